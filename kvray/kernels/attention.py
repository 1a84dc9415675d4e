"""Causal self-attention over a flat batch of variable-length sequences.

This module is the reference path: the model calls :func:`attention` with the
step's :class:`AttentionMetadata`, never with padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step description of how the flat token batch splits into sequences.

    Attributes:
        query_start_loc: [B + 1] int64 offsets of each sequence's tokens in the batch.
        positions: [T] int64 absolute position of each token in its sequence.
    """

    query_start_loc: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def for_full_sequences(cls, lengths: list[int], device: torch.device | str = "cpu"):
        """Metadata for a batch holding whole sequences (prefill, no cache)."""
        starts = torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return cls(query_start_loc=starts, positions=positions)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D], each token attending to the earlier
    tokens of its own sequence (within ``sliding_window`` when set). GQA by head groups."""
    num_tokens = q.shape[0]
    seq_ids = torch.repeat_interleave(
        torch.arange(meta.query_start_loc.numel() - 1, device=q.device),
        meta.query_start_loc.diff(),
        output_size=num_tokens,
    )
    pos = meta.positions
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
