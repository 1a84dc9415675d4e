"""Reasoning output on /v1/chat/completions: a thinking model's ``<think>…</think>`` text
split from its answer, into ``reasoning_content`` and ``content``, whole or as it streams.

Two parsers, named as vLLM names them:

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the output starts in the thinking block
  (R1's templates open it in the prompt; an output that opens it again is fine); everything
  before ``</think>`` is reasoning, even when the closing tag never comes.
- ``qwen3`` (Qwen3, QwQ): the output is in a thinking block only when the prompt opened one
  (the 2507 "Thinking" templates) or the output starts with ``<think>``; otherwise (and when
  the prompt holds a closed block: ``enable_thinking: false``) it is all answer.

Whatever the parser, a prompt that ends with a closed block (``<think>\\n\\n</think>``: the
template turned thinking off) means no reasoning in the output. The split is exact: the
text between the markers is the reasoning, the text after ``</think>`` the answer (nothing
stripped), whitespace before an opening ``<think>`` is dropped. :class:`ReasoningSplitter`
gives the same split however the text is cut into deltas; :func:`split_reasoning` is the
whole-text form. Tool calls and structured outputs apply to the answer only (the engine's
grammar waits for the end marker: :class:`kvray.sampling_params.ReasoningSpan`).
"""

from __future__ import annotations

from typing import Literal

from kvray.serve.tool_scanner import partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"

PromptState = Literal["open", "closed", "none"]


def prompt_state(prompt_tail: str) -> PromptState:
    """Whether a rendered prompt ends inside a thinking block (``open``), right after a
    closed one (``closed``: thinking turned off), or neither."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_START):
        return "open"
    if tail.endswith(THINK_END):
        return "closed"
    return "none"


def starts_in_reasoning(parser: str, state: PromptState) -> bool | None:
    """True: the output begins as reasoning; False: it is all answer; None: reasoning only
    if the output opens a block first (Qwen3 without a block in its prompt)."""
    if state == "closed":
        return False
    if state == "open" or parser == "deepseek_r1":
        return True
    return None


class ReasoningSplitter:
    """Turns one choice's text deltas into (reasoning, answer) deltas as they arrive.

    Text that may still become a marker (a partial ``<think>`` at the start, a partial
    ``</think>`` at the end of the reasoning) is held back until it is decided; ``finish``
    releases what is held when the output ends."""

    def __init__(self, begins: bool | None) -> None:
        # "start": before the first non-blank text (an opening <think> is dropped there);
        # "reasoning"; "answer".
        self._phase = "start" if begins is not False else "answer"
        self._default = "reasoning" if begins else "answer"
        self._held = ""
        self.saw_reasoning = begins is True

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, answer = [], []
        self._held += text
        while self._held:
            if self._phase == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_START):
                    self._held = stripped[len(THINK_START):]
                    self._phase, self.saw_reasoning = "reasoning", True
                    continue
                if THINK_START.startswith(stripped):  # blank, or a partial <think>
                    break
                self._phase = self._default
                continue
            if self._phase == "answer":
                answer.append(self._held)
                self._held = ""
                break
            end = self._held.find(THINK_END)
            if end >= 0:
                reasoning.append(self._held[:end])
                self._held = self._held[end + len(THINK_END):]
                self._phase = "answer"
                continue
            keep = partial_suffix(self._held, THINK_END)
            reasoning.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The output ended: what is still held back goes out as what it is."""
        held, self._held = self._held, ""
        if self._phase == "reasoning":
            return held, ""
        if self._phase == "start":
            return ("", held) if self._default == "answer" else (held, "")
        return "", held


def split_reasoning(text: str, begins: bool | None) -> tuple[str | None, str]:
    """(reasoning or None when the output had no thinking block, answer) of a whole
    output: the same split :class:`ReasoningSplitter` streams."""
    splitter = ReasoningSplitter(begins)
    r1, a1 = splitter.feed(text)
    r2, a2 = splitter.finish()
    reasoning = r1 + r2
    return (reasoning if splitter.saw_reasoning else None), a1 + a2
