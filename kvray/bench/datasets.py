"""Benchmark workloads: random token prompts of chosen lengths, or ShareGPT conversations.

Both follow ``vllm bench serve``: random prompts are lengths drawn uniformly within
``range_ratio`` of a mean, made of random tokens after a shared random prefix; ShareGPT
takes each conversation's first human turn as the prompt and the reply's token count as the
output length, dropping pairs that are too short or too long the way vLLM does.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ShareGPT pairs vLLM keeps: both sides at least this many tokens, the prompt at most
# SHAREGPT_MAX_PROMPT and prompt plus reply at most SHAREGPT_MAX_TOTAL.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
_HUMAN_ROLES = ("human", "user")
_FIT_ROUNDS = 10  # decode/re-encode rounds to bring a random prompt to its length


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload."""

    prompt: str | list[int]  # text, or token ids (the completions endpoint only)
    prompt_len: int  # prompt tokens by the client's tokenizer, special tokens included
    output_len: int  # max_tokens to ask for


def load_tokenizer_for_bench(path: str | None) -> tuple[Any, str]:
    """The tokenizer at ``path`` (a local Hugging Face directory or ``.gguf`` file; the
    built-in model's when None) and the id to report for it. Nothing is downloaded."""
    from kvray.tokenizer import load_tokenizer

    if path is None:
        from kvray.models.default_model import DEFAULT_MODEL_NAME, default_model_dir

        if not default_model_dir().is_dir():
            raise ValueError(
                "--tokenizer: not given, and the built-in model's tokenizer is not set up "
                f"under {default_model_dir()}; pass --tokenizer PATH (a local Hugging Face "
                "directory or .gguf file) or run `kvray setup` once")
        return load_tokenizer(default_model_dir(), default_model_dir()), DEFAULT_MODEL_NAME
    local = Path(path).expanduser()
    if not local.exists():
        raise FileNotFoundError(f"--tokenizer {path}: no such file or directory (a local "
                                "Hugging Face directory or .gguf file; nothing is downloaded)")
    try:
        if local.suffix == ".gguf":
            return load_tokenizer(local), path
        return load_tokenizer(local, local), path
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer from it ({err})") from err


def length_range(mean: int, range_ratio: float, at_least: int = 0) -> tuple[int, int]:
    """Inclusive bounds a length is drawn from: ``mean * (1 - r)`` rounded down to
    ``mean * (1 + r)`` rounded up, the low end raised to ``at_least``."""
    low = max(math.floor(mean * (1 - range_ratio)), at_least)
    return low, max(math.ceil(mean * (1 + range_ratio)), low)


def text_tokens(tokenizer: Any) -> list[int]:
    """Token ids that decode on their own to printable text and re-encode to themselves:
    random prompts built from them survive the decode/encode round trip nearly intact
    (a byte-level token alone decodes to U+FFFD, which re-encodes as several tokens)."""
    specials = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in specials]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    good = [i for i, text, enc in zip(ids, texts, encoded, strict=True)
            if text.strip() and "\ufffd" not in text and enc == [i]]
    return good if len(good) >= 16 else ids


def fit_to_length(tokenizer: Any, ids: list[int], target: int, vocab: list[int],
                  rng: random.Random) -> str:
    """Text of ``ids`` that re-encodes (without special tokens) to ``target`` tokens where a
    few rounds of truncating or padding with random ``vocab`` tokens get there: the
    tokens of decoded text can merge or split at their seams."""
    text = tokenizer.decode(ids)
    for _ in range(_FIT_ROUNDS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = ids[:target] + [rng.choice(vocab) for _ in range(target - len(ids))]
        text = tokenizer.decode(ids)
    return text


def sample_random(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0,
                  seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` prompts of random tokens: ``prefix_len`` shared ones, then a length
    drawn from :func:`length_range` of ``input_len`` (less the special tokens the tokenizer
    adds, so the server sees about ``input_len + prefix_len``); output lengths likewise."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio {range_ratio}: must be in [0, 1)")
    rng = random.Random(seed)
    vocab = text_tokens(tokenizer)
    body_low, body_high = length_range(
        max(input_len - tokenizer.num_special_tokens_to_add(), 0), range_ratio)
    if prefix_len + body_low < 1:
        raise ValueError(f"--random-input-len {input_len}: prompts could be empty; raise it "
                         "or --random-prefix-len")
    out_low, out_high = length_range(output_len, range_ratio, at_least=1)
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]
    requests = []
    for _ in range(num_prompts):
        body_len = rng.randint(body_low, body_high)
        body = [rng.choice(vocab) for _ in range(body_len)]
        text = fit_to_length(tokenizer, prefix + body, prefix_len + body_len, vocab, rng)
        requests.append(SampleRequest(text, len(tokenizer(text)["input_ids"]),
                                      rng.randint(out_low, out_high)))
    return requests


def keep_sharegpt_pair(prompt_len: int, output_len: int, fixed_output: bool = False) -> bool:
    """vLLM's filter: neither side too short (the output unless its length is fixed),
    the prompt and the whole not too long."""
    return (prompt_len >= SHAREGPT_MIN_LEN
            and (fixed_output or output_len >= SHAREGPT_MIN_LEN)
            and prompt_len <= SHAREGPT_MAX_PROMPT
            and prompt_len + output_len <= SHAREGPT_MAX_TOTAL)


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply after it) of each conversation in a ShareGPT JSON
    file; conversations without both are skipped."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--dataset-path {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file ({err})") from err
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of "
                         "{\"conversations\": [{\"from\": ..., \"value\": ...}, ...]}")
    return [pair for entry in data if (pair := _first_exchange(entry)) is not None]


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") in _HUMAN_ROLES:
            prompt, answer = turn.get("value"), reply.get("value")
            ok = isinstance(prompt, str) and isinstance(answer, str)
            return (prompt, answer) if ok and reply.get("from") not in _HUMAN_ROLES else None
    return None


def sample_sharegpt(tokenizer: Any, path: str | Path, num_prompts: int, seed: int = 0,
                    output_len: int | None = None) -> list[SampleRequest]:
    """``num_prompts`` ShareGPT requests in a seeded random order, each asking for as many
    tokens as its reply has (or ``output_len``); repeated at random when the file has too
    few usable conversations, as vLLM does."""
    pairs = read_sharegpt(path)
    random.Random(seed).shuffle(pairs)
    picked: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(picked) == num_prompts:
            break
        prompt_len = len(tokenizer(prompt)["input_ids"])
        want = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if keep_sharegpt_pair(prompt_len, want, fixed_output=output_len is not None):
            picked.append(SampleRequest(prompt, prompt_len, want))
    if not picked:
        raise ValueError(f"--dataset-path {path}: none of its {len(pairs)} conversations has "
                         f"a first human turn and reply of {SHAREGPT_MIN_LEN}.."
                         f"{SHAREGPT_MAX_PROMPT} tokens")
    rng = random.Random(seed + 1)
    usable = list(picked)
    picked += [rng.choice(usable) for _ in range(num_prompts - len(picked))]
    return picked
