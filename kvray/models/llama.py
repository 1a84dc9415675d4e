"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, and with MoE layers from
:mod:`kvray.models.moe` Mixtral, Qwen2-MoE, Qwen3-MoE), tensor- and pipeline-parallel
aware. Parameter names mirror Hugging Face's so checkpoints map one to one, except the fused
``qkv_proj`` and ``gate_up_proj`` (see :data:`STACKED_PARAMS`).

The forward pass takes a flat batch of tokens with positions (no padding).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvray.kernels.attention import AttentionMetadata, attention, paged_attention
from kvray.kernels.norm import GemmaRMSNorm, RMSNorm
from kvray.kernels.rotary import RotaryEmbedding
from kvray.models.layers import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvray.models.moe import MoEExperts, SparseMoeBlock
from kvray.models.spec import ModelSpec
from kvray.parallel import ParallelContext, pp_layer_range
from kvray.quant.fp8 import Fp8Rows

# checkpoint projection name -> (fused parameter name, shard id)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def make_norm(spec: ModelSpec, size: int, dtype: torch.dtype) -> nn.Module:
    """The family's RMSNorm: Gemma's ``(1 + w)`` one, or Llama's."""
    return (GemmaRMSNorm if spec.gemma_norms else RMSNorm)(size, spec.rms_norm_eps, dtype)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: ParallelContext, layer_idx: int,
                 rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(ctx, spec.hidden_size, spec.head_dim, spec.num_heads,
                                          spec.num_kv_heads, spec.qkv_bias, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(ctx, spec.num_heads * spec.head_dim, spec.hidden_size,
                                        spec.o_bias, dtype)
        self.q_norm = make_norm(spec, spec.head_dim, dtype) if spec.qk_norm else None
        self.k_norm = make_norm(spec, spec.head_dim, dtype) if spec.qk_norm else None
        self.rotary = rotary
        self.scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5
        self.softcap = spec.attn_logit_softcap
        self.sliding_window = spec.layer_windows[layer_idx]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        num_tokens = qkv.shape[0]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if kv_cache is not None and self.rotary.fused_write is not None \
                and (self.softcap is None or meta.kernels_take_softcap):
            return self.o_proj(self._rotate_write_attend(qkv, v, meta, kv_cache)
                               .reshape(-1, q_size))
        if self.q_norm is None:  # rotate q and k together: half the small ops per layer
            qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
            q, k = self.rotary.rotate_qk(meta.positions, qk).split(
                [self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(meta.positions, q, k)
        out = attention(q, k, v, meta, self.scale, self.sliding_window, kv_cache, self.softcap)
        return self.o_proj(out.reshape(-1, q_size))

    def _rotate_write_attend(self, qkv: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                             kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention with q and k rotated and k, v written to the cache in one kernel call
        (the rotary's ``fused_write``): q turned in place inside ``qkv``, or in the q
        norm's output."""
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rotary.rotate_and_write(meta.positions, q, k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, self.scale, self.sliding_window, self.softcap)


class LlamaMLP(nn.Module):
    fused_silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, dtype: torch.dtype,
                 size: int | None = None) -> None:
        super().__init__()
        # Qwen2-MoE's shared expert: its own width (named in a split error)
        name = "intermediate_size" if size is None else "shared_expert_intermediate_size"
        size = size or spec.intermediate_size
        self.act = spec.hidden_act
        self.gate_up_proj = MergedColumnParallelLinear(ctx, spec.hidden_size, [size, size],
                                                       spec.mlp_bias, dtype, name)
        self.down_proj = RowParallelLinear(ctx, size, spec.hidden_size, spec.mlp_bias, dtype,
                                           name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act != "silu":  # Gemma's tanh GELU: no fused kernel
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        act = None if self.gate_up_proj.lora_active() else \
            self.gate_up_proj.silu_mul_matmul(x, self.gate_up_proj.bias)
        if act is not None:  # the activation from the GEMM's epilogue
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        if self.fused_silu_and_mul is not None:
            return self.down_proj(self.fused_silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    # The whole layer in one call for decode batches of at most ``fused_decode_max_rows``
    # rows (the signature of decode_layer in cpu_ops' extension); set by
    # use_fused_decode_layer.
    fused_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    fused_decode_max_rows: int = 0
    # ... and with the rows' LoRA adapters added (decode_layer_lora's signature)
    fused_decode_lora: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # Whether the fused call may take weights packed once for batches past the small-M rows
    # (off in a model with MoE layers: their fused batches stay within those rows, and a
    # stage's layers share one set of dims).
    fused_packed: bool = True

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, layer_idx: int,
                 rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, ctx, layer_idx, rotary, dtype)
        if spec.is_moe_layer(layer_idx):
            shared = (LlamaMLP(spec, ctx, dtype, spec.shared_expert_intermediate_size)
                      if spec.shared_expert_intermediate_size else None)
            self.mlp = SparseMoeBlock(spec, ctx, dtype, shared, layer_idx)
        else:
            self.mlp = LlamaMLP(spec, ctx, dtype)
        self.is_moe = isinstance(self.mlp, SparseMoeBlock)
        self.input_layernorm = make_norm(spec, spec.hidden_size, dtype)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size, dtype)
        # Gemma's sandwich: the attention's and the MLP's outputs normed before their adds
        self.sandwich = spec.gemma_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(spec, spec.hidden_size, dtype)
            self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size, dtype)
        self._decode_args: tuple | None = None
        self._lora_args: list[torch.Tensor] | None = None

    def takes_fused_kernel(self) -> bool:
        """Whether the fused C++ layer computes this layer: a dense SwiGLU MLP or a MoE
        block the fused layer reads (:meth:`SparseMoeBlock.takes_fused_kernel`), Llama's
        norms, no score capping, whole heads rotated, one rotary table for the stack."""
        attn = self.self_attn
        mlp_ok = (isinstance(self.mlp, LlamaMLP) and self.mlp.act == "silu") \
            or (isinstance(self.mlp, SparseMoeBlock) and self.mlp.takes_fused_kernel())
        return mlp_ok and not self.sandwich and attn.softcap is None \
            and attn.scale == attn.head_dim ** -0.5 and attn.rotary.rot_dim == attn.head_dim

    def takes_fused_decode(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                           meta: AttentionMetadata, kv_cache: torch.Tensor | None) -> bool:
        """Whether this batch runs the layer as ``fused_decode``: a pure-decode batch of at
        most ``fused_decode_max_rows`` rows, contiguous, over a paged cache (rows with LoRA
        adapters where the kernel takes them)."""
        if self.is_moe and not self.mlp.fused_counts(hidden.shape[0]):
            return False
        return self.fused_decode is not None and kv_cache is not None \
            and (self.fused_decode_lora is not None
                 or not self.self_attn.qkv_proj.lora_active()) \
            and meta.num_decodes == hidden.shape[0] <= self.fused_decode_max_rows \
            and hidden.is_contiguous() and (residual is None or residual.is_contiguous())

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_cache: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.takes_fused_decode(hidden, residual, meta, kv_cache):
            return self._fused_decode(hidden, residual, meta, kv_cache)
        hidden, residual = self._norm_into(self.input_layernorm, hidden, residual,
                                           self.self_attn.qkv_proj)
        hidden = self.self_attn(hidden, meta, kv_cache)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        next_linear = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None
        hidden, residual = self._norm_into(self.post_attention_layernorm, hidden, residual,
                                           next_linear)
        return self.mlp(hidden), residual

    @staticmethod
    def _norm_into(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None,
                   linear: LinearBase | None) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(``norm(hidden + residual)``, the sum) as ``linear``'s input: as FP8 rows from the
        norm's own kernel where the linear takes them and no adapter reads its input (one
        launch for the add, the norm and the activations' quantization), else the rows."""
        fused_fp8 = getattr(norm, "fused_fp8", None)
        if fused_fp8 is not None and linear is not None and linear.takes_fp8_rows \
                and not linear.lora_active():
            rows = fused_fp8(hidden, norm.weight, norm.eps, residual)
            return rows, hidden if residual is None else residual
        if residual is None:
            return norm(hidden), hidden
        return norm(hidden, residual)

    def _fused_decode(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata, kv_cache: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer through ``fused_decode``: no Python between its kernels."""
        weights, biases, dims, eps, scale, window = self.decode_args()
        cos, sin = self.self_attn.rotary.tables(meta.positions, meta.max_position)
        args = (hidden, residual, weights, biases, dims, eps, meta.positions, cos, sin,
                kv_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping, scale, window)
        if self.is_moe:  # (decode_layer_moe)
            return self.fused_decode(*args, self.mlp.fused_args(), self.mlp.fused_dims())
        if self.self_attn.qkv_proj.lora_active():
            rows = self.self_attn.qkv_proj.lora.batch.row_slots
            return self.fused_decode_lora(*args, self.lora_args(), rows)
        return self.fused_decode(*args)

    def lora_args(self) -> list[torch.Tensor]:
        """This layer's adapter slots as ``decode_layer_lora`` takes them: (a, bt, ranks,
        slice starts) of qkv, o, gate_up and down (the slot tensors are updated in place,
        so the list is built once)."""
        if self._lora_args is None:
            linears = (self.self_attn.qkv_proj, self.self_attn.o_proj,
                       self.mlp.gate_up_proj, self.mlp.down_proj)
            self._lora_args = [t for m in linears for t in (
                m.lora.a, m.lora.bt, m.lora.ranks,
                torch.tensor(m.lora.slice_starts, dtype=torch.int64))]
        return self._lora_args

    def decode_args(self) -> tuple:
        """This layer's part of a ``decode_layer`` call: (weights, biases, dims, eps, scale,
        window), built on first use."""
        attn = self.self_attn
        if self._decode_args is None:  # the weights the small-M kernel reads, once
            norm = self.input_layernorm
            qkv, o = attn.qkv_proj, attn.o_proj
            none = torch.empty(0)  # an empty weight: the model has no q/k norms
            if self.is_moe:  # (the MoE block's arguments are fused_args')
                gate_up = down = None
            else:
                gate_up, down = self.mlp.gate_up_proj, self.mlp.down_proj

            def f32(t: torch.Tensor | None) -> torch.Tensor | None:
                # norms and biases in fp32, the layer's activations (a bf16 model's once)
                return None if t is None else t.detach().float()

            weights = [f32(norm.weight), qkv.kernel_weight,
                       f32(attn.q_norm.weight) if attn.q_norm is not None else none,
                       f32(attn.k_norm.weight) if attn.k_norm is not None else none,
                       o.kernel_weight, f32(self.post_attention_layernorm.weight),
                       none if gate_up is None else gate_up.kernel_weight,
                       none if down is None else down.kernel_weight]
            dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
            linears = (qkv, o, gate_up, down)
            if self.fused_packed and gate_up is not None \
                    and all(m.prepacked_weight is not None for m in linears):
                # batches past the small-M kernel's rows: the weights packed once (gate_up
                # paired where it could be: the activation from the GEMM)
                weights += [m.prepacked_weight for m in linears]
                dims += [min(m.small_m_max_rows if m.small_m_kernel is not None else 0
                             for m in linears)] + [m.out_features for m in linears]
                dims.append(int(gate_up.prepacked_silu_mul is not None))
            mlp_biases = [None, None] if gate_up is None else [f32(gate_up.bias), f32(down.bias)]
            self._decode_args = (
                weights, [f32(qkv.bias), f32(o.bias), *mlp_biases],
                dims, norm.eps, attn.scale, attn.sliding_window or -1)
        return self._decode_args


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: embedding on the first stage, layers
    [start, end), final norm on the last. Other stages' layers are ``nn.Identity`` stand-ins
    (no parameters) so parameter names keep their global layer index."""

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, dtype: torch.dtype,
                 max_positions: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.dtype = dtype
        self.start_layer, self.end_layer = pp_layer_range(spec.num_layers, ctx.pp_rank,
                                                          ctx.pp_size)
        # one per distinct rule (Gemma 3 has two: its sliding and full layers' bases and
        # scalings; both matter, the bases may be equal)
        rotaries: dict[str, RotaryEmbedding] = {}

        def rotary(i: int) -> RotaryEmbedding:
            theta, scaling = spec.layer_rope(i)
            key = json.dumps([theta, scaling], sort_keys=True, default=str)
            if key not in rotaries:
                rotaries[key] = RotaryEmbedding(spec.head_dim, theta, scaling, max_positions,
                                                spec.max_position_embeddings, spec.rot_dim)
            return rotaries[key]

        self.embed_tokens = (VocabParallelEmbedding(ctx, spec.vocab_size, spec.hidden_size, dtype)
                             if ctx.is_first_stage or spec.tie_word_embeddings else None)
        # Gemma scales the embeddings by sqrt(hidden), the factor rounded to the model's dtype
        self.embed_scale = (torch.tensor(spec.hidden_size ** 0.5).to(dtype).item()
                            if spec.gemma_norms else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, ctx, i, rotary(i), dtype)
            if self.start_layer <= i < self.end_layer else nn.Identity()
            for i in range(spec.num_layers)
        )
        self.norm = make_norm(spec, spec.hidden_size, dtype) if ctx.is_last_stage else None

    def forward(self, input_ids: torch.Tensor | None, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                kv_caches: list[torch.Tensor | None] | None = None):
        """First stage: embed ``input_ids``; later stages: continue from ``hidden``/``residual``.
        ``kv_caches[i]`` is layer i's paged cache (None: attend within the batch only).
        Returns the final normed hidden states on the last stage, else (hidden, residual)."""
        if self.ctx.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        stacked = self._fused_decode_stack(hidden, residual, meta, kv_caches)
        if stacked is not None:
            hidden, residual = stacked
        else:
            for i in range(self.start_layer, self.end_layer):
                cache = kv_caches[i] if kv_caches is not None else None
                hidden, residual = self.layers[i](hidden, residual, meta, cache)
        # A bf16 model's fused decode layers leave fp32 activations: the next stage and
        # the LM head get the model's dtype.
        if not self.ctx.is_last_stage:
            return hidden.to(self.dtype), residual.to(self.dtype)
        hidden, _ = self.norm(hidden, residual)
        return hidden.to(self.dtype)

    # All of the stage's layers as one call of ``decode_layers`` (set by
    # use_fused_decode_layer): where every layer would take its fused call anyway.
    fused_decode_stack: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    fused_decode_stack_lora: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    _stack_args: tuple | None = None

    def _fused_decode_stack(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                            meta: AttentionMetadata,
                            kv_caches: list[torch.Tensor | None] | None
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stage's layers in one C++ call when the batch is one each layer would run
        as ``fused_decode`` (a layer's own check, on the first layer: the others see the
        same rows, contiguous outputs and their own caches); else None. Between per-layer
        calls the engine thread may give up the GIL to the server's threads and wait to get
        it back; one call for the stack avoids that."""
        if self.fused_decode_stack is None or kv_caches is None \
                or self.start_layer == self.end_layer:
            return None
        first = self.layers[self.start_layer]
        caches = kv_caches[self.start_layer:self.end_layer]
        if any(c is None for c in caches) \
                or not first.takes_fused_decode(hidden, residual, meta, caches[0]):
            return None
        if self._stack_args is None:  # the layers' arguments, gathered once
            layers = [self.layers[i] for i in range(self.start_layer, self.end_layer)]
            args = [layer.decode_args() for layer in layers]
            _, _, dims, eps, scale, _ = args[0]
            # each layer's MoE block (None: dense), or no list for a stage without one
            moe = [layer.mlp if layer.is_moe else None for layer in layers]
            self._stack_args = ([a[0] for a in args], [a[1] for a in args], dims, eps, scale,
                                [a[5] for a in args],
                                moe if any(b is not None for b in moe) else None)
        weights, biases, dims, eps, scale, windows, moe = self._stack_args
        cos, sin = first.self_attn.rotary.tables(meta.positions, meta.max_position)
        args = (hidden, residual, weights, biases, dims, eps, meta.positions, cos, sin, caches,
                meta.block_tables, meta.seq_lens, meta.slot_mapping, scale, windows)
        if moe is not None:  # (decode_layers_moe; a dense layer's MoE arguments are none)
            block = next(b for b in moe if b is not None)
            if not block.fused_counts(hidden.shape[0]):  # (one counter for every layer)
                return None
            return self.fused_decode_stack(
                *args, [[] if b is None else b.fused_args() for b in moe], block.fused_dims())
        if first.self_attn.qkv_proj.lora_active():
            if self.fused_decode_stack_lora is None:
                return None
            lora = [self.layers[i].lora_args() for i in range(self.start_layer, self.end_layer)]
            return self.fused_decode_stack_lora(
                *args, lora, first.self_attn.qkv_proj.lora.batch.row_slots)
        return self.fused_decode_stack(*args)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` projects the
    rows that need sampling, so prefill tokens that sample nothing cost no vocab matmul."""

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, dtype: torch.dtype,
                 max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.ctx = ctx
        self.model = LlamaModel(spec, ctx, dtype, max_positions)
        self.lm_head = None
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(ctx, spec.vocab_size, spec.hidden_size, dtype)
            if spec.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        # a sequence-classification head (whole on every rank of the last stage: it is small)
        self.score = None
        if ctx.is_last_stage and spec.head == "classify":
            self.score = nn.Linear(spec.hidden_size, spec.num_labels, bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor | None, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                kv_caches: list[torch.Tensor | None] | None = None):
        return self.model(input_ids, meta, hidden, residual, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits = self.lm_head.compute_logits(hidden)
        cap = self.spec.final_logit_softcap
        if cap is not None:  # Gemma 2: tanh(logits / cap) * cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classification head's logits of pooled hidden states (fp32)."""
        assert self.score is not None, "not a sequence-classification model"
        return F.linear(pooled.to(self.score.weight.dtype), self.score.weight).float()


def use_fused_decode_layer(model: nn.Module, kernel: Callable[..., tuple], max_rows: int,
                           stack: Callable[..., tuple] | None = None,
                           lora_kernels: tuple[Callable[..., tuple], Callable[..., tuple]]
                           | None = None,
                           moe_kernels: tuple[Callable[..., tuple], Callable[..., tuple]]
                           | None = None) -> None:
    """Run each decoder layer of decode batches of at most ``max_rows`` rows as one call of
    ``kernel`` (``decode_layer`` of :mod:`kvray.kernels.cpu_ops`' extension, which computes
    exactly what :meth:`LlamaDecoderLayer.forward` does with the same kernels in fp32; a
    bf16 model's layers compute there on fp32 activations: more precise than its bf16 path,
    and the small-M kernel's input). Only for one tensor-parallel rank (a TP layer
    all-reduces mid-layer, in Python) and the CPU kernels' paged cache; inputs that are not
    contiguous take the Python layer. With ``stack`` (``decode_layers``) a batch that every
    layer would take that way runs all of the stage's layers in one call. A model with MoE
    layers takes ``moe_kernels`` (``decode_layer_moe``, ``decode_layers_moe``: routing,
    experts and shared expert in the same call) where its blocks allow
    (:meth:`SparseMoeBlock.takes_fused_kernel`), without adapters; else, like Gemma's
    layers (sandwich norms, GELU, capped scores), the Python layer, and then no stage is
    one call. ``lora_kernels`` (``decode_layer_lora``, ``decode_layers_lora``) take batches
    with LoRA adapter rows the same way, once the layers have adapter slots
    (:class:`kvray.lora.layers.LoRAModel`); without them such batches take the Python
    layer."""
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    has_moe = any(m.is_moe for m in layers)
    fusable = [m for m in layers
               if m.takes_fused_kernel() and (moe_kernels is not None or not m.is_moe)]
    all_fused = len(fusable) == len(layers)
    for module in fusable:
        module.fused_decode, module.fused_decode_max_rows = \
            (moe_kernels[0] if module.is_moe else kernel), max_rows
        module.fused_decode_lora = lora_kernels[0] if lora_kernels and not has_moe else None
        module.fused_packed = not has_moe
        module._decode_args = module._lora_args = None
    for module in model.modules():
        if isinstance(module, LlamaModel):
            module.fused_decode_stack = (moe_kernels[1] if has_moe else stack) \
                if all_fused else None
            module.fused_decode_stack_lora = lora_kernels[1] \
                if all_fused and lora_kernels and not has_moe else None
            module._stack_args = None


def use_fused_ops(model: nn.Module, ops: ModuleType) -> None:
    """Route the decoder's norms, rotary embedding and MLP activation through fused ops
    (:mod:`kvray.kernels.cpu_ops` on CPU, :mod:`kvray.kernels.triton_ops` on GPU): one call
    each instead of several tiny PyTorch ops, whose dispatch (CPU) or launches (GPU) dominate
    a decode step's elementwise work. Where ``ops`` has them (Triton), also the rotary that
    writes the KV cache in the same launch and the norm that quantizes its output for an
    FP8 linear."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = ops.rms_norm
            module.fused_fp8 = getattr(ops, "rms_norm_fp8", None)
        elif isinstance(module, RotaryEmbedding):
            module.fused_inplace = ops.rotary_inplace
            module.fused_write = getattr(ops, "rotary_write_kv", None)
        elif isinstance(module, LlamaMLP):
            module.fused_silu_and_mul = ops.silu_and_mul
        elif isinstance(module, SparseMoeBlock):
            if hasattr(ops, "moe_route") and ops.vector_lanes() >= 8:
                module.fused_route = ops.moe_route
        elif isinstance(module, MoEExperts):
            module.fused_linear = getattr(ops, "expert_linear", None)
            module.fused_silu_and_mul = ops.silu_and_mul
            module.fused_moe = getattr(ops, "fused_moe", None)
            # (builds without vector kernels have no quantized products to run there)
            if hasattr(ops, "moe_experts") and ops.vector_lanes() >= 8:
                module.cpu_moe = ops.moe_experts
                module.cpu_moe_max_rows = ops.small_m_max_rows()

