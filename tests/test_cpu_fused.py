"""kvray's fused CPU ops equal their PyTorch references: RMSNorm (with and without the
residual add), rotary embedding in place on a strided view, and silu-and-mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.kernels.norm import RMSNorm, rms_norm
from kvray.kernels.rotary import RotaryEmbedding

pytestmark = pytest.mark.parity

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,size", [(1, 576), (7, 64), (33, 24), (3, 1003)])
def test_fused_rms_norm_matches_the_reference(ops, dtype, rows, size):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, size, generator=gen).to(dtype)
    w = torch.randn(size, generator=gen).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **TOL[dtype])
    residual = torch.randn(rows, size, generator=gen).to(dtype)
    want_sum = x + residual
    want = rms_norm(want_sum, w, 1e-5)
    got = ops.rms_norm(x, w, 1e-5, residual)
    torch.testing.assert_close(residual, want_sum, rtol=0, atol=0)  # added in place, exactly
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_fused_rms_norm_of_fp32_rows_with_a_bf16_weight(ops):
    """A bf16 model's final norm after its fused decode layers: fp32 rows, bf16 weight (the
    weight's values widened, as if it were fp32)."""
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w = torch.randn(40, generator=g).bfloat16()
    res32 = res.clone()
    want = ops.rms_norm(x, w.float(), 1e-6, res32)
    got = ops.rms_norm(x, w, 1e-6, res)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(res, res32)


def test_rms_norm_module_gives_the_same_pair_with_the_fused_op(ops):
    norm = RMSNorm(16, 1e-6, torch.float32)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    want = norm(x, residual.clone())
    norm.fused = ops.rms_norm
    got = norm(x, residual.clone())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(norm(x.view(5, 2, 8)[:, :, :8].reshape(5, 16)),
                               rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 80])
def test_fused_rotary_rotates_a_view_of_qkv_in_place(ops, dtype, head_dim):
    tokens, hq, hk = 6, 3, 1
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim).to(dtype)
    positions = torch.tensor([0, 5, 17, 1, 300, 2])
    rope = RotaryEmbedding(head_dim, 10000.0, None, 512)
    qk_ref = qkv[:, : (hq + hk) * head_dim].view(tokens, -1, head_dim).clone()
    want = rope.rotate_qk(positions, qk_ref)
    v_before = qkv[:, (hq + hk) * head_dim:].clone()
    rope.fused_inplace = ops.rotary_inplace
    view = qkv[:, : (hq + hk) * head_dim].view(tokens, -1, head_dim)
    got = rope.rotate_qk(positions, view)
    assert got.data_ptr() == view.data_ptr()  # in place, in the projection's own storage
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], v_before)  # V untouched


def test_fused_rotary_grows_its_tables_for_long_positions(ops):
    rope = RotaryEmbedding(16, 10000.0, None, 8)
    rope.fused_inplace = ops.rotary_inplace
    x = torch.randn(2, 1, 16)
    want = RotaryEmbedding(16, 10000.0, None, 64).rotate_qk(torch.tensor([3, 40]), x.clone())
    torch.testing.assert_close(rope.rotate_qk(torch.tensor([3, 40]), x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_the_reference(ops, dtype):
    gate_up = torch.randn(9, 2 * 37).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


def test_fused_silu_and_mul_is_exact_to_a_few_ulp_over_the_whole_range(ops):
    """The vector exp behind the fp32 op: gates from -120 to 120 (past where e^-g
    overflows fp32 and where silu's value vanishes) within 4 ulp of float64 math down to
    |silu| of 1e-36 (below, e^g is a denormal with fewer bits), never NaN, and off by no
    more than the smallest normal fp32 beyond."""
    gate = torch.linspace(-120, 120, 4096).double()  # fp32 values, float64 math
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    got = ops.silu_and_mul(gate_up.float())[0].double()
    want = gate / (1 + torch.exp(-gate))
    f32 = torch.finfo(torch.float32)
    normal = want.abs() >= 1e-36
    err = (got - want).abs()
    assert (err[normal] <= 4 * f32.eps * want[normal].abs()).all()
    assert (err[~normal] <= f32.tiny).all() and not got.isnan().any()


def test_fused_bf16_residual_add_rounds_as_torch_does_specials_included(ops):
    """The vector bf16 store: sums rounded to nearest even like torch's, NaN, infinities
    and bf16 denormals too, in the vector body and the scalar tail alike."""
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(5)).bfloat16()
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-39, -3e-40, 0.0,
                             -0.0, 3.3e38], dtype=torch.bfloat16)
    x[0, :8] = specials
    x[1, 32:] = specials  # the tail of a 40-wide row
    residual = torch.randn(4, 40, generator=torch.Generator().manual_seed(6)).bfloat16()
    residual[:2] = torch.tensor(1e-39, dtype=torch.bfloat16)
    want = x + residual
    ops.rms_norm(x, torch.ones(40, dtype=torch.bfloat16), 1e-5, residual)
    nan = want.isnan()
    assert torch.equal(residual.isnan(), nan)  # torch's own NaN bits vary with its path
    assert torch.equal(residual[~nan].view(torch.int16), want[~nan].view(torch.int16))
