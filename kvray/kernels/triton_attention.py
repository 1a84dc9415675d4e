"""Paged attention in Triton: decode and varlen prefill over the paged cache. The GPU path
of :mod:`kvray.kernels.attention`, with the same cache layout (``[2, num_kv_heads,
num_blocks, block_size, head_dim]``) and the same semantics as its PyTorch reference, which
the tests compare against on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported). What writes the cache (:func:`write_kv`, the fused
:func:`rotary_write_kv`) and its quantized row format live in :mod:`kvray.kernels.triton_kv`.

- :func:`paged_decode`: short contexts (or batches whose programs fill the device alone) in
  one launch, one program per (sequence, KV head) running an online softmax over all its
  blocks for the KV head's whole query group (each K/V row read once); longer ones
  flash-decoding style, each (sequence, query head, split) program over its share of the
  blocks, then a merge kernel. GQA/MQA by ``kv_head = q_head // group``; sliding windows
  skip whole blocks before the window.
- :func:`paged_prefill`: queries of a chunk (any length, after a cached prefix of any
  length) against the paged K/V, causal, ``BLOCK_M`` queries per program.

Both take Gemma 2's score capping (``softcap``): ``cap * tanh(score / cap)`` before the mask.
Head dims need not be powers of two (80, 96 ...): loads are masked to ``head_dim``. Quantized
caches (int8 / fp8 e4m3 / fp8 e5m2 codes with a per-row fp32 scale) are decoded in registers;
attention accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.kernels.triton_kv import (
    KV_KINDS,
    SCALE_BYTES,
    dequantize_cache,
    kernel_view,
    kv_kind,
    load_kv,
    rotary_write_kv,
    write_kv,
)

__all__ = ["KV_KINDS", "SCALE_BYTES", "dequantize_cache", "kv_kind", "paged_decode",
           "paged_prefill", "rotary_write_kv", "self_check", "write_kv"]


@triton.jit
def _cap(s, softcap, SOFTCAP: tl.constexpr):
    """Gemma 2's score capping ``cap * tanh(s / cap)`` (tanh from exp: no overflow)."""
    if SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(s / softcap))
        t = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(s < 0, -t, t)
    return s


