"""Scheduler policy and invariants, driven by synthetic model outputs (pure Python)."""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from kvray.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from kvray.sampling_params import SamplingParams, StructuredOutputsParams
from kvray.scheduler.output import ModelRunnerOutput
from kvray.scheduler.preemption import PreemptionCosts
from kvray.scheduler.request import Request, RequestStatus
from kvray.scheduler.scheduler import RequestTooLongError, Scheduler
from tests.helpers.shadow_kv import ShadowKV, sampled_token

pytestmark = pytest.mark.unit

# One block (4 tokens) costs as much to swap out and in as 3.5 tokens to recompute: "auto"
# swaps a victim with 8 computed tokens (7 < 8) and recomputes one with 5 (7 > 5).
MIXED_COSTS = PreemptionCosts(prefill_s_per_token=1.0, swap_s_per_byte=3.5 / 64,
                              bytes_per_block=64)


def _sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, policy="fcfs",
           prefix=True, max_len=256, mode="recompute", swap_blocks=0,
           costs=MIXED_COSTS, micro_batches=1, async_scheduling=False,
           kv_tier=None, offload_mode="evicted") -> Scheduler:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                  scheduling_policy=policy, preemption_mode=mode,
                                  async_scheduling=async_scheduling),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix,
                          kv_offload_mode=offload_mode),
        parallel=ParallelConfig(pipeline_parallel_size=micro_batches))  # steps in flight
    return Scheduler(config, num_blocks, max_len, swap_capacity_blocks=swap_blocks,
                     costs=costs, kv_tier=kv_tier)


def _req(rid, n_prompt, max_tokens=4, priority=0, t=0.0, tokens=None) -> Request:
    # crc32, not hash(): str hashes are salted per process, so tests would not repeat.
    base = zlib.crc32(rid.encode())
    ids = tokens if tokens is not None else [(base + i) % 50 for i in range(n_prompt)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t,
                   priority, max_tokens)


def _run_step(s: Scheduler, rng: random.Random | None = None, shadow: ShadowKV | None = None):
    out = s.schedule()
    if shadow is not None:
        shadow.apply(s, out)
    _finish_step(s, out, rng)
    return out


def _finish_step(s: Scheduler, out, rng: random.Random | None = None,
                 offloaded: dict | None = None, failed: set[str] = frozenset()) -> None:
    """Feed back the step's output as a worker would: a token for each request whose
    scheduled tokens reach its end (none for one aborted while the step ran), the blocks
    it copied out for the KV tier and the copies it could not restore."""
    sampled = []
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests.get(rid)
        done = r is not None and r.num_computed_tokens + n == r.num_tokens
        sampled.append([sampled_token(rid, r.num_tokens) if rng else 7] if done else [])
    result = ModelRunnerOutput(list(out.num_scheduled_tokens), sampled, [None] * len(sampled),
                               [[0.0] * len(x) for x in sampled], failed_swaps=set(failed),
                               kv_offloaded=offloaded or {})
    s.update_from_output(out, result)


def test_chunked_prefill_respects_the_token_budget_and_mixes_decodes():
    s = _sched(budget=16)
    s.add_request(_req("a", 5, t=0))
    s.add_request(_req("b", 40, t=1))
    out = _run_step(s)
    assert out.num_scheduled_tokens == {"a": 5, "b": 11}
    out = _run_step(s)  # a decodes one token while b's prefill continues
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [c.req_id for c in out.cached_requests] == ["a", "b"] and not out.new_requests


def test_incremental_output_sends_only_new_tokens_and_blocks():
    s = _sched(budget=64)
    s.add_request(_req("a", 4))
    first = _run_step(s)
    assert first.new_requests[0].block_ids == [0]
    second = _run_step(s)
    (cached,) = second.cached_requests
    assert cached.new_token_ids == [7] and cached.new_block_ids == [1]


def test_priority_policy_admits_lower_value_first_then_by_arrival():
    s = _sched(policy="priority", max_seqs=1)
    s.add_request(_req("late_low", 4, priority=5, t=0))
    s.add_request(_req("urgent", 4, priority=0, t=2))
    s.add_request(_req("urgent_earlier", 4, priority=0, t=1))
    assert list(_run_step(s).num_scheduled_tokens) == ["urgent_earlier"]


