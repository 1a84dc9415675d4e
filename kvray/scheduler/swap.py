"""Bookkeeping of the swap pool: which preempted requests have their KV saved there, and
how many of its blocks they use. The copies themselves live with the workers."""

from __future__ import annotations

from kvray.config import EngineConfig
from kvray.scheduler.queues import WaitingQueue, make_waiting_queue
from kvray.scheduler.request import Request, RequestStatus


def swap_pool_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks the swap pool holds: ``swap_space`` GiB over the bytes of a block on the
    largest worker shard, when ``preemption_mode`` may swap (else 0)."""
    if config.scheduler.preemption_mode not in ("swap", "auto"):
        return 0
    return int(config.cache.swap_space * (1 << 30)) // bytes_per_block


class SwapSpace:
    """Swapped-out requests, bounded by ``capacity_blocks``, in the order they come back:
    the scheduling policy's (fcfs: oldest swapped first; priority: lowest (priority,
    arrival) first, so a more important request is never stuck behind a less important
    one)."""

    def __init__(self, capacity_blocks: int, policy: str = "fcfs") -> None:
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0
        self.queue: WaitingQueue = make_waiting_queue(policy)
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
        self.queue.add(request)

    def peek(self) -> Request:
        return self.queue.peek()

    def swap_in(self) -> Request:
        """Take the next swapped request back; return it (its blocks are restored)."""
        request = self.queue.pop()
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
