"""What goes into the paged KV cache, in Triton: the quantized row format the attention
kernels (:mod:`kvray.kernels.triton_attention`) read, :func:`write_kv`, and
:func:`rotary_write_kv`, which rotates q and k and writes k and v in one launch (a decode
step's rotary and KV write, which would otherwise be two launches per layer).

Quantized caches (``kv_cache_dtype`` int8 / fp8 e4m3 / fp8 e5m2) have rows of ``D + 4``
elements: D codes, then the 4 little-endian bytes of the row's fp32 scale (``value = code *
scale``, ``scale = amax / QMAX``). The kernels read them through an int8 view and decode with
integer ops (an fp8 byte shifted into an fp16's bits), and the writes round to nearest even
exactly as torch's casts do, so every GPU (and Triton's interpreter) agrees bit for bit with
the PyTorch reference (:mod:`kvray.kernels.kv_quant`).
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


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels index: a quantized cache as raw int8 bytes (codes and scales)."""
    return kv_cache.view(torch.int8) if kv_cache.dtype in KV_KINDS else kv_cache


@triton.jit
def rne(v):
    """Round fp32 to the nearest integer, ties to even (|v| < 2^22), like torch.round."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def encode_fp8(v, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """fp32 -> fp8 bits (int32 0..255) rounded to nearest even, saturating at MAX_CODE."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    lsb = (mag >> (23 - MANT)) & 1
    normal = ((mag + ((1 << (22 - MANT)) - 1) + lsb) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # below the least normal: multiples of the least subnormal step (clamped: no overflow)
    a = tl.minimum(tl.abs(v), 2.0 ** (1 - BIAS))
    sub = rne(a * (2.0 ** (BIAS - 1 + MANT))).to(tl.int32)
    code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    return tl.minimum(code, MAX_CODE) | sign


@triton.jit
def quantize_row(x, QMAX: tl.constexpr, KV_KIND: tl.constexpr):
    """(codes as int8, fp32 scale) of one row: scale = amax / QMAX (1 for a zero row)."""
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)
    v = tl.div_rn(x, scale)
    if KV_KIND == 1:
        code = tl.minimum(tl.maximum(rne(v), -127.0), 127.0).to(tl.int32)
    elif KV_KIND == 2:
        code = encode_fp8(v, 3, 7, 0x7E)
    else:
        code = encode_fp8(v, 2, 15, 0x7B)
    return code.to(tl.int8), scale


