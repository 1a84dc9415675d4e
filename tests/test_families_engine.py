"""The engine's other features on the model families of issue 43: n-gram speculative
decoding gives plain greedy decoding's tokens (its verify steps run several tokens of a
sequence at once: capped attention, sliding windows and MoE routing over them), and JSON
schema constraints hold, on a MoE model, Gemma 2 and Phi-3; Gemma 2's capped attention runs
in the C++ kernels."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvray import LLM, SamplingParams

pytestmark = pytest.mark.engine

# finite choices: a random tiny model must still finish the object within max_tokens
SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]},
                                           "w": {"enum": ["ab", "cd"]}},
          "required": ["n", "w"], "additionalProperties": False}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma2_softcap", "phi3_longrope"])
def test_speculative_and_structured_decoding_on_the_new_families(arch, tiny_model_dir,
                                                                 monkeypatch):
    """Every attention call, Gemma 2's capped ones included, goes through the C++ paged
    kernels: the per-sequence PyTorch path for capped scores is never called."""
    from kvray.kernels import attention

    def no_python_path(*args, **kwargs):
        raise AssertionError("capped attention took the PyTorch path")

    monkeypatch.setattr(attention, "softcapped_attention", no_python_path)
    path = str(tiny_model_dir(arch))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]},  # n-gram matches
               {"prompt_token_ids": list(range(10, 40))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(path, dtype="float32", block_size=4)
    runner = plain.llm_engine.executor.worker.runner
    assert runner.attention_backend == "cpu" and runner.kernels["kernels_take_softcap"]
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
        constrained = plain.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=100, structured_outputs={"json": SCHEMA}),
            use_tqdm=False)
    finally:
        plain.shutdown()
    for out in constrained:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    spec = LLM(path, dtype="float32", block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    try:
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)]
        drafts = spec.llm_engine.stats.spec_decode_num_draft_tokens
    finally:
        spec.shutdown()
    assert got == want
    assert drafts > 0, "the repeating prompt should have produced n-gram drafts"
