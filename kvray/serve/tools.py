"""Tool calling on /v1/chat/completions: the constraint ``tool_choice`` implies, and the
model's text turned into OpenAI ``tool_calls``, whole or streamed.

- ``tool_choice="required"``: the output is constrained (structured outputs) to a JSON array
  of ``{"name": <one of the tools>, "parameters": <that tool's schema>}``, one item unless
  ``parallel_tool_calls``; each item becomes a call. A named function: the output is
  constrained to its parameters' schema and is the call's arguments.
- ``"auto"``: the model writes freely; a parser for its family finds the calls: ``hermes``
  (Qwen2/2.5/3, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  ``llama3_json`` (Llama 3.x: ``{"name": ..., "parameters": {...}}``, several joined by
  ``;``, maybe after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]`` and a JSON array of
  calls, or ``[TOOL_CALLS]name[ARGS]{...}`` per call), ``pythonic`` (Llama 3.2/4:
  ``[get_weather(city="Paris"), ...]``, maybe in ``<|python_start|>``...``<|python_end|>``)
  or ``qwen3_coder`` (Qwen3-Coder: ``<function=NAME><parameter=KEY>value</parameter>...``,
  values typed by the tool's schema). ``"none"``: no calls are ever parsed.

Streaming: :class:`ToolCallStreamer` turns text deltas into OpenAI deltas as the text
arrives: content outside the calls as ``content``; per call first a delta with its index,
id, type and name, then its arguments' raw JSON text in pieces, as OpenAI streams them.
A small incremental JSON scanner (:class:`_CallScanner`) finds the name and the arguments'
extent without waiting for the whole object. The mistral, pythonic and qwen3_coder formats
are each one incremental scanner (text in; content, call names and argument pieces out);
their whole-text parse is that scanner fed the whole text, so both agree however the text
is cut.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_QWEN_FUNC, _QWEN_FUNC_END = "<function=", "</function>"
_QWEN_PARAM, _QWEN_PARAM_END = "<parameter=", "</parameter>"
# Llama 3.2's pythonic prompt: "... in the format of [func_name1(params_name1=params_value1,"
_PYTHONIC_INSTRUCTION = re.compile(r"\[\s*func_name\w*\s*\(\s*params?_name\w*\s*=")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = string.ascii_letters + string.digits

# What a format scanner reads: ("content", text, None), ("name", name, the model's call id
# or None) opening a call, ("args", a piece of the open call's arguments' JSON text, None).
Event = tuple[str, str, str | None]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """A call id of Mistral's shape, 9 letters and digits: its chat templates reject others
    when the conversation comes back with the call in it."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _id_maker(parser: str) -> Callable[[], str]:
    return new_mistral_call_id if parser == "mistral" else new_call_id


def pick_parser(requested: str, chat_template: str | None) -> str:
    """The parser ``tool_call_parser`` names; ``auto`` reads the chat template: ``mistral``
    where it writes ``[TOOL_CALLS]``, ``qwen3_coder`` for ``<function=``/``<parameter=``
    XML, ``pythonic`` for ``<|python_start|>`` or a prompt asking for
    ``[func_name1(params_name1=...)]``, ``llama3_json`` for Llama 3's JSON format, else
    ``hermes`` (Qwen's, Hermes', and the usual default)."""
    if requested != "auto":
        if requested not in PARSERS:
            raise ValueError(f"tool_call_parser: unknown parser {requested!r}; expected auto "
                             f"or one of {', '.join(PARSERS)}")
        return requested
    template = chat_template or ""
    if _MISTRAL_TAG in template:
        return "mistral"
    if _QWEN_FUNC in template and _QWEN_PARAM in template:
        return "qwen3_coder"
    if _PY_START in template or _PYTHONIC_INSTRUCTION.search(template):
        return "pythonic"
    if _PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    return "hermes"


