"""Small random-weight Hugging Face models of every supported architecture, saved with
``save_pretrained`` together with a small trained BPE tokenizer and a chat template."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! kvray serves language models with a paged KV cache on Ray.",
    "Once upon a time there was a small model that generated tokens one at a time.",
    "numbers 0123456789 and symbols .,;:!?()[]{}<>+-*/=_ and unicode: héllo, 日本語, 🙂",
]

_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# name -> (config class, overrides)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("LlamaConfig", {}),
    "llama3_rope_tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=None, num_key_value_heads=4)),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_qknorm_headdim": ("Qwen3Config", dict(head_dim=24, num_key_value_heads=2)),
    # rope scaling: YaRN (interpolated low frequencies, cos/sin scaled), LongRoPE (its short
    # factors below the original context, and the attention factor)
    "llama_yarn": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256})),
    "llama_longrope": ("LlamaConfig", dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0,
        "original_max_position_embeddings": 1024,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]})),
    # mixture of experts: Mixtral (renormalised top-2 of 4), Qwen2-MoE (shared expert and
    # its gate, a dense layer among MoE ones, top-2 of 6 not renormalised), Qwen3-MoE (q/k
    # norms, top-2 of 8 renormalised)
    "mixtral_moe": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                          intermediate_size=96, sliding_window=None)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         head_dim=24)),
    # Phi-3: fused qkv_proj / gate_up_proj tensors, LongRoPE in its own config fields
    "phi3_longrope": ("Phi3Config", dict(
        max_position_embeddings=4096, original_max_position_embeddings=1024, pad_token_id=0,
        sliding_window=None, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.05, 1.2, 1.4, 1.7, 2.0, 2.4, 2.9],
            "long_factor": [1.0, 1.4, 2.2, 3.5, 5.0, 8.0, 11.0, 15.0]})),
    # Phi-4-mini: Phi-3's layout with partial rotary (the leading 3/4 of each head turns,
    # LongRoPE over those dims)
    "phi4_partial_rotary": ("Phi3Config", dict(
        max_position_embeddings=4096, original_max_position_embeddings=1024, pad_token_id=0,
        sliding_window=None, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 12.0]})),
    # Gemma 2: (1 + w) sandwich norms, scaled embeddings, tanh GELU, query_pre_attn_scalar,
    # capped attention scores and logits, alternating sliding-window layers
    "gemma2_softcap": ("Gemma2Config", dict(
        head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0, sliding_window=8, pad_token_id=0)),
    # Gemma 3 (text): q/k norms, a rope base per layer type (linear x8 on the global layers)
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}})),
}
MOE_ARCHS = ("mixtral_moe", "qwen2_moe_shared", "qwen3_moe")
# layers the fused C++ decode layer does not compute (Gemma's norms / GELU / caps, partial
# rotary)
UNFUSED_ARCHS = ("gemma2_softcap", "gemma3_text", "phi4_partial_rotary")


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(arch: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a random ``arch`` model (fp32) and tokenizer to ``path``; return the path."""
    cls_name, arch_overrides = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**_BASE, **arch_overrides, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than default init so logits are not all near-uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" not in "".join(n for n, q in model.named_parameters() if q is p):
                p.normal_(0, 0.02)
    path = Path(path)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def load_hf(path: str | Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True).eval()


def runner_facts(llm) -> SimpleNamespace:
    """What the tests check of an in-process engine's model runner, read before
    ``llm.shutdown()`` (which frees the runner's model, KV cache and CUDA graphs): attention
    backend, pinned inputs, whether every MoE layer has the fused-MoE kernel, KV blocks
    allocated and the decode graphs' counters (``graphs`` None when the runner has none;
    ``graphs.captured`` lists the sizes with a CUDA graph)."""
    runner = llm.llm_engine.executor.worker.runner
    graphs = None
    if runner.graphs is not None:
        g = runner.graphs
        graphs = SimpleNamespace(captured=sorted(g.graphs), steps=g.steps,
                                 padded_rows=g.padded_rows, sizes=list(g.sizes),
                                 pad_block=g.pad_block)
    from kvray.models.moe import MoEExperts

    experts = [m for m in runner.model.modules() if isinstance(m, MoEExperts)]
    return SimpleNamespace(attention_backend=runner.attention_backend,
                           pin_memory=runner.pin_memory,
                           fused_moe=bool(experts) and all(m.fused_moe is not None
                                                           for m in experts),
                           kv_blocks=runner.cache.kv_caches[runner.model.model.start_layer]
                           .shape[2], graphs=graphs)


def transformers_greedy(model_dir, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' own ``generate`` (fp32, EOS ignored) for prompts given
    as ``{"prompt_token_ids": [...]}``: the reference the parity tests compare kvray against."""
    import torch

    hf = load_hf(model_dir)
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p["prompt_token_ids"]]), max_new_tokens=max_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0
                            )[0, len(p["prompt_token_ids"]):].tolist() for p in prompts]
