"""The small-M and tiled linear kernels equal F.linear, and the model routes decode-sized
inputs through the first, prefill-sized ones through the second."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from kvray.kernels import plan
from kvray.kernels.plan import cpu_linear_routes, packed_weights_supported
from kvray.models.kernel_install import min_small_m_rows, use_cpu_linear_kernels
from kvray.models.layers import (
    WEIGHT_MAJOR_MAX_ROWS,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    release_plain_weights,
    use_packed_weights,
    use_prepacked_weights,
    use_small_m_kernel,
)
from kvray.parallel import ParallelContext
from tests.helpers.skips import NOT_THIS_HARDWARE

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 15, 16, 17, 24, 31, 32])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (96, 64), (301, 577)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_matches_f_linear(ops, rows, out_features, in_features, with_bias):
    # Odd sizes: the vector loop's tail, and every mix of the 8-row (AVX-512), 4-row and
    # 3/2/1-row passes over a weight tile.
    _check_against_f_linear(ops.linear_small_m, rows, out_features, in_features, with_bias)


def _check_against_f_linear(kernel, rows: int, out_features: int, in_features: int,
                            with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    # fp32 sums of in_features products in another order: error grows with the length
    torch.testing.assert_close(kernel(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=2e-6 * in_features)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_m_linear_on_bf16_weights_equals_fp32_weights_of_the_same_values(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 203, generator=gen)
    w16 = torch.randn(97, 203, generator=gen).bfloat16()
    b = torch.randn(97, generator=gen)
    torch.testing.assert_close(ops.linear_small_m(x, w16, b), F.linear(x, w16.float(), b),
                               rtol=1e-5, atol=2e-6 * 203)


def test_small_m_linear_rejects_what_it_cannot_do(ops):
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="1 <= M <= 32"):
        ops.linear_small_m(torch.randn(33, 8), w, None)
    with pytest.raises(RuntimeError, match="fp32 x with fp32 or bf16 w only"):
        ops.linear_small_m(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16(), None)


@pytest.mark.parametrize("rows", [1, 7, 13, 17, 25, 33, 65, 121, 255, 256, 257, 700])
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 3), (127, 64), (129, 577), (700, 33), (40, 1600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_linear_matches_f_linear(ops, rows, out_features, in_features, with_bias):
    # Row counts on both sides of the 12-row (AVX-512) or 5-row (AVX2) register blocks and
    # of the tiles (256 rows; 120 for 1,600 inputs, so that they stay in L2), column counts
    # on both sides of the panels of 32 or 16 weight rows and of the 3-panel tiles.
    _check_against_f_linear(ops.linear_tiled, rows, out_features, in_features, with_bias)


@pytest.mark.parametrize("rows", [1, 8, 9, 12, 13, 16, 17, 23, 25, 31, 32, 33, 48, 49, 64, 65,
                                  121, 257, 700])
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 3), (127, 64), (129, 577), (700, 33), (40, 1600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_on_a_weight_packed_once_matches_f_linear(ops, rows, out_features,
                                                         in_features, with_bias):
    # Row counts on both sides of the 12-row (AVX-512) or 5-row (AVX2) register blocks (the
    # last two blocks split evenly) and of the tiles; columns on both sides of the panels of
    # 32 or 16 weight rows and of the 3-panel tiles (the last panel padded with zero rows).
    def packed_kernel(x, w, b):
        packed = ops.pack_linear_weight(w)
        panel = 2 * ops.vector_lanes()
        assert packed.dim() == 1
        assert packed.numel() == -(-w.shape[0] // panel) * panel * w.shape[1]
        return ops.linear_packed(x, packed, w.shape[0], b)

    _check_against_f_linear(packed_kernel, rows, out_features, in_features, with_bias)


def test_linear_on_a_packed_weight_takes_strided_inputs_and_empty_ones(ops):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(200, 96, generator=gen)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(70, 2, 96, generator=gen)[:, 1]  # rows 192 floats apart
    torch.testing.assert_close(ops.linear_packed(x, packed, 200, None), F.linear(x, w),
                               rtol=1e-5, atol=2e-4)
    xt = torch.randn(96, 40, generator=gen).t()  # columns contiguous, not rows
    torch.testing.assert_close(ops.linear_packed(xt, packed, 200, None), F.linear(xt, w),
                               rtol=1e-5, atol=2e-4)
    assert ops.linear_packed(torch.randn(0, 96), packed, 200, None).shape == (0, 200)


def test_linear_on_a_packed_weight_rejects_a_weight_of_another_shape(ops):
    # (out_features within the same panel of 16 or 32 rows share the packed size)
    packed = ops.pack_linear_weight(torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="does not hold 70 x 8 fp32 or bf16 values"):
        ops.linear_packed(torch.randn(4, 8), packed, 70, None)
    with pytest.raises(RuntimeError, match="does not hold 5 x 9 fp32 or bf16 values"):
        ops.linear_packed(torch.randn(4, 9), packed, 5, None)
    with pytest.raises(RuntimeError, match="fp32 bias \\[N\\]"):
        ops.linear_packed(torch.randn(4, 8), packed, 5, torch.randn(4))
    with pytest.raises(RuntimeError, match="fp32 or bf16 CPU weight"):
        ops.pack_linear_weight(torch.randn(5, 8, dtype=torch.float16))


@pytest.mark.parametrize("rows,half,in_features", [(1, 1, 8), (13, 3, 100), (300, 4, 64),
                                                    (2048, 96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_packed_paired_gives_f_linear_and_the_mlp_activation(
        ops, rows, half, in_features, with_bias):
    """A gate_up weight [2I, K] packed paired (each panel a vector of gate rows and the same
    rows of up; I = ``half`` vectors): its plain output equals the unpaired packed kernel's
    bit for bit, and the fused epilogue equals silu_and_mul of that output (up to flushed
    denormals, which depend on the thread a row lands on)."""
    lanes = ops.vector_lanes()
    inter = half * lanes
    gen = torch.Generator().manual_seed(rows + half)
    w = torch.randn(2 * inter, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(2 * inter, generator=gen) if with_bias else None
    paired = ops.pack_gate_up_weight(w)
    plain = ops.linear_packed_gate_up(x, paired, 2 * inter, b)
    assert torch.equal(plain, ops.linear_packed(x, ops.pack_linear_weight(w), 2 * inter, b))
    torch.testing.assert_close(plain, F.linear(x, w, b), rtol=1e-5, atol=2e-4)
    act = ops.linear_packed_gate_up(x, paired, 2 * inter, b, silu_mul=True)
    assert act.shape == (rows, inter)
    torch.testing.assert_close(act, ops.silu_and_mul(plain), rtol=0, atol=1e-30)
    with pytest.raises(RuntimeError, match="whole number of panels"):
        ops.pack_gate_up_weight(torch.randn(2 * inter + 2, 8))
    with pytest.raises(RuntimeError, match="does not hold"):
        ops.linear_packed_gate_up(x, paired, 2 * inter + 2 * lanes, b, silu_mul=True)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 16, 17, 33, 300])
@pytest.mark.parametrize("out_features,in_features", [(1, 3), (129, 577), (40, 1600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bf16_weight_packed_as_bf16_gives_the_fp32_panels_results_bit_for_bit(
        ops, rows, out_features, in_features, with_bias):
    """A bf16 weight packs into bf16 panels (half the bytes), which the kernel widens in
    registers: the very products and sums of fp32 panels holding the same values, for the
    plain layout and the paired gate_up one with its fused activation."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w16 = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    packed16 = ops.pack_linear_weight(w16)
    assert packed16.dtype == torch.bfloat16
    assert packed16.numel() == ops.pack_linear_weight(w16.float()).numel()
    got = ops.linear_packed(x, packed16, out_features, b)
    want = ops.linear_packed(x, ops.pack_linear_weight(w16.float()), out_features, b)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, F.linear(x, w16.float(), b), rtol=1e-5, atol=5e-4)
    inter = ops.vector_lanes() * 2
    g16 = torch.randn(2 * inter, in_features, generator=gen).bfloat16()
    for silu_mul in (False, True):
        got = ops.linear_packed_gate_up(x, ops.pack_gate_up_weight(g16), 2 * inter, None,
                                        silu_mul=silu_mul)
        want = ops.linear_packed_gate_up(x, ops.pack_gate_up_weight(g16.float()), 2 * inter,
                                         None, silu_mul=silu_mul)
        assert torch.equal(got, want)


