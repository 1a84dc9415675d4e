"""Write a tiny Hugging Face model as a GGUF file the way llama.cpp's converter does
(llama.cpp names, Q/K rows interleaved for the Llama architecture), in F32 or with chosen
tensors quantized: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 by the ``gguf`` package, Q2_K/Q3_K/Q4_K/Q5_K/Q6_K
by the simple K-quant quantizers here (``gguf`` only reads K-quants), built block by block in
llama.cpp's layout."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _expert_tensors(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers' fused expert tensors as llama.cpp's stacked ones: gate_up_proj
    [E, 2 ff, H] -> ffn_gate_exps and ffn_up_exps [E, ff, H]; down_proj -> ffn_down_exps."""
    prefix = name.rsplit(".mlp.", 1)[0].replace("model.layers.", "blk.")
    if name.endswith("gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        return [(f"{prefix}.ffn_gate_exps.weight", gate), (f"{prefix}.ffn_up_exps.weight", up)]
    return [(f"{prefix}.ffn_down_exps.weight", data)]


# llama.cpp's names where an architecture differs: Gemma's sandwich norms, Phi-3's fused
# projections
_ARCH_LAYER = {
    "gemma": {"post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def _gguf_name(name: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, idx, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module == "mlp.gate":  # a MoE layer's router
        return f"blk.{idx}.ffn_gate_inp.{kind}"
    names = {**_LAYER, **_ARCH_LAYER.get("gemma" if arch.startswith("gemma") else arch, {})}
    return f"blk.{idx}.{names[module]}.{kind}"


def _add_tokenizer(w: gguf.GGUFWriter, tokenizer) -> None:
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    special = set(tokenizer.all_special_ids)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_scores([0.0] * len(tokens))
    merges = tokenizer.backend_tokenizer.model.get_merges() if hasattr(
        tokenizer.backend_tokenizer.model, "get_merges") else []
    w.add_token_merges([f"{a} {b}" if isinstance(a, str) else " ".join(a) for a, b in
                        [(m if isinstance(m, tuple) else tuple(m.split(" "))) for m in merges]]
                       if merges else [])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)


QK_K = 256  # values per K-quant super-block
# llama.cpp's Q4_K_M mix, simplified: V and down projections (and the head) in Q6_K.
Q4_K_M = {"*.v_proj.*": "Q6_K", "*.down_proj.*": "Q6_K", "lm_head.weight": "Q6_K", "*": "Q4_K"}
Q5_K_M = {**Q4_K_M, "*": "Q5_K"}
# llama.cpp's Q3_K_M and Q2_K mixes, simplified: the rest in Q3_K / Q2_K
Q3_K_M = {"*.v_proj.*": "Q5_K", "*.down_proj.*": "Q4_K", "lm_head.weight": "Q6_K", "*": "Q3_K"}
Q2_K_MIX = {"*.v_proj.*": "Q4_K", "lm_head.weight": "Q6_K", "*": "Q2_K"}


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [n, 2], the fp16 values back in fp32 [n, 1])."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8), h.astype(np.float32)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(by == 0, 0, x / np.where(by == 0, 1, by))


def _affine_k(x: np.ndarray, groups: int, levels: int, scale_max: int
              ) -> tuple[np.ndarray, ...]:
    """Per sub-block (``groups`` per super-block of 256), min/max -> an affine grid of
    ``levels`` codes whose scale and min are rounded to ``scale_max`` multiples of the
    super-block's fp16 d and dmin: (d bytes, dmin bytes, scales, mins, codes [blocks, 256])."""
    b = x.astype(np.float32).reshape(-1, groups, 256 // groups)
    lo = np.minimum(b.min(axis=2), 0)
    scale = (np.maximum(b.max(axis=2), lo) - lo) / (levels - 1)
    d_bytes, d = _f16(scale.max(axis=1) / scale_max)
    dmin_bytes, dmin = _f16(-lo.min(axis=1) / scale_max)
    sc = np.clip(np.rint(_divide(scale, d)), 0, scale_max).astype(np.uint8)
    m = np.clip(np.rint(_divide(-lo, dmin)), 0, scale_max).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * m)[..., None]
    q = np.clip(np.rint(_divide(b + offset, step)), 0, levels - 1).astype(np.uint8)
    return d_bytes, dmin_bytes, sc, m, q.reshape(-1, 256)


def _k_scales_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins -> Q4_K / Q5_K's 12 bytes (inverse of gguf's get_scale_min)."""
    return np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                           (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)


def _bits_to_plane(bits: np.ndarray) -> np.ndarray:
    """[blocks, count * 32] bits (run i of 32) -> [blocks, 32] bytes, bit i of byte l."""
    runs = bits.reshape(bits.shape[0], -1, 32).astype(np.uint8)
    return np.bitwise_or.reduce(runs << np.arange(runs.shape[1], dtype=np.uint8)[None, :, None],
                                axis=1)


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """[blocks, 256] 2-bit codes -> Q2_K / Q3_K's 64 bytes (each half's 32 bytes hold four
    runs of 32, at shifts 0, 2, 4, 6)."""
    runs = q.reshape(-1, 2, 4, 32) & 3
    return np.bitwise_or.reduce(runs << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :,
                                                                                 None],
                                axis=2).reshape(-1, 64)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """fp32 [N, K] (K % 256 == 0) -> Q4_K bytes [N, K / 256 * 144]: per sub-block of 32,
    min/max -> a 4-bit affine grid, its scale and min rounded to 6 bits of the super-block's
    fp16 d and dmin (llama.cpp's layout; a plainer fit than its make_qkx2_quants)."""
    d_bytes, dmin_bytes, sc, m, q = _affine_k(x, 8, 16, 63)
    q = q.reshape(-1, 4, 2, 32)  # 32 bytes hold sub-blocks 2i (low) and 2i + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d_bytes, dmin_bytes, _k_scales_bytes(sc, m), qs],
                          axis=1).reshape(x.shape[0], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """fp32 [N, K] -> Q5_K bytes [N, K / 256 * 176]: Q4_K's fit with 32 levels, the 5th bit
    of value l of sub-block i at bit i of qh byte l."""
    d_bytes, dmin_bytes, sc, m, q = _affine_k(x, 8, 32, 63)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d_bytes, dmin_bytes, _k_scales_bytes(sc, m),
                           _bits_to_plane(q >> 4), qs], axis=1).reshape(x.shape[0], -1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """fp32 [N, K] -> Q3_K bytes [N, K / 256 * 110]: per sub-block of 16 a symmetric grid
    of codes -4..3 whose scale is a 6-bit (offset 32) multiple of the fp16 d."""
    b = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(b).max(axis=2) / 4
    d_bytes, d = _f16(scale.max(axis=1) / 31)
    sc = np.clip(np.rint(_divide(scale, d)), -32, 31).astype(np.int16)
    q = np.clip(np.rint(_divide(b, (d * sc)[..., None])), -4, 3).astype(np.int16) + 4
    q = q.astype(np.uint8).reshape(-1, 256)
    s6 = (sc + 32).astype(np.uint8)  # 6 bits: low nibbles in 8 bytes, high pairs in 4
    packed = np.concatenate([s6[:, :8] & 0x0F | ((s6[:, 8:] & 0x0F) << 4),
                             np.bitwise_or.reduce((s6 >> 4).reshape(-1, 4, 4) << np.array(
                                 [0, 2, 4, 6], dtype=np.uint8)[None, :, None], axis=1)],
                            axis=1)
    return np.concatenate([_bits_to_plane(q >> 2), _two_bit_bytes(q), packed, d_bytes],
                          axis=1).reshape(x.shape[0], -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """fp32 [N, K] -> Q2_K bytes [N, K / 256 * 84]: per sub-block of 16 an affine grid of
    4 levels, its scale and min 4-bit multiples of the fp16 d and dmin."""
    d_bytes, dmin_bytes, sc, m, q = _affine_k(x, 16, 4, 15)
    return np.concatenate([sc | (m << 4), _two_bit_bytes(q), d_bytes, dmin_bytes],
                          axis=1).reshape(x.shape[0], -1)


K_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k,
                "Q5_K": quantize_q5_k}


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """fp32 [N, K] (K % 256 == 0) -> Q6_K bytes [N, K / 256 * 210]: per sub-block of 16,
    a symmetric 6-bit grid whose scale is an int8 multiple of the super-block's fp16 d."""
    n = x.shape[0]
    b = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(b).max(axis=2) / 31
    d_bytes, d = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(_divide(scale, d)), 0, 127).astype(np.int8)
    q = np.clip(np.rint(_divide(b, (d * sc)[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    qh = _two_bit_bytes((q >> 4).reshape(-1, 256))  # top 2 bits of value 32 t + j: bits 2 t
    return np.concatenate([ql.reshape(-1, 128), qh, sc.view(np.uint8),
                           d_bytes], axis=1).reshape(n, -1)


# llama.cpp's type for a K-quant tensor whose rows cannot hold a super-block of 256 (Q2_K
# and Q3_K go to IQ4_NL there, which the gguf package cannot write: Q4_0 here)
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def quantize(x: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[
        np.ndarray, gguf.GGMLQuantizationType]:
    """``x`` [N, K] as ``qtype`` bytes, following llama.cpp's fallbacks: a K-quant needs
    K % 256 == 0 (else :data:`K_FALLBACK`), a 32-block type K % 32 == 0 (else F32)."""
    types = gguf.GGMLQuantizationType
    if qtype.name in K_FALLBACK and x.shape[1] % QK_K:
        qtype = types[K_FALLBACK[qtype.name]]
    if qtype == types.F32 or x.shape[1] % 32:
        return np.ascontiguousarray(x, dtype=np.float32), types.F32
    if qtype.name in K_QUANTIZERS:
        return K_QUANTIZERS[qtype.name](x), qtype
    if qtype == types.Q6_K:
        return quantize_q6_k(x), qtype
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype), qtype


def _chosen_type(name: str, quant: Mapping[str, str | gguf.GGMLQuantizationType]
                 ) -> gguf.GGMLQuantizationType:
    for pattern, qtype in quant.items():
        if fnmatch.fnmatchcase(name, pattern):
            return gguf.GGMLQuantizationType[qtype] if isinstance(qtype, str) else qtype
    return gguf.GGMLQuantizationType.F32


def write_gguf(model_dir: str | Path, out: str | Path,
               quant: Mapping[str, str | gguf.GGMLQuantizationType] | None = None) -> Path:
    """Convert the HF model in ``model_dir`` (llama, mistral, qwen2, qwen3, qwen2_moe,
    qwen3_moe, mixtral, gemma2, gemma3_text or phi3) to a GGUF, as llama.cpp's converter
    does: a MoE router (and Qwen2-MoE's shared-expert gate, 1-D) stays F32 and expert tensors
    are stacked per layer; Gemma's norms are stored as ``1 + w``, its head tied, its rope
    base written for Gemma 3 only; Phi-3 keeps its fused tensors and writes its LongRoPE
    factors as tensors, as Llama-3 rope scaling goes into ``rope_freqs``; linear and YaRN
    rules into ``rope.scaling.*`` keys.

    ``quant`` maps fnmatch patterns of Hugging Face tensor names to GGUF types ("Q4_K" or
    ``GGMLQuantizationType.Q4_K``); the first matching pattern wins, unmatched tensors stay
    F32, and so do 1-D tensors (norms, biases) as in llama.cpp. E.g. ``{"*": "Q8_0"}``, or
    :data:`Q4_K_M`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama",
            "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}[cfg.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch != "phi3":  # (its converter leaves the head size to hidden / heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch not in ("gemma2", "gemma3", "phi3"):
        w.add_vocab_size(cfg.vocab_size)
    extra = _add_rope(w, arch, cfg, head_dim)
    if arch.startswith("gemma"):
        _add_gemma(w, arch, cfg)
    elif arch == "phi3":
        w.add_sliding_window(cfg.sliding_window or 0)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    elif cfg.model_type == "mixtral":  # llama.cpp writes Mixtral as llama with experts
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    _add_tokenizer(w, tokenizer)
    for name, data in extra:
        w.add_tensor(name, data)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or arch == "gemma2"):
            continue  # (Gemma 2's converter drops it whatever the config says)
        data = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        if data.ndim == 3:  # stacked experts, quantized row by row
            qtype = _chosen_type(name, quant or {})
            for gname, part in _expert_tensors(name, data):
                e, rows, k = part.shape
                raw, qt = quantize(part.reshape(e * rows, k), qtype)
                w.add_tensor(gname, raw.reshape(e, rows, -1), raw_dtype=None if qt ==
                             gguf.GGMLQuantizationType.F32 else qt)
            continue
        if name.endswith("mlp.gate.weight"):  # the router: F32, as llama.cpp keeps it
            w.add_tensor(_gguf_name(name), data)
            continue
        if name.endswith("shared_expert_gate.weight"):  # [1, H]: llama.cpp's is 1-D, F32
            w.add_tensor(_gguf_name(name), data.reshape(-1))
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        qtype = _chosen_type(name, quant or {}) if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        data, qtype = quantize(data, qtype)
        w.add_tensor(_gguf_name(name, arch), data, raw_dtype=None if qtype ==
                     gguf.GGMLQuantizationType.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def _add_rope(w: gguf.GGUFWriter, arch: str, cfg, head_dim: int
              ) -> list[tuple[str, np.ndarray]]:
    """Write the rope keys of ``cfg`` as llama.cpp's converter does; return the rope tensors
    it writes instead of keys (Llama-3's ``rope_freqs``, Phi-3's LongRoPE factors)."""
    params = dict(cfg.rope_parameters)
    if arch == "gemma3":  # the global layers' rule; the sliding ones' base in its own key
        w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
        params = dict(params["full_attention"])
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if arch != "gemma2":  # its converter writes neither base nor rotary dims
        w.add_rope_freq_base(params["rope_theta"])
    if not arch.startswith("gemma"):
        w.add_rope_dimension_count(rot_dim)
    kind, factor = params.get("rope_type", "default"), params.get("factor")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if params.get(key) is not None:
                add(params[key])
    elif kind == "llama3":  # one divisor per frequency, as the converter computes them
        inv = 1.0 / params["rope_theta"] ** (np.arange(0, rot_dim, 2) / rot_dim)
        wavelen = 2 * math.pi / inv
        old = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        smooth = (old / wavelen - low) / (high - low)
        divisors = np.where(wavelen < old / high, 1.0, np.where(
            wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        return [("rope_freqs.weight", divisors.astype(np.float32))]
    elif kind == "longrope":
        original = cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        return [(f"rope_factors_{which}.weight",
                 np.asarray(params[f"{which}_factor"], np.float32)) for which in ("long", "short")]
    return []


def _add_gemma(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """Gemma's keys: the caps (Gemma 3 has only the final one) and the window. The layer
    pattern and query scale are not written (readers derive them, as llama.cpp does)."""
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def dequantized_reference(model_dir: str | Path,
                          quant: Mapping[str, str | gguf.GGMLQuantizationType]
                          ) -> transformers.PreTrainedModel:
    """The HF model with every weight ``write_gguf(..., quant=quant)`` quantizes replaced by
    its quantize -> dequantize round trip: what any reader of that GGUF must compute (rows
    are quantized independently, so llama.cpp's Q/K row interleaving does not change it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() not in (2, 3) or name.endswith(("mlp.gate.weight",
                                                         "shared_expert_gate.weight")):
                continue
            rows = p.reshape(-1, p.shape[-1]).numpy()  # stacked experts: row by row
            data, qtype = quantize(rows, _chosen_type(name, quant))
            back = gguf.quants.dequantize(data, qtype).reshape(p.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return model


def bare_llama_gguf(path: str | Path, entries: Mapping,
                    endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A llama GGUF of ``entries`` (ints: uint32 keys, strings: string keys, lists: array
    keys, arrays named ``*.weight``: tensors) plus a zero embedding, no tokenizer, in
    ``endianess``."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for key, v in entries.items():
        if key.endswith(".weight") and isinstance(v, tuple):  # (values, GGML type)
            w.add_tensor(key, v[0], raw_dtype=v[1])
        elif key.endswith(".weight"):
            w.add_tensor(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_uint32(key, v)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
