"""This worker's shard of the paged KV cache: sizing and allocation."""

from __future__ import annotations

import torch

from kvray.config import CacheConfig


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block takes across this worker's layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_budget(cache: CacheConfig, bytes_per_block: int,
                          device: torch.device) -> int:
    """Blocks that fit: the override, else ``kv_cache_memory`` on CPU, else on CUDA what is
    left of ``gpu_memory_utilization`` x total memory once the weights are loaded (measured
    now; no profile run reserves room for activations yet)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
    else:
        budget = cache.kv_cache_memory
    num = budget // bytes_per_block
    if num < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA)")
    return int(num)


class CacheEngine:
    """One ``[2, kv_heads, num_blocks, block_size, head_dim]`` tensor per local layer,
    indexed by global layer number (``None`` for layers on other pipeline stages)."""

    def __init__(self, num_layers: int, layer_range: tuple[int, int], num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        start, end = layer_range
        shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
        self.kv_caches: list[torch.Tensor | None] = [
            torch.zeros(shape, dtype=dtype, device=device) if start <= i < end else None
            for i in range(num_layers)
        ]
