"""Structured outputs on the sampling worker: each constrained request's grammar matcher,
and the step's next-token bitmasks filled on a helper thread while the forward runs
(llguidance works outside the GIL)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvray.sampling_params import SamplingParams
from kvray.structured_output import (
    GrammarCompiler,
    Matcher,
    ReasoningGatedMatcher,
    compiler_for,
)


class GrammarMasks:
    """The grammar compiler (built on the first constrained request) and the mask thread
    (started on the first step that needs one)."""

    def __init__(self, model_path: str, tokenizer: str | None, vocab_size: int,
                 pin_memory: bool) -> None:
        self.model_path, self.tokenizer, self.vocab_size = model_path, tokenizer, vocab_size
        self.pin_memory = pin_memory
        self._compiler: GrammarCompiler | None = None
        self._thread: ThreadPoolExecutor | None = None

    def matcher(self, params: SamplingParams, generated: list[int]) -> Matcher:
        """A matcher for ``params.structured_outputs`` that has accepted ``generated`` (a
        request back from preemption replays what it generated so far)."""
        if self._compiler is None:
            self._compiler = compiler_for(self.model_path, self.tokenizer, self.vocab_size,
                                          params.eos_token_ids)
        structured = params.structured_outputs
        matcher = self._compiler.compile(structured)
        if structured.reasoning is not None:  # the grammar starts after the reasoning
            matcher = ReasoningGatedMatcher(matcher, structured.reasoning)
        matcher.accept(generated)
        return matcher

    def start(self, plain: list[tuple[Matcher, int]],
              spec: list[tuple[Matcher, int, list[int]]], num_rows: int) -> Future | None:
        """The masks of ``num_rows`` logits rows, computed on the helper thread: row ``r``
        of each ``(matcher, r)`` in ``plain``; for each ``(matcher, first, drafts)`` in
        ``spec`` a row per draft position from ``first`` (the matcher steps through the
        drafts and is rolled back after). Unconstrained rows stay all ones. None when no
        row is constrained."""
        if not plain and not spec:
            return None
        bitmask = torch.full((num_rows, self._compiler.bitmask_words), -1,
                             dtype=torch.int32, pin_memory=self.pin_memory)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvray-grammar")
        return self._thread.submit(self._fill, plain, spec, bitmask)

    def _fill(self, plain: list[tuple[Matcher, int]],
              spec: list[tuple[Matcher, int, list[int]]], bitmask: torch.Tensor
              ) -> torch.Tensor:
        # the bitmask was made under the worker's inference mode, which is per thread: a
        # write through torch here (the reasoning gate's opening-marker bit) needs it too
        with torch.inference_mode():
            return self._fill_rows(plain, spec, bitmask)

    def _fill_rows(self, plain: list[tuple[Matcher, int]],
                   spec: list[tuple[Matcher, int, list[int]]], bitmask: torch.Tensor
                   ) -> torch.Tensor:
        self._compiler.fill_bitmask(plain, bitmask)
        for matcher, first, drafts in spec:
            consumed = 0
            for j in range(len(drafts) + 1):
                row = first + j
                self._compiler.fill_bitmask([(matcher, row)], bitmask)
                if j == len(drafts):
                    break
                # a draft the grammar refuses is masked out: verification rejects it, and
                # the rows after it are never used
                tok = drafts[j]
                if not (int(bitmask[row, tok // 32]) >> (tok % 32)) & 1 \
                        or not matcher.accept([tok]):
                    break
                consumed += 1
            if consumed:
                matcher.rollback(consumed)
        return bitmask

    def shutdown(self) -> None:
        """Stop the helper thread (without waiting for a mask in flight)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