def test_the_mlp_takes_its_activation_from_the_gemm_on_paired_weights(ops, monkeypatch):
    """With weights packed once (AVX2 or AVX-512 kernels, a bf16 checkpoint run in fp32),
    the MLP's gate_up is packed paired and inputs past the small-M kernel's rows get
    silu(gate) * up from the GEMM's epilogue, no silu_and_mul pass; fewer rows keep the
    small-M route; both equal the reference MLP."""
    from types import SimpleNamespace

    from kvray.models.llama import LlamaMLP

    cut = cpu_linear_routes().prepack_from_rows
    if cut is None:
        pytest.skip(f"{NOT_THIS_HARDWARE}: this build's kernels do not pack weights once (no AVX2)")
    spec = SimpleNamespace(hidden_size=64, intermediate_size=3 * ops.vector_lanes(),
                           mlp_bias=False, hidden_act="silu")
    mlp = LlamaMLP(spec, ParallelContext(), torch.float32)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape).bfloat16().float()
    gate_w, up_w = mlp.gate_up_proj.weight.detach().clone().chunk(2)
    down_w = mlp.down_proj.weight.detach().clone()
    use_cpu_linear_kernels(mlp, cpu_linear_routes(), bf16_weights=True)
    assert mlp.gate_up_proj.prepacked_silu_mul is not None
    calls = []
    silu_and_mul = ops.silu_and_mul
    monkeypatch.setattr(ops, "silu_and_mul", lambda t: calls.append(t.shape[0]) or silu_and_mul(t))
    mlp.fused_silu_and_mul = ops.silu_and_mul
    for rows in (1, cut - 1, cut, 300):
        calls.clear()
        x = torch.randn(rows, 64)
        want = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
        torch.testing.assert_close(mlp(x), want, rtol=1e-4, atol=1e-4)
        assert calls == ([] if rows >= cut else [rows])


