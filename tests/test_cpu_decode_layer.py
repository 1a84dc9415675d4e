"""The one-call C++ decoder layer for decode batches (``cpu_ops`` ``decode_layer``) computes
exactly what the Python layer computes with the same kernels: the output, the residual
stream and the K/V written into the paged cache, on every architecture's variant (biases,
per-head q/k norms, GQA, sliding window, MoE layers with and without a shared expert), for
the first layer (no residual yet) and later ones; ``decode_layers`` (all of a stage's layers
in one call) is those layers in turn; and the engine takes them only for pure-decode
batches of few rows — of any size where the
linears have weights packed once (an fp32 run of bf16 values). A bf16 model's fused layer
is the fp32 layer over the same values (K/V rounded into its bf16 cache)."""

from __future__ import annotations

import pytest
import torch

from kvray import LLM, SamplingParams
from kvray.kernels.attention import paged_batch
from kvray.models.llama import LlamaDecoderLayer
from tests.helpers.skips import NOT_THIS_HARDWARE
from tests.helpers.tiny_models import ARCHS, MOE_ARCHS, UNFUSED_ARCHS

pytestmark = pytest.mark.parity

BLOCK = 4
# (Gemma's layers keep the Python layer: tests/test_gemma.py)
VARIANTS = {**{arch: (arch, {}) for arch in ARCHS if arch not in UNFUSED_ARCHS},
            "mistral_window": ("mistral", dict(sliding_window=8)),
            # one KV head / one head: per-head q/k norms over strided one-head rows
            "qwen3_one_kv_head": ("qwen3_qknorm_headdim", dict(num_key_value_heads=1)),
            "qwen3_one_head": ("qwen3_qknorm_headdim", dict(
                num_attention_heads=1, num_key_value_heads=1, head_dim=32))}
# the layer the tests compare: the second, or a MoE model's second MoE one (Qwen2-MoE's
# second layer is dense)
LAYER = {"qwen2_moe_shared": 2}


@pytest.fixture(scope="module")
def llms(tiny_model_dir, tmp_path_factory, cpu_kernels):
    from tests.helpers.tiny_models import make_tiny_model

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
    kv = torch.randn(2, heads, 8 * rows, BLOCK, dim, generator=g)  # <= 8 blocks a row
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


def _python_layer(layer, hidden, residual, meta, kv):
    """The layer's output through its Python path (the fused call switched off for it)."""
    fused, layer.fused_decode = layer.fused_decode, None
    try:
        return layer(hidden, residual, meta, kv)
    finally:
        layer.fused_decode = fused


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [1, 3, 16, 32])  # 32: the fused range with AVX-512 kernels
@pytest.mark.parametrize("first_layer", [True, False])
def test_fused_decode_layer_equals_the_python_layer(llms, variant, rows, first_layer):
    runner = _runner(llms(variant))
    layer = runner.model.model.layers[LAYER.get(variant, 1)]
    assert layer.fused_decode is not None, "the engine should have installed the fused layer"
    assert layer.is_moe == (variant in MOE_ARCHS)
    meta, kv, hidden, residual = _decode_batch(runner, rows, seed=rows)
    res = None if first_layer else residual

    kv_py, kv_fused = kv.clone(), kv.clone()
    with torch.inference_mode():
        want = _python_layer(layer, hidden.clone(), None if res is None else res.clone(), meta,
                             kv_py)
        hidden_in = hidden.clone()
        got = layer(hidden_in, None if res is None else res.clone(), meta, kv_fused)
    assert torch.equal(got[0], want[0]), "layer output"
    assert torch.equal(got[1], want[1]), "residual stream"
    assert torch.equal(kv_fused, kv_py), "K/V written into the cache"
    if first_layer:  # the residual stream starts as the layer's input
        assert got[1].data_ptr() == hidden_in.data_ptr()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_decode_stack_equals_the_layers_one_by_one(llms, variant, rows, with_residual):
    """``decode_layers`` (every layer of the stage in one call) computes exactly what the
    layers' own fused calls compute in turn: output, residual stream and every layer's
    cache."""
    runner = _runner(llms(variant))
    model = runner.model.model
    assert model.fused_decode_stack is not None, "the engine should have installed the stack"
    meta, kv, hidden, residual = _decode_batch(runner, rows, seed=10 + rows)
    layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    res = residual if with_residual else None
    caches_one = [kv.clone() for _ in layers]
    caches_stack = [kv.clone() for _ in layers]
    with torch.inference_mode():
        h, r = hidden.clone(), None if res is None else res.clone()
        for layer, cache in zip(layers, caches_one, strict=True):
            h, r = layer(h, r, meta, cache)
        all_caches = [None] * model.start_layer + caches_stack
        got = model._fused_decode_stack(hidden.clone(), None if res is None else res.clone(),
                                        meta, all_caches)
    assert got is not None, "a pure-decode batch of few rows takes the stack"
    assert torch.equal(got[0], h), "stack output"
    assert torch.equal(got[1], r), "residual stream"
    for i, (a, b) in enumerate(zip(caches_stack, caches_one, strict=True)):
        assert torch.equal(a, b), f"layer {i}'s cache"


