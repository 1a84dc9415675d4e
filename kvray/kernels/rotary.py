"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama-family
checkpoints), with the checkpoints' frequency scaling rules: linear, Llama-3, YaRN, dynamic
NTK and LongRoPE, as transformers computes them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# the scaling rules rope_frequencies knows
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeFrequencies:
    """What the cos/sin tables are built from: ``inv_freq`` for positions below
    ``switch_at``, ``long_inv_freq`` from there on (dynamic NTK and LongRoPE; None for the
    static rules), both tables multiplied by ``attention_factor`` (YaRN, LongRoPE)."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    switch_at: int = 0


def rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _plain_inv_freq(theta: float, rot_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def rope_frequencies(rot_dim: int, theta: float, scaling: dict[str, Any] | None,
                     model_max_positions: int, max_positions: int) -> RopeFrequencies:
    """The frequencies of the checkpoint's rule (transformers' ``modeling_rope_utils``).

    transformers recomputes dynamic NTK and LongRoPE frequencies per forward from the
    largest position in it (a prompt past the limit re-rotates every position; a decode step
    only its own token). A paged cache rotates each key once, at its position, so kvray
    picks per position, as vLLM does: below the limit (``max_position_embeddings`` for
    dynamic, ``original_max_position_embeddings`` for LongRoPE) the frequencies
    transformers uses for any sequence that stays below it, from there on the long ones
    (dynamic: NTK sized for ``max_positions``, the configured context)."""
    base = _plain_inv_freq(theta, rot_dim)
    kind, s = rope_type(scaling), scaling or {}
    if kind == "default":
        return RopeFrequencies(base)
    if kind == "linear":
        return RopeFrequencies(base / float(s["factor"]))
    if kind == "llama3":
        return RopeFrequencies(_llama3_inv_freq(base, s))
    if kind == "yarn":
        return _yarn(rot_dim, theta, s, model_max_positions)
    if kind == "dynamic":
        factor = float(s["factor"])
        seq_len = max(max_positions, model_max_positions)
        ntk = theta * ((factor * seq_len / model_max_positions) - (factor - 1)) ** (
            rot_dim / (rot_dim - 2))
        return RopeFrequencies(base, long_inv_freq=_plain_inv_freq(ntk, rot_dim),
                               switch_at=model_max_positions)
    if kind == "longrope":
        return _longrope(rot_dim, theta, s, model_max_positions)
    raise ValueError(
        f"rope scaling type '{kind}' is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rot_dim / 2] in fp32 of a static rule (no position switch)."""
    return rope_frequencies(rot_dim, theta, scaling, 1 << 30, 1 << 30).inv_freq


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _extension(s: dict[str, Any], model_max: int) -> tuple[int, float, float | None]:
    """(original context, factor, attention factor or None) of a YaRN / LongRoPE rule; a
    missing factor is the ratio of the two contexts, as transformers takes it."""
    original = int(s.get("original_max_position_embeddings") or model_max)
    factor = s.get("factor")
    factor = float(factor) if factor is not None else model_max / original
    return original, factor, s.get("attention_factor")


def _yarn(dim: int, theta: float, s: dict[str, Any], model_max: int) -> RopeFrequencies:
    # Frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), more than beta_fast times kept, a linear ramp between.
    original, factor, attention = _extension(s, model_max)
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) \
        + (1.0 / pos_freqs) * extrapolation
    return RopeFrequencies(inv_freq, float(attention))


def _longrope(dim: int, theta: float, s: dict[str, Any], model_max: int) -> RopeFrequencies:
    original, factor, attention = _extension(s, model_max)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def freqs(ext: list[float]) -> torch.Tensor:
        if len(ext) != dim // 2:
            raise ValueError(f"longrope: {len(ext)} factors for a rotary dim of {dim} "
                             f"(need {dim // 2})")
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape)

    return RopeFrequencies(freqs(s["short_factor"]), float(attention),
                           freqs(s["long_factor"]), original)


