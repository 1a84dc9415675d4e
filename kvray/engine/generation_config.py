"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies
them (``--generation-config auto``): a request that leaves ``temperature`` (or ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, ``max_tokens``) unset gets the model
author's value instead of OpenAI's default. Qwen and Llama instruct checkpoints ship such
values (e.g. temperature 0.6, top_p 0.9); serving them without would sample differently
from vLLM on the same request."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvray.sampling_params import SamplingParams

logger = logging.getLogger("kvray")

# generation_config.json key -> SamplingParams field, with the value transformers takes
# when the key is absent (vLLM applies only values that differ from these)
_KEYS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0),
         "top_k": ("top_k", 50), "min_p": ("min_p", None),
         "repetition_penalty": ("repetition_penalty", 1.0),
         "max_new_tokens": ("max_tokens", None)}


def generation_defaults(source: str, model_path: str | Path,
                        overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults ``generation_config`` names: ``auto`` the model directory's
    ``generation_config.json`` (nothing for a GGUF file or a directory without one),
    ``vllm`` none (vLLM's and OpenAI's own defaults), else a directory holding that file;
    ``overrides`` (``override_generation_config``, the file's keys) laid over them. A file's
    values equal to transformers' defaults are not applied, as vLLM reads the file.
    ValueError naming the file and key when a value is not a valid sampling parameter."""
    data = _file_values(source, model_path)
    data.update(overrides or {})
    defaults = {field: data[key] for key, (field, _) in _KEYS.items()
                if data.get(key) is not None}
    where = "override_generation_config" if overrides else "generation_config"
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}; set generation_config: vllm to ignore the "
                         "model's file") from None
    if defaults:
        logger.info("kvray: default sampling parameters %s (generation_config %s; a "
                    "request's own values win)", defaults, source)
    return defaults


def _file_values(source: str, model_path: str | Path) -> dict[str, Any]:
    """The sampling keys of the generation_config.json ``source`` names whose values differ
    from transformers' defaults."""
    if source == "vllm":
        return {}
    folder = Path(model_path) if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config = {source!r}: no generation_config.json "
                             "there; give 'auto' (the model's), 'vllm' (none) or its folder")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"generation_config: cannot read {path} as JSON ({err}); set "
                         "generation_config: vllm to ignore it") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    values = {key: data[key] for key, (_, unset) in _KEYS.items()
              if data.get(key) is not None and data[key] != unset}
    try:
        SamplingParams(**{_KEYS[k][0]: v for k, v in values.items()})
    except (TypeError, ValueError) as err:
        raise ValueError(f"generation_config: {path}: {err}; set generation_config: vllm "
                         "to ignore the file") from None
    return values


def generation_eos_ids(source: str, model_path: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (one id or a list) of the model's generation_config.json (of the
    folder ``source`` names, if it names one): ids that end a sequence besides the
    tokenizer's EOS, read as vLLM reads them whatever ``source`` says about sampling
    defaults. Instruct checkpoints list their end-of-turn token there (Qwen2.5's
    ``<|im_end|>`` beside ``<|endoftext|>``, Phi-3's ``<|end|>``, Gemma's
    ``<end_of_turn>``); without it generation runs past the turn. () when there is none."""
    folder = Path(model_path) if source in ("auto", "vllm") else Path(source).expanduser()
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return ()
    ids = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list):
        return ()
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def generation_max_tokens_cap(source: str, overrides: dict[str, Any] | None,
                              defaults: dict[str, Any]) -> int | None:
    """The most tokens a served request may generate whatever it asks, as vLLM's server
    caps it: ``max_new_tokens`` of ``override_generation_config``, or of a generation
    config folder named by ``source``; the model's own file (``auto``) only sets the
    default of requests that leave ``max_tokens`` unset."""
    if source not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (overrides or {}).get("max_new_tokens")
