"""The quantized KV cache (``kv_cache_dtype`` int8 / fp8 / fp8_e5m2): each (token, head) row
written as one-byte codes and an fp32 scale reads back within the format's rounding bound,
by the PyTorch reference and the C++ ``write_kv`` alike; the C++ paged decode and prefill
kernels over such a cache compute attention over its dequantized K/V (checked against dense
attention, an independent reference) and stay within a bound derived from the rounding of
the fp32 cache's result; the cache is sized at ``2 x Hk x (D + 4)`` bytes per token and
layer; swap carries codes and scales bit for bit; and an engine with a quantized cache
gives greedy tokens close to an unquantized one, and exactly its own under preemption (swap
and recompute) and prefix caching."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvray.kernels.attention import (
    AttentionMetadata,
    dense_attention,
    paged_attention,
    write_kv_cache,
)
from kvray.kernels.kv_quant import (
    QMAX,
    QUERY_CODE_MAX,
    cache_head_dim,
    dequantize_rows,
    kv_bytes_per_token,
    quantize_rows,
    round_query_rows,
    row_scales,
)

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
# fp8 formats: (mantissa bits, smallest normal exponent)
_FP8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
BS = 16


def _rounding_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest |dequantized - x| the format allows for each element of rows x [..., D]:
    half a code step of the row's scale (int8), half an ulp of the fp8 code (relative, or
    the subnormal step near zero); fp32 arithmetic slack on top."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    if dtype == torch.int8:
        bound = scale.expand_as(x) / 2
    else:
        mant, emin = _FP8[dtype]
        y = (x / scale).abs()
        bound = scale * torch.maximum(y * 2.0 ** -(mant + 1), torch.full_like(y, 2.0 ** (
            emin - mant - 1)))
    return bound * (1 + 1e-5) + 1e-7 * x.abs()


def _rows(n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """Random rows of very different sizes, one of them all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-3, 2, n)[:, None, None]
    x[n // 2] = 0.0
    return x


# ---- the format --------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
@pytest.mark.parametrize("dim", [64, 24])
def test_quantized_rows_read_back_within_the_rounding_bound(name, dim):
    dtype = QUANT_DTYPES[name]
    x = _rows(40, 3, dim, seed=1)
    rows = quantize_rows(x, dtype)
    assert rows.dtype == dtype and rows.shape == (40, 3, dim + 4)
    back = dequantize_rows(rows)
    assert torch.all((back - x).abs() <= _rounding_bound(x, dtype))
    assert torch.all(row_scales(rows)[20] == 1.0) and torch.all(back[20] == 0.0)
    assert torch.allclose(row_scales(rows)[..., 0], x.abs().amax(-1) / QMAX[dtype] + (
        x.abs().amax(-1) == 0), rtol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
@pytest.mark.parametrize("dim", [64, 128, 20])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_kv_quantizes_each_row_like_the_reference(cpu_kernels, name, dim,
                                                            src_dtype):
    dtype = QUANT_DTYPES[name]
    heads, num_blocks = 3, 9
    k = _rows(50, heads, dim, seed=2).to(src_dtype)
    v = _rows(50, heads, dim, seed=3).to(src_dtype)
    slots = torch.randperm(num_blocks * BS, generator=torch.Generator().manual_seed(4))[:50]
    ours = torch.zeros(2, heads, num_blocks, BS, dim + 4, dtype=dtype)
    ref = ours.clone()
    cpu_kernels.write_kv(k, v, ours, slots)
    write_kv_cache(k, v, ref, slots)
    flat = ours.view(2, heads, -1, dim + 4)[:, :, slots]  # [2, Hk, T, D + 4]
    for which, x in enumerate((k, v)):
        x = x.float().transpose(0, 1)
        assert torch.all((dequantize_rows(flat[which]) - x).abs() <= _rounding_bound(x, dtype))
    assert torch.allclose(row_scales(ours), row_scales(ref), rtol=1e-6)
    # the same codes but where x / scale sits on a rounding edge (the C++ build's fp32)
    same = (ours.view(torch.uint8) == ref.view(torch.uint8))[..., :dim]
    assert same.float().mean() > 0.99
    untouched = torch.ones(num_blocks * BS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(ours.view(2, heads, -1, dim + 4)[:, :, untouched].view(torch.uint8) == 0)


@pytest.mark.unit
def test_write_kv_refuses_a_cache_without_room_for_the_scales(cpu_kernels):
    k = torch.randn(2, 1, 64)
    cache = torch.zeros(2, 1, 4, BS, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="D \\+ 4"):
        cpu_kernels.write_kv(k, k, cache, torch.tensor([0, 1]))
    q = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="D \\+ 4"):
        cpu_kernels.paged_decode(q, cache, torch.zeros(1, 1, dtype=torch.int64),
                                 torch.tensor([1]), 0.125, -1)


# ---- attention over a quantized cache ----------------------------------------------------
def _setup(dtype, heads, groups, dim, context, queries, seed, block_size=BS):
    """K/V of whole sequences, the context's written into a quantized paged cache on shuffled
    blocks (the last block partly filled), then this step's; the metadata of the step."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context) + 3
    cache = torch.zeros(2, heads, num_blocks, block_size, dim + 4, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, ks, vs, qs, positions, starts = [], [], [], [], [], [], [0]
    for n, nq in zip(context, queries, strict=True):
        table = [perm.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, heads, dim, generator=g) * 2
        v = torch.randn(n, heads, dim, generator=g)
        all_slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(n)])
        write_kv_cache(k, v, cache, all_slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(nq, heads * groups, dim, generator=g))
        slots.append(all_slots[n - nq:])
        positions.append(torch.arange(n - nq, n))
        starts.append(starts[-1] + nq)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts), positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(context), seq_lens_list=list(context),
        num_decodes=sum(1 for q in queries if q == 1), max_query_len=max(queries))
    return cache, meta, ks, vs, qs


def _dense(ks, vs, qs, window):
    """Each sequence's new tokens attended over its whole K/V (plain causal attention)."""
    outs = []
    for k, v, q in zip(ks, vs, qs, strict=True):
        n, nq = k.shape[0], q.shape[0]
        full_q = torch.cat([torch.zeros(n - nq, *q.shape[1:]), q])
        meta = AttentionMetadata.for_full_sequences([n])
        outs.append(dense_attention(full_q, k, v, meta, q.shape[-1] ** -0.5, window)[n - nq:])
    return torch.cat(outs)


def _derived_bound(ks, vs, qs, dtype, window):
    """How far attention over the quantized K/V may be from attention over the exact ones,
    for each output element: with every score moved by at most delta (= the scale x
    |q . (k~ - k)| of the keys it sees, k~ the reference's dequantized keys), each
    probability moves by at most a factor e^(+-2 delta), the probabilities by e^(2 delta) - 1
    in sum, which moves the output by at most that times the values' half range; and the
    values' own rounding by at most their largest |v~ - v|."""
    out = []
    for k, v, q in zip(ks, vs, qs, strict=True):
        n, nq, dim = k.shape[0], q.shape[0], q.shape[-1]
        groups = q.shape[1] // k.shape[1]
        dk = (dequantize_rows(quantize_rows(k, dtype)) - k).repeat_interleave(groups, dim=1)
        dv = (dequantize_rows(quantize_rows(v, dtype)) - v).repeat_interleave(groups, dim=1)
        vg = v.repeat_interleave(groups, dim=1)  # [n, Hq, D]
        for i in range(nq):
            pos = n - nq + i
            first = 0 if window is None else max(0, pos - window + 1)
            seen = slice(first, pos + 1)
            delta = dim ** -0.5 * (q[i][None] * dk[seen]).sum(-1).abs().amax(0)  # [Hq]
            half_range = (vg[seen].amax(0) - vg[seen].amin(0)) / 2  # [Hq, D]
            moved = (torch.exp(2 * delta) - 1)[:, None] * half_range
            out.append(moved + dv[seen].abs().amax(0) + 1e-5)
    return torch.stack(out)


def _dequantized(ks, vs, dtype):
    return ([dequantize_rows(quantize_rows(k, dtype)) for k in ks],
            [dequantize_rows(quantize_rows(v, dtype)) for v in vs])


SHAPES = [  # (KV heads, query heads per KV head, head size)
    (1, 1, 64), (3, 3, 64), (3, 1, 128), (1, 4, 128), (2, 3, 24)]


@pytest.mark.unit
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
@pytest.mark.parametrize("heads,groups,dim", SHAPES)
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_paged_decode_over_a_quantized_cache_is_attention_over_its_values(
        cpu_kernels, name, heads, groups, dim, window):
    dtype = QUANT_DTYPES[name]
    context = [100, 70, 37, 16, 1]  # decode rows longest first
    cache, meta, ks, vs, qs = _setup(dtype, heads, groups, dim, context, [1] * 5, seed=dim)
    q = torch.cat(qs)
    got = cpu_kernels.paged_decode(q, cache, meta.block_tables, meta.seq_lens, dim ** -0.5,
                                   window)
    dk, dv = _dequantized(ks, vs, dtype)
    # the kernel's query: q itself, or each scaled row rounded to int16 codes where it
    # scores an int8 cache in integers
    scored = _scored_queries(cpu_kernels, cache, qs, dim)
    assert torch.allclose(got, _dense(dk, dv, scored, window), atol=2e-5, rtol=1e-5)
    reference = paged_attention(q, cache, meta, dim ** -0.5, window)  # the torch backend
    assert torch.allclose(reference, _dense(dk, dv, qs, window), atol=2e-5, rtol=1e-5)
    exact = _dense(ks, vs, scored, window)
    assert torch.all((got - exact).abs() <= _derived_bound(ks, vs, scored, dtype, window))
    as_bf16 = cpu_kernels.paged_decode(q.bfloat16(), cache, meta.block_tables, meta.seq_lens,
                                       dim ** -0.5, window)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.allclose(as_bf16.float(), got, atol=3e-2, rtol=2e-2)


@pytest.mark.unit
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("heads,groups,dim", [(2, 7, 64), (1, 2, 128)])
@pytest.mark.parametrize("window", [None, 13])
def test_cpu_paged_decode_over_an_int8_cache_takes_any_block_size_and_tail(
        cpu_kernels, block_size, heads, groups, dim, window):
    """Contexts ending on every kind of block tail (one key, under and over eight keys, a
    whole block, past a block) in blocks of 8 and 32, query groups of 7 and 2: attention
    over the cache's values (with the kernel's query) as tightly as with blocks of 16."""
    context = [1, 7, 8, 9, 15, 16, 17, 33, 41, 64]
    cache, meta, ks, vs, qs = _setup(torch.int8, heads, groups, dim, context,
                                     [1] * len(context), seed=block_size + dim,
                                     block_size=block_size)
    got = cpu_kernels.paged_decode(torch.cat(qs), cache, meta.block_tables, meta.seq_lens,
                                   dim ** -0.5, window)
    dk, dv = _dequantized(ks, vs, torch.int8)
    scored = _scored_queries(cpu_kernels, cache, qs, dim)
    assert torch.allclose(got, _dense(dk, dv, scored, window), atol=2e-5, rtol=1e-5)
    # and the query's rounding moves the result by little next to the cache's own
    assert torch.allclose(got, _dense(dk, dv, qs, window), atol=5e-4, rtol=0)


def _scored_queries(cpu_kernels, cache, qs, dim):
    """The query rows the decode kernel scores: each scaled row rounded to int16 codes where
    ``paged_decode_query_codes`` says so (the rounding checked to be within 2^-16 of the
    row's largest element), else ``qs`` as they are."""
    if not cpu_kernels.paged_decode_query_codes(cache, dim):
        return qs
    scale = dim ** -0.5
    out = []
    for q in qs:
        rounded = round_query_rows(q * scale) / scale
        amax = q.abs().amax(-1, keepdim=True)  # half a code step, and a few fp32 ulps
        assert torch.all((rounded - q).abs() <= amax * (0.5 / QUERY_CODE_MAX + 5e-7))
        out.append(rounded)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
@pytest.mark.parametrize("heads,groups,dim", SHAPES)
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_paged_prefill_over_a_quantized_cache_is_attention_over_its_values(
        cpu_kernels, name, heads, groups, dim, window):
    dtype = QUANT_DTYPES[name]
    context, queries = [45, 70, 17, 33], [45, 13, 1, 20]  # whole, chunk, one row, chunk
    cache, meta, ks, vs, qs = _setup(dtype, heads, groups, dim, context, queries, seed=dim)
    meta.num_decodes = 0
    q = torch.cat(qs)
    got = cpu_kernels.paged_prefill(q, cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, dim ** -0.5,
                                    window)
    dk, dv = _dequantized(ks, vs, dtype)
    assert torch.allclose(got, _dense(dk, dv, qs, window), atol=2e-5, rtol=1e-5)
    reference = paged_attention(q, cache, meta, dim ** -0.5, window)  # the torch backend
    assert torch.allclose(reference, _dense(dk, dv, qs, window), atol=2e-5, rtol=1e-5)
    exact = _dense(ks, vs, qs, window)
    assert torch.all((got - exact).abs() <= _derived_bound(ks, vs, qs, dtype, window))


# ---- sizing and swap ---------------------------------------------------------------------
@pytest.mark.unit
def test_bytes_per_token_are_two_heads_times_head_size_plus_scale_per_layer():
    from kvray.actors.cache_engine import CacheEngine, kv_bytes_per_block

    # the built-in model's shape: 30 layers, 3 KV heads, head size 64
    assert kv_bytes_per_token(30, 3, 64, torch.int8) == 30 * 2 * 3 * 68
    assert kv_bytes_per_token(30, 3, 64, torch.float8_e5m2) == 30 * 2 * 3 * 68
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    assert kv_bytes_per_token(30, 3, 64, torch.float32) == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_block(30, 16, 3, 64, torch.int8) == 16 * 30 * 2 * 3 * 68
    engine = CacheEngine(4, (1, 3), 5, BS, 3, 64, torch.float8_e4m3fn, torch.device("cpu"))
    cache = engine.kv_caches[1]
    assert engine.kv_caches[0] is None and engine.kv_caches[3] is None
    assert cache.shape == (2, 3, 5, BS, 68) and cache.dtype == torch.float8_e4m3fn
    assert cache_head_dim(cache) == 64
    assert cache.numel() * cache.element_size() == 5 * kv_bytes_per_block(1, BS, 3, 64,
                                                                          cache.dtype)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
def test_swap_carries_codes_and_scales_bit_for_bit(name):
    from kvray.actors.swap_pool import SwapPool

    dtype = QUANT_DTYPES[name]
    g = torch.Generator().manual_seed(5)
    caches = [torch.randint(0, 256, (2, 2, 12, 4, 20), dtype=torch.uint8, generator=g)
              .view(dtype) for _ in range(3)]
    before = [c.view(torch.uint8).clone() for c in caches]
    pool = SwapPool()
    pool.save("r", [None, *caches], [3, 7, 1])
    for c in caches:
        c.view(torch.uint8)[:, :, [3, 7, 1]] = 0
    pool.restore("r", [None, *caches], [5, 0, 11])
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c.view(torch.uint8)[:, :, [5, 0, 11]], b[:, :, [3, 7, 1]])
    assert len(pool) == 0 and not pool.take_failed()


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["fp16", "int4", "float8"])
def test_an_unknown_kv_cache_dtype_is_a_config_error_naming_the_key(bad):
    from kvray.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_config(kv_cache_dtype=bad)


