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
    their partial sums (a mean's, a first token's)."""

    pooling_ids: set[str] = field(default_factory=set)
    pool_sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, req_id: str) -> None:
        self.pooling_ids.add(req_id)

    def forget(self, req_id: str) -> None:
        self.pooling_ids.discard(req_id)
        self.pool_sums.pop(req_id, None)

    def pool(self, inputs: StepInputs, out: SchedulerOutput, hidden: torch.Tensor,
             requests: dict[str, CachedRequestState],
             classify: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, list[float]]:
        """Pooling requests: fold this chunk's final hidden states into the request's
        vector; once its prompt is complete, the vector (the classification head's logits
        for ``classify``), cut to ``dimensions`` and normalised as asked. A mean's running
        sum outlives a swap-out (kept until the request finishes); a request that
        recomputes starts it again at token 0."""
        result: dict[str, list[float]] = {}
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
            if pooling.pooling_type == "mean":
                total = rows.sum(0)
                if start > 0:
                    total += self.pool_sums[req_id]
                self.pool_sums[req_id] = total
            elif pooling.pooling_type == "cls" and start == 0:
                self.pool_sums[req_id] = rows[0]
            if end < num_prompt:
                continue
            if pooling.pooling_type == "last":
                vector = rows[-1]
            else:
                vector = self.pool_sums.pop(req_id)
                if pooling.pooling_type == "mean":
                    vector = vector / num_prompt
            if pooling.task == "classify":
                vector = classify(vector[None])[0]
            if pooling.dimensions is not None:
                vector = vector[:pooling.dimensions]
            if pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            result[req_id] = vector.tolist()
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
        ranks = ((lp > target_lp).sum(dim=-1) + 1).tolist()
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