def keeps_special_tokens(parser: str) -> bool:
    """Whether ``parser`` needs markers that are special tokens, which the detokenizer must
    then keep (``skip_special_tokens=False``): Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``.
    (Llama 4's ``<|python_start|>`` is one too, but a list without it parses all the same
    where it starts the output.)"""
    return parser == "mistral"


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


def _call_of(obj: Any, args_keys: tuple[str, ...],
             new_id: Callable[[], str] = new_call_id) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], _args_text(args), new_id())


def parse_tool_calls(text: str, mode: str, parser: str, named: str | None = None,
                     tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. ``mode``: the request's tool_choice kind
    (``none``, ``auto``, ``required``, ``named``). ``tools``: the request's tools (OpenAI's
    ``{"type": "function", "function": {...}}`` items or bare function specs), which
    ``qwen3_coder`` reads to type argument values (None: all strings). Text that does not
    parse stays content."""
    new_id = _id_maker(parser)
    if mode == "none":
        return text, []
    if mode == "named":
        return None, [ToolCall(named or "", text, new_id())]
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in (_call_of(i, ("parameters", "arguments"), new_id) for i in items)
                 if c] if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if parser in _SCANNERS:
        return _parse_with(_SCANNERS[parser](_param_schemas(tools)), text, new_id)
    if parser == "llama3_json":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _parse_with(scanner: _Scanner, text: str, new_id: Callable[[], str]
                ) -> tuple[str | None, list[ToolCall]]:
    """A whole output through its format's scanner: the calls whose arguments are complete
    JSON (one cut off mid-arguments is dropped) and the text around them as content."""
    content: list[str] = []
    found: list[list[Any]] = []  # [name, arguments, the model's id]
    for kind, value, call_id in scanner.feed(text) + scanner.finish():
        if kind == "content":
            content.append(value)
        elif kind == "name":
            found.append([value, "", call_id])
        elif found:
            found[-1][1] += value
    calls = [ToolCall(name, args, call_id or new_id())
             for name, args, call_id in found if _is_json(args)]
    if not calls:
        return text, []
    return "".join(content).strip() or None, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


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

    def __init__(self, mode: str, parser: str, named: str | None = None,
                 tools: list[dict] | None = None) -> None:
        """``tools``: the request's tools, as :func:`parse_tool_calls` takes them."""
        self.mode, self.parser, self.named = mode, parser, named
        self.new_id = _id_maker(parser)
        self.calls: list[dict] = []  # per call: {"id", "name"}
        self.pending_args = ""  # arguments seen before the name (rare key order)
        self.held = ""  # content held back: the start of a tag, or spaces (format scanners)
        self.in_call = False
        self.started = False
        self.scanner: _CallScanner | None = None
        self.format_scanner: _Scanner | None = None  # mistral, pythonic, qwen3_coder
        # Before any call (format scanners): the text in, the scanner's content out, how
        # much of the text went out as content, in order; content after text the scanner
        # dropped waits for a call (or, if none comes, the text goes out as it was).
        self.fed = self.content_seen = ""
        self.num_sent = 0
        self.deferred: list[str] | None = None
        if mode == "required":
            self.scanner = _CallScanner(2, ("parameters", "arguments"))
            self.in_call = True
        elif mode == "auto" and parser in _SCANNERS:
            self.format_scanner = _SCANNERS[parser](_param_schemas(tools))

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
                self.calls.append({"id": self.new_id(), "name": self.named})
                out.append(self._header(0, self.named, ""))
            out.append(self._args(0, text))
            return out
        if self.mode == "required":
            return self._scan(text)
        if self.format_scanner is not None:
            if not self.calls:
                self.fed += text
            return self._apply(self.format_scanner.feed(text))
        if self.parser == "llama3_json":
            return self._feed_llama3(text)
        return self._feed_hermes(text)

    def finish(self) -> list[dict]:
        out = self._apply(self.format_scanner.finish()) if self.format_scanner else []
        if self.format_scanner and not self.calls:
            # no call came: what the scanner took for one's start is content after all
            out += self._send_content(self.fed[self.num_sent:])
        held, self.held = self.held, ""
        if held and not self.in_call and not (self.format_scanner and self.calls):
            out.append({"content": held})  # (a format scanner's spaces around calls are not)
        return out

    def _apply(self, events: list[Event]) -> list[dict]:
        """The deltas of a format scanner's events. Content's trailing spaces wait for more
        content: spaces before, between or after calls are none."""
        out: list[dict] = []
        for kind, value, call_id in events:
            if kind == "content":
                out += self._content_event(value)
            elif kind == "name":
                if self.deferred:
                    out += self._send_content("".join(self.deferred))
                self.deferred = None
                self.calls.append({"id": call_id or self.new_id(), "name": value})
                out.append(self._header(len(self.calls) - 1, value, ""))
            elif self.calls:
                out.append(self._args(len(self.calls) - 1, value))
        return out

    def _content_event(self, text: str) -> list[dict]:
        if self.calls:
            return self._send_content(text)
        at = len(self.content_seen)
        self.content_seen += text
        if self.deferred is None and self.fed[at:at + len(text)] == text:
            self.num_sent = len(self.content_seen)
            return self._send_content(text)
        self.deferred = self.deferred or []  # (the scanner dropped text before this)
        self.deferred.append(text)
        return []

    def _send_content(self, text: str) -> list[dict]:
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return [{"content": body}] if body else []

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
                self.calls.append({"id": self.new_id(), "name": None})
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