# ---- end to end --------------------------------------------------------------------------
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
LENGTHS = [3, 20, 9, 33, 1, 14, 26, 7]
MAX_TOKENS = 24


def _prompts() -> list[dict]:
    """Prompts of odd lengths; the last two share the 33-token prompt's first 24 (prefix
    cache hits)."""
    from tests.helpers.tiny_models import VOCAB_SIZE

    ids = [[3 + zlib.crc32(f"{i}:{j}".encode()) % (VOCAB_SIZE - 3) for j in range(n)]
           for i, n in enumerate(LENGTHS)]
    ids += [ids[3][:24] + [5, 6, 7], ids[3][:24] + [8]]
    return [{"prompt_token_ids": p} for p in ids]


def _generate(path: str, **overrides) -> tuple[list[list[int]], object]:
    from kvray import LLM, SamplingParams

    llm = LLM(path, **{**ENGINE, **overrides})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params,
                                                           use_tqdm=False)]
    stats = llm.llm_engine.stats
    llm.shutdown()
    return tokens, stats


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama_gqa"))


@pytest.fixture(scope="module")
def unquantized(tiny) -> list[list[int]]:
    return _generate(tiny, num_gpu_blocks_override=400)[0]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


# Greedy tokens of a random tiny model have near-ties that any rounding can flip, and a
# flipped token changes everything after it: measured agreement (same position, same
# token) with the fp32 cache on this workload: int8 1.0, fp8 (e4m3) 0.64, fp8_e5m2 0.50
# (2 mantissa bits); with a bf16 model 0.88 / 0.70 / 0.62 against its bf16 cache.
MIN_AGREEMENT = {"int8": 0.9, "fp8": 0.45, "fp8_e5m2": 0.3}