def _fill_cache_with_three_running(policy: str = "fcfs", priorities=(0, 0, 0)) -> Scheduler:
    """a, b, c (arrived in that order) each hold 2 of 6 blocks with 8 computed tokens; d
    waits. The next step needs a block for a's 9th token and none is free."""
    s = _sched(num_blocks=6, block_size=4, budget=64, max_len=64, policy=policy)
    for t, (rid, prio) in enumerate(zip("abc", priorities, strict=True)):
        s.add_request(_req(rid, 8, max_tokens=8, priority=prio, t=t))
    _run_step(s)  # prefill 8 tokens each (2 full blocks), sample a 9th
    s.add_request(_req("d", 4, max_tokens=8, t=10))
    assert sorted(r.request_id for r in s.running) == ["a", "b", "c"] and s.kv.pool.num_free == 0
    return s


def test_preemption_evicts_the_latest_arrival_and_requeues_it_ahead_of_waiting_ones():
    s = _fill_cache_with_three_running()
    out = s.schedule()
    assert out.preempted_req_ids == {"c"}
    c = s.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # front, before the later arrival
    assert list(out.num_scheduled_tokens) == ["a", "b"]  # nothing admitted in that step
    assert s.kv.block_ids("c") == [] and s.kv.pool.num_free == 0  # c's blocks went to a, b


def test_priority_preemption_evicts_the_least_important_even_if_it_arrived_first():
    s = _fill_cache_with_three_running("priority", priorities=(5, 0, 1))
    out = s.schedule()
    assert out.preempted_req_ids == {"a"}
    a = s.requests["a"]
    assert a.status is RequestStatus.PREEMPTED and a.num_preemptions == 1 and a in s.waiting
    assert s.waiting.peek() is s.requests["d"]  # priority 0 waits ahead of the evicted 5
    assert list(out.num_scheduled_tokens) == ["b", "c"]


def test_preempted_request_is_readmitted_before_later_arrivals_and_finishes():
    s = _fill_cache_with_three_running()
    _run_step(s)  # c preempted
    order = []
    for _ in range(40):
        out = _run_step(s)
        order += [r for r in out.num_scheduled_tokens if r not in order]
        if not s.has_unfinished_requests():
            break
    assert order.index("c") < order.index("d")
    assert not s.has_unfinished_requests() and s.kv.pool.num_free == 6


def test_pipelined_steps_take_disjoint_halves_and_never_preempt_a_request_in_flight():
    s = _sched(num_blocks=8, block_size=4, budget=64, micro_batches=2)
    for t, rid in enumerate("abcd"):  # 2 full blocks each; the 9th token needs a third
        s.add_request(_req(rid, 8, max_tokens=8, t=t))
    first = s.schedule()
    second = s.schedule()  # before the first step's output is back
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    assert list(second.num_scheduled_tokens) == ["c", "d"]
    assert not s.has_schedulable_requests() and s.kv.pool.num_free == 0
    _finish_step(s, first)  # a and b sampled a token; c and d are still in flight
    third = s.schedule()  # the victim would be d, the latest arrival: a and b wait for it
    assert third.is_noop and s.kv.pool.num_free == 0
    _finish_step(s, third)
    _finish_step(s, second)
    fourth = s.schedule()
    assert list(fourth.num_scheduled_tokens) == ["a", "b"] and fourth.preempted_req_ids == {"d"}


def test_async_scheduling_runs_a_decode_ahead_with_a_placeholder_for_the_token_in_flight():
    s = _sched(budget=64, async_scheduling=True)
    s.add_request(_req("a", 6, max_tokens=3))
    first = s.schedule()  # a's prompt: samples its first token
    ahead = s.schedule()  # before that token is back: a continues past it
    assert ahead.num_scheduled_tokens == {"a": 1} and ahead.placeholder_req_ids == {"a"}
    (cached,) = ahead.cached_requests
    assert cached.new_token_ids == [] and cached.num_computed_tokens == 6
    assert s.schedule().is_noop  # at most one step ahead
    _finish_step(s, first, random.Random(0))
    third = s.schedule()  # past the 2nd token (sampled by `ahead`) to sample the 3rd
    assert third.placeholder_req_ids == {"a"}
    assert third.cached_requests[0].num_computed_tokens == 7
    _finish_step(s, ahead, random.Random(0))
    assert s.schedule().is_noop  # the 3rd token, in flight, ends a: nothing runs past it
    _finish_step(s, third, random.Random(0))
    assert not s.has_unfinished_requests() and s.num_placeholders == 2
    assert s.kv.pool.num_free == s.kv.num_blocks


