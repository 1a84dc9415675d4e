"""Beam search above the engine: the search's rules on hand-made log-probabilities, its
beams equal to transformers' ``generate(num_beams=k)`` on every tiny architecture (EOS
reachable or ignored, several widths, length penalties and early-stopping modes), the
async driver through ``AsyncLLM`` equal to the offline one and cancel-safe, and each step's
requests served from the prefix cache."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
from collections.abc import Mapping

import pytest
import torch

from kvray import LLM
from kvray.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    beam_search_async,
    run_beam_searches,
)
from kvray.errors import ServerBusyError
from kvray.outputs import CompletionOutput, RequestOutput
from kvray.sampling_params import SamplingParams
from tests.helpers.tiny_models import ARCHS, VOCAB_SIZE, load_hf, make_tiny_model

EOS, A, B, C, D = 0, 1, 2, 3, 4  # the toy vocabulary of the unit tests
PROMPT = [7, 8, 9]


def _lp(p: float) -> float:
    return math.log(p)


def _toy_step(table: Mapping[tuple[int, ...], Mapping[int, float]], prompt: list[int]):
    """A step function over a table: generated tokens so far -> next-token log-probs."""
    def run_step(prompts, params):
        assert all(p.max_tokens == 1 and p.temperature == 0.0 for p in params)
        return [table[tuple(p[len(prompt):])] for p in prompts]
    return run_step


def _search(table, params: BeamSearchParams, prompt=PROMPT, eos=(EOS,)) -> list[tuple]:
    search = BeamSearch(prompt, params, eos)
    run_beam_searches([search], _toy_step(table, prompt))
    return [(s.token_ids, s.score, s.finish_reason) for s in search.output().sequences]


# ---- the search's rules (unit) -----------------------------------------------------------
@pytest.mark.unit
def test_a_beam_as_wide_as_every_prefix_finds_the_best_sequences_exhaustively():
    """Three tokens, three steps, nine beams: every 2-token prefix stays live, so the result
    must be the 9 best of all 27 sequences (enumerated here), for any length penalty."""
    g = torch.Generator().manual_seed(3)
    table = {prefix: dict(zip((A, B, C), torch.log_softmax(torch.randn(3, generator=g), 0)
                              .tolist(), strict=True))
             for n in range(3) for prefix in itertools.product((A, B, C), repeat=n)}
    every = sorted(((list(seq), sum(table[seq[:i]][seq[i]] for i in range(3)))
                    for seq in itertools.product((A, B, C), repeat=3)), key=lambda s: -s[1])
    for penalty in (1.0, 0.0, -2.0):
        got = _search(table, BeamSearchParams(beam_width=9, max_tokens=3, ignore_eos=True,
                                              length_penalty=penalty))
        assert [g[0] for g in got] == [s[0] for s in every[:9]]
        assert [g[1] for g in got] == pytest.approx([s[1] / 3 ** penalty for s in every[:9]])
        assert {g[2] for g in got} == {"length"}


@pytest.mark.unit
def test_width_beams_stay_live_when_some_of_the_best_pairs_end():
    table = {(): {EOS: _lp(0.4), A: _lp(0.3), B: _lp(0.2), C: _lp(0.1)}}
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=5), [EOS])
    search.step([table[()]])
    assert [b.token_ids for b in search.beams] == [[A], [B]]
    assert [(s.token_ids, s.finish_reason, s.stop_reason) for s in search.finished] == \
        [([EOS], "stop", EOS)]


@pytest.mark.unit
def test_an_eos_outside_the_steps_best_pairs_does_not_finish():
    """[EOS] (score -0.69) would beat [A, B] (-2.0 / 2) if it were kept, as vLLM keeps every
    EOS candidate; transformers keeps only those among the step's beam_width best pairs."""
    table = {(): {A: _lp(0.6), EOS: _lp(0.5)}, (A,): {B: -1.49, C: -3.0}}
    got = _search(table, BeamSearchParams(beam_width=1, max_tokens=2))
    assert got == [([A, B], pytest.approx((_lp(0.6) - 1.49) / 2), "length")]