@pytest.mark.engine
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
def test_quantized_cache_gives_nearly_the_unquantized_greedy_tokens(tiny, unquantized, name):
    tokens, stats = _generate(tiny, num_gpu_blocks_override=400, kv_cache_dtype=name)
    assert _agreement(tokens, unquantized) >= MIN_AGREEMENT[name]
    if name == "int8":
        assert [t[:4] for t in tokens] == [t[:4] for t in unquantized]
    assert stats.prefix_cache_hits > 0


@pytest.mark.engine
@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_on_a_quantized_cache_finish_with_the_same_tokens(tiny, name,
                                                                            mode):
    roomy, _ = _generate(tiny, num_gpu_blocks_override=400, kv_cache_dtype=name,
                         enable_prefix_caching=False)
    tight, stats = _generate(tiny, num_gpu_blocks_override=20, kv_cache_dtype=name,
                             preemption_mode=mode, swap_space=0.01)
    assert stats.num_preemptions > 0
    assert (stats.num_swaps_out > 0) == (mode == "swap")
    assert stats.prefix_cache_hits > 0
    assert tight == roomy


@pytest.mark.engine
def test_torch_backend_reads_the_quantized_cache_as_the_cpu_kernels_do(tiny, cpu_kernels):
    cpu, _ = _generate(tiny, num_gpu_blocks_override=400, kv_cache_dtype="fp8")
    ref, _ = _generate(tiny, num_gpu_blocks_override=400, kv_cache_dtype="fp8",
                       attention_backend="torch")
    assert ref == cpu


