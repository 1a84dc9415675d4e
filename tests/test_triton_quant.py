"""The Triton quantized kernels against plain references, on CPU under Triton's interpreter
(conftest sets TRITON_INTERPRET=1 where there is no GPU): ``linear_quant`` over every
segment kind against ``QuantTensor.dequantize() @ x`` in fp64 (odd K padded to 32, odd N,
decode- and prefill-sized M, groups 16/32/128/per-row, fp16/fp32 scales, mins, split-K,
several segments, bias, act-order), online FP8 quantization's error bounds, and the paged
attention kernels on int8 / fp8 KV caches against the reference attention over the
dequantized cache. Tiny shapes: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.skips import NO_GPU, NOT_THIS_HARDWARE, triton_or_skip

triton_or_skip()

from kvray.kernels import triton_quant  # noqa: E402
from kvray.kernels.triton_quant import linear_quant  # noqa: E402
from kvray.quant.fp8 import FP8_E4M3_MAX, quantize_fp8, quantize_fp8_activations  # noqa: E402
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor, pack_u4  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _u4(rows: int, k: int, group: int, scale_dtype: torch.dtype, with_min: bool,
        seed: int) -> QuantSegment:
    g = _gen(seed)
    kp = -(-k // 32) * 32
    codes = torch.randint(0, 16, (rows, kp), generator=g)
    scales = (torch.rand(rows, kp // group, generator=g) / 8 + 0.01).to(scale_dtype)
    mins = (-torch.rand(rows, kp // group, generator=g)).to(scale_dtype) if with_min else None
    return QuantSegment(QuantKind.U4, group, pack_u4(codes), scales, mins)


def _s8(rows: int, k: int, group: int, scale_dtype: torch.dtype, seed: int) -> QuantSegment:
    g = _gen(seed)
    kp = -(-k // 32) * 32
    codes = torch.randint(-128, 128, (rows, kp), generator=g).to(torch.int8)
    scales = (torch.rand(rows, kp // group, generator=g) / 64 + 1e-3).to(scale_dtype)
    return QuantSegment(QuantKind.S8, group, codes, scales)


def _check(qt: QuantTensor, m: int, dtype: torch.dtype = torch.float32,
           bias: bool = False, seed: int = 0) -> None:
    """linear_quant == x @ dequantize()^T (+ bias) in fp64, within dtype's rounding."""
    g = _gen(seed + 1000)
    x = torch.randn(m, qt.shape[1], generator=g).to(dtype)
    b = torch.randn(qt.shape[0], generator=g).to(dtype) if bias else None
    want = x.double() @ qt.dequantize(torch.float64).T
    if b is not None:
        want += b.double()
    got = linear_quant(x.to(DEVICE), qt.to(DEVICE), None if b is None else b.to(DEVICE))
    assert got.shape == (m, qt.shape[0]) and got.dtype == dtype
    # fp32: summation order only. 16-bit: the activations' and (per element dequantized)
    # weights' rounding, and the output's.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("k,group", [(96, 16), (100, 32), (256, 128), (300, 32)])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("with_min", [False, True])
def test_u4_linear_matches_dequantized_reference(k, group, m, with_min):
    qt = QuantTensor((33, k), (_u4(33, k, group, torch.float16, with_min, seed=k + group),))
    _check(qt, m, seed=m)


@pytest.mark.parametrize("k,group,scale_dtype", [
    (100, 128, torch.float32), (96, 32, torch.float16), (256, 128, torch.float16),
    (256, 256, torch.float32)])
@pytest.mark.parametrize("m", [1, 40])
def test_s8_linear_matches_dequantized_reference(k, group, scale_dtype, m):
    qt = QuantTensor((7, k), (_s8(7, k, group, scale_dtype, seed=k),))
    _check(qt, m, seed=k + m)


