"""Mistral's tool-call format, read incrementally (:class:`MistralScanner`):
``[TOOL_CALLS]`` and a JSON array of calls, or ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

from __future__ import annotations

import re
from typing import Any

from kvray.serve.tool_json import CallScanner, JsonExtent
from kvray.serve.tool_scanner import Event, FormatScanner, split_at_tag

MISTRAL_TAG, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


class MistralScanner(FormatScanner):
    """Mistral's calls, after content or not: ``[TOOL_CALLS]`` and a JSON array of
    ``{"name", "arguments"}`` objects (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B), or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+: Mistral Small 3.x, Devstral, Magistral;
    ``name[CALL_ID]id[ARGS]`` brings the model's own id). Text after a call is content; a
    call whose name is not a tool name is dropped with its arguments."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        super().__init__(schemas)
        self.extent = JsonExtent()  # where the array or the arguments object ends
        self.items = CallScanner(2, ("arguments", "parameters"))  # the array's calls
        self.emit_args = False  # the open call (name[ARGS] form) has a valid name
        self.named = False  # array form: the object being read has had its name
        self.pending = ""  # array form: its arguments read before its name

    def _content(self, out: list[Event]) -> bool:
        text, tag, self.buf = split_at_tag(self.buf, (MISTRAL_TAG,))
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
            self.extent, self.items = JsonExtent(), CallScanner(2, self.items.args_keys)
            return True
        brace, tag = head.find("{"), head.find(MISTRAL_TAG)
        if tag >= 0 and (brace < 0 or tag < brace):  # a name without arguments: dropped
            self.buf = head[tag + len(MISTRAL_TAG):]
            return True
        if brace < 0:
            return False
        name, call_id = _mistral_head(head[:brace])
        if name is not None:
            out.append(("name", name, call_id))
        self.buf, self.state, self.extent = head[brace:], "args", JsonExtent()
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
