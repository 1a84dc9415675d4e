"""What a worker keeps of each request between steps, and the tensors of one step's batch
(:class:`~kvray.actors.model_runner.ModelRunner` builds them; sampling and the prompt
outputs read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvray.kernels.attention import AttentionMetadata
from kvray.sampling_params import SamplingParams
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.structured_output import Matcher


@dataclass
class CachedRequestState:
    """A request as this worker holds it: all its tokens, its blocks, its progress."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # sliced once, for penalties
    matcher: Matcher | None = None  # structured outputs (output rank only)
    lora_slot: int = -1  # its adapter's slot (-1: the base model)


def placeholder_tokens(out: SchedulerOutput, prev: ModelRunnerOutput | None
                       ) -> dict[str, list[int]]:
    """The tokens the previous step sampled for ``out``'s placeholder requests (async
    scheduling), which every rank appends before building the batch."""
    if not out.placeholder_req_ids:
        return {}
    if prev is None:
        raise RuntimeError("a step with placeholders came without the previous step's output")
    sampled = dict(zip(prev.req_ids, prev.sampled_token_ids, strict=True))
    flying = {r: sampled.get(r) for r in out.placeholder_req_ids}
    missing = sorted(r for r, toks in flying.items() if not toks)
    if missing:
        raise RuntimeError(f"the previous step sampled no token for placeholder requests "
                           f"{missing[:5]}")
    return flying


@dataclass
class StepInputs:
    """One step's batch: token ids, attention metadata and which rows sample."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    req_ids: list[str]  # the step's requests
    sample_rows: list[int]  # index (in req_ids) of each request that samples
    logits_index: torch.Tensor  # token index of each logits row (hidden state to project)
    first_rows: list[int] = field(default_factory=list)  # per sample row: its logits row
    # speculative decoding: sample row -> its drafts (rows first_rows[i] .. + len(drafts))
    spans: dict[int, list[int]] = field(default_factory=dict)
    token_starts: list[int] = field(default_factory=list)  # per request: its first token
