"""The fused Triton ops (residual + RMSNorm, rotary in place, SiLU-and-mul) against their
PyTorch references, on CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1
where there is no GPU): odd widths that are not powers of two, one row and many, bf16
rounding, rotary on a strided q/k view of a fused QKV output. Tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.kernels import triton_ops
from kvray.kernels.norm import rms_norm as ref_rms_norm
from kvray.kernels.rotary import RotaryEmbedding, _rotate
from tests.helpers.skips import triton_or_skip

pytestmark = pytest.mark.parity


triton_or_skip()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("rows,width", [(1, 64), (5, 80), (3, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual_matches_reference(rows, width, dtype):
    x, res = _rand(rows, width, seed=1, dtype=dtype), _rand(rows, width, seed=2, dtype=dtype)
    w = _rand(width, seed=3, dtype=dtype)
    # fp32: the same arithmetic. bf16: two ulps (Triton's interpreter rounds bf16 its own
    # way; a GPU rounds to nearest like torch).
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5),
                               **tol)
    total = x + res
    got = triton_ops.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(res, total, **tol, msg="the residual must hold x + residual")
    torch.testing.assert_close(got, ref_rms_norm(res, w, 1e-5), **tol)


def test_rms_norm_keeps_leading_shape():
    """q/k norms of Qwen3 normalise [T, heads, head_dim]."""
    x, w = _rand(3, 2, 24, seed=4), _rand(24, seed=5)
    got = triton_ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref_rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 80, 24])
def test_rotary_in_place_on_a_qkv_view_matches_reference(head_dim):
    """The engine rotates q and k side by side inside the fused QKV output, a strided
    view whose v part must stay untouched."""
    hq, hk, tokens = 6, 2, 5
    qkv = _rand(tokens, (hq + 2 * hk) * head_dim, seed=6)
    v_before = qkv[:, (hq + hk) * head_dim:].clone()
    qk = qkv[:, :(hq + hk) * head_dim].view(tokens, hq + hk, head_dim)
    rope = RotaryEmbedding(head_dim, 10000.0, None, 64)
    positions = torch.tensor([0, 1, 17, 40, 63], device=DEVICE)
    rope._grow(positions)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want = _rotate(qk.clone(), cos, sin)
    got = triton_ops.rotary_inplace(qk, positions, rope.cos, rope.sin)
    assert got.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], v_before)


@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 96), (2, 1536)])
def test_silu_and_mul_matches_reference(rows, inter):
    gate_up = _rand(rows, 2 * inter, seed=7)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)


def test_self_check_passes_where_the_ops_work():
    triton_ops.self_check(DEVICE)
    triton_ops.self_check(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_reference(dtype):
    """Batched LoRA: three slices of odd widths (column blocks straddling them), ranks 0 to
    16 per slot and slice, rows of no adapter; the kernel adds what the reference adds."""
    from kvray.kernels import triton_lora
    from kvray.kernels.lora import lora_add_reference
    from kvray.lora.layers import LoRABatch, LoRAWeights

    sizes, slots, max_rank, k = [70, 40, 40], 3, 16, 96
    weights = LoRAWeights(LoRABatch(), sizes, k, slots, max_rank, dtype, torch.device(DEVICE),
                          lora_add_reference)
    for s in range(slots):
        for i, size in enumerate(sizes):
            r = [0, 4, 16][(s + i) % 3]
            if r:
                weights.set(s, i, _rand(r, k, seed=10 * s + i, dtype=dtype),
                            _rand(size, r, seed=100 + 10 * s + i, dtype=dtype))
    x, y = _rand(7, k, seed=1, dtype=dtype), _rand(7, sum(sizes), seed=2, dtype=dtype)
    rows = torch.tensor([0, -1, 2, 1, 2, -1, 0], device=DEVICE)
    want = lora_add_reference(y.clone(), x, weights.a, weights.bt, weights.ranks,
                              weights.slice_starts, rows)
    got = triton_lora.lora_add(y.clone(), x, weights.a, weights.bt, weights.ranks,
                               weights.slice_starts, rows)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)

