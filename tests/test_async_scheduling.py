"""Async scheduling (the next step scheduled while the current one runs on the step
thread) gives exactly the synchronous engine's outputs: tokens, text, finish reasons,
logprobs, seeded samples, penalties, stop strings, n sequences, drafts and grammars. The
preemption and chunked-prefill cases are in test_engine_parity.py, TP and PP over Ray in
test_distributed.py, the scheduler's rules in test_scheduler.py."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest

from kvray import LLM, SamplingParams
from kvray.config import config_from_flat
from kvray.engine.async_engine import AsyncLLM
from kvray.sampling_params import RequestOutputKind
from tests.helpers.tiny_models import transformers_greedy
from tests.test_spec_decode import NGRAM, _repetitive_prompts


def _both(model: str, prompts: list, params: SamplingParams | list[SamplingParams],
          **kw) -> tuple[list, list, LLM]:
    """Outputs of a synchronous and an async engine (kept open for its stats)."""
    sync = LLM(model, dtype="float32", **kw)
    want = sync.generate(prompts, params, use_tqdm=False)
    sync.shutdown()
    llm = LLM(model, dtype="float32", async_scheduling=True, **kw)
    return want, llm.generate(prompts, params, use_tqdm=False), llm


def _assert_close(got: list | None, want: list | None) -> None:
    assert (got is None) == (want is None)
    for x, y in zip(got or [], want or [], strict=True):
        assert (x is None) == (y is None)
        assert x is None or x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def _assert_same(got: list, want: list) -> None:
    """Tokens, text, finish and stop reasons equal; log-probs within 1e-4 (steps batch
    requests differently, so float sums may differ in their last bits)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                (b.token_ids, b.text, b.finish_reason, b.stop_reason)
            _assert_close(a.logprobs, b.logprobs)
            if b.cumulative_logprob is not None:
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.parity
def test_outputs_equal_the_synchronous_engines_with_every_kind_of_stop(tiny_model_dir):
    """Requests end mid-batch by max_tokens, stop strings, stop tokens and EOS while the
    rest run ahead; seeded samples, penalties and logprobs see the placeholders' tokens."""
    model = str(tiny_model_dir("llama_gqa"))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(8, seed=4)]
    greedy = transformers_greedy(model, prompts, 12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy[2][4]],
                       ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, n=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=2, ignore_eos=False),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
    ]
    want, got, llm = _both(model, prompts, params, max_num_seqs=8)
    sched, stats = llm.llm_engine.scheduler, llm.llm_engine.stats
    llm.shutdown()
    assert (stats.async_placeholder_tokens, stats.async_wasted_tokens) == \
        (sched.num_placeholders, sched.num_wasted_placeholders)  # exported as metrics
    _assert_same(got, want)
    for g, w in zip(got, want, strict=True):
        _assert_close(g.prompt_logprobs, w.prompt_logprobs)
    assert want[0].outputs[0].token_ids == greedy[0]
    stopped = want[2].outputs[0]  # its stop token came mid-batch
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 5
    assert sched.num_placeholders > 0 and sched.num_wasted_placeholders > 0


@pytest.mark.parity
def test_stop_strings_end_requests_whose_next_step_already_runs(tiny_model_dir):
    model = str(tiny_model_dir("llama_gqa"))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=6)]
    plain = LLM(model, dtype="float32")
    texts = [o.outputs[0].text for o in plain.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False)]
    plain.shutdown()
    stops = [t[len(t) // 2: len(t) // 2 + 2] for t in texts]  # cut each text in the middle
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[s])
              for s in stops]
    want, got, llm = _both(model, prompts, params)
    llm.shutdown()
    _assert_same(got, want)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)