def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Where the earliest of ``tags`` starts in ``text``, and which; (-1, "") if none does."""
    best = (-1, "")
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, tag)
    return best


def _split_at_tag(text: str, tags: tuple[str, ...]) -> tuple[str, str, str]:
    """(text before the earliest tag, the tag, text after it); with no tag: (the text that
    cannot be part of one, "", the end that may be a tag's start)."""
    i, tag = _first_tag(text, tags)
    if i >= 0:
        return text[:i], tag, text[i + len(tag):]
    keep = max(_partial_suffix(text, t) for t in tags)
    return text[:len(text) - keep], "", text[len(text) - keep:]


class _Scanner:
    """A tool-call format read a piece at a time: text in, events (:data:`Event`) out. A
    state is a method ``_<state>(out)`` that reads from ``buf``, appends events, and says
    whether it got anywhere (False: it waits for more text)."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas  # per tool: its parameters' schemas (qwen3_coder types values)
        self.state = "content"
        self.buf = ""  # text read and not yet turned into events

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self.buf and getattr(self, "_" + self.state)(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """The end of the output: a held tag start is content after all."""
        out: list[Event] = [("content", self.buf, None)] \
            if self.state == "content" and self.buf else []
        self.buf = ""
        return out


class _JsonExtent:
    """Where one JSON object or array ends, in text read a piece at a time (brackets inside
    strings do not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = self.done = False

    def feed(self, text: str) -> int:
        """How many leading characters of ``text`` belong to the value: all until it ends."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)


class _MistralScanner(_Scanner):
    """Mistral's calls, after content or not: ``[TOOL_CALLS]`` and a JSON array of
    ``{"name", "arguments"}`` objects (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B), or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+: Mistral Small 3.x, Devstral, Magistral;
    ``name[CALL_ID]id[ARGS]`` brings the model's own id). Text after a call is content; a
    call whose name is not a tool name is dropped with its arguments."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__(schemas)
        self.extent = _JsonExtent()  # where the array or the arguments object ends
        self.items = _CallScanner(2, ("arguments", "parameters"))  # the array's calls
        self.emit_args = False  # the open call (name[ARGS] form) has a valid name
        self.named = False  # array form: the object being read has had its name
        self.pending = ""  # array form: its arguments read before its name

    def _content(self, out: list[Event]) -> bool:
        text, tag, self.buf = _split_at_tag(self.buf, (_MISTRAL_TAG,))
        if text:
            out.append(("content", text, None))
        if tag:
            self.state = "head"
        return bool(tag)

    def _head(self, out: list[Event]) -> bool:
        """After the tag: ``[`` opens the array form; else a name up to the arguments."""
        head = self.buf.lstrip()
        if head.startswith("["):
            self.buf, self.state = head, "array"
            self.extent, self.items = _JsonExtent(), _CallScanner(2, self.items.args_keys)
            return True
        brace, tag = head.find("{"), head.find(_MISTRAL_TAG)
        if tag >= 0 and (brace < 0 or tag < brace):  # a name without arguments: dropped
            self.buf = head[tag + len(_MISTRAL_TAG):]
            return True
        if brace < 0:
            return False
        name, call_id = _mistral_head(head[:brace])
        if name is not None:
            out.append(("name", name, call_id))
        self.buf, self.state, self.extent = head[brace:], "args", _JsonExtent()
        self.emit_args = name is not None
        return True

    def _args(self, out: list[Event]) -> bool:
        n = self.extent.feed(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        if self.emit_args:
            out.append(("args", piece, None))
        if self.extent.done:
            self.state = "content"
        return True

    def _array(self, out: list[Event]) -> bool:
        n = self.extent.feed(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        for kind, value in self.items.feed(piece):
            if kind == "start":
                self.named, self.pending = False, ""
            elif kind == "name":
                out.append(("name", value, None))
                if self.pending:
                    out.append(("args", self.pending, None))
                self.named, self.pending = True, ""
            elif kind == "args" and self.named:
                out.append(("args", value, None))
            elif kind == "args":
                self.pending += value
        if self.extent.done:
            self.state = "content"
        return True


def _mistral_head(head: str) -> tuple[str | None, str | None]:
    """(name, the model's call id or None) of ``name[CALL_ID]id[ARGS]``; (None, None) if the
    name is not a tool name."""
    name, _, call_id = head.replace(_MISTRAL_ARGS, "").partition(_MISTRAL_CALL_ID)
    name, call_id = name.strip(), call_id.strip()
    if not _TOOL_NAME.fullmatch(name):
        return None, None
    return name, call_id if _MISTRAL_ID.fullmatch(call_id) else None


_PY_CALL = re.compile(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*(\()\s*(?:\)|[A-Za-z_]\w*\s*=)")
_PY_CALL_START = re.compile(r"\s*(?:[A-Za-z_][\w.]*\s*(?:\(\s*(?:[A-Za-z_]\w*\s*)?)?)?")
_PY_LIST_NEXT = re.compile(r"\s*([,\]])")


class _PythonicScanner(_Scanner):
    """Llama 3.2/4's Python list of calls, ``[f(a=1, b="x"), g()]``: the whole output, or
    after content inside ``<|python_start|>`` ... ``<|python_end|>``. Text that may still
    become a list is held back; text that turns out not to be one is content. A call's name
    goes out once ``name(`` and its first ``key=`` (or ``)``) are read; its arguments, Python
    literals read by ``ast.literal_eval`` and written as JSON, once its ``)`` is."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__(schemas)
        self.state = "lead"
        self.held = ""  # the tag and spaces before a list that may yet not be one
        self.tagged = False  # the list came after <|python_start|>
        self.step = "call"  # in the list: "call" | "args" | "next"
        self.pos = 0  # in the list: how far ``buf`` (the list's text) is read
        self.call_start = 0  # where the call being read starts in ``buf``
        self.extent = _PythonExtent(0)  # "args": where the call's parenthesis closes
        self.num_calls = 0  # calls named in this list

    def _lead(self, out: list[Event]) -> bool:
        """The output's start: a list, or content (where the tag may come)."""
        text = self.buf.lstrip()
        if text.startswith("["):
            return self._open_list(len(self.buf) - len(text), tagged=False)
        if not text:
            return False
        self.state = "content"
        return True

    def _content(self, out: list[Event]) -> bool:
        text, tag, self.buf = _split_at_tag(self.buf, (_PY_START,))
        if text:
            out.append(("content", text, None))
        if tag:
            self.held, self.state = tag, "tagged"
        return bool(tag)

    def _tagged(self, out: list[Event]) -> bool:
        text = self.buf.lstrip()
        if text.startswith("["):
            return self._open_list(len(self.buf) - len(text), tagged=True)
        return bool(text) and self._leave_list(out)

    def _open_list(self, spaces: int, tagged: bool) -> bool:
        self.held += self.buf[:spaces]
        self.buf, self.pos, self.step, self.num_calls = self.buf[spaces:], 1, "call", 0
        self.state, self.tagged = "list", tagged
        return True

    def _list(self, out: list[Event]) -> bool:
        if self.step == "call":
            return self._list_call(out)
        if self.step == "args":
            return self._list_args(out)
        return self._list_next(out)

    def _list_call(self, out: list[Event]) -> bool:
        match = _PY_CALL.match(self.buf, self.pos)
        if match is None:
            end = _PY_LIST_NEXT.match(self.buf, self.pos)
            if self.num_calls and end and end[1] == "]":  # a trailing comma
                return self._close_list(end.end())
            if _PY_CALL_START.fullmatch(self.buf, self.pos):
                return False
            return self._leave_list(out)
        out.append(("name", match[1], None))
        self.num_calls += 1
        self.call_start, self.pos = match.start(1), match.start(2)
        self.extent, self.step = _PythonExtent(self.pos), "args"
        return True

    def _list_args(self, out: list[Event]) -> bool:
        end = self.extent.end(self.buf)
        if end is None:
            return False
        args = _python_call_args(self.buf[self.call_start:end])
        if args is None:
            return self._leave_list(out)
        out.append(("args", args, None))
        self.pos, self.step = end, "next"
        return True

    def _list_next(self, out: list[Event]) -> bool:
        match = _PY_LIST_NEXT.match(self.buf, self.pos)
        if match is None:
            return bool(self.buf[self.pos:].strip()) and self._leave_list(out)
        if match[1] == "]":
            return self._close_list(match.end())
        self.pos, self.step = match.end(), "call"
        return True

    def _close_list(self, end: int) -> bool:
        self.buf, self.held, self.num_calls = self.buf[end:], "", 0
        self.state = "after" if self.tagged else "content"
        return True

    def _leave_list(self, out: list[Event]) -> bool:
        """Not a call list after all (before any call: all of it is content), or not one
        any more (from the call or separator that broke it on, the text is content)."""
        if self.num_calls == 0:
            if self.held:
                out.append(("content", self.held, None))
        else:
            self.buf = self.buf[self.call_start if self.step == "args" else self.pos:]
        self.held, self.state, self.num_calls = "", "content", 0
        return True

    def _after(self, out: list[Event]) -> bool:
        """After a tagged list: its ``<|python_end|>`` is no content."""
        text = self.buf.lstrip()
        if text.startswith(_PY_END):
            self.buf, self.state = text[len(_PY_END):], "content"
            return True
        if not text or _PY_END.startswith(text):
            return False
        self.state = "content"
        return True

    def finish(self) -> list[Event]:
        if self.state in ("lead", "content"):
            rest = self.buf
        elif self.state == "tagged" or (self.state == "list" and self.num_calls == 0):
            rest = self.held + self.buf
        else:  # a list cut off after some calls, or spaces after one
            rest = ""
        self.buf = self.held = ""
        return [("content", rest, None)] if rest else []


class _PythonExtent:
    """Where the bracket at ``text[start]`` closes, in text that grows a piece at a time:
    Python string literals (either quote, triple-quoted, with escapes) skipped. Each call
    reads on from where the last stopped."""

    def __init__(self, start: int) -> None:
        self.i = start  # the next character to read
        self.depth = 0
        self.quote = ""  # the open string's quote ("" outside strings)

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket; None if ``text`` does not close it yet."""
        i, n = self.i, len(text)
        while i < n:
            ch, rest = text[i], text[i:i + 3]
            if self.quote:
                if ch == "\\":
                    if i + 1 == n:
                        break  # the escaped character is still to come
                    i += 2
                elif text.startswith(self.quote, i):
                    i, self.quote = i + len(self.quote), ""
                elif n - i < len(self.quote) and self.quote.startswith(rest):
                    break  # maybe the closing quotes, not all read yet
                else:
                    i += 1
                continue
            if ch in "\"'":
                if len(rest) < 3 and rest == ch * len(rest):
                    break  # one quote, or the start of three?
                self.quote = ch * 3 if rest == ch * 3 else ch
                i += len(self.quote)
                continue
            if ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            i += 1
        self.i = i
        return None


def _python_call_args(call: str) -> str | None:
    """The JSON arguments of one pythonic call ``name(key=literal, ...)``; None if it is not
    one (positional or ``**`` arguments, a value that is no literal or has no JSON form).
    Parsed, never evaluated: ``ast.literal_eval`` reads only literals."""
    try:
        node = ast.parse(call.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        args = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return None
            args[keyword.arg] = ast.literal_eval(keyword.value)
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class _QwenCoderScanner(_Scanner):
    """Qwen3-Coder's calls: ``<function=NAME>``, per argument
    ``<parameter=KEY>\\nVALUE\\n</parameter>``, ``</function>``; each in ``<tool_call>`` ...
    ``</tool_call>`` (or bare). Values are text, typed by the tool's schema; each complete one
    goes out as the next ``"key": value`` of the arguments object (``{`` before the first,
    ``, `` before the others, ``}`` at the call's end: every prefix closed by ``}`` is valid
    JSON). A call cut off is closed with the parameters it completed."""

    _OPENERS = (_HERMES_OPEN, _QWEN_FUNC)
    _IN_WRAPPER = (_QWEN_FUNC, _HERMES_CLOSE)
    _IN_FUNCTION = (_QWEN_PARAM, _QWEN_FUNC_END, _QWEN_FUNC, _HERMES_CLOSE)
    _VALUE_ENDS = (_QWEN_PARAM_END, _QWEN_PARAM, _QWEN_FUNC_END)

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__(schemas)
        self.wrapped = False  # inside <tool_call>
        self.call: str | None = None  # the open call's name
        self.param = ""  # the parameter whose value is being read
        self.num_params = 0  # parameters of the open call sent

    def _content(self, out: list[Event]) -> bool:
        text, tag, self.buf = _split_at_tag(self.buf, self._OPENERS)
        if text:
            out.append(("content", text, None))
        if tag:
            self.wrapped = tag == _HERMES_OPEN
            self.state = "wrapper" if self.wrapped else "name"
        return bool(tag)

    def _wrapper(self, out: list[Event]) -> bool:
        _, tag, self.buf = _split_at_tag(self.buf, self._IN_WRAPPER)
        if tag:
            self.state = "name" if tag == _QWEN_FUNC else "content"
        return bool(tag)

    def _name(self, out: list[Event]) -> bool:
        end = self.buf.find(">")
        if end < 0:
            return False
        name, self.buf = self.buf[:end].strip(), self.buf[end + 1:]
        self.call, self.num_params, self.state = name or None, 0, "function"
        if name:
            out.append(("name", name, None))
        return True

    def _function(self, out: list[Event]) -> bool:
        _, tag, self.buf = _split_at_tag(self.buf, self._IN_FUNCTION)
        if tag == _QWEN_PARAM:
            self.state = "param"
        elif tag:
            self._close_call(out)
            if tag == _QWEN_FUNC_END:
                self.state = "wrapper" if self.wrapped else "content"
            else:
                self.state = "name" if tag == _QWEN_FUNC else "content"
        return bool(tag)

    def _param(self, out: list[Event]) -> bool:
        end = self.buf.find(">")
        if end < 0:
            return False
        self.param, self.buf, self.state = self.buf[:end].strip(), self.buf[end + 1:], "value"
        return True

    def _value(self, out: list[Event]) -> bool:
        end, tag = _first_tag(self.buf, self._VALUE_ENDS)
        if end < 0:
            return False
        text = self.buf[:end]
        self.buf = self.buf[end + len(tag):] if tag == _QWEN_PARAM_END else self.buf[end:]
        self.state = "function"
        if self.call is not None:
            text = text[1:] if text.startswith("\n") else text
            text = text[:-1] if text.endswith("\n") else text
            value = _typed_value(text, self.schemas.get(self.call, {}).get(self.param))
            out.append(("args", ("{" if self.num_params == 0 else ", ")
                        + json.dumps(self.param, ensure_ascii=False) + ": "
                        + json.dumps(value, ensure_ascii=False), None))
            self.num_params += 1
        return True

    def _close_call(self, out: list[Event]) -> None:
        if self.call is not None:
            out.append(("args", "}" if self.num_params else "{}", None))
        self.call = None

    def finish(self) -> list[Event]:
        out = super().finish()  # a value cut off (no end tag) is dropped
        self._close_call(out)
        return out


_SCANNERS: dict[str, type[_Scanner]] = {
    "mistral": _MistralScanner, "pythonic": _PythonicScanner, "qwen3_coder": _QwenCoderScanner}


def _param_schemas(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """Per tool name, the JSON schemas of its parameters (``parameters.properties``)."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise ValueError(f"tools.{i}: a tool is an object, got {type(tool).__name__}")
        spec = tool.get("function", tool)
        params = spec.get("parameters") if isinstance(spec, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("name"), str) \
                and isinstance(props, dict):
            schemas[spec["name"]] = props
    return schemas


_NO_VALUE = object()  # a converter's answer for text that is not of its type
_INTEGER_TEXT = re.compile(r"[-+]?\d+")


def _typed_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the type its schema gives (``integer``, ``number``,
    ``boolean``, ``null``, ``object``/``array`` as JSON or a Python literal); the text itself
    where the schema gives no other type or the text is not of it."""
    for kind in _schema_types(schema):
        convert = _CONVERTERS.get(kind)
        value = convert(text.strip()) if convert else _NO_VALUE
        if value is not _NO_VALUE:
            return value
    return text


def _schema_types(schema: Any) -> list[str]:
    """The ``type`` names a schema allows, its ``anyOf``/``oneOf`` branches' included."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    out = [kinds] if isinstance(kinds, str) else \
        [k for k in kinds if isinstance(k, str)] if isinstance(kinds, list) else []
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            out += [k for branch in branches for k in _schema_types(branch)]
    return out


def _as_number(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        return _NO_VALUE
    if not math.isfinite(value):
        return _NO_VALUE
    return int(text) if _INTEGER_TEXT.fullmatch(text) else value


def _as_integer(text: str) -> Any:
    value = _as_number(text)
    if isinstance(value, float):
        return int(value) if value.is_integer() else _NO_VALUE
    return value


def _as_boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)


def _as_null(text: str) -> Any:
    return None if text.lower() in ("null", "none") else _NO_VALUE


def _as_container(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(text)
                json.dumps(value, allow_nan=False)  # JSON has a form of it
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                continue
            if isinstance(value, kind):
                return value
        return _NO_VALUE
    return convert


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _as_integer, "number": _as_number, "boolean": _as_boolean, "null": _as_null,
    "object": _as_container(dict), "array": _as_container(list)}
