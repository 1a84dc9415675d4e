"""Preemption beyond vLLM (issue 9): a more important arrival preempts less important running
requests under the priority policy, and preemption_mode="auto" picks swap or recompute per
victim by measured cost. Scheduler tests are pure Python with requests built by hand; the
engine test runs a tiny model in-process."""

from __future__ import annotations

import zlib

import pytest

from kvray.config import CacheConfig, EngineConfig, SchedulerConfig
from kvray.sampling_params import SamplingParams
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.preemption import PreemptionCosts
from kvray.scheduler.request import Request, RequestStatus
from kvray.scheduler.scheduler import Scheduler
from tests.helpers.shadow_kv import ShadowKV
from tests.helpers.tiny_models import transformers_greedy

pytestmark = pytest.mark.parity

# Per 4-token block: swapping out and in costs 3.5, recomputing costs 1 per token. "auto"
# swaps a victim with 8 computed tokens (2 blocks: 7 < 8), recomputes one with 5 (7 > 5).
COSTS = PreemptionCosts(prefill_s_per_token=1.0, swap_s_per_byte=3.5 / 64, bytes_per_block=64)


def _sched(num_blocks: int, policy: str = "priority", mode: str = "recompute",
           max_seqs: int = 8, swap_blocks: int = 0) -> Scheduler:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs,
                                  scheduling_policy=policy, preemption_mode=mode),
        cache=CacheConfig(block_size=4, enable_prefix_caching=True))
    return Scheduler(config, num_blocks, 128, swap_capacity_blocks=swap_blocks, costs=COSTS)


def _req(rid: str, n_prompt: int, max_tokens: int = 8, priority: int = 0, t: float = 0.0,
         tokens: list[int] | None = None) -> Request:
    base = zlib.crc32(rid.encode())  # not hash(): str hashes change between processes
    ids = tokens if tokens is not None else [(base + i) % 50 for i in range(n_prompt)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t,
                   priority, max_tokens)


def _step(s: Scheduler, shadow: ShadowKV | None = None) -> SchedulerOutput:
    """One step with a synthetic model that samples token 7 wherever a request samples
    (``shadow``: and checks that every request reads its own K/V)."""
    out = s.schedule()
    if shadow is not None:
        shadow.apply(s, out)
    sampled = [[7] if s.requests[r].num_computed_tokens + n == s.requests[r].num_tokens else []
               for r, n in out.num_scheduled_tokens.items()]
    s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled,
                                                [None] * len(sampled), [[]] * len(sampled)))
    return out


def _three_low_priority_running(policy: str = "priority", mode: str = "recompute",
                                swap_blocks: int = 0) -> Scheduler:
    """a, b, c (priority 5, arrived in that order) each hold 2 of 9 blocks after a 5-token
    prefill; their next 3 decodes need no new block. 3 blocks are free."""
    s = _sched(num_blocks=9, policy=policy, mode=mode, swap_blocks=swap_blocks)
    for t, rid in enumerate("abc"):
        s.add_request(_req(rid, 5, max_tokens=8, priority=5, t=t))
    _step(s)
    assert [s.kv.block_ids(r) for r in "abc"] == [[0, 1], [2, 3], [4, 5]]
    return s


def _finish_order(s: Scheduler, max_steps: int = 100) -> list[str]:
    order = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        before = set(s.requests)
        _step(s)
        order += sorted(before - set(s.requests))
    assert not s.has_unfinished_requests()
    return order


def test_high_priority_arrival_into_a_full_cache_runs_before_low_priority_ones_finish():
    s = _three_low_priority_running()
    s.add_request(_req("urgent", 15, max_tokens=2, priority=0, t=10))  # needs 4 blocks
    out = _step(s)
    # c (lowest priority, latest arrival) gave up its blocks; urgent ran in the same step.
    assert out.preempted_req_ids == {"c"} and not out.swap_out
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "urgent": 15}
    assert s.kv.block_ids("urgent") == [6, 7, 8, 5]
    c = s.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.num_priority_preemptions == 1 and s.num_preemptions == 1
    assert _finish_order(s)[0] == "urgent"
    assert s.kv.pool.num_free == 9


def test_the_victim_never_preempts_back_the_request_it_yielded_to():
    s = _three_low_priority_running()
    urgent = _req("urgent", 15, max_tokens=12, priority=0, t=10)
    s.add_request(urgent)
    _finish_order(s)
    assert urgent.num_preemptions == 0
    assert s.num_priority_preemptions == 1  # later preemptions are a, b, c making room


