"""RMSNorm, computed in fp32 and cast back, as Hugging Face's Llama-family models do."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


FusedRMSNorm = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]


class RMSNorm(torch.nn.Module):
    """RMSNorm with an optional fused residual add: ``forward(x, residual)`` returns
    ``(norm(x + residual), x + residual)``, which saves a pass over the hidden states.

    ``fused`` (set by :func:`kvray.models.llama.use_fused_ops`) does it in one kernel call;
    it then adds ``x`` into ``residual`` in place and returns that tensor as the sum."""

    fused: FusedRMSNorm | None = None
    # The same in one kernel that hands its output over as FP8 rows for an FP8 GEMM
    # (triton_ops.rms_norm_fp8; the decoder layer calls it where the next linear takes them)
    fused_fp8: Callable[..., object] | None = None

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            out = self.fused(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` with the product taken in fp32 before the
    cast back (transformers' Gemma 2 / 3; the checkpoint stores ``w``, zeros = identity).
    Same ``forward(x, residual)`` contract as :class:`RMSNorm`; no fused kernel."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