def test_tiled_linear_takes_strided_inputs(ops):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 2, 96, generator=gen)[:, 1]  # rows 192 floats apart
    w = torch.randn(200, 96, generator=gen)
    torch.testing.assert_close(ops.linear_tiled(x, w, None), F.linear(x, w),
                               rtol=1e-5, atol=2e-4)
    xt = torch.randn(96, 300, generator=gen).t()  # columns contiguous, not rows
    torch.testing.assert_close(ops.linear_tiled(xt, w, None), F.linear(xt, w),
                               rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_works_in_inference_mode(ops, dtype):
    # Regression: the threads of the sgemm-per-tile path (every dtype but fp32 with AVX2)
    # run ATen ops on the caller's inference tensors; without the caller's thread-local
    # state they failed ("Inplace update to inference tensor outside InferenceMode"), which
    # the engine (it runs in inference mode) hit on every prefill.
    with torch.inference_mode():
        x, w, b = (torch.randn(600, 64, dtype=dtype), torch.randn(300, 64, dtype=dtype),
                   torch.randn(300, dtype=dtype))
        tol = dict(rtol=1e-5, atol=2e-4) if dtype == torch.float32 else \
            dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(ops.linear_tiled(x, w, b), F.linear(x, w, b), **tol)


def test_tiled_linear_rejects_mismatched_shapes(ops):
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        ops.linear_tiled(torch.randn(4, 8), torch.randn(5, 9), None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        ops.linear_tiled(torch.randn(4, 8), torch.randn(5, 8), torch.randn(4))


def test_kernels_let_other_python_threads_run(ops):
    """The ops release the GIL: a Serve replica's threads stream tokens while the engine
    thread is inside a kernel, instead of waiting for it (and the step for them)."""
    x, w = torch.randn(4096, 1024), torch.randn(4096, 1024)  # ~34 GFLOP: 0.1 s or more
    started, done = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        for _ in range(3):  # between calls it holds the GIL: only a kernel lets it go
            ops.linear_tiled(x, w, None)
        done.set()

    # No forced switches: this thread gets the GIL back before the worker is done only if
    # a kernel releases it (an event, not a count of timer ticks on a busy host).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=run)
        worker.start()
        assert started.wait(60)
        ran_meanwhile = not done.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_meanwhile, "this thread ran only once the kernels had returned: they held the GIL"


def test_layers_use_the_kernel_only_for_few_rows(ops, monkeypatch):
    layer = RowParallelLinear(ParallelContext(), 16, 8, True, torch.float32)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    calls, weight_major = [], []

    def counting(x, w, b):
        calls.append(x.shape[0])
        return ops.linear_small_m(x, w, b)

    mm = torch.mm

    def counting_mm(a, b):
        weight_major.append(b.shape[1])
        return mm(a, b)

    tiled = []

    def counting_tiled(x, w, b):
        tiled.append(x.shape[0])
        return ops.linear_tiled(x, w, b)

    use_small_m_kernel(layer, counting, max_rows=4, large_m_kernel=counting_tiled)
    monkeypatch.setattr(torch, "mm", counting_mm)
    # past the kernel's rows: (W x^T)^T up to WEIGHT_MAJOR_MAX_ROWS, the tiled GEMM beyond
    for rows in (1, 4, 5, 32, WEIGHT_MAJOR_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 16)
        y = layer(x)
        assert y.is_contiguous() and y.shape == (rows, 8)
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    assert calls == [1, 4]
    assert weight_major == [5, 32, WEIGHT_MAJOR_MAX_ROWS]
    assert tiled == [WEIGHT_MAJOR_MAX_ROWS + 1, 300]


def test_the_lm_head_stays_weight_major_at_any_row_count(ops, monkeypatch):
    head = ParallelLMHead(ParallelContext(), 40, 16, torch.float32)
    torch.nn.init.normal_(head.weight)
    use_small_m_kernel(head, ops.linear_small_m, max_rows=4)
    weight_major = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: weight_major.append(b.shape[1]) or mm(a, b))
    x = torch.randn(300, 16)
    torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight))
    assert weight_major == [300]


