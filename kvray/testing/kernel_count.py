"""Kernel launches per decoder layer, counted on CPU: what a decode step of the Triton path
would launch on a GPU, with and without the fused kernels.

:func:`count_launches` counts each Triton kernel launch (``kernel[grid](...)`` of the
``*_kernel`` functions of kvray's Triton modules) and each PyTorch op that would be a GPU
kernel (views and allocations are not). Triton's interpreter (``TRITON_INTERPRET=1``) runs
the kernels on CPU; what it does inside a launch is not counted. :func:`decode_layer_launches`
runs one decoder layer of a tiny random Llama through a decode step that way: what a CUDA
graph of the step would hold for that layer (the profiler counts the same on a GPU:
``benchmarks/gpu_bench.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TRITON_MODULES = ("kvray.kernels.triton_kv", "kvray.kernels.triton_attention",
                  "kvray.kernels.triton_ops", "kvray.kernels.triton_quant")
# ops that launch nothing on a GPU: allocations and metadata
_NO_KERNEL = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
              "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::is_same_size"}


@dataclass
class LaunchCount:
    """Launches by kernel (Triton) and by op (PyTorch)."""

    triton: Counter = field(default_factory=Counter)
    torch: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values())

    def describe(self) -> str:
        """One line: the total, then each kernel and op with its count."""
        parts = [f"{name} x{n}" for name, n in (self.triton + self.torch).items()]
        return f"{self.total} launches: " + ", ".join(parts)


class _TorchOps(TorchDispatchMode):
    """Counts the PyTorch ops that would launch a kernel, except while ``paused``."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func._schema.name not in _NO_KERNEL \
                and (not func.is_view or not _aliases(out, args)):
            self.counts[func._schema.name.removeprefix("aten::")] += 1
        return out


def _aliases(out, args) -> bool:
    """Whether a view-like op's output shares its input's memory (``to`` copies when the
    dtype changes, ``reshape`` when the strides do not allow a view)."""
    if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return True
    return out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()


class _CountedKernel:
    """A Triton kernel whose ``[grid](...)`` launches are counted."""

    def __init__(self, kernel, name: str, count: LaunchCount, ops: _TorchOps) -> None:
        self.kernel, self.name, self.count, self.ops = kernel, name, count, ops

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.count.triton[self.name] += 1
            self.ops.paused = True  # the interpreter's own tensor work is no GPU kernel
            try:
                return launch(*args, **kwargs)
            finally:
                self.ops.paused = False

        return run


@contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Count the kernel launches inside the ``with`` block (see the module docstring)."""
    count = LaunchCount()
    ops = _TorchOps(count.torch)
    patched = []
    for module_name in TRITON_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                patched.append((module, name, obj))
                setattr(module, name, _CountedKernel(obj, name.strip("_"), count, ops))
    try:
        with ops:
            yield count
    finally:
        for module, name, obj in patched:
            setattr(module, name, obj)


def tiny_llama(num_layers: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0,
               quantization: str | None = None):
    """A random Llama (hidden 64, 4 query / 2 KV heads of 16, MLP 96) on CPU with the Triton
    kernels installed as on a GPU (needs ``TRITON_INTERPRET=1``); ``quantization`` (``fp8``,
    ``int8``) quantizes its linears online, read by the Triton GEMMs."""
    import transformers

    from kvray.kernels.plan import choose_kernel_plan
    from kvray.models.kernel_install import install_kernel_plan
    from kvray.models.loader import build_model
    from kvray.models.quantized import quantize_online
    from kvray.models.spec import ModelSpec
    from kvray.parallel import ParallelContext

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = build_model(ModelSpec.from_hf_config(config), ParallelContext(), dtype, 512)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    if quantization is not None:
        quantize_online(model, quantization, torch.device("cpu"))
    # the GPU's plan: no CPU linear kernels (each linear one GEMM launch, F.linear here)
    plan = dataclasses.replace(choose_kernel_plan("triton", torch.device("cpu"), dtype, None, 1),
                               linear_routes=None, onednn_bf16=False, huge_pages=False,
                               quant_backend="triton")
    install_kernel_plan(model, plan)
    return model, plan


def unfuse(model: torch.nn.Module) -> None:
    """Take the fused rotary + KV write and norm + FP8 quantization out of ``model``: the
    separate kernels they replace run instead."""
    for module in model.modules():
        if hasattr(module, "fused_write"):
            module.fused_write = None
        if hasattr(module, "fused_fp8"):
            module.fused_fp8 = None


def decode_layer_launches(model: torch.nn.Module, plan, context_len: int, batch: int = 2,
                          table_blocks: int | None = None, block_size: int = 16
                          ) -> tuple[LaunchCount, tuple[torch.Tensor, ...]]:
    """The launches of ``model``'s second decoder layer (residual in, as every layer but
    the first) in a decode step of ``batch`` sequences of ``context_len`` tokens, their
    block tables ``table_blocks`` wide (a CUDA graph's are as wide as the longest context
    the engine allows), and what the layer computed: (hidden, residual, KV cache)."""
    from kvray.kernels.attention import paged_batch

    spec = model.spec
    need = -(-context_len // block_size)
    width = max(table_blocks or need, need)
    cache = torch.zeros(2, spec.num_kv_heads, batch * width + 1, block_size, spec.head_dim,
                        dtype=plan.dtype)
    rows = [([1], context_len - 1, list(range(b * width, (b + 1) * width)))
            for b in range(batch)]
    _, meta, _ = paged_batch(rows, block_size, torch.tensor, **plan.kernels)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch, spec.hidden_size, generator=g).to(plan.dtype)
    residual = torch.randn(batch, spec.hidden_size, generator=g).to(plan.dtype)
    layer = model.model.layers[1]
    layer.self_attn.rotary.tables(meta.positions)  # grown once per step, not per layer
    with torch.inference_mode(), count_launches() as count:
        hidden, residual = layer(hidden, residual, meta, cache)
    return count, (hidden, residual, cache)
