"""Attention over a flat batch of variable-length sequences: plain (no cache) and paged.

Paged layout (per layer): one tensor ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
(K then V); a quantized cache's rows are ``head_dim + 4`` wide, codes and a scale
(:mod:`kvray.kernels.kv_quant`). Heads outermost means a gather of a sequence's blocks comes
out as ``[heads, length, head_dim]``, which matmul reads without another copy. ``slot_mapping[t]``
is the flat slot (``block_id * block_size + offset``) where token t's K/V is written;
``block_tables`` maps each sequence's logical blocks to physical ones.

Every call first writes all of the step's new K/V into the cache, then attends: a request
may read blocks that another request of the same step is filling (prefix sharing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvray.kernels.kv_quant import dequantize_rows, is_quantized, quantize_rows


@dataclass
class AttentionMetadata:
    """Per-step description of the flat token batch.

    Attributes:
        query_start_loc: [B + 1] offsets of each sequence's new tokens in the batch.
        positions: [T] absolute position of each token in its sequence.
        slot_mapping: [T] cache slot for each token's K/V (paged mode only).
        block_tables: [B, max_blocks] physical block ids per sequence, padded with block 0
            (never read: attention stops at seq_lens).
        seq_lens: [B] context length of each sequence after this step (paged).
        seq_lens_list: the same as Python ints (no device sync).
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        decode_kernel: fast decode attention with :func:`cpu_ops.paged_decode`'s
            signature (None = the PyTorch reference).
        write_kernel: writes K/V with :func:`write_kv_cache`'s signature (None = it).
        prefill_kernel: varlen paged prefill over all prefill rows at once, with
            :func:`kvray.kernels.triton_attention.paged_prefill`'s signature (None = the
            reference, one sequence at a time).
        max_query_len: the longest row's new tokens (for ``prefill_kernel``'s grid).
        kernels_take_softcap: ``decode_kernel`` and ``prefill_kernel`` take a ``softcap``
            keyword (Gemma 2's capped scores); if not, capped attention runs
            :func:`softcapped_attention`.
    """

    query_start_loc: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_list: list[int] | None = None
    num_decodes: int = 0
    decode_kernel: Callable | None = None
    write_kernel: Callable | None = None
    prefill_kernel: Callable | None = None
    max_query_len: int = 0
    kernels_take_softcap: bool = False

    @property
    def max_position(self) -> int | None:
        """The batch's largest position, known on the host (None where it is not): every
        row's positions end at its sequence length."""
        return max(self.seq_lens_list) - 1 if self.seq_lens_list else None

    @classmethod
    def for_full_sequences(cls, lengths: list[int], device: torch.device | str = "cpu"):
        """Metadata for a batch holding whole sequences (prefill, no cache)."""
        starts = torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return cls(query_start_loc=starts, positions=positions)


PagedRow = tuple[list[int], int, list[int]]  # (query token ids, first position, block ids)


def paged_batch(rows: list[PagedRow], block_size: int,
                to_tensor: Callable[[list], torch.Tensor], **kernels: Callable | None
                ) -> tuple[list[int], AttentionMetadata, list[int]]:
    """The flat batch of ``rows`` over a paged cache: one-token rows first, longest context
    first (the decode path buckets them by length), then the longer ones. Returns the token
    ids in batch order, the metadata (index tensors made by ``to_tensor``; ``kernels`` as
    :class:`AttentionMetadata` names them), and the flat index of each row's last token in
    the order ``rows`` were given."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]) != 1,
                                                    -(rows[i][1] + len(rows[i][0]))))
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens, query_lens, tables = [], [], []
    last = [0] * len(rows)
    for i in order:
        toks, first, blocks = rows[i]
        pos = range(first, first + len(toks))
        ids.extend(toks)
        positions.extend(pos)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        seq_lens.append(first + len(toks))
        query_lens.append(len(toks))
        tables.append(blocks)
        last[i] = len(ids) - 1
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=to_tensor(starts), positions=to_tensor(positions),
        slot_mapping=to_tensor(slots),
        block_tables=to_tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=to_tensor(seq_lens), seq_lens_list=seq_lens,
        num_decodes=sum(1 for n in query_lens if n == 1), max_query_len=max(query_lens),
        **kernels)
    return ids, meta, last


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float, sliding_window: int | None = None,
              kv_cache: torch.Tensor | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]; causal within each sequence. With
    ``softcap`` (Gemma 2) the scores become ``tanh(s / cap) * cap`` before the mask: in the
    paged kernels where they take a cap (``meta.kernels_take_softcap``), else in
    :func:`softcapped_attention`, which computes the scores itself."""
    if softcap is not None and (kv_cache is None or not meta.kernels_take_softcap):
        return softcapped_attention(q, k, v, meta, scale, sliding_window, kv_cache, softcap)
    if kv_cache is None:
        return dense_attention(q, k, v, meta, scale, sliding_window)
    (meta.write_kernel or write_kv_cache)(k, v, kv_cache, meta.slot_mapping)
    return paged_attention(q, kv_cache, meta, scale, sliding_window, softcap)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata, scale: float, sliding_window: int | None,
                         kv_cache: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """Attention with capped scores, each sequence's queries against its keys (the batch's
    own, or the paged cache's after this step's K/V are written)."""
    if kv_cache is not None:
        (meta.write_kernel or write_kv_cache)(k, v, kv_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for b in range(len(starts) - 1):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        if kv_cache is None:
            out[s:e] = _capped_one(q[s:e], k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                   scale, sliding_window, softcap)
        else:
            out[s:e] = _prefill_one(q[s:e], kv_cache, meta.block_tables[b],
                                    meta.seq_lens_list[b], scale, sliding_window, softcap)
    return out


def _capped_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float) -> torch.Tensor:
    """One sequence's last ``Lq`` tokens q [Lq, Hq, D] against its keys and values
    [Hk, L, D] with capped scores (SDPA takes no cap) -> [Lq, Hq, D]."""
    num_q, (hk, seq_len, dim) = q.shape[0], keys.shape
    allowed = _query_mask(num_q, seq_len, sliding_window, q.device)
    qg = q.transpose(0, 1).reshape(hk, -1, dim)  # [Hk, G * Lq, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(hk, -1, num_q, seq_len).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.matmul(probs.view(hk, -1, seq_len), values)  # [Hk, G * Lq, D]
    return o.view(-1, num_q, dim).transpose(0, 1)


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
    """Scatter this step's K/V ([T, Hk, D]) into their slots (a quantized cache: each
    (token, head) row's codes and scale, :func:`kv_quant.quantize_rows`)."""
    _, heads, num_blocks, block_size, width = kv_cache.shape
    if is_quantized(kv_cache.dtype):  # copied as bytes: index_copy_ has no fp8 kernels
        k = quantize_rows(k, kv_cache.dtype).view(torch.uint8)
        v = quantize_rows(v, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    flat = kv_cache.view(2, heads, num_blocks * block_size, width)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attend each new token to its sequence's cached context. Decode rows (one token each)
    go through the decode kernel, or batched, vectorised calls over a few length buckets;
    prefill chunks through the prefill kernel, or the reference one sequence at a time.
    A ``softcap`` goes to the kernels as a keyword (they must take it), and to the
    references."""
    nd = meta.num_decodes
    prefill_kernel = None
    if nd < len(meta.seq_lens_list):
        prefill_kernel = meta.prefill_kernel or prefill_reference
    cap = {} if softcap is None else {"softcap": softcap}  # kernels without a cap: no keyword

    def prefill_rows() -> torch.Tensor:
        qsl = meta.query_start_loc[nd:]
        first = int(qsl[0])
        return prefill_kernel(q[first:], kv_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                              qsl - first, meta.max_query_len, scale, sliding_window, **cap)

    if nd == 0 and prefill_kernel is not None:  # prefill rows only: no copy
        return prefill_rows()
    if nd and meta.decode_kernel is not None:
        decoded = meta.decode_kernel(q[:nd], kv_cache, meta.block_tables[:nd],
                                     meta.seq_lens[:nd], scale, sliding_window, **cap)
        if prefill_kernel is None:  # decode rows only: no copy
            return decoded
        out = torch.empty_like(q)
        out[:nd] = decoded
        nd_ref = 0
    else:
        out = torch.empty_like(q)
        nd_ref = nd
    for s, e in decode_buckets(meta.seq_lens_list[:nd_ref]):
        out[s:e] = _decode(q[s:e], kv_cache, meta.block_tables[s:e], meta.seq_lens[s:e],
                           meta.seq_lens_list[s], scale, sliding_window, softcap)
    if prefill_kernel is not None:
        out[int(meta.query_start_loc[nd]):] = prefill_rows()
    return out


def prefill_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      max_query_len: int, scale: float, sliding_window: int | None,
                      softcap: float | None = None) -> torch.Tensor:
    """The PyTorch reference ``prefill_kernel`` (what runs where none is set): each
    sequence's new tokens through SDPA over its gathered K/V, or with ``softcap`` through
    explicit capped scores (``max_query_len`` unused)."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e > s:
            out[s:e] = _prefill_one(q[s:e], kv_cache, block_tables[b], seq_len, scale,
                                    sliding_window, softcap)
    return out


def decode_buckets(seq_lens: list[int], max_buckets: int = 4, slack: float = 0.8
                   ) -> list[tuple[int, int]]:
    """Split decode rows, sorted longest first, into [start, end) slices each padded to its
    first row's length; a new slice starts when a row is shorter than ``slack`` x that length.
    Padding the whole batch to its longest sequence would multiply the gathered K/V."""
    assert all(a >= b for a, b in zip(seq_lens, seq_lens[1:], strict=False)), \
        "decode rows must be sorted"
    bounds, start = [], 0
    for i, n in enumerate(seq_lens):
        if i > start and n < slack * seq_lens[start] and len(bounds) < max_buckets - 1:
            bounds.append((start, i))
            start = i
    if seq_lens:
        bounds.append((start, len(seq_lens)))
    return bounds


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
            dtype: torch.dtype):
    """K and V of the first ``num_blocks`` logical blocks of each row of ``block_table``
    ([B, >= num_blocks]): each [Hk, B, num_blocks * block_size, D], ready for matmul (a
    quantized cache's dequantized to ``dtype``, the queries')."""
    _, heads, total, block_size, width = kv_cache.shape
    quantized = is_quantized(kv_cache.dtype)
    src = kv_cache.view(torch.uint8) if quantized else kv_cache  # no fp8 index_select
    ids = block_table[:, :num_blocks].reshape(-1)
    kv = src.view(2 * heads, total, block_size * width).index_select(1, ids)
    kv = kv.view(2, heads, block_table.shape[0], num_blocks * block_size, width)
    if quantized:
        kv = dequantize_rows(kv.view(kv_cache.dtype), dtype)
    return kv[0], kv[1]


def _decode(q, kv_cache, block_tables, seq_lens, max_len: int, scale: float,
            sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    batch, hq, dim = q.shape
    hk, block_size = kv_cache.shape[1], kv_cache.shape[3]
    nb = -(-max_len // block_size)
    k, v = _gather(kv_cache, block_tables, nb, q.dtype)  # [Hk, B, L, D]
    qg = q.view(batch, hk, hq // hk, dim).transpose(0, 1)  # [Hk, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [Hk, B, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(nb * block_size, device=q.device)
    invalid = key_pos[None, :] >= seq_lens[:, None]
    if sliding_window is not None:
        invalid |= key_pos[None, :] < seq_lens[:, None] - sliding_window
    scores.masked_fill_(invalid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hk, B, G, D]
    return out.transpose(0, 1).reshape(batch, hq, dim)


def _query_mask(num_q: int, seq_len: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor:
    """[num_q, seq_len] keys each of a sequence's last ``num_q`` tokens may attend: causal,
    within the window."""
    q_pos = torch.arange(seq_len - num_q, seq_len, device=device)
    k_pos = torch.arange(seq_len, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
    return mask


def _prefill_one(q, kv_cache, block_table, seq_len: int, scale: float,
                 sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    num_q = q.shape[0]
    block_size = kv_cache.shape[3]
    k, v = _gather(kv_cache, block_table[None], -(-seq_len // block_size), q.dtype)
    k, v = k[:, 0, :seq_len], v[:, 0, :seq_len]  # [Hk, L, D]
    if softcap is not None:
        return _capped_one(q, k, v, scale, sliding_window, softcap)
    if num_q == seq_len and sliding_window is None:
        # The whole sequence is new: query i sees keys 0..i, SDPA's own causal mask, with
        # which its CPU flash kernel skips the blocks above the diagonal (1.36x faster at
        # 512 tokens, 9 query / 3 KV heads) where an explicit mask computes them all.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale,
            enable_gqa=q.shape[1] != k.shape[0])
        return out[0].transpose(0, 1)
    mask = _query_mask(num_q, seq_len, sliding_window, q.device)
    # 4-D inputs: 3-D ones fall back to SDPA's slow math path on CPU.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)
