"""Paged KV cache bookkeeping: a block pool with reference counts and automatic prefix
caching. Pure Python: it hands out block ids; workers own the tensors.

Prefix caching: a full block is keyed by ``hash((parent_hash, its token ids))``. A lookup
only counts as a hit when the cached block's tokens equal the request's tokens *and* its
recorded parent is the block already matched for the previous position, so by induction a
hash collision can never make two different prefixes share a block. A request with a LoRA
adapter keys its blocks in the adapter's namespace (its chain starts from the adapter id, and
each block records it): two adapters, or an adapter and the base model, never share K/V.

Freed blocks keep their key and sit in an LRU free queue: they are reused by a later
request with the same prefix, or evicted (key dropped) when a fresh block is needed.

A block enters the prefix index only when its contents are certain to be in place: blocks
the step computes are keyed when scheduled (every layer writes the step's new K/V before any
attention reads it), but a request whose leading blocks are *restored* from a copy (swap-in)
keys none of its blocks until the step that restores them has returned without a failed
restore (:meth:`KVCacheManager.confirm_restored`). So no request can hit a block whose copy
never arrived.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvray.config import CacheConfig
from kvray.scheduler.request import Request

CHAIN_ROOT = 0x6B7672  # the parent of a base-model prefix's first block, in its key


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent_id: int | None = None  # block holding the previous tokens when this was cached
    namespace: int = 0  # the LoRA adapter whose K/V it holds (0: the base model)
    parent_key: int | None = None  # the previous block's key when this was cached


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached
    requests: int = 0


class BlockPool:
    """All blocks, the LRU free queue (front = evict first) and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        # With a KV tier: base-model blocks evicted with their contents (id, key, tokens,
        # parent key), for the workers to copy out before anything overwrites them.
        self.record_evictions = False
        self.evicted: list[tuple[int, int, tuple[int, ...], int | None]] = []

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take(self, count: int) -> list[Block]:
        """Pop ``count`` free blocks (least recently freed first), evicting their keys."""
        assert count <= self.num_free
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if self.record_evictions and block.block_hash is not None and not block.namespace:
                self.evicted.append((block.block_id, block.block_hash, block.token_ids,
                                     block.parent_key))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference; blocks reaching zero join the free queue's tail, so the tail
        end of a sequence (freed first when given in reverse) is evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
              parent: Block | None, namespace: int = 0, parent_key: int | None = None) -> None:
        if block.block_hash is not None or block_hash in self.cached:
            return  # already cached, or another block holds this key: keep the first
        block.block_hash, block.token_ids = block_hash, token_ids
        block.namespace = namespace
        block.parent_id = None if parent is None else parent.block_id
        block.parent_key = parent_key
        self.cached[block_hash] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: Block | None,
               namespace: int = 0) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.namespace != namespace:
            return None
        if block.parent_id != (None if parent is None else parent.block_id):
            return None
        return block

    def uncache(self, block: Block) -> None:
        self._evict(block)

    def reset_cache(self) -> bool:
        """Forget every cached key (vLLM's ``reset_prefix_cache``); False, changing
        nothing, while a request holds blocks."""
        if self.num_free < len(self.blocks):
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent_id = None, (), None
            block.parent_key = None


