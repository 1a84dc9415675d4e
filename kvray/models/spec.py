"""The architecture facts kvray needs, read once from a Hugging Face config.

The Llama family differs in a handful of switches (biases, q/k norm, rope scaling,
sliding windows, tied embeddings); :class:`ModelSpec` names them so the model code
has no per-architecture branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvray.kernels.rotary import SUPPORTED_ROPE_TYPES, rope_type

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# Pooling models of the dense families: the base model alone (``*Model``: embedding
# checkpoints such as sentence-transformers' decoders) and ``*ForSequenceClassification``
# (a ``score`` head of num_labels rows over the last token: rerankers, classifiers).
POOLING_HEADS = {"Model": "embed", "ForSequenceClassification": "classify"}
for _stem, _family in (("Llama", "llama"), ("Mistral", "mistral"), ("Qwen2", "qwen2"),
                       ("Qwen3", "qwen3")):
    for _suffix in POOLING_HEADS:
        SUPPORTED_ARCHITECTURES[f"{_stem}{_suffix}"] = _family
_GEMMA_FAMILIES = ("gemma2", "gemma3")
_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP
    # Gemma 2 / 3
    hidden_act: str = "silu"
    gemma_norms: bool = False  # (1 + w) RMSNorms, four per layer (sandwich), scaled embeddings
    query_pre_attn_scalar: float | None = None  # attention scale ** -0.5 instead of head_dim
    attn_logit_softcap: float | None = None  # tanh(s / cap) * cap on attention scores
    final_logit_softcap: float | None = None  # ... and on the logits
    local_rope_theta: float | None = None  # sliding-window layers' own rope base (Gemma 3)
    # leading dims of each head the rotary embedding turns (partial_rotary_factor, Phi-4's
    # 0.75; the rest pass through); 0: all of head_dim
    rotary_dim: int = 0
    # lm: a language model; embed: the base model only (pooling; the LM head borrows the
    # embeddings); classify: a score head of num_labels rows (pooling)
    head: str = "lm"
    num_labels: int = 0
    labels: tuple[str, ...] = ()  # a classifier's class names (config.id2label), by index

    @property
    def is_pooling_model(self) -> bool:
        """Serves embeddings / scores only: no language-model head of its own."""
        return self.head != "lm"

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_rope(self, i: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of layer i's rotary embedding."""
        if self.local_rope_theta is not None and self.layer_windows[i] is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Build from a ``transformers.PretrainedConfig``; raise UnsupportedModelError if
        the architecture or an option (activation, rope type) is not one kvray runs."""
        arch = _architecture(config)
        family = SUPPORTED_ARCHITECTURES[arch]
        act_key = "hidden_activation" if family in _GEMMA_FAMILIES else "hidden_act"
        act = getattr(config, act_key, None) or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"{arch}: {act_key} '{act}' is not supported "
                                        f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        theta, scaling, local_theta, partial = _rope(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rotary_dim = _rotary_dim(arch, family, head_dim, partial)
        # transformers reads these keys for some families only; the others' layers have
        # their biases fixed (Qwen2's q/k/v always, Mistral's and Phi-3's none; Qwen2-MoE
        # reads qkv_bias)
        attention_bias = family in _ATTENTION_BIAS_FAMILIES and bool(
            getattr(config, "attention_bias", False))
        if family == "gemma3" and getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{arch}: use_bidirectional_attention = true is not "
                                        "supported (kvray's attention is causal)")
        head = next((h for suffix, h in POOLING_HEADS.items()
                     if arch.endswith(suffix) and not arch.endswith("ForCausalLM")), "lm")
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=head != "lm" or bool(getattr(config, "tie_word_embeddings",
                                                                 False)),
            qkv_bias=(family == "qwen2" or attention_bias
                      or (family == "qwen2_moe" and bool(getattr(config, "qkv_bias", True)))),
            o_bias=attention_bias,
            mlp_bias=family == "llama" and bool(getattr(config, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            layer_windows=_layer_windows(config, family),
            eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
            torch_dtype=_dtype_name(getattr(config, "dtype", None)
                                    or getattr(config, "torch_dtype", None)),
            **(_moe_fields(config, family) if family in _MOE_FAMILIES else {}),
            hidden_act=act,
            local_rope_theta=local_theta,
            **(_gemma_fields(config, family) if family in _GEMMA_FAMILIES else {}),
            head=head,
            num_labels=int(getattr(config, "num_labels", 0) or 0) if head == "classify" else 0,
            labels=_labels(config) if head == "classify" else (),
        )


def _labels(config: Any) -> tuple[str, ...]:
    """The classes' names by index (``LABEL_i`` where the config names none)."""
    names = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    count = int(getattr(config, "num_labels", 0) or 0)
    return tuple(names.get(i, f"LABEL_{i}") for i in range(count))