@triton.jit
def decode_codes(raw, KV_KIND: tl.constexpr):
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
def row_scales(row_ptrs, mask, HEAD_DIM: tl.constexpr):
    """The fp32 scales stored after the codes of the rows starting at ``row_ptrs``."""
    b0 = tl.load(row_ptrs + HEAD_DIM, mask=mask, other=0).to(tl.int32) & 0xFF
    b1 = tl.load(row_ptrs + HEAD_DIM + 1, mask=mask, other=0).to(tl.int32) & 0xFF
    b2 = tl.load(row_ptrs + HEAD_DIM + 2, mask=mask, other=0).to(tl.int32) & 0xFF
    b3 = tl.load(row_ptrs + HEAD_DIM + 3, mask=mask, other=0).to(tl.int32) & 0xFF
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def load_kv(row_ptrs, offs_d, rmask, dmask, KV_KIND: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 [rows, BLOCK_D] of the K or V rows starting at ``row_ptrs``."""
    ptrs = row_ptrs[:, None] + offs_d[None, :]
    mask = rmask[:, None] & dmask[None, :]
    if KV_KIND == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        codes = decode_codes(tl.load(ptrs, mask=mask, other=0), KV_KIND)
        return codes * row_scales(row_ptrs, rmask, HEAD_DIM)[:, None]


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
    head_cache = cache_ptr + h.to(tl.int64) * stride_ch  # past 2^31 bytes: int64
    _store_kv_row(head_cache + slot * stride_cslot, stride_c0, k, v, offs_d, dmask, HEAD_DIM,
                  KV_KIND, QMAX)


@triton.jit
def _store_kv_row(row, stride_c0, k, v, offs_d, dmask, HEAD_DIM: tl.constexpr,
                  KV_KIND: tl.constexpr, QMAX: tl.constexpr):
    """One token's K and V rows of one head into the slot starting at ``row``."""
    if KV_KIND == 0:
        tl.store(row + offs_d, k, mask=dmask)
        tl.store(row + stride_c0 + offs_d, v, mask=dmask)
    else:
        store_quantized(row, k.to(tl.float32), offs_d, dmask, QMAX, KV_KIND, HEAD_DIM)
        store_quantized(row + stride_c0, v.to(tl.float32), offs_d, dmask, QMAX, KV_KIND,
                        HEAD_DIM)


@triton.jit
def store_quantized(row, x, offs_d, dmask, QMAX: tl.constexpr, KV_KIND: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
    """One row's codes, then its scale's 4 bytes (little-endian)."""
    codes, scale = quantize_row(tl.where(dmask, x, 0.0), QMAX, KV_KIND)
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
    flat = kernel_view(kv_cache).view(2, heads, num_blocks * block_size, row)
    _write_kv_kernel[(num_tokens, heads)](
        k, v, flat, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat.stride(0), flat.stride(1), flat.stride(2),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), KV_KIND=kind, QMAX=qmax)


def dequantize_cache(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A quantized cache as fp32 values [2, Hk, blocks, block_size, D] (codes * scales)."""
    raw = kv_cache.view(torch.int8)
    codes = raw[..., :head_dim].contiguous().view(kv_cache.dtype).to(torch.float32)
    return codes * raw[..., head_dim:].contiguous().view(torch.float32)


@triton.jit
def rotated_head(base, pos, cos_ptr, sin_ptr, stride_cos, offs_d, dmask,
                  HALF: tl.constexpr):
    """One head's row [BLOCK_D] in its dtype with its first ``2 * HALF`` dims turned by
    ``pos`` ("rotate half"; the rest pass through), rounded as ``rotary._rotate`` rounds."""
    x = tl.load(base + offs_d, mask=dmask, other=0.0)
    dtype = x.dtype
    low = offs_d < HALF
    turned = offs_d < 2 * HALF
    partner = tl.load(base + tl.where(low, offs_d + HALF, offs_d - HALF), mask=turned,
                      other=0.0).to(tl.float32)
    i = tl.where(low, offs_d, offs_d - HALF)
    # cos/sin rounded to x's dtype first, as the reference does
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=turned, other=1.0).to(dtype)
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=turned, other=0.0).to(dtype)
    xf, cf, sf = x.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
    out = tl.where(low, xf * cf - partner * sf, xf * cf + partner * sf)
    return tl.where(turned, out, xf).to(dtype)


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr,
                            slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                            stride_vh, stride_cos, stride_c0, stride_ch, stride_cslot,
                            NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            KV_KIND: tl.constexpr, QMAX: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    pos = tl.load(pos_ptr + t)
    if h < NUM_Q_HEADS:  # a query head: turned in place
        base = q_ptr + t * stride_qt + h * stride_qh
        q = rotated_head(base, pos, cos_ptr, sin_ptr, stride_cos, offs_d, dmask, HALF)
        tl.store(base + offs_d, q, mask=offs_d < 2 * HALF)
    else:  # a KV head: k turned, then k and v into the slot
        kvh = h - NUM_Q_HEADS
        k = rotated_head(k_ptr + t * stride_kt + kvh * stride_kh, pos, cos_ptr, sin_ptr,
                          stride_cos, offs_d, dmask, HALF)
        v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + offs_d, mask=dmask)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        head_cache = cache_ptr + kvh.to(tl.int64) * stride_ch  # past 2^31 bytes: int64
        _store_kv_row(head_cache + slot * stride_cslot, stride_c0, k, v, offs_d, dmask,
                      HEAD_DIM, KV_KIND, QMAX)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Turn q [T, Hq, D] in place and k [T, Hk, D] by ``positions`` with the fp32 tables
    [max_pos, R/2] (each head's first R dims turn: R < D is partial rotary), and write the
    turned k and v [T, Hk, D] into their slots of ``kv_cache`` (a quantized cache's rows
    quantized): ``triton_ops.rotary_inplace`` and :func:`write_kv` in one launch. k itself
    is left as it was. Each head's D elements must be contiguous; positions must lie
    inside the tables."""
    num_tokens, hq, dim = q.shape
    hk = k.shape[1]
    kind, qmax = kv_kind(kv_cache, dim)
    half = cos.shape[-1]
    assert 2 * half <= dim and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride()
    if num_tokens == 0:
        return
    _, _, num_blocks, block_size, row = kv_cache.shape
    flat = kernel_view(kv_cache).view(2, hk, num_blocks * block_size, row)
    _rotary_write_kv_kernel[(num_tokens, hq + hk)](
        q, k, v, positions, cos, sin, flat, slot_mapping, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        flat.stride(0), flat.stride(1), flat.stride(2), NUM_Q_HEADS=hq, HALF=half,
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), KV_KIND=kind, QMAX=qmax)
