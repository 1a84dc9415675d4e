"""What a slow consumer of a request's output stream gets: the outputs that queued up while
it was busy, folded into one, so that a busy server sends fewer, larger chunks instead of
falling further behind. Used by the engine's own streams and by the Serve ingress' client."""

from __future__ import annotations

import asyncio
from typing import Any


def fold_queued(first: Any, queue: asyncio.Queue, delta: bool
                ) -> tuple[Any, BaseException | None]:
    """``first`` with the outputs queued behind it folded in, taken off ``queue`` without
    waiting: DELTA outputs (``delta``) add up, a cumulative one supersedes the one before.
    Folding stops at the first error, taken off the queue and returned beside the folded
    output (the caller decides whether it wins over the outputs or comes after them). An
    error as ``first`` is returned as it is, nothing folded."""
    item = first
    while not isinstance(item, BaseException) and not queue.empty():
        later = queue.get_nowait()
        if isinstance(later, BaseException):
            return item, later
        if delta:
            item.add(later)
        else:
            item = later
    return item, None
