"""The quantized paged KV cache (``kv_cache_dtype`` int8 / fp8): its layout, and the plain
PyTorch quantize / dequantize every kernel is tested against.

The cache stays one tensor per layer, ``[2, Hk, num_blocks, block_size, D + 4]`` of int8,
float8_e4m3fn or float8_e5m2: elements ``[..., :D]`` are the codes of one (token, head) row
of K or V, elements ``[..., D:]`` the four bytes (little-endian) of that row's fp32 scale,
``value = code * scale`` with ``scale = amax(|row|) / QMAX`` (1 for an all-zero row). Codes
and scales live in the same block, so block copies (swap, prefix caching) carry both.
"""

from __future__ import annotations

import torch

from kvray.quant.fp8 import divisor_on_device

SCALE_BYTES = 4  # one fp32 scale per (token, head) row, after its D codes

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# The largest code of each dtype: a row's largest |value| maps onto it.
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# The largest int16 code of a query row scored against an int8 cache in integers.
QUERY_CODE_MAX = 32767.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for ``kv_cache_dtype`` (``auto``: the model's own)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds codes and per-row scales."""
    return dtype in QMAX


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of a cache of ``dtype``: its last dimension."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The head size D whose K/V ``kv_cache`` holds."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(kv_cache.dtype) else width


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one token's K and V take over ``num_layers`` layers in a cache of ``dtype``:
    ``2 * Hk * (D + 4)`` per layer quantized, ``2 * Hk * D * element size`` otherwise."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * row_elements(head_dim, dtype) * elem


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` as cache rows ``[..., D + 4]`` of ``dtype``: codes, then the
    row's fp32 scale. int8 codes round to nearest (ties to even); fp8 codes are the cast."""
    x = x.float()
    qmax = QMAX[dtype]
    amax = x.abs().amax(dim=-1, keepdim=True)
    # by a device tensor, as the kernels divide (see divisor_on_device)
    scale = torch.where(amax > 0, amax / divisor_on_device(qmax, amax), torch.ones_like(amax))
    y = x / scale
    if dtype == torch.int8:
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp(-qmax, qmax).to(dtype)
    dim = x.shape[-1]
    out = torch.empty(*x.shape[:-1], dim + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :dim] = codes.view(torch.uint8)
    out[..., dim:] = scale.contiguous().view(torch.uint8)
    return out.view(dtype)


def round_query_rows(q: torch.Tensor) -> torch.Tensor:
    """Scaled query rows ``q [..., D]`` (fp32) as the CPU decode kernel scores them over an
    int8 cache where it computes in integers (``cpu_ops.paged_decode_query_codes``): each row
    rounded to int16 codes with the scale ``amax / 32767``, then back to fp32."""
    q = q.float()
    amax = q.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QUERY_CODE_MAX, torch.ones_like(amax))
    codes = (q * (1 / scale)).round().clamp(-QUERY_CODE_MAX - 1, QUERY_CODE_MAX)
    return codes * scale


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each cache row ``[..., D + 4]`` -> ``[..., 1]``."""
    return rows.view(torch.uint8)[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., D + 4]`` back to values ``[..., D]`` of ``dtype``."""
    codes = rows[..., :rows.shape[-1] - SCALE_BYTES].float()
    return (codes * row_scales(rows)).to(dtype)
