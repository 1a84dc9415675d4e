"""Llama 3.2/4's pythonic tool-call format, read incrementally (:class:`PythonicScanner`):
a Python list of calls, ``[get_weather(city="Paris"), ...]``, maybe in
``<|python_start|>`` ... ``<|python_end|>``. Arguments are parsed as literals, never
evaluated."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvray.serve.tool_scanner import Event, FormatScanner, split_at_tag

PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_PY_CALL = re.compile(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*(\()\s*(?:\)|[A-Za-z_]\w*\s*=)")
_PY_CALL_START = re.compile(r"\s*(?:[A-Za-z_][\w.]*\s*(?:\(\s*(?:[A-Za-z_]\w*\s*)?)?)?")
_PY_LIST_NEXT = re.compile(r"\s*([,\]])")


class PythonicScanner(FormatScanner):
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
        text, tag, self.buf = split_at_tag(self.buf, (PY_START,))
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
