"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama-family
checkpoints), with Llama-3 and linear frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")  # the scaling rules rope_inv_freq knows


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rot_dim / 2] in fp32, after the checkpoint's scaling rule."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(
        f"rope scaling type '{rope_type}' is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embedding to q and k given each token's absolute position.

    cos/sin are precomputed in fp32 for ``max_positions`` and grown on demand.
    ``fused_inplace`` (set by :func:`kvray.models.llama.use_fused_ops`) rotates in place
    in one kernel call.
    """

    fused_inplace: Callable[..., torch.Tensor] | None = None

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._last = None
        self._grown_for: torch.Tensor | None = None
        self._fixed = False
        self._build(max_positions)

    def fix_tables(self, max_positions: int, device: torch.device) -> None:
        """Build the tables for every position below ``max_positions`` on ``device`` now and
        stop checking positions against them: no host sync per step (what a CUDA graph
        capture needs). The caller guarantees no position reaches ``max_positions``."""
        if self.cos.shape[0] < max_positions:
            self._build(max_positions)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self._fixed = True

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def _grow(self, positions: torch.Tensor) -> None:
        """Extend the tables past the largest position, on the positions' device."""
        if not self._fixed and positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(2 * int(positions.max()) + 1)
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole fp32 cos/sin tables ([max_pos, D/2]), grown past ``positions`` first:
        what the fused kernels index themselves. Checked once per step, not per layer."""
        if self._grown_for is not positions:
            self._grow(positions)
            self._grown_for = positions
        return self.cos, self.sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows for ``positions`` as [T, 1, D/2] in ``dtype``. Every layer of a step
        asks for the same positions, so the last answer is kept and reused."""
        key = (positions.data_ptr(), positions.shape, dtype)
        if self._last is not None and self._last[0] == key and self._last[1] is positions:
            return self._last[2]
        self._grow(positions)
        pair = (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))
        self._last = (key, positions, pair)
        return pair

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] -> rotated (q, k)."""
        return self.rotate_qk(positions, q), self.rotate_qk(positions, k)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Rotate q and k heads held side by side ([T, Hq + Hk, D]) in one pass (in place
        with the fused kernel: ``qk`` may be a view of the QKV projection)."""
        if self.fused_inplace is not None and qk.stride(-1) == 1 \
                and qk.stride(-2) == qk.shape[-1]:
            return self.fused_inplace(qk, positions, *self.tables(positions))
        cos, sin = self.cos_sin(positions, qk.dtype)
        return _rotate(qk, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