def test_async_scheduling_sends_each_token_once_when_a_request_stops_running_ahead():
    s = _sched(num_blocks=64, budget=64, async_scheduling=True)
    s.add_request(_req("a", 6, max_tokens=8))
    first, ahead = s.schedule(), s.schedule()
    _finish_step(s, first, random.Random(0))
    _finish_step(s, ahead, random.Random(0))  # both back: a runs in a plain step again
    plain = s.schedule()
    (cached,) = plain.cached_requests
    # the 1st token reached the workers as `ahead`'s placeholder; only the 2nd is new
    assert cached.new_token_ids == [sampled_token("a", 7)] and not plain.placeholder_req_ids
    assert cached.num_computed_tokens == 7


def test_async_scheduling_holds_back_requests_that_need_their_real_token():
    from kvray.config import ModelConfig, SpeculativeConfig

    s = _sched(budget=64, async_scheduling=True)
    grammar = Request("g", [1, 2, 3], SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]+")), 0.0, 0, 8)
    s.add_request(grammar)
    s.add_request(_req("plain", 3, max_tokens=8))
    s.schedule()
    assert set(s.schedule().num_scheduled_tokens) == {"plain"}  # g waits for its mask
    config = EngineConfig(scheduler=SchedulerConfig(async_scheduling=True),
                          model=ModelConfig(speculative_config=SpeculativeConfig(
                              num_speculative_tokens=2)))
    spec = Scheduler(config, 64, 256)
    spec.add_request(_req("d", 3, max_tokens=8))
    spec.schedule()
    assert spec.schedule().is_noop  # its drafts come from the real token


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_drains_the_steps_in_flight_to_preempt_and_finishes_everything(mode):
    """Seeded workloads on caches small enough to preempt: requests run ahead (the shadow
    cache replays the placeholders' tokens), a preemption waits until nothing is in
    flight, every step reads only its own K/V and every request finishes."""
    placeholders = preemptions = wasted = 0
    for seed in range(25):
        rng = random.Random(seed)
        ops = [(rng.choice(["arrive", "arrive", "step", "step", "abort"]), rng.randint(1, 40),
                rng.randint(1, 12), rng.randint(0, 3)) for _ in range(50)]
        s = _sched(num_blocks=rng.randint(10, 30), block_size=4, budget=24,
                   max_seqs=rng.randint(2, 5), policy=rng.choice(["fcfs", "priority"]),
                   prefix=seed % 2 == 0, max_len=128, mode=mode,
                   swap_blocks=rng.randint(0, 20), async_scheduling=True)
        _drive(s, ops, rng)
        placeholders += s.num_placeholders
        wasted += s.num_wasted_placeholders
        preemptions += s.num_preemptions
    assert placeholders > 100 and preemptions > 10 and wasted > 0


def test_request_that_can_never_fit_is_rejected_at_admission():
    s = _sched(num_blocks=4, block_size=4, max_len=256)
    with pytest.raises(RequestTooLongError, match="more KV cache than exists"):
        s.add_request(_req("big", 20))
    with pytest.raises(RequestTooLongError, match="exceeds max_model_len") as err:
        _sched(max_len=16).add_request(_req("long", 14, max_tokens=4))
    assert err.value.param == "max_tokens"
    # a prompt that fills the context: the prompt is what to shorten, not max_tokens
    with pytest.raises(RequestTooLongError, match="the prompt alone leaves no room") as err:
        _sched(max_len=16).add_request(_req("full", 16, max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(RequestTooLongError, match="empty"):
        s.add_request(_req("empty", 0, tokens=[]))
    assert not s.has_unfinished_requests()


def _check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    refs = {}
    for blocks in s.kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in one table"
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id} ref count drifted"
        assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue)
    used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert pool.num_free + used == len(pool.blocks)
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    swapped = {r.request_id for r in s.swap.queue}
    assert not running & waiting and not running & swapped and not waiting & swapped
    assert running | waiting | swapped == set(s.requests)
    assert s.swap.used_blocks == sum(r.num_swapped_blocks for r in s.swap.queue)
    assert s.swap.used_blocks <= s.swap.capacity_blocks
    assert set(s.kv.req_blocks) <= running
    assert len(s.running) <= s.config.max_num_seqs
    if s.config.scheduling_policy == "priority":  # so a swapped request never preempts
        assert all(sw.priority >= r.priority for sw in s.swap.queue for r in s.running)
    assert s.num_priority_preemptions <= s.num_preemptions


