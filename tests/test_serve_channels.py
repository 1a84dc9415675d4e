"""Two model replicas behind Ray Serve's OpenAI ingress. Each request's outputs come back
on its replica's carrier for the ingress (one Ray item per engine step for all of them),
a call Serve routes to that replica by name: concurrent streams spread over both replicas
each get exactly their own tokens, and both replicas served some. Requests go by their
prompt's prefix: follow-ups of a prompt land where its prefix is cached."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.helpers.server import API_KEY, launch_server
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    model = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("channels") / "tiny-llama")
    with launch_server(model, ["--num-replicas", "2"]) as base:
        yield base, model.name


def _by_replica(base: str, series: str = "kvray:engine_decode_tokens_total"
                ) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.findall(rf'^{series}\{{[^}}]*replica="([^"]+)"[^}}]*\}} (\S+)', text, re.M)
    return {replica: float(value) for replica, value in found}


def _decode_tokens_by_replica(base: str) -> dict[str, float]:
    return _by_replica(base)


def test_streams_on_two_replicas_each_get_their_own_tokens(two_replicas):
    base, name = two_replicas
    prompts = [f"Story {i}: once upon a time" + " and then" * (i % 5) for i in range(16)]
    lengths = [6 + 9 * (i % 4) for i in range(16)]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    expected = [client.completions.create(model=name, prompt=p, max_tokens=n, temperature=0)
                .choices[0].text for p, n in zip(prompts, lengths, strict=True)]

    async def stream(aclient: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str, int]:
        text, finish, chunks = "", None, 0
        events = await aclient.completions.create(model=name, prompt=prompt, max_tokens=n,
                                                  temperature=0, stream=True)
        async for chunk in events:
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, chunks

    async def batch(aclient: openai.AsyncOpenAI) -> list[str]:
        # several prompts in one request: their calls share one HTTP request's context
        resp = await aclient.completions.create(model=name, prompt=prompts[:4], max_tokens=6,
                                                temperature=0)
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    async def all_streams() -> tuple[list[tuple[str, str, int]], list[str]]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY,
                                      max_retries=0) as aclient:
            many = asyncio.gather(*(stream(aclient, p, n)
                                    for p, n in zip(prompts, lengths, strict=True)))
            return await asyncio.gather(many, batch(aclient))

    for _ in range(2):  # the second round reuses carriers the first one opened
        got, batched = asyncio.run(asyncio.wait_for(all_streams(), 120))
        assert [(t, f) for t, f, _ in got] == [(e, "length") for e in expected]
        # streamed, not sent whole: a loaded ingress may coalesce one short stream's tokens
        # into a single chunk, but not every stream's
        assert sum(chunks for _, _, chunks in got) > len(got)
        assert batched == [client.completions.create(model=name, prompt=p, max_tokens=6,
                                                     temperature=0).choices[0].text
                           for p in prompts[:4]]

    deadline = time.monotonic() + 60  # replica stats reach the ingress every ~0.5 s
    while True:
        served = {r: v for r, v in _decode_tokens_by_replica(base).items() if v > 0}
        if len(served) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(served) == 2, f"one replica served every request: {served}"



@pytest.fixture
def bare_replica(tiny_model_dir):
    """The model replica's class over a real in-process engine, without Ray Serve: its
    channel bookkeeping driven call by call."""
    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM
    from kvray.serve.replica import LLMServer

    engine = AsyncLLM(config_from_flat(dict(model=str(tiny_model_dir("llama_gqa")),
                                            dtype="float32", block_size=4, max_model_len=128,
                                            num_gpu_blocks_override=64)))
    replica = LLMServer.func_or_class.__new__(LLMServer.func_or_class)
    replica.engine, replica.replica_id, replica._channels = engine, "r1", {}
    try:
        yield replica
    finally:
        engine.shutdown()


async def _until(condition, timeout_s: float = 30.0):
    """Poll ``condition`` until it is true or ``timeout_s`` passed; its last value (a wait
    for the event itself, with a deadline only against a hang)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return value


