"""Which kernels a model runs with: decided once per model, before its first step.

:func:`choose_kernel_plan` turns the device, the model's dtype, the checkpoint's dtype,
the tensor-parallel size and ``attention_backend`` into a :class:`KernelPlan`: the paged
attention kernels, the fused elementwise ops, how CPU linears are routed by input rows,
whether weights get oneDNN or huge-page copies and whether small decode batches run a whole
layer in one C++ call. It is plain data (no model in sight); :mod:`kvray.models.kernel_install`
applies it to a model. The numbers behind each cut are in docs/design.md ("CPU kernels").
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from kvray.kernels import cpu_ops

logger = logging.getLogger("kvray")

# Past this many rows F.linear is as fast as the weight-major GEMM (W x^T)^T on the
# decoder's shapes, and the transpose back costs more the more rows there are.
WEIGHT_MAJOR_MAX_ROWS = 64
# From this many rows a bf16 checkpoint's fp32 linears read weights packed once instead of
# the small-M kernel's bf16 copies: the packed kernel's time grows more slowly with the rows,
# and with AVX2 its bf16 panels beat the small-M kernel from a few rows on.
AVX512_PACKED_FROM_ROWS = 24
AVX2_PACKED_FROM_ROWS = 3
# A bf16 model's decode batches of up to this many rows take the fused C++ layer; past it
# oneDNN's packed bf16 matmuls (AMX where the CPU has it) win by more than fusing saves.
BF16_FUSED_ROWS = 4
UNLIMITED_ROWS = 1 << 62


@dataclass(frozen=True)
class LinearRoutes:
    """How an fp32 model's CPU linears split their inputs by rows (see
    :class:`kvray.models.layers.SmallMMatmul`): the small-M kernel up to
    ``small_m_max_rows``, then the weight-major GEMM, then the tiled GEMM or F.linear; with
    ``prepack_from_rows``, layers that have an exact bf16 copy take every input of at least
    that many rows through weights packed once (bf16 panels with ``bf16_panels``)."""

    lanes: int  # fp32 lanes of the built kernels' vectors
    small_m_max_rows: int
    weight_major_max_rows: int = WEIGHT_MAJOR_MAX_ROWS
    lm_head_weight_major_max_rows: int = UNLIMITED_ROWS
    large_m_min_rows: int = 0
    lm_head_large_m_min_rows: int = 0
    prepack_from_rows: int | None = None
    bf16_panels: bool = False


def linear_routes(lanes: int, small_m_max_rows: int) -> LinearRoutes:
    """The routes for kernels built with ``lanes`` fp32 lanes. 16 (AVX-512): MKL's sgemm
    (F.linear) is fast there, so no weight-major route, the tiled GEMM only past 64 rows
    and never for the LM head. 8 (AVX2): the weight-major sgemm up to 64 rows (any number
    for the LM head), the tiled GEMM past it. Both pack weights once; other builds do not."""
    if lanes >= 16:
        return LinearRoutes(lanes, small_m_max_rows, weight_major_max_rows=0,
                            lm_head_weight_major_max_rows=0,
                            large_m_min_rows=WEIGHT_MAJOR_MAX_ROWS + 1,
                            lm_head_large_m_min_rows=UNLIMITED_ROWS,
                            prepack_from_rows=AVX512_PACKED_FROM_ROWS)
    if lanes == 8:
        return LinearRoutes(lanes, small_m_max_rows, prepack_from_rows=AVX2_PACKED_FROM_ROWS,
                            bf16_panels=True)
    return LinearRoutes(lanes, small_m_max_rows)


def cpu_linear_routes() -> LinearRoutes:
    """:func:`linear_routes` for this process's build of the CPU kernels."""
    return linear_routes(cpu_ops.vector_lanes(), cpu_ops.small_m_max_rows())


@dataclass(frozen=True)
class KernelPlan:
    """The kernels one model runs with (see the module docstring)."""

    device_type: str
    dtype: torch.dtype
    attention_backend: str  # "cpu", "triton" or "torch"
    cpu_kernels: bool  # kvray's C++ extension is built here
    decode_kernel: Callable | None = None  # None: the PyTorch reference
    write_kernel: Callable | None = None
    prefill_kernel: Callable | None = None
    fused_ops: ModuleType | None = None  # rms_norm / rotary_inplace / silu_and_mul
    linear_routes: LinearRoutes | None = None  # CPU linear kernels (fp32 models)
    bf16_copies: bool = False  # a bf16 checkpoint run in fp32: exact bf16 copies to read
    onednn_bf16: bool = False  # bf16 weights reordered once for oneDNN's matmuls
    huge_pages: bool = False  # weights copied onto transparent huge pages
    fused_decode: bool = False  # small decode batches run each layer as one C++ call
    # What reads quantized weights: "cpu" (the C++ kernels), "triton", or "dense" (none
    # here: they are dequantized to ``dtype`` at start-up)
    quant_backend: str = "dense"

    @property
    def kernels(self) -> dict:
        """The attention kernels, as :class:`~kvray.kernels.attention.AttentionMetadata`
        names them; the C++ and Triton kernels and the PyTorch references take Gemma 2's
        score cap."""
        return dict(decode_kernel=self.decode_kernel, write_kernel=self.write_kernel,
                    prefill_kernel=self.prefill_kernel,
                    kernels_take_softcap=self.attention_backend in ("cpu", "torch", "triton"))

    def for_draft(self) -> KernelPlan:
        """The plan for a draft model beside this one: on one rank, without bf16 copies,
        and nothing but the fused ops with Triton or without the CPU extension."""
        if self.attention_backend == "triton" or not (self.device_type == "cpu"
                                                      and self.cpu_kernels):
            return dataclasses.replace(self, linear_routes=None, bf16_copies=False,
                                       onednn_bf16=False, huge_pages=False,
                                       fused_decode=False)
        return dataclasses.replace(self, bf16_copies=False,
                                   fused_decode=_fused_decode_fits(self.attention_backend,
                                                                   1, self.dtype))

    def describe(self) -> str:
        """One line naming what the plan picked."""
        parts = [f"attention {self.attention_backend}"]
        if self.fused_ops is not None:
            parts.append(f"fused ops {self.fused_ops.__name__.rsplit('.', 1)[-1]}")
        routes = self.linear_routes
        if routes is not None:
            packed = ("" if routes.prepack_from_rows is None or not self.bf16_copies
                      else f", packed from {routes.prepack_from_rows} rows")
            parts.append(f"linears: {routes.lanes}-lane kernels, small-M up to "
                         f"{routes.small_m_max_rows} rows{packed}")
        parts += [name for name, on in (("oneDNN bf16 weights", self.onednn_bf16),
                                        ("huge pages", self.huge_pages),
                                        ("fused decode layer", self.fused_decode)) if on]
        return "; ".join(parts)


