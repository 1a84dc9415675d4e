"""The engine's state of one request (its ``n`` sequences, their detokenizers, what has been
sent) and the :class:`~kvray.outputs.RequestOutput` it gives after each step, in the kind
its params ask for: cumulative, only what is new (DELTA), or only the final one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvray.engine.detokenizer import IncrementalDetokenizer
from kvray.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams
from kvray.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvray.lora.request import LoRARequest


@dataclass
class SequenceState:
    """One of a request's n sequences: the scheduler's request and what the engine adds."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None  # DELTA: only those not yet sent
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # DELTA: output tokens already in an output
    finish_sent: bool = False  # DELTA: the finish reason went out

    def take_text(self) -> str:
        """The text since the previous output (all of it once the request has ended). A
        stop string found only in the text flushed at the end (held back while its last
        character was incomplete) turns a finish by length into a stop at it: the text is
        cut there, so the finish reason says why."""
        req = self.request
        text = self.detok.get_delta(finished=req.is_finished)
        stop = self.detok.matched_stop
        if stop is not None and req.status is RequestStatus.FINISHED_LENGTH:
            req.stop_reason, req.status = stop, RequestStatus.FINISHED_STOPPED
        return text

    def cumulative(self, index: int) -> CompletionOutput:
        """Everything this sequence has produced so far."""
        req = self.request
        return CompletionOutput(
            index=index, text=self.detok.sent_text, token_ids=list(req.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason)

    def delta(self, index: int, text: str) -> CompletionOutput | None:
        """What is new in this sequence since its previous output, or None."""
        req = self.request
        new_ids = req.output_token_ids[self.num_sent_tokens:]
        report_finish = req.is_finished and not self.finish_sent
        if not new_ids and not text and not report_finish:
            return None
        self.num_sent_tokens += len(new_ids)
        self.finish_sent = req.is_finished
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        return CompletionOutput(
            index=index, text=text, token_ids=new_ids,
            cumulative_logprob=self.cumulative_logprob if logprobs is not None else None,
            logprobs=logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)


@dataclass
class RequestState:
    """A user's request: its prompt, params and sequences, and what went out already."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_sent_prompt_logprobs: int = 0  # DELTA
    prompt_sent: bool = False  # DELTA: the prompt went out with the first output
    pooled: list[float] | list[list[float]] | None = None  # once computed (token tasks: rows)
    lora_request: LoRARequest | None = None  # the adapter it runs with

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)

    def output(self) -> RequestOutput | None:
        """The request's output after this step (None for FINAL_ONLY until it finishes, or
        a DELTA with nothing new)."""
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        outs = []
        for i, seq in enumerate(self.seqs):
            # Held-back text (a possible stop string's start) is released only when safe.
            text = seq.take_text()
            comp = seq.delta(i, text) if delta else seq.cumulative(i)
            if comp is not None:
                outs.append(comp)
        if delta and not outs:
            return None
        prompt, prompt_ids, prompt_lps = self.prompt, self.prompt_token_ids, \
            self.prompt_logprobs
        if delta:
            if self.prompt_sent:
                prompt = prompt_ids = None
            self.prompt_sent = True
            if prompt_lps is not None:
                prompt_lps = prompt_lps[self.num_sent_prompt_logprobs:]
                self.num_sent_prompt_logprobs += len(prompt_lps)
        return RequestOutput(self.request_id, prompt, prompt_ids, prompt_lps, outs,
                             self.finished, self.metrics(), self.pooled, self.lora_request)

    def metrics(self) -> RequestMetrics:
        """Arrival, first scheduled, first token and finish times over the sequences."""
        first = self.seqs[0].request
        return RequestMetrics(
            first.arrival_time, first.first_scheduled_time,
            min((s.request.first_token_time for s in self.seqs
                 if s.request.first_token_time is not None), default=None),
            max((s.request.finished_time or 0.0) for s in self.seqs) or None,
            max(first.num_cached_tokens, 0),
            sum(s.request.num_preemptions for s in self.seqs))
