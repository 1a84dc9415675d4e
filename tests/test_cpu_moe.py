"""A MoE layer's experts in one C++ call (``cpu_ops.moe_experts``) against a plain
per-token, per-expert loop and against the layer's per-expert Python loop on the same
kernels, on odd shapes: top-k 1 / 2 / 8, experts that receive no token, one token to every
expert, widths that are not whole vectors, bf16 experts, experts held by another rank, and
int8 blob experts with and without act-order permutations. The layer takes the one call
up to its row limit and its loop past it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvray.models.moe import MoEExperts
from kvray.parallel import ParallelContext
from kvray.quant.blob import to_blob
from kvray.quant.online import quantize_int8
from tests.helpers.moe_routing import random_routing

pytestmark = pytest.mark.unit

HIDDEN, INTER, EXPERTS = 40, 36, 8  # neither a whole number of 16- or 32-lane vectors


def _layer(cpu_kernels, seed: int, dtype=torch.float32) -> MoEExperts:
    """Random experts with the CPU ops installed as use_fused_ops installs them."""
    g = torch.Generator().manual_seed(seed)
    experts = MoEExperts(ParallelContext(), EXPERTS, HIDDEN, INTER, dtype)
    experts.w13_weight.data = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.3
                               ).to(dtype)
    experts.w2_weight.data = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.3).to(dtype)
    experts.fused_linear = cpu_kernels.expert_linear
    experts.fused_silu_and_mul = cpu_kernels.silu_and_mul
    experts.cpu_moe, experts.cpu_moe_max_rows = cpu_kernels.moe_experts, 64
    return experts


def _per_token_loop(x, w13, w2, routing, choice, held=None):
    """float64 sum over each token's chosen experts (those in ``held``)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(choice.shape[1]):
            e = int(choice[t, j])
            if held is not None and e not in held:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += routing[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _both_paths(experts: MoEExperts, x, routing, choice):
    """The layer's output through the one call, then through its per-expert loop."""
    one_call = experts(x, routing, choice)
    experts.cpu_moe_max_rows = 0
    loop = experts(x, routing, choice)
    experts.cpu_moe_max_rows = 64
    return one_call, loop


@pytest.mark.parametrize("tokens,top_k,allowed", [
    (1, 1, list(range(8))), (1, 4, list(range(8))), (5, 2, [1, 6]),  # 6 experts get nothing
    (9, 8, list(range(8))),  # every token to every expert
    (3, 1, [7]), (32, 3, [0, 2, 3, 5])])
def test_one_call_experts_equal_a_per_token_loop_and_the_layers_loop(
        cpu_kernels, tokens, top_k, allowed):
    experts = _layer(cpu_kernels, seed=tokens + top_k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(top_k))
    routing, choice = random_routing(tokens, EXPERTS, top_k, allowed, seed=tokens)
    one_call, loop = _both_paths(experts, x, routing, choice)
    want = _per_token_loop(x, experts.w13_weight, experts.w2_weight, routing, choice)
    torch.testing.assert_close(one_call.double(), want, rtol=1e-5, atol=1e-5)
    # the same kernels where an expert's rows fit the small-M kernel (past its 16 rows with
    # AVX2 the loop takes the tiled one): equal to rounding
    torch.testing.assert_close(one_call, loop, rtol=1e-5, atol=1e-5)


def test_one_call_reads_bf16_experts_exactly_widened(cpu_kernels):
    experts = _layer(cpu_kernels, seed=1, dtype=torch.bfloat16)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    routing, choice = random_routing(6, EXPERTS, 2, list(range(8)), seed=3)
    got = cpu_kernels.moe_experts(x, routing, choice, experts._local_index_on(x.device),
                                  experts.w13_weight, experts.w2_weight)
    assert got.dtype == torch.float32
    want = _per_token_loop(x, experts.w13_weight, experts.w2_weight, routing, choice)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    as_bf16 = experts(x.bfloat16(), routing, choice)  # a bf16 model's layer: its dtype back
    assert as_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(as_bf16.double(), want, rtol=2e-2, atol=2e-2)


def test_one_call_adds_only_the_experts_this_rank_holds(cpu_kernels):
    """Expert parallelism: rows of another rank's experts are skipped, and the held
    experts (not a contiguous range) are found through local_index."""
    full = _layer(cpu_kernels, seed=4)
    held = [1, 2, 5, 6]
    local_index = torch.full((EXPERTS,), -1, dtype=torch.int64)
    local_index[held] = torch.arange(len(held))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5))
    routing, choice = random_routing(7, EXPERTS, 3, list(range(8)), seed=6)
    got = cpu_kernels.moe_experts(x, routing, choice, local_index,
                                  full.w13_weight[held].contiguous(),
                                  full.w2_weight[held].contiguous())
    want = _per_token_loop(x, full.w13_weight, full.w2_weight, routing, choice, set(held))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_one_call_on_int8_blob_experts_equals_the_layers_loop(cpu_kernels, act_order):
    """Quantized experts read as blobs: the one call gives the per-expert linear_q loop's
    values (activations quantized alike), and with act-order permutations each input is
    taken in its blob's column order."""
    experts = _layer(cpu_kernels, seed=7)
    g = torch.Generator().manual_seed(8)
    quant = []
    for e in range(EXPERTS):
        pair = []
        for w in (experts.w13_weight[e], experts.w2_weight[e]):
            q = quantize_int8(w)
            if act_order:
                q = dataclasses.replace(q, input_perm=torch.randperm(w.shape[1], generator=g))
            pair.append((to_blob(q), q.input_perm, q.dequantize()))
        quant.append(pair)
    experts.quant = [[(blob, perm) for blob, perm, _ in pair] for pair in quant]
    experts.quant_kind = "blob"
    x = torch.randn(5, HIDDEN, generator=g)
    routing, choice = random_routing(5, EXPERTS, 3, list(range(8)), seed=9)
    one_call, loop = _both_paths(experts, x, routing, choice)
    torch.testing.assert_close(one_call, loop, rtol=1e-6, atol=1e-6)
    dense13 = torch.stack([pair[0][2] for pair in quant])
    dense2 = torch.stack([pair[1][2] for pair in quant])
    want = _per_token_loop(x, dense13, dense2, routing, choice)
    # (the activations' int8 rounding: about 1 % of the outputs' range here)
    assert (one_call.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_the_layer_takes_the_one_call_up_to_its_row_limit(cpu_kernels, monkeypatch):
    experts = _layer(cpu_kernels, seed=10)
    calls = []
    experts.cpu_moe = lambda *a: calls.append(a[0].shape[0]) or cpu_kernels.moe_experts(*a)
    experts.cpu_moe_max_rows = 4
    for tokens in (1, 4, 5):
        x = torch.randn(tokens, HIDDEN)
        routing, choice = random_routing(tokens, EXPERTS, 2, list(range(8)), seed=tokens)
        experts(x, routing, choice)
    assert calls == [1, 4]


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,shared", [
    (1, 8, 2, True, False), (5, 32, 4, True, False), (3, 60, 4, False, True),
    (32, 8, 1, False, False), (7, 8, 8, True, True)])
