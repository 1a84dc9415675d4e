"""The decoder's small fused ops in Triton: residual-add + RMSNorm, rotary embedding in
place, SiLU-and-mul, and a MoE layer's experts as two grouped GEMMs
(:mod:`kvray.kernels.triton_moe`). The GPU twins of :mod:`kvray.kernels.cpu_ops` (same names and
signatures, so :func:`kvray.models.llama.use_fused_ops` installs either), each one kernel
launch where the PyTorch reference takes three to six; at decode sizes the launches, not
the bytes, are the cost. Two more have no CPU twin: :func:`rms_norm_fp8` (the norm's output
quantized per token for an FP8 GEMM in the same launch) and :func:`rotary_write_kv` (rotary
and the paged KV-cache write in one launch, :mod:`kvray.kernels.triton_kv`).

Rounding follows the PyTorch references (:mod:`kvray.kernels.norm`, ``rotary._rotate``,
``F.silu(gate) * up``): fp32 inside, cast to the activation dtype where they cast. The tests
compare them on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.kernels.triton_kv import encode_fp8, rotary_write_kv, rotated_head
from kvray.quant.fp8 import FP8_E4M3_MAX, MIN_ACTIVATION_SCALE, Fp8Rows
from kvray.quant.tensor import BLOCK, round_up

__all__ = ["fused_moe", "quantize_fp8_rows", "rms_norm", "rms_norm_fp8", "rotary_inplace",
           "rotary_write_kv", "self_check", "silu_and_mul"]

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scales_ptr, stride_x, stride_r,
                     stride_o, eps, min_scale, N: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
                     N_PADDED: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(dtype)
    if FP8_OUT:
        _store_fp8_row(y, mask, offs, out_ptr + row * stride_o, scales_ptr + row, min_scale,
                       N_PADDED)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _store_fp8_row(y, mask, offs, codes_row, scale_ptr, min_scale, N_PADDED: tl.constexpr):
    """quantize_fp8_activations of one row: its e4m3 codes (zero-padded to N_PADDED) and
    fp32 scale, rounded as torch rounds."""
    yf = tl.where(mask, y.to(tl.float32), 0.0)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(yf), 0), _FP8_MAX), min_scale)
    v = tl.minimum(tl.maximum(tl.div_rn(yf, scale), -_FP8_MAX), _FP8_MAX)
    tl.store(codes_row + offs, encode_fp8(v, 3, 7, 0x7E).to(tl.int8), mask=offs < N_PADDED)
    tl.store(scale_ptr, scale)


@triton.jit
def _fp8_rows_kernel(x_ptr, codes_ptr, scales_ptr, stride_x, stride_c, min_scale,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, N_PADDED: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    _store_fp8_row(x, mask, offs, codes_ptr + row * stride_c, scales_ptr + row, min_scale,
                   N_PADDED)


def quantize_fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """``quantize_fp8_activations(x)`` of the rows of ``x`` [M, K] in one launch, bit for
    bit (the activations of an FP8 linear that no norm quantized: o_proj, down_proj)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    n_out = round_up(n, BLOCK)
    codes = torch.empty((rows, n_out), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n_out)
        _fp8_rows_kernel[(rows,)](x, codes.view(torch.int8), scales, x.stride(0),
                                  codes.stride(0), MIN_ACTIVATION_SCALE, N=n, BLOCK_N=block,
                                  N_PADDED=n_out, num_warps=min(16, max(4, block // 1024)))
    return Fp8Rows(codes, scales, x.dtype, n)


def _norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None, fp8_out: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output rows [R, N] in x's dtype, or e4m3 codes [R, N padded] and scales [R, 1]) of
    the rows of ``x`` (residual added in place first)."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    res = None
    if residual is not None:
        res = residual.view(-1, n)
        assert res.stride(-1) == 1, "residual must have a contiguous last dimension"
    rows = flat.shape[0]
    n_out = round_up(n, BLOCK) if fp8_out else n
    out = torch.empty((rows, n_out), dtype=torch.float8_e4m3fn if fp8_out else x.dtype,
                      device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8_out else None
    if rows:
        _rms_norm_kernel[(rows,)](
            flat, res if res is not None else flat, weight,
            out.view(torch.int8) if fp8_out else out, scales if fp8_out else out,
            flat.stride(0), res.stride(0) if res is not None else 0, out.stride(0), float(eps),
            MIN_ACTIVATION_SCALE, N=n, BLOCK_N=triton.next_power_of_2(n_out),
            HAS_RESIDUAL=res is not None, FP8_OUT=fp8_out, N_PADDED=n_out)
    return out, scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension; with ``residual``, ``residual += x`` in place first
    and the sum is normalised (:func:`kvray.kernels.cpu_ops.rms_norm`'s contract)."""
    return _norm_launch(x, weight, eps, residual, fp8_out=False)[0].view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> Fp8Rows:
    """:func:`rms_norm` of the rows of ``x`` [R, N] handed over quantized for an FP8 GEMM,
    in the same launch: exactly ``quantize_fp8_activations(rms_norm(...))`` (per-row e4m3
    codes zero-padded to a multiple of 32 columns, fp32 scales), without the norm's output
    ever written. ``residual += x`` in place first, as :func:`rms_norm` does."""
    codes, scales = _norm_launch(x, weight, eps, residual, fp8_out=True)
    return Fp8Rows(codes, scales, x.dtype, x.shape[-1])


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    base = x_ptr + tl.program_id(0) * stride_t + tl.program_id(1) * stride_h
    offs_d = tl.arange(0, BLOCK_D)
    x = rotated_head(base, tl.load(pos_ptr + tl.program_id(0)), cos_ptr, sin_ptr, stride_cos,
                     offs_d, offs_d < HEAD_DIM, HALF)
    tl.store(base + offs_d, x, mask=offs_d < 2 * HALF)


def rotary_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (each head's D contiguous) in place by ``positions`` with the fp32
    ``cos``/``sin`` tables [max_pos, D/2]; returns x. Positions must lie inside the tables
    (the caller grows them)."""
    num_tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    if num_tokens and heads:
        _rotary_kernel[(num_tokens, heads)](
            x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
            HALF=dim // 2, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim))
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ([T, 2I] -> [T, I])."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
    """A MoE layer's experts on this rank (:func:`kvray.kernels.triton_moe.fused_moe`)."""
    from kvray.kernels import triton_moe

    return triton_moe.fused_moe(x, w13, w2, weights, experts, local_index)


def self_check(device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """Run each op once on tiny inputs against its PyTorch reference; raise if one fails or
    differs (what the engine runs before trusting them by default on CUDA)."""
    import torch.nn.functional as F

    from kvray.kernels.norm import rms_norm as ref_rms_norm
    from kvray.kernels.rotary import _rotate
    from kvray.quant.fp8 import quantize_fp8_activations

    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x = torch.randn(3, 40, generator=g).to(device, dtype)
    res = torch.randn(3, 40, generator=g).to(device, dtype)
    w = torch.randn(40, generator=g).to(device, dtype)
    want = ref_rms_norm(x + res, w, 1e-6)
    want_res = x + res
    got = rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(res, want_res, rtol=tol, atol=tol)
    qk = torch.randn(3, 5, 24, generator=g).to(device, dtype)
    pos = torch.tensor([0, 7, 3], device=device)
    freqs = torch.outer(torch.arange(8.0), torch.rand(12, generator=g)).to(device)
    want = _rotate(qk, freqs.cos()[pos].unsqueeze(1).to(dtype),
                   freqs.sin()[pos].unsqueeze(1).to(dtype))
    torch.testing.assert_close(rotary_inplace(qk, pos, freqs.cos(), freqs.sin()), want,
                               rtol=tol, atol=tol)
    want_codes, want_scales = quantize_fp8_activations(rms_norm(x, w, 1e-6))
    for rows in (rms_norm_fp8(x, w, 1e-6), quantize_fp8_rows(rms_norm(x, w, 1e-6))):
        if not (torch.equal(rows.codes.view(torch.uint8), want_codes.view(torch.uint8))
                and torch.equal(rows.scales, want_scales)):
            raise RuntimeError("Triton FP8 activations differ from quantize_fp8_activations")
    gate_up = torch.randn(3, 80, generator=g).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, rtol=tol, atol=tol)
    # a MoE layer: 5 tokens, top-2 of 4 experts, expert 2 held elsewhere
    x = torch.randn(5, 32, generator=g).to(device, dtype)
    w13 = (torch.randn(3, 48, 32, generator=g) * 0.2).to(device, dtype)
    w2 = (torch.randn(3, 32, 24, generator=g) * 0.2).to(device, dtype)
    experts = torch.tensor([[0, 1], [3, 2], [1, 3], [0, 2], [2, 1]], device=device)
    weights = torch.rand(5, 2, generator=g).to(device)
    local_index = torch.tensor([0, 1, -1, 2], device=device)
    want = torch.zeros(5, 32, device=device)
    for t in range(5):
        for j in range(2):
            e = int(local_index[experts[t, j]])
            if e >= 0:
                h = w13[e].float() @ x[t].float()
                want[t] += weights[t, j] * (w2[e].float() @ (F.silu(h[:24]) * h[24:]))
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, experts, local_index).float(),
                               want, rtol=tol, atol=tol)
