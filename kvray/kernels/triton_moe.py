"""Mixture-of-experts layers in Triton: the GPU twin of the grouped loop in
:class:`kvray.models.moe.MoEExperts` (one GEMM pair per active expert), as two launches of
one grouped GEMM whatever the number of active experts.

The (token, slot) pairs of a step are sorted by expert and each expert's run is padded to
whole blocks of ``BLOCK_M`` rows (:func:`align_pairs`, torch ops on the device: no host
sync, so a step's launches keep their shapes). A program takes one block (one expert) and
one tile of output columns: the first launch multiplies the block's token rows by that
expert's gate/up rows, the SiLU-and-mul runs on the result, the second launch multiplies by
its down rows and scales each pair by its routing weight; a token's k pairs are summed at
the end. Blocks of experts this rank does not hold (expert parallelism) are skipped, their
pairs contributing zero, as the grouped loop does. fp32 accumulation.

The tests compare it with a per-token loop on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``): top-k 1, 2 and 8, experts that receive no token, one token to
every expert, a subset of experts held.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pair rows per program: tl.dot's smallest tile


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr, N, K,
                         num_pairs, stride_a, stride_we, stride_wn, stride_c,
                         ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """c[pair, n] = a[pair // ROWS_PER_A] . w[expert, n] (x the pair's weight)."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert >= 0:
        # The interpreter's tl.dot mishandles bf16: on CPU the tiles are multiplied in fp32.
        dtype = tl.float32 if DOT_FP32 else a_ptr.dtype.element_ty
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pair_ptr + offs_m)
        valid = pairs < num_pairs
        rows = pairs // ROWS_PER_A
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            acc += tl.dot(a.to(dtype), w.to(dtype), input_precision=PRECISION)
        if MUL_WEIGHT:
            acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + pairs[:, None] * stride_c + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_pairs(experts: torch.Tensor, num_experts: int, local_index: torch.Tensor,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``experts`` [tokens, k] grouped by expert, each expert's
    run padded to whole blocks: (pair ids [blocks * block_m], padding = the pair count;
    each block's local expert [blocks], -1 for experts not held here and unused blocks).
    ``local_index`` [num_experts] maps a global expert id to its row in the weights, or -1.
    The block count is the bound for any routing, so no value is read on the host."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    blocks = triton.cdiv(pairs + num_experts * (block_m - 1), block_m)
    pair_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int64, device=flat.device)
    pair_ids[(ends - padded)[sorted_experts] + rank] = order
    starts = torch.arange(blocks, device=flat.device) * block_m
    owner = torch.searchsorted(ends, starts, right=True)
    local = local_index[owner.clamp(max=num_experts - 1)]
    return pair_ids, torch.where(owner < num_experts, local, -1).to(torch.int32)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_ids: torch.Tensor,
                  block_experts: torch.Tensor, rows_per_a: int,
                  weights: torch.Tensor | None) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, pair_ids, block_experts, weights if weights is not None else a, n, k,
        out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHT=weights is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_FP32=a.device.type == "cpu")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
    """This rank's sum over each token's chosen experts: ``x`` [T, H], ``w13``
    [local experts, 2 I, H] (gate rows, then up rows), ``w2`` [local experts, H, I],
    ``weights`` / ``experts`` [T, k] the routing weights and global expert ids,
    ``local_index`` [experts] (see :func:`align_pairs`). Returns [T, H] in x's dtype."""
    tokens, top_k = experts.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    pair_ids, block_experts = align_pairs(experts, local_index.numel(), local_index)
    pairs = tokens * top_k
    inter = w2.shape[2]
    gate_up = torch.zeros(pairs, 2 * inter, dtype=torch.float32, device=x.device)
    _grouped_gemm(x, w13, gate_up, pair_ids, block_experts, top_k, None)
    act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
    down = torch.zeros(pairs, x.shape[1], dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, down, pair_ids, block_experts, 1, flat_weights)
    return down.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
