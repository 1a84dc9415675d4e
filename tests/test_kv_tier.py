"""The KV tier below the device cache (pure Python): evicted prefix blocks are copied out
under their keys and fetched back by a later prompt with that prefix, instead of recomputed;
a fetch that fails recomputes, and no request ever reads a block whose copy did not arrive
(each step replayed on a shadow of the workers' cache)."""

from __future__ import annotations

import pytest

from kvray.scheduler.kv_tier import KVTierIndex, LocalKVTier, TierBlock, adoptable_run
from kvray.scheduler.scheduler import Scheduler
from tests.helpers.shadow_kv import ShadowKV
from tests.test_scheduler import _req, _sched


def _run(s: Scheduler, shadow: ShadowKV) -> list:
    outs = []
    while s.has_unfinished_requests():
        outs.append(shadow.step(s))
        assert len(outs) < 200
    return outs


PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks of 4, one token left to compute


def _evict_then_return(lose: bool = False) -> tuple[Scheduler, list, LocalKVTier]:
    """``a`` runs PROMPT; ``b`` and ``c`` take the whole cache, evicting a's blocks; ``d``
    (PROMPT and more) then finds them in the tier."""
    tier = LocalKVTier(capacity_bytes=1 << 20, owner="me")
    s = _sched(num_blocks=10, block_size=4, budget=64, max_len=64, kv_tier=tier)
    shadow = ShadowKV(4)
    s.add_request(_req("a", 0, max_tokens=2, tokens=PROMPT))
    _run(s, shadow)
    s.add_request(_req("b", 0, max_tokens=2, tokens=list(range(300, 318))))
    s.add_request(_req("c", 0, max_tokens=2, tokens=list(range(400, 418))))
    _run(s, shadow)
    assert not s.kv.find_cached_prefix(_req("probe", 0, tokens=PROMPT + [1]))[0]
    s.add_request(_req("d", 0, max_tokens=3, tokens=PROMPT + [9, 9, 9]))
    if lose:
        shadow.lose.add("d")
    return s, _run(s, shadow), tier


@pytest.mark.unit
def test_evicted_blocks_are_fetched_back_instead_of_recomputed():
    s, outs, tier = _evict_then_return()
    first = next(o for o in outs if "d" in o.num_scheduled_tokens)
    assert [r.num_computed_tokens for r in first.new_requests] == [20]  # 5 blocks fetched
    assert first.num_scheduled_tokens["d"] == 4  # computed: the rest only
    assert len(first.kv_fetch["d"]) == 5
    assert s.tier.stats.hit_tokens == 20 and s.tier.stats.local_hit_tokens == 20
    assert s.tier.stats.offloaded_blocks >= 5 and s.tier.stats.fetch_failures == 0
    # once fetched, the blocks are the device cache's again
    assert s.kv.find_cached_prefix(_req("e", 0, tokens=PROMPT + [1]))[1] == 20
    assert s.kv.pool.num_free == s.kv.num_blocks


@pytest.mark.unit
def test_a_fetch_that_fails_recomputes_and_drops_the_lost_copies():
    # the shadow fails the run if d (or anyone after it) reads the junk the lost copy left
    s, outs, tier = _evict_then_return(lose=True)
    assert s.tier.stats.fetch_failures == 1
    fetched = [o for o in outs if "d" in o.kv_fetch]
    assert len(fetched) == 1  # not tried again
    probe = _req("probe", 0, tokens=PROMPT + [1])
    s.kv.update_hashes(probe)
    assert tier.lookup(probe.block_hashes[:5]) == {}  # the lost copies are forgotten
    recomputed = next(o for o in outs[outs.index(fetched[0]) + 1:]
                      if "d" in o.num_scheduled_tokens)
    assert [r.num_computed_tokens for r in recomputed.new_requests] == [0]
    assert s.kv.pool.num_free == s.kv.num_blocks