def _delta_params(max_tokens: int):
    from kvray.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def test_a_dead_ingress_leaves_no_channel_on_the_model_replica(bare_replica):
    """The ingress dies mid-stream: its carrier call on the model replica is cancelled, the
    replica aborts the channel's requests, and the channel (with the outputs nobody will
    read) is gone once they end; a new carrier of the same name starts afresh."""
    replica, params = bare_replica, _delta_params(100)

    async def drain(gen) -> list:
        return [item async for item in gen]

    async def main() -> tuple[dict, list, list]:
        submit = replica.submit("ingress-a", "req-1", "Hello world", params)
        assert await submit.__anext__() == "r1"
        submitted = asyncio.create_task(drain(submit))
        carrier = replica.carry("ingress-a")
        assert await carrier.__anext__() == "r1"
        first = await carrier.__anext__()  # outputs flow
        # more of them pile up, unread
        assert await _until(lambda: replica._channels["ingress-a"].pending)
        await carrier.aclose()  # the ingress died: Serve cancels its carrier call
        await asyncio.wait_for(submitted, 30)  # aborted by the replica (or finished)
        left = dict(replica._channels)
        again = replica.carry("ingress-a")  # the same name later: a fresh channel
        return left, first, [await again.__anext__(), replica._channels["ingress-a"].pending]

    left, first, (landed, pending) = asyncio.run(main())
    assert first and all(rid == "req-1" for rid, _ in first)
    assert left == {}
    assert landed == "r1" and pending == []


def test_a_channel_whose_carrier_never_comes_is_dropped_and_one_that_comes_late_is_read(
        bare_replica, monkeypatch):
    """Requests admitted on a channel whose ingress died before opening its carrier: the
    channel goes after UNCARRIED_CHANNEL_S. A carrier that opens after a short request
    already ended still gets all of its outputs."""
    from kvray.serve import transport

    monkeypatch.setattr(transport, "UNCARRIED_CHANNEL_S", 0.3)
    replica, params = bare_replica, _delta_params(3)

    async def run_uncarried(channel: str, request_id: str) -> None:
        async for _ in replica.submit(channel, request_id, "Hello world", params):
            pass

    async def main() -> tuple[bool, bool, list]:
        await run_uncarried("dead", "req-dead")
        await run_uncarried("late", "req-late")
        carrier = replica.carry("late")  # opens after its request ended
        assert await carrier.__anext__() == "r1"
        batch = await carrier.__anext__()
        await carrier.aclose()
        # Both go: "dead" once UNCARRIED_CHANNEL_S passed, "late" with its carrier.
        await _until(lambda: not {"dead", "late"} & replica._channels.keys(), timeout_s=10)
        return "dead" in replica._channels, "late" in replica._channels, batch

    dead_left, late_left, batch = asyncio.run(main())
    assert not dead_left and not late_left
    assert [rid for rid, _ in batch] == ["req-late"] * len(batch)
    assert sum(len(out.outputs[0].token_ids) for _, out in batch) == 3
    assert batch[-1][1].finished


def _settled(base: str, series: str) -> dict[str, float]:
    """``series`` by replica once two reads 0.6 s apart agree (stats reach the ingress every
    0.5 s)."""
    last = None
    for _ in range(60):
        now = _by_replica(base, series)
        if now == last:
            return now
        last = now
        time.sleep(0.6)
    return last


def test_follow_ups_go_to_the_replica_that_cached_their_prefix(two_replicas):
    """A long prompt, then follow-ups that extend it (a growing chat), one at a time: each
    lands on the replica holding the prefix, so every follow-up's prefix is a cache hit.
    (Picking the less loaded of two at random would split them over both replicas.)"""
    base, name = two_replicas
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    before = _settled(base, "kvray:prefix_cache_hits_total")
    queries_before = _settled(base, "kvray:prefix_cache_queries_total")
    prompt = "You are a terse assistant for a shipping company. " * 12
    for turn in range(6):
        prompt += f" Question {turn}: where is parcel {turn * 7}? Answer:"
        out = client.completions.create(model=name, prompt=prompt, max_tokens=4,
                                        temperature=0)
        prompt += out.choices[0].text
    # Hits and queries settled together, once they hold the follow-ups: settled one after
    # the other, a loaded host could show the queries updated and the hits not yet.
    last = None
    for _ in range(60):
        now = (_by_replica(base, "kvray:prefix_cache_hits_total"),
               _by_replica(base, "kvray:prefix_cache_queries_total"))
        if now == last and sum(now[1].values()) > sum(queries_before.values()):
            break
        last = now
        time.sleep(0.6)
    hits, queries = now
    gained = {r: hits.get(r, 0) - before.get(r, 0) for r in hits}
    asked = {r: queries.get(r, 0) - queries_before.get(r, 0) for r in queries}
    assert [r for r, n in asked.items() if n > 0] == [max(asked, key=asked.get)], asked
    assert sum(gained.values()) >= 0.8 * sum(asked.values()) * 5 / 6, (gained, asked)
