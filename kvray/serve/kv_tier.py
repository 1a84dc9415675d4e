"""The application's KV tier: one named actor holding the index of every replica's evicted
prefix blocks (:class:`~kvray.scheduler.kv_tier.KVTierIndex`), whose copies stay in the Ray
object store where the replicas' workers put them. A replica on any node fetches a block
another replica computed; the index holds each replica's copies within its
``kv_offload_bytes`` (LRU). A copy whose owner died cannot be read: the fetch fails, the
request recomputes, and the entry is forgotten.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvray.scheduler.kv_tier import KVTierIndex, TierBlock
from kvray.serve.stats_board import STATS_NAMESPACE

logger = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 2.0  # an admission does not wait longer for the index


def kv_tier_actor(name: str, capacity_bytes: int) -> Any:
    """The index actor called ``name``, started if it does not run yet."""
    import ray

    @ray.remote(num_cpus=0)
    class KVTierActor:
        def __init__(self, capacity: int) -> None:
            self.index = KVTierIndex(capacity)

        def lookup(self, keys: list[int]) -> dict[int, TierBlock]:
            return self.index.lookup(keys)

        def publish(self, blocks: list[TierBlock]) -> None:
            self.index.publish(blocks)

        def forget(self, keys: list[int]) -> None:
            self.index.forget(keys)

        def forget_owner(self, owner: str) -> None:
            self.index.forget_owner(owner)

        def nbytes(self) -> int:
            return self.index.nbytes

        def keys(self) -> list[int]:
            return list(self.index.entries)

    # Restarted by Ray if its process dies (empty: the copies it referenced are freed).
    # Outside any placement group: created inside a replica's group, it would go with it.
    outside = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(None)
    return KVTierActor.options(name=name, namespace=STATS_NAMESPACE, get_if_exists=True,
                               lifetime="detached", max_restarts=-1,
                               scheduling_strategy=outside).remote(capacity_bytes)


class RemoteKVTier:
    """A replica's view of the application's tier (the scheduler's :class:`KVTier`):
    lookups wait for the index (bounded), publishing and forgetting do not."""

    def __init__(self, name: str, capacity_bytes: int, owner: str) -> None:
        self.name, self.capacity_bytes, self.owner = name, capacity_bytes, owner
        self.actor = kv_tier_actor(name, capacity_bytes)

    def lookup(self, keys: Sequence[int]) -> dict[int, TierBlock]:
        import ray

        try:
            return ray.get(self.actor.lookup.remote(list(keys)), timeout=LOOKUP_TIMEOUT_S)
        except Exception as err:  # the index restarting: recompute this time
            logger.warning("KV tier lookup failed (%s)", err.__class__.__name__)
            self.actor = kv_tier_actor(self.name, self.capacity_bytes)
            return {}

    def publish(self, blocks: list[TierBlock]) -> None:
        self.actor.publish.remote(blocks)

    def forget(self, keys: Sequence[int]) -> None:
        self.actor.forget.remote(list(keys))
