"""Which model replica probably holds which prompt prefix in its prefix cache: what the
ingress' router (:mod:`kvray.serve.routing`) reads to send a request where its prefix is
cached. Pure Python, no Ray.

The index remembers the prompts this router sent, as chains of block hashes (one per full
``block_size``-token block, each hash covering the whole prefix up to its block, in the
LoRA adapter's namespace like the engine's cache), and for each replica at most
``capacity_blocks`` of them, least recently sent first out, with a prompt's tail blocks
ahead of its head (the engine frees a sequence tail first). It is approximate: it does not
see a replica evict a block early, nor the prompts other ingress replicas sent; it needs no
message from the replicas and costs a hash per block of each prompt.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence

# A replica wins a request on its cached prefix unless it runs more than this many ongoing
# requests above the least loaded replica (or LOAD_SLACK_FRACTION of the mean, if larger):
# one hot prefix spreads over more replicas instead of pinning one.
LOAD_SLACK = 2
LOAD_SLACK_FRACTION = 0.25


def block_hashes(token_ids: Sequence[int], block_size: int, namespace: str = "") -> list[int]:
    """One hash per full block of ``token_ids``, each covering every token before it too."""
    out: list[int] = []
    parent: object = ("lora", namespace) if namespace else None
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash((parent, tuple(token_ids[end - block_size:end])))
        out.append(parent)
    return out


class PrefixIndex:
    """Block-hash chains -> the replicas they were sent to, bounded per replica (LRU)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Each replica's number of leading blocks of ``hashes`` it holds (none: absent)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes):
            advanced = False
            for replica in self._holders.get(h, ()):
                if depth.get(replica, 0) == i:
                    depth[replica] = i + 1
                    advanced = True
            if not advanced:
                break
        return depth

    def insert(self, hashes: Sequence[int], replica: str) -> None:
        """``replica`` was sent a prompt of these block hashes."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # the head ends most recent: it outlives the tail
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            self._drop(h, replica)

    def forget(self, replica: str) -> None:
        """``replica`` is gone: nothing is cached there any more."""
        for h in self._lru.pop(replica, ()):
            self._drop(h, replica)

    def replicas(self) -> set[str]:
        return set(self._lru)

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def _drop(self, h: int, replica: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]


def pick_replica(candidates: Sequence[str], depths: dict[str, int], loads: dict[str, int],
                 rng: random.Random | None = None) -> str:
    """The replica for a request: among those within the load slack of the least loaded,
    the one holding the longest prefix of it (ties: the less loaded, then at random); with
    no prefix anywhere among them, the least loaded."""
    rng = rng or random
    lmin = min(loads.get(r, 0) for r in candidates)
    mean = sum(loads.get(r, 0) for r in candidates) / len(candidates)
    slack = max(LOAD_SLACK, math.ceil(LOAD_SLACK_FRACTION * mean))
    eligible = [r for r in candidates if loads.get(r, 0) <= lmin + slack]
    key = {r: (depths.get(r, 0), -loads.get(r, 0), rng.random()) for r in eligible}
    return max(eligible, key=key.__getitem__)
