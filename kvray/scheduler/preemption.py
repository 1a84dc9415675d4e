"""What a preemption costs, for ``preemption_mode="auto"``: swap or recompute per victim.

Pure Python. The engine measures two per-unit costs at start-up (:func:`measure_costs`
times the steps :func:`probe_steps` builds) and hands them to the scheduler as
:class:`PreemptionCosts`; the scheduler prices each victim with them and picks the cheaper
way to give up its blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvray.sampling_params import SamplingParams
from kvray.scheduler.output import NewRequestData, SchedulerOutput

PROBE_ID = "__kvray_cost_probe__"  # never a user's id: the engine's own, dropped at once


@dataclass(frozen=True)
class PreemptionCosts:
    """Measured per-unit costs of the two ways a victim gives up its blocks."""

    prefill_s_per_token: float  # marginal seconds to prefill one more token in a step
    swap_s_per_byte: float  # seconds to save one byte of KV and restore it later
    bytes_per_block: int  # KV bytes of one block on the largest worker shard

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to compute ``num_tokens`` again when the victim is re-admitted."""
        return num_tokens * self.prefill_s_per_token

    def swap_s(self, num_blocks: int) -> float:
        """Seconds to copy ``num_blocks`` out to the swap pool and back in."""
        return num_blocks * self.bytes_per_block * self.swap_s_per_byte

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """True when swapping ``num_blocks`` out and in is cheaper than recomputing
        ``num_tokens``. Ties recompute: it holds no pool space."""
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)


@dataclass
class ProbeSteps:
    """The synthetic steps the engine times at start-up, in the order it runs them."""

    prefill_long: SchedulerOutput  # one request prefilling ``num_tokens``
    prefill_short: SchedulerOutput  # another prefilling a few tokens (the per-step overhead)
    empty: SchedulerOutput  # nothing scheduled: the round trip alone
    swap_out: SchedulerOutput  # save the long request's blocks
    swap_in: SchedulerOutput  # restore them, into the same blocks
    finish: SchedulerOutput  # the workers forget both probe requests
    num_tokens_long: int
    num_tokens_short: int
    num_blocks_swapped: int


def probe_steps(num_tokens: int, block_size: int, vocab_size: int) -> ProbeSteps:
    """Steps that measure prefill time per token and swap time per block on blocks
    ``0 .. ceil(num_tokens / block_size) - 1``, greedy (no generator is drawn from). Run
    them before any request: they overwrite those blocks, which is harmless only while the
    scheduler has keyed none of them. ``finish`` leaves the workers as they were."""
    assert num_tokens >= 2
    num_short = max(1, num_tokens // 8)
    num_blocks = -(-num_tokens // block_size)
    blocks = list(range(num_blocks))
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens = [(7 * i + 3) % vocab_size for i in range(num_tokens)]

    def prefill(req_id: str, n: int) -> SchedulerOutput:
        new = NewRequestData(req_id, tokens[:n], n, greedy, blocks[: -(-n // block_size)],
                             0, None)
        return SchedulerOutput(new_requests=[new], num_scheduled_tokens={req_id: n})

    # The short request's tokens are a prefix of the long one's, at the same positions and
    # in the same blocks: it rewrites them with the values they already hold.
    short_id = PROBE_ID + "short"
    return ProbeSteps(
        prefill_long=prefill(PROBE_ID, num_tokens),
        prefill_short=prefill(short_id, num_short),
        empty=SchedulerOutput(),
        swap_out=SchedulerOutput(swap_out={PROBE_ID: blocks}),
        swap_in=SchedulerOutput(swap_in={PROBE_ID: blocks}),
        finish=SchedulerOutput(finished_req_ids={PROBE_ID, short_id}),
        num_tokens_long=num_tokens, num_tokens_short=num_short, num_blocks_swapped=num_blocks)


PROBE_TOKENS = 64  # longest prefill timed at start-up
PROBE_REPEATS = 2  # empty steps and swap round trips timed; the best counts


def measure_costs(run: Callable[[SchedulerOutput], object], num_tokens: int, block_size: int,
                  vocab_size: int, bytes_per_block: int, swap_blocks: int) -> PreemptionCosts:
    """Time :func:`probe_steps` through ``run`` (the executor, as real steps run) on a fresh
    cache: prefill seconds per token as the slope between a long and a short prefill (a
    step's fixed cost is paid anyway), swap seconds per byte as a save plus a restore less
    two empty round trips. The long prefill and the copies are timed twice and the faster
    counts (the first call also pays one-off set-up). Bounded: three forward passes of at
    most ``min(num_tokens, PROBE_TOKENS)`` tokens and two round trips of their blocks."""
    n = min(num_tokens, PROBE_TOKENS)
    if n < 2 or swap_blocks == 0:  # no pool, or nothing to measure with: recompute
        return PreemptionCosts(0.0, math.inf, bytes_per_block)
    steps = probe_steps(n, block_size, vocab_size)
    first_long = _timed(run, steps.prefill_long)  # also pays the first forward's set-up
    short = _timed(run, steps.prefill_short)
    long = min(first_long, _timed(run, steps.prefill_long))
    empty = min(_timed(run, steps.empty) for _ in range(PROBE_REPEATS))
    out_in = min(_timed(run, steps.swap_out) + _timed(run, steps.swap_in)
                 for _ in range(PROBE_REPEATS))
    run(steps.finish)
    # Timer noise can make a difference negative; the gross time then stands in.
    num_long, num_short = steps.num_tokens_long, steps.num_tokens_short
    per_token = (long - short) / (num_long - num_short) if long > short else long / num_long
    swap = out_in - 2 * empty if out_in > 2 * empty else out_in
    return PreemptionCosts(per_token, swap / (steps.num_blocks_swapped * bytes_per_block),
                           bytes_per_block)


def _timed(run: Callable[[SchedulerOutput], object], step: SchedulerOutput) -> float:
    start = time.perf_counter()
    run(step)
    return time.perf_counter() - start
