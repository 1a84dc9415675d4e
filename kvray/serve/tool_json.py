"""Incremental JSON reading for tool calls, for text that arrives a piece at a time:
:class:`CallScanner` reports each call object's name and its arguments' raw text as they
arrive (``hermes``, ``llama3_json``, ``tool_choice="required"`` and ``mistral``'s array
form); :class:`JsonExtent` says where one JSON object or array ends (``mistral``).
"""

from __future__ import annotations

import json


class _JsonStrings:
    """Whether a scan is inside a JSON string; escapes tracked so that quotes and brackets
    inside strings do not count."""

    in_string = escape = False

    def _string_char(self, ch: str) -> bool:
        """Step over ``ch`` inside a string; True when it closed the string."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False


class CallScanner(_JsonStrings):
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
            if self._string_char(ch) and self.args_depth == 0:  # the value was a string
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
            if self._string_char(ch):
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


class JsonExtent(_JsonStrings):
    """Where one JSON object or array ends, in text read a piece at a time (brackets inside
    strings do not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = self.done = False

    def feed(self, text: str) -> int:
        """How many leading characters of ``text`` belong to the value: all until it ends."""
        for i, ch in enumerate(text):
            if self.in_string:
                self._string_char(ch)
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
