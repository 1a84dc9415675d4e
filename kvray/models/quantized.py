"""Quantized weights in a model: assembled at load, quantized online, given their kernels.

A checkpoint's quantized tensors reach the layers' weight loaders as
:class:`~kvray.quant.tensor.QuantTensor` pieces (a TP shard of a projection; the Q, K and V
of a fused QKV). :func:`assemble_quantized` stacks each layer's pieces into its ``quant``
once every tensor is loaded; ``quantization: int8`` (or ``fp8`` on a GPU) quantizes a dense
checkpoint's linears the same way (:func:`quantize_online`). :func:`install_quantized`
then picks what reads them, as the :class:`~kvray.kernels.plan.KernelPlan` says: on CPU
the C++ kernels on one blob per layer (int8 dot products on activations quantized per
block of 32, llama.cpp's scheme), on CUDA the Triton kernels on the segments, elsewhere
(or for a kind no kernel reads) the weights dequantized to the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from kvray.kernels.plan import KernelPlan
from kvray.models.layers import SmallMMatmul, VocabParallelEmbedding
from kvray.models.moe import MoEExperts
from kvray.quant.blob import to_blob
from kvray.quant.fp8 import Fp8Rows
from kvray.quant.tensor import QuantKind, QuantTensor

logger = logging.getLogger("kvray")

QUANTIZATION_METHODS = ("none", "int8", "fp8")
# vLLM's names for the format a checkpoint is stored in: accepted when it is stored so (the
# same as null then), an error naming both otherwise, so a vLLM command line carries over
CHECKPOINT_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "gguf")
_CPU_KINDS = {QuantKind.U4, QuantKind.U5, QuantKind.U6, QuantKind.S8}


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding a quantized weight (linears, embeddings, LM head)."""
    return [m for m in model.modules()
            if isinstance(m, (SmallMMatmul, VocabParallelEmbedding))
            and (m.quant is not None or m.qweight is not None)]


