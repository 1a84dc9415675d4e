"""Paged attention against plain attention: the PyTorch reference path, and the C++ CPU
decode and prefill kernels against the reference (fp32 exact to rounding, bf16 close), with
and without Gemma 2's soft-capped scores."""

from __future__ import annotations

import pytest
import torch

from kvray.kernels.attention import (
    AttentionMetadata,
    decode_buckets,
    dense_attention,
    paged_attention,
    write_kv_cache,
)
from kvray.kernels.kv_quant import dequantize_rows, is_quantized, quantize_rows, round_query_rows

pytestmark = pytest.mark.parity

HK, G, D, BS, NUM_BLOCKS = 2, 3, 16, 4, 64


def _paged_setup(context_lens, query_lens, dtype=torch.float32, seed=0):
    """Random K/V for whole sequences written into a shuffled paged cache, and the metadata of
    a step whose new tokens are the last ``query_lens`` of each sequence."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, HK, NUM_BLOCKS, BS, D, dtype=dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, slots, ks, vs, qs, positions, starts = [], [], [], [], [], [], [0]
    for n, nq in zip(context_lens, query_lens, strict=True):
        nblk = -(-n // BS)
        table = [perm.pop() for _ in range(nblk)]
        tables.append(table)
        k = torch.randn(n, HK, D, generator=g).to(dtype)
        v = torch.randn(n, HK, D, generator=g).to(dtype)
        all_slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        write_kv_cache(k[: n - nq], v[: n - nq], cache, all_slots[: n - nq])  # context
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(nq, HK * G, D, generator=g).to(dtype))
        slots.append(all_slots[n - nq:])
        positions.append(torch.arange(n - nq, n))
        starts.append(starts[-1] + nq)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts), positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(context_lens), seq_lens_list=list(context_lens),
        num_decodes=sum(1 for q in query_lens if q == 1))
    return cache, meta, ks, vs, qs


def _expected(ks, vs, qs, window=None):
    outs = []
    for k, v, q in zip(ks, vs, qs, strict=True):
        n, nq = k.shape[0], q.shape[0]
        full_q = torch.cat([torch.zeros(n - nq, *q.shape[1:], dtype=q.dtype), q])
        meta = AttentionMetadata.for_full_sequences([n])
        outs.append(dense_attention(full_q, k, v, meta, D ** -0.5, window)[n - nq:])
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_reference_matches_dense_for_mixed_decode_and_prefill(window):
    # Decodes first (longest first), then prefill chunks with and without cached context.
    context = [23, 17, 9, 2, 30, 12]
    queries = [1, 1, 1, 1, 30, 7]
    cache, meta, ks, vs, qs = _paged_setup(context, queries)
    q = torch.cat(qs)
    k_new = torch.cat([k[n - nq:] for k, n, nq in zip(ks, context, queries, strict=True)])
    v_new = torch.cat([v[n - nq:] for v, n, nq in zip(vs, context, queries, strict=True)])
    write_kv_cache(k_new, v_new, cache, meta.slot_mapping)
    got = paged_attention(q, cache, meta, D ** -0.5, window)
    assert torch.allclose(got, _expected(ks, vs, qs, window), atol=1e-5)


@pytest.mark.parametrize("lens,max_buckets,want", [
    # 95 and 90 are >= 0.8 x 100 = 80, so they share 100's padding; 60 < 80 opens a bucket.
    # 58 >= 0.8 x 60 = 48 joins it; 20 < 48 opens one, 3 < 16 another; 2 < 0.8 x 3 = 2.4 would
    # open a fifth, but the fourth bucket is the last one allowed, so 2 is padded to 3.
    ([100, 95, 90, 60, 58, 20, 3, 2], 4, [(0, 3), (3, 5), (5, 6), (6, 8)]),
    # Compared with the bucket's FIRST row, not the previous one: 85 >= 80 stays, 79 < 80
    # opens a bucket at 79, then 70 >= 0.8 x 79 = 63.2 stays with it.
    ([100, 85, 79, 70], 4, [(0, 2), (2, 4)]),
    # The bound is strict: 8 == 0.8 x 10 is not below it, 7 is.
    ([10, 8], 4, [(0, 2)]),
    ([10, 7], 4, [(0, 1), (1, 2)]),
    # Equal lengths never split; a single row is one bucket.
    ([5, 5, 5], 4, [(0, 3)]),
    ([7], 4, [(0, 1)]),
    # max_buckets=2: 50 < 80 opens the second and last bucket, which takes every shorter row.
    ([100, 50, 25, 12, 6], 2, [(0, 1), (1, 5)]),
    ([], 4, []),
])
def test_decode_buckets_pad_little_and_cover_every_row(lens, max_buckets, want):
    assert decode_buckets(lens, max_buckets=max_buckets) == want


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return cpu_kernels.paged_decode


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_decode_kernel_matches_the_reference(kernel, dtype, atol, window):
    context = [31, 22, 16, 15, 5, 1]
    cache, meta, ks, vs, qs = _paged_setup(context, [1] * len(context), dtype)
    q = torch.cat(qs)
    k_new = torch.cat([k[-1:] for k in ks])
    v_new = torch.cat([v[-1:] for v in vs])
    write_kv_cache(k_new, v_new, cache, meta.slot_mapping)
    ref = paged_attention(q, cache, meta, D ** -0.5, window)
    meta.decode_kernel = kernel
    fast = paged_attention(q, cache, meta, D ** -0.5, window)
    assert fast.dtype == dtype
    assert torch.allclose(fast.float(), ref.float(), atol=atol)
    assert torch.allclose(fast.float(), _expected(ks, vs, qs, window).float(), atol=atol)


@pytest.mark.parametrize("head_dim", [64, 24])
def test_cpu_decode_kernel_reads_a_bf16_cache_for_an_fp32_query(kernel, head_dim):
    """The fused decode layer of a bf16 model: fp32 q over the bf16 cache, fp32 out; the
    same numbers as the fp32 kernel over the cache's values widened."""
    g = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(2, 2, 8, 4, head_dim, generator=g).bfloat16()
    q = torch.randn(2, 4, head_dim, generator=g)
    tables = torch.tensor([[3, 1, 0], [5, 2, 0]])
    lens = torch.tensor([10, 6])
    got = kernel(q, cache, tables, lens, 0.2, -1)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernel(q, cache.float(), tables, lens, 0.2, -1))
    with pytest.raises(RuntimeError, match="q must have the cache's dtype or be fp32"):
        kernel(q.bfloat16(), cache.float(), tables, lens, 0.2, -1)


