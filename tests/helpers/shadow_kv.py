"""A shadow of the workers' KV cache for the scheduler tests: replays each step's block
tables and fails on a request reading K/V that is not its own."""

from __future__ import annotations

import zlib

from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.scheduler import Scheduler


class ShadowKV:
    """What the workers' KV cache holds, slot by slot: the K/V written at position p stands
    for the request's tokens 0..p (as a chained hash). Steps apply like the worker applies
    them: swaps first, then every scheduled token is written, then every scheduled request
    reads its whole context, which must be its own tokens. This catches a request reading a
    block that was never computed (e.g. keyed by a request preempted before computing it)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[int, int] = {}
        self.saved: dict[str, list[int | None]] = {}
        self.lose: set[str] = set()  # requests whose next restore fails (garbage arrives)
        self.failed: set[str] = set()  # restores that failed in the last step applied

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def apply(self, s: Scheduler, out) -> dict:
        """Replay ``out``; returns the blocks it copied out for the KV tier, as a worker
        reports them (key -> [(handle, nbytes)])."""
        offloaded = {key: [(tuple(self.slots.get(block * self.bs + i)
                                  for i in range(self.bs)), 64)]
                     for block, key in out.kv_offload}
        for rid, blocks in out.swap_out.items():
            self.saved[rid] = [self.slots.get(b * self.bs + i) for b in blocks
                               for i in range(self.bs)]
        self.failed = set(out.swap_in) & self.lose
        for rid, blocks in out.swap_in.items():
            saved = self.saved.pop(rid)
            assert len(saved) == len(blocks) * self.bs
            if rid in self.failed:
                saved = [None] * len(saved)  # the copy never arrived: the blocks hold junk
            for k, value in enumerate(saved):
                self.slots[blocks[k // self.bs] * self.bs + k % self.bs] = value
        for rid in out.swap_drop:
            self.saved.pop(rid)
        self.failed |= set(out.kv_fetch) & self.lose
        for rid, fetched in out.kv_fetch.items():
            for block, (handle,) in fetched:
                for i, value in enumerate(handle):
                    self.slots[block * self.bs + i] = None if rid in self.failed else value
        # A placeholder (async scheduling) stands for the token the step in flight samples,
        # which the test's workers pick by sampled_token.
        prefixes = {rid: _prefix_hashes(s.requests[rid].all_token_ids + (
            [sampled_token(rid, s.requests[rid].num_tokens)]
            if rid in out.placeholder_req_ids else [])) for rid in out.num_scheduled_tokens}
        # where each request starts: past its tokens in steps still in flight before this
        starts = {rid: s.requests[rid].num_computed_tokens + s._in_flight_tokens[rid] - n
                  for rid, n in out.num_scheduled_tokens.items()}
        for rid, n in out.num_scheduled_tokens.items():
            table = s.kv.block_ids(rid)
            for pos in range(starts[rid], starts[rid] + n):
                self.slots[self._slot(table, pos)] = prefixes[rid][pos]
        for rid, n in out.num_scheduled_tokens.items():
            if rid in self.failed:
                continue  # reads junk, and the scheduler drops what it computed
            table = s.kv.block_ids(rid)
            for pos in range(starts[rid] + n):
                assert self.slots.get(self._slot(table, pos)) == prefixes[rid][pos], \
                    f"{rid} reads wrong K/V at position {pos}"
        return offloaded


    def step(self, s: Scheduler) -> SchedulerOutput:
        """One step of ``s`` replayed here, fed back as the workers would: a token for
        each request whose scheduled tokens reach its end, the restores and fetches that
        failed, the blocks copied out for the KV tier."""
        out = s.schedule()
        offloaded = self.apply(s, out)
        sampled = []
        for rid, n in out.num_scheduled_tokens.items():
            r = s.requests[rid]
            sampled.append([7] if r.num_computed_tokens + n == r.num_tokens else [])
        s.update_from_output(out, ModelRunnerOutput(
            list(out.num_scheduled_tokens), sampled, [None] * len(sampled),
            [[0.0] * len(x) for x in sampled], failed_swaps=set(self.failed),
            kv_offloaded=offloaded))
        self.lose -= self.failed
        return out


def sampled_token(rid: str, pos: int) -> int:
    """The token the test's workers sample for ``rid`` at position ``pos``: fixed, so that a
    step scheduled before it is sampled (async scheduling) can be replayed."""
    return zlib.crc32(f"{rid}:{pos}".encode()) % 50


def _prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))  # ints hash the same in every process
        out.append(h)
    return out
