"""How many KV cache blocks one worker can hold (the blocks' tensors: see cache_engine).

The budget is ``kv_cache_memory`` bytes on CPU; on CUDA it is what
``gpu_memory_utilization`` leaves after the weights, the activations of a profile run of the
largest step and the memory outside torch. Each worker sizes its own shard; the engine then
allocates the smallest count on all of them (:func:`kvray.actors.executor.initialize_kv_cache`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvray.actors.cache_engine import CacheEngine, kv_bytes_per_block
from kvray.config import CacheConfig, EngineConfig
from kvray.kernels.attention import PagedRow, paged_batch
from kvray.kernels.kv_quant import cache_dtype

if TYPE_CHECKING:
    from kvray.actors.model_runner import ModelRunner

logger = logging.getLogger("kvray")
GiB = 2**30


def local_kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of this worker's shard: its pipeline stage's layers and
    its tensor-parallel share of the KV heads."""
    inner = model.model
    attn = inner.layers[inner.start_layer].self_attn
    return inner.end_layer - inner.start_layer, attn.num_kv_heads, attn.head_dim


def kv_dtype(runner: ModelRunner) -> torch.dtype:
    """The dtype of the runner's cache tensors: ``kv_cache_dtype``, or the model's."""
    return cache_dtype(runner.config.cache.kv_cache_dtype, runner.dtype)


def new_kv_cache(runner: ModelRunner, num_blocks: int) -> CacheEngine:
    """``num_blocks`` zeroed blocks for each of the runner's local layers."""
    _, heads, dim = local_kv_shape(runner.model)
    inner = runner.model.model
    return CacheEngine(runner.spec.num_layers, (inner.start_layer, inner.end_layer), num_blocks,
                       runner.block_size, heads, dim, kv_dtype(runner), runner.device)


def bytes_per_block(runner: ModelRunner) -> int:
    """Bytes of one block on this worker: the target's layers, and the draft model's on the
    sampling rank (its cache shares the block ids)."""
    layers, heads, dim = local_kv_shape(runner.model)
    draft = runner.drafter.kv_bytes_per_block(runner.block_size) if runner.drafter else 0
    return kv_bytes_per_block(layers, runner.block_size, heads, dim, kv_dtype(runner)) + draft


def determine_num_blocks(runner: ModelRunner) -> int:
    """KV blocks this worker can hold: ``kv_cache_memory`` on CPU; on CUDA what
    ``gpu_memory_utilization`` leaves after the weights and a profile run of the largest
    step (:func:`profile_run`)."""
    cache = runner.config.cache
    block_bytes = bytes_per_block(runner)
    if cache.num_gpu_blocks_override is not None or runner.device.type != "cuda":
        num = num_blocks_for_budget(cache, block_bytes, cache.kv_cache_memory)
    else:
        budget, breakdown = _gpu_budget(runner)
        num = num_blocks_for_budget(cache, block_bytes, budget, breakdown)
    if runner.ctx.world_rank == 0:
        logger.info("kvray: KV cache: %d blocks (%d tokens), %d bytes/token, dtype %s", num,
                    num * runner.block_size, block_bytes // runner.block_size,
                    str(kv_dtype(runner)).removeprefix("torch."))
    return num


def _gpu_budget(runner: ModelRunner) -> tuple[int, str]:
    """Bytes left for the KV cache on this GPU after a profile run, and where the rest went
    (for the error when not one block fits)."""
    cache, device = runner.config.cache, runner.device
    activation_peak = profile_run(runner)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = gpu_kv_budget(total, cache.gpu_memory_utilization, weights, activation_peak,
                           max(0, non_torch))
    if runner.ctx.world_rank == 0:
        logger.info("kvray: GPU memory %.1f GiB x %.2f: weights %.2f GiB, activations "
                    "%.2f GiB, outside torch %.2f GiB -> KV cache %.2f GiB", total / GiB,
                    cache.gpu_memory_utilization, weights / GiB, activation_peak / GiB,
                    non_torch / GiB, budget / GiB)
    breakdown = (f"gpu_memory_utilization {cache.gpu_memory_utilization} x "
                 f"{total / GiB:.1f} GiB, less {weights / GiB:.2f} GiB of tensors this "
                 f"process holds (the weights, and any other engine's not shut down), "
                 f"{activation_peak / GiB:.2f} GiB of activations and "
                 f"{max(0, non_torch) / GiB:.2f} GiB outside torch (CUDA context, other "
                 "processes)")
    return budget, breakdown


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


def profile_rows(config: EngineConfig, max_model_len: int) -> tuple[list[PagedRow], int]:
    """The largest step the scheduler may send: ``max_num_batched_tokens`` prompt tokens
    spread over up to ``max_num_seqs`` sequences (none past ``max_model_len``), each on
    blocks of its own. Returns the rows and the blocks they take."""
    sched, bs = config.scheduler, config.cache.block_size
    tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_model_len)
    seqs = min(sched.max_num_seqs, tokens)
    rows: list[PagedRow] = []
    num_blocks = 0
    for i in range(seqs):
        n = tokens // seqs + (i < tokens % seqs)
        rows.append(([0] * n, 0, list(range(num_blocks, num_blocks + -(-n // bs)))))
        num_blocks += -(-n // bs)
    return rows, num_blocks


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> int:
    """One forward of the largest step (:func:`profile_rows`), each sequence's logits
    computed, over a scratch KV cache, to find the activations' peak; returns its bytes on
    CUDA (0 elsewhere: no allocator to ask). Pipeline stages run alone on zero activations;
    tensor-parallel ranks all run it (their all-reduces meet). The runner's own state and
    cache are left as they were."""
    rows, num_blocks = profile_rows(runner.config, runner.max_model_len)
    tokens = sum(len(row[0]) for row in rows)
    scratch = new_kv_cache(runner, num_blocks)
    dev = runner.device
    _, meta, last = paged_batch(rows, runner.block_size, runner._to_device, **runner.kernels)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
    hidden = residual = None
    if not runner.ctx.is_first_stage:
        hidden = torch.zeros(tokens, runner.spec.hidden_size, dtype=runner.dtype, device=dev)
        residual = torch.zeros_like(hidden)
    result = runner.model(ids, meta, hidden, residual, kv_caches=scratch.kv_caches)
    if runner.ctx.is_last_stage:
        logits = runner.model.compute_logits(result[runner._to_device(last)])
        torch.softmax(logits.float(), dim=-1)
    peak = 0
    if cuda:
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
    del scratch, result, meta
    return peak
