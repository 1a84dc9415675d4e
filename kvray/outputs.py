"""What the engine returns to callers, with vLLM's names.

With ``RequestOutputKind.DELTA`` each output carries only what is new: the text, token ids
and logprobs generated since the previous output, the sequences that changed, and the prompt
(``prompt``, ``prompt_token_ids``) on the first output only. :meth:`RequestOutput.add` folds
a later output into an earlier one, so a consumer that needs the whole can rebuild it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvray.lora.request import LoRARequest


class Logprob(float):
    """One token's log-probability, as vLLM's ``Logprob``: ``.logprob``, its ``rank`` in the
    vocabulary (1 = the likeliest) and ``decoded_token`` (the token's own text).

    A float subclass: code that treats logprobs as numbers (sums, ``math.exp``, JSON) keeps
    working, and code written for vLLM reads the attributes.
    """

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")


def logprob_entry(token: int, logprob: float, rank: int, top_ids: list[int],
                  top_logprobs: list[float]) -> dict[int, Logprob]:
    """One position's logprobs: its token first (with its own rank), then the top ids,
    ranked 1, 2, ... in the order given."""
    entry = {token: Logprob(logprob, rank)}
    for r, (t, lp) in enumerate(zip(top_ids, top_logprobs, strict=True), 1):
        if t != token:
            entry[t] = Logprob(lp, r)
    return entry


SampleLogprobs = list[dict[int, Logprob]]  # per generated token: id -> logprob (vLLM's name)
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` among the ``n``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # per token: id -> logprob (sampled + top-k)
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        """Whether this sequence has ended (vLLM's)."""
        return self.finish_reason is not None

    def copy(self) -> CompletionOutput:
        """A copy whose lists may be extended without touching this one."""
        return dataclasses.replace(self, token_ids=list(self.token_ids),
                                   logprobs=None if self.logprobs is None else list(self.logprobs))

    def add(self, later: CompletionOutput) -> None:
        """Append a later delta of the same sequence."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None on DELTA outputs after the first
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(repr=False, default=None)
    # a pooling request's embedding or class logits (on its final output)
    pooled: list[float] | list[list[float]] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field)

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache (vLLM's field)."""
        return None if self.metrics is None else self.metrics.num_cached_tokens

    def add(self, later: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one (``later`` is left
        as it was)."""
        assert later.request_id == self.request_id, "outputs of different requests"
        if self.prompt_token_ids is None:
            self.prompt, self.prompt_token_ids = later.prompt, later.prompt_token_ids
        if later.prompt_logprobs:
            self.prompt_logprobs = self.prompt_logprobs or []
            self.prompt_logprobs.extend(later.prompt_logprobs)
        by_index = {c.index: c for c in self.outputs}
        for comp in later.outputs:
            if comp.index in by_index:
                by_index[comp.index].add(comp)
            else:
                by_index[comp.index] = comp.copy()  # never alias the delta being folded
        self.outputs = sorted(by_index.values(), key=lambda c: c.index)
        self.finished = later.finished
        self.metrics = later.metrics
        if later.pooled is not None:
            self.pooled = later.pooled


@dataclass
class PoolingOutput:
    """A pooling request's result (``LLM.encode``) as a tensor, as vLLM's: a vector, or
    one row per prompt token for the token tasks."""

    data: Any


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # the model's activation of its logits (softmax, or a sigmoid)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's activated logit, or the embeddings' cosine similarity


@dataclass
class PoolingRequestOutput:
    """One prompt's result from ``LLM.encode`` / ``embed`` / ``classify`` / ``score``
    (vLLM's names): ``outputs`` holds the vector in the form the call returns."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
