"""kvray's engine against transformers (fp32, greedy) on seeded random model shapes of every
family: head counts and sizes, GQA groups down to one KV head, odd widths, biases, tied
embeddings, rope scalings, sliding windows, expert counts and top-k, shared experts and
dense layers among MoE ones, under random block sizes, token budgets and cache sizes.

The fixed tiny models of ``tests/helpers/tiny_models.py`` pin each feature once; shapes
between them broke before (one KV head under Qwen3's q/k norms, Gemma 3 with one rope base
for both layer types, a zero-width shared expert), so this draws new ones, reproducibly.
Tokens may differ only where transformers' own top two logits nearly tie."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from kvray import LLM, SamplingParams
from tests.helpers.tiny_models import VOCAB_SIZE, build_tokenizer

pytestmark = pytest.mark.parity

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
            "qwen2_moe", "qwen3_moe"]
CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                "qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma2": "Gemma2Config",
                "gemma3": "Gemma3TextConfig", "mixtral": "MixtralConfig",
                "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}
# families whose config takes head_dim apart from hidden_size / heads
FREE_HEAD_DIM = {"llama", "qwen3", "gemma2", "gemma3", "qwen3_moe", "mistral", "mixtral"}
MAX_TOKENS = 10
NEAR_TIE = 1e-3  # of the largest logit's magnitude


def _rope(rng: random.Random, family: str, rot_half: int) -> dict | None:
    kinds = ["default", "longrope"] if family == "phi3" else \
        ["default", "linear", "dynamic", "yarn", "llama3"] + (["longrope"] * (family == "llama"))
    kind = rng.choice(kinds)  # (Phi-3's config reads yarn as its own LongRoPE)
    theta = rng.choice([10000.0, 500000.0])
    if kind == "default":
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": kind, "rope_theta": theta, "factor": rng.choice([2.0, 4.0, 8.0])}
    if kind in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = 64
    if kind == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "longrope":
        del params["factor"]
        params["short_factor"] = [1.0 + 0.1 * i for i in range(rot_half)]
        params["long_factor"] = [1.0 + 0.7 * i for i in range(rot_half)]
    return params


def random_config(seed: int) -> tuple[str, dict]:
    """(config class name, kwargs) of a valid random tiny model; the family cycles with
    the seed so every family gets drawn."""
    rng = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    heads = rng.choice([1, 2, 3, 4, 6])
    kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim = rng.choice([8, 16, 24, 32])
    # (transformers wants hidden_size a multiple of the heads even where head_dim is free)
    hidden = heads * rng.choice([8, 12, 16, 20]) if family in FREE_HEAD_DIM \
        else heads * head_dim
    layers = rng.choice([2, 3, 4])
    kw: dict = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads,
                    intermediate_size=rng.choice([40, 50, 96, 100]),
                    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, tie_word_embeddings=rng.random() < 0.4)
    if family in FREE_HEAD_DIM:
        kw["head_dim"] = head_dim
    window = rng.choice([None, 4, 7, 12])
    rot_half = head_dim // 2
    if family == "phi3" and rng.random() < 0.5:  # Phi-4-mini's partial rotary
        kw["partial_rotary_factor"] = 0.5
        rot_half = head_dim // 4
    if family in ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe",
                  "qwen3_moe"):
        kw["rope_parameters"] = _rope(rng, family, rot_half)
        if "partial_rotary_factor" in kw:
            kw["rope_parameters"]["partial_rotary_factor"] = kw.pop("partial_rotary_factor")
    if family == "llama":
        kw.update(attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.3)
    if family in ("mistral", "mixtral", "phi3"):
        kw["sliding_window"] = window
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and window:
        kw.update(use_sliding_window=True, sliding_window=window, max_window_layers=layers)
    if family in ("gemma2", "gemma3"):
        kw.update(sliding_window=window or 6, query_pre_attn_scalar=rng.choice([16, 24, 64]),
                  layer_types=[rng.choice(["sliding_attention", "full_attention"])
                               for _ in range(layers)])
    if family == "gemma2":
        kw.update(attn_logit_softcapping=rng.choice([None, 5.0, 30.0]),
                  final_logit_softcapping=rng.choice([None, 10.0, 30.0]))
    if family == "gemma3":
        full = rng.choice([{"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0}])
        kw["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {**full, "rope_theta": rng.choice([10000.0, 1000000.0])}}
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        experts = rng.choice([3, 4, 5, 8])
        top_k = rng.randint(1, experts)
        if family == "mixtral":
            kw.update(num_local_experts=experts, num_experts_per_tok=top_k)
        else:
            kw.update(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=rng.choice([24, 32, 48]),
                      norm_topk_prob=rng.random() < 0.5,
                      decoder_sparse_step=rng.choice([1, 1, 2]),
                      mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, 1))))
        if family == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = rng.choice([0, 40, 64])
    return CONFIG_CLASS[family], kw


def _build(seed: int, path) -> None:
    cls_name, kw = random_config(seed)
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # large enough that logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:  # norms near 1 (or 0 for Gemma's 1 + w) but not exactly
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)


@torch.inference_mode()
def _transformers_greedy(path, prompts):
    # eager experts: transformers' grouped GEMM refuses widths that are not 16-byte strides
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True,
        experts_implementation="eager").eval()
    outs = []
    for p in prompts:
        r = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        eos_token_id=None, pad_token_id=0, output_logits=True,
                        return_dict_in_generate=True)
        outs.append((r.sequences[0, len(p):].tolist(), [x[0] for x in r.logits]))
    return outs


@pytest.mark.parametrize("seed", range(20))
def test_random_shapes_decode_as_transformers_does(seed, tmp_path):
    rng = random.Random(1000 + seed)
    _build(seed, tmp_path)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)]
               for n in rng.sample([1, 2, 5, 9, 16, 17, 31, 40], 5)]
    engine = dict(block_size=rng.choice([1, 3, 4, 16]),
                  max_num_batched_tokens=rng.choice([16, 64, 2048]))
    if rng.random() < 0.4:  # room for the longest sequence and little more: preemptions
        engine["num_gpu_blocks_override"] = -(-(40 + MAX_TOKENS) // engine["block_size"]) + 2
    llm = LLM(str(tmp_path), dtype="float32", **engine)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False)]
    finally:
        llm.shutdown()
    for prompt, ours, (theirs, logits) in zip(prompts, got, _transformers_greedy(
            tmp_path, prompts), strict=True):
        if ours == theirs:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        row = logits[step]
        gap = (row[theirs[step]] - row[ours[step]]).item() / row.abs().max().item()
        assert gap <= NEAR_TIE, (
            f"{random_config(seed)}, engine {engine}: prompt of {len(prompt)} tokens, step "
            f"{step}: kvray {ours[step]}, transformers {theirs[step]} by {gap:.2e} of the "
            "largest logit")