@pytest.mark.unit
def test_length_penalty_divides_by_the_generated_length_eos_included_prompt_not():
    table = {(): {A: -0.5, EOS: -1.0, B: -3.0},
             (A,): {EOS: -1.1, C: -2.0, D: -4.0}, (B,): {C: -5.0, D: -6.0}}
    for prompt in ([5], list(range(5, 40))):  # the prompt's length changes nothing
        plain = _search(table, BeamSearchParams(beam_width=2, max_tokens=4,
                                                length_penalty=0.0), prompt)
        assert plain == [([EOS], -1.0, "stop"), ([A, EOS], pytest.approx(-1.6), "stop")]
        mean = _search(table, BeamSearchParams(beam_width=2, max_tokens=4), prompt)
        assert mean == [([A, EOS], pytest.approx(-0.8), "stop"), ([EOS], -1.0, "stop")]


@pytest.mark.parametrize(("early_stopping", "expected"), [
    (True, [EOS]), (False, [EOS]), ("never", [A] * 10)])
@pytest.mark.unit
def test_early_stopping_modes(early_stopping, expected):
    """[EOS] finishes first. True stops there; False too, as the live [A] (-1.2 at length
    1) cannot beat it; "never" judges [A] at max_tokens (-1.2 / 10) and runs on: the long
    sequence's mean wins."""
    table = {tuple([A] * n): {A: -0.01, EOS: -9.0} for n in range(1, 10)}
    table[()] = {EOS: _lp(0.5), A: _lp(0.3), B: _lp(0.2)}
    got = _search(table, BeamSearchParams(beam_width=1, max_tokens=10,
                                          early_stopping=early_stopping))
    assert [g[0] for g in got] == [expected]


@pytest.mark.unit
def test_search_stops_once_no_live_beam_can_beat_the_finished():
    table = {(): {EOS: -0.1, A: -0.2, B: -0.3}, (A,): {EOS: -0.1, C: -5.0},
             (B,): {EOS: -0.2, C: -6.0}, (A, C): {D: -0.1}, (B, C): {D: -0.1}}
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=50), [EOS])
    run_beam_searches([search], _toy_step(table, PROMPT))
    assert search.num_generated == 2  # the live [A, C] (-5.2 / 2) is worse than both
    assert [s.token_ids for s in search.output().sequences] == [[EOS], [A, EOS]]


@pytest.mark.unit
def test_each_step_asks_for_enough_candidates_per_beam():
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    assert BeamSearch(PROMPT, params, [EOS]).num_logprobs == 6  # 2 x width, as vLLM
    assert BeamSearch(PROMPT, params, range(5)).num_logprobs == 8  # width + EOS ids
    step = BeamSearch(PROMPT, params, [EOS]).step_params()
    assert (step.max_tokens, step.temperature, step.logprobs, step.n) == (1, 0.0, 6, 1)
    with pytest.raises(ValueError, match="beam_width = 10"):
        BeamSearch(PROMPT, BeamSearchParams(beam_width=10, max_tokens=4), range(11))


@pytest.mark.parametrize(("field", "value"), [
    ("beam_width", 0), ("beam_width", 11), ("beam_width", 2.0), ("beam_width", True),
    ("max_tokens", 0), ("max_tokens", None), ("ignore_eos", "yes"), ("temperature", -0.1),
    ("temperature", float("nan")), ("length_penalty", float("inf")),
    ("length_penalty", "1"), ("early_stopping", "always"), ("early_stopping", 1)])
@pytest.mark.unit
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} = "):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})


@pytest.mark.unit
def test_prompts_that_cannot_be_searched_are_refused_up_front():
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    with pytest.raises(ValueError, match="^params: beam search takes BeamSearchParams"):
        BeamSearch(PROMPT, SamplingParams(n=2), [EOS])
    with pytest.raises(ValueError, match="^prompt: the prompt is empty"):
        BeamSearch([], params, [EOS])
    with pytest.raises(ValueError, match=r"^max_tokens = 8: the prompt \(3 tokens\)"):
        BeamSearch(PROMPT, params, [EOS], max_model_len=10)