def test_the_lm_head_goes_tiled_past_its_weight_major_limit(ops, monkeypatch):
    head = ParallelLMHead(ParallelContext(), 40, 16, torch.float32)
    torch.nn.init.normal_(head.weight)
    tiled = []

    def counting_tiled(x, w, b):
        tiled.append(x.shape[0])
        return ops.linear_tiled(x, w, b)

    use_small_m_kernel(head, ops.linear_small_m, max_rows=4, large_m_kernel=counting_tiled,
                       lm_head_weight_major_max_rows=32)
    weight_major = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: weight_major.append(b.shape[1]) or mm(a, b))
    for rows in (32, 33, 300):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight))
    assert weight_major == [32] and tiled == [33, 300]


@pytest.mark.parametrize("lanes", [16, 8])
def test_the_runner_routes_an_fp32_models_linears_by_the_kernels_vector_width(
        ops, monkeypatch, lanes):
    """16 lanes (AVX-512): small-M kernel, then F.linear, the tiled GEMM for layers past 64
    rows, F.linear for the LM head at any size; 8 lanes (AVX2): small-M kernel, weight-major
    sgemm up to 64 rows (any number for the LM head), then the tiled GEMM."""
    from kvray.kernels import cpu_ops
    monkeypatch.setattr(cpu_ops, "vector_lanes", lambda: lanes)
    routes = []
    small_m, tiled, mm, linear = cpu_ops.linear_small_m, cpu_ops.linear_tiled, torch.mm, F.linear
    monkeypatch.setattr(cpu_ops, "linear_small_m",
                        lambda x, w, b: routes.append("small") or small_m(x, w, b))
    monkeypatch.setattr(cpu_ops, "linear_tiled",
                        lambda x, w, b: routes.append("tiled") or tiled(x, w, b))
    layer = RowParallelLinear(ParallelContext(), 16, 8, False, torch.float32)
    head = ParallelLMHead(ParallelContext(), 40, 16, torch.float32)
    for module in (layer, head):
        torch.nn.init.normal_(module.weight)
        use_cpu_linear_kernels(module, cpu_linear_routes())
    monkeypatch.setattr(torch, "mm", lambda a, b: routes.append("weight-major") or mm(a, b))
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: routes.append("F.linear")
                        or linear(x, w, b))
    small = cpu_ops.small_m_max_rows()
    got = {}
    for name, module, rows in (("layer", layer, (small, small + 1, 64, 65, 300)),
                               ("head", head, (small, small + 1, 300))):
        for n in rows:
            routes.clear()
            x = torch.randn(n, 16)
            y = module.compute_logits(x) if module is head else module(x)
            torch.testing.assert_close(y, linear(x, module.weight), rtol=1e-5, atol=1e-4)
            got[name, n] = routes[0]
    if lanes == 16:
        assert small == cpu_ops.SMALL_M_MAX_ROWS_AVX512
        assert got == {("layer", small): "small", ("layer", small + 1): "F.linear",
                       ("layer", 64): "F.linear", ("layer", 65): "tiled",
                       ("layer", 300): "tiled", ("head", small): "small",
                       ("head", small + 1): "F.linear", ("head", 300): "F.linear"}
    else:
        assert small == cpu_ops.SMALL_M_MAX_ROWS
        assert got == {("layer", small): "small", ("layer", small + 1): "weight-major",
                       ("layer", 64): "weight-major", ("layer", 65): "tiled",
                       ("layer", 300): "tiled", ("head", small): "small",
                       ("head", small + 1): "weight-major", ("head", 300): "weight-major"}


