"""What a step's prompt tokens give besides the cache: pooling requests' vectors
(embeddings, classification) and the prompt's logprobs (``prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvray.actors.step_state import CachedRequestState, StepInputs
from kvray.outputs import Logprob, logprob_entry
from kvray.scheduler.output import SchedulerOutput


@dataclass
class Pooler:
    """Pooling requests' running state: which requests pool (none: no per-step scan) and
    their partial results (a mean's sum, a first token's row, every row so far for the
    token tasks)."""

    pooling_ids: set[str] = field(default_factory=set)
    pool_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    pool_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, req_id: str) -> None:
        self.pooling_ids.add(req_id)

    def forget(self, req_id: str) -> None:
        self.pooling_ids.discard(req_id)
        self.pool_sums.pop(req_id, None)
        self.pool_rows.pop(req_id, None)

    def pool(self, inputs: StepInputs, out: SchedulerOutput, hidden: torch.Tensor,
             requests: dict[str, CachedRequestState],
             classify: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, list[float] | list[list[float]]]:
        """Pooling requests: fold this chunk's final hidden states into the request's
        vector; once its prompt is complete, the vector (the classification head's logits
        for ``classify``), cut to ``dimensions`` and normalised as asked — or for the token
        tasks one such row per prompt token. A partial result outlives a swap-out (kept
        until the request finishes); a request that recomputes starts again at token 0."""
        result: dict[str, list[float] | list[list[float]]] = {}
        if not self.pooling_ids:
            return result
        for b, req_id in enumerate(inputs.req_ids):
            state = requests[req_id]
            pooling = state.params.pooling
            start, num_prompt = state.num_computed_tokens, state.num_prompt_tokens
            if pooling is None or start >= num_prompt:
                continue
            end = min(start + out.num_scheduled_tokens[req_id], num_prompt)
            first = inputs.token_starts[b]
            rows = hidden[first:first + end - start].float()
            kind = pooling.pooling_type
            if kind == "mean":
                total = rows.sum(0)
                if start > 0:
                    total += self.pool_sums[req_id]
                self.pool_sums[req_id] = total
            elif kind == "cls" and start == 0:
                self.pool_sums[req_id] = rows[0]
            elif kind == "all":
                kept = [] if start == 0 else self.pool_rows[req_id]
                kept.append(rows.clone())  # hidden is reused by the next step
                self.pool_rows[req_id] = kept
            if end < num_prompt:
                continue
            if kind == "last":
                vectors = rows[-1:]
            elif kind == "all":
                vectors = torch.cat(self.pool_rows.pop(req_id))
            else:
                vectors = self.pool_sums.pop(req_id)[None]
                if kind == "mean":
                    vectors = vectors / num_prompt
            if pooling.task in ("classify", "token_classify"):
                vectors = classify(vectors)
            if pooling.dimensions is not None:
                vectors = vectors[:, :pooling.dimensions]
            if pooling.normalize and pooling.task in ("embed", "token_embed"):
                vectors = torch.nn.functional.normalize(vectors, dim=-1)  # not class logits
            result[req_id] = vectors.tolist() if kind == "all" else vectors[0].tolist()
        return result


def prompt_logprobs(inputs: StepInputs, out: SchedulerOutput, hidden: torch.Tensor,
                requests: dict[str, CachedRequestState],
                compute_logits: Callable[[torch.Tensor], torch.Tensor]
                ) -> dict[str, tuple[int, list[dict[int, Logprob] | None]]]:
    """For requests asking prompt_logprobs: (index of the first prompt token covered,
    the logprobs of each prompt token this chunk predicts; None for token 0)."""
    result = {}
    starts = inputs.token_starts  # a request with prompt left is one contiguous row
    for b, req_id in enumerate(inputs.req_ids):
        state = requests[req_id]
        k = state.params.prompt_logprobs
        start = state.num_computed_tokens
        if k is None or start >= state.num_prompt_tokens:
            continue
        end = min(start + out.num_scheduled_tokens[req_id], state.num_prompt_tokens)
        # hidden at position p predicts token p + 1
        rows = torch.arange(starts[b], starts[b] + end - start)
        targets = state.token_ids[start + 1: min(end + 1, state.num_prompt_tokens)]
        rows = rows[: len(targets)]
        lp = torch.log_softmax(compute_logits(hidden[rows]).float(), dim=-1)
        target_lp = lp.gather(1, torch.tensor(targets, dtype=torch.int64,
                                              device=lp.device).view(-1, 1))
        ranks = (lp >= target_lp).sum(dim=-1).tolist()  # ties count, as vLLM's
        target_lp = target_lp.view(-1).tolist()
        entries: list[dict[int, Logprob] | None] = [None] if start == 0 else []
        top = lp.topk(k, dim=-1) if k else None
        for i, tok in enumerate(targets):
            entries.append(logprob_entry(
                tok, target_lp[i], ranks[i],
                top.indices[i].tolist() if top is not None else [],
                top.values[i].tolist() if top is not None else []))
        result[req_id] = (0 if start == 0 else start + 1, entries)
    return result
