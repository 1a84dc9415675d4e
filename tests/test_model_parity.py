"""kvray's model matches Hugging Face transformers exactly (fp32) on every supported
architecture: logits for a flat batch of mixed-length sequences and greedy decoding."""

from __future__ import annotations

import pytest
import torch

from kvray.engine.reference import generate_by_recompute
from kvray.kernels.attention import AttentionMetadata
from kvray.models.loader import load_model
from tests.helpers.tiny_models import ARCHS, VOCAB_SIZE, load_hf

pytestmark = pytest.mark.parity

LENGTHS = [1, 7, 33, 2, 64, 15]


def _random_seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.inference_mode()
def test_batched_logits_match_transformers(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf = load_hf(path)
    model, _ = load_model(path, "float32")
    seqs = _random_seqs(LENGTHS)
    hidden = model(torch.cat(seqs), AttentionMetadata.for_full_sequences(LENGTHS))
    ours = model.compute_logits(hidden)
    ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.inference_mode()
def test_greedy_decoding_matches_transformers_generate(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf = load_hf(path)
    model, _ = load_model(path, "float32")
    for prompt in _random_seqs([5, 40], seed=1):
        expected = hf.generate(prompt[None], max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert generate_by_recompute(model, prompt.tolist(), 12) == expected


@pytest.mark.parametrize("arch", ["mistral", "phi3_longrope"])
@torch.inference_mode()
def test_sliding_window_limits_attention(arch, tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    path = make_tiny_model(arch, tmp_path / "swa", sliding_window=8)
    hf = load_hf(path)
    model, spec = load_model(path, "float32")
    assert spec.layer_windows == (8, 8, 8)
    seq = _random_seqs([30])[0]
    ours = model.compute_logits(model(seq, AttentionMetadata.for_full_sequences([30])))
    assert (ours - hf(seq[None]).logits[0]).abs().max().item() <= 1e-4


def test_bf16_default_runs_and_stays_close(tiny_model_dir):
    path = tiny_model_dir("llama_gqa")
    model32, _ = load_model(path, "float32")
    model16, _ = load_model(path, "bfloat16")
    seq = _random_seqs([20])[0]
    meta = AttentionMetadata.for_full_sequences([20])
    with torch.inference_mode():
        a = model32.compute_logits(model32(seq, meta))
        b = model16.compute_logits(model16(seq, meta)).float()
    assert b.dtype == torch.float32 and (a - b).abs().max().item() < 0.1


# Shapes the main tiny models miss, each once broken: one KV head (or one head) under
# Qwen3's per-head norms in the fused decode layer (a strided per-head view reached the C++
# RMSNorm), Gemma 3 with one rope base for both layer types (the layers shared the first
# layer's rotary, keyed by base alone), a Qwen2-MoE shared expert 0 wide (its saved empty
# tensors were "unexpected").
EDGE_SHAPES = {
    "qwen3_one_kv_head": ("qwen3_qknorm_headdim", dict(num_key_value_heads=1)),
    "qwen3_one_head": ("qwen3_qknorm_headdim", dict(num_attention_heads=1,
                                                    num_key_value_heads=1, head_dim=32)),
    "qwen3_moe_one_kv_head": ("qwen3_moe", dict(num_key_value_heads=1)),
    "gemma3_one_rope_base": ("gemma3_text", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}})),
    "qwen2_moe_no_shared_expert": ("qwen2_moe_shared", dict(shared_expert_intermediate_size=0)),
}


@pytest.mark.parametrize("shape", list(EDGE_SHAPES))
def test_edge_shapes_decode_batches_in_an_engine_as_transformers_does(shape, tmp_path):
    from kvray import LLM, SamplingParams
    from tests.helpers.tiny_models import make_tiny_model, transformers_greedy

    arch, overrides = EDGE_SHAPES[shape]
    path = make_tiny_model(arch, tmp_path / shape, **overrides)
    prompts = [{"prompt_token_ids": s.tolist()} for s in _random_seqs([1, 5, 17, 40], seed=1)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_gpu_blocks_override=128)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == transformers_greedy(path, prompts, 12)


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("llama_gqa", dict(intermediate_size=101), "intermediate_size (101)"),
    ("qwen2_moe_shared", dict(shared_expert_intermediate_size=81),
     "shared_expert_intermediate_size (81)"),
    ("qwen3_qknorm_headdim", dict(num_attention_heads=5, num_key_value_heads=5),
     "num_attention_heads (5)"),
])
def test_a_size_tensor_parallelism_cannot_split_is_an_error_naming_its_key(
        arch, overrides, message, tmp_path):
    from kvray.parallel import ParallelContext
    from tests.helpers.tiny_models import make_tiny_model

    path = make_tiny_model(arch, tmp_path / "m", **overrides)
    with pytest.raises(ValueError, match=rf"{message.replace('(', '[(]').replace(')', '[)]')}"
                                         r" is not divisible by tensor_parallel_size \(2\)"):
        load_model(path, "float32", ParallelContext(tp_rank=0, tp_size=2))
