"""Qwen3-Coder's tool-call format, read incrementally (:class:`QwenCoderScanner`):
``<function=NAME><parameter=KEY>value</parameter>...</function>``, maybe in
``<tool_call>``; each value is text, typed by the tool's parameter schema."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

from kvray.serve.tool_scanner import (
    HERMES_CLOSE,
    HERMES_OPEN,
    Event,
    FormatScanner,
    first_tag,
    split_at_tag,
)

QWEN_FUNC, _QWEN_FUNC_END = "<function=", "</function>"
QWEN_PARAM, _QWEN_PARAM_END = "<parameter=", "</parameter>"


class QwenCoderScanner(FormatScanner):
    """Qwen3-Coder's calls: ``<function=NAME>``, per argument
    ``<parameter=KEY>\\nVALUE\\n</parameter>``, ``</function>``; each in ``<tool_call>`` ...
    ``</tool_call>`` (or bare). Values are text, typed by the tool's schema; each complete one
    goes out as the next ``"key": value`` of the arguments object (``{`` before the first,
    ``, `` before the others, ``}`` at the call's end: every prefix closed by ``}`` is valid
    JSON). A call cut off is closed with the parameters it completed."""

    _OPENERS = (HERMES_OPEN, QWEN_FUNC)
    _IN_WRAPPER = (QWEN_FUNC, HERMES_CLOSE)
    _IN_FUNCTION = (QWEN_PARAM, _QWEN_FUNC_END, QWEN_FUNC, HERMES_CLOSE)
    _VALUE_ENDS = (_QWEN_PARAM_END, QWEN_PARAM, _QWEN_FUNC_END)

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__(schemas)
        self.wrapped = False  # inside <tool_call>
        self.call: str | None = None  # the open call's name
        self.param = ""  # the parameter whose value is being read
        self.num_params = 0  # parameters of the open call sent
        self.searched = 0  # how much of the value in ``buf`` was searched for its end

    def _content(self, out: list[Event]) -> bool:
        text, tag, self.buf = split_at_tag(self.buf, self._OPENERS)
        if text:
            out.append(("content", text, None))
        if tag:
            self.wrapped = tag == HERMES_OPEN
            self.state = "wrapper" if self.wrapped else "name"
        return bool(tag)

    def _wrapper(self, out: list[Event]) -> bool:
        _, tag, self.buf = split_at_tag(self.buf, self._IN_WRAPPER)
        if tag:
            self.state = "name" if tag == QWEN_FUNC else "content"
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
        _, tag, self.buf = split_at_tag(self.buf, self._IN_FUNCTION)
        if tag == QWEN_PARAM:
            self.state = "param"
        elif tag:
            self._close_call(out)
            if tag == _QWEN_FUNC_END:
                self.state = "wrapper" if self.wrapped else "content"
            else:
                self.state = "name" if tag == QWEN_FUNC else "content"
        return bool(tag)

    def _param(self, out: list[Event]) -> bool:
        end = self.buf.find(">")
        if end < 0:
            return False
        self.param, self.buf, self.state = self.buf[:end].strip(), self.buf[end + 1:], "value"
        self.searched = 0
        return True

    def _value(self, out: list[Event]) -> bool:
        # a value is sent whole once its end tag comes: search only the text not searched
        # yet (and a tag's length back), or a long value streams in quadratic time
        longest = max(map(len, self._VALUE_ENDS))
        end, tag = first_tag(self.buf, self._VALUE_ENDS, max(0, self.searched - longest + 1))
        if end < 0:
            self.searched = len(self.buf)
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
