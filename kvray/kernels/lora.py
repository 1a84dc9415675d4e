"""Batched LoRA: add each token row's adapter delta to a linear layer's output.

Rows of one batch run different adapters (or none). The adapters resident on a worker sit
in slots of stacked tensors, per layer:

- ``a``  [slots, slices, max_rank, in]: slice i's A rows (its rank r_i of them; the rest 0);
- ``bt`` [slots, ceil(out / 64), max_rank, 64]: B transposed and already scaled, in blocks
  of 64 output columns (each block one contiguous read; :func:`unblock` gives the
  [max_rank, out] matrix): slice i's rows [0, r_i) in slice i's output columns;
- ``ranks`` int64 [slots, slices]: r_i per slot (0: the adapter does not touch the slice);
- ``slice_starts``: the output column where each slice starts, and the end.

For the rows of slot s: ``y[:, slice i] += (x A_i^T) B_i^T`` — the Punica / S-LoRA
"shrink then expand", one small GEMM pair per adapter present in the batch, never a loop
over rows in Python. :func:`lora_add_reference` is the PyTorch definition (and the path on
devices without a kernel); ``cpu_ops.lora_add`` computes the same in one C++ call.
"""

from __future__ import annotations

import torch

COLUMN_BLOCK = 64  # output columns per block of ``bt``


def blocked_shape(out_features: int, max_rank: int) -> tuple[int, int, int]:
    """``bt``'s shape per slot for a layer of ``out_features`` columns."""
    return -(-out_features // COLUMN_BLOCK), max_rank, COLUMN_BLOCK


def unblock(bt_slot: torch.Tensor, out_features: int) -> torch.Tensor:
    """One slot of ``bt`` as the plain [max_rank, out] matrix B^T (a copy)."""
    blocks, rank, width = bt_slot.shape
    return bt_slot.transpose(0, 1).reshape(rank, blocks * width)[:, :out_features]


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                       ranks: torch.Tensor, slice_starts: list[int],
                       row_slots: torch.Tensor) -> torch.Tensor:
    """``y`` [T, out] += each row's adapter delta, in place (fp32 math); rows whose slot is
    negative are left alone. ``row_slots`` int64 [T]. Returns ``y``."""
    slots = row_slots.tolist()
    present = sorted({s for s in slots if s >= 0})
    ranks_host = ranks.tolist()
    for s in present:
        rows = torch.tensor([t for t, v in enumerate(slots) if v == s], device=y.device)
        xs = x.index_select(0, rows).float()
        delta = torch.zeros(rows.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        b_t = unblock(bt[s], y.shape[1])
        for i, r in enumerate(ranks_host[s]):
            if r == 0:
                continue
            lo, hi = slice_starts[i], slice_starts[i + 1]
            shrunk = xs @ a[s, i, :r].float().t()
            delta[:, lo:hi] += shrunk @ b_t[:r, lo:hi].float()
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
    return y