def test_victims_go_lowest_priority_first_then_latest_arrival():
    s = _sched(num_blocks=6)
    for t, (rid, prio) in enumerate([("a", 3), ("b", 5), ("c", 5)]):
        s.add_request(_req(rid, 5, priority=prio, t=t))
    _step(s)
    s.add_request(_req("urgent", 12, max_tokens=2, priority=0, t=10))  # 3 blocks: 2 victims
    out = _step(s)
    assert out.preempted_req_ids == {"b", "c"}
    assert out.num_scheduled_tokens == {"a": 1, "urgent": 12}


def test_equal_priority_never_preempts():
    s = _sched(num_blocks=6)
    for t, rid in enumerate("abc"):
        s.add_request(_req(rid, 5, priority=1, t=t))
    _step(s)
    s.add_request(_req("same", 4, priority=1, t=10))
    out = _step(s)
    assert not out.preempted_req_ids and s.num_preemptions == 0
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_nothing_is_preempted_when_the_victims_would_not_free_enough():
    s = _sched(num_blocks=6)
    for t, (rid, prio) in enumerate([("a", 0), ("b", 0), ("c", 5)]):
        s.add_request(_req(rid, 5, priority=prio, t=t))
    _step(s)
    s.add_request(_req("big", 12, priority=1, t=10))  # 3 blocks; only c (2 blocks) ranks below
    out = _step(s)
    assert not out.preempted_req_ids and s.num_preemptions == 0
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_slot_limit_preempts_for_a_more_important_arrival():
    s = _sched(num_blocks=64, max_seqs=2)
    s.add_request(_req("a", 5, priority=5, t=0))
    s.add_request(_req("b", 5, priority=5, t=1))
    _step(s)
    s.add_request(_req("urgent", 4, max_tokens=2, priority=0, t=10))
    out = _step(s)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1, "urgent": 4}
    assert s.num_priority_preemptions == 1


def test_no_preemption_for_an_arrival_once_another_was_admitted_in_the_step():
    """w1 is admitted on a cache hit of block 2, which v keys in this step and computes
    only if it runs: preempting v for w2 in the same step would leave w1 reading a block
    nobody computed. w2 waits for the next step."""
    s = Scheduler(EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=10,
                                                         scheduling_policy="priority"),
                               cache=CacheConfig(block_size=4)), num_blocks=5, max_model_len=64)
    shadow = ShadowKV(4)
    prompt = list(range(20, 36))
    s.add_request(_req("v", 0, max_tokens=4, priority=5, t=0, tokens=prompt))
    _step(s, shadow)  # v computes tokens 0..9 (budget 10)
    s.add_request(_req("w1", 0, max_tokens=2, priority=0, t=1, tokens=prompt[:12] + [9]))
    s.add_request(_req("w2", 0, max_tokens=2, priority=0, t=2, tokens=[8]))
    out = _step(s, shadow)  # v: tokens 10..15, keying blocks 2 and 3; w1 hits 0..2
    assert out.num_scheduled_tokens == {"v": 6, "w1": 1} and not out.preempted_req_ids
    for _ in range(20):
        _step(s, shadow)
    assert not s.has_unfinished_requests()


def test_fcfs_never_preempts_for_an_arrival():
    s = _three_low_priority_running(policy="fcfs")
    s.add_request(_req("urgent", 16, max_tokens=2, priority=0, t=10))
    out = _step(s)
    assert not out.preempted_req_ids and out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert s.waiting.peek().request_id == "urgent"


def test_swapped_victim_comes_back_after_the_request_it_yielded_to():
    s = _three_low_priority_running(mode="swap", swap_blocks=8)
    s.add_request(_req("urgent", 15, max_tokens=2, priority=0, t=10))
    out = _step(s)
    # The workers save c's blocks before the forward pass writes urgent's K/V into block 5.
    assert out.swap_out == {"c": [4, 5]} and s.requests["c"].status is RequestStatus.SWAPPED
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "urgent": 15}
    assert _finish_order(s)[0] == "urgent"
    assert s.swap.num_swaps_in == s.swap.num_swaps_out >= 1


def test_a_more_important_arrival_is_admitted_past_a_swapped_request():
    s = _three_low_priority_running(mode="swap", swap_blocks=8)
    s.add_request(_req("urgent", 15, max_tokens=4, priority=0, t=10))
    _step(s)  # c swapped out for urgent; 1 block free
    s.add_request(_req("second", 4, max_tokens=2, priority=1, t=11))  # outranks c (5)
    s.add_request(_req("late_low", 4, max_tokens=2, priority=5, t=12))  # does not
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "urgent": 1, "second": 4}
    assert [r.request_id for r in s.swap.queue] == ["c"] and s.waiting.peek().request_id \
        == "late_low"