def _holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Modules by the id of the weight Parameter they hold (a tied LM head shares the
    embedding's)."""
    out: dict[int, list[nn.Module]] = defaultdict(list)
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is not None and isinstance(m, (SmallMMatmul, VocabParallelEmbedding)):
            out[id(w)].append(m)
    return out


def _set_quant(holders: list[nn.Module], qt: QuantTensor) -> None:
    """Give every module sharing one weight the quantized matrix; their dense weight
    becomes one empty Parameter (still shared, so the tie survives)."""
    old = holders[0].weight
    empty = nn.Parameter(old.new_empty(0), requires_grad=False)
    for m in holders:
        m.quant, m.weight = qt, empty
        if isinstance(m, SmallMMatmul):  # correct (if slow) until install_quantized
            m.out_features, m.quant_matmul = qt.shape[0], _reference_matmul
        if isinstance(m, VocabParallelEmbedding):
            m.quant_lookup = _segments_lookup


def assemble_quantized(model: nn.Module) -> None:
    """Stack the quantized pieces each layer's loaders kept into its ``quant``. A layer that
    got dense and quantized pieces (a GGUF with one projection of a fused QKV in F16) holds
    them all dense instead, dequantized into its weight."""
    holders = _holders(model)
    for module in list(model.modules()):
        if isinstance(module, MoEExperts):
            module.assemble_quantized()
            continue
        pieces: dict[int, QuantTensor] | None = module.__dict__.pop("quant_pieces", None)
        dense = module.__dict__.pop("dense_loaded", False)
        if not pieces:
            continue
        weight = module.weight
        if dense:
            for row, piece in pieces.items():
                weight.data.narrow(0, row, piece.shape[0]).copy_(piece.dequantize(weight.dtype))
            continue
        rows = sum(p.shape[0] for p in pieces.values())
        if rows != weight.shape[0]:
            raise ValueError(f"quantized pieces hold {rows} of {weight.shape[0]} rows")
        qt = QuantTensor.cat_rows([pieces[r] for r in sorted(pieces)])
        _set_quant(holders[id(weight)], qt)


def quantize_online(model: nn.Module, method: str, device: torch.device) -> int:
    """Quantize ``model``'s dense linears and LM head (and a tied embedding with it) as
    ``method`` says: ``int8`` weight-only int8 with per-channel scales; ``fp8`` e4m3 with
    per-channel scales (GPU). Layers already quantized by the checkpoint stay as they are.
    Returns the number of weights quantized."""
    if method == "int8":
        from kvray.quant.online import quantize_int8 as quantize
    elif method == "fp8":
        from kvray.quant.fp8 import quantize_fp8 as quantize
    else:
        raise ValueError(f"quantization = {method!r}: not an online method (int8, fp8)")
    done = 0
    for holders in _holders(model).values():
        lead = holders[0]
        if lead.quant is not None or not lead.weight.numel():
            continue
        if not any(isinstance(m, SmallMMatmul) for m in holders):
            continue  # an embedding that is not also the LM head: a lookup, kept dense
        qt = quantize(lead.weight.detach().to("cpu", torch.float32))
        _set_quant(holders, qt)
        done += 1
    for module in model.modules():  # MoE experts, one matrix pair per local expert
        if isinstance(module, MoEExperts) and module.quantize_experts(quantize):
            done += 2 * module.num_local
    return done


@dataclass
class QuantInstall:
    """What :func:`install_quantized` did, for the start-up log."""

    backend: str = ""
    layers: int = 0
    bytes_held: int = 0
    dequantized: int = 0  # layers whose kind no kernel here reads
    sources: Counter = field(default_factory=Counter)

    def report(self) -> dict:
        """Tensors held quantized, their bytes, their kinds (counts), and how many were
        dequantized (no kernel here reads their kind): zeros for a dense model."""
        return {"tensors": self.layers, "bytes": self.bytes_held,
                "kinds": dict(self.sources), "dequantized": self.dequantized}

    def log(self) -> None:
        if not self.layers:
            return
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.sources.items()))
        logger.info("kvray: quantized weights: %d tensors (%s), %.1f MiB, read by %s%s",
                    self.layers, kinds, self.bytes_held / 2**20, self.backend,
                    f"; {self.dequantized} dequantized (no kernel for their kind here)"
                    if self.dequantized else "")


def install_quantized(model: nn.Module, plan: KernelPlan) -> QuantInstall:
    """Give every quantized layer of ``model`` the kernel ``plan.quant_backend`` names."""
    done = QuantInstall(backend=plan.quant_backend)
    seen: dict[int, tuple] = {}  # id(QuantTensor) -> what its first holder got (ties)
    for module in quantized_modules(model):
        qt = module.quant
        if qt is None:
            continue
        key = id(qt)
        if key not in seen:
            seen[key] = _prepare(qt, plan)
            done.layers += 1
            done.sources[qt.source or "quantized"] += 1
            if seen[key][0] == "dense":
                done.dequantized += 1
            elif seen[key][0] == "blob":
                done.bytes_held += seen[key][1][0].numel()
            else:
                done.bytes_held += seen[key][1].nbytes
        kind, payload = seen[key]
        if kind == "dense":
            module.quant = None
            module.weight = payload
        elif kind == "blob":
            module.quant, module.qweight = None, payload[0]
            module.input_perm = payload[1]
        else:
            module.quant = payload
        _bind(module, kind, plan)
    for module in model.modules():
        if isinstance(module, MoEExperts) and module.quant is not None:
            _install_experts(module, plan, done)
    return done


