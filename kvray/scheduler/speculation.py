"""Speculative decoding as the scheduler sees it: where drafts come from, when they are
proposed, and the KV slots a draft model needs (``speculative_config``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvray.config import SpeculativeConfig
from kvray.scheduler.ngram import NgramProposer
from kvray.scheduler.request import Request

_NEVER = 1 << 30  # a batch size no step reaches


@dataclass
class Speculation:
    """Drafts for running requests: proposed here by n-gram lookup, or sent back by the
    workers (a draft model), or none."""

    proposer: NgramProposer | None = None  # n-gram drafts; None: the workers' or none
    disable_batch: int = _NEVER  # no drafts while this many requests or more run
    lookahead: int = 0  # KV slots a draft model writes past each request's tokens
    configured: bool = False  # requests may get drafts (n-gram or a draft model)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig | None) -> Speculation:
        """What ``speculative_config`` asks for (None: no speculation)."""
        if spec is None:
            return cls()
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max) if spec.method == "ngram" else None
        lookahead = spec.num_speculative_tokens if spec.method == "draft_model" else 0
        return cls(proposer, spec.disable_by_batch_size or _NEVER, lookahead, True)

    def wanted(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests verifies drafts."""
        return num_running < self.disable_batch

    def drafts_for(self, req: Request, worker_drafts: list[int] | None,
                   max_model_len: int) -> list[int]:
        """Drafts for ``req``'s next step: the workers' (a draft model), else the n-gram
        proposer's; never more than the tokens it may still emit less the one a step
        always emits, nor past ``max_model_len``."""
        room = min(req.max_tokens - len(req.output_token_ids) - 1,
                   max_model_len - req.num_tokens - 1, req.spec_len)
        drafts = worker_drafts
        if drafts is None and self.proposer is not None:
            drafts = self.proposer.propose(req.request_id, req.all_token_ids, room)
        return list(drafts or ())[:max(room, 0)]

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: drop what the proposer kept of it."""
        if self.proposer is not None:
            self.proposer.forget(req_id)