def test_swapped_requests_come_back_most_important_first():
    s = _sched(num_blocks=6, mode="swap", swap_blocks=8)
    s.add_request(_req("a", 5, priority=0, t=0))
    s.add_request(_req("b", 5, priority=2, t=1))
    s.add_request(_req("c", 5, priority=1, t=2))
    _step(s)
    s.add_request(_req("urgent", 12, max_tokens=1, priority=0, t=10))
    out = _step(s)
    assert out.swap_out.keys() == {"b", "c"}  # b swapped first (priority 2), then c
    first_back = []
    for _ in range(30):
        first_back += [r for r in _step(s).swap_in if r not in first_back]
    assert first_back == ["c", "b"]  # not the order they left in


def _preempt_one(victim_tokens: list[int], keeper_tokens: list[int], mode: str = "auto"
                 ) -> SchedulerOutput:
    """Keeper (arrived first) and victim fill the cache after their prefill; the keeper's
    next token needs a block, so the victim is preempted in the second step."""
    blocks = -(-len(keeper_tokens) // 4) + -(-len(victim_tokens) // 4)
    shared = len(victim_tokens) >= 4 and victim_tokens[:4] == keeper_tokens[:4]
    s = _sched(num_blocks=blocks - shared, policy="fcfs", mode=mode, swap_blocks=16)
    s.add_request(_req("keeper", 0, max_tokens=2, t=0, tokens=keeper_tokens))
    s.add_request(_req("victim", 0, max_tokens=2, t=1, tokens=victim_tokens))
    _step(s)
    assert s.kv.pool.num_free == 0
    out = _step(s)
    assert out.preempted_req_ids == {"victim"}
    return out


KEEPER = list(range(10, 18))


@pytest.mark.parametrize("victim,swaps", [
    (list(range(20, 28)), True),  # 8 tokens in 2 blocks: swap 7 < recompute 8
    (list(range(20, 25)), False),  # 5 tokens in 2 blocks: swap 7 > recompute 5
    # 12 tokens in 3 blocks: swap 10.5 < recompute 12, but its first block is the keeper's
    # too: swapped, it would come back into a private copy; recomputed, it hits the cache.
    (KEEPER[:4] + list(range(20, 28)), False),
])
def test_auto_mode_swaps_only_victims_cheaper_to_swap_than_to_recompute(victim, swaps):
    out = _preempt_one(victim, KEEPER)
    assert bool(out.swap_out) is swaps
    if swaps:
        assert out.swap_out == {"victim": [2, 3]}


def test_auto_mode_recomputes_when_the_swap_pool_is_full():
    s = _sched(num_blocks=4, policy="fcfs", mode="auto", swap_blocks=1)
    s.add_request(_req("keeper", 0, max_tokens=2, t=0, tokens=KEEPER))
    s.add_request(_req("victim", 0, max_tokens=2, t=1, tokens=list(range(20, 28))))
    _step(s)
    out = _step(s)
    assert out.preempted_req_ids == {"victim"} and not out.swap_out


def test_blocks_freed_by_victims_count_shared_blocks_only_once_all_holders_go():
    s = _sched(num_blocks=8, policy="fcfs")
    s.add_request(_req("a", 0, t=0, tokens=KEEPER))  # 2 blocks
    s.add_request(_req("b", 0, t=1, tokens=KEEPER[:4] + [1, 2, 3, 4, 5]))  # shares block 0
    _step(s)
    a, b = s.requests["a"], s.requests["b"]
    assert s.kv.block_ids("b")[:1] == s.kv.block_ids("a")[:1]
    assert list(s.kv.num_freed_by_prefixes([b, a])) == [2, 4]  # b: its own 2; a: 1 + shared
    assert s.kv.num_shared_prefix_tokens(b) == 4 and s.kv.num_shared_prefix_tokens(a) == 4


def test_auto_mode_without_costs_is_refused():
    with pytest.raises(ValueError, match="auto"):
        Scheduler(EngineConfig(scheduler=SchedulerConfig(preemption_mode="auto")), 8, 64)


def test_costs_price_recompute_per_token_and_swap_per_byte():
    costs = PreemptionCosts(prefill_s_per_token=2e-4, swap_s_per_byte=1e-9,
                            bytes_per_block=100_000)
    assert costs.recompute_s(100) == pytest.approx(0.02)
    assert costs.swap_s(10) == pytest.approx(1e-3)
    assert costs.prefers_swap(10, 100) and not costs.prefers_swap(10, 4)


# ---- engine: preemption_mode="auto" on a tiny model, in-process (the swap pool then keeps
# numpy copies instead of Ray objects) ---------------------------------------------------
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
LENGTHS = [3, 20, 9, 33, 1, 14, 26, 7]


def _prompts() -> list[dict]:
    from tests.helpers.tiny_models import VOCAB_SIZE

    return [{"prompt_token_ids": [3 + zlib.crc32(f"{i}:{j}".encode()) % (VOCAB_SIZE - 3)
                                  for j in range(n)]} for i, n in enumerate(LENGTHS)]


def _generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model_and_unconstrained(tiny_model_dir):
    """The model and transformers' greedy tokens, which a roomy engine also gives."""
    from kvray import LLM

    path = str(tiny_model_dir("llama_gqa"))
    want = transformers_greedy(path, _prompts(), 24)
    llm = LLM(path, num_gpu_blocks_override=400, **ENGINE)
    tokens = _generate(llm)
    assert llm.llm_engine.stats.num_preemptions == 0
    llm.shutdown()
    assert tokens == want
    return path, want


def _tight_auto_engine(path: str):
    from kvray import LLM

    return LLM(path, num_gpu_blocks_override=20, preemption_mode="auto", swap_space=0.01,
               **ENGINE)


def test_auto_mode_measures_costs_and_gives_the_unconstrained_tokens(model_and_unconstrained):
    path, expected = model_and_unconstrained
    llm = _tight_auto_engine(path)
    stats = llm.llm_engine.stats
    assert stats.prefill_s_per_token > 0 and stats.swap_s_per_byte > 0
    assert _generate(llm) == expected
    assert stats.num_preemptions > 0 and stats.num_swaps_in == stats.num_swaps_out
    assert llm.llm_engine.executor.swap_objects() == [0]
    llm.shutdown()


def test_auto_mode_swaps_some_victims_and_recomputes_others_end_to_end(
        model_and_unconstrained):
    path, expected = model_and_unconstrained
    llm = _tight_auto_engine(path)
    scheduler = llm.llm_engine.scheduler
    # Inject costs under which the choice depends on the victim (as in the unit tests
    # above), so that both kinds of preemption run through the worker in one workload.
    scheduler.costs = PreemptionCosts(1.0, 3.5 / scheduler.costs.bytes_per_block,
                                      scheduler.costs.bytes_per_block)
    assert _generate(llm) == expected
    stats = llm.llm_engine.stats
    assert 0 < stats.num_swaps_out < stats.num_preemptions  # both swap and recompute
    assert stats.num_swaps_in == stats.num_swaps_out
    assert llm.llm_engine.executor.swap_objects() == [0]
    llm.shutdown()


class _FlakyStore:
    """Stands in for Ray's object store in the swap pool: every other save fails (a full
    store and spill disk) and one restore in three fails (a lost object)."""

    def __init__(self) -> None:
        self.puts = self.gets = 0

    def put(self, arr):
        self.puts += 1
        if self.puts % 2 == 0:
            raise OSError("object store and spill disk are full")
        return ("ref", arr.copy())

    def get(self, ref):
        self.gets += 1
        if self.gets % 3 == 0:
            raise OSError("object lost")
        return ref[1]


def test_swaps_that_cannot_be_stored_or_restored_fall_back_to_recompute(
        model_and_unconstrained, monkeypatch):
    from kvray import LLM
    from kvray.actors.swap_pool import SwapPool

    path, expected = model_and_unconstrained
    store = _FlakyStore()
    monkeypatch.setattr(SwapPool, "_ray", staticmethod(lambda: store))
    llm = LLM(path, num_gpu_blocks_override=20, preemption_mode="swap", swap_space=0.01,
              **ENGINE)
    assert _generate(llm) == expected  # the same tokens: nothing computed on lost K/V
    scheduler = llm.llm_engine.scheduler
    assert store.puts >= 2 and store.gets >= 3, "the workload must hit both failures"
    assert scheduler.num_swap_failures >= 2
    assert llm.llm_engine.executor.swap_objects() == [0]
    assert not scheduler.swap and scheduler.swap.used_blocks == 0
    assert scheduler.kv.pool.num_free == scheduler.kv.num_blocks
    llm.shutdown()
