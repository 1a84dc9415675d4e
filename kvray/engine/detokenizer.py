"""Incremental detokenization: token ids to text as they arrive, with stop strings.

Decoding a whole sequence at every step costs O(length) per token, and decoding each token
alone is wrong: a multi-byte character may be split across tokens, and SentencePiece-style
decoders drop the leading space of the first token they see. So we decode a small window of
recent tokens twice — up to ``read_offset`` (text already emitted) and up to the end — and emit
the difference (the prefix_offset/read_offset technique). The window starts a few tokens
inside the prompt so that the first generated token is decoded in context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context before the first generated token.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one output sequence's token ids into text as they arrive, never splitting a
    multi-byte character, and applies stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        """``min_tokens``: stop strings count only after the output's ``min_tokens``-th
        token (vLLM's rule: the text up to it is not searched)."""
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        # Characters that could be the start of a stop string not yet complete.
        self._num_holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids = list(prompt_token_ids)
        self._stops_after = len(self._ids) + min_tokens  # ids held before stops count
        self._prefix_offset = max(len(self._ids) - _NUM_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        # Output text in pieces, so that appending stays O(new text).
        self._chunks: list[str] = []
        self._num_chars = 0
        self._num_sent = 0
        self._matched_stop: str | None = None
        # ids of the last add_tokens call after the one that completed a stop string
        self.num_unused = 0

    @property
    def matched_stop(self) -> str | None:
        """The stop string the text ended at, if any."""
        return self._matched_stop

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids; return the stop string matched (output text is then truncated
        just before it, or just after it with include_stop_str_in_output), else None. After a
        match, further calls are not expected.

        Several ids at once (speculative decoding accepts a few per step) are added one by
        one while stop strings are set, so a stop lands on the id that completes it, as in
        plain decoding; ``num_unused`` then counts the ids after it, for the caller to drop."""
        assert self._matched_stop is None, "add_tokens called after a stop string matched"
        self.num_unused = 0
        if len(new_token_ids) == 1 or not self._stop:
            self._ids.extend(new_token_ids)
            return self._append_text(self._decode_new_text(flush=False))
        for i, token in enumerate(new_token_ids):
            self._ids.append(token)
            stop = self._append_text(self._decode_new_text(flush=False))
            if stop is not None:
                self.num_unused = len(new_token_ids) - i - 1
                return stop
        return None

    @property
    def output_text(self) -> str:
        """The full text so far, without a matched stop string (unless it is included)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def sent_text(self) -> str:
        """The text returned by get_delta so far (safe to show: no partial stop string)."""
        return self.output_text[: self._num_sent]

    def get_delta(self, finished: bool) -> str:
        """Text produced since the previous get_delta call, for streaming. While not finished,
        holds back the last (longest stop string length - 1) characters, because they might be
        the start of a stop string that must not be sent; when finished, flushes everything."""
        if finished and self._matched_stop is None:
            # Tokens ending in an incomplete character are emitted as they are (with U+FFFD),
            # as a full decode would show them.
            self._append_text(self._decode_new_text(flush=True))
        end = self._num_chars if finished else self._num_chars - self._num_holdback
        if end <= self._num_sent:
            return ""
        delta = self._suffix(self._num_chars - self._num_sent)[: end - self._num_sent]
        self._num_sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across window boundaries.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_new_text(self, flush: bool) -> str:
        """Return the text of the tokens past ``read_offset`` and advance the window, or return
        "" and wait while that text is empty or ends inside a character (unless flushing)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not new_text.startswith(prefix_text):
            # The context ended inside a character (a prompt cut within its bytes) that the
            # new tokens complete: the output's text is its own tokens', as decoding the
            # output alone gives it, and none of it is lost to the context's length.
            prefix_text, new_text = "", self._decode(self._ids[self._read_offset:])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _append_text(self, new_text: str) -> str | None:
        """Append ``new_text`` to the output, truncating it at the first stop string completed."""
        if not new_text:
            return None
        tail = self._suffix(min(self._num_holdback, self._num_chars))
        self._chunks.append(new_text)
        self._num_chars += len(new_text)
        if len(self._ids) <= self._stops_after:
            return None
        match = self._find_stop(tail + new_text, len(tail))
        if match is None:
            return None
        stop, end = match
        keep = end if self._include_stop else end - len(stop)
        # Stop text lies within the held-back tail or the new text, so none of it was sent.
        self._truncate(self._num_chars - len(tail) - len(new_text) + keep)
        self._matched_stop = stop
        return stop

    def _find_stop(self, text: str, num_old_chars: int) -> tuple[str, int] | None:
        """Return (stop string, end index in ``text``) of the stop string that completes first
        in ``text``, considering only matches ending past ``num_old_chars``; ties go to the
        longer one, which starts earlier."""
        best: tuple[str, int] | None = None
        for stop in self._stop:
            start = text.find(stop, max(num_old_chars - len(stop) + 1, 0))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, -len(stop)) < (best[1], -len(best[0])):
                best = (stop, end)
        return best

    def _suffix(self, num_chars: int) -> str:
        """The last ``num_chars`` characters of the output, read from the newest chunks."""
        if num_chars <= 0:
            return ""
        parts: list[str] = []
        remaining = num_chars
        for chunk in reversed(self._chunks):
            parts.append(chunk[-remaining:])
            remaining -= len(parts[-1])
            if remaining == 0:
                break
        return "".join(reversed(parts))

    def _truncate(self, num_chars: int) -> None:
        """Cut the output to its first ``num_chars`` characters (all of them unsent)."""
        assert self._num_sent <= num_chars <= self._num_chars, "stop text was already sent"
        excess = self._num_chars - num_chars
        while excess:
            chunk = self._chunks.pop()
            if len(chunk) > excess:
                self._chunks.append(chunk[: len(chunk) - excess])
                excess = 0
            else:
                excess -= len(chunk)
        self._num_chars = num_chars
