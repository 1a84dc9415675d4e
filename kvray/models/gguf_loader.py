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

# GGUF architecture -> (HF architecture, HF config class name, permutes q/k)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", False),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", False),
}
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
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_REQUIRED = object()


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


def _hf_name(gguf_name: str, expert: int | None = None) -> str:
    """The Hugging Face name of a GGUF tensor (of one ``expert`` of a stacked one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _EXPERT_NAMES and expert is not None:
        return (f"model.layers.{m.group(1)}.mlp.experts.{expert}."
                f"{_EXPERT_NAMES[m.group(2)]}.{m.group(3)}")
    if not m or m.group(2) not in _LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor '{gguf_name}' has no Hugging Face equivalent")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _is_experts(gguf_name: str) -> bool:
    m = _BLOCK_RE.match(gguf_name)
    return bool(m) and m.group(2) in _EXPERT_NAMES


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
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.reader = gguf.GGUFReader(str(self.path))
        arch = _field(self.reader, "general.architecture")
        if arch not in _ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture '{arch}' is not supported; supported: {', '.join(_ARCHS)}")
        self.arch = arch
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise UnsupportedModelError(
                "GGUF with precomputed rope_freqs (Llama-3.1 rope scaling) is not supported; "
                "load the Hugging Face checkpoint instead")
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
        n_head = _number(r, f"{a}.attention.head_count", int)
        hidden = _number(r, f"{a}.embedding_length", int)
        kwargs = dict(
            architectures=[hf_arch],
            vocab_size=int(embd.shape[1]),
            hidden_size=hidden,
            intermediate_size=_number(r, f"{a}.feed_forward_length", int),
            num_hidden_layers=_number(r, f"{a}.block_count", int),
            num_attention_heads=n_head,
            num_key_value_heads=_number(r, f"{a}.attention.head_count_kv", int, n_head),
            head_dim=_number(r, f"{a}.attention.key_length", int, hidden // n_head),
            rms_norm_eps=_number(r, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-6),
            max_position_embeddings=_number(r, f"{a}.context_length", int, 2048),
            rope_theta=_number(r, f"{a}.rope.freq_base", float, 10000.0),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
            torch_dtype="bfloat16",
        )
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

    def iter_weights(self, keep_quantized: bool = True
                     ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """Yield (Hugging Face name, tensor) for every tensor: a QuantTensor where the
        block format has a kvray kind (and ``keep_quantized``), else fp32, dequantized."""
        import gguf

        from kvray.quant.gguf_blocks import to_quant_tensor

        permute = _ARCHS[self.arch][2]
        cfg = self.hf_config
        for t in self.reader.tensors:
            if _is_experts(t.name):
                yield from self._experts(t, keep_quantized)
                continue
            name = _hf_name(t.name)
            shape = tuple(reversed(t.shape.tolist()))
            if name.endswith("shared_expert_gate.weight"):  # one row; llama.cpp keeps it 1-D
                data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
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
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            data = np.asarray(data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
            if permute and ".q_proj." in name:
                data = _unpermute(data, cfg.num_attention_heads)
            elif permute and ".k_proj." in name:
                data = _unpermute(data, cfg.num_key_value_heads)
            yield name, torch.from_numpy(np.array(data, copy=True, order="C"))

    def _experts(self, t: Any, keep_quantized: bool
                 ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """A stacked expert tensor [experts, rows, K] as one tensor per expert."""
        import gguf

        from kvray.quant.gguf_blocks import to_quant_tensor

        experts, rows, k = reversed(t.shape.tolist())
        if keep_quantized:
            raw = np.asarray(t.data).reshape(experts * rows, -1)
            qt = to_quant_tensor(raw, t.tensor_type, (experts * rows, k))
            if qt is not None:
                for e in range(experts):
                    yield _hf_name(t.name, e), qt.narrow(0, e * rows, rows)
                return
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        data = data.reshape(experts, rows, k)
        for e in range(experts):
            yield _hf_name(t.name, e), torch.from_numpy(np.array(data[e], copy=True))

    def load_tokenizer(self) -> Any:
        """The tokenizer (with chat template) embedded in the GGUF, via transformers."""
        from kvray.tokenizer import load_tokenizer

        return load_tokenizer(self.path)
