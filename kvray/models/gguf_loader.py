"""Read a llama.cpp GGUF file as a Hugging Face config plus HF-named tensors.

Quantized tensors stay quantized: each block format kvray has kernels for (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K) is converted exactly into a
:class:`~kvray.quant.tensor.QuantTensor`;
the others (and every tensor with ``keep_quantized=False``) are dequantized with the
``gguf`` package to fp32 and cast to the model dtype by the loader. llama.cpp stores
Llama-architecture Q/K rows interleaved for its rotary kernel; they are permuted back to
the Hugging Face layout here (rows of blocks, so quantized ones too). A Qwen3-MoE or
Qwen2-MoE file (``qwen3moe``, ``qwen2moe``: its shared expert and that expert's gate as
tensors of their own), or a Mixtral one (``llama`` with an expert count), stores each
layer's experts stacked ([experts, rows, K], quantized row by row): they are yielded one
expert at a time under the hub's per-expert names, quantized ones as row ranges of one
converted matrix. A layer without a router is a dense one (``mlp_only_layers``).

Gemma 2 / 3 files store every RMSNorm weight as ``1 + w`` (llama.cpp's converter folds
Gemma's ``(1 + w)`` in): ``1`` is taken back off. Their query scale and sliding-window
layer pattern are not in the file: both are derived as llama.cpp derives them. A Phi-3
file keeps ``qkv_proj`` and ``gate_up_proj`` fused (``attn_qkv``, ``ffn_up``), as the hub
does. Rope scaling comes from the ``rope.scaling.*`` keys (linear, YaRN) and from the
tensors some converters write instead: Llama-3's ``rope_freqs`` (one divisor per
frequency) and Phi-3's ``rope_factors_short`` / ``rope_factors_long`` (LongRoPE), which
become the config's rope rule and are not weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvray.models.spec import UnsupportedModelError
from kvray.quant.tensor import QuantTensor
from kvray.tokenizer import open_gguf

# GGUF architecture -> (HF architecture, HF config class name, permutes q/k)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", False),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", False),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", False),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", False),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", False),
}
_GEMMA = ("gemma2", "gemma3")
# rope tensors that describe the rule, not weights
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
# stacked expert tensors: GGUF name -> the per-expert HF projection
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    # Qwen2-MoE's shared expert and its sigmoid gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# where an architecture names a layer tensor otherwise: Gemma's sandwich norms (its
# ffn_norm is the norm before the MLP, not after attention), Phi-3's fused projections
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# llama.cpp's n_layer of the 27B Gemmas, whose query scale is hidden / heads, not head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_REQUIRED = object()


def _positive(reader: Any, key: str, default: Any = _REQUIRED) -> int:
    """A count that must be at least 1 (a head count, a width); UnsupportedModelError
    naming the key otherwise."""
    value = _number(reader, key, int, default)
    if value < 1:
        raise UnsupportedModelError(f"GGUF metadata '{key}' = {value}: must be at least 1")
    return value


def _number(reader: Any, key: str, cast: type, default: Any = _REQUIRED) -> Any:
    """A numeric metadata value as ``cast``; UnsupportedModelError naming the key when it
    is missing (and required) or not one number (e.g. a per-layer array)."""
    value = _field(reader, key)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedModelError(f"GGUF metadata '{key}' is missing; the file cannot "
                                        "be read as this architecture")
        return default
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"GGUF metadata '{key}' = {str(value)[:60]}: expected "
                                    f"one {cast.__name__} (per-layer values are not "
                                    "supported)") from None


def _hf_name(gguf_name: str, arch: str = "llama", expert: int | None = None) -> str:
    """The Hugging Face name of a GGUF tensor of ``arch`` (of one ``expert`` of a stacked
    one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _EXPERT_NAMES and expert is not None:
        return (f"model.layers.{m.group(1)}.mlp.experts.{expert}."
                f"{_EXPERT_NAMES[m.group(2)]}.{m.group(3)}")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if not m or m.group(2) not in names:
        raise UnsupportedModelError(f"GGUF tensor '{gguf_name}' has no Hugging Face equivalent")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _is_experts(gguf_name: str) -> bool:
    m = _BLOCK_RE.match(gguf_name)
    return bool(m) and m.group(2) in _EXPERT_NAMES


def _readable(qtype: Any) -> bool:
    """Whether a GGML tensor type can be read as numbers (:func:`_dequantize`)."""
    import gguf

    traits = getattr(gguf.quants, "_type_traits", None)
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             gguf.GGMLQuantizationType.F64)
    return qtype in plain or traits is None or qtype in traits


