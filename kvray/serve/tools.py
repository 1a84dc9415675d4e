"""Tool calling on /v1/chat/completions: the constraint ``tool_choice`` implies, and the
model's text turned into OpenAI ``tool_calls``, whole or streamed.

- ``tool_choice="required"``: the output is constrained (structured outputs) to a JSON array
  of ``{"name": <one of the tools>, "parameters": <that tool's schema>}``, one item unless
  ``parallel_tool_calls``; each item becomes a call. A named function: the output is
  constrained to its parameters' schema and is the call's arguments.
- ``"auto"``: the model writes freely; a parser for its family finds the calls: ``hermes``
  (Qwen2/2.5/3, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) or
  ``llama3_json`` (Llama 3.x: ``{"name": ..., "parameters": {...}}``, several joined by
  ``;``, maybe after ``<|python_tag|>``). ``"none"``: no calls are ever parsed.

Streaming: :class:`ToolCallStreamer` turns text deltas into OpenAI deltas as the text
arrives: content outside the calls as ``content``; per call first a delta with its index,
id, type and name, then its arguments' raw JSON text in pieces, as OpenAI streams them.
A small incremental JSON scanner (:class:`_CallScanner`) finds the name and the arguments'
extent without waiting for the whole object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def pick_parser(requested: str, chat_template: str | None) -> str:
    """``auto``: ``llama3_json`` for a template that speaks Llama 3's tool format, else
    ``hermes`` (Qwen's, Hermes', and the usual default)."""
    if requested != "auto":
        return requested
    template = chat_template or ""
    if _PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    return "hermes"


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """JSON schema of ``tool_choice="required"``'s output: an array of calls."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["name"]},
                             "parameters": t.get("parameters") or {"type": "object"}}}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], _args_text(args))


