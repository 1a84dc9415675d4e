"""This worker's shard of the paged KV cache: the blocks' layout and their tensors.

How many blocks a worker holds is decided in :mod:`kvray.actors.kv_sizing`.
"""

from __future__ import annotations

import torch

from kvray.kernels.huge_pages import zeros_on_huge_pages


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block takes across this worker's layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class CacheEngine:
    """One ``[2, kv_heads, num_blocks, block_size, head_dim]`` tensor per local layer,
    indexed by global layer number (``None`` for layers on other pipeline stages).
    ``num_blocks`` counts every block allocated, those the block manager never hands out
    (the CUDA graphs' pad block) included."""

    def __init__(self, num_layers: int, layer_range: tuple[int, int], num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        start, end = layer_range
        shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
        local = end - start
        if torch.device(device).type == "cpu":  # blocks anywhere in GiBs: see huge_pages
            tensors = zeros_on_huge_pages(local, shape, dtype)
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(local)]
        self.kv_caches: list[torch.Tensor | None] = [
            tensors[i - start] if start <= i < end else None for i in range(num_layers)
        ]