def _install_experts(module: MoEExperts, plan: KernelPlan, done: QuantInstall) -> None:
    """Give a MoE layer's quantized experts what reads them (as :func:`_prepare` does for a
    linear), or dequantize them into its dense weights where nothing here does."""
    mats = [q for pair in module.quant for q in pair]
    done.layers += len(mats)
    for q in mats:
        done.sources[q.source or "quantized"] += 1
    readers = {_reader(q, plan) for q in mats}
    if len(readers) == 1 and readers != {"dense"}:
        module.quant = [[_prepare(q, plan)[1] for q in pair] for pair in module.quant]
        module.quant_kind = readers.pop()
    else:
        w13 = torch.stack([pair[0].dequantize(plan.dtype) for pair in module.quant])
        w2 = torch.stack([pair[1].dequantize(plan.dtype) for pair in module.quant])
        module.w13_weight.data = w13.to(plan.device_type)
        module.w2_weight.data = w2.to(plan.device_type)
        module.quant, module.quant_kind = None, ""
        done.dequantized += len(mats)
        return
    done.bytes_held += module.held_bytes()


def _reader(qt: QuantTensor, plan: KernelPlan) -> str:
    """What reads ``qt`` here: ``"blob"`` (the CPU kernels, for the kinds they take),
    ``"segments"`` (Triton) or ``"dense"`` (its values dequantized to the model dtype)."""
    if plan.quant_backend == "cpu" and set(qt.kinds) <= _CPU_KINDS:
        return "blob"
    return "segments" if plan.quant_backend == "triton" else "dense"


def _prepare(qt: QuantTensor, plan: KernelPlan) -> tuple:
    """(reader, what it reads): the blob and the input permutation, the segments on the
    device, or the dense weight."""
    kind = _reader(qt, plan)
    if kind == "blob":
        return kind, (to_blob(qt), qt.input_perm)
    if kind == "segments":  # U5/U6, code offsets and two-level scales as the kernels read
        return kind, qt.basic().to(plan.device_type)
    dense = qt.dequantize(plan.dtype).to(plan.device_type)
    return kind, nn.Parameter(dense, requires_grad=False)


def _bind(module: nn.Module, kind: str, plan: KernelPlan) -> None:
    if kind == "dense":
        if isinstance(module, SmallMMatmul):
            module.quant_matmul = None
        if isinstance(module, VocabParallelEmbedding):
            module.quant_lookup = None
        return
    if isinstance(module, SmallMMatmul):
        module.quant_matmul = _cpu_matmul if kind == "blob" else _triton_matmul
        module.takes_fp8_rows = kind == "segments" and _takes_fp8_rows(module.quant, plan)
    if isinstance(module, VocabParallelEmbedding):
        module.quant_lookup = _cpu_lookup if kind == "blob" else _segments_lookup


def _takes_fp8_rows(qt: QuantTensor, plan: KernelPlan) -> bool:
    from kvray.kernels import triton_quant

    return triton_quant.takes_fp8_rows(qt, torch.device(plan.device_type), plan.dtype)


def _cpu_matmul(module: SmallMMatmul, x: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    """x W^T (+ b) by the C++ kernel on the module's blob (:func:`cpu_ops.quantized_linear`)."""
    from kvray.kernels import cpu_ops

    return cpu_ops.quantized_linear(x, module.qweight, bias, getattr(module, "input_perm", None))


def _cpu_lookup(module: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
    from kvray.kernels import cpu_ops

    flat = cpu_ops.embedding_q(module.qweight, ids.reshape(-1).to(torch.int64))
    return flat.to(module.weight.dtype).view(*ids.shape, flat.shape[-1])


def _triton_matmul(module: SmallMMatmul, x: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    from kvray.kernels import triton_quant

    if isinstance(x, Fp8Rows):  # quantized by the norm before
        return triton_quant.linear_quant(x, module.quant, bias)
    shape = x.shape
    y = triton_quant.linear_quant(x.reshape(-1, shape[-1]), module.quant, bias)
    return y.view(*shape[:-1], y.shape[-1])


def _reference_matmul(module: SmallMMatmul, x: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """x W^T (+ b) on the weight dequantized for this call: the reference a model has
    between loading and :func:`install_quantized`."""
    w = module.quant.dequantize(x.dtype).to(x.device)
    return torch.nn.functional.linear(x, w, bias)


def _segments_lookup(module: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
    rows = module.quant.rows(ids.reshape(-1))
    return rows.to(module.weight.dtype).view(*ids.shape, rows.shape[-1])
