"""The fused Triton kernels against their PyTorch references, on CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU): rotary + KV-cache
write in one launch (partial rotary, every KV cache kind), residual + RMSNorm + per-token FP8
quantization in one launch, the one-pass decode kernel beside the split one, Gemma 2's score
capping in the decode and prefill kernels, and the launches a decoder layer saves. Odd head
counts, head dims 64/80/128, block sizes 8/16/32, sequences crossing blocks, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from kvray.kernels import attention as ref
from kvray.kernels import triton_attention, triton_ops, triton_quant
from kvray.kernels.norm import rms_norm as ref_rms_norm
from kvray.kernels.rotary import RotaryEmbedding
from kvray.quant.fp8 import quantize_fp8, quantize_fp8_activations
from tests.helpers.skips import triton_or_skip

triton_or_skip()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_DTYPES = (None, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE, dtype)


def _empty_cache(hk: int, dim: int, num_blocks: int, block_size: int, kv_dtype,
                 dtype) -> torch.Tensor:
    width = dim + triton_attention.SCALE_BYTES if kv_dtype is not None else dim
    return torch.zeros(2, hk, num_blocks, block_size, width, dtype=kv_dtype or dtype,
                       device=DEVICE)


def _values(cache: torch.Tensor, dim: int) -> torch.Tensor:
    """A cache's values in fp32 (a quantized one's codes times scales)."""
    if cache.dtype in triton_attention.KV_KINDS:
        return triton_attention.dequantize_cache(cache, dim)
    return cache.float()


# ---- rotary + KV write ---------------------------------------------------------------------

@pytest.mark.parity
@pytest.mark.parametrize("hq,hk,dim,rot_dim,block_size", [
    (3, 1, 64, 64, 16), (9, 3, 80, 80, 8), (5, 5, 128, 96, 32), (6, 2, 80, 40, 16),
])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_equals_rotary_then_write(hq, hk, dim, rot_dim, block_size, kv_dtype,
                                                  dtype):
    """q turned in place inside a fused QKV output, k turned and written with v, in one
    launch: what the reference's rotary (partial where rot_dim < dim) and KV write give."""
    tokens, num_blocks = 7, 5
    rotary = RotaryEmbedding(dim, 10000.0, None, 64, rot_dim=rot_dim)
    positions = torch.tensor([0, 3, 15, 16, 17, 40, 63], device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=_gen(1))[:tokens].to(DEVICE)
    qkv = _rand(tokens, (hq + 2 * hk) * dim, seed=2, dtype=dtype)
    q = qkv[:, :hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim:(hq + hk) * dim].view(tokens, hk, dim)
    v = qkv[:, (hq + hk) * dim:].view(tokens, hk, dim)
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    want_cache = _empty_cache(hk, dim, num_blocks, block_size, kv_dtype, dtype)
    ref.write_kv_cache(want_k, v, want_cache, slots)
    k_before = k.clone()
    cache = _empty_cache(hk, dim, num_blocks, block_size, kv_dtype, dtype)
    triton_attention.rotary_write_kv(q, k, v, positions, *rotary.tables(positions), cache,
                                     slots)
    # bf16: one rounding where the reference rounds each product (a couple of ulps)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q, want_q, **tol)
    assert torch.equal(k, k_before), "k itself stays as it was"
    got, want = _values(cache, dim), _values(want_cache, dim)
    if kv_dtype is not None:  # a rounding apart may land a code step apart
        rel = (0.5 / 127 if kv_dtype == torch.int8 else 2.0 ** -3) \
            + (2.0 ** -6 if dtype == torch.bfloat16 else 0.0)
        bound = 2 * rel * want.abs().amax(-1, keepdim=True) + 1e-6
        assert ((got - want).abs() <= bound).all()
    else:
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parity
def test_rotary_write_kv_leaves_unwritten_slots_alone():
    cache = _empty_cache(2, 64, 3, 16, None, torch.float32)
    rotary = RotaryEmbedding(64, 10000.0, None, 32)
    q, k, v = (_rand(2, h, 64, seed=s) for s, h in ((3, 4), (4, 2), (5, 2)))
    positions = torch.tensor([5, 9], device=DEVICE)
    triton_attention.rotary_write_kv(q, k, v, positions, *rotary.tables(positions), cache,
                                     torch.tensor([17, 40], device=DEVICE))
    written = torch.zeros(3 * 16, dtype=torch.bool)
    written[[17, 40]] = True
    flat = cache.view(2, 2, 48, 64)
    assert (flat[:, :, ~written] == 0).all() and (flat[:, :, written] != 0).all()


