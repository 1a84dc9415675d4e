"""Linear layers over quantized weights on the GPU: :func:`linear_quant` computes
``y = x @ W^T (+ bias)`` for a :class:`~kvray.quant.tensor.QuantTensor` ``W`` without ever
materialising ``W`` in the activation dtype.

- ``U4`` / ``S8`` / ``F8`` segments run one Triton GEMM that loads tiles of codes and
  dequantizes them in registers (``scale * q (+ min)``, any group, fp16/fp32 scales). A U4
  byte holds code ``j`` and ``j + 16`` of its 32-code block, so a tile of bytes is two
  half-tiles of codes; each is multiplied with the matching (gathered) columns of ``x`` —
  no nibble shuffling. Other layouts (U5/U6 codes, code offsets, two-level scales) come
  here as :meth:`~kvray.quant.tensor.QuantTensor.basic` converts them, exactly. F8 codes
  are decoded with integer ops (an e4m3 byte shifted into an fp16 is that value times
  2^-8), which every GPU and the interpreter run alike.
- Fixed tile configs (no autotuning, so a CUDA graph capture never benchmarks): for
  ``M <= 16`` (decode) narrow N tiles and split-K over enough programs to fill the device;
  for larger M a GEMM tile.
- Per-channel F8 on a device with FP8 tensor cores (compute capability >= 8.9) goes to
  ``torch._scaled_mm`` with dynamic per-token e4m3 activation scales (vLLM's fp8 path).

A tile whose K range lies inside one quantization group (``group % BLOCK_K == 0``) multiplies
the exact codes and applies the scale (and ``min * sum(x)``) to the tile's fp32 product;
smaller groups dequantize element by element. The tests compare every path with
``QuantTensor.dequantize()`` on CPU under Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvray.quant.fp8 import Fp8Rows
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor, gather_input


@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the quantized GEMM."""

    block_m: int
    block_n: int
    block_k: int  # a multiple of 32 (U4 splits it into two halves >= 16 for tl.dot)
    num_warps: int
    num_stages: int


GEMV_CONFIG = TileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)
GEMM_CONFIG = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
TARGET_PROGRAMS = 264  # about two per SM of an H100/H200 (132 SMs)


def tile_config(m: int) -> TileConfig:
    """The GEMV-like tile for decode-sized batches, the GEMM tile above 16 rows."""
    return GEMV_CONFIG if m <= 16 else GEMM_CONFIG


def num_k_splits(m: int, n: int, k_padded: int, cfg: TileConfig) -> int:
    """Split-K factor for small M: enough programs to fill the device, at most one split
    per K tile (a power of two)."""
    if m > 16:
        return 1
    n_tiles, k_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(k_padded, cfg.block_k)
    split = 1
    while split * 2 <= k_tiles and n_tiles * split < TARGET_PROGRAMS:
        split *= 2
    return split


@triton.jit
def _decode_codes(raw, KIND: tl.constexpr):
    """Codes (as loaded: uint8 nibbles already masked, int8, or e4m3 bytes) -> fp32."""
    if KIND == 3:  # e4m3fn: bits << 7 into an fp16 is the value * 2^-8 (subnormals too)
        b = raw.to(tl.int32)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return raw.to(tl.float32)


