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

Quantized caches (``kv_cache_dtype`` int8 / fp8 e4m3 / fp8 e5m2) have rows of ``D + 4``
elements: D codes, then the 4 little-endian bytes of the row's fp32 scale (``value = code *
scale``, ``scale = amax / QMAX``). The kernels read them through an int8 view and decode with
integer ops (an fp8 byte shifted into an fp16's bits), and :func:`write_kv` rounds to nearest
even exactly as torch's casts do, so every GPU (and Triton's interpreter) agrees bit for bit
with the PyTorch reference; attention accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# kv_cache dtype -> (KV_KIND, QMAX): 0 = plain values, 1 = int8, 2 = fp8 e4m3, 3 = fp8 e5m2.
KV_KINDS = {torch.int8: (1, 127.0), torch.float8_e4m3fn: (2, 448.0),
            torch.float8_e5m2: (3, 57344.0)}
SCALE_BYTES = 4  # one fp32 scale after each quantized row's codes


def kv_kind(kv_cache: torch.Tensor, head_dim: int) -> tuple[int, float]:
    """(KV_KIND, QMAX) of a cache, after checking its rows fit ``head_dim``."""
    kind, qmax = KV_KINDS.get(kv_cache.dtype, (0, 0.0))
    want = head_dim + SCALE_BYTES if kind else head_dim
    if kv_cache.shape[-1] != want:
        raise ValueError(f"a {kv_cache.dtype} KV cache with rows of {kv_cache.shape[-1]} for "
                         f"head_dim {head_dim}: expected {want}")
    return kind, qmax


def _kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels index: a quantized cache as raw int8 bytes (codes and scales)."""
    return kv_cache.view(torch.int8) if kv_cache.dtype in KV_KINDS else kv_cache


@triton.jit
def _rne(v):
    """Round fp32 to the nearest integer, ties to even (|v| < 2^22), like torch.round."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _encode_fp8(v, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """fp32 -> fp8 bits (int32 0..255) rounded to nearest even, saturating at MAX_CODE."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    lsb = (mag >> (23 - MANT)) & 1
    normal = ((mag + ((1 << (22 - MANT)) - 1) + lsb) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # below the least normal: multiples of the least subnormal step (clamped: no overflow)
    a = tl.minimum(tl.abs(v), 2.0 ** (1 - BIAS))
    sub = _rne(a * (2.0 ** (BIAS - 1 + MANT))).to(tl.int32)
    code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    return tl.minimum(code, MAX_CODE) | sign


@triton.jit
def _quantize_row(x, QMAX: tl.constexpr, KV_KIND: tl.constexpr):
    """(codes as int8, fp32 scale) of one row: scale = amax / QMAX (1 for a zero row)."""
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)
    v = tl.div_rn(x, scale)
    if KV_KIND == 1:
        code = tl.minimum(tl.maximum(_rne(v), -127.0), 127.0).to(tl.int32)
    elif KV_KIND == 2:
        code = _encode_fp8(v, 3, 7, 0x7E)
    else:
        code = _encode_fp8(v, 2, 15, 0x7B)
    return code.to(tl.int8), scale


@triton.jit
def _decode_codes(raw, KV_KIND: tl.constexpr):
    """Codes loaded as int8 -> fp32 values before the row scale."""
    if KV_KIND == 1:
        return raw.to(tl.float32)
    else:
        b = raw.to(tl.int32) & 0xFF
        if KV_KIND == 2:  # e4m3fn bits << 7 as an fp16 = the value * 2^-8
            h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
            scale_back = 256.0
        else:  # e5m2 is the top byte of an fp16
            h = b << 8
            scale_back = 1.0
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale_back


