"""A request as the scheduler sees it: token ids, progress, status, timing.

Pure Python. There is no prefill or decode phase: ``num_computed_tokens`` catches up to
``num_tokens`` and the scheduler decides each step how far it advances.
"""

from __future__ import annotations

import enum
import time

from kvray.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


def next_draft_length(num_drafts: int, num_accepted: int) -> int:
    """How many drafts a request proposes after ``num_accepted`` of its ``num_drafts`` were
    accepted: one more than were accepted, twice as many after a full accept. Every draft
    costs a row of the forward (on CPU, compute); rejected ones are waste."""
    return 2 * num_drafts if num_accepted == num_drafts else num_accepted + 1


class Request:
    """One sequence to generate (a prompt with ``n > 1`` becomes n requests)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0,
                 max_tokens: int = 16, seed: int | None = None, lora_id: int = 0) -> None:
        self.request_id = request_id
        self.lora_id = lora_id  # the LoRA adapter it runs with (0: the base model)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what fits max_model_len
        self.seed = seed  # sampling generator seed (params.seed + index among n siblings)
        self.output_token_ids: list[int] = []
        # tokens the last step added: fewer than it sampled when a stop or the length
        # ended the request inside a step's accepted drafts
        self.num_new_tokens = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission (-1 = not yet)
        self.num_preemptions = 0
        self.num_swapped_blocks = 0  # blocks held in the swap pool while SWAPPED
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        # KV tier entries found for its blocks (None: not looked up; cleared when a fetch
        # failed, so it recomputes instead of trying again)
        self.tier_found: dict | None = None
        self.tier_noted = 0  # leading blocks offered to the tier (kv_offload_mode: computed)
        self.spec_token_ids: list[int] = []  # draft tokens proposed for its next step
        self.spec_len = 1 << 30  # most drafts to propose next (adapted to acceptance)
        # timing (monotonic seconds)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: priority value, then arrival."""
        return (self.priority, self.arrival_time)