@pytest.mark.unit
def test_in_computed_mode_a_second_engine_fetches_a_prefix_the_first_still_holds():
    """kv_offload_mode "computed": full blocks go to the tier once computed (copied in the
    next step, so never before their K/V exists), so another engine fetches them while the
    first still holds them; each block is copied once."""
    from kvray.config import CacheConfig, EngineConfig, SchedulerConfig

    tier = LocalKVTier(capacity_bytes=1 << 20, owner="a")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64),
                          cache=CacheConfig(block_size=4, kv_offload_bytes=1 << 20,
                                            kv_offload_mode="computed"))
    a = Scheduler(config, 64, 64, kv_tier=tier)
    shadow_a = ShadowKV(4)
    a.add_request(_req("x", 0, max_tokens=6, tokens=PROMPT))
    outs = _run(a, shadow_a)
    copied = [key for o in outs for _, key in o.kv_offload]
    assert len(copied) == len(set(copied)) == (21 + 5) // 4  # every full block, once
    assert a.kv.find_cached_prefix(_req("probe", 0, tokens=PROMPT + [1]))[1] == 20  # still
    tier_b = LocalKVTier(1 << 20, owner="b")
    tier_b.index = tier.index  # one index, two engines
    b = Scheduler(config, 64, 64, kv_tier=tier_b)
    shadow_b = ShadowKV(4)
    b.add_request(_req("y", 0, max_tokens=2, tokens=PROMPT + [9]))
    first = _run(b, shadow_b)[0]
    assert [r.num_computed_tokens for r in first.new_requests] == [20]
    assert b.tier.stats.hit_tokens == 20 and b.tier.stats.local_hit_tokens == 0


@pytest.mark.unit
@pytest.mark.parametrize("num_blocks", [3, 16], ids=["then-evicted", "kept"])
def test_in_computed_mode_a_request_that_ends_in_its_first_step_still_shares_its_blocks(
        num_blocks):
    """x ends in the step that computes its blocks; the next step (y's) copies them to the
    tier once, as computed blocks, or as evicted ones when y's admission evicts them
    (before y overwrites them); another engine then fetches x's prefix."""
    from kvray.config import CacheConfig, EngineConfig, SchedulerConfig

    tier = LocalKVTier(capacity_bytes=1 << 20, owner="a")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64),
                          cache=CacheConfig(block_size=4, kv_offload_bytes=1 << 20,
                                            kv_offload_mode="computed"))
    a = Scheduler(config, num_blocks, 64, kv_tier=tier)
    shadow = ShadowKV(4)
    a.add_request(_req("x", 0, max_tokens=1, tokens=PROMPT[:9]))  # 2 full blocks, ends
    outs = _run(a, shadow)
    a.add_request(_req("y", 0, max_tokens=1, tokens=list(range(500, 509))))
    outs += _run(a, shadow)
    copied = [key for o in outs for _, key in o.kv_offload]
    probe = _req("probe", 0, tokens=PROMPT[:9])
    a.kv.update_hashes(probe)
    assert copied.count(probe.block_hashes[0]) == copied.count(probe.block_hashes[1]) == 1
    tier_b = LocalKVTier(1 << 20, owner="b")
    tier_b.index = tier.index
    b = Scheduler(config, 16, 64, kv_tier=tier_b)
    b.add_request(_req("z", 0, max_tokens=1, tokens=PROMPT[:9] + [7]))
    first = _run(b, ShadowKV(4))[0]
    assert [r.num_computed_tokens for r in first.new_requests] == [8]


@pytest.mark.unit
def test_only_a_verified_chain_is_adopted():
    def block(key, tokens, parent):
        return TierBlock(key, tuple(tokens), parent, ["h"], 8)

    hashes, tokens = [11, 12, 13], list(range(12))
    found = {11: block(11, range(4), None), 12: block(12, range(4, 8), 11),
             13: block(13, range(8, 12), 12)}
    assert [b.key for b in adoptable_run(hashes, tokens, 4, 0, 3, found)] == [11, 12, 13]
    assert [b.key for b in adoptable_run(hashes, tokens, 4, 1, 3, found)] == [12, 13]
    found[12] = block(12, range(50, 54), 11)  # a colliding key with other tokens
    assert [b.key for b in adoptable_run(hashes, tokens, 4, 0, 3, found)] == [11]
    found[12] = block(12, range(4, 8), 99)  # same tokens after another prefix
    assert [b.key for b in adoptable_run(hashes, tokens, 4, 0, 3, found)] == [11]


