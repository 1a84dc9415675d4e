"""Hostile requests the HTTP API is fuzzed with, in process and through a real server: JSON
literals Python cannot write (NaN, 1e999), lone surrogates, absurd sizes, and the hypothesis
settings every fuzz run uses."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, Phase, settings

POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
              "/rerank", "/score", "/tokenize", "/detokenize")


def fuzz_settings(max_examples: int) -> settings:
    """Reproducible hypothesis settings: derandomized, no database, no shrinking."""
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], print_blob=False,
                    suppress_health_check=list(HealthCheck))


SMALL = 8  # generated max_tokens / n above this are cut down, so that requests finish fast


def keep_cheap(body: Any) -> None:
    """Cut a generated body's max_tokens and n down to :data:`SMALL`, in place."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > SMALL:
            body[key] = SMALL
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = SMALL  # else the whole context is the limit
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > SMALL:
        body["n"] = SMALL


class Raw:
    """A JSON literal Python's json cannot write: NaN, Infinity, 1e999, ..."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


CONTENT_PARTS = [[{"type": "image_url", "image_url": {"url": "x"}}],
                 [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "x"}],
                 [{"type": "text", "text": 5}], [{"type": "text"}], [{"type": 1}], [{}],
                 ["str"], [None], [{"type": "text", "text": "\ud800"}],
                 [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]]


def dumps(body: Any) -> bytes:
    """JSON text as Python writes it (ASCII: a lone surrogate becomes ``\\ud800``), with
    :class:`Raw` literals put in verbatim."""
    raws: list[Raw] = []

    def default(o):
        if isinstance(o, Raw):
            raws.append(o)
            return f"@@RAW{len(raws) - 1}@@"
        raise TypeError(type(o))

    text = json.dumps(body, default=default)
    for i, r in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', r.text)
    return text.encode()


EXPLICIT = [  # the cases named in the brief, always tried first
    {"prompt": "x", "temperature": Raw("NaN")}, {"prompt": "x", "temperature": Raw("1e999")},
    {"prompt": "x", "temperature": Raw("Infinity")}, {"prompt": "x", "n": 100_000},
    {"prompt": "x", "n": 10**30}, {"prompt": "x", "max_tokens": 10**30},
    {"prompt": "x", "max_tokens": -1}, {"prompt": "\ud800"}, {"prompt": "x", "stop": "\ud800"},
    {"prompt": "x", "model": "\ud800"}, {"prompt": "x", "user": "\ud800"},
    {"prompt": "x", "stop": ["x"] * 10_000}, {"prompt": "x", "stop": "s" * 100_000},
    {"prompt": "x", "logit_bias": {"abc": 1}}, {"prompt": "x", "logit_bias": {"1": 1e30}},
    {"prompt": "x", "logit_bias": {"99999999999999999999": 1}}, {"prompt": []},
    {"prompt": [10**30]}, {"prompt": [-1]}, {"prompt": "x", "seed": 2**64},
    {"prompt": "x", "n": 256, "max_tokens": 2}, {"prompt": [[1, 2]] * 300, "max_tokens": 1},
    {"prompt": "x", "priority": 10**30}, {"prompt": "x", "top_k": 10**30},
    {"prompt": "x", "stream": True, "max_tokens": 3, "n": 2, "logprobs": 2},
    {"messages": [{"content": "hi"}]}, {"messages": [{"role": 1, "content": "hi"}]},
    {"messages": [{"role": "user", "content": "\ud800"}]}, {"messages": []},
    {"messages": [{"role": "user", "content": CONTENT_PARTS[0]}]},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**30},
    {"messages": [{"role": "tool", "content": "hi"}]},
    {"messages": [{"role": "assistant", "content": "hi"}] * 3},
    {"prompt": [[5, 6, 7], [8]], "echo": True, "logprobs": 5, "max_tokens": 3, "n": 2},
    {"prompt": ["ab", "cd"], "stream": True, "echo": True, "stop": ["w", " "],
     "include_stop_str_in_output": True, "stream_options": {"include_usage": True},
     "max_tokens": 4, "logprobs": 1},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 3, "seed": 1,
     "logprobs": True, "top_logprobs": 20, "max_completion_tokens": 4,
     "stream_options": {"include_usage": True}},
    {"prompt": "x", "min_tokens": 3, "max_tokens": 3, "ignore_eos": True,
     "stop_token_ids": [0, 1, 2], "logit_bias": {"5": 100, "6": -100}},
    {"input": "x", "max_output_tokens": 10**30}, {"input": []}, {"input": "\ud800"},
    {"input": [{"type": "input_image"}]}, {"input": "x", "previous_response_id": "resp_1"},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"input": "x", "text": {"format": {"type": "json_schema"}}},
    {"input": "x", "tools": [{"type": "web_search"}]}, {"input": [{"type": "function_call"}]},
    {"input": ["x"] * 10_000}, {"input": [[10**30]]}, {"input": "x", "dimensions": 10**30},
    {"input": "x", "encoding_format": "base64", "dimensions": 3}, {"input": [[]]},
    {"query": "q", "documents": ["d"] * 10_000}, {"query": "\ud800", "documents": ["d"]},
    {"query": "q", "documents": [{"text": 5}]}, {"query": "q", "documents": ["a"], "top_n": -1},
    {"text_1": ["a"] * 3, "text_2": ["b"] * 2}, {"text_1": "a", "text_2": []},
    {"input": "x", "stream": True, "max_output_tokens": 3, "tool_choice": "required",
     "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]},
    {"tokens": [10**30]}, {"tokens": [-1]}, {"tokens": [2**63]}, {"tokens": ["a"]},
    {"messages": [{"role": "user", "content": "\ud800"}], "prompt": 5},
]
