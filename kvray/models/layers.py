"""Tensor-parallel building blocks: linears, vocab-parallel embedding and LM head.

Each parameter carries a ``weight_loader(param, full_tensor, shard_id=None)`` that
copies this rank's slice out of the full checkpoint tensor, so a rank never keeps
more than its shard. With ``tp_size == 1`` every slice is the whole tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvray.kernels.huge_pages import return_freed_heap
from kvray.kernels.plan import UNLIMITED_ROWS, WEIGHT_MAJOR_MAX_ROWS
from kvray.parallel import ParallelContext
from kvray.quant.tensor import QuantTensor


def _check_shape(param: nn.Parameter, shard: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(shard.shape):
        raise ValueError(
            f"{what}: checkpoint slice has shape {tuple(shard.shape)}, "
            f"model expects {tuple(param.shape)}"
        )


def _check_full(loaded: torch.Tensor | QuantTensor, dim: int, expected: int,
                what: str) -> None:
    """A checkpoint tensor's whole ``dim`` (before this rank takes its slice) is what the
    config says: a larger one would otherwise be cut to fit, silently."""
    if loaded.shape[dim] != expected:
        raise ValueError(f"{what}: the checkpoint's tensor has shape "
                         f"{tuple(loaded.shape)}, the model's config makes dimension {dim} "
                         f"{expected}")


def split_evenly(size: int, parts: int, what: str) -> int:
    """Each TP rank's share of ``size``; ValueError naming ``what`` when it does not split."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({parts})")
    return size // parts


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank holds: its share, or one (replicated: each rank keeps the one
    its query heads need) when there are fewer KV heads than ranks; ValueError naming the
    settings when neither works."""
    if num_kv_heads >= tp:
        return split_evenly(num_kv_heads, tp, "num_key_value_heads")
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads}) when it exceeds it")
    return 1


SmallMKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (x, packed weight, out_features, bias) -> x W^T (+ b), e.g. cpu_ops.linear_packed
PackedKernel = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


class SmallMMatmul:
    """``x @ self.weight.T (+ b)``, with an optional kernel for inputs of few rows (decode
    steps: one row per running sequence), where a general GEMM re-reads the weights per row.
    The kernel may read a bf16 copy of the weights (``small_m_weight``) when it holds the
    very same values: half the bytes, the same products."""

    weight: torch.Tensor
    small_m_kernel: SmallMKernel | None = None  # set per layer by use_small_m_kernel()
    small_m_max_rows: int = 0
    small_m_weight: torch.Tensor | None = None
    weight_major_max_rows: int = 0  # inputs of at most this many rows go as (W x^T)^T
    large_m_kernel: SmallMKernel | None = None  # F.linear's stand-in past those rows
    large_m_min_rows: int = 0  # ... from this many rows on (F.linear below)
    packed_weight: torch.Tensor | None = None  # oneDNN's layout (use_packed_weights)
    # our tiled kernel's (use_prepacked_weights): fp32, or the bf16 copy's values packed
    prepacked_weight: torch.Tensor | None = None
    prepacked_kernel: PackedKernel | None = None
    # With a gate_up weight packed paired: (x, packed, out_features, bias) -> the MLP's
    # activation silu(gate) * up (cpu_ops.linear_packed_gate_up with silu_mul)
    prepacked_silu_mul: Callable[..., torch.Tensor] | None = None
    out_features: int = 0  # the weight's rows (kept when a released weight has none)
    # A quantized weight (kvray.models.quantized installs these; ``weight`` is then empty):
    # its segments (GPU kernels, references), or, on CPU, the one blob the C++ kernels read,
    # and the matmul that reads it: (module, x, bias) -> y.
    quant: QuantTensor | None = None
    qweight: torch.Tensor | None = None
    quant_matmul: Callable[..., torch.Tensor] | None = None
    # The quantized matmul takes its input as FP8 rows (kvray.quant.fp8.Fp8Rows) that a
    # fused norm quantized (an FP8 weight on a GPU with FP8 tensor cores)
    takes_fp8_rows: bool = False

    @property
    def is_quantized(self) -> bool:
        return self.quant is not None or self.qweight is not None

    @property
    def kernel_weight(self) -> torch.Tensor:
        """The weight the small-M kernel (or the fused decode layer) reads: the quantized
        blob, else the bf16 copy where there is one, else the weight."""
        if self.qweight is not None:
            return self.qweight
        return self.weight if self.small_m_weight is None else self.small_m_weight

    def silu_mul_matmul(self, x: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate_up projection's output, from a kernel that
        computes it in the GEMM's epilogue, where the input takes the prepacked route; else
        None (the caller runs the matmul and the activation)."""
        fused, prepacked = self.prepacked_silu_mul, self.prepacked_weight
        if fused is None or prepacked is None or x.dtype != torch.float32 or x.dim() != 2:
            return None
        if self.small_m_kernel is not None and x.shape[0] <= self.small_m_max_rows:
            return None
        return fused(x, prepacked, self.out_features, bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_matmul is not None:
            return self.quant_matmul(self, x, bias)
        rows = x.shape[0]
        if self.small_m_kernel is not None and 0 < rows <= self.small_m_max_rows:
            return self.small_m_kernel(x, self.kernel_weight, bias)
        prepacked = self.prepacked_weight
        if prepacked is not None and x.dtype == torch.float32:  # (fp32 or bf16 panels)
            flat = self.prepacked_kernel(x.reshape(-1, x.shape[-1]), prepacked,
                                         self.out_features, bias)
            return flat.view(*x.shape[:-1], self.out_features)
        packed = self.packed_weight
        if packed is not None and x.dtype == packed.dtype and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if rows <= self.weight_major_max_rows:  # MKL's fp32 sgemm is faster this way round
            y = torch.mm(self.weight, x.t()).t().contiguous()
            return y if bias is None else y.add_(bias)
        if self.large_m_kernel is not None and x.dim() == 2 and rows >= self.large_m_min_rows:
            return self.large_m_kernel(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


def use_small_m_kernel(model: nn.Module, kernel: SmallMKernel, max_rows: int,
                       bf16_weights: bool = False,
                       large_m_kernel: SmallMKernel | None = None,
                       weight_major_max_rows: int = WEIGHT_MAJOR_MAX_ROWS,
                       lm_head_weight_major_max_rows: int = UNLIMITED_ROWS,
                       large_m_min_rows: int = 0, lm_head_large_m_min_rows: int = 0) -> int:
    """Route every linear layer (and the LM head) of ``model`` through ``kernel`` when the
    input has at most ``max_rows`` rows, and inputs of up to ``weight_major_max_rows`` rows
    (``lm_head_weight_major_max_rows`` for the LM head: by default any number) through the
    weight-major GEMM (W x^T)^T, which MKL's fp32 sgemm runs faster than F.linear at those
    sizes on AVX2 CPUs (fp32 weights only); inputs
    of at least ``large_m_min_rows`` (``lm_head_large_m_min_rows``) rows past those through
    ``large_m_kernel`` (F.linear's signature) when given; the rest through F.linear.
    With ``bf16_weights``, give the kernel a bf16 copy of each weight that bf16 holds exactly
    (a bf16 checkpoint run in fp32). Returns the bytes those copies take."""
    extra = 0
    for module in model.modules():
        if isinstance(module, SmallMMatmul) and not module.is_quantized:
            module.small_m_kernel, module.small_m_max_rows = kernel, max_rows
            head = isinstance(module, ParallelLMHead)
            if module.weight.dtype == torch.float32:  # (MKL's sgemm; not for bf16)
                module.weight_major_max_rows = (
                    lm_head_weight_major_max_rows if head else weight_major_max_rows)
            module.large_m_kernel = large_m_kernel
            module.large_m_min_rows = lm_head_large_m_min_rows if head else large_m_min_rows
            if bf16_weights:
                copy = module.weight.to(torch.bfloat16)
                if torch.equal(copy.to(module.weight.dtype), module.weight):
                    module.small_m_weight = copy
                    extra += copy.numel() * copy.element_size()
    return extra


def use_packed_weights(model: nn.Module) -> int:
    """Give every bf16 linear layer (and the LM head) of ``model`` a copy of its weight in
    oneDNN's blocked layout, which its matmuls then use for inputs of any number of rows.

    ``F.linear`` on a plain bf16 weight has oneDNN reorder the whole weight into that layout
    on every call, which costs more than the matmul at decode sizes (identical products;
    fp32 accumulation either way). The plain weight stays (the embedding may share it;
    other paths read it). Returns the bytes the copies take."""
    extra = 0
    for module in model.modules():
        if (isinstance(module, SmallMMatmul) and module.weight.dtype == torch.bfloat16
                and module.weight.numel()):
            weight = module.weight.detach()
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
            extra += weight.numel() * weight.element_size()
    return extra


def use_prepacked_weights(model: nn.Module, pack: Callable[[torch.Tensor], torch.Tensor],
                          kernel: PackedKernel, from_rows: int | None = None,
                          gate_up: tuple[Callable[[torch.Tensor], torch.Tensor], PackedKernel,
                                         Callable[..., torch.Tensor], int] | None = None,
                          bf16: bool = False) -> int:
    """Give every fp32 linear layer (and the LM head) of ``model`` whose small-M inputs read
    an exact bf16 copy (see :func:`use_small_m_kernel`) a copy of its weight packed once by
    ``pack`` for ``kernel``, which then takes every input past the small-M kernel's rows
    (with ``from_rows``, every input of at least that many rows: the small-M kernel keeps
    fewer).

    MKL's sgemm (``F.linear``) and ``cpu_ops.linear_tiled`` repack the weight on every call,
    and at decode-batch sizes the packed kernel also prefetches the weight stream. Only
    layers with a bf16
    copy: their plain weight can then be dropped (:func:`release_plain_weights`), so the
    process holds as many bytes of weights as before; an fp32 checkpoint keeps its routes
    rather than a second fp32 copy.

    ``gate_up`` = (pack, kernel, silu_mul kernel, lanes): the MLP's merged gate and up
    projections (two halves of a multiple of ``lanes`` rows, no bias) are packed paired
    instead, so that the MLP can take ``silu(gate) * up`` straight from the GEMM
    (:meth:`SmallMMatmul.silu_mul_matmul`). With ``bf16``, pack the bf16 copy (the same
    values in half the bytes; the kernel widens them exactly: less to stream per step).
    Returns the bytes the packed copies take."""
    extra = 0
    for module in model.modules():
        if (isinstance(module, SmallMMatmul) and module.weight.dtype == torch.float32
                and module.small_m_weight is not None and module.weight.numel()):
            source = (module.small_m_weight if bf16 else module.weight).detach()
            halves = getattr(module, "out_local", None)
            if (gate_up is not None and halves is not None and len(halves) == 2
                    and halves[0] == halves[1] and halves[0] % gate_up[3] == 0
                    and getattr(module, "bias", None) is None):
                module.prepacked_weight = gate_up[0](source)
                module.prepacked_kernel, module.prepacked_silu_mul = gate_up[1], gate_up[2]
            else:
                module.prepacked_weight = pack(source)
                module.prepacked_kernel = kernel
            if from_rows is not None:
                module.small_m_max_rows = min(module.small_m_max_rows, from_rows - 1)
            module.out_features = module.weight.shape[0]
            extra += module.prepacked_weight.numel() * module.prepacked_weight.element_size()
    return extra


def release_plain_weights(model: nn.Module) -> int:
    """Drop the plain weight of every linear layer that nothing reads any more: inputs of
    up to the small-M kernel's rows read its exact bf16 copy, larger ones the prepacked
    copy, and no other module shares the weight (a tied embedding does: that one stays).
    So an fp32 run of a bf16 checkpoint holds bf16 + packed fp32 weights, not three
    copies. Returns the bytes freed."""
    holders = Counter(id(p) for m in model.modules() for p in m._parameters.values()
                      if p is not None)
    freed = 0
    for module in model.modules():
        if (isinstance(module, SmallMMatmul) and module.prepacked_weight is not None
                and module.small_m_weight is not None and module.small_m_kernel is not None
                and holders[id(module.weight)] == 1 and module.weight.numel()):
            freed += module.weight.numel() * module.weight.element_size()
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    if freed:
        return_freed_heap()
    return freed


class LinearBase(nn.Module, SmallMMatmul):
    """y = x W^T (+ b) with W of shape [out_local, in_local]."""

    # The adapters' weights when LoRA is on (kvray.lora.layers.LoRAWeights): adds each
    # row's delta to the output, before a row-parallel layer's all-reduce.
    lora = None

    def lora_active(self) -> bool:
        """Whether this step adds adapter deltas to this layer's output."""
        return self.lora is not None and self.lora.batch.row_slots is not None

    def lora_slices(self) -> list[int]:
        """This rank's output columns of each projection fused in the layer."""
        return [self.out_size]

    def lora_shard(self, index: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of projection ``index``'s adapter pair (A [r, in], B [out, r])."""
        raise NotImplementedError

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_size, self.out_size = in_local, out_local  # (the weight may be released)
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def _place(self, param: nn.Parameter, row: int, shard: torch.Tensor | QuantTensor,
               what: str) -> None:
        """Put ``shard`` at rows [row, row + len) of ``param``: copied for a dense tensor; a
        quantized one is kept as a piece for :func:`kvray.models.quantized.assemble_quantized`
        (the weight's dense storage is never written, so it takes no memory)."""
        target = param.data if param.dim() == 1 else param.data.narrow(0, row, shard.shape[0])
        if tuple(target.shape) != tuple(shard.shape):
            raise ValueError(f"{what}: checkpoint slice has shape {tuple(shard.shape)}, "
                             f"model expects {tuple(target.shape)}")
        if isinstance(shard, QuantTensor):
            if param is not self.weight:
                raise ValueError(f"{what}: a quantized tensor for a bias")
            self.__dict__.setdefault("quant_pieces", {})[row] = shard
            return
        if param is self.weight:
            self.__dict__["dense_loaded"] = True
        target.copy_(shard)


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks; no communication in forward."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int,
                 bias: bool, dtype: torch.dtype) -> None:
        self.ctx = ctx
        super().__init__(in_features, split_evenly(out_features, ctx.tp_size, "output size"),
                         bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _check_full(loaded, 0, size * self.ctx.tp_size, "column-parallel weight")
        shard = loaded.narrow(0, self.ctx.tp_rank * size, size)
        _check_shape(param, shard, "column-parallel weight")
        self._place(param, 0, shard, "column-parallel weight")

    def lora_shard(self, index: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.lora_slices()[index]
        return a, b.narrow(0, self.ctx.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora_active():
            self.lora.add(y, x)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of the MLP); ``shard_id`` is the index of the projection."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_sizes: Sequence[int],
                 bias: bool, dtype: torch.dtype, size_name: str = "output size") -> None:
        self.out_local = [split_evenly(s, ctx.tp_size, size_name) for s in out_sizes]
        super().__init__(ctx, in_features, sum(out_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert isinstance(shard_id, int)
        size = self.out_local[shard_id]
        offset = sum(self.out_local[:shard_id])
        _check_full(loaded, 0, size * self.ctx.tp_size, f"merged projection {shard_id}")
        if param.dim() == 1:  # a bias: its slice of the fused output
            param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.ctx.tp_rank * size,
                                                                   size))
            return
        shard = loaded.narrow(0, self.ctx.tp_rank * size, size)
        self._place(param, offset, shard, f"merged projection {shard_id}")

    def lora_slices(self) -> list[int]:
        return list(self.out_local)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projection. Q heads are split across ranks; KV heads too, or
    replicated (each rank keeps the one it needs) when there are fewer KV heads than ranks."""

    def __init__(self, ctx: ParallelContext, hidden_size: int, head_dim: int,
                 num_heads: int, num_kv_heads: int, bias: bool, dtype: torch.dtype) -> None:
        tp = ctx.tp_size
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.kv_head_start = ctx.tp_rank * self.num_kv_heads if num_kv_heads >= tp \
            else ctx.tp_rank * num_kv_heads // tp
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        out = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        super().__init__(ctx, hidden_size, out, bias, dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id in ("q", "k", "v")
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.ctx.tp_rank * self.q_size
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        _check_full(loaded, 0, self.total_heads[shard_id] * self.head_dim, f"{shard_id}_proj")
        shard = loaded.narrow(0, start, size)
        if param.dim() == 1:  # a bias
            param.data.narrow(0, offset, size).copy_(shard)
            return
        self._place(param, offset, shard, f"{shard_id}_proj")

    def lora_slices(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def lora_shard(self, index: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if index == 0:
            return a, b.narrow(0, self.ctx.tp_rank * self.q_size, self.q_size)
        return a, b.narrow(0, self.kv_head_start * self.head_dim, self.kv_size)


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; partial outputs summed by one all-reduce."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int,
                 bias: bool, dtype: torch.dtype, size_name: str = "input size") -> None:
        self.ctx = ctx
        super().__init__(split_evenly(in_features, ctx.tp_size, size_name), out_features, bias,
                         dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is not split; it is added once, after the reduce
            shard = loaded
        else:
            size = param.shape[1]
            _check_full(loaded, 1, size * self.ctx.tp_size, "row-parallel weight")
            try:
                shard = loaded.narrow(1, self.ctx.tp_rank * size, size)
            except ValueError as err:  # a quantized tensor split off its blocks
                raise ValueError(f"tensor_parallel_size {self.ctx.tp_size} splits the "
                                 f"{loaded.shape[1]} input features into {size}: {err}") from None
        _check_shape(param, shard, "row-parallel weight")
        self._place(param, 0, shard, "row-parallel weight")

    def lora_shard(self, index: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        # x's columns are split: each rank's partial delta joins the all-reduce
        return a.narrow(1, self.ctx.tp_rank * self.in_size, self.in_size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.lora_active():
            self.lora.add(y, x)
        y = self.ctx.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks (vocab padded to a multiple of tp_size);
    each rank looks up its own rows, zeros the rest, and an all-reduce combines them."""

    def __init__(self, ctx: ParallelContext, vocab_size: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding: checkpoint has shape {tuple(loaded.shape)}, model "
                             f"expects ({self.vocab_size}, {param.shape[1]})")
        end = min(self.vocab_start + self.rows_per_rank, self.vocab_size)
        if isinstance(loaded, QuantTensor):  # kept quantized; rows past the vocab are zeros
            rows = loaded.narrow(0, self.vocab_start, end - self.vocab_start)
            pad = self.rows_per_rank - rows.shape[0]
            if pad:
                rows = QuantTensor.cat_rows([rows, QuantTensor.zeros(pad, loaded.shape[1])])
            self.__dict__["quant_pieces"] = {0: rows}
            return
        self.__dict__["dense_loaded"] = True
        param.data.zero_()
        param.data[: end - self.vocab_start].copy_(loaded[self.vocab_start:end])

    # A quantized embedding (see SmallMMatmul): its rows looked up by (module, ids) -> rows.
    quant: QuantTensor | None = None
    qweight: torch.Tensor | None = None
    quant_lookup: Callable[..., torch.Tensor] | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_lookup is not None:
            return self.quant_lookup(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, SmallMMatmul):
    """Vocab-parallel output projection; full logits are gathered for sampling."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.all_gather_last_dim(self.matmul(hidden, None))
        return logits[..., : self.vocab_size]