@pytest.mark.unit
def test_each_owner_keeps_its_most_recent_bytes():
    index = KVTierIndex(capacity_bytes=30)
    index.publish([TierBlock(k, (), None, [], 10, "r1") for k in (1, 2, 3)])
    index.publish([TierBlock(k, (), None, [], 10, "r2") for k in (7, 8)])
    index.lookup([1])  # 1 used recently: 2 goes first
    index.publish([TierBlock(4, (), None, [], 10, "r1")])
    assert set(index.entries) == {1, 3, 4, 7, 8} and index.nbytes == 50
    index.publish([TierBlock(3, (), None, [], 10, "r2")])  # r1's copy stays, not counted twice
    assert index.entries[3].owner == "r1" and index.nbytes == 50
    index.forget_owner("r1")
    assert set(index.entries) == {7, 8} and index.nbytes == 20


@pytest.mark.engine
@pytest.mark.parametrize("lose", [False, True], ids=["fetched", "lost-copies-recomputed"])
def test_the_engine_gives_the_same_tokens_from_fetched_blocks(tiny_model_dir, monkeypatch,
                                                              lose):
    """A tiny device cache: every round evicts the previous round's shared prefixes to the
    tier and fetches them back; greedy tokens equal a roomy engine's (fp32). With every
    copy unreadable the requests recompute, with the same tokens."""
    import zlib

    from kvray import LLM, SamplingParams
    from kvray.actors.swap_pool import SwapPool
    from tests.helpers.tiny_models import VOCAB_SIZE

    path = str(tiny_model_dir("llama_gqa"))
    systems = [[3 + zlib.crc32(f"s{g}:{j}".encode()) % (VOCAB_SIZE - 3) for j in range(37)]
               for g in range(3)]
    prompts = [{"prompt_token_ids": systems[i % 3] + [5 + i, 6 + i]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = dict(dtype="float32", block_size=4, max_num_seqs=2)
    roomy = LLM(path, num_gpu_blocks_override=200, **engine)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    if lose:
        def unreadable(self, req_id, kv_caches, blocks, rank):
            self._failed.add(req_id)
        monkeypatch.setattr(SwapPool, "copy_in", unreadable)
    llm = LLM(path, num_gpu_blocks_override=24, kv_offload_bytes=1 << 26, **engine)
    for round_ in range(3):  # each round's prefixes were evicted by the one before
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, round_
    tier = llm.llm_engine.scheduler.tier.stats
    assert tier.offloaded_blocks > 0
    if lose:
        assert tier.fetch_failures > 0
    else:
        assert tier.hit_tokens >= 36 and tier.fetch_failures == 0
    llm.shutdown()


@pytest.mark.unit
def test_prefix_keys_are_the_same_in_every_process():
    """The KV tier matches keys computed by different replicas: a fresh interpreter (its
    own hash seed and object addresses) computes the same keys for the same tokens."""
    import subprocess
    import sys

    code = ("from kvray.scheduler.kv_cache_manager import KVCacheManager\n"
            "from kvray.scheduler.request import Request\n"
            "from kvray.sampling_params import SamplingParams\n"
            "r = Request('a', list(range(100, 121)), SamplingParams())\n"
            "KVCacheManager(8, 4).update_hashes(r)\n"
            "print(r.block_hashes)")
    here = _req("a", 0, tokens=PROMPT)
    _sched().kv.update_hashes(here)
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONHASHSEED": "random", "PATH": "/usr/bin:/bin"},
                            check=True).stdout.strip()
    assert theirs == str(here.block_hashes)