PREFIXES = [list(range(1, 21)), list(range(21, 41)), [5, 6, 7, 8] * 5]
workload = st.lists(
    st.tuples(st.sampled_from(["arrive", "step", "step", "step", "abort"]),
              st.integers(1, 60), st.integers(1, 12), st.integers(0, 3)),
    min_size=1, max_size=60)


class Pipeline:
    """Steps in flight, as the engine keeps them with pipeline parallelism and async
    scheduling: a step is submitted (and the shadow workers apply it, in submission order)
    while fewer than ``num_micro_batches`` (+ 1 with async scheduling) are out and a request
    could run; else the oldest completes."""

    def __init__(self, s: Scheduler, shadow: ShadowKV, rng: random.Random,
                 lose_fetches: float = 0.0) -> None:
        self.s, self.shadow, self.rng = s, shadow, rng
        self.lose_fetches = lose_fetches  # the chance a step's KV-tier fetch fails
        self.in_flight: list = []

    def step(self) -> None:
        s = self.s
        if len(self.in_flight) < s.num_micro_batches + s.async_scheduling and (
                not self.in_flight or s.has_schedulable_requests()):
            out = s.schedule()
            if out.is_noop and self.in_flight:  # as the engine: not submitted
                self.complete_oldest()
                return
            flying = [r for o, _, _ in self.in_flight for r in o.num_scheduled_tokens]
            again = set(flying) & set(out.num_scheduled_tokens)
            if s.async_scheduling:  # only runs ahead of the latest step, once
                latest = set(self.in_flight[-1][0].num_scheduled_tokens) \
                    if again else set()
                assert all(flying.count(r) == 1 and r in latest for r in again), \
                    "a request ran ahead of a step that is not the latest, or twice"
                assert out.placeholder_req_ids <= again
            else:
                assert not again, "a request in two steps"
            assert not set(flying) & (out.preempted_req_ids | set(out.swap_out)), \
                "a request in flight was preempted"
            self.shadow.lose |= {r for r in out.kv_fetch
                                 if self.rng.random() < self.lose_fetches}
            offloaded = self.shadow.apply(s, out)
            self.in_flight.append((out, offloaded, set(self.shadow.failed)))
            self.shadow.lose -= self.shadow.failed
        else:
            self.complete_oldest()

    def complete_oldest(self) -> None:
        out, offloaded, failed = self.in_flight.pop(0)
        _finish_step(self.s, out, self.rng, offloaded, failed)

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.s.has_unfinished_requests()


def _drive(s: Scheduler, ops, rng: random.Random, lose_fetches: float = 0.0) -> None:
    """Run ``ops`` (arrive / step / abort) and then steps until everything ends, checking
    the invariants and what every request reads after each; then check that every
    accepted request finished whole. With ``num_micro_batches`` > 1 steps overlap."""
    accepted, t, shadow = [], 0.0, ShadowKV(s.block_size)
    pipe = Pipeline(s, shadow, rng, lose_fetches)
    for op, n_prompt, max_tokens, prio in ops:
        if op == "arrive":
            t += 1
            # Common prefixes (one of three, up to 20 tokens) exercise the prefix cache.
            shared = PREFIXES[n_prompt % len(PREFIXES)][: rng.randint(0, n_prompt)]
            tokens = shared + [rng.randrange(50) for _ in range(n_prompt - len(shared))]
            r = _req(f"r{t}", n_prompt, max_tokens, prio, t, tokens)
            try:
                s.add_request(r)
                accepted.append(r)
            except RequestTooLongError:
                pass
        elif op == "abort" and s.requests:
            s.abort_request(rng.choice(sorted(s.requests)))
        else:
            pipe.step()
        _check_invariants(s)
    for _ in range(4000):
        if pipe.idle:
            break
        pipe.step()
        _check_invariants(s)
    assert pipe.idle, "a request was left behind"
    assert all(r.is_finished for r in accepted)
    assert all(len(r.output_token_ids) == r.max_tokens for r in accepted
               if r.status is RequestStatus.FINISHED_LENGTH)
    assert s.kv.pool.num_free == s.kv.num_blocks
    assert s.swap.used_blocks == 0 and not s.swap and not shadow.saved


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload, st.sampled_from(["fcfs", "priority"]), st.booleans(),
       st.integers(8, 40), st.sampled_from(["recompute", "swap", "auto"]), st.integers(0, 30),
       st.integers(2, 6), st.sampled_from([1, 1, 2, 3]), st.booleans(),
       st.randoms(use_true_random=False))
