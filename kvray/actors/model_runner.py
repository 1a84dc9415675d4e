"""Turns each incremental SchedulerOutput into tensors, runs the model, samples.

Keeps per-request state (token ids, block table, progress, generator) between steps, so
the scheduler only sends what changed.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from kvray.actors.cache_engine import (
    CacheEngine,
    gpu_kv_budget,
    kv_bytes_per_block,
    num_blocks_for_budget,
)
from kvray.actors.cuda_graphs import DecodeGraphs, capture_sizes
from kvray.actors.draft_runner import DraftRunner
from kvray.actors.swap_pool import SwapPool
from kvray.config import EngineConfig
from kvray.kernels import cpu_ops
from kvray.kernels.attention import AttentionMetadata, PagedRow, paged_batch
from kvray.kernels.huge_pages import move_to_huge_pages
from kvray.kernels.rotary import RotaryEmbedding
from kvray.kernels.sampling import (
    SamplerOutput,
    SamplingBatch,
    SpecSpan,
    row_argmax,
    sample,
    sample_speculative,
)
from kvray.models.layers import (
    WEIGHT_MAJOR_MAX_ROWS,
    ParallelLMHead,
    SmallMMatmul,
    packed_weights_supported,
    release_plain_weights,
    use_packed_weights,
    use_prepacked_weights,
    use_small_m_kernel,
)
from kvray.models.llama import LlamaDecoderLayer, use_fused_decode_layer, use_fused_ops
from kvray.models.loader import load_model, resolve_max_model_len
from kvray.parallel import ParallelContext
from kvray.sampling_params import SamplingParams
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.request import next_draft_length
from kvray.structured_output import GrammarCompiler, Matcher, bitmask_width, compiler_for

logger = logging.getLogger("kvray")


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # sliced once, for penalties
    matcher: Matcher | None = None  # structured outputs (output rank only)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    req_ids: list[str]  # the step's requests
    sample_rows: list[int]  # index (in req_ids) of each request that samples
    logits_index: torch.Tensor  # token index of each logits row (hidden state to project)
    first_rows: list[int] = field(default_factory=list)  # per sample row: its logits row
    # speculative decoding: sample row -> its drafts (rows first_rows[i] .. + len(drafts))
    spans: dict[int, list[int]] = field(default_factory=dict)
    token_starts: list[int] = field(default_factory=list)  # per request: its first token


# How an fp32 model's linears are routed past the small-M kernel's rows with 16-lane
# (AVX-512) kernels: F.linear (MKL's sgemm, AVX-512 there) up to 64 rows and for the LM
# head at any size, the tiled GEMM for layers past 64 rows (prefill chunks: it shares the
# work out tile by tile, see linear_tiled). Measured on a 2-core AVX-512 Xeon, fp32, two
# threads: the layers at 40 / 64 rows (cold weights) F.linear 53.7 / 73.3 ms per 30 layers,
# weight-major 59.6 / 81.8, tiled 87.0 / 86.3 (its 32-row panels pad 33-63 rows); the
# 49,152 x 576 LM head at 32 / 64 / 128 / 256 rows F.linear 11.6 / 20 / 30.7 / 70 ms,
# tiled 14.9 / 21.7 / 33.4 / 77, weight-major 13.6 / 30 / 52 / 99. With 8 lanes (AVX2
# EPYC) the weight-major sgemm up to 64 rows and for the LM head at any size (1.4-1.8x
# F.linear at 48-128 rows), the tiled GEMM past 64 (use_small_m_kernel's defaults).
AVX512_ROUTES = dict(weight_major_max_rows=0, lm_head_weight_major_max_rows=0,
                     large_m_min_rows=WEIGHT_MAJOR_MAX_ROWS + 1,
                     lm_head_large_m_min_rows=1 << 62)
# With 16 lanes, a layer that has an exact bf16 copy for the small-M kernel (a bf16
# checkpoint run in fp32) takes every input past those rows, the LM head's too, through the
# tiled kernel on a copy of its fp32 weight packed once at load time (cpu_ops.linear_packed),
# instead of the routes above; its plain fp32 weight is then released, so the weights take
# as many bytes as before, plus a packed copy of an LM head tied to the embedding. MKL's
# sgemm and linear_tiled repack the weight on every call, and at decode-batch sizes the
# kernel must also prefetch the weight stream to keep its FMAs fed. Measured on a 2-core
# AVX-512 Xeon (fp32, two threads), the built-in model's decode steps, two engines in one
# process alternating (median / best of 4 rounds) at 48 / 64 / 128 / 256 rows: 0.86 /
# 0.79 / 0.80 / 0.92x (0.83 / 0.80 / 0.86 / 0.87x) the time of the routes above. oneDNN's
# packed fp32 matmul was about as fast but grew memory per row count (design.md).
AVX512_PREPACKED = True
# Those layers take inputs of this many rows on through their packed weights, not the
# small-M kernel's bf16 copies (such decode batches left the fused layer when these were
# measured; since 2026-12-03 the fused layer takes the packed weights there too): the packed
# kernel's time grows with the rows more slowly than the small-M kernel's. Measured on a
# 2-core AVX-512 Xeon
# (fp32, weights on huge pages, cold, median of 7), the 30 layers' linears small-M /
# packed: 16 rows 32.7 / 33.3 ms, 20 40.7 / 44.2, 24 47.9 / 45.4, 28 56.2 / 45.4, 32 60.3 /
# 45.7; the 49,152 x 576 LM head: 16 7.4 / 7.0, 20 9.5 / 9.5, 24 11.0 / 9.3, 28 11.9 /
# 8.5, 32 13.4 / 9.1. Whole decode steps (two engines alternating, median of 4 rounds; the
# host's noise about +-10 %): from 24 rows, 1.08 / 1.06 / 0.81x the time at 24 / 28 / 32
# rows (the fused layer saves more than the kernels gain at 24-28); from 30, 0.97 / 0.84 /
# 0.91x at 30 / 31 / 32. With the packed kernel's 12-row blocks (2026-12-02; no 32-row
# panels any more) the cut moved down: from 22 vs from 30, median of 8 rounds, 1.06 /
# 1.08 / 1.05 / 1.05x faster at 22 / 24 / 26 / 28 rows (best rounds about even); from 17,
# 0.90 / 0.93x at 17 / 20 rows (the fused layer still wins there).
AVX512_PACKED_FROM_ROWS = 24
# With 8 lanes (AVX2) too, for every input past the small-M kernel's 16 rows, the LM
# head's included. On a 2-core AVX2 EPYC (Zen 3, fp32, two threads), the 30 layers'
# linears (cold weights, median of 7), weight-major sgemm / tiled / packed ms: 17 rows
# 100 / 90 / 41, 32 rows 98 / 105 / 57, 64 rows 183 / 207 / 155, 128 rows 333 / 413 / 362,
# 256 rows 602 / 659 / 530; the LM head 30 / 22 / 11 at 17 rows, 261 / 188 / 160 at 256;
# at 12-16 rows the small-M kernel's bf16 copies and the packed weights about even. Whole
# runs, two engines in one process alternating (median of 3, greedy tokens identical):
# 0.70x the time for 32 requests decoding together, 0.83x for 64 and 128, 0.87x for a
# prefill of 8 x 1,024 tokens.
AVX2_PREPACKED = True
# With 8 lanes the panels hold the bf16 copy's values (use_prepacked_weights' ``bf16``:
# half the bytes to stream, widened exactly; the same products), which beat the small-M
# kernel from a few rows on, and every decode batch of that size stays in the fused layer
# (decode_layer on the packed weights). On a 2-core AVX2 EPYC (Zen 3, fp32, two threads),
# the 30 layers' linears (median of 7), small-M / bf16 panels ms: 1 row 7.1 / 7.9, 2 8.2 /
# 8.8, 4 9.0 / 8.3, 6 13.3 / 8.9, 8 14.9 / 13.4, 12 21.0 / 15.9, 16 27.8 / 21.0.
AVX2_BF16_PANELS = True
AVX2_PACKED_FROM_ROWS = 3


def prepacked_from_rows() -> int | None:
    """From how many rows a bf16 checkpoint's fp32 linears take their weights packed once
    (:data:`AVX512_PREPACKED`, :data:`AVX2_PREPACKED`), by the built kernels' vector width;
    None where they are not packed (no AVX2 kernels, or packing switched off)."""
    lanes = cpu_ops.vector_lanes()
    if lanes >= 16 and AVX512_PREPACKED:
        return AVX512_PACKED_FROM_ROWS
    if lanes == 8 and AVX2_PREPACKED:
        return AVX2_PACKED_FROM_ROWS if AVX2_BF16_PANELS else cpu_ops.small_m_max_rows() + 1
    return None


def _use_cpu_linear_kernels(model: torch.nn.Module,
                            bf16_weights: bool = False) -> tuple[int, int, int]:
    """The CPU extension's linears for ``model`` (fp32): the small-M kernel for decode-sized
    inputs, the tiled GEMM for prefill-sized ones (see :func:`use_small_m_kernel`), the
    routes between by the kernels' vector width; with AVX2 or AVX-512 kernels, weights
    packed once past the small-M kernel's rows (:func:`prepacked_from_rows`). Returns the
    bytes of the bf16 copies, of the packed copies, and of the plain weights released."""
    wide = cpu_ops.vector_lanes() >= 16
    routes = AVX512_ROUTES if wide else {}
    bf16 = use_small_m_kernel(model, cpu_ops.linear_small_m, cpu_ops.small_m_max_rows(),
                              bf16_weights=bf16_weights, large_m_kernel=cpu_ops.linear_tiled,
                              **routes)
    packed = freed = 0
    from_rows = prepacked_from_rows()
    if from_rows is not None:
        gate_up = (cpu_ops.pack_gate_up_weight, cpu_ops.linear_packed_gate_up,
                   partial(cpu_ops.linear_packed_gate_up, silu_mul=True),
                   cpu_ops.load_ops().vector_lanes())  # the build's panels
        packed = use_prepacked_weights(model, cpu_ops.pack_linear_weight,
                                       cpu_ops.linear_packed, from_rows, gate_up,
                                       bf16=not wide and AVX2_BF16_PANELS)
        freed = release_plain_weights(model)
    return bf16, packed, freed


def _small_m_rows(model: torch.nn.Module) -> int:
    """The fewest rows any decoder linear of ``model`` gives the small-M kernel (the fused
    layer computes every linear with that kernel): ``cpu_ops.small_m_max_rows()``, less
    where packed weights take over earlier (:data:`AVX512_PACKED_FROM_ROWS`)."""
    rows = [m.small_m_max_rows for m in model.modules()
            if isinstance(m, SmallMMatmul) and not isinstance(m, ParallelLMHead)
            and m.small_m_kernel is not None]
    return min(rows, default=cpu_ops.small_m_max_rows())


# A bf16 model's decode batches of up to this many rows take the fused C++ layer (the
# small-M kernel over its bf16 weights, fp32 activations); larger ones oneDNN's packed bf16
# matmuls. Measured on a 2-core AMX Xeon, step ms fused / oneDNN: batch 1 16.2-17.2 / 20.9,
# batch 4 20.8-22.3 / 21.4, batch 8 24.3-27.7 / 23.6.
BF16_FUSED_ROWS = 4


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, ctx: ParallelContext,
                 device: torch.device) -> None:
        self.config = config
        self.model_path = model_path
        self.ctx = ctx
        self.device = device
        self.model, self.spec = load_model(model_path, config.model.dtype, ctx,
                                           config.model.max_model_len, device)
        self.dtype = next(self.model.parameters()).dtype  # resolved once, by load_model
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.spec)
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # survive preemption
        self.default_generator = torch.Generator(device).manual_seed(config.model.seed)
        self.cache: CacheEngine | None = None
        self.swap_pool = SwapPool()
        self.decode_kernel = self.write_kernel = self.prefill_kernel = None
        self.graphs: DecodeGraphs | None = None
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._mask_thread: ThreadPoolExecutor | None = None
        # Host-side inputs go through pinned memory, copied without blocking the host.
        self.pin_memory = device.type == "cuda"
        if device.type == "cpu" and cpu_ops.load_ops() is not None:
            use_fused_ops(self.model, cpu_ops)
            if self.dtype == torch.float32:
                self._use_small_m_kernel()
        if device.type == "cpu" and self.dtype == torch.bfloat16 and packed_weights_supported():
            extra = use_packed_weights(self.model)
            if ctx.world_rank == 0:
                logger.info("kvray: weights reordered for oneDNN's bf16 matmuls: %.0f MiB",
                            extra / 2**20)
        if device.type == "cpu":
            self._weights_to_huge_pages(self.model)
        self._pick_attention_backend(config.model.attention_backend)
        if self._fused_decode_layer_fits(ctx.tp_size):
            self._install_fused_decode(self.model)
        self.drafter: DraftRunner | None = None
        spec = config.model.speculative_config
        if spec is not None and spec.method == "draft_model" and ctx.is_output_rank:
            self.drafter = DraftRunner(
                spec.model, self.dtype, self.max_model_len, self.spec.vocab_size,
                spec.num_speculative_tokens, device, self.kernels)
            self._install_fast_ops(self.drafter.model)

    def release(self) -> None:
        """Drop what this runner holds on its device (CUDA graphs and their memory pool, the
        KV caches, the draft model, the weights) and hand the freed memory back to the
        device, so that another engine in this process gets it: on CUDA the next engine's
        ``gpu_memory_utilization`` budget counts every tensor the process still holds.
        Nothing runs on the runner afterwards."""
        self.graphs = None
        self.cache = None
        self.drafter = None
        self.requests.clear()
        self.generators.clear()
        self.swap_pool = SwapPool()
        self.model = None
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False)
            self._mask_thread = None
        gc.collect()  # reference cycles in the model would keep its tensors until later
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _pick_attention_backend(self, requested: str) -> None:
        """The paged attention kernels ``attention_backend`` asks for (see ModelConfig);
        an impossible choice is an error that names the setting."""
        on_cpu = self.device.type == "cpu"
        backend = requested
        if requested == "auto":
            backend = "cpu" if on_cpu and cpu_ops.load_ops() is not None else "torch"
            if not on_cpu and _triton_available() and self._triton_works():
                backend = "triton"
        if backend == "cpu":
            if not on_cpu or cpu_ops.load_ops() is None:
                raise ValueError(
                    f"attention_backend='cpu' needs kvray's C++ kernels on a CPU device "
                    f"(device here: {self.device.type}; kernels built: "
                    f"{cpu_ops.load_ops() is not None}); use 'auto' or 'torch'")
            self.decode_kernel, self.write_kernel = cpu_ops.paged_decode, cpu_ops.write_kv
            self.prefill_kernel = cpu_ops.paged_prefill
        elif backend == "triton":
            if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "attention_backend='triton' on CPU runs in Triton's interpreter only: "
                    "set TRITON_INTERPRET=1 before starting kvray (slow; meant for tests)")
            if not _triton_available():
                raise ValueError("attention_backend='triton' needs the `triton` package "
                                 "(pip install triton)")
            from kvray.kernels import triton_attention, triton_ops

            use_fused_ops(self.model, triton_ops)
            self._triton_ops = triton_ops
            self.decode_kernel = triton_attention.paged_decode
            self.write_kernel = triton_attention.write_kv
            self.prefill_kernel = triton_attention.paged_prefill
        self.attention_backend = backend

    def _fused_decode_layer_fits(self, tp_size: int) -> bool:
        """Whether small decode batches of a model split over ``tp_size`` ranks can run
        each layer as one C++ call: the CPU kernels' attention, fp32 or bf16 weights (the
        small-M kernel's; the layer computes on fp32 activations either way) and one
        tensor-parallel rank (no all-reduce in a layer)."""
        return self.attention_backend == "cpu" and tp_size == 1 \
            and self.dtype in (torch.float32, torch.bfloat16)

    def _fused_decode_max_rows(self, model: torch.nn.Module) -> int:
        """Decode batches of ``model`` up to this size take the fused layer. fp32: the
        small-M kernel's range (:func:`_small_m_rows`), or any size where every decoder
        linear also has its weights packed once (the fused layer takes those past the
        small-M kernel's rows: the same kernels as the Python layer, without the Python
        between them). bf16: past a few rows oneDNN's packed bf16 matmuls (AMX where the CPU
        has it) beat the small-M kernel by more than the fused layer saves (measured on a
        2-core AMX Xeon: see :data:`BF16_FUSED_ROWS`)."""
        if self.dtype != torch.float32:
            return BF16_FUSED_ROWS
        layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
        if layers and all(layer.decode_args()[0][8:] for layer in layers):
            return 1 << 30
        return _small_m_rows(model)

    @property
    def kernels(self) -> dict:
        """The attention kernels picked, as :class:`AttentionMetadata` names them."""
        return dict(decode_kernel=self.decode_kernel, write_kernel=self.write_kernel,
                    prefill_kernel=self.prefill_kernel)

    def _install_fast_ops(self, model: torch.nn.Module) -> None:
        """The fused ops the target model got, for another model (the draft)."""
        if self.attention_backend == "triton":
            use_fused_ops(model, self._triton_ops)
        elif self.device.type == "cpu" and cpu_ops.load_ops() is not None:
            use_fused_ops(model, cpu_ops)
            if self.dtype == torch.float32:
                _use_cpu_linear_kernels(model)
            if self.dtype == torch.bfloat16 and packed_weights_supported():
                use_packed_weights(model)
            self._weights_to_huge_pages(model)
            if self._fused_decode_layer_fits(tp_size=1):  # the draft runs on one rank
                self._install_fused_decode(model)

    def _install_fused_decode(self, model: torch.nn.Module) -> None:
        """``model``'s small decode batches through the extension's ``decode_layer`` (one
        call per layer) and ``decode_layers`` (all the stage's layers in one call)."""
        ops = cpu_ops.load_ops()
        use_fused_decode_layer(model, ops.decode_layer, self._fused_decode_max_rows(model),
                               ops.decode_layers)

    def _triton_works(self) -> bool:
        """Whether the Triton kernels compile and agree with the reference here; by default
        kvray trusts them only then (else the PyTorch reference, with a warning)."""
        try:
            from kvray.kernels import triton_attention, triton_ops

            triton_attention.self_check(self.device, self.dtype)
            triton_ops.self_check(self.device, self.dtype)
            return True
        except Exception as err:  # noqa: BLE001 - any failure means: do not use them
            logger.warning("kvray: Triton kernels failed their check on %s (%s); "
                           "using the PyTorch reference", self.device, err)
            return False

    def _weights_to_huge_pages(self, model: torch.nn.Module) -> None:
        """The weights a step streams onto huge pages (see :mod:`kvray.kernels.huge_pages`),
        once every copy the kernels read exists."""
        moved = move_to_huge_pages(model)
        if moved and self.ctx.world_rank == 0:
            logger.info("kvray: weights on transparent huge pages: %.0f MiB", moved / 2**20)

    def _use_small_m_kernel(self) -> None:
        """Decode-sized matmuls through the CPU kernel, prefill-sized ones through the tiled
        GEMM; a bf16 checkpoint run in fp32 also keeps bf16 copies of its weights for the
        former, halving the bytes each decode step reads."""
        bf16, packed, freed = _use_cpu_linear_kernels(
            self.model, bf16_weights=self.spec.torch_dtype == "bfloat16")
        if bf16 and self.ctx.world_rank == 0:
            logger.info("kvray: bf16 copies of the weights for decode steps: %.0f MiB",
                        bf16 / 2**20)
        if packed and self.ctx.world_rank == 0:
            logger.info("kvray: weights packed for larger batches: %.0f MiB; plain "
                        "copies released: %.0f MiB", packed / 2**20, freed / 2**20)

    # ---- KV cache ---------------------------------------------------------------------
    def _local_kv_shape(self) -> tuple[int, int, int]:
        attn = self.model.model.layers[self.model.model.start_layer].self_attn
        num_local_layers = self.model.model.end_layer - self.model.model.start_layer
        return num_local_layers, attn.num_kv_heads, attn.head_dim

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block here: the target's layers, and the draft model's on the
        sampling rank (its cache shares the block ids)."""
        layers, heads, dim = self._local_kv_shape()
        draft = self.drafter.kv_bytes_per_block(self.block_size) if self.drafter else 0
        return kv_bytes_per_block(layers, self.block_size, heads, dim, self.dtype) + draft

    def determine_num_blocks(self) -> int:
        """KV blocks this worker can hold: ``kv_cache_memory`` on CPU; on CUDA what
        ``gpu_memory_utilization`` leaves after the weights and a profile run of the largest
        step (:meth:`profile_run`)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None or self.device.type != "cuda":
            return num_blocks_for_budget(cache, self.kv_bytes_per_block(),
                                         cache.kv_cache_memory)
        activation_peak = self.profile_run()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = gpu_kv_budget(total, cache.gpu_memory_utilization, weights, activation_peak,
                               max(0, non_torch))
        if self.ctx.world_rank == 0:
            logger.info("kvray: GPU memory %.1f GiB x %.2f: weights %.2f GiB, activations "
                        "%.2f GiB, outside torch %.2f GiB -> KV cache %.2f GiB", total / 2**30,
                        cache.gpu_memory_utilization, weights / 2**30, activation_peak / 2**30,
                        non_torch / 2**30, budget / 2**30)
        gib = 2**30
        breakdown = (f"gpu_memory_utilization {cache.gpu_memory_utilization} x "
                     f"{total / gib:.1f} GiB, less {weights / gib:.2f} GiB of tensors this "
                     f"process holds (the weights, and any other engine's not shut down), "
                     f"{activation_peak / gib:.2f} GiB of activations and "
                     f"{max(0, non_torch) / gib:.2f} GiB outside torch (CUDA context, other "
                     "processes)")
        return num_blocks_for_budget(cache, self.kv_bytes_per_block(), budget, breakdown)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward of the largest step the scheduler may send (``max_num_batched_tokens``
        prompt tokens over up to ``max_num_seqs`` sequences, each one's logits computed) over
        a scratch KV cache, to find the activations' peak; returns its bytes on CUDA (0
        elsewhere: no allocator to ask). Pipeline stages run alone on zero activations;
        tensor-parallel ranks all run it (their all-reduces meet)."""
        sched, bs = self.config.scheduler, self.block_size
        tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        seqs = min(sched.max_num_seqs, tokens)
        rows: list[PagedRow] = []
        num_blocks = 0
        for i in range(seqs):
            n = tokens // seqs + (i < tokens % seqs)
            rows.append(([0] * n, 0, list(range(num_blocks, num_blocks + -(-n // bs)))))
            num_blocks += -(-n // bs)
        _, heads, dim = self._local_kv_shape()
        layer_range = (self.model.model.start_layer, self.model.model.end_layer)
        scratch = CacheEngine(self.spec.num_layers, layer_range, num_blocks, bs, heads, dim,
                              self.dtype, self.device)
        dev = self.device
        _, meta, last = paged_batch(rows, bs, self._to_device, **self.kernels)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        hidden = residual = None
        if not self.ctx.is_first_stage:
            hidden = torch.zeros(tokens, self.spec.hidden_size, dtype=self.dtype, device=dev)
            residual = torch.zeros_like(hidden)
        result = self.model(ids, meta, hidden, residual, kv_caches=scratch.kv_caches)
        if self.ctx.is_last_stage:
            logits = self.model.compute_logits(result[self._to_device(last)])
            torch.softmax(logits.float(), dim=-1)
        peak = 0
        if cuda:
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - before
        del scratch, result, meta
        return peak

    def initialize_cache(self, num_blocks: int) -> None:
        _, heads, dim = self._local_kv_shape()
        layer_range = (self.model.model.start_layer, self.model.model.end_layer)
        graphs = self._decode_graphs_wanted()
        # CUDA graphs pad batches with rows that write to a block of their own, past the
        # ``num_blocks`` the block manager hands out.
        self.cache = CacheEngine(self.spec.num_layers, layer_range, num_blocks + graphs,
                                 self.block_size, heads, dim, self.dtype, self.device)
        self.graphs = None
        if self.drafter is not None:
            self.drafter.initialize_cache(num_blocks + graphs, self.block_size)
        if graphs:
            self._build_decode_graphs(pad_block=num_blocks)

    def _decode_graphs_wanted(self) -> bool:
        """Replay decode steps from CUDA graphs? On CUDA with kernels free of host syncs
        (triton), one worker (collectives stay eager), unless ``enforce_eager``."""
        return (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.attention_backend == "triton" and self.ctx.tp_size == 1
                and self.ctx.pp_size == 1)

    @torch.inference_mode()
    def _build_decode_graphs(self, pad_block: int) -> None:
        sizes = capture_sizes(self.config.scheduler.max_num_seqs,
                              requested=self.config.model.cuda_graph_sizes)
        if not sizes:
            return
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):  # no host sync inside a graph
                module.fix_tables(self.max_model_len, self.device)
        # Only kernels free of host reads may be captured: the PyTorch reference reads the
        # sequence lengths on the host, and a graph would replay the capture's lengths
        # (wrong tokens, seen on an H200). Without them the padded batch runs eagerly.
        capture = self.device.type == "cuda" and self.attention_backend == "triton"
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0] if capture else 0
        self.graphs = DecodeGraphs(
            self.model, self.cache.kv_caches, sizes, -(-self.max_model_len // self.block_size),
            self.block_size, pad_block, self.device, self.decode_kernel, self.write_kernel,
            capture=capture)
        if capture and self.ctx.world_rank == 0:
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("kvray: captured %d CUDA graphs for decode batches of %s rows in "
                        "%.1f s (%.0f MiB)", len(sizes), f"{sizes[0]}..{sizes[-1]}",
                        time.perf_counter() - start, used / 2**20)

    # ---- per-request state --------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for req_id in out.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for new in out.new_requests:
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens,
                list(new.token_ids[new.num_prompt_tokens:]),
                list(new.token_ids[:new.num_prompt_tokens]))
            if new.sampling_params.structured_outputs is not None and self.ctx.is_output_rank:
                # a request back from preemption replays what it generated so far
                state.matcher = self._grammar_compiler(new.sampling_params).compile(
                    new.sampling_params.structured_outputs)
                state.matcher.accept(state.output_token_ids)
            if new.seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator(self.device).manual_seed(new.seed)
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.output_token_ids.extend(cached.new_token_ids)
            if state.matcher is not None:
                state.matcher.accept(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- inputs -------------------------------------------------------------------------
    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat token batch. Attention sees *rows*: a prefill chunk is one row;
        a decode is a one-token row; a request verifying drafts becomes one one-token row
        per token (row j attends to its context plus the first j drafts: causal attention
        over the chunk, run by the decode kernels)."""
        sched = out.num_scheduled_tokens
        rows: list[PagedRow] = []
        req_ids = list(sched)
        sample_rows: list[int] = []
        plan: list[tuple[int, int]] = []  # per request: (its first row, its logits rows)
        for r, req_id in enumerate(req_ids):
            state, n = self.requests[req_id], sched[req_id]
            start = state.num_computed_tokens
            drafts = out.spec_token_ids.get(req_id, [])
            real_end = start + n - len(drafts)  # drafts follow the request's own tokens
            toks = state.token_ids[start:real_end] + drafts
            plan.append((len(rows), len(toks) if drafts else 1))
            if drafts:
                rows.extend(([tok], start + j, state.block_ids) for j, tok in enumerate(toks))
            else:
                rows.append((toks, start, state.block_ids))
            if real_end == len(state.token_ids):
                sample_rows.append(r)
        tokens, meta, row_last_token = paged_batch(rows, self.block_size, self._to_device,
                                                   **self.kernels)
        logits_index: list[int] = []
        first_rows: list[int] = []
        spans: dict[int, list[int]] = {}
        for i, r in enumerate(sample_rows):
            first, count = plan[r]
            first_rows.append(len(logits_index))
            logits_index.extend(row_last_token[first + j] for j in range(count))
            drafts = out.spec_token_ids.get(req_ids[r])
            if drafts:
                spans[i] = drafts
        token_starts = [row_last_token[first] - len(rows[first][0]) + 1 for first, _ in plan]
        return StepInputs(self._to_device(tokens), meta, req_ids, sample_rows,
                          self._to_device(logits_index), first_rows, spans, token_starts)

    def _to_device(self, data: list) -> torch.Tensor:
        """An int64 tensor of ``data`` on this worker's device; on CUDA built in pinned host
        memory and copied without blocking the host (the copy is queued before the kernels
        that read it on the same stream)."""
        host = torch.tensor(data, dtype=torch.int64, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=self.pin_memory)

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on the last pipeline stage's TP rank 0
        (None elsewhere, unless a swap failed here: then an empty output that names the
        requests, for the executor to merge)."""
        self._swap(out)
        result = self._execute(out)
        failed = self.swap_pool.take_failed()
        if failed:
            if result is None:
                result = ModelRunnerOutput([], [], [], [])
            result.failed_swaps = failed
        return result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(out)
        if out.is_empty:
            return ModelRunnerOutput([], [], [], []) if self.ctx.is_output_rank else None
        inputs = self._prepare_inputs(out)
        bitmask = self._start_bitmask(inputs)  # on another thread, while the forward runs
        hidden = self._forward(inputs)
        if hidden is None:
            return None  # not the last pipeline stage: activations went to the next one
        prompt_logprobs = self._prompt_logprobs(inputs, out, hidden)
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        if not self.ctx.is_output_rank:
            return None
        result = self._sample(inputs, logits, prompt_logprobs,
                              bitmask.result() if bitmask is not None else None)
        if self.drafter is not None:
            result.draft_token_ids = self._propose_drafts(out, result)
        return result

    def _propose_drafts(self, out: SchedulerOutput, result: ModelRunnerOutput
                        ) -> dict[str, list[int]]:
        """The draft model's drafts for each request that sampled, as many as the
        scheduler's adaptive length will take (:func:`next_draft_length`, the rule it
        applies too), so that no draft step is wasted."""
        jobs = []
        for req_id, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            if not toks:
                continue
            drafts = out.spec_token_ids.get(req_id)
            if drafts:
                self.drafter.lengths[req_id] = next_draft_length(len(drafts), len(toks) - 1)
            state = self.requests[req_id]
            jobs.append((req_id, state.token_ids + toks, state.block_ids))
        return self.drafter.propose(jobs)

    # ---- structured outputs -------------------------------------------------------------
    def _grammar_compiler(self, params: SamplingParams) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = compiler_for(self.model_path, self.config.model.tokenizer,
                                          self.spec.vocab_size, params.eos_token_ids)
        return self._grammars

    def _start_bitmask(self, inputs: StepInputs) -> Future | None:
        """The next-token masks of the constrained requests that sample this step, one per
        logits row, computed on a helper thread (llguidance works outside the GIL) while
        the forward runs. A request verifying drafts gets a mask per draft position: its
        matcher steps through the drafts and is rolled back after."""
        if not self.ctx.is_output_rank:
            return None
        plain: list[tuple[Matcher, int]] = []
        spec: list[tuple[Matcher, int, list[int]]] = []
        for i, b in enumerate(inputs.sample_rows):
            matcher = self.requests[inputs.req_ids[b]].matcher
            if matcher is None:
                continue
            if i in inputs.spans:
                spec.append((matcher, inputs.first_rows[i], inputs.spans[i]))
            else:
                plain.append((matcher, inputs.first_rows[i]))
        if not plain and not spec:
            return None
        num_rows = inputs.logits_index.shape[0]
        bitmask = torch.full((num_rows, bitmask_width(self.spec.vocab_size)), -1,
                             dtype=torch.int32, pin_memory=self.pin_memory)
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kvray-grammar")
        grammars = self._grammars

        def fill() -> torch.Tensor:
            grammars.fill_bitmask(plain, bitmask)
            for matcher, first, drafts in spec:
                consumed = 0
                for j in range(len(drafts) + 1):
                    row = first + j
                    grammars.fill_bitmask([(matcher, row)], bitmask)
                    if j == len(drafts):
                        break
                    # a draft the grammar refuses is masked out: verification rejects it,
                    # and the rows after it are never used
                    tok = drafts[j]
                    if not (int(bitmask[row, tok // 32]) >> (tok % 32)) & 1 \
                            or not matcher.accept([tok]):
                        break
                    consumed += 1
                if consumed:
                    matcher.rollback(consumed)
            return bitmask

        return self._mask_thread.submit(fill)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        ctx, caches = self.ctx, self.cache.kv_caches
        hidden = residual = None
        if not ctx.is_first_stage:
            shape = (inputs.input_ids.shape[0], self.spec.hidden_size)
            hidden, residual = ctx.recv_from_prev_stage([shape, shape], self.dtype, self.device)
        if self.graphs is not None and \
                inputs.meta.num_decodes == len(inputs.meta.seq_lens_list):
            result = self.graphs.run(inputs.input_ids, inputs.meta)
            if result is not None:
                return result
        result = self.model(inputs.input_ids, inputs.meta, hidden, residual, kv_caches=caches)
        if ctx.is_last_stage:
            return result
        ctx.send_to_next_stage(list(result))
        return None

    def _swap(self, out: SchedulerOutput) -> None:
        """Save preempted requests' blocks before anyone reuses them, then restore the
        requests coming back, then forget copies that are no longer needed."""
        caches = self.cache.kv_caches
        for req_id, block_ids in out.swap_out.items():
            self.swap_pool.save(req_id, caches, block_ids)
        for req_id, block_ids in out.swap_in.items():
            self.swap_pool.restore(req_id, caches, block_ids)
        for req_id in out.swap_drop:
            self.swap_pool.drop(req_id)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, prompt_logprobs: dict,
                bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Sample each request that samples this step: one token from its row, or with
        drafts (speculative decoding) the accepted drafts and one more from its rows."""
        states = [self.requests[inputs.req_ids[b]] for b in inputs.sample_rows]
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]] | None] = {}
        sampled_lp: dict[str, list[float]] = {}
        plain = [i for i in range(len(states)) if i not in inputs.spans]
        if plain:
            rows = [inputs.first_rows[i] for i in plain]
            group = [states[i] for i in plain]
            rows_logits = logits[rows] if len(rows) < logits.shape[0] else logits
            result = None
            if bitmask is None and all(s.params.plain_greedy_after(len(s.output_token_ids))
                                       for s in group):
                # Every row takes its argmax: no sampling batch to build (its seven columns
                # and their checks were ~0.5 ms of a ~19 ms batch-1 step on a 2-core CPU).
                tokens = row_argmax(rows_logits).tolist()
            else:
                batch = SamplingBatch.from_params(
                    [s.params for s in group], [self.generators.get(s.req_id) for s in group],
                    [s.prompt_token_ids for s in group], [s.output_token_ids for s in group],
                    device=self.device,
                    token_bitmask=None if bitmask is None else bitmask[rows])
                result = sample(rows_logits, batch, self.default_generator)
                tokens = result.token_ids.tolist()
            self._collect(group, [[t] for t in tokens], result, list(range(len(group))),
                          sampled, logprobs, sampled_lp)
        if inputs.spans:
            self._sample_spans(inputs, logits, bitmask, states, sampled, logprobs, sampled_lp)
        req_ids = inputs.req_ids
        return ModelRunnerOutput(
            req_ids, [sampled.get(r, []) for r in req_ids], [logprobs.get(r) for r in req_ids],
            [sampled_lp.get(r, []) for r in req_ids], prompt_logprobs)

    def _sample_spans(self, inputs: StepInputs, logits: torch.Tensor,
                      bitmask: torch.Tensor | None, states: list[CachedRequestState],
                      sampled: dict, logprobs: dict, sampled_lp: dict) -> None:
        """Verify the drafts of every request that has some (one batch of all their rows;
        row j of a request sees its outputs plus its first j drafts, for penalties)."""
        rows, params, gens, prompts, outputs, spans, group = [], [], [], [], [], [], []
        for i, drafts in inputs.spans.items():
            state = states[i]
            gen = self.generators.get(state.req_id)
            spans.append(SpecSpan(len(rows), drafts, state.params.is_greedy, gen))
            group.append(state)
            for j in range(len(drafts) + 1):
                rows.append(inputs.first_rows[i] + j)
                params.append(state.params)
                gens.append(gen)
                prompts.append(state.prompt_token_ids)
                outputs.append(state.output_token_ids + drafts[:j])
        batch = SamplingBatch.from_params(
            params, gens, prompts, outputs, device=self.device,
            token_bitmask=None if bitmask is None else bitmask[rows])
        tokens, _, result = sample_speculative(logits[rows], batch, spans,
                                               self.default_generator)
        offsets, at = [], 0
        for toks in tokens:
            offsets.append(at)
            at += len(toks)
        self._collect(group, tokens, result, offsets, sampled, logprobs, sampled_lp)

    @staticmethod
    def _collect(group: list[CachedRequestState], tokens: list[list[int]],
                 result: SamplerOutput | None, offsets: list[int], sampled: dict,
                 logprobs: dict, sampled_lp: dict) -> None:
        """File each request's tokens, and their logprobs (rows ``offsets[i]`` on of
        ``result``) for those that asked."""
        lps = result.logprobs.tolist() if result is not None and result.logprobs is not None \
            else None
        top_ids = result.top_token_ids.tolist() \
            if result is not None and result.top_token_ids is not None else None
        top_lps = result.top_logprobs.tolist() \
            if result is not None and result.top_logprobs is not None else None
        for state, toks, at in zip(group, tokens, offsets, strict=True):
            sampled[state.req_id] = toks
            k = state.params.logprobs
            if k is None or lps is None:
                continue
            sampled_lp[state.req_id] = lps[at:at + len(toks)]
            entries = []
            for j, tok in enumerate(toks):
                top = dict(zip(top_ids[at + j][:k], top_lps[at + j][:k], strict=True)) \
                    if k and top_ids is not None else {}
                entries.append({tok: lps[at + j], **top})
            logprobs[state.req_id] = entries

    def _prompt_logprobs(self, inputs: StepInputs, out: SchedulerOutput, hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list[dict[int, float] | None]]]:
        """For requests asking prompt_logprobs: (index of the first prompt token covered,
        the logprobs of each prompt token this chunk predicts; None for token 0)."""
        result = {}
        starts = inputs.token_starts  # a request with prompt left is one contiguous row
        for b, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            k = state.params.prompt_logprobs
            start = state.num_computed_tokens
            if k is None or start >= state.num_prompt_tokens:
                continue
            end = min(start + out.num_scheduled_tokens[req_id], state.num_prompt_tokens)
            # hidden at position p predicts token p + 1
            rows = torch.arange(starts[b], starts[b] + end - start)
            targets = state.token_ids[start + 1: min(end + 1, state.num_prompt_tokens)]
            rows = rows[: len(targets)]
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            entries: list[dict[int, float] | None] = [None] if start == 0 else []
            top = lp.topk(k, dim=-1) if k else None
            for i, tok in enumerate(targets):
                entry = {tok: float(lp[i, tok])}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
                    entry[tok] = float(lp[i, tok])
                entries.append(entry)
            result[req_id] = (0 if start == 0 else start + 1, entries)
        return result


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