@pytest.mark.engine
def test_kv_capacity_from_memory_counts_the_quantized_bytes_per_token(tiny, caplog):
    import logging

    from kvray import LLM

    budget = 1 << 20
    blocks = {}
    for name in ("auto", "int8"):
        with caplog.at_level(logging.INFO, logger="kvray"):
            llm = LLM(tiny, **ENGINE, kv_cache_memory=budget, kv_cache_dtype=name)
        blocks[name] = llm.llm_engine.stats.num_blocks
        llm.shutdown()
    # llama_gqa: 3 layers, 2 KV heads, head size 16; fp32 model
    per_token = {"auto": 3 * 2 * 2 * 16 * 4, "int8": 3 * 2 * 2 * (16 + 4)}
    for name, n in blocks.items():
        assert n == budget // (4 * per_token[name])
    assert blocks["int8"] > 3 * blocks["auto"]
    assert f"{per_token['int8']} bytes/token, dtype int8" in caplog.text


@pytest.mark.engine
def test_a_bf16_model_runs_on_an_int8_cache(tiny):
    # the fused decode layer takes the bf16 model's hidden states over an int8 cache
    base, _ = _generate(tiny, num_gpu_blocks_override=400, dtype="bfloat16")
    tokens, _ = _generate(tiny, num_gpu_blocks_override=400, dtype="bfloat16",
                          kv_cache_dtype="int8")
    assert _agreement(tokens, base) >= 0.6