@triton.jit
def _decode_one_pass_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, out_ptr, scale,
                            softcap, window, stride_qb, stride_qh, stride_ob, stride_oh,
                            stride_c0, stride_ch, stride_cblk, stride_cslot, stride_tb,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, KV_KIND: tl.constexpr,
                            SOFTCAP: tl.constexpr, USE_DOT: tl.constexpr,
                            DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    head_cache = cache_ptr + kvh.to(tl.int64) * stride_ch  # past 2^31 bytes: int64
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    offs_g = tl.arange(0, GROUP_PAD)
    gmask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + offs_g  # the group's query heads share this KV head's reads
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=qmask, other=0.0)
    dot_dtype = tl.float32 if DOT_FP32 else q.dtype
    q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for blk in range(start // BLOCK_SIZE, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE):
        phys = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + offs_s
        valid = (pos < seq_len) & (pos >= start)
        rows = head_cache + phys * stride_cblk + offs_s * stride_cslot
        k = load_kv(rows, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
        if USE_DOT:  # the keys in the queries' dtype, as the reference gathers them
            s = tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision="ieee")
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(valid[None, :], _cap(s * scale, softcap, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a block holds a valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = load_kv(rows + stride_c0, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
        if USE_DOT:
            pv = tl.dot(p.to(dot_dtype), v.to(dot_dtype), input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, part_acc_ptr,
                         part_ml_ptr, scale, softcap, window, stride_qb, stride_qh,
                         stride_c0, stride_ch, stride_cblk, stride_cslot, stride_tb,
                         NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, KV_KIND: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP
    head_cache = cache_ptr + kvh.to(tl.int64) * stride_ch  # past 2^31 bytes: int64
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
        rows = head_cache + phys * stride_cblk + offs_s * stride_cslot
        k = load_kv(rows, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
        s = _cap(tl.sum(k * q[None, :], axis=1) * scale, softcap, SOFTCAP)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = load_kv(rows + stride_c0, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
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


# KV head) streams them all (16 blocks of 16 tokens: 256 tokens, 128 KiB of bf16 K/V at
# head_dim 128), where a merge launch would cost more than the parallelism it buys.
ONE_PASS_MAX_BLOCKS = 16
TARGET_PROGRAMS = 256  # about two per SM of an H100/H200: enough to fill the device


def num_decode_splits(max_blocks: int, batch_heads: int,
                      target_programs: int = TARGET_PROGRAMS) -> int:
    """Splits per (sequence, head): enough programs to fill the device, never more than
    the blocks (a power of two, as the merge kernel's block needs)."""
    splits = 1
    while splits * 2 <= max_blocks and batch_heads * splits * 2 <= target_programs:
        splits *= 2
    return splits


def decode_in_one_pass(max_blocks: int, batch_kv_heads: int) -> bool:
    """Whether a decode batch takes the one-pass kernel: its block tables are at most
    :data:`ONE_PASS_MAX_BLOCKS` wide, or its (sequence, KV head) programs fill the device
    by themselves (a split would only add the merge). Host-side shapes only: a CUDA graph
    keeps the choice it was captured with."""
    return max_blocks <= ONE_PASS_MAX_BLOCKS or batch_kv_heads >= TARGET_PROGRAMS


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; kv_cache: [2, Hk, num_blocks, block_size, D (+ 4 quantized)] ->
    [B, Hq, D] (the signature of the engine's other decode kernels; ``softcap``: Gemma 2's
    ``cap * tanh(score / cap)``). One launch where :func:`decode_in_one_pass`, else the
    split kernel and the merge."""
    batch, hq, dim = q.shape
    _, hk, _, block_size, _ = kv_cache.shape
    kind, _ = kv_kind(kv_cache, dim)
    cache = kernel_view(kv_cache)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    common = dict(BLOCK_SIZE=block_size, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
                  KV_KIND=kind, SOFTCAP=softcap is not None)
    strides = (cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
               block_tables.stride(0))
    if decode_in_one_pass(block_tables.shape[1], batch * hk):
        group = hq // hk
        use_dot = block_size >= 16  # tl.dot's least size (the group is padded to it)
        _decode_one_pass_kernel[(batch, hk)](
            q, cache, block_tables, seq_lens, out, scale, softcap or 0.0, sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, GROUP=group,
            GROUP_PAD=max(16 if use_dot else 1, triton.next_power_of_2(group)),
            USE_DOT=use_dot, DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",
            **common)
        return out
    splits = num_decode_splits(block_tables.shape[1], batch * hq)
    block_d = common["BLOCK_D"]
    part_acc = torch.empty(batch * hq * splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * hq * splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, hq, splits)](
        q, cache, block_tables, seq_lens, part_acc, part_ml, scale, softcap or 0.0,
        sliding_window or 0, q.stride(0), q.stride(1), *strides, NUM_SPLITS=splits,
        GROUP=hq // hk, **common)
    _decode_merge_kernel[(batch, hq)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                      NUM_SPLITS=splits, HEAD_DIM=dim, BLOCK_D=block_d)
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qstart_ptr, out_ptr, scale,
                    softcap, window, stride_qt, stride_qh, stride_c0, stride_ch, stride_cblk,
                    stride_cslot, stride_tb, stride_ot, stride_oh, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, KV_KIND: tl.constexpr,
                    SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    kvh = h // GROUP
    head_cache = cache_ptr + kvh.to(tl.int64) * stride_ch  # past 2^31 bytes: int64
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
        rows = head_cache + phys * stride_cblk + offs_s * stride_cslot
        in_seq = k_pos < seq_len
        k = load_kv(rows, offs_d, in_seq, dmask, KV_KIND, HEAD_DIM)
        if USE_DOT:  # tensor cores; fp32 kept exact ("ieee", not tf32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:  # shapes below tl.dot's 16 (the interpreter, tiny blocks)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [M, BLOCK_SIZE]
        s = _cap(s, softcap, SOFTCAP)
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        ok = ok & ((window <= 0) | (q_pos[:, None] - k_pos[None, :] < window))
        ok = ok & qmask[:, None]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = load_kv(rows + stride_c0, offs_d, in_seq, dmask, KV_KIND, HEAD_DIM)
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
                  scale: float, sliding_window: int | None, block_m: int = 16,
                  softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] — the new tokens of B sequences, sequence b's at
    ``query_start_loc[b]:query_start_loc[b + 1]``, the last of its ``seq_lens[b]`` positions
    (its K/V already written) — attended causally over the paged cache -> [T, Hq, D]
    (``softcap``: Gemma 2's ``cap * tanh(score / cap)``)."""
    num_tokens, hq, dim = q.shape
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    hk, block_size = kv_cache.shape[1], kv_cache.shape[3]
    kind, _ = kv_kind(kv_cache, dim)
    cache = kernel_view(kv_cache)
    block_d = triton.next_power_of_2(dim)
    grid = (batch, hq, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, cache, block_tables, seq_lens, query_start_loc, out, scale, softcap or 0.0,
        sliding_window or 0, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        cache.stride(2), cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hk, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        BLOCK_D=block_d, USE_DOT=min(block_m, block_size, block_d) >= 16, KV_KIND=kind,
        SOFTCAP=softcap is not None)
    return out


def self_check(device: torch.device | str, dtype: torch.dtype = torch.float32,
               kv_dtype: torch.dtype | None = None) -> None:
    """Compile and run every kernel once on a tiny paged batch and compare it with the
    PyTorch reference; raise if anything fails or differs. The engine runs it before it
    trusts these kernels by default (``attention_backend: auto`` on CUDA). With a quantized
    ``kv_dtype`` (int8, float8_e4m3fn, float8_e5m2), also the kernels on such a cache."""
    if kv_dtype is not None and kv_dtype in KV_KINDS:
        _self_check_quantized(device, dtype, kv_dtype)
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
    _check_rotary_write(device, dtype, cache, g)
    tables = torch.tensor([[1, 2, 0], [3, 4, 5]], device=device)
    lens = torch.tensor([41, 20], device=device)
    q = torch.randn(2, hq, dim, generator=g).to(device, dtype)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    meta = ref.AttentionMetadata(query_start_loc=torch.arange(3, device=device),
                                 positions=lens - 1, block_tables=tables, seq_lens=lens,
                                 seq_lens_list=[41, 20], num_decodes=2)
    wide = torch.cat([tables, tables.new_zeros(2, ONE_PASS_MAX_BLOCKS)], dim=1)
    for t in (tables, wide):  # the one-pass kernel, then the split one and the merge
        got = paged_decode(q, cache, t, lens, 0.125, None)
        want = ref.paged_attention(q, cache, meta, 0.125, None)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        got = paged_decode(q, cache, t, lens, 0.125, None, softcap=2.0)
        want = ref.paged_attention(q, cache, meta, 0.125, None, softcap=2.0)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    starts = torch.tensor([0, 2, 20], device=device)
    q = torch.randn(20, hq, dim, generator=g).to(device, dtype)
    got = paged_prefill(q, cache, tables, lens, starts, 18, 0.125, None)
    want = torch.cat([ref._prefill_one(q[s:e], cache, tables[b], int(lens[b]), 0.125, None)
                      for b, (s, e) in enumerate([(0, 2), (2, 20)])])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    got = paged_prefill(q, cache, tables, lens, starts, 18, 0.125, None, softcap=2.0)
    meta.query_start_loc, meta.num_decodes = starts, 0
    want = ref.paged_attention(q, cache, meta, 0.125, None, softcap=2.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _check_rotary_write(device: torch.device | str, dtype: torch.dtype, cache: torch.Tensor,
                        g: torch.Generator) -> None:
    """rotary_write_kv (partial rotary) against the reference's rotary and KV write."""
    from kvray.kernels import attention as ref
    from kvray.kernels.rotary import RotaryEmbedding

    hk, dim = cache.shape[1], cache.shape[-1]
    rotary = RotaryEmbedding(dim, 10000.0, None, 64, rot_dim=dim // 2)
    q = torch.randn(3, 2 * hk, dim, generator=g).to(device, dtype)
    k, v = (torch.randn(3, hk, dim, generator=g).to(device, dtype) for _ in range(2))
    positions = torch.tensor([2, 40, 7], device=device)
    slots = torch.tensor([5, 6, 33], device=device)
    want_q, want_k = rotary(positions, q.clone(), k)
    expect = cache.clone()
    ref.write_kv_cache(want_k, v, expect, slots)
    rotary_write_kv(q, k, v, positions, *rotary.tables(positions), cache, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(cache, expect, rtol=tol, atol=tol)


def _self_check_quantized(device: torch.device | str, dtype: torch.dtype,
                          kv_dtype: torch.dtype) -> None:
    """write_kv into a quantized cache (each row within half a code step of its value),
    then decode and prefill against the reference over the dequantized cache."""
    from kvray.kernels import attention as ref

    g = torch.Generator().manual_seed(1)
    hq, hk, dim, block_size, num_blocks = 4, 2, 64, 16, 4
    cache = torch.zeros(2, hk, num_blocks, block_size, dim + SCALE_BYTES, dtype=kv_dtype,
                        device=device)
    num_tokens = num_blocks * block_size
    k = torch.randn(num_tokens, hk, dim, generator=g).to(device, dtype)
    v = torch.randn(num_tokens, hk, dim, generator=g).to(device, dtype)
    write_kv(k, v, cache, torch.arange(num_tokens, device=device))
    dense = dequantize_cache(cache, dim)
    for i, x in enumerate((k, v)):
        want = x.float().transpose(0, 1).reshape(hk, num_blocks, block_size, dim)
        amax = want.abs().amax(-1, keepdim=True)
        rel = 0.5 / 127 if kv_dtype == torch.int8 else 2.0 ** -(3 if kv_dtype ==
                                                                torch.float8_e5m2 else 4)
        if ((dense[i] - want).abs() > amax * rel * 1.01 + 1e-6).any():
            raise RuntimeError(f"Triton write_kv into a {kv_dtype} cache: values off")
    tables = torch.tensor([[1, 2, 0], [3, 0, 0]], device=device)
    lens = torch.tensor([40, 9], device=device)
    q = torch.randn(2, hq, dim, generator=g).to(device, dtype)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    got = paged_decode(q, cache, tables, lens, 0.125, None)
    want = torch.cat([ref._decode(q[i:i + 1].float(), dense, tables[i:i + 1], lens[i:i + 1],
                                  int(lens[i]), 0.125, None) for i in range(2)])
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    starts = torch.tensor([0, 30, 39], device=device)
    q = torch.randn(39, hq, dim, generator=g).to(device, dtype)
    got = paged_prefill(q, cache, tables, lens, starts, 30, 0.125, None)
    want = torch.cat([ref._prefill_one(q[s:e].float(), dense, tables[b], int(lens[b]), 0.125,
                                       None) for b, (s, e) in enumerate([(0, 30), (30, 39)])])
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