def _dequantize(t: Any) -> np.ndarray:
    """A GGUF tensor's values as float32 (flat, in the file's order)."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.F64:
        return np.asarray(t.data).view(np.float64).astype(np.float32).ravel()
    try:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    except NotImplementedError:
        raise UnsupportedModelError(f"GGUF tensor '{t.name}' is stored as "
                                    f"{t.tensor_type.name}, which kvray cannot read") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's rotary row interleaving of a Q or K projection."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _row_order(rows: int, n_head: int) -> torch.Tensor:
    """The row indices :func:`_unpermute` takes, as a permutation of whole rows."""
    order = _unpermute(np.arange(rows), n_head)
    return torch.from_numpy(np.ascontiguousarray(order))


class GGUFCheckpoint:
    """A GGUF file opened for loading: ``hf_config`` and ``iter_weights()``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = open_gguf(self.path)
        except ValueError as err:  # truncated, not a GGUF, big-endian
            raise UnsupportedModelError(str(err)) from None
        arch = _field(self.reader, "general.architecture")
        if arch not in _ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture '{arch}' is not supported; supported: {', '.join(_ARCHS)}")
        self.arch = arch
        for t in self.reader.tensors:  # found here, not halfway through loading
            if not _readable(t.tensor_type):
                raise UnsupportedModelError(
                    f"GGUF tensor '{t.name}' is stored as {t.tensor_type.name}, which kvray "
                    "cannot read (it reads F32, F16, BF16, F64 and the quantized types "
                    "llama.cpp's gguf package dequantizes)")
        names = {t.name for t in self.reader.tensors}
        self.hf_config = self._build_config(names)

    def _build_config(self, names: set[str]) -> Any:
        import transformers

        a, r = self.arch, self.reader
        hf_arch, config_cls, _ = _ARCHS[a]
        experts = _number(r, f"{a}.expert_count", int, 0)
        if a == "llama" and experts:  # Mixtral: Llama's layout with an MoE MLP
            hf_arch, config_cls = "MixtralForCausalLM", "MixtralConfig"
        embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise UnsupportedModelError("GGUF without a 'token_embd.weight' tensor")
        n_head = _positive(r, f"{a}.attention.head_count")
        hidden = _positive(r, f"{a}.embedding_length")
        head_dim = _number(r, f"{a}.attention.key_length", int, hidden // n_head)
        rot_dim = _number(r, f"{a}.rope.dimension_count", int, head_dim)
        kwargs = dict(
            architectures=[hf_arch],
            vocab_size=int(embd.shape[1]),
            hidden_size=hidden,
            intermediate_size=_number(r, f"{a}.feed_forward_length", int),
            num_hidden_layers=_positive(r, f"{a}.block_count"),
            num_attention_heads=n_head,
            num_key_value_heads=_positive(r, f"{a}.attention.head_count_kv", n_head),
            head_dim=head_dim,
            rms_norm_eps=_number(r, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-6),
            max_position_embeddings=_number(r, f"{a}.context_length", int, 2048),
            rope_parameters=self._rope_rule(names, rot_dim),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
            pad_token_id=_field(r, "tokenizer.ggml.padding_token_id"),
            torch_dtype="bfloat16",
        )
        if rot_dim != head_dim:  # Phi-4-mini; an error for the families that rotate whole heads
            kwargs["rope_parameters"]["partial_rotary_factor"] = rot_dim / head_dim
        if a in _GEMMA:
            kwargs.update(self._gemma_fields(kwargs))
        elif a == "phi3":
            window = _number(r, f"{a}.attention.sliding_window", int, 0)
            kwargs.update(sliding_window=window or None, original_max_position_embeddings=(
                kwargs["rope_parameters"].get("original_max_position_embeddings")
                or kwargs["max_position_embeddings"]))
        if a in ("qwen2moe", "qwen3moe"):
            layers = kwargs["num_hidden_layers"]
            kwargs.update(
                num_experts=experts,
                num_experts_per_tok=_number(r, f"{a}.expert_used_count", int),
                moe_intermediate_size=_number(r, f"{a}.expert_feed_forward_length", int),
                # llama.cpp renormalises Qwen3-MoE's top-k weights, never Qwen2-MoE's
                norm_topk_prob=a == "qwen3moe", decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(layers)
                                 if f"blk.{i}.ffn_gate_inp.weight" not in names])
            if a == "qwen2moe":
                kwargs.update(shared_expert_intermediate_size=_number(
                    r, f"{a}.expert_shared_feed_forward_length", int))
        elif experts:  # Mixtral: the experts' width is feed_forward_length
            kwargs.update(num_local_experts=experts, sliding_window=None,
                          num_experts_per_tok=_number(r, f"{a}.expert_used_count", int))
        return getattr(transformers, config_cls)(**kwargs)

    def _rope_rule(self, names: set[str], rot_dim: int) -> dict[str, Any]:
        """The rope rule (``rope_parameters``) of the file's full-attention layers, from
        the ``rope.scaling.*`` keys or the rope tensors a converter wrote instead."""
        a, r = self.arch, self.reader
        rule: dict[str, Any] = {"rope_type": "default",
                                "rope_theta": _number(r, f"{a}.rope.freq_base", float, 10000.0)}
        kind = _field(r, f"{a}.rope.scaling.type")
        factor = _number(r, f"{a}.rope.scaling.factor", float, None)
        if kind is None and _field(r, f"{a}.rope.scale_linear") is not None:  # older files
            kind, factor = "linear", _number(r, f"{a}.rope.scale_linear", float)
        original = _number(r, f"{a}.rope.scaling.original_context_length", int, None)
        context = _number(r, f"{a}.context_length", int, 2048)
        if "rope_freqs.weight" in names:
            # Llama 3.1's rule written out: frequency i divided by rope_freqs[i] at every
            # position, which is LongRoPE with one set of factors and no attention factor
            factors = self._rope_factors("rope_freqs.weight", rot_dim)
            return rule | {"rope_type": "longrope", "short_factor": factors,
                           "long_factor": factors, "attention_factor": 1.0,
                           "original_max_position_embeddings": context}
        if "rope_factors_long.weight" in names:  # Phi-3's LongRoPE
            long = self._rope_factors("rope_factors_long.weight", rot_dim)
            short = (self._rope_factors("rope_factors_short.weight", rot_dim)
                     if "rope_factors_short.weight" in names else long)
            rule |= {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                     "original_max_position_embeddings": original or context}
            attention = _number(r, f"{a}.rope.scaling.attn_factor", float, None)
            return rule if attention is None else rule | {"attention_factor": attention}
        if kind in (None, "none"):
            return rule
        key = f"'{a}.rope.scaling.type' = '{kind}'"
        if kind not in ("linear", "yarn"):
            raise UnsupportedModelError(f"GGUF metadata {key} is not supported (supported: "
                                        "none, linear, yarn)")
        if factor is None:
            raise UnsupportedModelError(f"GGUF metadata {key} without "
                                        f"'{a}.rope.scaling.factor'")
        rule |= {"rope_type": kind, "factor": factor}
        if kind == "yarn":
            rule["original_max_position_embeddings"] = original or context
            for key, hf_key in (("yarn_beta_fast", "beta_fast"),
                                ("yarn_beta_slow", "beta_slow"),
                                ("yarn_attn_factor", "attention_factor")):
                value = _number(r, f"{a}.rope.scaling.{key}", float, None)
                if value is not None:
                    rule[hf_key] = value
        return rule

    def _rope_factors(self, name: str, rot_dim: int) -> list[float]:
        t = next(t for t in self.reader.tensors if t.name == name)
        values = _dequantize(t).ravel()
        if values.size != rot_dim // 2:
            raise UnsupportedModelError(f"GGUF tensor '{name}' holds {values.size} factors "
                                        f"for a rotary dim of {rot_dim} (need {rot_dim // 2})")
        return [float(v) for v in values]

    def _gemma_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Gemma 2 / 3's config fields. The file holds no query scale and (usually) no
        layer pattern: as llama.cpp takes them, the scale is head_dim except for the 27B
        models (hidden / heads), and every 2nd (Gemma 2) / 6th (Gemma 3) layer is global."""
        a, r = self.arch, self.reader
        layers, rule = kwargs["num_hidden_layers"], kwargs["rope_parameters"]
        window = _number(r, f"{a}.attention.sliding_window", int, 4096 if a == "gemma2" else 0)
        sliding = self._sliding_layers(layers, 2 if a == "gemma2" else 6) if window > 0 \
            else [False] * layers
        wide = layers == _GEMMA_27B_LAYERS[a]
        fields = dict(
            query_pre_attn_scalar=(kwargs["hidden_size"] // kwargs["num_attention_heads"]
                                   if wide else kwargs["head_dim"]),
            sliding_window=window or None,
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            final_logit_softcapping=_number(r, f"{a}.final_logit_softcapping", float, None))
        if a == "gemma2":
            fields["attn_logit_softcapping"] = _number(r, f"{a}.attn_logit_softcapping",
                                                       float, None)
        else:  # sliding layers turn at their own base, unscaled
            local = _number(r, f"{a}.rope.freq_base_swa", float, 10000.0)
            fields["rope_parameters"] = {
                "full_attention": rule,
                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        return fields

    def _sliding_layers(self, layers: int, every: int) -> list[bool]:
        """Which layers attend through the sliding window: the file's per-layer flags or
        pattern length, else llama.cpp's default (all but every ``every``-th layer)."""
        key = f"{self.arch}.attention.sliding_window_pattern"
        value = _field(self.reader, key)
        if isinstance(value, list):
            if len(value) != layers:
                raise UnsupportedModelError(f"GGUF metadata '{key}' has {len(value)} "
                                            f"entries for {layers} layers")
            return [bool(v) for v in value]
        n = every if value is None else _number(self.reader, key, int)
        return [n == 0 or i % n < n - 1 for i in range(layers)]

    def iter_weights(self, keep_quantized: bool = True
                     ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """Yield (Hugging Face name, tensor) for every tensor: a QuantTensor where the
        block format has a kvray kind (and ``keep_quantized``), else fp32, dequantized."""

        from kvray.quant.gguf_blocks import to_quant_tensor

        permute = _ARCHS[self.arch][2]
        cfg = self.hf_config
        for t in self.reader.tensors:
            if t.name in _ROPE_TENSORS:  # part of the config's rope rule
                continue
            if _is_experts(t.name):
                yield from self._experts(t, keep_quantized)
                continue
            name = _hf_name(t.name, self.arch)
            shape = tuple(reversed(t.shape.tolist()))
            if name.endswith("shared_expert_gate.weight"):  # one row; llama.cpp keeps it 1-D
                data = _dequantize(t)
                yield name, torch.from_numpy(np.array(data.reshape(1, -1), copy=True))
                continue
            qt = (to_quant_tensor(t.data, t.tensor_type, shape)
                  if keep_quantized and len(shape) == 2 else None)
            if qt is not None:
                if permute and ".q_proj." in name:
                    qt = qt.permute_rows(_row_order(shape[0], cfg.num_attention_heads))
                elif permute and ".k_proj." in name:
                    qt = qt.permute_rows(_row_order(shape[0], cfg.num_key_value_heads))
                yield name, qt
                continue
            data = _dequantize(t).reshape(tuple(reversed(t.shape.tolist())))
            if self.arch in _GEMMA and name.endswith("norm.weight"):
                data = data - 1.0  # stored as Gemma's 1 + w
            if permute and ".q_proj." in name:
                data = _unpermute(data, cfg.num_attention_heads)
            elif permute and ".k_proj." in name:
                data = _unpermute(data, cfg.num_key_value_heads)
            yield name, torch.from_numpy(np.array(data, copy=True, order="C"))

    def _experts(self, t: Any, keep_quantized: bool
                 ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """A stacked expert tensor [experts, rows, K] as one tensor per expert."""

        from kvray.quant.gguf_blocks import to_quant_tensor

        experts, rows, k = reversed(t.shape.tolist())
        if keep_quantized:
            raw = np.asarray(t.data).reshape(experts * rows, -1)
            qt = to_quant_tensor(raw, t.tensor_type, (experts * rows, k))
            if qt is not None:
                for e in range(experts):
                    yield _hf_name(t.name, self.arch, e), qt.narrow(0, e * rows, rows)
                return
        data = _dequantize(t)
        data = data.reshape(experts, rows, k)
        for e in range(experts):
            yield _hf_name(t.name, self.arch, e), torch.from_numpy(np.array(data[e], copy=True))

    def load_tokenizer(self) -> Any:
        """The tokenizer (with chat template) embedded in the GGUF, via transformers."""
        from kvray.tokenizer import load_tokenizer

        return load_tokenizer(self.path)