@pytest.mark.parametrize("variant", MOE_ARCHS)
def test_fused_moe_layer_counts_the_routing_the_python_layer_counts(llms, variant):
    """Inside ``counting`` the fused layer adds its rows' routing to the layer's expert
    token counters (in C++), exactly as the Python layer does; outside it, nothing."""
    runner = _runner(llms(variant))
    layer = runner.model.model.layers[LAYER.get(variant, 1)]
    counter = layer.mlp.experts.token_counts
    assert counter is not None
    meta, kv, hidden, residual = _decode_batch(runner, 5, seed=7)
    counter.take()
    with torch.inference_mode():
        with counter.counting(5):
            _python_layer(layer, hidden.clone(), residual.clone(), meta, kv.clone())
        want = counter.take()
        with counter.counting(5):
            layer(hidden.clone(), residual.clone(), meta, kv.clone())
        got = counter.take()
        layer(hidden.clone(), residual.clone(), meta, kv.clone())  # not counting
    assert got == want and sum(want[layer.mlp.experts.layer_idx]) == 5 * layer.mlp.top_k
    assert all(sum(c) == 0 for c in counter.take().values())


def test_fused_decode_layer_only_for_pure_decode_batches_of_few_rows(llms, monkeypatch):
    llm = llms("llama_gqa")
    runner = _runner(llm)
    model = runner.model.model
    calls, stacked = [], []
    fused = LlamaDecoderLayer._fused_decode
    stack = model.fused_decode_stack

    def spy(self, hidden, *args):
        calls.append(hidden.shape[0])
        return fused(self, hidden, *args)

    def stack_spy(hidden, *args):
        stacked.append((hidden.shape[0], len(args[1])))
        return stack(hidden, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "_fused_decode", spy)
    monkeypatch.setattr(model, "fused_decode_stack", stack_spy)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    # the first step prefills all three (32 rows, the Python layers); then 3 decode steps
    # of 3 rows, each every layer in one call
    assert stacked == [(3, runner.spec.num_layers)] * 3
    assert calls == []

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


# ---- a bf16 model: the fused layer computes on fp32 activations over its bf16 weights/cache


@pytest.fixture(scope="module")
def bf16_pairs(tiny_model_dir, cpu_kernels):
    """variant -> (bf16 LLM, fp32 LLM holding the bf16 model's weight values)."""
    cache = {}

    def get(variant):
        if variant not in cache:
            path = tiny_model_dir(VARIANTS[variant][0])
            llm16 = LLM(str(path), dtype="bfloat16", block_size=BLOCK,
                        num_gpu_blocks_override=64)
            llm32 = LLM(str(path), dtype="float32", block_size=BLOCK,
                        num_gpu_blocks_override=64)
            params16 = dict(_runner(llm16).model.named_parameters())
            with torch.no_grad():
                for name, p in _runner(llm32).model.named_parameters():
                    p.copy_(params16[name].float())  # bf16 values, exact in fp32
            cache[variant] = llm16, llm32
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", [v for v in VARIANTS
                                     if v != "mistral_window" and v not in MOE_ARCHS])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("first_layer", [True, False])
def test_bf16_fused_decode_layer_is_the_fp32_layer_over_the_same_values(
        bf16_pairs, variant, rows, first_layer):
    llm16, llm32 = bf16_pairs(variant)
    layer16 = _runner(llm16).model.model.layers[1]
    layer32 = _runner(llm32).model.model.layers[1]
    assert layer16.fused_decode is not None, "a bf16 model on CPU takes the fused layer too"
    meta, kv, hidden, residual = _decode_batch(_runner(llm16), rows, seed=rows)
    kv16 = kv.bfloat16()
    # the first layer gets the embedding (bf16); later ones the fp32 stream of the one before
    hidden_in = hidden.bfloat16() if first_layer else hidden
    res = None if first_layer else residual

    kv32 = kv16.float()
    with torch.inference_mode():
        want = _python_layer(layer32, hidden_in.float(), None if res is None else res.clone(),
                             meta, kv32)
        kv_fused = kv16.clone()
        got = layer16(hidden_in.clone(), None if res is None else res.clone(), meta, kv_fused)
    assert got[0].dtype == got[1].dtype == torch.float32
    # K and V come from the same kernels on the same values: equal once rounded to bf16
    assert torch.equal(kv_fused, kv32.bfloat16()), "K/V written into the bf16 cache"
    # the one difference: attention reads this token's K/V rounded to bf16 (the cache's)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["qwen2_moe_shared", "qwen3_moe"])