def parse_tool_calls(text: str, mode: str, parser: str, named: str | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. ``mode``: the request's tool_choice kind
    (``none``, ``auto``, ``required``, ``named``). Text that does not parse stays content."""
    if mode == "none":
        return text, []
    if mode == "named":
        return None, [ToolCall(named or "", text)]
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in (_call_of(i, ("parameters", "arguments")) for i in items) if c] \
            if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if parser == "llama3_json":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in re.findall(re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE)
                           + r"|$)", text[start:], flags=re.DOTALL):
        try:
            call = _call_of(json.loads(body.strip()), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


class _CallScanner:
    """Reads JSON text a piece at a time and reports, for each call object at ``depth``
    (1: top-level objects; 2: objects inside a top-level array), its ``name`` once the
    string is complete and the raw text of its arguments value (under ``args_keys``) as it
    arrives. Strings and escapes are tracked so braces inside strings do not count."""

    def __init__(self, depth: int, args_keys: tuple[str, ...]) -> None:
        self.depth = depth
        self.args_keys = args_keys
        self.stack: list[str] = []  # "{" / "["
        self.in_string = self.escape = False
        self.string = ""  # the string being read (keys and the name)
        self.expect_key = False
        self.key: str | None = None  # last key read at the call level
        self.capture: str | None = None  # "name" / "args" while reading that value
        self.args_depth = 0
        self.events: list[tuple[str, str]] = []  # ("start"|"name"|"args"|"end", text)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.events = []
        args = []
        for ch in text:
            if self.capture == "args" and self._args_char(ch):
                args.append(ch)
                continue
            self._flush(args)
            self._char(ch)
        self._flush(args)
        return self.events

    def _flush(self, args: list[str]) -> None:
        if args:
            self.events.append(("args", "".join(args)))
            args.clear()

    def _args_char(self, ch: str) -> bool:
        """Whether ``ch`` belongs to the arguments value being captured."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.args_depth == 0:  # the value was a string
                    self.capture = "args_done"
            return True
        if ch == '"':
            self.in_string = True
            return True
        if ch in "{[":
            self.args_depth += 1
            return True
        if ch in "}]":
            if self.args_depth == 0:  # closes the call object: the value ended before
                self.capture = None
                return False
            self.args_depth -= 1
            if self.args_depth == 0:
                self.capture = "args_done"
            return True
        if ch == "," and self.args_depth == 0:
            self.capture = None
            return False
        return not (ch.isspace() and self.args_depth == 0)  # not around a scalar value

    def _char(self, ch: str) -> None:
        if self.capture == "args_done":
            self.capture = None
        if self.in_string:
            if self.escape:
                self.escape = False
                self.string += ch
            elif ch == "\\":
                self.escape = True
                self.string += ch
            elif ch == '"':
                self.in_string = False
                self._string_done()
            else:
                self.string += ch
            return
        level = len(self.stack)
        if ch == '"':
            self.in_string, self.string = True, ""
        elif ch in "{[":
            self.stack.append(ch)
            if ch == "{" and len(self.stack) == self.depth:
                self.events.append(("start", ""))
                self.expect_key, self.key = True, None
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
            if ch == "}" and level == self.depth:
                self.events.append(("end", ""))
        elif ch == ":" and level == self.depth and self.key is not None:
            self.expect_key = False
            if self.key in self.args_keys:
                self.capture, self.args_depth = "args", 0
        elif ch == "," and level == self.depth:
            self.expect_key, self.key = True, None

    def _string_done(self) -> None:
        if len(self.stack) != self.depth:
            return
        if self.expect_key:
            try:
                self.key = json.loads(f'"{self.string}"')
            except ValueError:
                self.key = self.string
        elif self.key == "name":
            try:
                self.events.append(("name", json.loads(f'"{self.string}"')))
            except ValueError:
                self.events.append(("name", self.string))


class ToolCallStreamer:
    """Text deltas of one choice in, OpenAI chat deltas out (see the module docstring)."""

    def __init__(self, mode: str, parser: str, named: str | None = None) -> None:
        self.mode, self.parser, self.named = mode, parser, named
        self.calls: list[dict] = []  # per call: {"id", "name", "args", "sent_header"}
        self.pending_args = ""  # arguments seen before the name (rare key order)
        self.held = ""  # content held back: it may be the start of a tag
        self.in_call = False
        self.started = False
        self.scanner: _CallScanner | None = None
        if mode == "required":
            self.scanner = _CallScanner(2, ("parameters", "arguments"))
            self.in_call = True

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict]:
        """Deltas for ``text``; ``finish`` flushes what is held back."""
        if self.mode == "none" or not text:
            return [{"content": text}] if text else []
        if self.mode == "named":
            out = []
            if not self.calls:
                self.calls.append({"id": new_call_id(), "name": self.named})
                out.append(self._header(0, self.named, ""))
            out.append(self._args(0, text))
            return out
        if self.mode == "required":
            return self._scan(text)
        if self.parser == "llama3_json":
            return self._feed_llama3(text)
        return self._feed_hermes(text)

    def finish(self) -> list[dict]:
        held, self.held = self.held, ""
        if held and not self.in_call:
            return [{"content": held}]
        return []

    def _feed_hermes(self, text: str) -> list[dict]:
        out: list[dict] = []
        buf = self.held + text
        self.held = ""
        while buf:
            if self.in_call:
                end = buf.find(_HERMES_CLOSE)
                body, buf = (buf, "") if end < 0 else (buf[:end], buf[end + len(_HERMES_CLOSE):])
                out += self._scan(body)
                if end >= 0:
                    self.in_call, self.scanner = False, None
                continue
            start = buf.find(_HERMES_OPEN)
            if start >= 0:
                if buf[:start]:
                    out.append({"content": buf[:start]})
                buf = buf[start + len(_HERMES_OPEN):]
                self.in_call, self.scanner = True, _CallScanner(1, ("arguments", "parameters"))
                continue
            keep = _partial_suffix(buf, _HERMES_OPEN)
            if buf[:len(buf) - keep]:
                out.append({"content": buf[:len(buf) - keep]})
            self.held = buf[len(buf) - keep:]
            break
        return out

    def _feed_llama3(self, text: str) -> list[dict]:
        if self.in_call:
            return self._scan(text)
        buf = self.held + text
        self.held = ""
        stripped = buf.lstrip()
        if not stripped or _PYTHON_TAG.startswith(stripped):
            self.held = buf  # cannot tell yet
            return []
        if stripped.startswith(_PYTHON_TAG):
            stripped = stripped[len(_PYTHON_TAG):]
        if stripped.lstrip().startswith("{") and not self.started:
            self.in_call = True
            self.scanner = _CallScanner(1, ("parameters", "arguments"))
            return self._scan(stripped)
        self.started = True
        self.mode = "none"  # plain text: no calls in this output
        return [{"content": buf}]

    def _scan(self, text: str) -> list[dict]:
        out = []
        for kind, value in self.scanner.feed(text):
            if kind == "start":
                self.calls.append({"id": new_call_id(), "name": None})
                self.pending_args = ""
            elif not self.calls:
                continue
            elif kind == "name":
                call = self.calls[-1]
                call["name"] = value
                out.append(self._header(len(self.calls) - 1, value, self.pending_args))
                self.pending_args = ""
            elif kind == "args":
                if self.calls[-1]["name"] is None:
                    self.pending_args += value
                else:
                    out.append(self._args(len(self.calls) - 1, value))
        return out

    def _header(self, index: int, name: str, args: str) -> dict:
        return {"tool_calls": [{"index": index, "id": self.calls[index]["id"],
                                "type": "function",
                                "function": {"name": name, "arguments": args}}]}

    @staticmethod
    def _args(index: int, text: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

