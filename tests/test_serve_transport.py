"""The ingress' half of a request's call to a model replica (:mod:`kvray.serve.transport`):
when the client goes away before the call's first item, the call is cancelled only once it
has reached its replica (Serve can lose a cancel that lands while it assigns the call)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvray.serve.transport import first_item

pytestmark = pytest.mark.unit


class _Call:
    """A streaming call whose first item comes when ``placed`` is set; notes whether
    ``cancel`` came before or after that."""

    def __init__(self, fail: bool = False) -> None:
        self.placed = asyncio.Event()
        self.fail = fail
        self.cancels: list[bool] = []  # per cancel(): whether the call was placed then

    async def __anext__(self) -> str:
        await self.placed.wait()
        if self.fail:
            raise RuntimeError("admission refused")
        return "replica-1"

    def cancel(self) -> None:
        self.cancels.append(self.placed.is_set())


async def _leave_then_place(call: _Call) -> None:
    """The client goes away while Serve is assigning ``call``; later the call is placed."""
    waiter = asyncio.ensure_future(first_item(call))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert call.cancels == []  # not while it may be mid-assignment
    call.placed.set()
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_call_cancelled_before_its_first_item_is_cancelled_once_placed():
    async def scenario() -> list[bool]:
        call = _Call()
        await _leave_then_place(call)
        return call.cancels

    assert asyncio.run(scenario()) == [True]


def test_a_failed_admission_after_the_client_left_is_retrieved_and_cancelled():
    async def scenario() -> tuple[list[bool], list[dict]]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        call = _Call(fail=True)
        await _leave_then_place(call)
        gc.collect()  # an unretrieved task exception is reported when the task is freed
        await asyncio.sleep(0)
        return call.cancels, errors

    cancels, errors = asyncio.run(scenario())
    assert cancels == [True]
    assert errors == []


def test_the_first_item_passes_through_when_nobody_cancels():
    async def scenario() -> tuple[str, list[bool]]:
        call = _Call()
        call.placed.set()
        return await first_item(call), call.cancels

    assert asyncio.run(scenario()) == ("replica-1", [])
