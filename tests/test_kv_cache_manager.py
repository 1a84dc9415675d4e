"""KV cache manager: exact block ids, prefix-cache hits, LRU eviction, collision safety."""

from __future__ import annotations

import pytest

from kvray.sampling_params import SamplingParams
from kvray.scheduler.kv_cache_manager import KVCacheManager
from kvray.scheduler.request import Request

pytestmark = pytest.mark.unit


def _req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), arrival_time=0.0)


def _admit(kv: KVCacheManager, req: Request) -> list[int]:
    hits, num_hit = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens  # as if the step ran
    return ids


def test_allocation_takes_blocks_in_order_and_free_returns_them():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(10)))
    assert _admit(kv, a) == [0, 1, 2]
    assert kv.pool.num_free == 5
    kv.free(a)
    assert kv.pool.num_free == 8


def test_shared_prefix_reuses_full_blocks_and_counts_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", list(range(10)))
    _admit(kv, a)
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 3, hits) == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[1].ref_cnt == 2
    assert kv.stats.hits == 8


def test_fully_cached_prompt_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    _admit(kv, _req("a", list(range(8))))
    hits, num_hit = kv.get_computed_blocks(_req("b", list(range(8))))
    assert num_hit == 4 and len(hits) == 1


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(kv, a)  # blocks 0,1,2
    kv.free(a)
    b = _req("b", [1, 2, 3, 4, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # still cached after free
    # A request needing all 4 blocks evicts the cached ones (least recently freed first).
    c = _req("c", list(range(100, 108)))
    assert _admit(kv, c) == [3, 2, 1, 0]
    assert kv.get_computed_blocks(_req("d", [1, 2, 3, 4, 5]))[1] == 0


def test_hash_collision_never_shares_a_block(monkeypatch):
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(kv, a)
    # Force every block of another request onto a's hashes: contents differ, so no hit.
    b = _req("b", [7, 8, 3, 4, 5])
    b.block_hashes = list(a.block_hashes)
    assert kv.get_computed_blocks(b)[1] == 0
    # Same tokens in block 1 but a different parent block: no hit either.
    c = _req("c", [9, 9, 3, 4, 5])
    c.block_hashes = [hash((None, (9, 9))), a.block_hashes[1]]
    assert kv.get_computed_blocks(c)[1] == 0


def test_allocate_fails_cleanly_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is None
    assert kv.pool.num_free == 2 and "a" not in kv.req_blocks


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    _admit(kv, _req("a", [1, 2, 3, 4, 5]))
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5], prompt_logprobs=1))[1] == 0


def test_uncomputed_blocks_of_a_preempted_request_are_not_hit_later():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5) is not None  # keyed at schedule time
    kv.free(a)  # preempted before the step ran: num_computed_tokens is still 0
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5]))[1] == 0