@pytest.mark.parametrize("k,block", [(100, None), (256, None), (256, 128), (96, 32)])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_f8_linear_matches_dequantized_reference(k, block, m):
    w = torch.randn(33, k, generator=_gen(k)) * torch.linspace(0.01, 3, k)
    _check(quantize_fp8(w, block), m, seed=m)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_multi_segment_weight_writes_each_segments_rows_with_bias(m):
    # A fused QKV as a Q4_K_M GGUF stores it: U4 rows with mins, then other kinds.
    k = 100
    f8 = quantize_fp8(torch.randn(16, k, generator=_gen(3))).segments[0]
    segs = (_u4(9, k, 32, torch.float32, True, seed=1), _s8(7, k, 32, torch.float16, seed=2),
            f8)
    _check(QuantTensor((32, k), segs), m, bias=True, seed=m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 40])
def test_16_bit_activations_match_reference_within_their_rounding(dtype, m):
    k = 256
    segs = (_u4(16, k, 128, torch.float16, True, seed=4), _u4(8, k, 32, torch.float16, False,
                                                            seed=5),
            _s8(8, k, 256, torch.float32, seed=6))
    _check(QuantTensor((32, k), segs), m, dtype=dtype, bias=True, seed=m)


def test_act_order_weight_reads_activations_in_stored_column_order():
    k = 96
    perm = torch.randperm(k, generator=_gen(7))
    qt = QuantTensor((7, k), (_u4(7, k, 32, torch.float16, False, seed=8),), input_perm=perm)
    _check(qt, 5)


def test_act_order_tensor_parallel_shard_reads_its_padded_runs():
    """A row-parallel shard of an act-order weight stores its columns in padded runs; the
    padding reads a zero column past the activations' (gather_input)."""
    k = 128
    perm = torch.randperm(k, generator=_gen(12))
    full = QuantTensor((9, k), (_u4(9, k, 32, torch.float16, True, seed=13),), input_perm=perm)
    shard = full.narrow(1, 64, 64)
    assert shard.stored_k > 64
    _check(shard, 3)


@pytest.mark.parametrize("m", [1, 40])
def test_tensor_parallel_shard_views_are_read_in_place(m):
    # narrow() gives strided views of codes, scales and mins (a row-parallel shard's columns)
    full = QuantTensor((33, 256), (_u4(20, 256, 32, torch.float16, True, seed=9),
                                   _s8(13, 256, 64, torch.float32, seed=10)))
    shard = full.narrow(1, 128, 128).narrow(0, 3, 25)
    assert not shard.segments[0].codes.is_contiguous()
    _check(shard, m, seed=m)


def test_decode_batches_split_k_and_prefill_batches_use_the_gemm_tile():
    gemv, gemm = triton_quant.tile_config(1), triton_quant.tile_config(40)
    assert triton_quant.tile_config(16) == gemv and gemm != gemv
    # the shapes above exercise split-K, including an uneven last split (3 K tiles)
    assert triton_quant.num_k_splits(1, 33, 256, gemv) == 2
    assert triton_quant.num_k_splits(1, 33, 320, gemv) == 2
    assert triton_quant.num_k_splits(40, 33, 320, gemm) == 1
    # a large decode GEMV keeps whole K when N alone fills the device
    assert triton_quant.num_k_splits(1, 32768, 4096, gemv) == 1


def test_self_check_passes():
    triton_quant.self_check(DEVICE)


def test_fp8_scaled_mm_path_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip(f"{NO_GPU}: torch._scaled_mm runs on CUDA only")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{NOT_THIS_HARDWARE}: FP8 tensor cores need compute capability 8.9")
    k = 256
    qt = quantize_fp8(torch.randn(64, k, generator=_gen(9))).to(DEVICE)
    assert triton_quant.scaled_mm_supported(qt.segments[0],
                                            torch.empty(1, k, device="cuda",
                                                        dtype=torch.bfloat16))
    x = torch.randn(5, k, generator=_gen(10))
    bias = torch.randn(64, generator=_gen(11))
    want = x.double() @ qt.dequantize(torch.float64).cpu().T + bias.double()
    got = linear_quant(x.to("cuda", torch.bfloat16), qt, bias.to("cuda", torch.bfloat16))
    # e4m3 activations: each product carries up to 2^-4 relative rounding
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= 0.08 * want.abs().max().item()


