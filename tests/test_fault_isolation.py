"""A failure that belongs to one request ends that request only, in process: the other
requests of the same steps finish with the tokens they would have had, no block leaks, and
the client sees an error without internal details."""

from __future__ import annotations

import asyncio

import pytest

from kvray.engine.async_engine import AsyncLLM
from kvray.engine.detokenizer import IncrementalDetokenizer
from kvray.errors import KVRayError
from kvray.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.engine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def engine(tiny_async_llm):
    return tiny_async_llm(max_model_len=128, num_gpu_blocks_override=64)


async def _collect(engine: AsyncLLM, request_id: str, prompt: str, params=PARAMS):
    tokens: list[int] = []
    async for out in engine.generate(request_id, prompt, params):
        for c in out.outputs:
            tokens += c.token_ids
    return tokens


@pytest.mark.parametrize("n", [1, 2])
def test_a_detokenizer_failure_ends_only_its_request(engine, monkeypatch, n):
    poisoned = "the word poison"
    original = IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids):
        if self._ids[:len(poison_ids)] == poison_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, token_ids)

    poison_ids = engine.tokenizer(poisoned)["input_ids"]

    async def main():
        want = await _collect(engine, "alone", "Hello world")
        monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=n,
                                output_kind=RequestOutputKind.DELTA)
        results = await asyncio.gather(
            _collect(engine, "good", "Hello world"),
            _collect(engine, "bad", poisoned, params), return_exceptions=True)
        return want, results

    want, (good, bad) = asyncio.run(main())
    assert good == want
    assert isinstance(bad, KVRayError) and bad.status == 500
    assert "aborted" in bad.message and "Traceback" not in bad.message
    sched = engine.engine.scheduler
    assert not sched.running and len(sched.waiting) == 0
    assert sched.kv.pool.num_free == sched.kv.num_blocks
    assert not engine.engine.has_unfinished_requests()
