"""The Triton fused-MoE layer (``triton_moe.fused_moe``) against a plain per-token loop
over the chosen experts, on CPU under Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU): top-k 1 / 2 / 8, experts that receive no token,
one token to every expert, odd hidden and intermediate sizes, a subset of experts held
(expert parallelism), and the pair alignment's blocks. Tiny shapes: the interpreter is
slow."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.skips import triton_or_skip

triton_or_skip()

from kvray.kernels.triton_moe import BLOCK_M, align_pairs, fused_moe  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _loop(x, w13, w2, weights, experts, local_index):
    """Each token's chosen experts one at a time (those held here), SwiGLU, weighted sum."""
    out = torch.zeros_like(x, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(local_index[int(experts[t, j])])
            if e < 0:
                continue
            gate_up = w13[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def _case(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
          held: list[int] | None, allowed: list[int] | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    local = held if held is not None else list(range(num_experts))
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(len(local), 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(len(local), hidden, inter, generator=g) * 0.2
    pool = torch.tensor(allowed if allowed is not None else range(num_experts))
    experts = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]]
                           for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    local_index = torch.full((num_experts,), -1, dtype=torch.int64)
    local_index[torch.tensor(local)] = torch.arange(len(local))
    return x, w13, w2, weights, experts, local_index


@pytest.mark.parametrize("tokens,top_k,num_experts,hidden,inter,held,allowed", [
    (1, 1, 8, 48, 40, None, None),            # batch-1 decode, top-1
    (5, 2, 8, 48, 40, None, [1, 6]),          # six experts get nothing
    (37, 2, 8, 40, 24, None, None),           # several blocks per expert
    (7, 8, 8, 32, 24, None, None),            # every token to every expert
    (9, 2, 6, 40, 36, [0, 2, 5], None),       # expert parallel: half the experts here
    (3, 2, 4, 24, 20, [1, 3], [0, 2]),        # none of the chosen experts held here
])
def test_fused_moe_equals_a_per_token_loop(tokens, top_k, num_experts, hidden, inter, held,
                                           allowed):
    x, w13, w2, weights, experts, local_index = _case(tokens, top_k, num_experts, hidden,
                                                      inter, held, allowed, seed=tokens)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, experts, local_index)]
    got = fused_moe(*args).cpu()
    want = _loop(x, w13, w2, weights, experts, local_index)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_pairs_are_grouped_by_expert_in_whole_blocks():
    experts = torch.tensor([[3, 0], [3, 1], [0, 3]])  # expert 2 gets nothing
    local_index = torch.tensor([0, -1, 1, 2])  # expert 1 is another rank's
    pair_ids, block_experts = align_pairs(experts, 4, local_index)
    assert pair_ids.numel() == block_experts.numel() * BLOCK_M
    flat = experts.reshape(-1)
    seen = []
    for b, local in enumerate(block_experts.tolist()):
        ids = [p for p in pair_ids[b * BLOCK_M:(b + 1) * BLOCK_M].tolist() if p < flat.numel()]
        if local == -1:
            assert all(int(flat[p]) == 1 for p in ids)  # not held: skipped
            continue
        assert ids and all(int(local_index[flat[p]]) == local for p in ids)
        seen += ids
    assert sorted(seen) == [p for p in range(flat.numel()) if int(flat[p]) != 1]


def test_no_tokens_give_an_empty_output():
    x = torch.zeros(0, 32, device=DEVICE)
    out = fused_moe(x, torch.zeros(2, 32, 32, device=DEVICE), torch.zeros(2, 32, 16,
                                                                           device=DEVICE),
                    torch.zeros(0, 2, device=DEVICE),
                    torch.zeros(0, 2, dtype=torch.int64, device=DEVICE),
                    torch.arange(2, device=DEVICE))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("rank,expert_parallel", [(0, False), (1, True)])
def test_a_moe_layer_with_the_fused_kernel_computes_its_grouped_loop(rank, expert_parallel):
    """MoEExperts given ``fused_moe`` (as use_fused_ops installs the Triton ops) returns
    what its grouped loop returns: one rank of two, experts sliced or whole (EP), and the
    routing still counted."""
    from kvray.kernels import triton_ops
    from kvray.models.expert_stats import ExpertTokenCounts
    from kvray.models.moe import MoEExperts
    from kvray.parallel import ParallelContext

    g = torch.Generator().manual_seed(rank)
    ctx = ParallelContext(tp_rank=rank, tp_size=2, expert_parallel=expert_parallel)
    layer = MoEExperts(ctx, 6, 40, 48, torch.float32)
    for e in range(6):
        for part, shape in (("gate", (48, 40)), ("up", (48, 40)), ("down", (40, 48))):
            param = layer.w2_weight if part == "down" else layer.w13_weight
            param.weight_loader(param, torch.randn(*shape, generator=g) * 0.2, f"{e}.{part}")
    x = torch.randn(11, 40, generator=g)
    experts = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=g)
    want = layer(x, weights, experts)
    layer.to(DEVICE)
    layer.fused_moe = triton_ops.fused_moe
    layer.token_counts = ExpertTokenCounts([0], 6, DEVICE)
    with layer.token_counts.counting(11):
        got = layer(x.to(DEVICE), weights.to(DEVICE), experts.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert layer.token_counts.take()[0] == torch.bincount(experts.reshape(-1),
                                                          minlength=6).tolist()
