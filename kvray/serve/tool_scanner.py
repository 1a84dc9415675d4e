"""The shared shape of the incremental tool-call format scanners (``mistral``,
``pythonic``, ``qwen3_coder``, one module each): the :data:`Event` they emit, the
:class:`FormatScanner` state machine they extend, and the helpers that find a marker in
text that may stop partway through one.

A scanner is fed the output a piece at a time and emits content, call names and pieces of
the arguments' JSON text; the whole-text parse is the same scanner fed the whole text, so
the two agree however the text is cut.
"""

from __future__ import annotations

from typing import Any

# Hermes' call wrapper; Qwen3-Coder's calls may come in it too.
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

# What a format scanner emits: ("content", text, None), ("name", name, the model's call id
# or None) opening a call, ("args", a piece of the open call's arguments' JSON text, None).
Event = tuple[str, str, str | None]


class FormatScanner:
    """A tool-call format read a piece at a time: text in, events (:data:`Event`) out. A
    state is a method ``_<state>(out)`` that reads from ``buf``, appends events, and says
    whether it got anywhere (False: it waits for more text)."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas  # per tool: its parameters' schemas (qwen3_coder types values)
        self.state = "content"
        self.buf = ""  # text read and not yet turned into events

    def feed(self, text: str) -> list[Event]:
        """The events of ``text``, read on from where the last piece stopped."""
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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def first_tag(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the earliest of ``tags`` starts in ``text`` (from ``start``), and which;
    (-1, "") if none does."""
    best = (-1, "")
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, tag)
    return best


def split_at_tag(text: str, tags: tuple[str, ...]) -> tuple[str, str, str]:
    """(text before the earliest tag, the tag, text after it); with no tag: (the text that
    cannot be part of one, "", the end that may be a tag's start)."""
    i, tag = first_tag(text, tags)
    if i >= 0:
        return text[:i], tag, text[i + len(tag):]
    keep = max(partial_suffix(text, t) for t in tags)
    return text[:len(text) - keep], "", text[len(text) - keep:]
