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
  values typed by the tool's schema); ``parallel_tool_calls: false`` keeps the first call
  found. ``"none"``: no calls are ever parsed.

Streaming: :class:`ToolCallStreamer` turns text deltas into OpenAI deltas as the text
arrives: content outside the calls as ``content``; per call first a delta with its index,
id, type and name, then its arguments' raw JSON text in pieces, as OpenAI streams them.

This module holds the public API, ``hermes`` and ``llama3_json`` (whole-text parses here;
their incremental JSON reading is :class:`kvray.serve.tool_json.CallScanner`) and the
streamer. The mistral, pythonic and qwen3_coder formats are each one incremental scanner
(:mod:`kvray.serve.tool_mistral`, :mod:`~kvray.serve.tool_pythonic`,
:mod:`~kvray.serve.tool_qwen_coder`, on the base in :mod:`~kvray.serve.tool_scanner`):
text in; content, call names and argument pieces out. Their whole-text parse is that
scanner fed the whole text, so both agree however the text is cut.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvray.sampling_params import SCHEMA_DATA_KEYWORDS
from kvray.serve.tool_json import CallScanner
from kvray.serve.tool_mistral import MISTRAL_TAG, MistralScanner
from kvray.serve.tool_pythonic import PY_START, PythonicScanner
from kvray.serve.tool_qwen_coder import QWEN_FUNC, QWEN_PARAM, QwenCoderScanner
from kvray.serve.tool_scanner import (
    HERMES_CLOSE,
    HERMES_OPEN,
    Event,
    FormatScanner,
    partial_suffix,
)

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
_PYTHON_TAG = "<|python_tag|>"
# Llama 3.2's pythonic prompt: "... in the format of [func_name1(params_name1=params_value1,"
_PYTHONIC_INSTRUCTION = re.compile(r"\[\s*func_name\w*\s*\(\s*params?_name\w*\s*=")
_ALPHANUMERIC = string.ascii_letters + string.digits

