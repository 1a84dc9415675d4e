"""Bookkeeping of the swap pool: which preempted requests have their KV saved there, and
how many of its blocks they use. The copies themselves live with the workers."""

from __future__ import annotations

from collections import deque

from kvray.scheduler.request import Request, RequestStatus


class SwapSpace:
    """Swapped-out requests, oldest first, bounded by ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0
        self.queue: deque[Request] = deque()
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        self._to_drop: set[str] = set()  # saved copies the workers may forget

    def __len__(self) -> int:
        return len(self.queue)

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks > 0 and self.used_blocks + num_blocks <= self.capacity_blocks

    def swap_out(self, request: Request, num_blocks: int) -> None:
        """Record that ``request``'s first ``num_blocks`` blocks are being saved."""
        request.status = RequestStatus.SWAPPED
        request.num_swapped_blocks = num_blocks
        self.used_blocks += num_blocks
        self.num_swaps_out += 1
        self.queue.append(request)

    def peek(self) -> Request:
        return self.queue[0]

    def swap_in(self) -> Request:
        """Take the oldest swapped request back; return it (its blocks are restored)."""
        request = self.queue.popleft()
        self.used_blocks -= request.num_swapped_blocks
        request.num_swapped_blocks = 0
        self.num_swaps_in += 1
        return request

    def discard(self, request: Request) -> None:
        """``request`` ends while swapped: free its share and let the workers drop it."""
        self.queue.remove(request)
        self.used_blocks -= request.num_swapped_blocks
        request.num_swapped_blocks = 0
        self._to_drop.add(request.request_id)

    def take_drops(self) -> set[str]:
        """The copies to drop, once (they go out with the next SchedulerOutput)."""
        drops, self._to_drop = self._to_drop, set()
        return drops
