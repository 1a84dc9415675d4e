"""The one-call C++ decoder layer for decode batches (``cpu_ops`` ``decode_layer``) computes
exactly what the Python layer computes with the same kernels: the output, the residual
stream and the K/V written into the paged cache, on every architecture's variant (biases,
per-head q/k norms, GQA, sliding window), for the first layer (no residual yet) and later
ones; and the engine takes it only for pure-decode batches of few rows."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS

from kvray import LLM, SamplingParams
from kvray.kernels.attention import paged_batch
from kvray.models.llama import LlamaDecoderLayer

BLOCK = 4
VARIANTS = {**{arch: (arch, {}) for arch in ARCHS},
            "mistral_window": ("mistral", dict(sliding_window=8))}


@pytest.fixture(scope="module")
def llms(tiny_model_dir, tmp_path_factory, cpu_kernels):
    from tiny_models import make_tiny_model

    cache = {}

    def get(variant):
        if variant not in cache:
            arch, overrides = VARIANTS[variant]
            path = (make_tiny_model(arch, tmp_path_factory.mktemp(variant), **overrides)
                    if overrides else tiny_model_dir(arch))
            cache[variant] = LLM(str(path), dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64)
        return cache[variant]

    return get


def _runner(llm):
    return llm.llm_engine.executor.worker.runner


def _decode_batch(runner, rows: int, seed: int):
    """A decode batch of ``rows`` sequences with 5..30 tokens of random cached K/V each."""
    g = torch.Generator().manual_seed(seed)
    spec = runner.spec
    layer = runner.model.model.layers[0]
    heads, dim = layer.self_attn.num_kv_heads, layer.self_attn.head_dim
    kv = torch.randn(2, heads, 160, BLOCK, dim, generator=g)  # 17 rows x 8 blocks fit
    batch, next_block = [], 0
    for _ in range(rows):
        length = int(torch.randint(5, 30, (1,), generator=g))
        n = -(-(length + 1) // BLOCK)
        batch.append(([int(torch.randint(3, spec.vocab_size, (1,), generator=g))], length,
                      list(range(next_block, next_block + n))))
        next_block += n
    _, meta, _ = paged_batch(batch, BLOCK, lambda v: torch.tensor(v, dtype=torch.int64),
                             **runner.kernels)
    hidden = torch.randn(rows, spec.hidden_size, generator=g)
    residual = torch.randn(rows, spec.hidden_size, generator=g)
    return meta, kv, hidden, residual


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("first_layer", [True, False])
def test_fused_decode_layer_equals_the_python_layer(llms, variant, rows, first_layer):
    runner = _runner(llms(variant))
    layer = runner.model.model.layers[1]
    assert layer.fused_decode is not None, "the engine should have installed the fused layer"
    meta, kv, hidden, residual = _decode_batch(runner, rows, seed=rows)
    res = None if first_layer else residual

    kv_py, kv_fused = kv.clone(), kv.clone()
    fused, layer.fused_decode = layer.fused_decode, None
    with torch.inference_mode():
        try:
            want = layer(hidden.clone(), None if res is None else res.clone(), meta, kv_py)
        finally:
            layer.fused_decode = fused
        hidden_in = hidden.clone()
        got = layer(hidden_in, None if res is None else res.clone(), meta, kv_fused)
    assert torch.equal(got[0], want[0]), "layer output"
    assert torch.equal(got[1], want[1]), "residual stream"
    assert torch.equal(kv_fused, kv_py), "K/V written into the cache"
    if first_layer:  # the residual stream starts as the layer's input
        assert got[1].data_ptr() == hidden_in.data_ptr()


def test_fused_decode_layer_only_for_pure_decode_batches_of_few_rows(llms, monkeypatch):
    llm = llms("llama_gqa")
    runner = _runner(llm)
    calls = []
    fused = LlamaDecoderLayer._fused_decode

    def spy(self, hidden, *args):
        calls.append(hidden.shape[0])
        return fused(self, hidden, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "_fused_decode", spy)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    # the first step prefills all three (32 rows, the Python layers); then 3 decode rows
    assert calls and set(calls) == {3}
    assert len(calls) == 3 * runner.spec.num_layers  # 3 decode steps x every layer

    calls.clear()
    layer = runner.model.model.layers[0]
    max_rows = layer.fused_decode_max_rows
    meta, kv, hidden, residual = _decode_batch(runner, max_rows + 1, seed=2)
    with torch.inference_mode():
        layer(hidden, residual, meta, kv)
    assert calls == [], f"{max_rows + 1} decode rows are past the small-M kernel's range"

    meta, kv, hidden, residual = _decode_batch(runner, 2, seed=3)
    strided = hidden.t().contiguous().t()  # the same values, not contiguous
    with torch.inference_mode():
        got = layer(strided, residual.clone(), meta, kv.clone())
        want = layer(hidden, residual.clone(), meta, kv.clone())
    assert calls == [2], "only the contiguous batch (the second call) takes the fused layer"
    assert torch.equal(got[0], want[0]), "a strided input takes the Python layer, same result"


def test_rejects_a_slot_outside_the_cache(llms):
    runner = _runner(llms("llama_gqa"))
    layer = runner.model.model.layers[0]
    meta, kv, hidden, residual = _decode_batch(runner, 2, seed=0)
    meta.slot_mapping = torch.tensor([0, kv.shape[2] * BLOCK], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer(hidden, residual, meta, kv)
