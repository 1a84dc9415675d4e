"""The KV tier below the device cache: full prefix-cache blocks the cache evicts, kept as
host copies (in the Ray object store when Ray runs, shared by every replica of the
application) under their prefix keys, for any later prompt with that prefix to fetch instead
of recomputing. Pure Python: the index and its bound; the copies are opaque handles the
workers made (one per worker shard) and read back.

A block's key is the prefix cache's chained hash of the whole prefix up to it (ints and
tuples hash alike in every process); an entry also records its tokens and its parent's key,
and a request adopts a run of entries only when each entry's tokens are the request's and
its parent is the previous block's key, so a hash collision cannot hand it another prefix's
K/V (the device cache's rule, :mod:`kvray.scheduler.kv_cache_manager`). Only base-model
blocks enter the tier (a LoRA adapter's ids are local to an engine).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class TierBlock:
    """One block's copy: ``handles`` per worker (rank order), ``nbytes`` over them all."""

    key: int
    token_ids: tuple[int, ...]
    parent_key: int | None
    handles: list[Any]
    nbytes: int
    owner: str = ""  # the engine that computed it


@dataclass
class TierStats:
    """An engine's use of the tier: prompt tokens fetched instead of computed (of which
    from copies this engine made), bytes moved each way, blocks copied out, fetches that
    failed (recomputed)."""

    hit_tokens: int = 0
    local_hit_tokens: int = 0
    fetched_bytes: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    fetch_failures: int = 0


class KVTier(Protocol):
    """Where evicted blocks go and where admissions look them up."""

    owner: str

    def lookup(self, keys: Sequence[int]) -> dict[int, TierBlock]:
        """The entries held among ``keys``."""

    def publish(self, blocks: list[TierBlock]) -> None:
        """Hold ``blocks`` (this engine's evictions), within this engine's byte bound."""

    def forget(self, keys: Sequence[int]) -> None:
        """Drop entries whose copies could not be read."""


class KVTierIndex:
    """The index itself: entries by key, LRU per owner within ``capacity_bytes`` each.
    In process (an engine alone) or inside the application's named actor."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: dict[int, TierBlock] = {}
        self._lru: dict[str, OrderedDict[int, int]] = {}  # owner -> key -> nbytes
        self._bytes: dict[str, int] = {}

    def lookup(self, keys: Sequence[int]) -> dict[int, TierBlock]:
        found = {}
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                found[key] = entry
                self._lru[entry.owner].move_to_end(key)
        return found

    def publish(self, blocks: list[TierBlock]) -> None:
        for block in blocks:
            if block.key in self.entries:  # another engine's copy already: keep the first
                continue
            self.entries[block.key] = block
            lru = self._lru.setdefault(block.owner, OrderedDict())
            lru[block.key] = block.nbytes
            self._bytes[block.owner] = self._bytes.get(block.owner, 0) + block.nbytes
            while self._bytes[block.owner] > self.capacity_bytes and lru:
                key, nbytes = lru.popitem(last=False)
                del self.entries[key]
                self._bytes[block.owner] -= nbytes

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self._lru[entry.owner].pop(key, None)
                self._bytes[entry.owner] -= entry.nbytes

    def forget_owner(self, owner: str) -> None:
        """``owner`` is gone (its copies with it)."""
        self.forget(list(self._lru.get(owner, ())))

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())


class LocalKVTier:
    """An engine's own tier in its process (no Ray, or a single engine)."""

    def __init__(self, capacity_bytes: int, owner: str = "local") -> None:
        self.owner = owner
        self.index = KVTierIndex(capacity_bytes)

    def lookup(self, keys: Sequence[int]) -> dict[int, TierBlock]:
        return self.index.lookup(keys)

    def publish(self, blocks: list[TierBlock]) -> None:
        self.index.publish(blocks)

    def forget(self, keys: Sequence[int]) -> None:
        self.index.forget(keys)


def adoptable_run(block_hashes: Sequence[int], tokens: Sequence[int], block_size: int,
                  start: int, stop: int, found: dict[int, TierBlock]) -> list[TierBlock]:
    """The entries of ``found`` that continue a request's cached prefix from block
    ``start`` (exclusive of ``stop``), each checked against the request's tokens and the
    previous block's key."""
    run: list[TierBlock] = []
    for i in range(start, stop):
        entry = found.get(block_hashes[i])
        parent = block_hashes[i - 1] if i else None
        if entry is None or entry.parent_key != parent or \
                entry.token_ids != tuple(tokens[i * block_size:(i + 1) * block_size]):
            break
        run.append(entry)
    return run
