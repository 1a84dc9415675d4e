"""Output kinds: DELTA outputs fold back into exactly the CUMULATIVE / FINAL_ONLY result,
their payload grows linearly with the generated length, and a lagging async consumer gets
queued deltas folded together, not dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from kvray import RequestOutput, SamplingParams
from kvray.config import config_from_flat
from kvray.engine.async_engine import AsyncLLM
from kvray.engine.llm_engine import LLMEngine
from kvray.sampling_params import RequestOutputKind

pytestmark = pytest.mark.parity

CONFIG = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
              num_gpu_blocks_override=256, max_model_len=1024,
              enable_prefix_caching=False)  # same batches, same arithmetic: exact equality
PROMPTS = ["Hello world", "The capital of France is", "Once upon a time"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=30, stop=["a", "e "], logprobs=0,
                   prompt_logprobs=1),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(config_from_flat({**CONFIG, "model": str(tiny_model_dir("llama_gqa"))}))


def _run(engine: LLMEngine, kind: RequestOutputKind, tag: str) -> dict[str, list]:
    """Every output each request yields, keyed by the prompt's index."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"{tag}{i}", prompt, dataclasses.replace(params, output_kind=kind))
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id.removeprefix(tag), []).append(out)
    return outs


def _fold(deltas: list[RequestOutput]) -> RequestOutput:
    total = RequestOutput(deltas[0].request_id, None, None, None, [], False)
    for d in deltas:
        total.add(d)
    return total


def _view(out: RequestOutput) -> tuple:
    return (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished,
            [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
              c.finish_reason, c.stop_reason) for c in out.outputs])


def test_deltas_fold_into_the_same_result_as_cumulative_and_final_only(engine):
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE, "c")
    final = _run(engine, RequestOutputKind.FINAL_ONLY, "f")
    delta = _run(engine, RequestOutputKind.DELTA, "d")
    assert all(len(v) == 1 for v in final.values())
    for i in cumulative:
        assert _view(cumulative[i][-1]) == _view(final[i][0]) == _view(_fold(delta[i]))
        assert len(delta[i]) > 1
        # each sequence reports its finish once, and only the first output carries the prompt
        finishes = [c.index for d in delta[i] for c in d.outputs if c.finish_reason]
        assert sorted(finishes) == list(range(PARAMS[int(i)].n))
        assert [d.prompt_token_ids is not None for d in delta[i]] == \
            [True] + [False] * (len(delta[i]) - 1)
    # a stop string ended request 2 and is not part of its text
    last = final["2"][0].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason in ("a", "e ")
    assert not last.text.endswith(last.stop_reason)


def _stream_bytes(engine: LLMEngine, kind: RequestOutputKind, num_tokens: int) -> int:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            logprobs=1, output_kind=kind)
    engine.add_request(f"bytes-{kind.name}-{num_tokens}", "Hello world", params)
    total = 0
    while engine.has_unfinished_requests():
        total += sum(len(pickle.dumps(o)) for o in engine.step())
    return total


def test_delta_payload_grows_linearly_with_the_output_length(engine):
    short = _stream_bytes(engine, RequestOutputKind.DELTA, 100)
    long = _stream_bytes(engine, RequestOutputKind.DELTA, 400)
    assert long / short < 4.5  # 4x the tokens: about 4x the bytes
    cumulative_long = _stream_bytes(engine, RequestOutputKind.CUMULATIVE, 400)
    assert cumulative_long > 5 * long  # what DELTA saves: the quadratic resend


def test_stop_string_is_kept_with_include_stop_str_in_output(engine):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=30, stop=["a", "e "],
                            output_kind=RequestOutputKind.FINAL_ONLY)
    outs = {}
    for include in (False, True):
        engine.add_request(f"inc{include}", PROMPTS[2],
                           dataclasses.replace(params, include_stop_str_in_output=include))
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0] for o in engine.step()})
    without, with_stop = outs["incFalse"], outs["incTrue"]
    assert without.finish_reason == with_stop.finish_reason == "stop"
    assert with_stop.text == without.text + with_stop.stop_reason


def test_a_lagging_async_consumer_receives_every_delta_folded(tiny_model_dir):
    config = config_from_flat({**CONFIG, "model": str(tiny_model_dir("llama_gqa"))})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def consume(engine: AsyncLLM, lag_s: float) -> tuple[str, list[int], int]:
        text, ids, received = "", [], 0
        async for out in engine.generate(f"lag{lag_s}", "Hello world", params):
            received += 1
            text += out.outputs[0].text if out.outputs else ""
            ids += out.outputs[0].token_ids if out.outputs else []
            await asyncio.sleep(lag_s)
        return text, ids, received

    engine = AsyncLLM(config)
    try:
        eager = asyncio.run(consume(engine, 0.0))
        lagging = asyncio.run(consume(engine, 0.3))
    finally:
        engine.shutdown()
    assert lagging[:2] == eager[:2] and len(eager[1]) == 40
    assert lagging[2] < eager[2]  # fewer, folded outputs


def test_stream_interval_sends_the_first_token_then_chunks_of_that_many(tiny_model_dir):
    """server.stream_interval = 4: the first token goes at once, then each chunk carries
    at least 4 new tokens of its longest sequence, the last one whatever is left; folded
    together they are exactly the interval-1 stream, n > 1 and logprobs included. An
    interval longer than the output: the first chunk, then the last."""
    params = [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True,
                             output_kind=RequestOutputKind.DELTA),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=18, logprobs=1,
                             ignore_eos=True, output_kind=RequestOutputKind.DELTA)]

    async def collect(engine: AsyncLLM, tag: str) -> list[list[RequestOutput]]:
        async def one(i: int, p: SamplingParams) -> list[RequestOutput]:
            return [o async for o in engine.generate(f"{tag}{i}", PROMPTS[i], p)]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(params)))

    streams = {}
    for interval in (1, 4, 1000):
        config = config_from_flat({**CONFIG, "model": str(tiny_model_dir("llama_gqa")),
                                   "stream_interval": interval})
        engine = AsyncLLM(config)
        try:
            streams[interval] = asyncio.run(collect(engine, f"si{interval}-"))
        finally:
            engine.shutdown()
    for every, chunked in zip(streams[1], streams[4], strict=True):
        assert _view(_fold(chunked)) == _view(_fold(every))
        sizes = [max(len(c.token_ids) for c in o.outputs) for o in chunked]
        assert all(s >= 4 for s in sizes[1:-1]), sizes
        assert chunked[-1].finished and not any(o.finished for o in chunked[:-1])
        assert len(chunked) < len(every)
    for every, two in zip(streams[1], streams[1000], strict=True):
        # longer than the output: the first token (not held), then the rest at the end
        assert len(two) == 2 and two[-1].finished, [len(o.outputs[0].token_ids) for o in two]
        assert _view(_fold(two)) == _view(_fold(every))


def test_a_request_id_is_free_again_as_soon_as_its_last_output_arrives(tiny_model_dir):
    """Regression: the engine thread forgot a finished stream only after queueing its last
    output, so a client reusing the id at once could be told it was still in use."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine = AsyncLLM(config_from_flat({**CONFIG, "model": str(tiny_model_dir("llama_gqa"))}))

    async def reuse() -> int:
        done = 0
        for _ in range(12):
            async for out in engine.generate("same-id", "Hello", params):
                done += out.finished
        return done

    try:
        assert asyncio.run(reuse()) == 12
    finally:
        engine.shutdown()