@triton.jit
def _tile_product(x, q, s_ptrs, m_ptrs, kg, k_ok, g0, n_mask, acc, DTYPE: tl.constexpr,
                  HAS_MIN: tl.constexpr, BROADCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x [BM, BK] @ dequant(q [BK, BN]); ``kg`` [BK] is each code row's group (read
    where ``k_ok``), ``g0`` the tile's group where one group covers the tile (``BROADCAST``)."""
    if BROADCAST:  # scale the exact codes' product
        s = tl.load(s_ptrs + g0, mask=n_mask, other=0.0).to(tl.float32)
        part = tl.dot(x, q.to(DTYPE), input_precision=PRECISION)
        acc += part * s[None, :]
        if HAS_MIN:
            mn = tl.load(m_ptrs + g0, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * mn[None, :]
    else:
        mask = k_ok[:, None] & n_mask[None, :]  # past K: no scale (nor garbage) to read
        s = tl.load(s_ptrs[None, :] + kg[:, None], mask=mask, other=0.0).to(tl.float32)
        w = q * s
        if HAS_MIN:
            w += tl.load(m_ptrs[None, :] + kg[:, None], mask=mask, other=0.0).to(tl.float32)
        acc += tl.dot(x, w.to(DTYPE), input_precision=PRECISION)
    return acc


@triton.jit
def _quant_gemm_kernel(x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, y_ptr,
                       M, N, K, stride_xm, stride_c, stride_s, stride_ym, stride_ysplit,
                       k_tiles, k_tiles_per_split,
                       KIND: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       DOT_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    # The interpreter's tl.dot mishandles bf16: on CPU the tiles are multiplied in fp32.
    dtype = tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    c_rows = codes_ptr + offs_n.to(tl.int64) * stride_c
    s_rows = scales_ptr + offs_n.to(tl.int64) * stride_s
    m_rows = mins_ptr + offs_n.to(tl.int64) * stride_s
    broadcast: tl.constexpr = GROUP % BLOCK_K == 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    t0 = split * k_tiles_per_split
    for t in range(t0, tl.minimum(t0 + k_tiles_per_split, k_tiles)):
        k0 = t * BLOCK_K
        if KIND == 1:  # U4: byte j of a 32-code block = code j (low) | code j + 16 (high)
            j = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (j // 16) * 32 + j % 16
            k_hi = k_lo + 16
            lo_ok = k_lo < K
            hi_ok = k_hi < K
            raw = tl.load(c_rows[None, :] + (k0 // 2 + j)[:, None],
                          mask=lo_ok[:, None] & n_mask[None, :], other=0).to(tl.int32)
            x_lo = tl.load(x_rows + k_lo[None, :], mask=m_mask[:, None] & lo_ok[None, :],
                           other=0.0).to(dtype)
            x_hi = tl.load(x_rows + k_hi[None, :], mask=m_mask[:, None] & hi_ok[None, :],
                           other=0.0).to(dtype)
            g0 = k0 // GROUP
            acc = _tile_product(x_lo, (raw & 0xF).to(tl.float32), s_rows, m_rows, k_lo // GROUP,
                                lo_ok, g0, n_mask, acc, dtype, HAS_MIN, broadcast, PRECISION)
            acc = _tile_product(x_hi, (raw >> 4).to(tl.float32), s_rows, m_rows, k_hi // GROUP,
                                hi_ok, g0, n_mask, acc, dtype, HAS_MIN, broadcast, PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            raw = tl.load(c_rows[None, :] + offs_k[:, None],
                          mask=k_ok[:, None] & n_mask[None, :], other=0)
            xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_ok[None, :],
                         other=0.0).to(dtype)
            acc = _tile_product(xt, _decode_codes(raw, KIND), s_rows, m_rows, offs_k // GROUP,
                                k_ok, k0 // GROUP, n_mask, acc, dtype, HAS_MIN, broadcast,
                                PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = (y_ptr + split * stride_ysplit + offs_m[:, None].to(tl.int64) * stride_ym
              + offs_n[None, :])
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _segment_gemm(x: torch.Tensor, seg: QuantSegment, bias: torch.Tensor | None,
                  y: torch.Tensor) -> None:
    """y [M, seg.rows] (a column range of the output) = x @ seg^T (+ bias)."""
    m, k = x.shape
    n = seg.rows
    cfg = tile_config(m)
    split = num_k_splits(m, n, seg.k_padded, cfg)
    k_tiles = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_tiles, split)
    codes = _row_contiguous(seg.codes.view(torch.uint8) if seg.kind != QuantKind.S8
                            else seg.codes.view(torch.int8))
    scales = _row_contiguous(seg.scales)
    mins = _row_contiguous(seg.mins) if seg.mins is not None else scales
    if mins.stride() != scales.stride():  # the kernel steps both by one row stride
        scales, mins = scales.contiguous(), mins.contiguous()
    # Split-K writes fp32 partial sums, reduced below; one split writes y directly.
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    use_bias = bias is not None and split == 1
    _quant_gemm_kernel[grid](
        x, codes, scales, mins, bias if use_bias else scales, out,
        m, n, k, x.stride(0), codes.stride(0), scales.stride(0),
        out.stride(-2), out.stride(0) if split > 1 else 0, k_tiles, per_split,
        KIND=int(seg.kind), GROUP=seg.group, HAS_MIN=seg.mins is not None,
        HAS_BIAS=use_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_FP32=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        total = out.sum(0)
        if bias is not None:
            total += bias.float()
        y.copy_(total)


def scaled_mm_supported(seg: QuantSegment, x: torch.Tensor) -> bool:
    """Whether an F8 segment times ``x`` can go to ``torch._scaled_mm``: 16-bit activations
    on a GPU with FP8 tensor cores (capability >= 8.9), one scale per output channel, and
    rows a multiple of 16 (cuBLASLt's rule)."""
    return scaled_mm_possible(seg, x.device, x.dtype)


def scaled_mm_possible(seg: QuantSegment, device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`scaled_mm_supported` for activations of ``dtype`` on ``device``."""
    if seg.kind != QuantKind.F8 or device.type != "cuda" or seg.group != seg.k_padded:
        return False
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if seg.rows % 16 or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def takes_fp8_rows(qt: QuantTensor, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`linear_quant` can take ``qt``'s input as :class:`Fp8Rows` (activations
    of ``dtype`` quantized before the call, by a fused norm): every segment goes to
    ``torch._scaled_mm`` and no input permutation reorders the columns."""
    return qt.input_perm is None and all(scaled_mm_possible(seg.basic(), device, dtype)
                                         for seg in qt.segments)


def _scaled_mm(rows: Fp8Rows, seg: QuantSegment, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 x FP8 on tensor cores: per-token e4m3 activations, per-channel weight scales ->
    bf16 (a bf16 bias added in the GEMM's epilogue)."""
    w = seg.codes.view(torch.float8_e4m3fn)
    if w.stride(-1) != 1:
        w = w.contiguous()
    w_scales = seg.scales.to(torch.float32).reshape(1, -1)
    in_epilogue = bias is None or bias.dtype == torch.bfloat16
    out = torch._scaled_mm(rows.codes, w.t(), scale_a=rows.scales, scale_b=w_scales,
                           bias=bias if in_epilogue else None, out_dtype=torch.bfloat16)
    return out if in_epilogue else out + bias


def _fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """x's rows quantized per token in one launch (``quantize_fp8_activations``'s codes)."""
    from kvray.kernels.triton_ops import quantize_fp8_rows

    return quantize_fp8_rows(x)


def linear_quant(x: torch.Tensor | Fp8Rows, qt: QuantTensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``x [M, K] @ qt^T (+ bias)`` -> [M, N] in x's dtype (fp16, bf16 or fp32), with ``qt``'s
    segments (and ``bias``) on x's device. Each segment writes its own rows of the output.
    ``x`` may come quantized already (:class:`Fp8Rows`, where :func:`takes_fp8_rows`)."""
    width = x.width if isinstance(x, Fp8Rows) else x.shape[-1]
    if width != qt.shape[1] or (not isinstance(x, Fp8Rows) and x.dim() != 2):
        raise ValueError(f"activations of width {width} for a {qt.shape} weight")
    rows = x if isinstance(x, Fp8Rows) else None
    if rows is None:
        if qt.input_perm is not None:  # act-order: the codes' columns are stored permuted
            x = gather_input(x, qt.input_perm.to(x.device))
        x = _row_contiguous(x)
    like = rows.codes if rows is not None else x
    m, n = like.shape[0], qt.shape[0]
    out_dtype = rows.dtype if rows is not None else x.dtype
    single = qt.segments[0].basic() if len(qt.segments) == 1 else None
    if m and out_dtype == torch.bfloat16 and single is not None \
            and (rows is not None or scaled_mm_supported(single, x)):
        return _scaled_mm(rows or _fp8_rows(x), single, bias)  # no copy into y
    y = torch.empty(m, n, dtype=out_dtype, device=like.device)
    if m == 0:
        return y
    row0 = 0
    quantized = rows  # x's FP8 rows, made once where a segment takes them
    for seg in qt.segments:
        seg = seg.basic()  # a no-op for what install_quantized prepared
        y_seg = y.narrow(1, row0, seg.rows)
        b_seg = None if bias is None else bias.narrow(0, row0, seg.rows)
        if rows is not None or scaled_mm_supported(seg, x):
            quantized = quantized or _fp8_rows(x)
            y_seg.copy_(_scaled_mm(quantized, seg, b_seg))
        else:
            _segment_gemm(x, seg, b_seg, y_seg)
        row0 += seg.rows
    return y


def self_check(device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """Run every kind once (decode- and prefill-sized batches) against the dequantized
    reference; raise if one fails or differs (what the engine runs before trusting it)."""
    from kvray.quant.fp8 import quantize_fp8
    from kvray.quant.tensor import pack_u4

    g = torch.Generator().manual_seed(0)
    n, k = 48, 96
    u4 = torch.randint(0, 16, (n, k), generator=g)
    segs = (QuantSegment(QuantKind.U4, 32, pack_u4(u4), torch.rand(n, 3, generator=g) / 8,
                         -torch.rand(n, 3, generator=g)),
            QuantSegment(QuantKind.S8, 96, torch.randint(-127, 128, (n, k), generator=g)
                         .to(torch.int8), torch.rand(n, 1, generator=g).half() / 64))
    fp8 = quantize_fp8(torch.randn(n, k, generator=g))
    qt = QuantTensor((3 * n, k), (*segs, *fp8.segments))
    bias = torch.randn(3 * n, generator=g)
    dense = qt.dequantize()
    qt_dev = qt.to(device)
    for m in (1, 20):
        x = torch.randn(m, k, generator=g)
        want = x.double() @ dense.double().T + bias.double()
        got = linear_quant(x.to(device, dtype), qt_dev, bias.to(device, dtype))
        tol = 1e-3 if dtype == torch.float32 else 6e-2
        scale = want.abs().max().item()
        err = (got.double().cpu() - want).abs().max().item()
        if err > tol * max(scale, 1.0):
            raise RuntimeError(f"Triton linear_quant differs from the reference by {err} "
                               f"(M = {m}, {dtype})")