def _gemma_fields(config: Any, family: str) -> dict[str, Any]:
    """Gemma 2 / 3's switches. Gemma 3's ``attn_logit_softcapping`` is not applied by
    transformers (its attention never receives it): ignored likewise."""
    return dict(gemma_norms=True,
                query_pre_attn_scalar=float(config.query_pre_attn_scalar),
                attn_logit_softcap=(getattr(config, "attn_logit_softcapping", None)
                                    if family == "gemma2" else None) or None,
                final_logit_softcap=getattr(config, "final_logit_softcapping", None) or None)


def _moe_fields(config: Any, family: str) -> dict[str, Any]:
    """The MoE switches of a Mixtral / Qwen2-MoE / Qwen3-MoE config (transformers' names;
    Qwen3-MoE's saved configs may say ``num_local_experts`` for ``num_experts``)."""
    n = config.num_hidden_layers
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    top_k = getattr(config, "num_experts_per_tok", 0)
    if not experts or not 0 < top_k <= experts:
        raise UnsupportedModelError(f"{family}: num_experts_per_tok = {top_k} with "
                                    f"{experts} experts")
    if family == "mixtral":  # every layer, the experts as wide as intermediate_size
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=config.intermediate_size, norm_topk_prob=True,
                    moe_layers=(True,) * n)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return dict(
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        shared_expert_intermediate_size=(getattr(config, "shared_expert_intermediate_size", 0)
                                         if family == "qwen2_moe" else 0) or 0,
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n)))


def _architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    # a config without architectures is its family's language model (transformers'
    # AutoModelForCausalLM), never one of the pooling heads listed after it
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items() if k.endswith("ForCausalLM")}
    by_type["gemma3_text"] = "Gemma3ForCausalLM"  # Gemma3TextConfig's model_type
    model_type = getattr(config, "model_type", None)
    if not archs and model_type in by_type:
        return by_type[model_type]
    raise UnsupportedModelError(
        f"architecture {archs or model_type!r} is not supported; kvray runs "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rotary_dim(arch: str, family: str, head_dim: int, partial: float) -> int:
    """The rotated dims of a head for ``partial_rotary_factor`` (0: all of them). Phi-3's
    code rotates the leading int(head_dim * factor) dims and passes the rest (Phi-4-mini:
    0.75); the Llama-family code rotates whole heads, so a factor there is an error."""
    if partial == 1.0:
        return 0
    if family != "phi3":
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor {partial} is supported "
                                    "for the Phi-3 family only (its code rotates part of a "
                                    "head)")
    dim = int(head_dim * partial)
    if not 0 < dim <= head_dim or dim % 2:
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor {partial} gives {dim} "
                                    f"rotated dims of {head_dim}: not a positive even number")
    return 0 if dim == head_dim else dim


def _rope(config: Any) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling, the sliding layers' own theta or None, partial_rotary_factor).
    Gemma 3 keys its ``rope_parameters`` by layer type: full-attention layers take the
    scaled rule, sliding ones a plain rope of their own base."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    local_theta = None
    if isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention") or {}
        if rope_type(local) != "default":
            raise UnsupportedModelError(
                f"rope_parameters.sliding_attention: rope type '{rope_type(local)}' is not "
                "supported for sliding-window layers (only default)")
        local_theta = float(local.get("rope_theta", 10000.0))
        params = dict(params["full_attention"])
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type '{kind}' is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    partial = float(params.pop("partial_rotary_factor", None)
                    or getattr(config, "partial_rotary_factor", None) or 1.0)
    return theta, (params if kind != "default" else None), local_theta, partial


def _layer_windows(config: Any, family: str) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    if family in ("mistral", "mixtral", "phi3"):
        return (window,) * n
    if family in _GEMMA_FAMILIES:  # sliding layers by layer_types, whatever other switches say
        types = getattr(config, "layer_types", None) or ()
        return tuple(window if t == "sliding_attention" else None for t in types) \
            if window and types else (None,) * n
    if family == "qwen3_moe":  # one switch for every layer
        return (window if getattr(config, "use_sliding_window", False) else None,) * n
    layer_types = getattr(config, "layer_types", None)
    if window and getattr(config, "use_sliding_window", False) and layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