@pytest.mark.engine
def test_a_draft_models_cache_stays_in_its_models_dtype(tiny):
    from kvray import LLM, SamplingParams

    llm = LLM(tiny, **ENGINE, num_gpu_blocks_override=400, kv_cache_dtype="int8",
              speculative_config={"model": tiny, "num_speculative_tokens": 3})
    runner = llm.llm_engine.executor.worker.runner
    assert runner.cache.kv_caches[0].dtype == torch.int8
    assert runner.drafter.cache.kv_caches[0].dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    assert llm.llm_engine.stats.spec_decode_num_accepted_tokens > 0
    llm.shutdown()


@pytest.mark.parity
@pytest.mark.parametrize("name", list(QUANT_DTYPES))
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_fused_decode_layer_over_a_quantized_cache_equals_the_python_layer(
        tiny, cpu_kernels, name, model_dtype):
    from kvray import LLM
    from kvray.kernels.attention import paged_batch

    llm = LLM(tiny, **{**ENGINE, "dtype": model_dtype}, num_gpu_blocks_override=64,
              kv_cache_dtype=name)
    runner = llm.llm_engine.executor.worker.runner
    layer = runner.model.model.layers[1]
    assert layer.fused_decode is not None, "the engine should have installed the fused layer"
    attn, block = layer.self_attn, ENGINE["block_size"]
    g = torch.Generator().manual_seed(7)
    rows = [([5], n, list(range(8 * i, 8 * i + -(-(n + 1) // block))))
            for i, n in enumerate([29, 17, 3])]
    _, meta, _ = paged_batch(rows, block, lambda v: torch.tensor(v, dtype=torch.int64),
                             **runner.kernels)
    kv = quantize_rows(torch.randn(2, attn.num_kv_heads, 24, block, attn.head_dim,
                                   generator=g), QUANT_DTYPES[name])
    hidden = torch.randn(3, runner.spec.hidden_size, generator=g).to(runner.dtype)
    kv_py, kv_fused = kv.clone(), kv.clone()
    with torch.inference_mode():
        fused, layer.fused_decode = layer.fused_decode, None
        want = layer(hidden.clone(), None, meta, kv_py)  # the Python path, same kernels
        layer.fused_decode = fused
        got = layer(hidden.clone(), None, meta, kv_fused)
    llm.shutdown()
    if model_dtype == "float32":
        assert torch.equal(kv_fused.view(torch.uint8), kv_py.view(torch.uint8)), "K/V"
        assert torch.equal(got[0], want[0])
        return
    # A bf16 model's fused layer computes on fp32 activations, its Python layer on bf16
    # ones: the step's K/V rows and the output are close, every other row untouched.
    slots = meta.slot_mapping
    flat = [c.view(2, attn.num_kv_heads, -1, attn.head_dim + 4) for c in (kv_fused, kv_py)]
    assert torch.allclose(dequantize_rows(flat[0][:, :, slots]),
                          dequantize_rows(flat[1][:, :, slots]), atol=0.1, rtol=0.3)
    others = torch.ones(flat[0].shape[2], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat[0][:, :, others].view(torch.uint8),
                       kv.view(2, attn.num_kv_heads, -1, attn.head_dim + 4)[:, :, others]
                       .view(torch.uint8))
    assert torch.allclose(got[0].float(), want[0].float(), atol=0.1, rtol=0.05)
