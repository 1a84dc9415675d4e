"""Online quantization: a dense checkpoint's weights quantized at load time
(``quantization: int8``), one rank's shard at a time."""

from __future__ import annotations

import torch

from kvray.quant.tensor import BLOCK, QuantKind, QuantSegment, QuantTensor, round_up

INT8_MAX = 127


def quantize_int8(w: torch.Tensor) -> QuantTensor:
    """Weight-only int8 of a [N, K] matrix: S8 codes ``round(w / scale)`` in [-127, 127]
    with one fp32 scale per output row, ``amax(|row|) / 127`` (1 for an all-zero row), so
    each weight is within half a step of its row's scale. Symmetric and per channel: what
    the int8 kernels read fastest and what loses least on LLM weights."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization of a {w.dim()}-D tensor: only matrices")
    n, k = w.shape
    w32 = w.detach().to(torch.float32)
    amax = torch.maximum(w32.amax(dim=1, keepdim=True), -w32.amin(dim=1, keepdim=True))
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    codes = torch.div(w32, scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    k_padded = round_up(k, BLOCK)
    codes = torch.nn.functional.pad(codes, (0, k_padded - k))
    seg = QuantSegment(QuantKind.S8, k_padded, codes, scale)
    return QuantTensor((n, k), (seg,), "int8")