def test_bf16_copies_only_where_bf16_holds_the_weights_exactly(ops):
    exact = RowParallelLinear(ParallelContext(), 16, 8, False, torch.float32)
    inexact = RowParallelLinear(ParallelContext(), 16, 8, False, torch.float32)
    exact.weight.data = torch.randn(8, 16).bfloat16().float()  # a bf16 checkpoint in fp32
    inexact.weight.data = torch.randn(8, 16)
    model = torch.nn.ModuleList([exact, inexact])
    extra = use_small_m_kernel(model, ops.linear_small_m, 8, bf16_weights=True)
    assert exact.small_m_weight is not None and inexact.small_m_weight is None
    assert extra == 8 * 16 * 2
    x = torch.randn(2, 16)
    for layer in (exact, inexact):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


needs_packed = pytest.mark.skipif(not packed_weights_supported(),
                                  reason=f"{NOT_THIS_HARDWARE}: no oneDNN bf16 matmul")


@needs_packed
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_weights_give_f_linears_result_at_any_row_count(with_bias):
    layer = ColumnParallelLinear(ParallelContext(), 72, 40, with_bias, torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    if with_bias:
        torch.nn.init.normal_(layer.bias)
    head = ParallelLMHead(ParallelContext(), 50, 72, torch.bfloat16)
    torch.nn.init.normal_(head.weight)
    model = torch.nn.ModuleList([layer, head])
    assert use_packed_weights(model) == (40 * 72 + 50 * 72) * 2
    assert layer.packed_weight is not None and head.packed_weight is not None
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 72).bfloat16()
        # oneDNN's kernel either way, fp32 accumulation: equal up to the last bf16 rounding
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=2 ** -7, atol=0.05)
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight),
                                   rtol=2 ** -7, atol=0.05)
    x32 = torch.randn(3, 72)  # not bf16: the plain weight's path, which rejects the mix
    with pytest.raises(RuntimeError):
        layer(x32)


