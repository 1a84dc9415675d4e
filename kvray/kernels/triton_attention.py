"""Paged attention in Triton: the KV write, split-K decode and varlen prefill over the
paged cache. The GPU path of :mod:`kvray.kernels.attention`, with the same cache layout
(``[2, num_kv_heads, num_blocks, block_size, head_dim]``) and the same semantics as its
PyTorch reference, which the tests compare against on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported).

- :func:`write_kv`: one program per (token, KV head) copies K and V into their slot.
- :func:`paged_decode`: flash-decoding. Each (sequence, query head, split) program runs an
  online softmax over its share of the sequence's blocks, reading K/V in place; a second
  kernel merges the splits. GQA/MQA by ``kv_head = q_head // group``; sliding windows skip
  whole blocks before the window.
- :func:`paged_prefill`: queries of a chunk (any length, after a cached prefix of any
  length) against the paged K/V, causal, ``BLOCK_M`` queries per program.

Head dims need not be powers of two (80, 96 ...): loads are masked to ``head_dim``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_c0, stride_ch, stride_cslot,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    slot = tl.load(slot_ptr + t)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=dmask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=dmask)
    base = cache_ptr + h * stride_ch + slot * stride_cslot + offs_d
    tl.store(base, k, mask=dmask)
    tl.store(base + stride_c0, v, mask=dmask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, Hk, D]) into their slots of ``kv_cache``."""
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    _, _, num_blocks, block_size, _ = kv_cache.shape
    flat = kv_cache.view(2, heads, num_blocks * block_size, dim)
    _write_kv_kernel[(num_tokens, heads)](
        k, v, flat, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat.stride(0), flat.stride(1), flat.stride(2),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim))


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, part_acc_ptr,
                         part_ml_ptr, scale, window, stride_qb, stride_qh, stride_c0,
                         stride_ch, stride_cblk, stride_cslot, stride_tb,
                         NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first = start // BLOCK_SIZE
    last = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    per_split = (last - first + NUM_SPLITS - 1) // NUM_SPLITS
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, last)

    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for blk in range(lo, hi):
        phys = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + offs_s
        valid = (pos < seq_len) & (pos >= start)
        ptrs = (cache_ptr + kvh * stride_ch + phys * stride_cblk
                + offs_s[:, None] * stride_cslot + offs_d[None, :])
        mask = valid[:, None] & dmask[None, :]
        k = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(ptrs + stride_c0, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS + split
    tl.store(part_acc_ptr + row * BLOCK_D + offs_d, acc)
    tl.store(part_ml_ptr + row * 2, m_i)
    tl.store(part_ml_ptr + row * 2 + 1, l_i)


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, NUM_SPLITS)
    rows = (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_p
    m = tl.load(part_ml_ptr + rows * 2)
    lsum = tl.load(part_ml_ptr + rows * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh 0
    acc = tl.load(part_acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def num_decode_splits(max_blocks: int, batch_heads: int, target_programs: int = 256) -> int:
    """Splits per (sequence, head): enough programs to fill the device, never more than
    the blocks (a power of two, as the merge kernel's block needs)."""
    splits = 1
    while splits * 2 <= max_blocks and batch_heads * splits * 2 <= target_programs:
        splits *= 2
    return splits


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None
                 ) -> torch.Tensor:
    """q: [B, Hq, D]; kv_cache: [2, Hk, num_blocks, block_size, D] -> [B, Hq, D] (the
    signature of the engine's other decode kernels)."""
    batch, hq, dim = q.shape
    _, hk, _, block_size, _ = kv_cache.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    splits = num_decode_splits(block_tables.shape[1], batch * hq)
    part_acc = torch.empty(batch * hq * splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * hq * splits, 2, dtype=torch.float32, device=q.device)
    grid = (batch, hq, splits)
    _decode_split_kernel[grid](
        q, kv_cache, block_tables, seq_lens, part_acc, part_ml, scale, sliding_window or 0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        NUM_SPLITS=splits, GROUP=hq // hk, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        BLOCK_D=block_d)
    _decode_merge_kernel[(batch, hq)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                      NUM_SPLITS=splits, HEAD_DIM=dim, BLOCK_D=block_d)
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qstart_ptr, out_ptr, scale,
                    window, stride_qt, stride_qh, stride_c0, stride_ch, stride_cblk,
                    stride_cslot, stride_tb, stride_ot, stride_oh, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # cached tokens before this chunk
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = offs_m < q_len
    q_pos = context + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
                + offs_d[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32)

    lowest = tl.minimum(context + tile * BLOCK_M, seq_len)  # this tile's first position
    start = tl.where(window > 0, tl.maximum(lowest - window + 1, 0), 0)
    highest = tl.minimum(context + (tile + 1) * BLOCK_M, seq_len)
    first = start // BLOCK_SIZE
    # An empty tile of a short chunk has nothing to do.
    last = tl.where(tile * BLOCK_M < q_len, (highest + BLOCK_SIZE - 1) // BLOCK_SIZE, first)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(first, last):
        phys = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        k_pos = blk * BLOCK_SIZE + offs_s
        ptrs = (cache_ptr + kvh * stride_ch + phys * stride_cblk
                + offs_s[:, None] * stride_cslot + offs_d[None, :])
        kmask = (k_pos < seq_len)[:, None] & dmask[None, :]
        k = tl.load(ptrs, mask=kmask, other=0.0).to(tl.float32)
        if USE_DOT:  # tensor cores; fp32 kept exact ("ieee", not tf32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:  # shapes below tl.dot's 16 (the interpreter, tiny blocks)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [M, BLOCK_SIZE]
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        ok = ok & ((window <= 0) | (q_pos[:, None] - k_pos[None, :] < window))
        ok = ok & qmask[:, None]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(ptrs + stride_c0, mask=kmask, other=0.0).to(tl.float32)
        if USE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                  scale: float, sliding_window: int | None, block_m: int = 16
                  ) -> torch.Tensor:
    """q: [T, Hq, D] — the new tokens of B sequences, sequence b's at
    ``query_start_loc[b]:query_start_loc[b + 1]``, the last of its ``seq_lens[b]`` positions
    (its K/V already written) — attended causally over the paged cache -> [T, Hq, D]."""
    num_tokens, hq, dim = q.shape
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    hk, block_size = kv_cache.shape[1], kv_cache.shape[3]
    block_d = triton.next_power_of_2(dim)
    grid = (batch, hq, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, sliding_window or 0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hk, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        BLOCK_D=block_d, USE_DOT=min(block_m, block_size, block_d) >= 16)
    return out


def self_check(device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """Compile and run every kernel once on a tiny paged batch and compare it with the
    PyTorch reference; raise if anything fails or differs. The engine runs it before it
    trusts these kernels by default (``attention_backend: auto`` on CUDA)."""
    from kvray.kernels import attention as ref

    g = torch.Generator().manual_seed(0)
    hq, hk, dim, block_size, num_blocks = 4, 2, 64, 16, 8
    cache = torch.randn(2, hk, num_blocks, block_size, dim, generator=g).to(device, dtype)
    expect = cache.clone()
    k = torch.randn(3, hk, dim, generator=g).to(device, dtype)
    v = torch.randn(3, hk, dim, generator=g).to(device, dtype)
    slots = torch.tensor([18, 19, 40], device=device)
    write_kv(k, v, cache, slots)
    ref.write_kv_cache(k, v, expect, slots)
    if not torch.equal(cache, expect):
        raise RuntimeError("Triton write_kv differs from the reference")
    tables = torch.tensor([[1, 2, 0], [3, 4, 5]], device=device)
    lens = torch.tensor([20, 41], device=device)
    q = torch.randn(2, hq, dim, generator=g).to(device, dtype)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    got = paged_decode(q, cache, tables, lens, 0.125, None)
    want = torch.cat([ref._decode(q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1],
                                  int(lens[i]), 0.125, None) for i in range(2)])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    starts = torch.tensor([0, 2, 20], device=device)
    q = torch.randn(20, hq, dim, generator=g).to(device, dtype)
    got = paged_prefill(q, cache, tables, lens, starts, 18, 0.125, None)
    want = torch.cat([ref._prefill_one(q[s:e], cache, tables[b], int(lens[b]), 0.125, None)
                      for b, (s, e) in enumerate([(0, 2), (2, 20)])])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
