"""The scheduler's side of the KV tier (:mod:`kvray.scheduler.kv_tier`): which prompts' blocks
to look up, which of them to fetch instead of recomputing, which blocks to copy out, and
what each step's results mean for the tier's entries.

Per step the scheduler calls :meth:`TierTraffic.look_up` before admitting anything,
:meth:`TierTraffic.run_for` and :meth:`TierTraffic.fetch` while admitting a request,
:meth:`TierTraffic.fill` when it writes the step's :class:`SchedulerOutput`, and
:meth:`TierTraffic.results` when the step's output comes back. Blocks go out when the device
cache evicts them (``kv_offload_mode: evicted``) or, write-through, as soon as a returned step
has computed them (``computed``, each key once). A fetched block is keyed in the device cache
only once the step that filled it returns without a failed fetch.
"""

from __future__ import annotations

from kvray.scheduler.kv_cache_manager import KVCacheManager
from kvray.scheduler.kv_tier import KVTier, TierBlock, TierStats, adoptable_run
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.preemption import PreemptionCosts
from kvray.scheduler.request import Request

MAX_TIERED_KEYS = 1 << 18  # kv_offload_mode "computed": keys remembered as put in the tier


class TierTraffic:
    """What moves between one engine's device cache and the tier, and its counters."""

    def __init__(self, tier: KVTier, kv: KVCacheManager, block_size: int,
                 costs: PreemptionCosts | None, write_through: bool) -> None:
        """``costs``: when given (``preemption_mode: auto``), a run of blocks is fetched only
        where copying it in is cheaper than recomputing it. ``write_through``:
        ``kv_offload_mode: computed``."""
        self.tier = tier
        self.kv = kv
        self.block_size = block_size
        self.costs = costs
        self.write_through = write_through
        self.stats = TierStats()
        kv.pool.record_evictions = True
        # keys copied out in the step in flight -> (tokens, parent key), until published
        self._offloading: dict[int, tuple[tuple[int, ...], int | None]] = {}
        self._to_fetch: dict[str, list[tuple[int, list]]] = {}  # for the next output
        self._fetching: dict[str, list[int]] = {}  # req -> keys fetched in the step in flight
        self._to_look_up: list[Request] = []  # queued (or re-queued) since the last lookup
        # write-through: blocks a returned step keyed, copied out in the next step (block id,
        # key); keys this engine already put in the tier
        self._computed_blocks: list[tuple[int, int]] = []
        self._tiered: set[int] = set()

    # ---- admission ---------------------------------------------------------------------
    def queue(self, req: Request) -> None:
        """Look ``req``'s prompt up at the next step (new, or preempted by recompute: its
        blocks may be in the tier now)."""
        req.tier_found = None
        self._to_look_up.append(req)

    def look_up(self) -> None:
        """One lookup for the requests queued since the last one (not the whole waiting
        queue, every step): the tier's entries among their full blocks' keys."""
        new = [r for r in self._to_look_up if not r.is_finished and r.tier_found is None]
        self._to_look_up.clear()
        if not new:
            return
        keys: list[int] = []
        for req in new:
            req.tier_found = {}
            if self.kv.uses_cache(req) and not req.lora_id:
                self.kv.update_hashes(req)
                keys += req.block_hashes[:(req.num_tokens - 1) // self.block_size]
        if not keys:
            return
        found = self.tier.lookup(keys)
        for req in new:
            req.tier_found = {k: found[k] for k in req.block_hashes if k in found}

    def run_for(self, req: Request, start: int) -> list[TierBlock]:
        """The tier's blocks that continue ``req``'s cached prefix from block ``start``,
        when fetching them is cheaper than recomputing (by the measured costs, where
        given; otherwise always)."""
        if not req.tier_found:
            return []
        stop = (req.num_tokens - 1) // self.block_size  # one token is always computed
        run = adoptable_run(req.block_hashes, req.all_token_ids, self.block_size, start,
                            stop, req.tier_found)
        if run and self.costs is not None and \
                not self.costs.prefers_swap(len(run), len(run) * self.block_size):
            return []
        return run

    def fetch(self, req: Request, run: list[TierBlock], block_ids: list[int]) -> None:
        """The workers fill ``block_ids`` from ``run``'s copies in the coming step, before
        the forward."""
        self._to_fetch[req.request_id] = [
            (block_id, entry.handles) for block_id, entry in zip(block_ids, run, strict=True)]
        self._fetching[req.request_id] = [entry.key for entry in run]
        if self.write_through:  # already in the tier: not copied back
            self._tiered.update(entry.key for entry in run)
        self.stats.hit_tokens += len(run) * self.block_size
        self.stats.local_hit_tokens += self.block_size * sum(
            entry.owner == self.tier.owner for entry in run)
        self.stats.fetched_bytes += sum(entry.nbytes for entry in run)

    # ---- the step's output -------------------------------------------------------------
    def fill(self, out: SchedulerOutput) -> None:
        """The step's copies out and fetches. Evicted blocks first: a block noted as
        computed but evicted by this schedule goes out as an evicted one (either way before
        this step writes into it)."""
        for block_id, key, tokens, parent in self.kv.pool.evicted:
            if key not in self._offloading and key not in self._tiered:
                self._offload(out, block_id, key, tokens, parent)
        self.kv.pool.evicted.clear()
        for block_id, key in self._computed_blocks:
            block = self.kv.pool.blocks[block_id]
            if block.block_hash == key and key not in self._offloading \
                    and key not in self._tiered:  # still holds it, not copied yet
                self._offload(out, block_id, key, block.token_ids, block.parent_key)
        self._computed_blocks.clear()
        out.kv_fetch, self._to_fetch = self._to_fetch, {}

    def _offload(self, out: SchedulerOutput, block_id: int, key: int,
                 tokens: tuple[int, ...], parent: int | None) -> None:
        out.kv_offload.append((block_id, key))
        self._offloading[key] = (tokens, parent)
        if self.write_through:  # each computed block goes to the tier once
            self._tiered.add(key)

    # ---- results ------------------------------------------------------------------------
    def note_computed(self, out: SchedulerOutput, requests: dict[str, Request],
                      lost: set[str]) -> None:
        """Write-through: the full base-model blocks this (returned) step finished
        computing, noted before its requests finish or roll back drafts; the next step
        copies them out if they still hold their keys."""
        if not self.write_through:
            return
        if len(self._tiered) > MAX_TIERED_KEYS:  # forget old ones: a few copies twice
            self._tiered.clear()
        bs = self.block_size
        for req_id, num in out.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is None or req.is_finished or req_id in lost or req.lora_id \
                    or not self.kv.uses_cache(req):
                continue
            blocks = self.kv.req_blocks.get(req_id, [])
            drafts = len(out.spec_token_ids.get(req_id, ()))
            done = (req.num_computed_tokens + num - drafts) // bs
            for block in blocks[min(req.tier_noted, done):done]:
                key = block.block_hash
                if key is not None and key not in self._tiered:
                    self._computed_blocks.append((block.block_id, key))
            req.tier_noted = done

    def results(self, out: SchedulerOutput, result: ModelRunnerOutput,
                requests: dict[str, Request], lost: set[str]) -> None:
        """Publish the step's copied-out blocks; confirm its fetches (their blocks may be
        hit from now on) or, for one that failed, forget the entries and recompute."""
        blocks = []
        for key, parts in result.kv_offloaded.items():
            meta = self._offloading.pop(key, None)
            if meta is not None:
                blocks.append(TierBlock(key, meta[0], meta[1], [h for h, _ in parts],
                                        sum(n for _, n in parts), self.tier.owner))
        for _, key in out.kv_offload:  # copies no worker could store: gone
            self._offloading.pop(key, None)
        if blocks:
            self.tier.publish(blocks)
            self.stats.offloaded_blocks += len(blocks)
            self.stats.offloaded_bytes += sum(b.nbytes for b in blocks)
        for req_id in out.kv_fetch:
            keys = self._fetching.pop(req_id, [])
            req = requests.get(req_id)
            if req_id in result.failed_swaps or req_id in lost:
                self.tier.forget(keys)
                self._tiered.difference_update(keys)
                self.stats.fetch_failures += 1
                if req is not None:
                    req.tier_found = {}  # recompute; do not try those copies again
            elif req is not None:
                self.kv.confirm_restored(req)