@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 16, 4), (64, 32, 1),
                                                     (64, 4, 2), (128, 8, 3), (96, 16, 2),
                                                     (32, 16, 3)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [-1, 13])
def test_cpu_decode_kernel_vector_paths_match_a_float64_reference(
        kernel, head_dim, block_size, group, cache_dtype, window):
    """Head sizes of four vectors take the kernel's vector code (64 and 128 with AVX-512, 32
    and 96 too with AVX2; eight keys at a time, then one at a time), reading fp32 and bf16
    blocks in place and fp16 ones converted: context lengths on both sides of 8 and of a
    block, any block order."""
    g = torch.Generator().manual_seed(head_dim + block_size + group)
    lens = [1, 5, 8, 9, 16, 17, 31, 100]
    hk, blocks = 2, 160
    cache = torch.randn(2, hk, blocks, block_size, head_dim, generator=g).to(cache_dtype)
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(order[used:used + nb] + [0] * (width - nb))
        used += nb
    tables_t = torch.tensor(tables)
    q = torch.randn(len(lens), hk * group, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = kernel(q.to(cache_dtype) if cache_dtype == torch.float32 else q, cache, tables_t,
                 torch.tensor(lens), scale, window)
    for b, n in enumerate(lens):
        slots = [tables[b][t // block_size] * block_size + t % block_size for t in range(n)]
        k = cache[0].reshape(hk, -1, head_dim)[:, slots].double()  # [hk, n, D]
        v = cache[1].reshape(hk, -1, head_dim)[:, slots].double()
        start = max(0, n - window) if window > 0 else 0
        for h in range(hk * group):
            kv_h = h // group
            scores = (k[kv_h, start:] @ q[b, h].double()) * scale
            want = torch.softmax(scores, 0) @ v[kv_h, start:]
            torch.testing.assert_close(got[b, h].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k_dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_cpu_kv_write_equals_the_reference_scatter(cpu_kernels, k_dtype, cache_dtype):
    """The CPU backend's K/V write: the same cache as write_kv_cache's index_copy_, from
    strided views of a QKV output; fp32 K/V into a bf16 cache are rounded to it."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 * HK) * D, generator=g).to(k_dtype)
    k = qkv[:, 4 * D:(4 + HK) * D].view(5, HK, D)
    v = qkv[:, (4 + HK) * D:].view(5, HK, D)
    slots = torch.tensor([7, 0, 63, 200, NUM_BLOCKS * BS - 1])
    want = torch.randn(2, HK, NUM_BLOCKS, BS, D, generator=g).to(cache_dtype)
    got = want.clone()
    write_kv_cache(k.to(cache_dtype), v.to(cache_dtype), want, slots)
    cpu_kernels.write_kv(k, v, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.write_kv(k, v, got, torch.tensor([0, 1, 2, 3, NUM_BLOCKS * BS]))
    with pytest.raises(RuntimeError, match="the cache's dtype or fp32"):
        cpu_kernels.write_kv(k.half(), v.half(), got, slots)


def test_cpu_decode_kernel_handles_unusual_head_dim(kernel):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 1, 8, 4, 24, generator=g)
    q = torch.randn(2, 2, 24, generator=g)
    tables = torch.tensor([[3, 1, 0], [5, 2, 0]])
    lens = torch.tensor([10, 6])
    meta = AttentionMetadata(torch.tensor([0, 1, 2]), torch.tensor([9, 5]), torch.tensor([0, 0]),
                             tables, lens, [10, 6], num_decodes=2)
    ref = paged_attention(q, cache, meta, 0.2)
    assert torch.allclose(kernel(q, cache, tables, lens, 0.2, None), ref, atol=1e-5)


def _prefill_case(head_dim, block_size, group, cache_dtype, query_lens, context_lens, seed):
    """A shuffled paged cache holding whole sequences, and the last ``query_lens`` tokens
    of each as new rows: q a strided view of a QKV-like output, as the model passes it."""
    g = torch.Generator().manual_seed(seed)
    hk = 2
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    width = max(-(-n // block_size) for n in seq_lens)
    blocks = len(seq_lens) * width + 3
    cache = torch.randn(2, hk, blocks, block_size, head_dim, generator=g).to(cache_dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    tables = [order[b * width:(b + 1) * width] for b in range(len(seq_lens))]
    rows = sum(query_lens)
    qkv = torch.randn(rows, (hk * group + 2 * hk) * head_dim, generator=g)
    q = qkv[:, :hk * group * head_dim].view(rows, hk * group, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return cache, q, torch.tensor(tables), torch.tensor(seq_lens), torch.tensor(starts)


def _prefill_float64(q, cache, tables, seq_lens, starts, scale, window, softcap=None):
    """Each new token against its sequence's keys up to its own position (and within the
    window), in float64 from the cache's values (a quantized cache's dequantized), the
    scaled scores capped at ``softcap * tanh(s / softcap)`` when given."""
    if is_quantized(cache.dtype):
        cache = dequantize_rows(cache)
    hk, block_size, head_dim = cache.shape[1], cache.shape[3], cache.shape[4]
    group = q.shape[1] // hk
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        slots = [int(tables[b][t // block_size]) * block_size + t % block_size for t in range(n)]
        k = cache[0].reshape(hk, -1, head_dim)[:, slots].double()
        v = cache[1].reshape(hk, -1, head_dim)[:, slots].double()
        s, e = int(starts[b]), int(starts[b + 1])
        for i in range(s, e):
            pos = n - (e - i)
            first = max(0, pos - window + 1) if window > 0 else 0
            for h in range(q.shape[1]):
                kv_h = h // group
                scores = k[kv_h, first:pos + 1] @ q[i, h].double() * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[i, h] = torch.softmax(scores, 0) @ v[kv_h, first:pos + 1]
    return out


@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 32, 4), (48, 5, 2),
                                                     (32, 16, 1), (64, 1, 3), (24, 16, 2)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [-1, 13])
def test_cpu_prefill_kernel_matches_a_float64_reference(
        cpu_kernels, head_dim, block_size, group, cache_dtype, window):
    """Prefill rows read in place from the paged cache: query tiles full and short (16 and
    32 rows are the AVX2 and AVX-512 tiles), with and without cached context, keys in any
    block order, masked on the diagonal and at a window's edge; head sizes that are not a
    whole number of vectors (24 with AVX-512) and fp16 caches go through the reference."""
    query_lens = [1, 15, 16, 17, 31, 32, 33, 70]
    context_lens = [0, 40, 3, 0, 16, 1, 0, 100]
    cache, q, tables, lens, starts = _prefill_case(
        head_dim, block_size, group, cache_dtype, query_lens, context_lens, seed=head_dim)
    q = q.to(cache_dtype)
    scale = head_dim ** -0.5
    got = cpu_kernels.paged_prefill(q, cache, tables, lens, starts, max(query_lens), scale,
                                    window if window > 0 else None)
    assert got.dtype == q.dtype and got.shape == q.shape
    want = _prefill_float64(q, cache, tables, lens, starts, scale, window)
    tol = dict(rtol=1e-4, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)


def test_cpu_prefill_kernel_takes_an_fp32_query_over_a_bf16_cache(cpu_kernels):
    cache, q, tables, lens, starts = _prefill_case(64, 16, 3, torch.bfloat16, [40, 9],
                                                   [0, 21], seed=5)
    got = cpu_kernels.paged_prefill(q, cache, tables, lens, starts, 40, 0.125, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, cpu_kernels.paged_prefill(
        q, cache.float(), tables, lens, starts, 40, 0.125, None), rtol=1e-5, atol=1e-6)


MIXED_CONTEXT, MIXED_QUERIES = [23, 17, 9, 30, 12], [1, 1, 1, 30, 7]


def _mixed_step():
    """Three decode rows, then prefill chunks with and without cached context: the setup,
    q, and the step's new K and V (not yet written)."""
    cache, meta, ks, vs, qs = _paged_setup(MIXED_CONTEXT, MIXED_QUERIES)
    rows = list(zip(MIXED_CONTEXT, MIXED_QUERIES, strict=True))
    k_new = torch.cat([k[n - nq:] for k, (n, nq) in zip(ks, rows, strict=True)])
    v_new = torch.cat([v[n - nq:] for v, (n, nq) in zip(vs, rows, strict=True)])
    meta.max_query_len = max(MIXED_QUERIES)
    return cache, meta, ks, vs, qs, torch.cat(qs), k_new, v_new


def test_mixed_step_takes_both_cpu_kernels_and_equals_the_reference(cpu_kernels):
    """A step of decode rows then prefill chunks (cached context or none), and one of
    prefill chunks only (the prefill kernel's output returned as it is)."""
    cache, meta, ks, vs, qs, q, k_new, v_new = _mixed_step()
    write_kv_cache(k_new, v_new, cache, meta.slot_mapping)
    want = _expected(ks, vs, qs)
    meta.decode_kernel, meta.prefill_kernel = cpu_kernels.paged_decode, cpu_kernels.paged_prefill
    assert torch.allclose(paged_attention(q, cache, meta, D ** -0.5), want, atol=1e-5)
    prefill_meta = AttentionMetadata(
        query_start_loc=meta.query_start_loc[3:] - 3, positions=meta.positions[3:],
        slot_mapping=meta.slot_mapping[3:], block_tables=meta.block_tables[3:],
        seq_lens=meta.seq_lens[3:], seq_lens_list=meta.seq_lens_list[3:], num_decodes=0,
        max_query_len=30, prefill_kernel=cpu_kernels.paged_prefill)
    got = paged_attention(q[3:], cache, prefill_meta, D ** -0.5)
    assert torch.allclose(got, want[3:], atol=1e-5)


def test_cpu_prefill_with_a_window_past_the_kernels_float_range_uses_the_reference(
        cpu_kernels, monkeypatch):
    """The kernel compares row-to-key distances as floats (exact below 2^22): a wider window
    goes through the reference path, with the same result as no window here."""
    from kvray.kernels import attention

    cache, q, tables, lens, starts = _prefill_case(64, 16, 3, torch.float32, [20], [5], seed=9)
    calls = []
    reference = attention.prefill_reference
    monkeypatch.setattr(attention, "prefill_reference",
                        lambda *a: calls.append(1) or reference(*a))
    got = cpu_kernels.paged_prefill(q, cache, tables, lens, starts, 20, 0.125, 1 << 22)
    assert calls == [1]
    torch.testing.assert_close(got, cpu_kernels.paged_prefill(q, cache, tables, lens, starts,
                                                              20, 0.125, None))
    assert calls == [1]


CAPPED_CACHES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                 "fp8": torch.float8_e4m3fn}


def _capped_case(head_dim, cache_name, query_lens, context_lens, seed):
    """A _prefill_case over a cache of ``cache_name`` (a quantized one holds the random
    values' codes), with 2 KV heads of 3 query heads each and 16-token blocks; q in the
    cache's dtype for bf16, else fp32."""
    cache, q, tables, lens, starts = _prefill_case(head_dim, 16, 3, torch.float32,
                                                   query_lens, context_lens, seed)
    dtype = CAPPED_CACHES[cache_name]
    cache = quantize_rows(cache, dtype) if is_quantized(dtype) else cache.to(dtype)
    return cache, q.to(torch.bfloat16) if cache_name == "bf16" else q, tables, lens, starts


# head sizes 64 / 128 take the one-pass decode loop, 24 / 16 the two-pass one
@pytest.mark.parametrize("head_dim", [64, 128, 24, 16])
@pytest.mark.parametrize("cache_name", list(CAPPED_CACHES))
@pytest.mark.parametrize("window", [None, 11])
def test_cpu_decode_kernel_caps_scores_like_a_float64_reference(
        cpu_kernels, head_dim, cache_name, window):
    """Decode rows of sequences that end inside, at and past 16-token blocks, GQA of 3: the
    capped scores' softmax, and far from the uncapped one (the cap bites at scale 1)."""
    context = [69, 32, 16, 14, 0]
    cache, q, tables, lens, starts = _capped_case(head_dim, cache_name, [1] * 5, context,
                                                  seed=head_dim)
    got = cpu_kernels.paged_decode(q, cache, tables, lens, 1.0, window, softcap=4.0)
    assert got.dtype == q.dtype
    scored = q  # the kernel's query: rounded to int16 codes where it scores in integers
    if cpu_kernels.paged_decode_query_codes(cache, head_dim):
        scored = round_query_rows(q.float())
    want = _prefill_float64(scored, cache, tables, lens, starts, 1.0, window or -1,
                            softcap=4.0)
    tol = dict(rtol=1e-4, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    uncapped = cpu_kernels.paged_decode(q, cache, tables, lens, 1.0, window)
    assert (uncapped.double() - want).abs().max() > 0.1


@pytest.mark.parametrize("head_dim", [64, 48, 24])
@pytest.mark.parametrize("cache_name", list(CAPPED_CACHES))
@pytest.mark.parametrize("window", [None, 13])
def test_cpu_prefill_kernel_caps_scores_like_a_float64_reference(
        cpu_kernels, head_dim, cache_name, window):
    """Prefill rows (query tiles full and short, with and without cached context) with
    capped scores; a head size that is not a whole number of vectors (24 with AVX-512)
    goes through the reference, which caps too."""
    query_lens, context_lens = [1, 17, 33, 40], [0, 40, 3, 20]
    cache, q, tables, lens, starts = _capped_case(head_dim, cache_name, query_lens,
                                                  context_lens, seed=head_dim + 1)
    got = cpu_kernels.paged_prefill(q, cache, tables, lens, starts, max(query_lens), 1.0,
                                    window, softcap=4.0)
    want = _prefill_float64(q, cache, tables, lens, starts, 1.0, window or -1, softcap=4.0)
    tol = dict(rtol=1e-4, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    uncapped = cpu_kernels.paged_prefill(q, cache, tables, lens, starts, max(query_lens), 1.0,
                                         window)
    assert (uncapped.double() - want).abs().max() > 0.1


def test_capped_mixed_step_takes_the_cpu_kernels_and_equals_the_capped_reference(
        cpu_kernels, monkeypatch):
    """A step of decode rows and prefill chunks with capped scores goes through both C++
    kernels (with the cap), not the per-sequence PyTorch path, and gives its result."""
    from kvray.kernels import attention

    cache, meta, _, _, _, q, k_new, v_new = _mixed_step()
    want = attention.softcapped_attention(q, k_new, v_new, meta, 1.0, 6, cache.clone(), 2.0)
    caps = []

    def spy(kernel):
        return lambda *a, softcap=None: caps.append(softcap) or kernel(*a, softcap=softcap)

    meta.decode_kernel = spy(cpu_kernels.paged_decode)
    meta.prefill_kernel = spy(cpu_kernels.paged_prefill)
    meta.kernels_take_softcap = True
    monkeypatch.setattr(attention, "softcapped_attention", None)  # must not be called
    got = attention.attention(q, k_new, v_new, meta, 1.0, 6, cache, softcap=2.0)
    assert caps == [2.0, 2.0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