# ---- the async driver on a fake engine (unit) ---------------------------------------------
class FakeEngine:
    """``generate`` over a toy table, recording every stream opened and closed; a step
    request of ``block_at`` generated tokens never answers, one of ``fail_at`` is refused."""

    def __init__(self, table, prompt, block_at: int | None = None,
                 fail_at: int | None = None) -> None:
        self.table, self.prompt = table, prompt
        self.block_at, self.fail_at = block_at, fail_at
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.blocked = asyncio.Event()

    async def generate(self, request_id, prompt, params, priority=0):
        self.opened.append(request_id)
        try:
            tokens = tuple(prompt["prompt_token_ids"][len(self.prompt):])
            if len(tokens) == self.fail_at and request_id.endswith(".1"):
                raise ServerBusyError("server overloaded")
            if len(tokens) == self.block_at:
                self.blocked.set()
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            lps = self.table[tokens]
            best = max(lps, key=lps.get)
            yield RequestOutput(request_id, None, list(prompt["prompt_token_ids"]), None,
                                [CompletionOutput(0, "", [best], lps[best], [dict(lps)],
                                                  "length")], True)
        finally:
            self.closed.append(request_id)


def _toy_table():
    g = torch.Generator().manual_seed(5)
    return {prefix: dict(zip((EOS, A, B, C), torch.log_softmax(
        torch.randn(4, generator=g), 0).tolist(), strict=True))
        for n in range(5) for prefix in itertools.product((A, B, C), repeat=n)}


@pytest.mark.unit
def test_async_driver_runs_each_step_as_concurrent_requests_like_the_sync_one():
    table, params = _toy_table(), BeamSearchParams(beam_width=3, max_tokens=5)
    engine = FakeEngine(table, PROMPT)
    got = asyncio.run(beam_search_async(engine.generate, PROMPT, params, "r", [EOS]))
    assert [(s.token_ids, s.score) for s in got.sequences] == \
        [(s[0], s[1]) for s in _search(table, params)]
    assert engine.opened[:4] == ["r-beam0.0", "r-beam1.0", "r-beam1.1", "r-beam1.2"]
    assert sorted(engine.closed) == sorted(engine.opened)
    assert len(set(engine.opened)) == len(engine.opened)


@pytest.mark.unit
def test_cancelling_the_async_search_closes_the_steps_requests():
    engine = FakeEngine(_toy_table(), PROMPT, block_at=2)

    async def main():
        task = asyncio.create_task(beam_search_async(
            engine.generate, PROMPT, BeamSearchParams(beam_width=3, max_tokens=5), "r",
            [EOS]))
        await engine.blocked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert any(r.startswith("r-beam2.") for r in engine.opened)
    assert sorted(engine.closed) == sorted(engine.opened)


@pytest.mark.unit
def test_a_refused_step_request_raises_its_error_and_closes_the_others():
    engine = FakeEngine(_toy_table(), PROMPT, block_at=2, fail_at=2)
    with pytest.raises(ServerBusyError, match="overloaded"):
        asyncio.run(beam_search_async(engine.generate, PROMPT,
                                      BeamSearchParams(beam_width=3, max_tokens=5), "r",
                                      [EOS]))
    assert sorted(engine.closed) == sorted(engine.opened)


# ---- parity with transformers ------------------------------------------------------------
MAX_TOKENS = 10
PROMPT_LENGTHS = (3, 9, 17)  # across 4-token block boundaries
# (beam_width, length_penalty, early_stopping, ignore_eos)
EVERY_SETTING = list(itertools.product(
    (2, 3, 4), [(1.0, False), (0.0, True), (2.0, "never"), (-1.0, False), (0.5, "never"),
                (1.5, True)], (False, True)))
SOME_SETTINGS = [(3, (1.0, False), False), (2, (2.0, "never"), False), (4, (0.0, True), True)]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _settings(arch: str) -> list[tuple]:
    return EVERY_SETTING if arch == "llama_gqa" else SOME_SETTINGS


