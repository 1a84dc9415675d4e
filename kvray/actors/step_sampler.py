"""A step's logits rows into its :class:`~kvray.scheduler.output.ModelRunnerOutput`: one token
per request that samples, or with drafts (speculative decoding) the accepted drafts and one
more; greedy rows skip building a sampling batch; logprobs where asked."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvray.actors.sampling_batch import sampling_batch
from kvray.actors.step_state import CachedRequestState, StepInputs
from kvray.kernels.sampling import (
    SamplerOutput,
    SpecSpan,
    row_argmax,
    sample,
    sample_speculative,
)
from kvray.outputs import logprob_entry
from kvray.scheduler.output import ModelRunnerOutput


@dataclass
class StepSampler:
    """Draws from each seeded request's own generator (kept across its steps, and across
    preemption) and from one default generator for the rest."""

    device: torch.device
    default_generator: torch.Generator
    generators: dict[str, torch.Generator] = field(default_factory=dict)

    def add(self, req_id: str, seed: int | None) -> None:
        """A new request: its own generator where it has a seed (kept if it has one)."""
        if seed is not None and req_id not in self.generators:
            self.generators[req_id] = torch.Generator(self.device).manual_seed(seed)

    def forget(self, req_id: str) -> None:
        """A finished request: its generator goes (a preempted one keeps it)."""
        self.generators.pop(req_id, None)

    def sample(self, inputs: StepInputs, states: list[CachedRequestState],
               logits: torch.Tensor, prompt_logprobs: dict,
               bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Sample each request that samples this step (``states``, in ``inputs``'s
        sample-row order): one token from its row, or with drafts (speculative decoding)
        the accepted drafts and one more from its rows."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]] | None] = {}
        sampled_lp: dict[str, list[float]] = {}
        plain = [i for i in range(len(states)) if i not in inputs.spans]
        if plain:
            rows = [inputs.first_rows[i] for i in plain]
            group = [states[i] for i in plain]
            rows_logits = logits[rows] if len(rows) < logits.shape[0] else logits
            result = None
            if bitmask is None and all(s.params.plain_greedy_after(len(s.output_token_ids))
                                       for s in group):
                # Every row takes its argmax: no sampling batch to build (its seven columns
                # and their checks were ~0.5 ms of a ~19 ms batch-1 step on a 2-core CPU).
                tokens = row_argmax(rows_logits).tolist()
            else:
                batch = sampling_batch(
                    [s.params for s in group], [self.generators.get(s.req_id) for s in group],
                    [s.prompt_token_ids for s in group], [s.output_token_ids for s in group],
                    device=self.device,
                    token_bitmask=None if bitmask is None else bitmask[rows])
                result = sample(rows_logits, batch, self.default_generator)
                tokens = result.token_ids.tolist()
            self._collect(group, [[t] for t in tokens], result, list(range(len(group))),
                          sampled, logprobs, sampled_lp)
        if inputs.spans:
            self._sample_spans(inputs, logits, bitmask, states, sampled, logprobs, sampled_lp)
        req_ids = inputs.req_ids
        return ModelRunnerOutput(
            req_ids, [sampled.get(r, []) for r in req_ids], [logprobs.get(r) for r in req_ids],
            [sampled_lp.get(r, []) for r in req_ids], prompt_logprobs)

    def _sample_spans(self, inputs: StepInputs, logits: torch.Tensor,
                      bitmask: torch.Tensor | None, states: list[CachedRequestState],
                      sampled: dict, logprobs: dict, sampled_lp: dict) -> None:
        """Verify the drafts of every request that has some (one batch of all their rows;
        row j of a request sees its outputs plus its first j drafts, for penalties)."""
        rows, params, gens, prompts, outputs, spans, group = [], [], [], [], [], [], []
        for i, drafts in inputs.spans.items():
            state = states[i]
            gen = self.generators.get(state.req_id)
            spans.append(SpecSpan(len(rows), drafts, state.params.is_greedy, gen))
            group.append(state)
            for j in range(len(drafts) + 1):
                rows.append(inputs.first_rows[i] + j)
                params.append(state.params)
                gens.append(gen)
                prompts.append(state.prompt_token_ids)
                outputs.append(state.output_token_ids + drafts[:j])
        batch = sampling_batch(
            params, gens, prompts, outputs, device=self.device,
            token_bitmask=None if bitmask is None else bitmask[rows])
        tokens, _, result = sample_speculative(logits[rows], batch, spans,
                                               self.default_generator)
        offsets, at = [], 0
        for toks in tokens:
            offsets.append(at)
            at += len(toks)
        self._collect(group, tokens, result, offsets, sampled, logprobs, sampled_lp)

    @staticmethod
    def _collect(group: list[CachedRequestState], tokens: list[list[int]],
                 result: SamplerOutput | None, offsets: list[int], sampled: dict,
                 logprobs: dict, sampled_lp: dict) -> None:
        """File each request's tokens, and their logprobs (rows ``offsets[i]`` on of
        ``result``) for those that asked."""
        lps = result.logprobs.tolist() if result is not None and result.logprobs is not None \
            else None
        top_ids = result.top_token_ids.tolist() \
            if result is not None and result.top_token_ids is not None else None
        top_lps = result.top_logprobs.tolist() \
            if result is not None and result.top_logprobs is not None else None
        ranks = result.ranks.tolist() if lps is not None else None
        for state, toks, at in zip(group, tokens, offsets, strict=True):
            sampled[state.req_id] = toks
            k = state.params.logprobs
            if k is None or lps is None:
                continue
            sampled_lp[state.req_id] = lps[at:at + len(toks)]
            entries = []
            for j, tok in enumerate(toks):
                top = k and top_ids is not None
                entries.append(logprob_entry(tok, lps[at + j], ranks[at + j],
                                             top_ids[at + j][:k] if top else [],
                                             top_lps[at + j][:k] if top else []))
            logprobs[state.req_id] = entries
