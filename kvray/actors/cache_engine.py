"""This worker's shard of the paged KV cache: sizing and allocation."""

from __future__ import annotations

import torch

from kvray.config import CacheConfig
from kvray.kernels.huge_pages import zeros_on_huge_pages


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block takes across this worker's layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def gpu_kv_budget(total: int, utilization: float, weights: int, activation_peak: int,
                  non_torch: int) -> int:
    """Bytes left for the KV cache on a GPU: ``utilization`` x its memory, less the weights,
    the peak of the profile run's activations (the largest step the scheduler may send) and
    what lives outside torch's allocator (CUDA context, NCCL buffers, other processes)."""
    return int(total * utilization) - weights - activation_peak - non_torch


def num_blocks_for_budget(cache: CacheConfig, bytes_per_block: int, budget: int,
                          breakdown: str = "") -> int:
    """Blocks that fit: the override, else ``budget`` bytes (``kv_cache_memory`` on CPU,
    :func:`gpu_kv_budget` on CUDA) over the bytes of one block. ``breakdown`` says where a
    GPU budget went, for the error when not one block fits."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    num = budget // bytes_per_block
    if num < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {bytes_per_block} bytes"
            f"{f' ({breakdown})' if breakdown else ''}; "
            "raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA)")
    return int(num)


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