def _reachable_eos(hf, arch: str) -> list[int]:
    """EOS ids for ``arch``'s model: 2 and the first of the tokens its width-4 beams (EOS
    ignored) generate most with which transformers' beams, under this arch's settings,
    both end at EOS and run to max_tokens."""
    counts = collections.Counter()
    for out in _transformers_beams(hf, 4, 1.0, False, None):
        counts.update(t for seq, _ in out for t in seq)
    candidates = [t for t, _ in counts.most_common(20) if t != 2]
    for token in candidates:
        eos = [2, token]
        ends = {seq[-1] in eos for width, (penalty, early), ignore in _settings(arch)
                if not ignore for out in _transformers_beams(hf, width, penalty, early, eos)
                for seq, _ in out}
        if ends == {True, False}:
            return eos
    return [2, candidates[0]]  # the test's check that EOS was reached then fails


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """arch -> (model dir, its EOS ids, transformers model): a tiny model with a second EOS
    id that its beams reach (:func:`_reachable_eos`)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
            eos = _reachable_eos(load_hf(path), arch)
            for name in ("config.json", "generation_config.json"):
                config = json.loads((path / name).read_text())
                config["eos_token_id"] = eos
                (path / name).write_text(json.dumps(config))
            cache[arch] = (path, eos, load_hf(path))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def engine_of(eos_model):
    """arch -> an LLM on ``eos_model(arch)``; one at a time (the previous one is shut
    down)."""
    held: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in held:
            for llm in held.values():
                llm.shutdown()
            held.clear()
            held[arch] = LLM(str(eos_model(arch)[0]), dtype="float32", block_size=4,
                             num_gpu_blocks_override=256)
        return held[arch]

    yield get
    for llm in held.values():
        llm.shutdown()


@torch.inference_mode()
def _transformers_beams(hf, width: int, penalty: float, early_stopping, eos: list[int] | None
                        ) -> list[list[tuple[list[int], float]]]:
    """Per prompt, transformers' ``width`` beams: (generated tokens up to and including the
    first EOS, sequence score), best first."""
    results = []
    for prompt in _prompts():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=MAX_TOKENS, length_penalty=penalty,
                          early_stopping=early_stopping, eos_token_id=eos, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True)
        beams = []
        for row, score in zip(out.sequences[:, len(prompt):].tolist(),
                              out.sequences_scores.tolist(), strict=True):
            ends = [i for i, t in enumerate(row) if eos and t in eos]
            beams.append((row[:ends[0] + 1] if ends else row, score))
        results.append(beams)
    return results


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parity
def test_beams_equal_transformers(arch, eos_model, engine_of):
    _, eos, hf = eos_model(arch)
    llm = engine_of(arch)
    assert set(llm.llm_engine.eos_token_ids) == set(eos)
    mismatches, reasons = [], collections.Counter()
    for width, (penalty, early_stopping), ignore_eos in _settings(arch):
        params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                                  length_penalty=penalty, early_stopping=early_stopping)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in _prompts()], params)
        expected = _transformers_beams(hf, width, penalty, early_stopping,
                                       None if ignore_eos else eos)
        for out, want in zip(outs, expected, strict=True):
            got = [(s.token_ids, s.score) for s in out.sequences]
            reasons.update((ignore_eos, s.finish_reason) for s in out.sequences)
            if [g[0] for g in got] != [w[0] for w in want] or \
                    [g[1] for g in got] != pytest.approx([w[1] for w in want], rel=1e-5,
                                                         abs=1e-4):
                mismatches.append((params, got, want))
    assert not mismatches, "\n".join(f"{p}:\n  kvray {g}\n  transformers {w}"
                                     for p, g, w in mismatches)
    # EOS was reached, and not by every sequence; with ignore_eos, never
    assert reasons[(False, "stop")] and reasons[(False, "length")], reasons
    assert not reasons[(True, "stop")], reasons


@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parity
def test_a_single_beam_is_greedy(ignore_eos, eos_model, engine_of):
    """Width 1 is transformers' greedy search (EOS stops it), early_stopping aside."""
    _, eos, hf = eos_model("llama_gqa")
    params = BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    outs = engine_of("llama_gqa").beam_search([{"prompt_token_ids": p} for p in _prompts()],
                                              params)
    with torch.inference_mode():
        for prompt, out in zip(_prompts(), outs, strict=True):
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                              eos_token_id=None if ignore_eos else eos, pad_token_id=0)
            row = ref[0, len(prompt):].tolist()
            ends = [i for i, t in enumerate(row) if not ignore_eos and t in eos]
            assert out.sequences[0].token_ids == (row[:ends[0] + 1] if ends else row)