def test_random_workloads_keep_invariants_and_finish_everything(
        ops, policy, prefix, num_blocks, mode, swap_blocks, max_seqs, micro_batches,
        asynchronous, rng):
    # Under "priority", arrivals of priority 0..3 preempt less important running requests
    # when blocks or the max_seqs slots run short (few slots make the slot case common).
    # With micro_batches > 1 up to that many steps are in flight (pipeline parallelism),
    # one more with async scheduling (requests run ahead of the step in flight).
    s = _sched(num_blocks=num_blocks, block_size=4, budget=24, max_seqs=max_seqs,
               policy=policy, prefix=prefix, max_len=128, mode=mode, swap_blocks=swap_blocks,
               micro_batches=micro_batches, async_scheduling=asynchronous)
    _drive(s, ops, rng)
    target(float(s.num_priority_preemptions), label="preemptions for waiting requests")


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("offload", ["computed", "evicted"])
def test_random_workloads_with_a_kv_tier_fetch_and_lose_copies_without_a_wrong_read(
        offload, micro_batches):
    """Random workloads with small caches over a KV tier, one in five fetches lost: every
    step is replayed on the shadow cache (no request reads K/V that is not its own: not a
    copy that never arrived, not a block copied out after it was overwritten), the
    invariants hold and everything finishes."""
    from kvray.scheduler.kv_tier import LocalKVTier

    fetched = failures = 0
    for seed in range(30):
        rng = random.Random(seed)
        ops = [(rng.choice(["arrive", "arrive", "step", "step", "step", "abort"]),
                rng.randint(1, 40), rng.randint(1, 12), rng.randint(0, 3)) for _ in range(60)]
        config = EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=24,
                                      max_num_seqs=rng.randint(2, 5)),
            cache=CacheConfig(block_size=4, kv_offload_bytes=1 << 20,
                              kv_offload_mode=offload),
            parallel=ParallelConfig(pipeline_parallel_size=micro_batches))
        tiered = Scheduler(config, rng.randint(10, 24), 128, kv_tier=LocalKVTier(1 << 20))
        _drive(tiered, ops, rng, lose_fetches=0.2)
        fetched += tiered.tier.stats.hit_tokens
        failures += tiered.tier.stats.fetch_failures
    assert fetched > 0 and failures > 0  # both paths taken


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_seeded_priority_workloads_preempt_for_arrivals_and_keep_invariants(mode,
                                                                            micro_batches):
    """The same checks over fixed random workloads that surely take the path where a waiting
    request preempts running ones (blocks and slots), with each preemption mode, one step
    at a time and two in flight."""
    num_priority_preemptions = num_swaps = 0
    for seed in range(25):
        rng = random.Random(seed)
        ops = [(rng.choice(["arrive", "arrive", "step", "step", "abort"]), rng.randint(1, 40),
                rng.randint(1, 12), rng.randint(0, 3)) for _ in range(50)]
        s = _sched(num_blocks=rng.randint(10, 30), block_size=4, budget=24,
                   max_seqs=rng.randint(2, 5), policy="priority", prefix=seed % 2 == 0,
                   max_len=128, mode=mode, swap_blocks=rng.randint(0, 20),
                   micro_batches=micro_batches)
        _drive(s, ops, rng)
        num_priority_preemptions += s.num_priority_preemptions
        num_swaps += s.swap.num_swaps_out
    assert num_priority_preemptions >= (10 if micro_batches == 1 else 3)  # the path is taken
    assert (num_swaps > 0) == (mode != "recompute")


