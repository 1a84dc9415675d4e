"""LoRA on a worker: adapter slots in every target linear of its shard of the model.

:class:`LoRAModel` gives each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``
and ``down_proj`` (dense MLPs; not MoE experts, embeddings or the LM head) a
:class:`LoRAWeights`: ``max_loras`` slots of stacked A / B^T tensors
(:mod:`kvray.kernels.lora`). The engine decides which adapter sits in which slot and sends
the adapter's weights when a slot changes hands (:meth:`LoRAModel.load`); every step the
model runner sets the slot of each token row on the shared :class:`LoRABatch`, which the
layers read in their forward.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvray.kernels.lora import blocked_shape, lora_add_reference, unblock
from kvray.lora.adapter import MODULES

_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(MODULES) + r")$")

LoRAKernel = Callable[..., torch.Tensor]  # cpu_ops.lora_add / lora_add_reference


@dataclass
class LoRABatch:
    """The step's adapter slot of each token row (int64 [T], -1: the base model), or None
    when no row of the step has an adapter (then the layers skip LoRA entirely)."""

    row_slots: torch.Tensor | None = None


class LoRAWeights:
    """One linear layer's adapter slots on this rank (see :mod:`kvray.kernels.lora`)."""

    def __init__(self, batch: LoRABatch, slices: list[int], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 kernel: LoRAKernel) -> None:
        self.batch = batch
        self.slice_starts = [0]
        for size in slices:
            self.slice_starts.append(self.slice_starts[-1] + size)
        self.a = torch.zeros(max_loras, len(slices), max_rank, in_features, dtype=dtype,
                             device=device)
        self.bt = torch.zeros(max_loras, *blocked_shape(self.slice_starts[-1], max_rank),
                              dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, len(slices), dtype=torch.int64, device=device)
        self.kernel = kernel

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.bt))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot].zero_()

    def set(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice ``index`` of ``slot`` holds A [r, in] and the scaled B [out, r]."""
        r = a.shape[0]
        lo, hi = self.slice_starts[index], self.slice_starts[index + 1]
        self.a[slot, index, :r].copy_(a)
        blocks, rank, width = self.bt.shape[1:]
        plain = unblock(self.bt[slot], blocks * width).clone()  # [max_rank, blocks * 64]
        plain[:r, lo:hi] = b.t()
        self.bt[slot].copy_(plain.reshape(rank, blocks, width).transpose(0, 1))
        self.ranks[slot, index] = r

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` += each row's adapter delta, in place."""
        if x.dim() != 2:
            x, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            self.kernel(y2, x, self.a, self.bt, self.ranks, self.slice_starts,
                        self.batch.row_slots)
            return y
        return self.kernel(y, x, self.a, self.bt, self.ranks, self.slice_starts,
                           self.batch.row_slots)


class LoRAModel:
    """The LoRA slots of one worker's model: its target layers, by (layer, module)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernel: LoRAKernel) -> None:
        self.batch = LoRABatch()
        self.max_loras = max_loras
        self.layers: dict[tuple[int, str], nn.Module] = {}
        for name, module in model.named_modules():
            m = _MODULE_RE.match(name)
            if m is None or not hasattr(module, "lora_slices"):
                continue
            module.lora = LoRAWeights(self.batch, module.lora_slices(), module.in_size,
                                      max_loras, max_rank, dtype, device, kernel)
            self.layers[(int(m.group(1)), m.group(2))] = module

    @property
    def num_bytes(self) -> int:
        return sum(m.lora.num_bytes for m in self.layers.values())

    def load(self, slot: int,
             weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]
             ) -> None:
        """Put an adapter (its :attr:`kvray.lora.adapter.LoRAAdapter.weights`) in ``slot``:
        this rank's shard of each pair whose layer is on this stage."""
        for module in self.layers.values():
            module.lora.clear(slot)
        for key, slices in weights.items():
            module = self.layers.get(key)
            if module is None:
                continue  # another pipeline stage's layer
            for index, (a, b) in slices.items():
                a_local, b_local = module.lora_shard(index, a, b)
                module.lora.set(slot, index, a_local, b_local)

    def set_rows(self, row_slots: list[int] | None, to_device: Callable[[list], torch.Tensor]
                 ) -> None:
        """This step's slot per token row; None (or no row with an adapter): none."""
        if row_slots is None or all(s < 0 for s in row_slots):
            self.batch.row_slots = None
        else:
            self.batch.row_slots = to_device(row_slots)


def lora_kernel(device: torch.device, reference: bool = False) -> LoRAKernel:
    """The batched-LoRA kernel for ``device``: Triton's on CUDA, the C++ one on CPU where it
    builds (unless ``reference``: the model runs PyTorch's reference kernels), else the
    PyTorch one."""
    if device.type == "cuda" and not reference:
        try:
            from kvray.kernels import triton_lora
        except ImportError:  # a CUDA torch without Triton
            return lora_add_reference
        return triton_lora.lora_add
    if device.type == "cpu" and not reference:
        from kvray.kernels import cpu_ops

        if cpu_ops.load_ops() is not None:
            def kernel(y, x, a, bt, ranks, starts, rows):
                if x.dtype in (torch.float32, torch.bfloat16) and a.dtype in (
                        torch.float32, torch.bfloat16):
                    return cpu_ops.lora_add(y, x, a, bt, ranks, starts, rows)
                return lora_add_reference(y, x, a, bt, ranks, starts, rows)
            return kernel
    return lora_add_reference


def resolve_lora_dtype(name: str, model: nn.Module, compute_dtype: torch.dtype,
                       checkpoint_dtype: str | None) -> torch.dtype:
    """The adapter slots' dtype: ``lora_dtype`` when set; for ``auto`` the model's weights':
    a bf16/fp16 model's own dtype, bf16 for a bf16 checkpoint run in fp32 or a quantized
    one, else fp32 (PEFT's own precision)."""
    if name != "auto":
        return getattr(torch, name)
    if compute_dtype in (torch.bfloat16, torch.float16):
        return compute_dtype
    quantized = any(getattr(m, "is_quantized", False) for m in model.modules())
    return torch.bfloat16 if quantized or checkpoint_dtype == "bfloat16" else torch.float32
