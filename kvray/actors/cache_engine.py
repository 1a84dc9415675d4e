"""This worker's shard of the paged KV cache: the blocks' layout and their tensors.

How many blocks a worker holds is decided in :mod:`kvray.actors.kv_sizing`.
"""

from __future__ import annotations

import torch

from kvray.kernels.huge_pages import zeros_on_huge_pages
from kvray.kernels.kv_quant import kv_bytes_per_token, row_elements


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block takes across this worker's layers (K and V) in a cache of ``dtype``
    (a quantized one's per-row scales included)."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


class CacheEngine:
    """One ``[2, kv_heads, num_blocks, block_size, head_dim]`` tensor per local layer,
    indexed by global layer number (``None`` for layers on other pipeline stages); rows of
    ``head_dim + 4`` (codes, then an fp32 scale) for an int8 / fp8 ``dtype``
    (:mod:`kvray.kernels.kv_quant`). ``num_blocks`` counts every block allocated, those the
    block manager never hands out (the CUDA graphs' pad block) included."""

    def __init__(self, num_layers: int, layer_range: tuple[int, int], num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        start, end = layer_range
        shape = (2, num_kv_heads, num_blocks, block_size, row_elements(head_dim, dtype))
        local = end - start
        if torch.device(device).type == "cpu":  # blocks anywhere in GiBs: see huge_pages
            tensors = zeros_on_huge_pages(local, shape, dtype)
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(local)]
        self.kv_caches: list[torch.Tensor | None] = [
            tensors[i - start] if start <= i < end else None for i in range(num_layers)
        ]
