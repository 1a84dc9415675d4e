"""Locate a local model and load its tokenizer, without importing torch.

The engine core needs the tokenizer (to tokenize prompts and detokenize outputs) but never
the weights: those live in the workers. Loading is local only; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def check_model_path(path: str | Path) -> Path:
    """Return ``path`` as a Path if it is a ``.gguf`` file or a Hugging Face directory
    (with ``config.json``); else raise FileNotFoundError saying what to pass instead."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; pass a local Hugging Face directory or a "
            ".gguf file (kvray never downloads weights), or omit it for the built-in model")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory (no config.json); pass a local "
            "directory or a .gguf file — kvray never downloads weights")
    return path


def open_gguf(path: Path) -> Any:
    """The ``gguf`` package's reader of the file at ``path``; a ValueError naming the file
    when kvray cannot read it: not a GGUF, truncated, or big-endian (its blocks' bytes read
    in this machine's order would be garbage, NaNs at the first step)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, OSError, KeyError) as err:  # truncated or not a GGUF
        raise ValueError(f"{path.name} is not a readable GGUF file (truncated or corrupt: "
                         f"{str(err)[:120]})") from None
    if reader.byte_order != "I":
        raise ValueError(f"{path.name} is a big-endian GGUF; kvray reads little-endian ones "
                         f"(llama.cpp's gguf_convert_endian.py {path.name} little converts it)")
    return reader


def _check_gguf_tokenizer(path: Path) -> None:
    """A ValueError saying why transformers could not read the tokenizer of the GGUF file at
    ``path``, where kvray can tell: the file is unreadable (:func:`open_gguf`) or holds no
    tokenizer. Read only after transformers failed: parsing a file's metadata takes seconds."""
    if path.is_file() and "tokenizer.ggml.model" not in open_gguf(path).fields:
        raise ValueError(f"{path.name} holds no tokenizer (no tokenizer.ggml.* metadata): "
                         "pass `tokenizer`, a Hugging Face tokenizer directory, or run "
                         "token ids alone with skip_tokenizer_init")


@contextmanager
def transformers_errors(where: str | Path) -> Iterator[None]:
    """Turn transformers' own failures reading the model files at ``where`` (a config.json
    failing its checks raises KeyError or a dataclass error from deep inside it) into a
    ValueError naming the place and why; missing files stay OSErrors."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        raise ValueError(f"{where}: transformers cannot read its config or tokenizer "
                         f"({type(err).__name__}: {err})") from None


def load_tokenizer(model_path: str | Path, tokenizer_path: str | Path | None = None,
                   chat_template: str | None = None) -> Any:
    """The tokenizer at ``tokenizer_path`` if given, else the model's own: a Hugging Face
    directory's files, or the tokenizer (with chat template) embedded in a GGUF file.
    ``chat_template`` (the template text) replaces the tokenizer's own. A directory
    transformers cannot read (its config.json fails transformers' own checks, e.g. a rope
    dict missing a key) is a ValueError naming it and why; so is a GGUF file kvray cannot
    read (:func:`open_gguf`) or one without a tokenizer."""
    try:
        with transformers_errors(tokenizer_path if tokenizer_path is not None else model_path):
            tokenizer = _load(model_path, tokenizer_path)
    except (ValueError, OSError):
        if tokenizer_path is None and Path(model_path).suffix == ".gguf":
            _check_gguf_tokenizer(Path(model_path))  # kvray's words for why, if it can tell
        raise
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _load(model_path: str | Path, tokenizer_path: str | Path | None) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_path is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
    path = check_model_path(model_path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                             local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
