"""Decode steps replayed from CUDA graphs.

A decode step of a small model launches a few hundred kernels, each for microseconds of
work: on a GPU the launches, not the math, set the step time. A CUDA graph records the
step's launches once per batch size and replays them with one call. A graph replays fixed
addresses and shapes, so:

- inputs live in static buffers sized for the largest captured batch; each step copies its
  rows in and pads the batch up to the next captured size (:func:`capture_sizes`,
  :func:`padded_size`);
- pad rows are one-token sequences of length 1 that read and write only the *pad block*,
  a KV block past the ones the block manager hands out, so they touch nobody's cache;
- block tables are as wide as ``max_model_len`` needs, so any context fits the same graph;
- every op inside must be free of host syncs and host-side shapes: the Triton attention
  kernels are (the PyTorch reference reads ``seq_lens_list`` on the host), so graphs are
  used with ``attention_backend`` triton, TP = PP = 1 (collectives stay eager), and not
  under ``enforce_eager``.

Without CUDA the same class runs the padded batch eagerly (``capture=False``): the tests
check the padding and buffer logic on CPU, token for token.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from kvray.kernels.attention import AttentionMetadata

# 1, 2, 4, then every multiple of 8: padding costs at most 7 rows past 8.
_SMALL_SIZES = (1, 2, 4)
_STEP = 8


def capture_sizes(max_num_seqs: int, limit: int = 256,
                  requested: Sequence[int] | None = None) -> list[int]:
    """Batch sizes to capture, ascending: ``requested`` if given (capped at
    ``max_num_seqs``), else 1, 2, 4 and the multiples of 8 up to ``min(max_num_seqs,
    limit)``, plus that cap itself so the largest batch the scheduler can send has a graph."""
    if requested is not None:
        return sorted({s for s in requested if s <= max_num_seqs})
    top = min(max_num_seqs, limit)
    sizes = [s for s in _SMALL_SIZES if s <= top] + list(range(_STEP, top + 1, _STEP))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_rows`` (None: past the largest)."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Static input buffers and one graph per captured batch size for pure-decode steps.

    ``model(input_ids, meta, kv_caches=...)`` must return the final hidden states (the last
    pipeline stage, TP = 1). ``pad_block`` is a cache block nobody else uses."""

    def __init__(self, model: Callable[..., torch.Tensor], kv_caches: list[torch.Tensor | None],
                 sizes: Sequence[int], max_blocks_per_seq: int, block_size: int,
                 pad_block: int, device: torch.device, decode_kernel: Callable | None,
                 write_kernel: Callable | None, capture: bool) -> None:
        assert sizes, "at least one batch size to capture"
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.decode_kernel, self.write_kernel = decode_kernel, write_kernel
        largest = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(largest, **i64)
        self.positions = torch.zeros(largest, **i64)
        self.slot_mapping = torch.full((largest,), self.pad_slot, **i64)
        self.block_tables = torch.full((largest, max_blocks_per_seq), pad_block, **i64)
        self.seq_lens = torch.ones(largest, **i64)
        self.query_start_loc = torch.arange(largest + 1, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = self.padded_rows = 0  # what ran through here (tests, metrics)
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int, seq_lens_list: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], seq_lens_list=seq_lens_list, num_decodes=size,
            decode_kernel=self.decode_kernel, write_kernel=self.write_kernel,
            max_query_len=1, kernels_take_softcap=True)  # every backend's kernels cap (plan)

    def _capture(self) -> None:
        """Largest size first, all graphs sharing one memory pool (the smaller ones fit in
        what the larger one freed). Each size runs once eagerly first: Triton compiles
        (and autotunes) outside the capture."""
        pool = None
        for size in reversed(self.sizes):
            meta = self._meta(size, [1] * size)
            ids = self.input_ids[:size]
            self.model(ids, meta, kv_caches=self.kv_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, meta, kv_caches=self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [n, H] of a pure-decode batch of n rows (``meta`` as the runner
        built it), or None when n is past the largest captured size (run it eagerly)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:size].fill_(self.pad_block)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if size > n:  # pad rows: length-1 sequences on the pad block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
        self.steps += 1
        self.padded_rows += size - n
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        lens = list(meta.seq_lens_list) + [1] * (size - n)  # eager: the host-side lengths
        out = self.model(self.input_ids[:size], self._meta(size, lens),
                         kv_caches=self.kv_caches)
        return out[:n]
