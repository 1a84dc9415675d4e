"""The built-in SmolLM2-135M-Instruct (set up by `kvray setup`) answers sensibly."""

from __future__ import annotations

import pytest
import torch

from kvray.engine.reference import generate_by_recompute
from kvray.models.loader import load_model
from kvray.tokenizer import load_tokenizer
from tests.helpers.skips import builtin_model_or_skip

pytestmark = pytest.mark.engine


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


def test_bad_words_keep_a_word_out_of_the_output():
    """vLLM's ``bad_words``: the model that answers "Paris" cannot say it, with or without
    a leading space."""
    from kvray import LLM, SamplingParams

    llm = LLM(builtin_model_or_skip(), max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        prompts = ["The capital of France is", "Paris is the capital of"]
        free, banned = (llm.generate(prompts, p, use_tqdm=False) for p in (
            params, SamplingParams(temperature=0, max_tokens=16, bad_words=["Paris"])))
        assert "Paris" in free[0].outputs[0].text
        for out in banned:
            assert "Paris" not in out.outputs[0].text, out.outputs[0].text
    finally:
        llm.shutdown()


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

    from kvray.models.default_model import default_gguf_path, default_model_dir
    from kvray.models.gguf_loader import GGUFCheckpoint

    if not default_gguf_path().is_file():
        pytest.skip("GGUF not kept in the cache (set up by an older kvray)")
    ckpt = GGUFCheckpoint(default_gguf_path())
    with safe_open(str(default_model_dir() / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        seen = 0
        for name, tensor in ckpt.iter_weights(keep_quantized=False):
            assert torch.equal(f.get_tensor(name), tensor.to(torch.bfloat16)), name
            seen += 1
    assert seen == len(names) == 272


def test_greedy_tokens_equal_transformers_in_fp32():
    """The real checkpoint through the engine (fp32, CPU kernels, paged KV) gives
    transformers' own greedy tokens: 3 prompts x 32 tokens."""
    import transformers

    from kvray import LLM, SamplingParams

    path = builtin_model_or_skip()
    tok = load_tokenizer(path)
    prompts = [tok(text)["input_ids"] for text in (
        "The capital of France is", "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                            max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del hf
    llm = LLM(str(path), dtype="float32")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want


def test_the_default_model_runs_its_q4_1_gguf_in_place_and_follows_the_dense_weights():
    """`model: null` is the shipped Q4_1 GGUF, its blocks read by the quantized kernels (no
    dense weights held), with the tokenizer directory beside it, and it predicts what the
    same weights run dense predict (the reference is the GGUF itself dequantized: Q4_1 values
    are d*q + m with fp16 d, m and q < 16, which bf16 does not always hold). Greedy texts of a
    135M model part ways after a few tokens once any logit moves (activations go through
    int8, as in llama.cpp), so the measure is teacher-forced: on the dense model's greedy
    texts, the quantized model's top token at each position is mostly the dense one's."""
    from kvray import LLM, SamplingParams
    from kvray.models.default_model import default_gguf_path
    from kvray.models.quantized import quantized_modules

    builtin_model_or_skip()
    prompts = ["The capital of France is", "Water boils at a temperature of",
               "The three primary colors are"]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def top_tokens(llm: LLM, texts: list[list[int]]) -> list[int]:
        outs = llm.generate([{"prompt_token_ids": t} for t in texts], scored, use_tqdm=False)
        return [max(step, key=step.get) for o in outs for step in o.prompt_logprobs if step]

    dense = LLM(dtype="float32", quantization="none")
    try:
        greedy = dense.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                        ignore_eos=True), use_tqdm=False)
        texts = [[*o.prompt_token_ids, *o.outputs[0].token_ids] for o in greedy]
        ref = top_tokens(dense, texts)
    finally:
        dense.shutdown()
    llm = LLM(dtype="float32")
    try:
        runner = llm.llm_engine.executor.worker.runner
        assert llm.llm_engine.model_path == str(default_gguf_path())
        held = quantized_modules(runner.model)
        assert len(held) >= 30 * 4 and all(m.qweight is not None for m in held)
        assert all(m.weight.numel() == 0 for m in held)
        ours = top_tokens(llm, texts)
        first = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3,
                                                     ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(ours) == len(ref) >= 80
    agree = sum(a == b for a, b in zip(ours, ref, strict=True)) / len(ref)
    assert agree >= 0.85, agree
    assert [list(o.outputs[0].token_ids) for o in first] == [t[len(o.prompt_token_ids):][:3]
                                                            for t, o in zip(texts, first,
                                                                            strict=True)]
