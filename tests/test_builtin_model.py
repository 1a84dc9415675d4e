"""The built-in SmolLM2-135M-Instruct (set up by `kvray setup`) answers sensibly."""

from __future__ import annotations

import pytest
import torch
from conftest import builtin_model_or_skip

from kvray.engine.reference import generate_by_recompute
from kvray.models.loader import load_model
from kvray.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smollm2():
    path = builtin_model_or_skip()
    model, spec = load_model(path, "bfloat16")
    return model, spec, load_tokenizer(path)


def test_builtin_model_is_the_expected_llama(smollm2):
    _, spec, tok = smollm2
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        576, 30, 9, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_greedy_completion_knows_paris(smollm2):
    model, spec, tok = smollm2
    ids = tok("The capital of France is")["input_ids"]
    out = generate_by_recompute(model, ids, 8, stop_ids=spec.eos_token_ids)
    assert "Paris" in tok.decode(out)


def test_chat_answer_goes_through_the_template(smollm2):
    model, spec, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    out = generate_by_recompute(model, ids, 24, stop_ids=spec.eos_token_ids)
    assert out[-1] in spec.eos_token_ids, "the answer should end with the end-of-turn token"
    assert "Paris" in tok.decode(out, skip_special_tokens=True)


def test_converted_weights_equal_the_gguf_dequantized(smollm2):
    """The cached HF directory holds exactly the GGUF's weights, rounded to bf16."""
    from safetensors import safe_open

    from kvray.default_model import default_gguf_path, default_model_dir
    from kvray.models.gguf_loader import GGUFCheckpoint

    if not default_gguf_path().is_file():
        pytest.skip("GGUF not kept in the cache (set up by an older kvray)")
    ckpt = GGUFCheckpoint(default_gguf_path())
    with safe_open(str(default_model_dir() / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        seen = 0
        for name, tensor in ckpt.iter_weights():
            assert torch.equal(f.get_tensor(name), tensor.to(torch.bfloat16)), name
            seen += 1
    assert seen == len(names) == 272