@pytest.mark.parity
def test_string_prompts_are_tokenized_and_outputs_decoded(eos_model, engine_of):
    llm = engine_of("llama_gqa")
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    by_text = llm.beam_search("The capital of France", params)[0]
    by_ids = llm.beam_search({"prompt_token_ids": tok("The capital of France")["input_ids"]},
                             params)[0]
    assert by_text.prompt == "The capital of France"
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert [s.token_ids for s in by_text.sequences] == [s.token_ids for s in by_ids.sequences]
    for seq in by_text.sequences:
        assert seq.text == tok.decode(seq.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="max_tokens = 5000"):
        llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=5000))


# ---- through the engine: prefix cache, AsyncLLM ------------------------------------------
@pytest.mark.engine
def test_every_step_reuses_the_prompt_and_beam_blocks_from_the_prefix_cache(tiny_model_dir):
    """Prefix caching is on by default; each step's request of ``prompt + beam`` (L tokens)
    finds all of its full blocks but the last token's cached by the step before: exactly
    (L - 1) // 4 * 4 tokens, counted in the engine's prefix-cache stats."""
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32", block_size=4,
              num_gpu_blocks_override=256)
    try:
        assert llm.llm_engine.config.cache.enable_prefix_caching
        calls: list[list[RequestOutput]] = []  # one per step
        generate = llm.generate

        def recording(prompts, params, use_tqdm=True, **kwargs):
            calls.append(generate(prompts, params, use_tqdm=use_tqdm, **kwargs))
            return calls[-1]

        llm.generate = recording
        llm.beam_search([{"prompt_token_ids": p} for p in _prompts()],
                        BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
        assert [len(outs) for outs in calls] == [3] + [3 * 4] * 7
        assert all(out.metrics.num_cached_tokens == 0 for out in calls[0])  # a cold cache
        later = [(len(out.prompt_token_ids), out.metrics.num_cached_tokens)
                 for outs in calls[1:] for out in outs]
        assert all(hit == (n - 1) // 4 * 4 for n, hit in later), later
        stats = llm.llm_engine.stats
        assert stats.prefix_cache_hits == sum(hit for _, hit in later)
        assert stats.prefix_cache_queries == sum(len(out.prompt_token_ids)
                                                 for outs in calls for out in outs)
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_async_search_through_async_llm_equals_the_offline_one(tiny_model_dir, tiny_async_llm):
    engine = tiny_async_llm()
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    eos = engine.engine.eos_token_ids

    async def search_all():
        return await asyncio.gather(*(
            beam_search_async(engine.generate, p, params, f"beam-{i}", eos,
                              tokenizer=engine.tokenizer,
                              max_model_len=engine.engine.max_model_len)
            for i, p in enumerate(_prompts())))

    got = asyncio.run(search_all())
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32", block_size=4)
    try:
        want = llm.beam_search([{"prompt_token_ids": p} for p in _prompts()], params)
    finally:
        llm.shutdown()
    for g, w in zip(got, want, strict=True):
        assert [(s.token_ids, s.finish_reason, s.text) for s in g.sequences] == \
            [(s.token_ids, s.finish_reason, s.text) for s in w.sequences]
        assert [s.score for s in g.sequences] == pytest.approx([s.score for s in w.sequences])
    assert engine.num_in_flight() == 0


@pytest.mark.engine
def test_cancelled_async_search_leaves_nothing_in_the_engine(tiny_async_llm):
    engine = tiny_async_llm()
    params = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)

    opened: list[str] = []

    async def generate(request_id, prompt, params, priority=0):
        opened.append(request_id)
        async for out in engine.generate(request_id, prompt, params, priority):
            yield out

    async def main():
        task = asyncio.create_task(beam_search_async(
            generate, list(range(3, 40)), params, "cancelled", engine.engine.eos_token_ids))
        while not any(r.startswith("cancelled-beam2.") for r in opened):
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # the aborts run on the engine thread
            if engine.num_in_flight() == 0 and not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.num_in_flight() == 0
    assert not engine.engine.has_unfinished_requests()