def max_context(model_max_positions: int, scaling: dict[str, Any] | None) -> int:
    """The longest context a checkpoint's rope rule is meant for: ``max_position_embeddings``,
    times ``factor`` for dynamic NTK, ``original_max_position_embeddings`` times ``factor``
    for YaRN (as vLLM derives it; LongRoPE and Llama-3 configs state the extended length)."""
    kind, s = rope_type(scaling), scaling or {}
    if kind == "dynamic":
        return int(model_max_positions * float(s["factor"]))
    if kind == "yarn":
        original, factor, _ = _extension(s, model_max_positions)
        return max(model_max_positions, int(original * factor))
    return model_max_positions


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embedding to q and k given each token's absolute position.

    cos/sin are precomputed in fp32 for ``max_positions`` and grown on demand.
    ``fused_inplace`` (set by :func:`kvray.models.llama.use_fused_ops`) rotates in place
    in one kernel call.
    """

    fused_inplace: Callable[..., torch.Tensor] | None = None
    # rotary + KV-cache write in one launch (triton_ops.rotary_write_kv's signature), set
    # with the Triton kernels, whose cache it writes
    fused_write: Callable[..., None] | None = None

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int, model_max_positions: int | None = None,
                 rot_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        # the leading dims of a head that turn (partial rotary); the rest pass through
        self.rot_dim = rot_dim or head_dim
        self.freqs = rope_frequencies(self.rot_dim, theta, scaling,
                                      model_max_positions or max_positions, max_positions)
        self.inv_freq = self.freqs.inv_freq
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
        f = self.freqs
        positions = torch.arange(n, dtype=torch.float32)
        angles = torch.outer(positions, f.inv_freq)
        if f.long_inv_freq is not None and n > f.switch_at:
            angles[f.switch_at:] = torch.outer(positions[f.switch_at:], f.long_inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()
        if f.attention_factor != 1.0:
            self.cos, self.sin = self.cos * f.attention_factor, self.sin * f.attention_factor

    def _grow(self, positions: torch.Tensor, max_position: int | None = None) -> None:
        """Extend the tables past the largest position (``max_position`` where the caller
        knows it on the host: no device read), on the positions' device."""
        if not self._fixed and positions.numel():
            top = int(positions.max()) if max_position is None else max_position
            if top >= self.cos.shape[0]:
                self._build(2 * top + 1)
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)

    def tables(self, positions: torch.Tensor, max_position: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole fp32 cos/sin tables ([max_pos, rot_dim/2]), grown past ``positions`` first
        (``max_position``: their largest, where known on the host): what the fused kernels
        index themselves. Checked once per step, not per layer."""
        if self._grown_for is not positions:
            self._grow(positions, max_position)
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

    def rotate_and_write(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] in place and write the rotated k and v [T, Hk, D] into their
        cache slots, in one ``fused_write`` call (partial rotary included)."""
        assert self.fused_write is not None, "rotate_and_write needs the fused kernel"
        self.fused_write(q, k, v, positions, *self.tables(positions), kv_cache, slot_mapping)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] -> rotated (q, k)."""
        return self.rotate_qk(positions, q), self.rotate_qk(positions, k)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Rotate q and k heads held side by side ([T, Hq + Hk, D]) in one pass (in place
        with the fused kernel, which turns whole heads: ``qk`` may be a view of the QKV
        projection)."""
        partial = self.rot_dim < qk.shape[-1]
        if self.fused_inplace is not None and not partial and qk.stride(-1) == 1 \
                and qk.stride(-2) == qk.shape[-1]:
            return self.fused_inplace(qk, positions, *self.tables(positions))
        cos, sin = self.cos_sin(positions, qk.dtype)
        if partial:
            r = self.rot_dim
            return torch.cat((_rotate(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)
        return _rotate(qk, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

