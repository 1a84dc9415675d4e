"""What a lagging consumer of an output stream gets (``fold_queued``): queued DELTA outputs
added into one, a cumulative output superseding the ones before it, and an error stopping
the fold and handed back beside what came before it."""

from __future__ import annotations

import asyncio

import pytest

from kvray.engine.stream_fold import fold_queued
from kvray.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.unit


def _out(tokens: list[int], finished: bool = False) -> RequestOutput:
    seq = CompletionOutput(0, "".join(f"<{t}>" for t in tokens), list(tokens), None, None)
    return RequestOutput("r", None, None, None, [seq], finished)


def _queue(*items) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_queued_deltas_add_up_into_one_output():
    q = _queue(_out([2]), _out([3], finished=True))
    item, error = fold_queued(_out([1]), q, delta=True)
    assert error is None and q.empty()
    assert item.outputs[0].token_ids == [1, 2, 3] and item.outputs[0].text == "<1><2><3>"
    assert item.finished


def test_a_later_cumulative_output_supersedes_the_earlier_ones():
    last = _out([1, 2, 3])
    item, error = fold_queued(_out([1]), _queue(_out([1, 2]), last), delta=False)
    assert item is last and error is None


def test_an_error_stops_the_fold_and_comes_back_beside_the_outputs_before_it():
    err = RuntimeError("engine failed")
    q = _queue(_out([2]), err, _out([9]))
    item, error = fold_queued(_out([1]), q, delta=True)
    assert item.outputs[0].token_ids == [1, 2] and error is err
    assert q.qsize() == 1  # what came after the error stays queued


def test_an_error_first_is_returned_as_it_is():
    err = RuntimeError("deadline")
    q = _queue(_out([2]))
    item, error = fold_queued(err, q, delta=True)
    assert item is err and error is None and q.qsize() == 1
