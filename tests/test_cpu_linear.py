"""The small-M linear kernel equals F.linear, and the model routes decode-sized inputs
through it (and larger ones through PyTorch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.models.layers import (
    WEIGHT_MAJOR_MAX_ROWS,
    ParallelLMHead,
    RowParallelLinear,
    use_small_m_kernel,
)
from kvray.parallel import ParallelContext


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 32])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (96, 64), (301, 577)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_matches_f_linear(ops, rows, out_features, in_features, with_bias):
    # Odd sizes: the 8-wide vector loop's tail and the 4/2-row weight groups' remainders.
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    # fp32 sums of in_features products in another order: error grows with the length
    torch.testing.assert_close(ops.linear_small_m(x, w, b), F.linear(x, w, b),
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

    use_small_m_kernel(layer, counting, max_rows=4)
    monkeypatch.setattr(torch, "mm", counting_mm)
    # past the kernel's rows: (W x^T)^T up to WEIGHT_MAJOR_MAX_ROWS, F.linear beyond
    for rows in (1, 4, 5, 32, WEIGHT_MAJOR_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 16)
        y = layer(x)
        assert y.is_contiguous() and y.shape == (rows, 8)
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    assert calls == [1, 4]
    assert weight_major == [5, 32, WEIGHT_MAJOR_MAX_ROWS]


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
