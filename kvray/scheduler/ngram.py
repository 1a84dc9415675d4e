"""N-gram prompt lookup: draft tokens for speculative decoding without a draft model.

The longest suffix of the sequence (``prompt_lookup_max`` down to ``prompt_lookup_min``
tokens) that occurred earlier in it is looked up; the tokens that followed its latest
earlier occurrence are the draft. Text that copies from its context (summaries, edits,
code) is where this pays.

Pure Python, and fast: each request's tokens are kept as 4-byte little-endian words in a
``bytearray`` that grows with the sequence, so the search is ``bytes.rfind`` in C.
"""

from __future__ import annotations

import struct


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self._seqs: dict[str, tuple[bytearray, int]] = {}  # req -> (words, tokens held)

    def propose(self, req_id: str, token_ids: list[int], max_tokens: int | None = None
                ) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens to follow ``token_ids`` (the request's
        whole sequence so far); [] when no suffix recurs."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        words, held = self._seqs.get(req_id, (bytearray(), 0))
        if held > len(token_ids):  # the sequence was replaced: start over
            words, held = bytearray(), 0
        words += struct.pack(f"<{len(token_ids) - held}I", *token_ids[held:])
        self._seqs[req_id] = (words, len(token_ids))
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = bytes(words[4 * (total - n):])
            end = 4 * (total - 1)  # an occurrence must end before the suffix's own end
            pos = words.rfind(suffix, 0, end)
            while pos >= 0 and pos % 4:  # not aligned to a token: search on to the left
                pos = words.rfind(suffix, 0, pos + len(suffix) - 1)
            if pos >= 0:
                start = pos // 4 + n
                return list(token_ids[start:start + k])
        return []

    def forget(self, req_id: str) -> None:
        self._seqs.pop(req_id, None)
