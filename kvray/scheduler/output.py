"""What the scheduler tells the workers each step, incrementally.

Full data only for requests the workers have not seen (new or resumed after preemption);
for the others only their new blocks and the token(s) appended since they last ran.
Workers keep per-request state, so the message grows with the change, not the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvray.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + any output already generated (resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None  # per-request generator seed (None: the engine's shared generator)
    lora_slot: int = -1  # the worker slot of its LoRA adapter (-1: the base model)


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # tokens appended since the request last ran
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    finished_req_ids: set[str] = field(default_factory=set)  # workers drop their state
    preempted_req_ids: set[str] = field(default_factory=set)  # workers drop batch state
    # KV swap, done by every worker at the start of the step, before the forward pass:
    swap_out: dict[str, list[int]] = field(default_factory=dict)  # req -> blocks to save
    swap_in: dict[str, list[int]] = field(default_factory=dict)  # req -> blocks to restore to
    swap_drop: set[str] = field(default_factory=set)  # saved copies no longer needed
    # Speculative decoding: req -> draft tokens fed after its last token this step (they
    # are the tail of its num_scheduled_tokens); the workers verify them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Async scheduling: requests whose input this step starts with the token the previous
    # step (in submission order) sampled for them, unknown when this step was scheduled:
    # each worker appends it from that step's output before building the batch.
    placeholder_req_ids: set[str] = field(default_factory=set)
    # LoRA adapters to put in worker slots before this step's forward (LoRALoad each)
    lora_loads: list = field(default_factory=list)
    # KV tier (kvray.scheduler.kv_tier), before the forward and before any swap: copy these
    # evicted blocks out (block id, key), then fill fetched blocks from the tier's copies
    # (req -> [(block id, handles per worker)]).
    kv_offload: list[tuple[int, int]] = field(default_factory=list)
    kv_fetch: dict[str, list[tuple[int, list]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def is_noop(self) -> bool:
        """Nothing to run and nothing for the workers to update: may be skipped."""
        return not (self.num_scheduled_tokens or self.finished_req_ids or
                    self.preempted_req_ids or self.swap_out or self.swap_in or self.swap_drop
                    or self.lora_loads or self.kv_offload)


@dataclass
class ModelRunnerOutput:
    """What the sampling worker returns: per scheduled request, in batch order."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a request mid-prefill (nothing sampled)
    logprobs: list[list[dict[int, float]] | None]  # per sampled token: id -> logprob
    sampled_logprobs: list[list[float]]  # log-prob of each sampled token ([] if not asked)
    # req -> (first prompt token index covered, entries), chunk by chunk
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float] | None]]] = field(
        default_factory=dict)
    # Requests whose KV a worker could not save to (or restore from) the swap pool this
    # step; the scheduler makes them recompute. Merged over all workers by the executor.
    failed_swaps: set[str] = field(default_factory=set)
    # KV tier: evicted blocks copied out this step, key -> [(handle, nbytes) per worker];
    # merged over the workers by the executor (a key a worker could not store is left out).
    kv_offloaded: dict[int, list[tuple[object, int]]] = field(default_factory=dict)
    # Pooling requests whose prompt completed this step: req -> embedding / class logits.
    pooled: dict[str, list[float] | list[list[float]]] = field(default_factory=dict)
    # Speculative decoding with a draft model: req -> draft tokens for its next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
