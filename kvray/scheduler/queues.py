"""Waiting queues, one class per scheduling policy (the swap queue uses them too).

Both answer the same small interface (``add``, ``add_front``, ``peek``, ``pop``, ``remove``)
so the scheduler never branches on the policy name.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from kvray.scheduler.request import Request


class WaitingQueue(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...

    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""
        ...

    def add_front(self, request: Request) -> None:
        """Queue a preempted request so it is admitted again before later arrivals."""
        ...

    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._deque: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._deque)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._deque)

    def add(self, request: Request) -> None:
        self._deque.append(request)

    def add_front(self, request: Request) -> None:
        self._deque.appendleft(request)

    def peek(self) -> Request:
        return self._deque[0]

    def pop(self) -> Request:
        return self._deque.popleft()

    def remove(self, request: Request) -> None:
        self._deque.remove(request)


class PriorityQueue:
    """Lowest (priority, arrival) first. A preempted request keeps its key, which already
    places it ahead of every later arrival of the same priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*request.sort_key(), next(self._tiebreak), request))

    add_front = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The queue for ``scheduling_policy`` (``fcfs`` or ``priority``)."""
    queues = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    return queues[policy]()