def test_one_call_routing_equals_the_layers_torch_routing(cpu_kernels, tokens, experts, top_k,
                                                          renormalize, shared):
    """``moe_route``: router linear, softmax, top-k, renormalisation and the shared
    expert's sigmoid gate in one call give torch's routing (the same experts in the same
    order, weights to fp32 rounding) for every family's options."""
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, HIDDEN, generator=g)
    router = torch.randn(experts + int(shared), HIDDEN, generator=g) * 0.5
    weights, ids, scale = cpu_kernels.moe_route(x, router, top_k, renormalize, shared)
    logits = x.double() @ router.double().T
    want_w, want_ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w.float(), rtol=1e-5, atol=1e-6)
    if shared:
        torch.testing.assert_close(scale, torch.sigmoid(logits[:, experts:]).float())
    else:
        assert scale is None


def test_one_call_routing_breaks_ties_by_the_lower_expert_and_survives_nan(cpu_kernels):
    x = torch.ones(2, HIDDEN)
    router = torch.zeros(6, HIDDEN)
    router[4] = 1.0  # expert 4 first; 0..3 and 5 tie
    _, ids, _ = cpu_kernels.moe_route(x, router, 3, True, False)
    assert ids.tolist() == [[4, 0, 1], [4, 0, 1]]
    x[1, 0] = float("nan")  # a bad row routes somewhere, never out of range, no crash
    _, ids, _ = cpu_kernels.moe_route(x, router, 3, True, False)
    assert ids[0].tolist() == [4, 0, 1] and ((ids >= 0) & (ids < 6)).all()
    with pytest.raises(RuntimeError, match="top_k 7 of 6"):
        cpu_kernels.moe_route(x, router, 7, True, False)
