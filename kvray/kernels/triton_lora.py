"""Batched LoRA in Triton: the GPU twin of ``cpu_ops.lora_add`` (same signature and
layout, :mod:`kvray.kernels.lora`), two launches per layer whatever the adapters in the
batch: the shrink ``t = x A^T`` (a program per row and slice) and the expand
``y += t B^T`` (a program per row, slice and block of output columns). Each row reads its
own slot's tensors (the slot index comes from ``row_slots`` on the device: no host sync,
so the launches can sit in a CUDA graph). fp32 accumulation; ``y`` rounded once.

The tests run it on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.kernels.lora import COLUMN_BLOCK


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ranks_ptr, slots_ptr, t_ptr, stride_x, K, n_slices,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    offs_r = tl.arange(0, BLOCK_R)
    if slot >= 0:
        r = tl.load(ranks_ptr + slot * n_slices + i)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_base = a_ptr + ((slot * n_slices + i) * R) * K
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K,
                         other=0.0).to(tl.float32)
            a = tl.load(a_base + offs_r[:, None] * K + offs_k[None, :],
                        mask=(offs_r[:, None] < r) & (offs_k[None, :] < K),
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(t_ptr + (row * n_slices + i) * R + offs_r, acc, mask=offs_r < R)


@triton.jit
def _expand_kernel(y_ptr, t_ptr, bt_ptr, ranks_ptr, slots_ptr, starts_ptr, stride_y,
                   n_slices, num_blocks, R: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, COL_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1)
    nb = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        lo = tl.load(starts_ptr + i)
        hi = tl.load(starts_ptr + i + 1)
        r = tl.load(ranks_ptr + slot * n_slices + i)
        cols = lo + nb * BLOCK_N + tl.arange(0, BLOCK_N)
        if (r > 0) & (lo + nb * BLOCK_N < hi):
            offs_r = tl.arange(0, BLOCK_R)
            t = tl.load(t_ptr + (row * n_slices + i) * R + offs_r, mask=offs_r < r,
                        other=0.0)
            # B^T in blocks of COL_BLOCK columns: (j, c) at [slot, c // 64, j, c % 64]
            b_off = ((slot * num_blocks + cols[None, :] // COL_BLOCK) * R
                     + offs_r[:, None]) * COL_BLOCK + cols[None, :] % COL_BLOCK
            b = tl.load(bt_ptr + b_off, mask=(offs_r[:, None] < r) & (cols[None, :] < hi),
                        other=0.0).to(tl.float32)
            delta = tl.sum(b * t[:, None], axis=0)
            y_ptrs = y_ptr + row * stride_y + cols
            y = tl.load(y_ptrs, mask=cols < hi, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=cols < hi)


_STARTS: dict[tuple, torch.Tensor] = {}


def _device_starts(starts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A layer's slice starts on ``device``, copied there once (no copy per launch)."""
    key = (starts, str(device))
    if key not in _STARTS:
        _STARTS[key] = torch.tensor(starts, dtype=torch.int64, device=device)
    return _STARTS[key]


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             ranks: torch.Tensor, slice_starts: list[int], row_slots: torch.Tensor
             ) -> torch.Tensor:
    """``y`` [T, N] += each row's adapter delta, in place (see :mod:`kvray.kernels.lora`)."""
    rows, k = x.shape
    if rows == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert y.stride(-1) == 1, "y must have a contiguous last dimension"
    n_slices, max_rank = a.shape[1], a.shape[2]
    block_r = max(16, triton.next_power_of_2(max_rank))
    shrunk = torch.empty(rows, n_slices, max_rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, n_slices)](
        x, a, ranks, row_slots, shrunk, x.stride(0), k, n_slices, R=max_rank,
        BLOCK_R=block_r, BLOCK_K=64)
    starts = _device_starts(tuple(slice_starts), x.device)
    widest = max(hi - lo for lo, hi in zip(slice_starts, slice_starts[1:], strict=False))
    block_n = 64
    _expand_kernel[(rows, n_slices, triton.cdiv(widest, block_n))](
        y, shrunk, bt, ranks, row_slots, starts, y.stride(0), n_slices, bt.shape[1],
        R=max_rank, BLOCK_R=block_r, BLOCK_N=block_n, COL_BLOCK=COLUMN_BLOCK)
    return y