@dataclass
class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`.

    Check/act pairs: :meth:`get_computed_blocks` then :meth:`allocate_slots` (returns None
    when the blocks are not there, changing nothing), and :meth:`free`.
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    pool: BlockPool = field(init=False)
    req_blocks: dict[str, list[Block]] = field(init=False, default_factory=dict)
    stats: PrefixCacheStats = field(init=False, default_factory=PrefixCacheStats)
    # req id -> how many leading blocks of its table were already offered to the cache
    _num_keyed: dict[str, int] = field(init=False, default_factory=dict)
    # requests whose restored blocks are not confirmed yet: none of their blocks is keyed
    _restoring: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks)

    @classmethod
    def from_config(cls, cache: CacheConfig, num_blocks: int) -> KVCacheManager:
        """The manager of ``num_blocks`` blocks (as the workers allocated them) laid out
        as the cache section says."""
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def update_hashes(self, request: Request) -> None:
        bs = self.block_size
        if (len(request.block_hashes) + 1) * bs > request.num_tokens:
            return  # no new full block: skip building the token list (hot path)
        tokens = request.all_token_ids
        while (len(request.block_hashes) + 1) * bs <= len(tokens):
            i = len(request.block_hashes)
            # an adapter's K/V differs from the base model's: its chain starts elsewhere.
            # The base model's starts from an int: keys must agree across processes (the KV
            # tier), and Python 3.11 hashes None by its address.
            parent = request.block_hashes[-1] if i else (
                ("lora", request.lora_id) if request.lora_id else CHAIN_ROOT)
            request.block_hashes.append(hash((parent, tuple(tokens[i * bs:(i + 1) * bs]))))

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest chain of cached full blocks that prefixes the request's tokens, and
        how many tokens they cover, counted in the prefix-cache stats. At least one token is
        always left to compute, so the step still produces logits."""
        if not self.uses_cache(request):
            return [], 0
        hits, num_hit = self.find_cached_prefix(request)
        self.count_lookup(request, num_hit)
        return hits, num_hit

    def count_lookup(self, request: Request, num_hit: int) -> None:
        """Count a lookup that found ``num_hit`` tokens in the prefix-cache stats (once per
        admission: a request that waits for blocks is looked up again every step)."""
        if self.uses_cache(request):
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit

    def find_cached_prefix(self, request: Request) -> tuple[list[Block], int]:
        """What :meth:`get_computed_blocks` finds, without counting it in the stats."""
        if not self.uses_cache(request):
            return [], 0
        self.update_hashes(request)
        tokens, bs = request.all_token_ids, self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[Block] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            parent = hits[-1] if hits else None
            block = self.pool.lookup(block_hash, tuple(tokens[i * bs:(i + 1) * bs]), parent,
                                     request.lora_id)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed: list[Block] = (), lookahead: int = 0) -> int:
        held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed)
        total_tokens = request.num_computed_tokens + len(new_computed) * self.block_size \
            + num_new_tokens + lookahead
        return max(0, -(-total_tokens // self.block_size) - held)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed: list[Block] = (), lookahead: int = 0) -> bool:
        # Cache hits currently in the free queue stop being free once touched.
        hits_in_free = sum(1 for b in new_computed if b.ref_cnt == 0)
        need = self.num_blocks_needed(request, num_new_tokens, new_computed, lookahead)
        return need + hits_in_free <= self.pool.num_free

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: list[Block] = (), lookahead: int = 0,
                       restoring: bool = False) -> list[int] | None:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens (after adopting the
        cache hits ``new_computed``) and ``lookahead`` slots past them (a draft model
        writes ahead there; they are never keyed). Returns the ids of blocks newly added
        to its table, or None (nothing changed) when there are not enough free blocks.

        ``restoring``: the request's computed tokens are being copied into the new blocks
        (swap-in); its blocks stay out of the prefix index until :meth:`confirm_restored`."""
        if not self.can_allocate(request, num_new_tokens, new_computed, lookahead):
            return None
        if restoring:
            self._restoring.add(request.request_id)
        need = self.num_blocks_needed(request, num_new_tokens, new_computed, lookahead)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        self.pool.touch(list(new_computed))
        blocks.extend(new_computed)
        fresh = self.pool.take(need)
        blocks.extend(fresh)
        if self.enable_prefix_caching and request.request_id not in self._restoring:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens
                                    + len(new_computed) * self.block_size + num_new_tokens)
        return [b.block_id for b in (*new_computed, *fresh)]

    def is_restoring(self, request: Request) -> bool:
        """Whether ``request``'s blocks are being restored by a step not confirmed yet."""
        return request.request_id in self._restoring

    def confirm_restored(self, request: Request) -> None:
        """The step that restored ``request``'s blocks returned and its copy arrived: key
        its computed full blocks (later ones are keyed as they are scheduled)."""
        if request.request_id not in self._restoring:
            return
        self._restoring.discard(request.request_id)
        blocks = self.req_blocks.get(request.request_id)
        if self.enable_prefix_caching and blocks:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        # Blocks are keyed when scheduled, before the step computes them: a request
        # admitted later in the same step may share them, because every layer writes the
        # step's new K/V into the cache before any attention reads it.
        bs = self.block_size
        start = self._num_keyed.get(request.request_id, 0)
        if num_tokens // bs <= start:
            return  # every full block of this table was offered to the cache already
        self.update_hashes(request)
        tokens = request.all_token_ids
        end = min(num_tokens // bs, len(request.block_hashes))
        for i in range(start, end):
            parent = blocks[i - 1] if i else None
            self.pool.cache(blocks[i], request.block_hashes[i],
                            tuple(tokens[i * bs:(i + 1) * bs]), parent, request.lora_id,
                            request.block_hashes[i - 1] if i else None)
        self._num_keyed[request.request_id] = end

    def num_freed_by_prefixes(self, requests: Iterable[Request]) -> Iterator[int]:
        """For ``requests[:1]``, ``requests[:2]``, ...: how many blocks would join the free
        queue if those requests were freed (the blocks no other request holds)."""
        refs: dict[int, int] = {}
        num_freed = 0
        for request in requests:
            for block in self.req_blocks.get(request.request_id, ()):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                num_freed += refs[block.block_id] == block.ref_cnt
            yield num_freed

    def uses_cache(self, request: Request) -> bool:
        # Prompt logprobs, and mean or first-token pooling, need every prompt position (or
        # the first) computed, so such a request never hits; last-token pooling may.
        params = request.sampling_params
        pooling = params.pooling
        return self.enable_prefix_caching and params.prompt_logprobs is None and (
            pooling is None or pooling.pooling_type == "last")

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Computed tokens at the start of ``request`` in cached blocks that another request
        also holds: freed now, ``request`` will find them cached when it comes back, while a
        swap would restore private copies of them."""
        if not self.uses_cache(request):
            return 0
        blocks = self.req_blocks.get(request.request_id, [])
        num_shared = 0
        for block in blocks[: request.num_computed_tokens // self.block_size]:
            if block.block_hash is None or block.ref_cnt < 2:
                break
            num_shared += 1
        return num_shared * self.block_size

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (tail first, so it is evicted first).

        Blocks past ``num_computed_tokens`` were keyed when scheduled but never computed
        (the request is preempted in the step that scheduled them): their keys are dropped
        so no later request can hit them.
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_keyed.pop(request.request_id, None)
        self._restoring.discard(request.request_id)
        num_valid = request.num_computed_tokens // self.block_size
        for block in blocks[num_valid:]:
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.release(list(reversed(blocks)))