# The formats read by one incremental scanner each (hermes and llama3_json are read here).
_SCANNERS: dict[str, type[FormatScanner]] = {
    "mistral": MistralScanner, "pythonic": PythonicScanner, "qwen3_coder": QwenCoderScanner}


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
    if MISTRAL_TAG in template:
        return "mistral"
    if QWEN_FUNC in template and QWEN_PARAM in template:
        return "qwen3_coder"
    if PY_START in template or _PYTHONIC_INSTRUCTION.search(template):
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
    """JSON schema of ``tool_choice="required"``'s output: an array of calls. Each tool's
    parameters schema moves under the root's ``$defs`` with its local ``$ref`` pointers
    rebased there, so ``#/$defs/...`` (pydantic's) and ``#`` (recursion) still mean the
    tool's own schema, not the array's."""
    defs = {f"tool{i}": _rebased(t.get("parameters") or {"type": "object"}, f"#/$defs/tool{i}")
            for i, t in enumerate(tools)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["name"]},
                             "parameters": {"$ref": f"#/$defs/tool{i}"}}}
             for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local JSON-pointer ``$ref`` (``#`` or ``#/...``) prefixed by
    ``base``; anchors (``#name``) and other URIs are left as they are."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#"
                                                           or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in SCHEMA_DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


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
        except (ValueError, RecursionError):  # (a model repeating "[" to max_tokens)
            return text, []
        calls = [c for c in (_call_of(i, ("parameters", "arguments"), new_id) for i in items)
                 if c] if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if parser in _SCANNERS:
        return _parse_with(_SCANNERS[parser](_param_schemas(tools)), text, new_id)
    if parser == "llama3_json":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _parse_with(scanner: FormatScanner, text: str, new_id: Callable[[], str]
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


def _string_args(text: str) -> str:
    """Arguments a model wrote as a JSON string: the string's text (the arguments' JSON),
    as :func:`_args_text` reads it in the whole parse; the text as it is if not a string."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, str) else text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in re.findall(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE)
                           + r"|$)", text[start:], flags=re.DOTALL):
        body = body.strip()
        body = body[:len(body) - partial_suffix(body, HERMES_CLOSE)]  # output cut in the tag
        try:
            call = _call_of(json.loads(body), ("arguments", "parameters"))
        except (ValueError, RecursionError):
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
        except (ValueError, RecursionError):
            return text, []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls



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


class ToolCallStreamer:
    """Text deltas of one choice in, OpenAI chat deltas out (see the module docstring)."""

    def __init__(self, mode: str, parser: str, named: str | None = None,
                 tools: list[dict] | None = None) -> None:
        """``tools``: the request's tools, as :func:`parse_tool_calls` takes them."""
        self.mode, self.parser, self.named = mode, parser, named
        self.new_id = _id_maker(parser)
        self.calls: list[dict] = []  # per call: {"id", "name"}
        self.pending_args = ""  # arguments seen before the name (rare key order)
        # A JSON call object opened and not yet named: it becomes a call with its name (an
        # object without one never does, as in the whole-text parse).
        self.unnamed = False
        self.args_sent = False  # the open call's arguments started (else "{}" at its end)
        # arguments given as a JSON string (its text is the JSON, as the whole parse reads
        # it): held until the call's object ends, then sent decoded
        self.string_args: str | None = None
        # hermes: the raw text of the call being read (from its tag), and the calls before
        # it: a tag that yields no call gives its text back as content
        self.call_raw = ""
        self.calls_before = 0
        self.held = ""  # content held back: the start of a tag, or spaces (format scanners)
        self.in_call = False
        self.started = False
        self.scanner: CallScanner | None = None
        self.format_scanner: FormatScanner | None = None  # mistral, pythonic, qwen3_coder
        # Before any call (format scanners): the text in, the scanner's content out, how
        # much of the text went out as content, in order; content after text the scanner
        # dropped waits for a call (or, if none comes, the text goes out as it was).
        self.fed = self.content_seen = ""
        self.num_sent = 0
        self.deferred: list[str] | None = None
        if mode == "required":
            self.scanner = CallScanner(2, ("parameters", "arguments"))
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
        if self.in_call and self.mode == "auto" and self.parser not in _SCANNERS \
                and self.parser != "llama3_json":
            self.call_raw += self.held  # (a cut close tag's start is the call's text)
            self.held = ""
            out += self._end_hermes_call()
        elif self.in_call and self.parser == "llama3_json" and self.mode == "auto" \
                and not self.calls and self.call_raw:
            out.append({"content": self.call_raw})  # JSON that named no call: text after all
            self.call_raw = ""
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
                end = buf.find(HERMES_CLOSE)
                if end < 0:  # the close tag may be cut: hold its start
                    keep = partial_suffix(buf, HERMES_CLOSE)
                    body, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
                    self.call_raw += body
                    out += self._scan(body)
                    break
                self.call_raw += buf[:end + len(HERMES_CLOSE)]
                out += self._scan(buf[:end])
                buf = buf[end + len(HERMES_CLOSE):]
                out += self._end_hermes_call()
                continue
            start = buf.find(HERMES_OPEN)
            if start >= 0:
                if buf[:start]:
                    out.append({"content": buf[:start]})
                buf = buf[start + len(HERMES_OPEN):]
                self.in_call, self.scanner = True, CallScanner(1, ("arguments", "parameters"))
                self.call_raw, self.calls_before = HERMES_OPEN, len(self.calls)
                continue
            keep = partial_suffix(buf, HERMES_OPEN)
            if buf[:len(buf) - keep]:
                out.append({"content": buf[:len(buf) - keep]})
            self.held = buf[len(buf) - keep:]
            break
        return out

    def _end_hermes_call(self) -> list[dict]:
        """A hermes call's text ended (its close tag, or the output): one that gave no
        call (a tag in prose, an object with no name) is content after all."""
        self.in_call, self.scanner = False, None
        raw, self.call_raw = self.call_raw, ""
        return [{"content": raw}] if len(self.calls) == self.calls_before and raw else []

    def _feed_llama3(self, text: str) -> list[dict]:
        if self.in_call:
            self.call_raw += text
            return self._scan(text)
        buf = self.held + text
        self.held = ""
        stripped = buf.lstrip()
        if not stripped or _PYTHON_TAG.startswith(stripped):
            self.held = buf  # cannot tell yet
            return []
        if stripped.startswith(_PYTHON_TAG):
            stripped = stripped[len(_PYTHON_TAG):]
            if not stripped.strip():
                self.held = buf  # the tag and spaces: the call may follow
                return []
        if stripped.lstrip().startswith("{") and not self.started:
            self.in_call, self.call_raw = True, buf
            self.scanner = CallScanner(1, ("parameters", "arguments"))
            return self._scan(stripped)
        self.started = True
        self.mode = "none"  # plain text: no calls in this output
        return [{"content": buf}]

    def _scan(self, text: str) -> list[dict]:
        out = []
        for kind, value in self.scanner.feed(text):
            if kind == "start":
                self.unnamed, self.pending_args, self.args_sent = True, "", False
            elif kind == "name":
                if not self.unnamed:
                    continue  # a second "name" key in one object: the first named the call
                self.unnamed = False
                self.calls.append({"id": self.new_id(), "name": value})
                out.append(self._header(len(self.calls) - 1, value, self.pending_args))
                self.args_sent = bool(self.pending_args)
                self.pending_args = ""
            elif kind == "args":
                if self.unnamed:
                    self.pending_args += value
                elif self.string_args is not None:
                    self.string_args += value
                elif self.calls and not self.args_sent and value.lstrip().startswith('"'):
                    self.string_args = value
                elif self.calls:
                    out.append(self._args(len(self.calls) - 1, value))
                    self.args_sent = True
            elif kind == "end":
                if not self.unnamed and self.calls and self.string_args is not None:
                    out.append(self._args(len(self.calls) - 1, _string_args(self.string_args)))
                elif not self.unnamed and self.calls and not self.args_sent:
                    out.append(self._args(len(self.calls) - 1, "{}"))  # no arguments given
                self.unnamed, self.string_args = False, None
        return out

    def _header(self, index: int, name: str, args: str) -> dict:
        return {"tool_calls": [{"index": index, "id": self.calls[index]["id"],
                                "type": "function",
                                "function": {"name": name, "arguments": args}}]}

    @staticmethod
    def _args(index: int, text: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
