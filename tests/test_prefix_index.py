"""The ingress' prefix index and replica choice (pure Python): which replica probably holds
a prompt's prefix, and when load overrides it."""

from __future__ import annotations

import random

import pytest

from kvray.serve.prefix_index import PrefixIndex, block_hashes, pick_replica

pytestmark = pytest.mark.unit


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def test_hashes_cover_full_blocks_and_chain_the_whole_prefix():
    a, b = _prompt(1, 40), _prompt(2, 40)
    assert len(block_hashes(a, 16)) == 2  # the 8 tokens past the last full block: none
    assert block_hashes(a[:32] + [1] * 16, 16)[:2] == block_hashes(a, 16)
    # a block equal to another prompt's only hashes alike after an equal prefix
    assert block_hashes(b[:16] + a[16:32], 16)[1] != block_hashes(a, 16)[1]
    # an adapter's prompts live in its own namespace, as in the engine's cache
    assert not set(block_hashes(a, 16, "sql")) & set(block_hashes(a, 16))


def test_match_counts_each_replicas_contiguous_leading_blocks():
    index = PrefixIndex(block_size=4, capacity_blocks=100)
    system = _prompt(3, 16)
    index.insert(block_hashes(system + _prompt(4, 8), 4), "r1")
    index.insert(block_hashes(system[:8], 4), "r2")
    follow_up = block_hashes(system + _prompt(4, 8) + _prompt(5, 8), 4)
    assert index.match(follow_up) == {"r1": 6, "r2": 2}
    assert index.match(block_hashes(_prompt(6, 16), 4)) == {}


def test_each_replica_keeps_its_most_recent_blocks_and_a_prompts_head_longest():
    index = PrefixIndex(block_size=4, capacity_blocks=6)
    old, new = _prompt(7, 16), _prompt(8, 16)
    index.insert(block_hashes(old, 4), "r1")
    index.insert(block_hashes(new, 4), "r1")  # 8 blocks into 6: old's tail goes first
    assert index.match(block_hashes(old, 4)) == {"r1": 2}
    assert index.match(block_hashes(new, 4)) == {"r1": 4}
    assert len(index) == 6
    index.forget("r1")
    assert index.match(block_hashes(new, 4)) == {} and len(index) == 0


def test_the_longest_prefix_wins_within_the_load_slack():
    replicas = ["r1", "r2", "r3"]
    depths = {"r1": 10, "r2": 3}
    assert pick_replica(replicas, depths, {"r1": 2, "r2": 0, "r3": 0}) == "r1"
    # more than two ongoing requests above the least loaded: the prefix loses
    assert pick_replica(replicas, depths, {"r1": 3, "r2": 0, "r3": 0}) == "r2"
    assert pick_replica(replicas, depths, {"r1": 5, "r2": 5, "r3": 0}) == "r3"
    # at higher load the slack is a quarter of the mean
    assert pick_replica(replicas, depths, {"r1": 20, "r2": 16, "r3": 16}) == "r1"
    assert pick_replica(replicas, depths, {"r1": 22, "r2": 16, "r3": 16}) == "r2"


def test_without_a_cached_prefix_the_least_loaded_replica_takes_the_request():
    rng = random.Random(0)
    assert pick_replica(["r1", "r2", "r3"], {}, {"r1": 1, "r2": 0, "r3": 2}, rng) == "r2"
    picks = {pick_replica(["r1", "r2"], {}, {}, rng) for _ in range(50)}
    assert picks == {"r1", "r2"}  # ties at random, not always the first


def test_a_hot_prefix_spreads_over_replicas_while_sessions_stay_put():
    """Simulated: 40 requests of one system prompt arrive while none finishes, then each
    session's second turn comes back: the hot prefix spreads within the slack, and every
    second turn goes to the replica that ran its first."""
    index = PrefixIndex(block_size=16, capacity_blocks=10_000)
    replicas = ["r1", "r2", "r3"]
    loads = dict.fromkeys(replicas, 0)
    system = _prompt(9, 128)
    first_turn = {}
    rng = random.Random(1)
    for session in range(40):
        prompt = system + _prompt(100 + session, 48)
        hashes = block_hashes(prompt, 16)
        chosen = pick_replica(replicas, index.match(hashes), loads, rng)
        index.insert(hashes, chosen)
        loads[chosen] += 1
        first_turn[session] = (chosen, prompt)
    assert max(loads.values()) <= 1.5 * sum(loads.values()) / len(loads)
    loads = dict.fromkeys(replicas, 0)  # the first turns finished
    for session, (replica, prompt) in first_turn.items():
        hashes = block_hashes(prompt + _prompt(200 + session, 40), 16)
        assert pick_replica(replicas, index.match(hashes), loads, rng) == replica


def test_the_router_reads_the_prompt_of_each_admitting_call():
    from types import SimpleNamespace

    from kvray.serve.routing import ReplicaTargetRouter

    def call(method: str, *args) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=list(args))

    prompt = {"prompt_token_ids": [1, 2, 3], "prompt": "x"}
    assert ReplicaTargetRouter._prompt_of(call("submit", "ch", "req", prompt)) == [1, 2, 3]
    assert ReplicaTargetRouter._prompt_of(call("generate", "req", prompt)) == [1, 2, 3]
    assert ReplicaTargetRouter._prompt_of(call("carry", "ch")) is None
    assert ReplicaTargetRouter._prompt_of(call("submit", "ch", "req", "text")) is None
    assert ReplicaTargetRouter._prompt_of(None) is None
