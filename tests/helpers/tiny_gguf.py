"""Write a tiny Hugging Face model as a GGUF file the way llama.cpp's converter does
(F32 tensors, llama.cpp names, Q/K rows interleaved for the Llama architecture)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import transformers

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, idx, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{idx}.{_LAYER[module]}.{kind}"


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


def write_gguf(model_dir: str | Path, out: str | Path) -> Path:
    """Convert the HF model in ``model_dir`` (llama or qwen2 family) to an F32 GGUF."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[
        cfg.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(w, tokenizer)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