# ---- online FP8 quantization -----------------------------------------------------------------

@pytest.mark.parametrize("k,block", [(100, None), (256, 128), (96, 32)])
def test_quantize_fp8_round_trip_error_is_within_e4m3_rounding(k, block):
    w = torch.randn(9, k, generator=_gen(k)) * torch.logspace(-3, 1, k)
    w[3] = 0.0  # an all-zero channel
    qt = quantize_fp8(w, block)
    seg = qt.segments[0]
    assert seg.kind == QuantKind.F8 and seg.scales.dtype == torch.float32
    assert seg.group == (qt.k_padded if block is None else block)
    deq = qt.dequantize()
    scales = seg.scales.repeat_interleave(seg.group, dim=1)[:, :k]
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative); subnormals step 2^-9 * scale
    bound = torch.maximum(w.abs() * 2.0 ** -4, scales * 2.0 ** -10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.equal(deq[3], torch.zeros(k))
    # the largest magnitude of each channel/block is a full-scale code, exactly
    groups = torch.nn.functional.pad(w, (0, qt.k_padded - k)).view(9, -1, seg.group)
    amax = groups.abs().amax(dim=2)
    nz = amax > 0
    torch.testing.assert_close(seg.scales[nz], amax[nz] / FP8_E4M3_MAX)


def test_quantize_fp8_rejects_blocks_that_do_not_divide_k():
    with pytest.raises(ValueError, match="block size 128"):
        quantize_fp8(torch.randn(4, 96), 128)


def test_fp8_activations_are_per_token_and_zero_padded():
    x = torch.randn(4, 100, generator=_gen(12)) * torch.tensor([[1e-3], [1.0], [50.0], [0.0]])
    codes, scales = quantize_fp8_activations(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (4, 128)
    assert scales.shape == (4, 1) and scales.dtype == torch.float32
    back = codes.float() * scales
    assert torch.equal(back[:, 100:], torch.zeros(4, 28))
    bound = torch.maximum(x.abs() * 2.0 ** -4, scales * 2.0 ** -10) * (1 + 1e-6)
    assert ((back[:, :100] - x).abs() <= bound).all()


# ---- paged attention over a quantized KV cache ------------------------------------------------

KV_DTYPES = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
             "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    """Reference: rows [..., D] -> [..., D + 4] of ``dtype`` (codes, then the fp32 scale's
    bytes) as q_common's layout says, with torch's own rounding."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    v = x / scale
    codes = v.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else v.to(dtype)
    raw = torch.cat([codes.view(torch.int8), scale.view(torch.int8)], dim=-1)
    return raw.view(dtype)


def _dequantize_cache(cache: torch.Tensor, dim: int) -> torch.Tensor:
    raw = cache.cpu().view(torch.int8)
    codes = raw[..., :dim].contiguous().view(cache.dtype).to(torch.float32)
    return codes * raw[..., dim:].contiguous().view(torch.float32)


def _quant_cache(kv: str, hk: int, dim: int, block_size: int, num_blocks: int,
                 seed: int) -> torch.Tensor:
    dtype, qmax = KV_DTYPES[kv]
    values = torch.randn(2, hk, num_blocks, block_size, dim, generator=_gen(seed))
    return _quantize_rows(values, dtype, qmax).to(DEVICE)


def _tables(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Each sequence's blocks: distinct physical blocks in a shuffled order."""
    perm = torch.randperm(num_blocks, generator=_gen(1)).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    rows, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        rows.append(perm[used:used + need] + [0] * (width - need))
        used += need
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_write_kv_quantizes_each_row_exactly_as_torch_rounds(kv):
    from kvray.kernels import triton_attention

    dtype, qmax = KV_DTYPES[kv]
    hk, dim, block_size, num_blocks = 2, 40, 16, 4
    k = torch.randn(5, hk, dim, generator=_gen(2))
    v = torch.randn(5, hk, dim, generator=_gen(3))
    k[1, 0] = 0.0  # an all-zero row: scale 1, codes 0
    v[2, 1] *= torch.logspace(-10, 0, dim)  # fp8 subnormals at the small end
    k[3, 1, 7] = -k[3, 1].abs().max() * 2  # the largest magnitude negative: code -QMAX
    slots = torch.tensor([0, 5, 17, 40, 63], device=DEVICE)
    cache = _quant_cache(kv, hk, dim, block_size, num_blocks, seed=4)
    want = cache.cpu().view(torch.int8).clone().view(2, hk, -1, dim + 4)
    want[0, :, slots.cpu()] = _quantize_rows(k, dtype, qmax).view(torch.int8).transpose(0, 1)
    want[1, :, slots.cpu()] = _quantize_rows(v, dtype, qmax).view(torch.int8).transpose(0, 1)
    triton_attention.write_kv(k.to(DEVICE), v.to(DEVICE), cache, slots)
    assert torch.equal(cache.cpu().view(torch.int8).view(2, hk, -1, dim + 4), want)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("hq,hk,dim,block_size,window", [
    (6, 2, 40, 16, None), (3, 3, 64, 32, 20)])
def test_paged_decode_on_quantized_cache_matches_reference_over_dequantized_cache(
        kv, hq, hk, dim, block_size, window):
    from kvray.kernels import attention as ref
    from kvray.kernels import triton_attention

    seq_lens = [1, 17, 50]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = _quant_cache(kv, hk, dim, block_size, num_blocks, seed=dim + hq)
    tables = _tables(seq_lens, block_size, num_blocks)
    q = torch.randn(len(seq_lens), hq, dim, generator=_gen(5)).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    got = triton_attention.paged_decode(q, cache, tables, lens, 0.125, window)
    dense = _dequantize_cache(cache, dim)
    want = torch.cat([ref._decode(q[i:i + 1].cpu(), dense, tables[i:i + 1].long().cpu(),
                                  lens[i:i + 1].cpu(), seq_lens[i], 0.125, window)
                      for i in range(len(seq_lens))])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("hq,hk,dim,block_size,window,block_m", [
    (4, 2, 40, 16, None, 8), (2, 1, 32, 16, 9, 16)])  # the second: the tl.dot path
def test_paged_prefill_on_quantized_cache_matches_reference_over_dequantized_cache(
        kv, hq, hk, dim, block_size, window, block_m):
    from kvray.kernels import attention as ref
    from kvray.kernels import triton_attention

    chunks = [(0, 5), (3, 20), (37, 9)]  # (cached prefix, new tokens)
    seq_lens = [c + n for c, n in chunks]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = _quant_cache(kv, hk, dim, block_size, num_blocks, seed=7 + dim)
    tables = _tables(seq_lens, block_size, num_blocks)
    starts = torch.tensor([0, *[n for _, n in chunks]]).cumsum(0)
    q = torch.randn(int(starts[-1]), hq, dim, generator=_gen(6))
    lens = torch.tensor(seq_lens)
    got = triton_attention.paged_prefill(q.to(DEVICE), cache, tables, lens.to(DEVICE),
                                         starts.to(DEVICE), max(n for _, n in chunks), 0.2,
                                         window, block_m=block_m)
    dense = _dequantize_cache(cache, dim)
    want = torch.cat([ref._prefill_one(q[starts[b]:starts[b + 1]], dense,
                                       tables[b].long().cpu(), seq_lens[b], 0.2, window)
                      for b in range(len(chunks))])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_quantized_cache_with_wrong_row_width_is_rejected():
    from kvray.kernels import triton_attention

    cache = torch.zeros(2, 1, 2, 16, 64, dtype=torch.int8, device=DEVICE)  # no scale bytes
    q = torch.zeros(1, 1, 64, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="expected 68"):
        triton_attention.paged_decode(q, cache, tables, torch.ones(1, device=DEVICE), 1.0,
                                      None)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_attention_self_check_passes_on_each_quantized_cache(kv):
    from kvray.kernels import triton_attention

    triton_attention.self_check(DEVICE, torch.float32, KV_DTYPES[kv][0])