def choose_kernel_plan(requested: str, device: torch.device, dtype: torch.dtype,
                       checkpoint_dtype: str | None, tp_size: int) -> KernelPlan:
    """The plan for a model of ``dtype`` (from a ``checkpoint_dtype`` checkpoint) split
    over ``tp_size`` ranks on ``device``, with ``attention_backend = requested``; an
    impossible backend is an error that names the setting."""
    on_cpu = device.type == "cpu"
    cpu_kernels = on_cpu and cpu_ops.load_ops() is not None
    backend = _attention_backend(requested, device, dtype, cpu_kernels)
    fused_ops = cpu_ops if cpu_kernels else None
    attention: dict = {}
    if backend == "cpu":
        attention = dict(decode_kernel=cpu_ops.paged_decode, write_kernel=cpu_ops.write_kv,
                         prefill_kernel=cpu_ops.paged_prefill)
    elif backend == "triton":
        from kvray.kernels import triton_attention, triton_ops

        fused_ops = triton_ops
        attention = dict(decode_kernel=triton_attention.paged_decode,
                         write_kernel=triton_attention.write_kv,
                         prefill_kernel=triton_attention.paged_prefill)
    return KernelPlan(
        device.type, dtype, backend, cpu_kernels, **attention, fused_ops=fused_ops,
        linear_routes=cpu_linear_routes() if cpu_kernels and dtype == torch.float32 else None,
        bf16_copies=checkpoint_dtype == "bfloat16",
        onednn_bf16=on_cpu and dtype == torch.bfloat16 and packed_weights_supported(),
        huge_pages=on_cpu, fused_decode=_fused_decode_fits(backend, tp_size, dtype),
        quant_backend=_quant_backend(device, backend, cpu_kernels))


def _quant_backend(device: torch.device, attention: str, cpu_kernels: bool) -> str:
    """What reads quantized weights on ``device``: kvray's C++ kernels on CPU, the Triton
    kernels where attention runs in Triton on a GPU, else nothing (dequantized)."""
    if device.type == "cpu":
        return "cpu" if cpu_kernels else "dense"
    return "triton" if attention == "triton" else "dense"


def _attention_backend(requested: str, device: torch.device, dtype: torch.dtype,
                       cpu_kernels: bool) -> str:
    """``auto``: the C++ kernels on CPU, Triton on CUDA once it passes its self-check,
    else the PyTorch reference; a named backend is checked to be possible here."""
    on_cpu = device.type == "cpu"
    if requested == "auto":
        if not on_cpu and triton_available() and triton_works(device, dtype):
            return "triton"
        return "cpu" if cpu_kernels else "torch"
    if requested == "cpu" and not cpu_kernels:
        raise ValueError(
            f"attention_backend='cpu' needs kvray's C++ kernels on a CPU device "
            f"(device here: {device.type}; kernels built: "
            f"{cpu_ops.load_ops() is not None}); use 'auto' or 'torch'")
    if requested == "triton":
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU runs in Triton's interpreter only: "
                "set TRITON_INTERPRET=1 before starting kvray (slow; meant for tests)")
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the `triton` package "
                             "(pip install triton)")
    return requested


def _fused_decode_fits(backend: str, tp_size: int, dtype: torch.dtype) -> bool:
    """Whether small decode batches can run each layer as one C++ call: the CPU kernels'
    attention, fp32 or bf16 weights (the layer computes on fp32 activations either way)
    and one tensor-parallel rank (no all-reduce inside a layer)."""
    return backend == "cpu" and tp_size == 1 and dtype in (torch.float32, torch.bfloat16)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def triton_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels compile and agree with the reference here; by default
    kvray trusts them only then (else the PyTorch reference, with a warning)."""
    try:
        from kvray.kernels import triton_attention, triton_ops

        triton_attention.self_check(device, dtype)
        triton_ops.self_check(device, dtype)
        return True
    except Exception as err:  # noqa: BLE001 - any failure means: do not use them
        logger.warning("kvray: Triton kernels failed their check on %s (%s); "
                       "using the PyTorch reference", device, err)
        return False


def packed_weights_supported() -> bool:
    """Whether this PyTorch build runs bf16 matmuls on oneDNN's packed weights here."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