def test_swap_preemption_keeps_progress_and_swaps_back_before_admitting():
    s = _sched(num_blocks=5, block_size=4, budget=64, max_len=64, mode="swap", swap_blocks=8)
    s.add_request(_req("old", 8, max_tokens=10, t=0))
    s.add_request(_req("new", 7, max_tokens=10, t=1))
    swapped_out = swapped_in = None
    for _ in range(40):
        out = _run_step(s)
        swapped_out = swapped_out or out.swap_out
        swapped_in = swapped_in or out.swap_in
        if not s.has_unfinished_requests():
            break
    assert swapped_out and "new" in swapped_out and s.swap.num_swaps_out >= 1
    assert swapped_in and set(swapped_in) <= set(swapped_out) and s.swap.num_swaps_in >= 1
    assert not s.has_unfinished_requests() and s.swap.used_blocks == 0


def _swap_back_with_a_sharer(lose_restore: bool) -> tuple[Scheduler, list]:
    """``b`` is swapped out while ``a`` runs; when ``a`` ends, ``b`` comes back and ``c``
    (``b``'s first 12 tokens + 3) arrives in that step. Every step is checked against a
    shadow of the workers' cache; ``lose_restore``: ``b``'s copy never arrives."""
    s = _sched(num_blocks=8, block_size=4, budget=64, max_len=64, mode="swap", swap_blocks=16)
    shadow = ShadowKV(4)
    s.add_request(_req("a", 8, max_tokens=16, t=0))
    s.add_request(_req("b", 8, max_tokens=16, t=1))
    outs = []
    while s.has_unfinished_requests():
        if s.swap and "c" not in s.requests and "a" not in s.requests:
            shared = list(s.swap.peek().all_token_ids[:12])
            s.add_request(_req("c", 0, max_tokens=2, t=2, tokens=shared + [1, 2, 3]))
            if lose_restore:
                shadow.lose.add("b")
        outs.append(shadow.step(s))
        assert len(outs) < 100
    return s, outs


def test_blocks_being_restored_are_not_hit_in_the_step_that_restores_them():
    s, outs = _swap_back_with_a_sharer(lose_restore=False)
    restore = next(i for i, o in enumerate(outs) if "b" in o.swap_in)
    assert "c" not in outs[restore].num_scheduled_tokens  # too big without b's blocks
    first_c = next(o for o in outs if "c" in o.num_scheduled_tokens)
    assert first_c.new_requests[0].num_computed_tokens == 12  # hit once the copy arrived
    assert s.kv.pool.num_free == s.kv.num_blocks


def test_a_failed_restore_leaves_no_block_a_later_request_can_hit():
    # The shadow fails the run if c (or b, recomputed) ever reads the junk b's lost copy
    # left in its blocks.
    s, outs = _swap_back_with_a_sharer(lose_restore=True)
    assert s.num_swap_failures == 1
    assert sum(1 for o in outs if "b" in o.swap_in) == 1
    assert s.kv.pool.num_free == s.kv.num_blocks


def test_full_swap_pool_falls_back_to_recompute():
    s = _sched(num_blocks=5, block_size=4, budget=64, max_len=64, mode="swap", swap_blocks=0)
    s.add_request(_req("old", 8, max_tokens=10, t=0))
    s.add_request(_req("new", 7, max_tokens=10, t=1))
    outs = [_run_step(s) for _ in range(6)]
    assert s.num_preemptions >= 1 and not any(o.swap_out for o in outs)


def test_prefix_cache_stats_count_each_admission_once():
    """A request that waits several steps for blocks is looked up every step, but its
    prompt counts once in the hit-rate stats."""
    s = _sched(num_blocks=6, block_size=4, budget=64, max_seqs=4)
    s.add_request(_req("a", 16, max_tokens=6, t=0))  # 5 of the 6 blocks by its end
    s.add_request(_req("b", 12, max_tokens=2, t=1))  # waits until a ends
    waited = 0
    while s.has_unfinished_requests():
        out = _run_step(s)
        waited += "b" in s.requests and "b" not in out.num_scheduled_tokens
    assert waited >= 2
    assert (s.kv.stats.requests, s.kv.stats.queries) == (2, 16 + 12)
