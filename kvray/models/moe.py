"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), tensor- or expert-parallel.

A router picks ``top_k`` experts per token (softmax in fp32, then top-k; Mixtral always
renormalises the k weights, the Qwen families when ``norm_topk_prob`` says so). Tokens are
grouped by expert with one sort, and each expert that received tokens runs one GEMM pair on
its rows (SwiGLU), scaled by the routing weights and added into the output: no per-token
Python loop, and a decode step of one token reads only its k experts' weights. Qwen2-MoE
adds a shared expert on every token, scaled by ``sigmoid(shared_expert_gate(x))``.

Parallelism over the TP group, whose ranks all hold every token's activations:

- plain TP (default): every rank holds every expert, each expert's intermediate dimension
  split across the ranks like a dense MLP's (gate/up by rows, down by columns);
- expert parallelism (``enable_expert_parallel``): each rank holds ``num_experts / tp``
  whole experts and runs only the tokens routed to them.

Either way each rank's output is a partial sum over the experts' contributions and one
all-reduce (the dense MLP's) completes it; with expert parallelism no rank reads a slice of
an expert, and a rank whose experts received no token runs no GEMM at all.

:mod:`kvray.models.expert_stats` counts the tokens routed to each expert of each layer (the
load that expert placement balances and the metrics show) and reports what each rank holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvray.models.expert_placement import contiguous_experts
from kvray.models.spec import ModelSpec
from kvray.parallel import ParallelContext
from kvray.quant.tensor import QuantTensor

if TYPE_CHECKING:
    from kvray.models.expert_stats import ExpertTokenCounts

# the halves of a stacked gate_up weight, in checkpoint order
EXPERT_PARTS = ("gate", "up", "down")


def check_expert_split(num_experts: int, inter: int, tp: int, expert_parallel: bool) -> None:
    """ValueError naming the setting when ``tp`` ranks cannot share the experts: whole
    experts under expert parallelism, else each expert's ``inter`` rows."""
    if tp == 1:
        return
    if expert_parallel and num_experts % tp:
        raise ValueError(f"enable_expert_parallel: {num_experts} experts do not split "
                         f"evenly over tensor_parallel_size = {tp}")
    if not expert_parallel and inter % tp:
        raise ValueError(f"the experts' intermediate size {inter} does not split evenly "
                         f"over tensor_parallel_size = {tp} (or set enable_expert_parallel)")


class MoEExperts(nn.Module):
    """This rank's experts, stacked: ``w13_weight`` [experts, 2 * inter, hidden] (gate rows
    then up rows) and ``w2_weight`` [experts, hidden, inter]; ``inter`` is the rank's slice
    under plain TP, the whole width under expert parallelism.

    Quantized experts (a quantized checkpoint's, or ``quantization: int8``) are held in
    ``quant`` instead, per local expert its w13 and w2 as
    :class:`~kvray.quant.tensor.QuantTensor`; :func:`kvray.models.quantized.install_quantized`
    turns them into what reads them (``quant_kind``: ``"blob"`` for the CPU kernels, each a
    (blob, input permutation) pair, ``"segments"`` for Triton), and the dense parameters
    stay empty. Decode at batch 1 then
    reads only the chosen experts' quantized bytes."""

    # An expert's few rows through the CPU extension's linear and activation kernels (fp32;
    # set by kvray.models.llama.use_fused_ops): ~2x F.linear at 8 rows.
    fused_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    fused_silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # The whole layer's experts as two grouped GEMMs on the GPU (Triton; set by
    # use_fused_ops with kvray.kernels.triton_ops): no host sync, no loop over experts.
    fused_moe: Callable[..., torch.Tensor] | None = None
    # A few tokens' experts in one C++ call (kvray.kernels.cpu_ops.moe_experts; set by
    # use_fused_ops on CPU), dense fp32 / bf16 or quantized blob experts, up to
    # cpu_moe_max_rows tokens: at batch 1 the per-expert calls of the loop below cost more
    # than the weights' bytes.
    cpu_moe: Callable[..., torch.Tensor] | None = None
    cpu_moe_max_rows: int = 0
    # where this layer's routing is counted (set by count_expert_tokens)
    token_counts: ExpertTokenCounts | None = None

    def __init__(self, ctx: ParallelContext, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.layer_idx = layer_idx
        self.expert_parallel = ctx.expert_parallel and ctx.tp_size > 1
        check_expert_split(num_experts, inter, ctx.tp_size, ctx.expert_parallel)
        if self.expert_parallel:
            # every rank's experts of this layer; this rank holds placement[tp_rank]
            self.placement = ctx.expert_placement[layer_idx] if ctx.expert_placement \
                else contiguous_experts(num_experts, ctx.tp_size)
            self.held = list(self.placement[ctx.tp_rank])
            self.inter, self.inter_start = inter, 0
        else:
            self.placement = None  # every rank holds a slice of every expert
            self.held = list(range(num_experts))
            self.inter = inter // ctx.tp_size
            self.inter_start = ctx.tp_rank * self.inter
        # the global ids of the experts this rank holds, ascending: w13/w2 row i is held[i]
        assert self.held == sorted(set(self.held)), self.held
        self.num_local = len(self.held)
        self.local_index = {e: i for i, e in enumerate(self.held)}
        self.full_inter, self.hidden = inter, hidden
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden,
                                                   dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, self.inter,
                                                  dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # per local expert [w13, w2] quantized (see the class doc); None: dense
        self.quant: list[list[Any]] | None = None
        self.quant_kind = ""  # "": QuantTensors, read dequantized (before install)
        # quantized checkpoint pieces as loaded: (local expert, part) -> QuantTensor
        self.expert_pieces: dict[tuple[int, str], QuantTensor] = {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantTensor,
                      shard_id: str) -> None:
        """``shard_id`` ``"<expert>.<gate|up|down>"`` (one expert's tensor, global index) or
        ``"all.<gate_up|down>"`` (the fused 3-D tensors of a transformers v5 checkpoint)."""
        which, part = shard_id.split(".")
        if isinstance(loaded, QuantTensor):
            if which != "all":
                self._load_quantized(loaded, int(which), part)
                return
            loaded = loaded.dequantize(param.dtype)  # a fused 3-D quantized tensor: none yet
        if which == "all":
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"expected [{self.num_experts}, ...] stacked experts")
            halves = loaded.chunk(2, dim=1) if part == "gate_up" else (loaded,)
            names = ("gate", "up") if part == "gate_up" else ("down",)
            for e in range(self.num_experts):
                for name, t in zip(names, halves, strict=True):
                    self._load_one(param, t[e], e, name)
            return
        self._load_one(param, loaded, int(which), part)

    def _load_quantized(self, loaded: QuantTensor, expert: int, part: str) -> None:
        """Keep this rank's slice of a quantized expert tensor (rows of gate / up, columns
        of down: on quantization-group boundaries, else an error naming
        tensor_parallel_size) for :meth:`assemble_quantized`."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of {self.num_experts}")
        local = self.local_index.get(expert)
        if local is None:
            return
        want = (self.hidden, self.full_inter) if part == "down" else (self.full_inter,
                                                                       self.hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"{part}: shape {tuple(loaded.shape)}, expected {want}")
        dim = 1 if part == "down" else 0
        try:
            piece = loaded.narrow(dim, self.inter_start, self.inter)
        except ValueError as err:
            raise ValueError(f"expert {expert} {part}: {err} (tensor_parallel_size splits "
                             "each expert; enable_expert_parallel keeps them whole)") from err
        self.expert_pieces[(local, part)] = piece

    def assemble_quantized(self) -> bool:
        """Stack the quantized pieces into ``quant`` once every tensor is loaded; where only
        some experts' tensors came quantized, dequantize them into the dense weights.
        Returns whether the experts are now held quantized."""
        pieces, self.expert_pieces = self.expert_pieces, {}
        if not pieces:
            return self.quant is not None
        parts = ("gate", "up", "down")
        if len(pieces) == self.num_local * len(parts):
            self.quant = [[QuantTensor.cat_rows([pieces[(i, "gate")], pieces[(i, "up")]]),
                           pieces[(i, "down")]] for i in range(self.num_local)]
            self.w13_weight.data = self.w13_weight.data.new_empty(0)
            self.w2_weight.data = self.w2_weight.data.new_empty(0)
            return True
        for (local, part), piece in pieces.items():
            dense = piece.dequantize(self.w13_weight.dtype)
            if part == "down":
                self.w2_weight.data[local].copy_(dense)
            else:
                offset = 0 if part == "gate" else self.inter
                self.w13_weight.data[local, offset:offset + self.inter].copy_(dense)
        return False

    def quantize_experts(self, quantize: Callable[[torch.Tensor], QuantTensor]) -> bool:
        """Quantize the dense experts (online quantization): False if already quantized."""
        if self.quant is not None or not self.w13_weight.numel():
            return False
        self.quant = [[quantize(self.w13_weight[i].detach().to("cpu", torch.float32)),
                       quantize(self.w2_weight[i].detach().to("cpu", torch.float32))]
                      for i in range(self.num_local)]
        self.w13_weight.data = self.w13_weight.data.new_empty(0)
        self.w2_weight.data = self.w2_weight.data.new_empty(0)
        return True

    def held_bytes(self) -> int:
        """Bytes of this rank's expert weights as held (quantized: codes and scales)."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.quant is None:
            return dense
        # a (blob, input permutation) pair, or a QuantTensor
        return dense + sum(q[0].numel() if isinstance(q, tuple) else q.nbytes
                           for pair in self.quant for q in pair)

    def _load_one(self, param: nn.Parameter, loaded: torch.Tensor, expert: int,
                  part: str) -> None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of {self.num_experts}")
        local = self.local_index.get(expert)
        if local is None:
            return  # another rank's expert
        hidden = self.hidden
        rows = slice(self.inter_start, self.inter_start + self.inter)
        if part == "down":
            if tuple(loaded.shape) != (hidden, self.full_inter):
                raise ValueError(f"down: shape {tuple(loaded.shape)}, expected "
                                 f"{(hidden, self.full_inter)}")
            param.data[local].copy_(loaded[:, rows])
            return
        if tuple(loaded.shape) != (self.full_inter, hidden):
            raise ValueError(f"{part}: shape {tuple(loaded.shape)}, expected "
                             f"{(self.full_inter, hidden)}")
        offset = 0 if part == "gate" else self.inter
        param.data[local, offset:offset + self.inter].copy_(loaded[rows])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                ) -> torch.Tensor:
        """This rank's partial sum over the chosen experts: ``weights`` / ``experts``
        [tokens, k] the routing weights and global expert ids."""
        if self.fused_moe is not None and self.quant is None:  # no host sync
            self._count(experts)
            return self.fused_moe(x, self.w13_weight, self.w2_weight, weights, experts,
                                  self._local_index_on(x.device))
        if self.takes_cpu_moe(x):
            self._count(experts)
            return self.cpu_moe(x, weights, experts, self._local_index_on(x.device),
                                *self._cpu_moe_weights())
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.token_counts is not None:
            self.token_counts.add(self.layer_idx, experts, counts)
        # one host sync; expert e's (token, slot) pairs follow those of experts < e
        per_expert = counts.tolist()
        starts = [0, *itertools.accumulate(per_expert)]
        tokens = order // experts.shape[1]
        flat_weights = weights.reshape(-1)
        for i, e in enumerate(self.held):
            n, start = per_expert[e], starts[e]
            if n == 0:
                continue
            pick = order[start:start + n]
            rows = tokens[start:start + n]
            y = self._expert_linear(self._act(self._expert_linear(x[rows], i, 0)), i, 1)
            out.index_add_(0, rows, y * flat_weights[pick].unsqueeze(1).to(y.dtype))
        return out

    def takes_cpu_moe(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows run as one ``cpu_moe`` call: few enough, and experts it
        reads."""
        return self.cpu_moe is not None and x.shape[0] <= self.cpu_moe_max_rows \
            and self._cpu_moe_weights() is not None

    def _count(self, experts: torch.Tensor) -> None:
        """Add this forward's routing to the token counters, where they count."""
        if self.token_counts is not None and self.token_counts.num_rows:
            self.token_counts.add(self.layer_idx, experts, torch.bincount(
                experts.reshape(-1), minlength=self.num_experts))

    def cpu_moe_tensors(self) -> list[torch.Tensor]:
        """The experts as the fused decode layer's ``moe_mlp`` takes them: stacked w13, w2;
        or each local expert's w13 blob, then each one's w2 blob, then (where any has one)
        their input permutations, w13's and w2's per expert (empty: none)."""
        w13, w2, perms = self._cpu_moe_weights()
        if isinstance(w13, torch.Tensor):
            return [w13, w2]
        none = torch.empty(0, dtype=torch.int64)
        return [*w13, *w2, *(none if p is None else p for p in perms or [])]

    def _cpu_moe_weights(self) -> tuple | None:
        """(w13, w2, input permutations) as ``cpu_moe`` takes them: the stacked fp32 / bf16
        weights, or per local expert the blobs (kept while ``quant`` stays the same list);
        None for experts it does not read (Triton segments, or not yet installed)."""
        if self.quant is None:
            if self.w13_weight.dtype not in (torch.float32, torch.bfloat16) \
                    or not self.w13_weight.is_contiguous() or not self.w2_weight.is_contiguous():
                return None
            return self.w13_weight, self.w2_weight, None
        if self.quant_kind != "blob":
            return None
        cached = self.__dict__.get("_blob_lists")
        if cached is None or cached[0] is not self.quant:
            perms = [perm for pair in self.quant for _, perm in pair]
            cached = (self.quant, [pair[0][0] for pair in self.quant],
                      [pair[1][0] for pair in self.quant],
                      perms if any(p is not None for p in perms) else None)
            self.__dict__["_blob_lists"] = cached
        return cached[1:]

    def _local_index_on(self, device: torch.device) -> torch.Tensor:
        """[num_experts] global expert id -> row of w13/w2 here, or -1, on ``device``."""
        cached = self.__dict__.get("_local_index")
        if cached is None or cached.device != device:
            cached = torch.full((self.num_experts,), -1, dtype=torch.int64)
            cached[torch.tensor(self.held)] = torch.arange(self.num_local)
            cached = cached.to(device)
            self.__dict__["_local_index"] = cached
        return cached

    def _expert_linear(self, x: torch.Tensor, i: int, which: int) -> torch.Tensor:
        """x times local expert i's w13 (which 0) or w2 (which 1), transposed."""
        if self.quant is None:
            w = (self.w13_weight if which == 0 else self.w2_weight)[i]
            if self.fused_linear is not None and x.dtype == w.dtype == torch.float32:
                return self.fused_linear(x, w)
            return F.linear(x, w)
        q = self.quant[i][which]
        if self.quant_kind == "blob":
            from kvray.kernels import cpu_ops

            blob, perm = q
            return cpu_ops.quantized_linear(x, blob, None, perm)
        if self.quant_kind == "segments":
            from kvray.kernels.triton_quant import linear_quant

            return linear_quant(x, q)
        return F.linear(x, q.dequantize(x.dtype).to(x.device))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_silu_and_mul is not None:
            return self.fused_silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert); in the decoder layer's ``mlp`` slot."""

    # The routing of a few fp32 rows in one C++ call (kvray.kernels.cpu_ops.moe_route; set
    # by use_fused_ops on CPU) where the experts take their one-call path: the router's
    # linear, softmax, top-k, renormalisation and the shared expert's gate, as the fused
    # decode layer computes them (the same values either way).
    fused_route: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, dtype: torch.dtype,
                 shared_expert: nn.Module | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.ctx = ctx
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = MoEExperts(ctx, spec.num_experts, spec.hidden_size,
                                  spec.moe_intermediate_size, dtype, layer_idx)
        # Qwen2-MoE's always-on expert: a dense MLP the decoder layer builds (its own
        # all-reduce), scaled per token by sigmoid(shared_expert_gate(x))
        self.shared_expert, self.shared_expert_gate = shared_expert, None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.weight.requires_grad_(False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [tokens, top_k], as transformers computes them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_route is not None and self.experts.takes_cpu_moe(x):
            weights, experts, scale = self.fused_route(
                x, self.router_weight(), self.top_k, self.renormalize,
                self.shared_expert is not None)
        else:
            weights, experts = self.route(x)
            scale = None if self.shared_expert is None \
                else torch.sigmoid(self.shared_expert_gate(x))
        out = self.ctx.all_reduce(self.experts(x, weights, experts))
        if self.shared_expert is not None:
            out = out + scale.to(out.dtype) * self.shared_expert(x)
        return out

    def router_weight(self) -> torch.Tensor:
        """The router's rows in fp32, the shared expert's gate as one more row, as
        ``fused_route`` and the fused decode layer read them (built once)."""
        cached = self.__dict__.get("_router_weight")
        if cached is None:
            rows = [self.gate.weight] + ([self.shared_expert_gate.weight]
                                         if self.shared_expert_gate is not None else [])
            cached = torch.cat([r.detach().float() for r in rows]).contiguous()
            self.__dict__["_router_weight"] = cached
        return cached

    def takes_fused_kernel(self) -> bool:
        """Whether the fused C++ decode layer computes this block (``moe_mlp``): routed
        through ``fused_route``, experts the one-call path reads, and a shared expert (if
        any) of plain SwiGLU linears the small-M or quantized kernel reads."""
        if self.fused_route is None or self.experts.cpu_moe is None \
                or self.experts._cpu_moe_weights() is None:
            return False
        shared = self.shared_expert
        if shared is None:
            return True

        def readable(m: nn.Module) -> bool:  # the fused layer's kernels read its weight
            if m.bias is not None or getattr(m, "input_perm", None) is not None:
                return False
            w = m.kernel_weight
            return m.qweight is not None or (w.dtype in (torch.float32, torch.bfloat16)
                                             and w.is_contiguous() and w.numel() > 0)

        return getattr(shared, "act", None) == "silu" and all(
            readable(m) for m in (shared.gate_up_proj, shared.down_proj))

    def fused_args(self) -> list[torch.Tensor]:
        """This block as the fused decode layer's ``moe_mlp`` takes it: [router, local
        index, token counts row (empty: none), shared gate_up, shared down (empty: none),
        experts...] (rebuilt when the counters or the experts' weights change)."""
        experts, counts = self.experts, self.experts.token_counts
        cached = self.__dict__.get("_fused_args")
        if cached is None or cached[0] is not counts or cached[1] is not experts.quant:
            none = torch.empty(0)
            shared = self.shared_expert
            row = none if counts is None else counts.counts[counts.row[experts.layer_idx]]
            tensors = [self.router_weight(), experts._local_index_on(torch.device("cpu")), row,
                       none if shared is None else shared.gate_up_proj.kernel_weight,
                       none if shared is None else shared.down_proj.kernel_weight,
                       *experts.cpu_moe_tensors()]
            cached = (counts, experts.quant, tensors)
            self.__dict__["_fused_args"] = cached
        return cached[2]

    def fused_counts(self, rows: int) -> bool:
        """Whether the fused layer's counting fits a batch of ``rows``: it counts every
        row's routing or none, so a count of only the first rows (padding after them)
        needs the Python layer."""
        counts = self.experts.token_counts
        return counts is None or not 0 < counts.num_rows < rows

    def fused_dims(self) -> list[int]:
        """``moe_mlp``'s dims for this step: [top_k, renormalize, local experts, count]."""
        counts = self.experts.token_counts
        return [self.top_k, int(self.renormalize), self.experts.num_local,
                int(counts is not None and counts.num_rows > 0)]
