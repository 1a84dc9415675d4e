"""Attention over a flat batch of variable-length sequences: plain (no cache) and paged.

Paged layout (per layer): one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V), the layout a CUDA/Triton paged kernel reads. ``slot_mapping[t]`` is the flat
slot (``block_id * block_size + offset``) where token t's K/V is written; ``block_tables``
maps each sequence's logical blocks to physical ones.

Every call first writes all of the step's new K/V into the cache, then attends: a request
may read blocks that another request of the same step is filling (prefix sharing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step description of the flat token batch.

    Attributes:
        query_start_loc: [B + 1] offsets of each sequence's new tokens in the batch.
        positions: [T] absolute position of each token in its sequence.
        slot_mapping: [T] cache slot for each token's K/V (paged mode only).
        block_tables: [B, max_blocks] physical block ids per sequence, -padded (paged).
        seq_lens: [B] context length of each sequence after this step (paged).
        seq_lens_list / query_lens_list: the same as Python ints (no device sync).
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
    """

    query_start_loc: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_list: list[int] | None = None
    query_lens_list: list[int] | None = None
    num_decodes: int = 0

    @property
    def is_paged(self) -> bool:
        return self.slot_mapping is not None

    @classmethod
    def for_full_sequences(cls, lengths: list[int], device: torch.device | str = "cpu"):
        """Metadata for a batch holding whole sequences (prefill, no cache)."""
        starts = torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return cls(query_start_loc=starts, positions=positions)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float, sliding_window: int | None = None,
              kv_cache: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]; causal within each sequence."""
    if kv_cache is None:
        return dense_attention(q, k, v, meta, scale, sliding_window)
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    return paged_attention(q, kv_cache, meta, scale, sliding_window)


def dense_attention(q, k, v, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Reference: every sequence is complete in the batch (no cached context)."""
    num_tokens = q.shape[0]
    seq_ids = torch.repeat_interleave(
        torch.arange(meta.query_start_loc.numel() - 1, device=q.device),
        meta.query_start_loc.diff(), output_size=num_tokens)
    pos = meta.positions
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V into their slots."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attend each new token to its sequence's cached context. Decode rows (one token each)
    go through one batched, vectorised call; prefill chunks go one sequence at a time."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                           max(meta.seq_lens_list[:nd]), scale, sliding_window)
    starts = meta.query_start_loc.tolist() if nd < len(meta.seq_lens_list) else []
    for b in range(nd, len(meta.seq_lens_list)):
        s, e = starts[b], starts[b + 1]
        out[s:e] = _prefill_one(q[s:e], kv_cache, meta.block_tables[b], meta.seq_lens_list[b],
                                scale, sliding_window)
    return out


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int):
    """K and V of the first ``num_blocks`` logical blocks: [..., L, Hk, D] each."""
    kv = kv_cache[:, block_table[..., :num_blocks]]  # [2, ..., nb, bs, Hk, D]
    shape = (*kv.shape[1:-4], num_blocks * kv.shape[-3], *kv.shape[-2:])
    return kv[0].reshape(shape), kv[1].reshape(shape)


def _decode(q, kv_cache, block_tables, seq_lens, max_len: int, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    batch, hq, dim = q.shape
    block_size, hk = kv_cache.shape[2], kv_cache.shape[3]
    nb = -(-max_len // block_size)
    k, v = _gather(kv_cache, block_tables, nb)  # [B, L, Hk, D]
    group = hq // hk
    qg = q.view(batch, hk, group, dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hk, G, L]
    key_pos = torch.arange(nb * block_size, device=q.device)
    valid = key_pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        valid &= key_pos[None, :] >= seq_lens[:, None] - sliding_window
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, Hk, G, D]
    return out.reshape(batch, hq, dim)


def _prefill_one(q, kv_cache, block_table, seq_len: int, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    num_q = q.shape[0]
    block_size = kv_cache.shape[2]
    k, v = _gather(kv_cache, block_table, -(-seq_len // block_size))
    k, v = k[:seq_len], v[:seq_len]
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)
