"""What a response of the HTTP API must not be: a 5xx, an error that is not OpenAI's error
JSON, or text that leaks the server's insides (tracebacks, paths, pids, addresses, actor
ids). Findings are collected per distinct failure and reported once."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

LEAKS = [
    ("traceback", re.compile(r"Traceback")),
    ("source location", re.compile(r'File "|\.py"|\.py\'|\.py:\d|line \d+, in ')),
    ("pid", re.compile(r"\bpid=", re.IGNORECASE)),
    ("IP address", re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b")),
    ("filesystem path", re.compile(r"/work/|/tmp/|/usr/|/home/|/root/|/opt/|site-packages")),
    ("ray internals", re.compile(r"ActorID|actor_id|ObjectRef|RayTaskError|ray::")),
    ("memory address", re.compile(r"\b0x[0-9a-fA-F]{8,}\b")),
    # a 32+ hex run with a letter in it, except a response id (cmpl-/chatcmpl-/embd-/
    # score-/rerank-/pool-/classify-<uuid hex>; resp_/msg_/fc_/rs_ ids have no word
    # boundary before it)
    ("hex id", re.compile(r"(?<!cmpl-)(?<!embd-)(?<!score-)(?<!rerank-)(?<!pool-)"
                          r"(?<!classify-)\b(?=[0-9]*[a-fA-F])[0-9a-fA-F]{32,}\b")),
]
# Generated or echoed text in a successful response is content, not a leak.
CONTENT_KEYS = {"text", "content", "token", "tokens", "top_logprobs", "prompt", "bytes"}


def _strings(obj: Any, skip: set[str] = frozenset()) -> list[str]:
    """Every string (keys too) in a JSON value, but not under a key in ``skip``."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, list):
        return [s for x in obj for s in _strings(x, skip)]
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            if k in skip:
                continue
            out.append(str(k))
            out.extend(_strings(v, skip))
        return out
    return []


def _sent_strings(body: Any, raw: bytes) -> list[str]:
    """What the client sent, as it may come back in an error message."""
    sent = {raw.decode("utf-8", "replace")}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            sent.add(repr(x))
            for v in x:
                walk(v)
        elif isinstance(x, str | int | float) and not isinstance(x, bool):
            sent.update({str(x), repr(x), repr(x)[1:-1], json.dumps(x)})

    walk(body)
    return [s for s in sent if s]


def _leaks(text: str, sent: list[str]) -> list[str]:
    """Leak patterns in ``text``, but not a match that is the client's own input echoed."""
    found = []
    for name, rx in LEAKS:
        for m in rx.finditer(text):
            if not any(m.group(0) in s for s in sent):
                found.append(f"{name}: {m.group(0)!r}")
                break
    return found


def _error_shape_problem(body: Any, status: int) -> str | None:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(
            body["error"], dict):
        return "error body is not {'error': {...}}"
    err = body["error"]
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error lacks {sorted(missing)}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "error message/type not strings"
    if err["param"] is not None and not isinstance(err["param"], str):
        return "error param neither null nor a string"
    if not isinstance(err["code"], int) or isinstance(err["code"], bool):
        return "error code not an int"
    if err["code"] != status:
        return f"error code {err['code']} != HTTP status {status}"
    return None


RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _responses_event_problems(events: list[Any]) -> list[str]:
    """A Responses event stream: numbered 0, 1, ... in order; no server error in it."""
    problems = []
    numbers = [ev.get("sequence_number") for ev in events if isinstance(ev, dict)]
    if numbers != list(range(len(numbers))):
        problems.append("Responses events are not numbered 0, 1, ...")
    for ev in events:
        if isinstance(ev, dict) and ev.get("type") == "error":
            code = str(ev.get("code"))
            if code.isdigit() and int(code) >= 500:
                problems.append(f"in-stream error {code}")
    return problems


def response_problems(status: int, content_type: str, content: bytes, body: Any,
                      raw: bytes, cut_short: bool = False) -> list[str]:
    """Everything wrong with one response to a request (``body`` as sent, ``raw`` its bytes;
    ``cut_short``: the client read only the start of an event stream)."""
    problems = []
    if status >= 500:
        problems.append(f"HTTP {status}")
    text = content.decode("utf-8", "replace")
    events: list[Any] = []
    if "text/event-stream" in content_type:
        for line in text.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    events.append(json.loads(line.removeprefix("data: ")))
                except ValueError:
                    problems.append(f"SSE event is not JSON: {line[:80]!r}")
        kinds = [ev.get("type") for ev in events if isinstance(ev, dict)]
        if kinds and kinds[0] == "response.created":  # the Responses API's events
            if not cut_short and kinds[-1] not in RESPONSES_TERMINAL:
                problems.append(f"Responses stream ends with {kinds[-1]!r}")
            problems += _responses_event_problems(events)
        elif not cut_short and not text.endswith("data: [DONE]\n\n"):
            problems.append("event stream does not end with [DONE]")
    else:
        try:
            events.append(json.loads(text))
        except ValueError:
            events.append(text)  # /metrics, /health: scan the text as it is
            if status >= 400:
                problems.append("error body is not JSON")
    sent = _sent_strings(body, raw)
    for ev in events:
        is_error = status >= 400 or (isinstance(ev, dict) and ev.get("error") is not None)
        if is_error and isinstance(ev, dict):
            code = (ev.get("error") or {}).get("code") if isinstance(ev.get("error"),
                                                                      dict) else None
            if status < 400 and isinstance(code, int) and code >= 500:
                problems.append(f"in-stream error {code}")
            shape = _error_shape_problem(ev, status if status >= 400 else code)
            if shape:
                problems.append(shape)
        scanned = "\n".join(_strings(ev, set() if is_error else CONTENT_KEYS))
        problems += [f"leak ({x})" for x in _leaks(scanned, sent if is_error else [])]
    return problems


@dataclass
class Findings:
    by_key: dict[tuple, tuple[int, str]] = field(default_factory=dict)

    def add(self, endpoint: str, status: int, problems: list[str], request: str,
            response: str) -> None:
        msg = response
        with contextlib.suppress(ValueError, KeyError, TypeError):
            msg = json.loads(response)["error"]["message"]
        shape = re.sub(r"'[^']*'|\"[^\"]*\"|-?\d+(\.\d+)?(e[-+]?\d+)?", "_", str(msg))[:60]
        key = (endpoint, status, tuple(p.split(":")[0] for p in problems), shape)
        line = (f"{endpoint} {status} {problems}\n    request:  {request[:300]}\n"
                f"    response: {response[:400]}")
        if key not in self.by_key or len(request) < self.by_key[key][0]:
            self.by_key[key] = (len(request), line)

    def report(self) -> str:
        return (f"{len(self.by_key)} distinct failure(s):\n"
                + "\n".join(line for _, line in self.by_key.values()))
