"""Draft-model proposals for speculative decoding (``speculative_config.model``).

A small model of the target's family (same tokenizer) runs on the sampling worker, whole
(no tensor parallelism), with a paged KV cache of its own that shares the target's block
tables: the same block ids address both caches, so the scheduler's allocation covers the
draft too (it reserves ``num_speculative_tokens`` lookahead slots per request for the
drafts the draft model writes ahead).

After each step, for each request that sampled: one forward catches the draft cache up on
the tokens it has not seen (the whole prompt the first time, then the accepted tokens and
the new one), and its argmax is the first draft; ``k - 1`` one-token steps give the rest.
Drafts are greedy (a point-mass proposal), which the target's rejection sampling accepts
with probability p(draft): the target distribution stays exact.
"""

from __future__ import annotations

import torch

from kvray.actors.cache_engine import CacheEngine, kv_bytes_per_block
from kvray.kernels.attention import PagedRow, paged_batch
from kvray.kernels.sampling import row_argmax
from kvray.models.loader import load_model
from kvray.parallel import ParallelContext


class DraftRunner:
    def __init__(self, model_path: str, dtype: torch.dtype, max_model_len: int,
                 target_vocab: int, num_speculative_tokens: int, device: torch.device,
                 kernels: dict) -> None:
        dtype_name = str(dtype).removeprefix("torch.")
        try:
            self.model, self.spec = load_model(model_path, dtype_name, ParallelContext(),
                                               max_model_len, device)
        except (OSError, ValueError) as err:
            raise ValueError(f"speculative_config.model = {model_path!r}: {err}") from None
        if self.spec.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model = {model_path!r}: its vocabulary has "
                f"{self.spec.vocab_size} tokens, the target's {target_vocab}; a draft model "
                "must share the target's tokenizer")
        self.device, self.dtype = device, dtype
        self.k = num_speculative_tokens
        self.kernels = kernels  # decode_kernel / write_kernel / prefill_kernel
        self.cache: CacheEngine | None = None
        self.computed: dict[str, int] = {}  # req -> positions whose draft KV is valid
        self.lengths: dict[str, int] = {}  # req -> drafts to propose (adaptive; default k)

    def _kv_shape(self) -> tuple[int, int, int]:
        attn = self.model.model.layers[0].self_attn
        return self.spec.num_layers, attn.num_kv_heads, attn.head_dim

    def kv_bytes_per_block(self, block_size: int) -> int:
        layers, heads, dim = self._kv_shape()
        return kv_bytes_per_block(layers, block_size, heads, dim, self.dtype)

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        layers, heads, dim = self._kv_shape()
        self.block_size = block_size
        self.cache = CacheEngine(layers, (0, layers), num_blocks, block_size, heads, dim,
                                 self.dtype, self.device)

    def forget(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.lengths.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], list[int]]]
                ) -> dict[str, list[int]]:
        """Drafts for each ``(req_id, all its tokens, its block ids)``: up to ``k``, fewer
        where its blocks end (the draft model writes ahead into them)."""
        bs = self.block_size
        jobs = []
        for req_id, tokens, blocks in requests:
            room = len(blocks) * bs - len(tokens) + 1  # writes reach position len + k - 2
            k = min(self.k, room, self.lengths.get(req_id, self.k))
            if k >= 1:
                jobs.append((req_id, tokens, blocks, k))
        if not jobs:
            return {}
        # 1. catch up on unseen tokens; the last row's argmax is each first draft
        rows = []
        for req_id, tokens, blocks, _ in jobs:
            start = min(self.computed.get(req_id, 0), len(tokens) - 1)
            rows.append((tokens[start:], start, blocks))
            self.computed[req_id] = len(tokens)
        next_tokens = self._forward(rows)
        drafts = {job[0]: [tok] for job, tok in zip(jobs, next_tokens, strict=True)}
        # 2. one token at a time for the rest
        for step in range(1, max(k for *_, k in jobs)):
            live = [(req_id, tokens, blocks) for req_id, tokens, blocks, k in jobs if step < k]
            rows = [([drafts[req_id][-1]], len(tokens) + step - 1, blocks)
                    for req_id, tokens, blocks in live]
            for (req_id, *_), tok in zip(live, self._forward(rows), strict=True):
                drafts[req_id].append(tok)
        return drafts

    def _forward(self, rows: list[PagedRow]) -> list[int]:
        """One varlen forward of ``(tokens, first position, block ids)`` rows through the
        draft model over its paged cache; the argmax after each row's last token."""

        def t(data: list) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int64, device=self.device)

        ids, meta, last = paged_batch(rows, self.block_size, t, **self.kernels)
        hidden = self.model(t(ids), meta, kv_caches=self.cache.kv_caches)
        return row_argmax(self.model.compute_logits(hidden[t(last)])).tolist()
