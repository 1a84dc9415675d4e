"""The plan of one scheduling step, built request by request before it becomes a
SchedulerOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvray.scheduler.request import Request


@dataclass
class StepPlan:
    """What one :meth:`~kvray.scheduler.scheduler.Scheduler.schedule` call has decided so
    far: tokens per request, blocks added, drafts to verify."""

    budget: int  # tokens still free in this step
    max_requests: int  # requests this step may take (its micro-batch's share)
    num_scheduled: dict[str, int] = field(default_factory=dict)  # req -> tokens, batch order
    new_blocks: dict[str, list[int]] = field(default_factory=dict)  # req -> block ids added
    spec: dict[str, list[int]] = field(default_factory=dict)  # req -> drafts it verifies
    # async scheduling: requests whose first token this step is the one the step in flight
    # samples for them
    placeholders: set[str] = field(default_factory=set)
    preempted: bool = False  # a request lost its blocks this step
    admitted_waiting: bool = False  # a waiting request joined the batch this step

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.num_scheduled) >= self.max_requests

    def schedule(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.new_blocks[request.request_id] = block_ids
        self.budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Take back a request scheduled earlier in this step (it was just preempted)."""
        self.budget += self.num_scheduled.pop(request.request_id, 0)
        self.new_blocks.pop(request.request_id, None)
        self.spec.pop(request.request_id, None)
        self.placeholders.discard(request.request_id)
