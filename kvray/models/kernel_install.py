"""Applies a :class:`~kvray.kernels.plan.KernelPlan` to a model: the fused ops, the CPU
linears' routes and packed copies, oneDNN's bf16 layout, huge pages and the fused decode
layer, in that order (huge pages once every copy the kernels read exists)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from kvray.kernels import cpu_ops
from kvray.kernels.huge_pages import move_to_huge_pages
from kvray.kernels.plan import BF16_FUSED_ROWS, KernelPlan, LinearRoutes
from kvray.models.layers import (
    ParallelLMHead,
    SmallMMatmul,
    release_plain_weights,
    use_packed_weights,
    use_prepacked_weights,
    use_small_m_kernel,
)
from kvray.models.llama import (
    LlamaDecoderLayer,
    use_fused_decode_layer,
    use_fused_ops,
)
from kvray.models.quantized import QuantInstall, install_quantized

logger = logging.getLogger("kvray")


@dataclass
class InstalledKernels:
    """What installing a plan added to or freed from the model's weights, in bytes."""

    bf16_copies: int = 0  # the small-M kernel's bf16 copies
    packed: int = 0  # weights packed once for larger batches
    released: int = 0  # plain weights nothing reads any more
    onednn: int | None = None  # oneDNN's bf16 layout (None: not used)
    huge_pages: int = 0  # weights moved onto huge pages
    quantized: QuantInstall = field(default_factory=QuantInstall)

    def log(self) -> None:
        """The lines a target model's install logs (on one rank)."""
        self.quantized.log()
        if self.bf16_copies:
            logger.info("kvray: bf16 copies of the weights for decode steps: %.0f MiB",
                        self.bf16_copies / 2**20)
        if self.packed:
            logger.info("kvray: weights packed for larger batches: %.0f MiB; plain "
                        "copies released: %.0f MiB", self.packed / 2**20, self.released / 2**20)
        if self.onednn is not None:
            logger.info("kvray: weights reordered for oneDNN's bf16 matmuls: %.0f MiB",
                        self.onednn / 2**20)
        self.log_huge_pages()

    def log_huge_pages(self) -> None:
        if self.huge_pages:
            logger.info("kvray: weights on transparent huge pages: %.0f MiB",
                        self.huge_pages / 2**20)


def install_kernel_plan(model: nn.Module, plan: KernelPlan) -> InstalledKernels:
    """Give ``model`` the kernels ``plan`` picked; returns the bytes that moved."""
    done = InstalledKernels(quantized=install_quantized(model, plan))
    if plan.fused_ops is not None:
        use_fused_ops(model, plan.fused_ops)
    if plan.linear_routes is not None:
        done.bf16_copies, done.packed, done.released = use_cpu_linear_kernels(
            model, plan.linear_routes, bf16_weights=plan.bf16_copies)
    if plan.onednn_bf16:
        done.onednn = use_packed_weights(model)
    if plan.huge_pages:
        done.huge_pages = move_to_huge_pages(model)
    # The fused layer reads the blobs without an act-order (GPTQ g_idx) input permutation.
    if plan.fused_decode and not any(getattr(m, "input_perm", None) is not None
                                     for m in model.modules()):
        ops = cpu_ops.load_ops()
        use_fused_decode_layer(model, ops.decode_layer, fused_decode_max_rows(model, plan.dtype),
                               ops.decode_layers, (ops.decode_layer_lora, ops.decode_layers_lora),
                               (ops.decode_layer_moe, ops.decode_layers_moe))
    return done


def use_cpu_linear_kernels(model: nn.Module, routes: LinearRoutes,
                           bf16_weights: bool = False) -> tuple[int, int, int]:
    """The CPU extension's linears for ``model`` (fp32) along ``routes``: the small-M kernel
    for decode-sized inputs, the tiled GEMM for prefill-sized ones; with
    ``routes.prepack_from_rows``, weights packed once for the layers that have an exact bf16
    copy (``bf16_weights``: a bf16 checkpoint), their plain weights then released. Returns
    the bytes of the bf16 copies, of the packed copies and of the plain weights released."""
    bf16 = use_small_m_kernel(model, cpu_ops.linear_small_m, routes.small_m_max_rows,
                              bf16_weights=bf16_weights, large_m_kernel=cpu_ops.linear_tiled,
                              weight_major_max_rows=routes.weight_major_max_rows,
                              lm_head_weight_major_max_rows=routes.lm_head_weight_major_max_rows,
                              large_m_min_rows=routes.large_m_min_rows,
                              lm_head_large_m_min_rows=routes.lm_head_large_m_min_rows)
    if routes.prepack_from_rows is None:
        return bf16, 0, 0
    gate_up = (cpu_ops.pack_gate_up_weight, cpu_ops.linear_packed_gate_up,
               partial(cpu_ops.linear_packed_gate_up, silu_mul=True),
               cpu_ops.load_ops().vector_lanes())  # the build's panels
    packed = use_prepacked_weights(model, cpu_ops.pack_linear_weight, cpu_ops.linear_packed,
                                   routes.prepack_from_rows, gate_up, bf16=routes.bf16_panels)
    return bf16, packed, release_plain_weights(model)


def min_small_m_rows(model: nn.Module) -> int:
    """The fewest rows any decoder linear of ``model`` gives the small-M kernel (the fused
    layer computes every linear with that kernel): ``cpu_ops.small_m_max_rows()``, less
    where packed weights take over earlier."""
    rows = [m.small_m_max_rows for m in model.modules()
            if isinstance(m, SmallMMatmul) and not isinstance(m, ParallelLMHead)
            and m.small_m_kernel is not None]
    return min(rows, default=cpu_ops.small_m_max_rows())


def fused_decode_max_rows(model: nn.Module, dtype: torch.dtype) -> int:
    """Decode batches of ``model`` up to this size take the fused layer. fp32: the small-M
    kernel's range (:func:`min_small_m_rows`), or any size where every decoder linear also
    has its weights packed once (the fused layer takes those past the small-M kernel's rows:
    the same kernels as the Python layer, without the Python between them). bf16:
    :data:`~kvray.kernels.plan.BF16_FUSED_ROWS`. A model with MoE layers: at most the
    small-M kernel's rows (the routing and the experts run on it, and none of its layers
    takes packed weights in the fused call)."""
    decoder = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    if any(layer.is_moe for layer in decoder):
        rows = min(min_small_m_rows(model), cpu_ops.small_m_max_rows())
        return rows if dtype == torch.float32 else min(rows, BF16_FUSED_ROWS)
    layers = [m for m in decoder if m.takes_fused_kernel()]
    if layers and all(m.qweight is not None for layer in layers for m in _linears(layer)):
        return 1 << 30  # the quantized kernel takes any rows, as the Python layer would
    if dtype != torch.float32:
        return BF16_FUSED_ROWS
    if layers and all(layer.decode_args()[0][8:] for layer in layers):
        return 1 << 30
    return min_small_m_rows(model)


def _linears(layer: LlamaDecoderLayer) -> tuple[SmallMMatmul, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)
