"""Online FP8 (e4m3) quantization: weights at load time (vLLM's ``--quantization fp8``) and
activations per call (what ``torch._scaled_mm`` multiplies with the weights).

Weights get one scale per output channel (``block=None``) or per ``block`` columns of a row
(DeepSeek-style 128-wide blocks along K): ``scale = amax / 448`` over the channel or block,
codes = ``w / scale`` rounded to e4m3 (round to nearest even, as torch casts). A channel or
block of zeros gets scale 1. The result is a one-segment ``F8`` :class:`QuantTensor` whose
``dequantize()`` is the reference the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvray.quant.tensor import BLOCK, QuantKind, QuantSegment, QuantTensor, round_up

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_ACTIVATION_SCALE = 1e-12 / FP8_E4M3_MAX  # an all-zero token still divides safely


def _scales_for(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def quantize_fp8(w: torch.Tensor, block: int | None = None) -> QuantTensor:
    """e4m3 codes of ``w`` [N, K] with fp32 scales per output channel (``block=None``) or
    per ``block`` columns (a multiple of 32 dividing K rounded up to 32); codes and scales on
    ``w``'s device."""
    if w.dim() != 2:
        raise ValueError(f"FP8 quantization of a {w.dim()}-D tensor: expected a matrix")
    n, k = w.shape
    k_padded = round_up(k, BLOCK)
    group = k_padded if block is None else block
    if group % BLOCK or k_padded % group:
        raise ValueError(f"FP8 block size {block} for K = {k}: it must be a multiple of "
                         f"{BLOCK} that divides {k_padded} (K rounded up to {BLOCK}); use "
                         "per-channel scales (block None) for this matrix")
    padded = F.pad(w.to(torch.float32), (0, k_padded - k)).view(n, k_padded // group, group)
    scales = _scales_for(padded.abs().amax(dim=2))
    codes = (padded / scales[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = codes.to(torch.float8_e4m3fn).view(torch.uint8).view(n, k_padded)
    seg = QuantSegment(QuantKind.F8, group, codes, scales.contiguous())
    return QuantTensor((n, k), (seg,), source="fp8" if block is None else f"fp8 block {block}")


@dataclass(frozen=True)
class Fp8Rows:
    """Activation rows already quantized per token for an FP8 GEMM, as
    :func:`quantize_fp8_activations` makes them (a fused norm hands them over this way),
    with what the rows were before: their dtype (the GEMM's output dtype) and width K."""

    codes: torch.Tensor  # [M, K rounded up to 32] e4m3, zero-padded
    scales: torch.Tensor  # [M, 1] fp32
    dtype: torch.dtype
    width: int


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic e4m3 quantization of ``x`` [M, K]: codes [M, K] padded with
    zeros to a multiple of 32 columns (what FP8 GEMMs need), and fp32 scales [M, 1] with
    ``x ~= codes * scales``."""
    k = x.shape[1]
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)
    scales = (amax / divisor_on_device(FP8_E4M3_MAX, amax)).clamp(min=MIN_ACTIVATION_SCALE)
    codes = (xf / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    if k % BLOCK:
        codes = F.pad(codes.view(torch.uint8), (0, round_up(k, BLOCK) - k)).view(
            torch.float8_e4m3fn)
    return codes, scales


def divisor_on_device(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` in a tensor like ``like`` (fp32, filled on its device: no host copy, so
    CUDA-graph safe), to divide by. On CUDA, PyTorch turns a division by a Python number
    into a multiplication by its reciprocal (other bits in about half the cases); by a
    tensor it divides, as the CPU and the Triton kernels (``div_rn``) do, so all round alike."""
    return torch.full_like(like, value, dtype=torch.float32)