@triton.jit
def _row_scales(row_ptrs, mask, HEAD_DIM: tl.constexpr):
    """The fp32 scales stored after the codes of the rows starting at ``row_ptrs``."""
    b0 = tl.load(row_ptrs + HEAD_DIM, mask=mask, other=0).to(tl.int32) & 0xFF
    b1 = tl.load(row_ptrs + HEAD_DIM + 1, mask=mask, other=0).to(tl.int32) & 0xFF
    b2 = tl.load(row_ptrs + HEAD_DIM + 2, mask=mask, other=0).to(tl.int32) & 0xFF
    b3 = tl.load(row_ptrs + HEAD_DIM + 3, mask=mask, other=0).to(tl.int32) & 0xFF
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _load_kv(row_ptrs, offs_d, rmask, dmask, KV_KIND: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 [rows, BLOCK_D] of the K or V rows starting at ``row_ptrs``."""
    ptrs = row_ptrs[:, None] + offs_d[None, :]
    mask = rmask[:, None] & dmask[None, :]
    if KV_KIND == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        codes = _decode_codes(tl.load(ptrs, mask=mask, other=0), KV_KIND)
        return codes * _row_scales(row_ptrs, rmask, HEAD_DIM)[:, None]


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_c0, stride_ch, stride_cslot,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_KIND: tl.constexpr,
                     QMAX: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=dmask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=dmask)
    row = cache_ptr + h * stride_ch + slot * stride_cslot
    if KV_KIND == 0:
        tl.store(row + offs_d, k, mask=dmask)
        tl.store(row + stride_c0 + offs_d, v, mask=dmask)
    else:
        _store_quantized(row, k.to(tl.float32), offs_d, dmask, QMAX, KV_KIND, HEAD_DIM)
        _store_quantized(row + stride_c0, v.to(tl.float32), offs_d, dmask, QMAX, KV_KIND,
                         HEAD_DIM)


@triton.jit
def _store_quantized(row, x, offs_d, dmask, QMAX: tl.constexpr, KV_KIND: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
    """One row's codes, then its scale's 4 bytes (little-endian)."""
    codes, scale = _quantize_row(tl.where(dmask, x, 0.0), QMAX, KV_KIND)
    tl.store(row + offs_d, codes, mask=dmask)
    offs_b = tl.arange(0, 4)
    bits = scale.to(tl.int32, bitcast=True)
    tl.store(row + HEAD_DIM + offs_b, ((bits >> (offs_b * 8)) & 0xFF).to(tl.int8))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, Hk, D]) into their slots of ``kv_cache`` (quantizing
    each (token, head) row of a quantized cache)."""
    num_tokens, heads, dim = k.shape
    kind, qmax = kv_kind(kv_cache, dim)
    if num_tokens == 0:
        return
    _, _, num_blocks, block_size, row = kv_cache.shape
    flat = _kernel_view(kv_cache).view(2, heads, num_blocks * block_size, row)
    _write_kv_kernel[(num_tokens, heads)](
        k, v, flat, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat.stride(0), flat.stride(1), flat.stride(2),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), KV_KIND=kind, QMAX=qmax)


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, part_acc_ptr,
                         part_ml_ptr, scale, window, stride_qb, stride_qh, stride_c0,
                         stride_ch, stride_cblk, stride_cslot, stride_tb,
                         NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, KV_KIND: tl.constexpr):
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
        rows = cache_ptr + kvh * stride_ch + phys * stride_cblk + offs_s * stride_cslot
        k = _load_kv(rows, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = _load_kv(rows + stride_c0, offs_d, valid, dmask, KV_KIND, HEAD_DIM)
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
    """q: [B, Hq, D]; kv_cache: [2, Hk, num_blocks, block_size, D (+ 4 quantized)] ->
    [B, Hq, D] (the signature of the engine's other decode kernels)."""
    batch, hq, dim = q.shape
    _, hk, _, block_size, _ = kv_cache.shape
    kind, _ = kv_kind(kv_cache, dim)
    cache = _kernel_view(kv_cache)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    splits = num_decode_splits(block_tables.shape[1], batch * hq)
    part_acc = torch.empty(batch * hq * splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * hq * splits, 2, dtype=torch.float32, device=q.device)
    grid = (batch, hq, splits)
    _decode_split_kernel[grid](
        q, cache, block_tables, seq_lens, part_acc, part_ml, scale, sliding_window or 0,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        cache.stride(2), cache.stride(3), block_tables.stride(0),
        NUM_SPLITS=splits, GROUP=hq // hk, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        BLOCK_D=block_d, KV_KIND=kind)
    _decode_merge_kernel[(batch, hq)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                      NUM_SPLITS=splits, HEAD_DIM=dim, BLOCK_D=block_d)
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qstart_ptr, out_ptr, scale,
                    window, stride_qt, stride_qh, stride_c0, stride_ch, stride_cblk,
                    stride_cslot, stride_tb, stride_ot, stride_oh, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, KV_KIND: tl.constexpr):
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
        rows = cache_ptr + kvh * stride_ch + phys * stride_cblk + offs_s * stride_cslot
        in_seq = k_pos < seq_len
        k = _load_kv(rows, offs_d, in_seq, dmask, KV_KIND, HEAD_DIM)
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
        v = _load_kv(rows + stride_c0, offs_d, in_seq, dmask, KV_KIND, HEAD_DIM)
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
    kind, _ = kv_kind(kv_cache, dim)
    cache = _kernel_view(kv_cache)
    block_d = triton.next_power_of_2(dim)
    grid = (batch, hq, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, cache, block_tables, seq_lens, query_start_loc, out, scale, sliding_window or 0,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hk, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        BLOCK_D=block_d, USE_DOT=min(block_m, block_size, block_d) >= 16, KV_KIND=kind)
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


def dequantize_cache(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A quantized cache as fp32 values [2, Hk, blocks, block_size, D] (codes * scales)."""
    raw = kv_cache.view(torch.int8)
    codes = raw[..., :head_dim].contiguous().view(kv_cache.dtype).to(torch.float32)
    return codes * raw[..., head_dim:].contiguous().view(torch.float32)


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