@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_fused_moe_layer_is_the_fp32_layer_over_the_same_values(bf16_pairs, variant,
                                                                    rows):
    """A bf16 MoE model's fused layer (bf16 experts, router and shared expert widened in
    the kernels, fp32 activations) computes what the fp32 Python layer computes on the
    same values, up to this token's K/V read back rounded to bf16."""
    llm16, llm32 = bf16_pairs(variant)
    index = LAYER.get(variant, 1)
    layer16 = _runner(llm16).model.model.layers[index]
    layer32 = _runner(llm32).model.model.layers[index]
    assert layer16.is_moe and layer16.fused_decode is not None
    meta, kv, hidden, residual = _decode_batch(_runner(llm16), rows, seed=rows)
    kv16 = kv.bfloat16()
    kv32 = kv16.float()
    with torch.inference_mode():
        want = _python_layer(layer32, hidden.clone(), residual.clone(), meta, kv32)
        kv_fused = kv16.clone()
        got = layer16(hidden.clone(), residual.clone(), meta, kv_fused)
    assert got[0].dtype == torch.float32
    assert torch.equal(kv_fused, kv32.bfloat16()), "K/V written into the bf16 cache"
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_moe_shared"])
def test_a_bf16_engine_decodes_through_the_fused_layer_and_returns_bf16(bf16_pairs, variant,
                                                                        monkeypatch):
    llm16, _ = bf16_pairs(variant)
    runner = _runner(llm16)
    max_rows = runner.model.model.layers[0].fused_decode_max_rows
    assert 1 <= max_rows < 16, "bf16: only the smallest batches (oneDNN's matmuls beyond)"
    calls, dtypes = [], []
    model = runner.model.model
    stack = model.fused_decode_stack
    forward = type(model).forward

    def spy(hidden, *args):
        calls.append((hidden.shape[0], len(args[1])))
        return stack(hidden, *args)

    def spy_model(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(model, "fused_decode_stack", spy)
    monkeypatch.setattr(type(model), "forward", spy_model)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out16 = llm16.generate(prompts, params, use_tqdm=False)
    assert calls == [(2, runner.spec.num_layers)] * 5, "5 decode steps, every layer at once"
    assert set(dtypes) == {torch.bfloat16}, "the LM head gets the model's dtype"
    assert all(len(o.outputs[0].token_ids) == 6 for o in out16)


# ---- an fp32 run of bf16-exact weights: linears packed once, the fused layer at any size


@pytest.fixture(scope="module")
def packed_llms(tmp_path_factory, cpu_kernels):
    """variant -> LLM running that variant's bf16 checkpoint in fp32: where the build has
    vector kernels every decoder linear gets a packed copy (see
    ``kvray.kernels.plan.linear_routes``) and the fused layer takes them past the small-M
    kernel's rows."""
    from tests.helpers.tiny_models import load_hf, make_tiny_model

    cache = {}

    def get(variant):
        if variant not in cache:
            arch, overrides = {**VARIANTS, **PACKED_ONLY}[variant]
            src = make_tiny_model(arch, tmp_path_factory.mktemp(variant), **overrides)
            dst = tmp_path_factory.mktemp(variant + "_bf16")
            load_hf(src).to(torch.bfloat16).save_pretrained(dst)
            for file in src.iterdir():  # the tokenizer's files
                if not (dst / file.name).exists():
                    (dst / file.name).write_bytes(file.read_bytes())
            cache[variant] = LLM(str(dst), dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=600, max_num_seqs=48)
        return cache[variant]

    return get


# an MLP of 100 (not a whole number of vectors): gate_up packed plain, not paired
PACKED_ONLY = {"llama_odd_mlp": ("llama_gqa", dict(intermediate_size=100))}
PACKED_VARIANTS = ["llama_gqa", "qwen2_bias", "qwen3_qknorm_headdim", "mistral_window",
                   "llama_odd_mlp"]


@pytest.mark.parametrize("variant", PACKED_VARIANTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 40])
@pytest.mark.parametrize("first_layer", [True, False])
def test_fused_decode_layer_on_packed_weights_equals_the_python_layer(
        packed_llms, variant, rows, first_layer):
    """Decode batches on both sides of the small-M kernel's rows: the fused layer takes the
    packed weights (the MLP's activation from the paired GEMM) exactly as the Python layer
    does: output, residual stream and K/V bit for bit, at any batch size."""
    from kvray.kernels import cpu_ops

    if cpu_ops.vector_lanes() < 8:
        pytest.skip(f"{NOT_THIS_HARDWARE}: no packed weights without AVX2 kernels")
    runner = _runner(packed_llms(variant))
    layer = runner.model.model.layers[1]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj)
    assert all(m.prepacked_weight is not None for m in linears)
    paired = layer.mlp.gate_up_proj.prepacked_silu_mul is not None
    assert paired == (variant != "llama_odd_mlp")
    assert layer.fused_decode_max_rows >= 1 << 20, "any decode batch takes the fused layer"
    meta, kv, hidden, residual = _decode_batch(runner, rows, seed=100 + rows)
    res = None if first_layer else residual
    kv_py, kv_fused = kv.clone(), kv.clone()
    with torch.inference_mode():
        want = _python_layer(layer, hidden.clone(), None if res is None else res.clone(), meta,
                             kv_py)
        got = layer(hidden.clone(), None if res is None else res.clone(), meta, kv_fused)
    assert torch.equal(got[0], want[0]), "layer output"
    assert torch.equal(got[1], want[1]), "residual stream"
    assert torch.equal(kv_fused, kv_py), "K/V written into the cache"


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias", "llama_odd_mlp"])
def test_an_engine_on_packed_weights_decodes_every_batch_in_one_call_with_the_same_tokens(
        packed_llms, variant, monkeypatch):
    """40 requests decoding together take the whole stack in one call per step (no Python
    layer), and greedy tokens equal those of each request alone (1-row batches, the small-M
    kernel) and of the engine with the fused layer switched off."""
    from kvray.kernels import cpu_ops

    if cpu_ops.vector_lanes() < 8:
        pytest.skip(f"{NOT_THIS_HARDWARE}: no packed weights without AVX2 kernels")
    llm = packed_llms(variant)
    model = _runner(llm).model.model
    stack = model.fused_decode_stack
    rows = []

    def spy(hidden, *args):
        rows.append(hidden.shape[0])
        return stack(hidden, *args)

    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 300 + 5 for j in range(3 + i % 5)]}
               for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    monkeypatch.setattr(model, "fused_decode_stack", spy)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert rows and max(rows) == 40, "the 40-row decode steps took the stack"
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:6]]
    monkeypatch.setattr(model, "fused_decode_stack", None)
    unfused = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(together[:6], alone, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for a, b in zip(together, unfused, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_moe_models_fused_rows_stay_within_the_small_m_kernels(packed_llms):
    """In a MoE model no layer's fused call takes packed weights (a stage's layers share
    one set of dims; the routing runs on the small-M kernel), so its fused decode rows stay
    within the small-M kernel's, even where its MoE layers keep the Python layer and its
    dense layers have packed weights."""
    from kvray.kernels import cpu_ops
    from kvray.models.kernel_install import fused_decode_max_rows

    if cpu_ops.vector_lanes() < 8:
        pytest.skip(f"{NOT_THIS_HARDWARE}: no packed weights without AVX2 kernels")
    model = _runner(packed_llms("qwen2_moe_shared")).model
    dense = model.model.layers[1]
    assert not dense.is_moe and dense.self_attn.qkv_proj.prepacked_weight is not None
    assert len(dense.decode_args()[0]) == 8, "no packed weights in a MoE model's fused call"
    assert dense.fused_decode_max_rows <= cpu_ops.small_m_max_rows()
    layers = list(model.model.layers)
    blocks = [layer.mlp for layer in layers if layer.is_moe]
    routes = [b.fused_route for b in blocks]
    for b in blocks:  # MoE layers the fused call does not take
        b.fused_route = None
    for layer in layers:  # as the kernel install finds them: before use_fused_decode_layer
        layer.fused_packed, layer._decode_args = True, None
    try:
        assert not any(layer.takes_fused_kernel() for layer in layers if layer.is_moe)
        assert fused_decode_max_rows(model, torch.float32) <= cpu_ops.small_m_max_rows()
    finally:
        for b, route in zip(blocks, routes, strict=True):
            b.fused_route = route
        for layer in layers:
            layer.fused_packed, layer._decode_args = False, None