# ---- residual + RMSNorm + FP8 activations --------------------------------------------------

@pytest.mark.parity
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 80), (3, 100), (2, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_equals_norm_then_activation_quantization(rows, width, dtype,
                                                               with_residual):
    """Bit for bit: the codes (zero-padded to a multiple of 32) and scales the FP8 GEMM
    would have made of the norm's output, and the residual sum left in place."""
    x, w = _rand(rows, width, seed=6, dtype=dtype), _rand(width, seed=7, dtype=dtype)
    res = _rand(rows, width, seed=8, dtype=dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    got = triton_ops.rms_norm_fp8(x, w, 1e-5, res)
    want_codes, want_scales = quantize_fp8_activations(triton_ops.rms_norm(x, w, 1e-5,
                                                                           res_ref))
    assert got.codes.dtype == torch.float8_e4m3fn and got.width == width
    assert torch.equal(got.codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(got.scales, want_scales)
    if with_residual:
        assert torch.equal(res, res_ref)
    # and the norm itself is the reference's, within e4m3's rounding
    normed = ref_rms_norm(x.float() + (res_ref.float() - x.float() if with_residual else 0),
                          w.float(), 1e-5)
    back = got.codes[:, :width].float() * got.scales
    assert ((back - normed).abs() <= normed.abs().amax(-1, keepdim=True) * 2 ** -3 + 1e-2).all()


@pytest.mark.parity
@pytest.mark.parametrize("rows,width", [(1, 64), (4, 100), (3, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_fp8_rows_equals_torch_activation_quantization(rows, width, dtype):
    x = _rand(rows, width, seed=19, dtype=dtype) * 3
    got = triton_ops.quantize_fp8_rows(x[:, :width])
    codes, scales = quantize_fp8_activations(x)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got.scales, scales) and got.dtype == dtype and got.width == width


@pytest.mark.parity
def test_rms_norm_fp8_of_a_zero_row_takes_the_least_scale():
    x = torch.zeros(2, 64, device=DEVICE)
    got = triton_ops.rms_norm_fp8(x, torch.ones(64, device=DEVICE), 1e-6)
    assert (got.codes.view(torch.uint8) == 0).all()
    assert torch.equal(got.scales, quantize_fp8_activations(x)[1])


@pytest.mark.unit
@pytest.mark.parametrize("m", [1, 5])
def test_linear_takes_fp8_rows_from_the_norm_as_it_would_quantize_them(m, monkeypatch):
    """The FP8 GEMM's path (torch._scaled_mm; it has CPU kernels too) gives the same output
    from rows the norm quantized as from the rows it quantizes itself."""
    monkeypatch.setattr(triton_quant, "scaled_mm_possible",
                        lambda seg, device, dtype: seg.kind == triton_quant.QuantKind.F8)
    qt = quantize_fp8(torch.randn(48, 80, generator=_gen(9))).to(DEVICE)
    bias = _rand(48, seed=10, dtype=torch.bfloat16)
    x, w = _rand(m, 80, seed=11, dtype=torch.bfloat16), _rand(80, seed=12, dtype=torch.bfloat16)
    assert triton_quant.takes_fp8_rows(qt, torch.device(DEVICE), torch.bfloat16)
    want = triton_quant.linear_quant(triton_ops.rms_norm(x, w, 1e-6), qt, bias)
    got = triton_quant.linear_quant(triton_ops.rms_norm_fp8(x, w, 1e-6), qt, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.unit
@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("m", [1, 6])
def test_fp8_tensor_core_path_matches_the_dequantized_weight(segments, m, monkeypatch):
    """The GEMM on FP8 rows (one segment: straight out of torch._scaled_mm, its bias in the
    epilogue; several: each into its columns) within e4m3's rounding of x @ W^T + b."""
    monkeypatch.setattr(triton_quant, "scaled_mm_possible",
                        lambda seg, device, dtype: seg.kind == triton_quant.QuantKind.F8)
    parts = [quantize_fp8(torch.randn(32, 96, generator=_gen(20 + i))) for i in range(segments)]
    qt = triton_quant.QuantTensor((32 * segments, 96),
                                  tuple(s for p in parts for s in p.segments)).to(DEVICE)
    x = _rand(m, 96, seed=22, dtype=torch.bfloat16)
    bias = _rand(32 * segments, seed=23, dtype=torch.bfloat16)
    got = triton_quant.linear_quant(x, qt, bias)
    want = x.double() @ qt.dequantize(torch.float64).T + bias.double()
    assert got.shape == (m, 32 * segments) and got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 0.08 * want.abs().max()


@pytest.mark.unit
def test_only_fp8_weights_on_fp8_tensor_cores_take_fp8_rows():
    qt = quantize_fp8(torch.randn(48, 80, generator=_gen(13)))
    assert not triton_quant.takes_fp8_rows(qt, torch.device("cpu"), torch.bfloat16)


# ---- decode: one pass, split, capped scores ------------------------------------------------

def _decode_case(hq: int, hk: int, dim: int, block_size: int, seq_lens: list[int],
                 kv_dtype, dtype, width: int):
    """(q, cache, block tables ``width`` wide, lens) with K/V written by the reference."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    cache = _empty_cache(hk, dim, num_blocks, block_size, kv_dtype, dtype)
    perm = torch.randperm(num_blocks, generator=_gen(14)).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n] + [perm[-1]] * (width - n))
        used += n
    tables_t = torch.tensor(tables, device=DEVICE)
    slots = torch.cat([tables_t[b, torch.arange(n, device=DEVICE) // block_size] * block_size
                       + torch.arange(n, device=DEVICE) % block_size
                       for b, n in enumerate(seq_lens)])
    k = _rand(len(slots), hk, dim, seed=15, dtype=dtype)
    v = _rand(len(slots), hk, dim, seed=16, dtype=dtype)
    ref.write_kv_cache(k, v, cache, slots)
    q = _rand(len(seq_lens), hq, dim, seed=17, dtype=dtype)
    return q, cache, tables_t, torch.tensor(seq_lens, device=DEVICE)


def _reference_decode(q, cache, tables, lens, scale, window, softcap):
    meta = ref.AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, device=DEVICE), positions=lens - 1,
        block_tables=tables, seq_lens=lens, seq_lens_list=lens.tolist(),
        num_decodes=len(lens))
    return ref.paged_attention(q, cache, meta, scale, window, softcap)


@pytest.mark.parity
@pytest.mark.parametrize("hq,hk,dim,block_size,window,softcap", [
    (3, 1, 64, 16, None, None), (9, 3, 80, 8, None, 30.0), (5, 5, 128, 32, None, None),
    (6, 2, 80, 16, 20, 50.0),
])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_pass", [True, False])
def test_decode_one_pass_and_split_match_reference(hq, hk, dim, block_size, window, softcap,
                                                   kv_dtype, dtype, one_pass):
    """Both kernels over GQA groups, partial last blocks, windows, capped scores and
    quantized caches; which runs is picked by the tables' width."""
    seq_lens = [3 * block_size - 2, block_size + 1, 1]  # longest first, as batches come
    width = 3 if one_pass else triton_attention.ONE_PASS_MAX_BLOCKS + 1
    assert triton_attention.decode_in_one_pass(width, len(seq_lens) * hk) == one_pass
    q, cache, tables, lens = _decode_case(hq, hk, dim, block_size, seq_lens, kv_dtype, dtype,
                                          width)
    got = triton_attention.paged_decode(q, cache, tables, lens, dim ** -0.5, window,
                                        softcap=softcap)
    want = _reference_decode(q, cache, tables, lens, dim ** -0.5, window, softcap)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.unit
def test_one_pass_is_picked_for_short_tables_or_a_full_device():
    limit = triton_attention.ONE_PASS_MAX_BLOCKS
    assert triton_attention.decode_in_one_pass(limit, 1)
    assert not triton_attention.decode_in_one_pass(limit + 1, 8)
    assert triton_attention.decode_in_one_pass(limit + 1, triton_attention.TARGET_PROGRAMS)


@pytest.mark.parity
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_prefill_with_capped_scores_matches_reference(kv_dtype):
    """Chunks after cached prefixes, scores capped before the causal mask."""
    hq, hk, dim, block_size = 6, 2, 80, 16
    seq_lens = [20, 37]
    q_lens = [20, 5]
    _, cache, tables, lens = _decode_case(hq, hk, dim, block_size, seq_lens, kv_dtype,
                                          torch.float32, 3)
    q = _rand(sum(q_lens), hq, dim, seed=18)
    starts = torch.tensor([0, 20, 25], device=DEVICE)
    got = triton_attention.paged_prefill(q, cache, tables, lens, starts, 20, dim ** -0.5,
                                         None, softcap=25.0)
    want = ref.prefill_reference(q, cache, tables, lens, starts, 20, dim ** -0.5, None, 25.0)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.unit
def test_the_triton_plan_hands_capped_scores_to_its_kernels():
    """Gemma 2 on the Triton kernels: no fallback to the per-sequence reference."""
    from kvray.kernels.plan import choose_kernel_plan

    plan = choose_kernel_plan("triton", torch.device("cpu"), torch.float32, None, 1)
    assert plan.kernels["kernels_take_softcap"]


# ---- launches per decoder layer ------------------------------------------------------------

@pytest.mark.parity
def test_fused_decoder_layer_launches_fewer_kernels_and_computes_the_same():
    """One decode step of a tiny Llama's layer on the Triton path: rotary + KV write fused
    and the one-pass decode save launches (the profiler counts the same on a GPU), and the
    layer's output and cache are the unfused path's."""
    from kvray.testing.kernel_count import decode_layer_launches, tiny_llama, unfuse

    fused_model, plan = tiny_llama()
    plain_model, _ = tiny_llama()
    unfuse(plain_model)
    fused, fused_out = decode_layer_launches(fused_model, plan, context_len=40)
    plain, plain_out = decode_layer_launches(plain_model, plan, context_len=40)
    long_fused, _ = decode_layer_launches(fused_model, plan, context_len=40, table_blocks=64)
    assert fused.triton["rotary_write_kv_kernel"] == 1 and "write_kv_kernel" not in fused.triton
    assert fused.triton["decode_one_pass_kernel"] == 1 and "decode_merge_kernel" not in fused.triton
    assert long_fused.triton["decode_merge_kernel"] == 1
    assert fused.total == plain.total - 1 and long_fused.total == fused.total + 1
    assert fused.torch == {"linear": 4}, "no copies or other PyTorch ops between kernels"
    for a, b in zip(fused_out, plain_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parity
def test_fp8_decoder_layer_quantizes_in_its_norms_and_computes_the_same(monkeypatch):
    """With FP8 linears on FP8 tensor cores (torch._scaled_mm: its CPU kernels stand in
    here), the norms before qkv_proj and gate_up_proj hand over FP8 rows in their own
    launch instead of a norm and the activation quantization's PyTorch ops."""
    from kvray.testing.kernel_count import decode_layer_launches, tiny_llama, unfuse

    monkeypatch.setattr(triton_quant, "scaled_mm_possible",
                        lambda seg, device, dtype: seg.kind == triton_quant.QuantKind.F8)
    fused_model, plan = tiny_llama(dtype=torch.bfloat16, quantization="fp8")
    plain_model, _ = tiny_llama(dtype=torch.bfloat16, quantization="fp8")
    unfuse(plain_model)
    attn = fused_model.model.layers[1].self_attn
    assert attn.qkv_proj.takes_fp8_rows and attn.o_proj.takes_fp8_rows
    fused, fused_out = decode_layer_launches(fused_model, plan, context_len=20)
    plain, plain_out = decode_layer_launches(plain_model, plan, context_len=20)
    assert fused.torch == plain.torch == {"_scaled_mm": 4}, "no copies, no PyTorch quantizing"
    # two of the four linears' activations come quantized from the norm's kernel
    assert fused.triton["fp8_rows_kernel"] == 2 and plain.triton["fp8_rows_kernel"] == 4
    assert fused.total == plain.total - 3  # and rotary + KV write in one
    for a, b in zip(fused_out, plain_out, strict=True):
        assert torch.equal(a, b)