@needs_packed
def test_packing_leaves_fp32_layers_alone():
    layer = ColumnParallelLinear(ParallelContext(), 16, 8, False, torch.float32)
    assert use_packed_weights(torch.nn.ModuleList([layer])) == 0
    assert layer.packed_weight is None


@needs_packed
def test_a_bf16_engine_packs_its_weights_and_keeps_the_small_m_kernel_off(ops,
                                                                          tiny_model_dir):
    from kvray import LLM

    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="bfloat16", num_gpu_blocks_override=32)
    try:
        runner = llm.llm_engine.executor.worker.runner
        layers = [m for m in runner.model.modules() if hasattr(m, "packed_weight")]
        assert layers and all(m.packed_weight is not None for m in layers)
        # bf16 decode batches past the fused layer's rows go to oneDNN, not the small-M kernel
        assert all(m.small_m_kernel is None for m in layers)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("lanes", [16, 8, 1])
def test_the_runner_prepacks_only_bf16_exact_layers_and_only_with_vector_kernels(
        ops, monkeypatch, lanes):
    """A bf16 checkpoint run in fp32 (exact bf16 copies): with 16 lanes every input of
    ``AVX512_PACKED_FROM_ROWS`` rows or more goes to the tiled kernel on the weight packed
    once, with 8 every input past the small-M kernel's rows, the LM head's too; fewer rows
    to the small-M kernel; each plain weight nothing else shares is released. A build
    without AVX2 (1 lane) keeps its routes and releases nothing."""
    from kvray.kernels import cpu_ops
    monkeypatch.setattr(cpu_ops, "vector_lanes", lambda: lanes)
    routes = []
    small_m, packed_linear = cpu_ops.linear_small_m, cpu_ops.linear_packed
    monkeypatch.setattr(cpu_ops, "linear_small_m",
                        lambda x, w, b: routes.append("small") or small_m(x, w, b))
    monkeypatch.setattr(cpu_ops, "linear_packed",
                        lambda x, p, n, b: routes.append("packed") or packed_linear(x, p, n, b))
    ctx = ParallelContext()
    layer = RowParallelLinear(ctx, 16, 8, False, torch.float32)
    head = ParallelLMHead(ctx, 40, 16, torch.float32)
    embed = VocabParallelEmbedding(ctx, 40, 16, torch.float32)
    for module in (layer, head):
        module.weight.data = torch.randn(module.weight.shape).bfloat16().float()
    head.weight = embed.weight = torch.nn.Parameter(head.weight.data, requires_grad=False)
    want = {"layer": layer.weight.detach().clone(), "head": head.weight.detach().clone()}
    model = torch.nn.ModuleList([layer, head, embed])
    bf16, packed, freed = use_cpu_linear_kernels(model, cpu_linear_routes(), bf16_weights=True)
    assert bf16 == (8 * 16 + 40 * 16) * 2
    small = cpu_ops.small_m_max_rows()
    cut = cpu_linear_routes().prepack_from_rows
    avx2_cut = plan.AVX2_PACKED_FROM_ROWS
    assert cut == {16: plan.AVX512_PACKED_FROM_ROWS, 8: avx2_cut, 1: None}[lanes]
    if cut is None:
        assert (packed, freed) == (0, 0) and layer.weight.shape == (8, 16)
        assert all(m.prepacked_weight is None for m in (layer, head))
        assert min_small_m_rows(model) == small
        return
    got = {}
    for name, module, rows in (("layer", layer, (cut - 1, cut, small, small + 1, 64, 300)),
                               ("head", head, (cut - 1, cut, small, small + 1, 300))):
        for n in rows:
            routes.clear()
            x = torch.randn(n, 16)
            y = module.compute_logits(x) if module is head else module(x)
            torch.testing.assert_close(y, F.linear(x, want[name]), rtol=1e-5, atol=1e-4)
            got[name, n] = routes[0] if routes else "other"
    assert head.weight is embed.weight and head.weight.shape == (40, 16)  # tied: kept
    assert 1 < cut <= small + 1
    panel = 2 * cpu_ops.load_ops().vector_lanes()  # the build's panels (padded)
    padded = -(-8 // panel) * panel + -(-40 // panel) * panel
    # with 8 lanes the panels hold the bf16 copies' values (2 bytes each)
    panel_bytes = 2 if lanes == 8 else 4
    assert (packed, freed) == (padded * 16 * panel_bytes, 8 * 16 * 4)
    assert all(m.prepacked_weight.element_size() == panel_bytes for m in (layer, head))
    assert layer.weight.numel() == 0
    assert got == {(name, n): "small" if n < cut else "packed" for name, n in got}
    assert min_small_m_rows(model) == cut - 1  # the fused layer's range


def test_an_fp32_checkpoint_gets_no_packed_copy(ops):
    """No bf16 copy, no packed one: its plain weight is what the small-M kernel reads, and
    a second fp32 copy would double the weights' memory."""
    layer = RowParallelLinear(ParallelContext(), 16, 8, False, torch.float32)
    torch.nn.init.normal_(layer.weight)
    use_small_m_kernel(layer, ops.linear_small_m, 8, bf16_weights=True)
    assert layer.small_m_weight is None
    assert use_prepacked_weights(layer, ops.pack_linear_weight, ops.linear_packed) == 0
    assert release_plain_weights(layer) == 0 and layer.weight.shape == (8, 16)


def test_an_fp32_run_of_a_bf16_checkpoint_keeps_transformers_tokens_on_packed_weights(
        ops, tmp_path):
    """A bf16 checkpoint run in fp32, on whichever routes this CPU's kernels take (AVX2 or
    AVX-512: packed weights, plain ones released): greedy tokens equal transformers' fp32
    run of the same checkpoint, through prefill and decode batches on both sides of the
    small-M kernel's rows."""
    from kvray import LLM, SamplingParams
    from kvray.kernels import cpu_ops
    from tests.helpers.tiny_models import load_hf, make_tiny_model

    path = make_tiny_model("llama_gqa", tmp_path / "fp32")
    load_hf(path).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for file in path.iterdir():  # the tokenizer's files
        if not (tmp_path / "bf16" / file.name).exists():
            (tmp_path / "bf16" / file.name).write_bytes(file.read_bytes())
    ref = load_hf(tmp_path / "bf16")
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(5 + i % 7)] for i in range(40)]
    llm = LLM(str(tmp_path / "bf16"), dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=600, max_num_seqs=40)
    try:
        runner = llm.llm_engine.executor.worker.runner
        linears = [m for m in runner.model.modules() if hasattr(m, "prepacked_weight")]
        if cpu_ops.vector_lanes() >= 8:
            assert linears and all(m.prepacked_weight is not None for m in linears)
            released = [m for m in linears if m.weight.numel() == 0]
            assert released and all(m.small_m_weight is not None for m in released)
        # decode batches of 40 rows (packed), 20 (packed with AVX2, the small-M kernel with
        # AVX-512), then 10 (the small-M kernel)
        lengths = [4 if i % 2 else 9 if i % 4 == 2 else 12 for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in lengths], use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