@pytest.mark.parity
@pytest.mark.parametrize("end", ["abort", "stop token"])
def test_a_reused_request_id_gets_none_of_its_predecessors_tokens(tiny_model_dir, end):
    """A request that ends (aborted, or at a stop token) while its next step runs ahead
    leaves that step's token behind; a new request under the same id must not get it."""
    model = str(tiny_model_dir("llama_gqa"))
    prompt = {"prompt_token_ids": _repetitive_prompts(1, seed=9)[0][:50]}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(model, dtype="float32", async_scheduling=True)
    try:
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        engine = llm.llm_engine
        first = params if end == "abort" else SamplingParams(
            temperature=0.0, max_tokens=10, stop_token_ids=[want[3]])
        engine.add_request("req-A", prompt, first)
        engine.step()
        engine.step()
        if end == "abort":
            engine.abort_request("req-A")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("req-A", prompt, params)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        assert final.request_id == "req-A" and final.outputs[0].token_ids == want
    finally:
        llm.shutdown()


@pytest.mark.parity
def test_drafts_and_grammars_wait_for_real_tokens_beside_requests_running_ahead(
        tiny_model_dir):
    """n-gram drafts and a JSON schema's masks need the real last token: those requests
    sit steps out instead of running ahead, and the tokens stay the synchronous ones."""
    model = str(tiny_model_dir("llama_gqa"))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want, got, llm = _both(model, prompts, params, speculative_config=NGRAM)
    stats = llm.llm_engine.stats
    llm.shutdown()
    _assert_same(got, want)
    assert stats.spec_decode_num_accepted_tokens > 0

    schema = {"type": "object", "additionalProperties": False, "required": ["xs"],
              "properties": {"xs": {"type": "array", "minItems": 4, "maxItems": 4,
                                    "items": {"enum": ["ab", "cd"]}}}}
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs={"json": schema})
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want, got, llm = _both(model, ["ab cd ab", "hello", "the cat", "x"],
                           [constrained, free, constrained, free])
    sched = llm.llm_engine.scheduler
    llm.shutdown()
    _assert_same(got, want)
    assert sched.num_placeholders > 0
    for o in (got[0], got[2]):
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


@pytest.mark.parity
def test_steps_run_on_the_step_thread_while_the_engine_schedules(tiny_model_dir):
    """The overlap is real: with async scheduling the forward runs on `kvray-step`, and
    the engine keeps a step in flight beside the one it waits for."""
    seen = set()
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32", async_scheduling=True)
    worker = llm.llm_engine.executor.worker
    run = worker.execute_model

    def spy(out, prev=None):
        seen.add(threading.current_thread().name.split("_")[0])
        return run(out, prev)

    worker.execute_model = spy
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3,
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.llm_engine.stats
    llm.shutdown()
    assert seen == {"kvray-step"}
    assert stats.num_overlapped_steps >= 6


@pytest.mark.engine
def test_streams_under_async_scheduling_equal_the_synchronous_ones_and_a_cancel_frees_all(
        tiny_model_dir):
    """The serving engine (AsyncLLM) with async scheduling: concurrent DELTA streams fold
    to the synchronous engine's outputs; a stream the client leaves mid-way (its request
    aborted while its next step may already run) frees its blocks and the rest finish."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    prompts = ["The capital of France", "One two three", "Hello world", "a b c d e"]

    async def run(engine: AsyncLLM, leave_after: int | None) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            ids: list[int] = []
            async for out in engine.generate(f"r{i}", prompts[i], params):
                ids += out.outputs[0].token_ids
                if i == 0 and leave_after is not None and len(ids) >= leave_after:
                    break  # the client goes away: the request is aborted
            return ids
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    got = {}
    for mode in (False, True):
        engine = AsyncLLM(config_from_flat({"model": str(tiny_model_dir("llama_gqa")),
                                            "dtype": "float32", "async_scheduling": mode}))
        try:
            got[mode] = asyncio.run(run(engine, None))
            left = asyncio.run(run(engine, 5)) if mode else None
            stats = engine.engine.published_stats
        finally:
            engine.shutdown()
    assert got[True] == got[False] and all(len(ids) == 24 for ids in got[True])
    assert left[1:] == got[True][1:] and 5 <= len(left[0]) < 24
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0
    assert stats.async_placeholder_tokens > 0
