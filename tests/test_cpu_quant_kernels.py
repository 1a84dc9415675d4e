"""The CPU kernels on quantized weights read in place (``cpu_ops`` ``linear_q``,
``embedding_q``, ``dequantize_q``) agree with the plain reference, ``QuantTensor.dequantize()``
and a float64 matmul: on odd shapes, every kind (U4, U5, U6 with and without mins or a code
offset, S8), group 16 to 128, fp16, fp32 and two-level scales, multi-segment blobs, strided
inputs. ``linear_q`` quantizes the
activations per block of 32 to int8, so its error is held to that quantization's bound (and
is exactly zero where the activations are whole numbers its grid holds); malformed blobs
raise; the fused decode layer runs quantized weights as it runs their dequantized values."""

from __future__ import annotations

import struct

import pytest
import torch

from kvray.quant.blob import to_blob
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor, pack_u4, round_up

pytestmark = pytest.mark.unit

# (kind, group (0: the whole padded row), scale dtype, mins, zero): the layouts GGUF,
# AWQ/GPTQ and int8 checkpoints become; uint8 / int8 scales are two-level (times an fp16 per
# super-group of 256 columns)
LAYOUTS = {
    "u4_g32_fp16_mins": (QuantKind.U4, 32, torch.float16, True, 0),    # Q4_1
    "u4_g32_fp16_zero": (QuantKind.U4, 32, torch.float16, False, 8),   # Q4_0
    "u4_g32_fp16": (QuantKind.U4, 32, torch.float16, False, 0),
    "u4_g16_fp32_mins": (QuantKind.U4, 16, torch.float32, True, 0),    # Q2_K-like halves
    "u4_g128_fp16_mins": (QuantKind.U4, 128, torch.float16, True, 0),  # AWQ / GPTQ
    "u4_g32_u8_mins": (QuantKind.U4, 32, torch.uint8, True, 0),        # Q4_K
    "u5_g32_fp16_zero": (QuantKind.U5, 32, torch.float16, False, 16),  # Q5_0
    "u5_g32_fp16_mins": (QuantKind.U5, 32, torch.float16, True, 0),    # Q5_1
    "u6_g16_s8_zero": (QuantKind.U6, 16, torch.int8, False, 32),       # Q6_K
    "u5_g32_u8_mins": (QuantKind.U5, 32, torch.uint8, True, 0),        # Q5_K
    "u4_g16_s8_zero": (QuantKind.U4, 16, torch.int8, False, 4),        # Q3_K
    "u4_g16_u8_mins": (QuantKind.U4, 16, torch.uint8, True, 0),        # Q2_K
    "u6_g64_fp32_mins": (QuantKind.U6, 64, torch.float32, True, 0),
    "s8_g32_fp16": (QuantKind.S8, 32, torch.float16, False, 0),        # Q8_0
    "s8_g16_fp32": (QuantKind.S8, 16, torch.float32, False, 0),
    "s8_g64_fp32": (QuantKind.S8, 64, torch.float32, False, 0),
    "s8_g32_s8": (QuantKind.S8, 32, torch.int8, False, 0),
    "s8_row_fp32": (QuantKind.S8, 0, torch.float32, False, 0),          # int8: one per row
    "s8_g32_fp16_mins": (QuantKind.S8, 32, torch.float16, True, 0),
}
BITS = {QuantKind.U4: 4, QuantKind.U5: 5, QuantKind.U6: 6}


def _codes(kind: QuantKind, rows: int, k_padded: int, gen: torch.Generator) -> torch.Tensor:
    if kind in BITS:
        codes = torch.randint(0, 2 ** BITS[kind], (rows, k_padded), generator=gen)
        return pack_u4(codes) if kind == QuantKind.U4 else codes.to(torch.uint8)
    return torch.randint(-128, 128, (rows, k_padded), generator=gen).to(torch.int8)


def _segment(kind: QuantKind, rows: int, k_padded: int, group: int, scale_dtype: torch.dtype,
             with_mins: bool, zero: int, gen: torch.Generator) -> QuantSegment:
    """Random codes; scales giving outputs of a sane size; two-level ones as the K-quants
    store them (6-bit values times an fp16 per 256 columns)."""
    group = group or k_padded
    ng = k_padded // group
    codes = _codes(kind, rows, k_padded, gen)
    size = 0.01 / 2 ** (BITS.get(kind, 8) - 4)  # a step for codes of this width
    if scale_dtype in (torch.uint8, torch.int8):
        sg = 256 // group
        low = -63 if scale_dtype == torch.int8 else 1
        scales = torch.randint(low, 64, (rows, ng), generator=gen).to(scale_dtype)
        sup = (torch.rand(rows, -(-ng // sg), generator=gen) * size / 16).half()
        mins = smin = None
        if with_mins:
            mins = torch.randint(0, 64, (rows, ng), generator=gen).to(scale_dtype)
            smin = (-torch.rand(rows, -(-ng // sg), generator=gen) * 0.002).half()
        return QuantSegment(kind, group, codes, scales, mins, zero, sg, sup, smin)
    scales = (torch.rand(rows, ng, generator=gen) * size * 2 + size / 5).to(scale_dtype)
    mins = (torch.randn(rows, ng, generator=gen) * 0.05).to(scale_dtype) if with_mins else None
    return QuantSegment(kind, group, codes, scales, mins, zero)


def _matrix(layouts: list[str], n: int, k: int, seed: int) -> QuantTensor:
    """An [n, k] matrix whose rows are split between the given layouts, in order."""
    gen = torch.Generator().manual_seed(seed)
    kp = round_up(k, 32)
    cuts = [n * i // len(layouts) for i in range(len(layouts) + 1)]
    segs = tuple(_segment(LAYOUTS[name][0], cuts[i + 1] - cuts[i], kp, *LAYOUTS[name][1:],
                          gen)
                 for i, name in enumerate(layouts) if cuts[i + 1] > cuts[i])
    return QuantTensor((n, k), segs)


def _activation_error_bound(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """The bound [M, N] on |linear_q - exact| from quantizing x per block of 32 to int8:
    rounding moves each x[m, k] by at most dx/2 (dx = the block's amax / 127), so
    |err| <= sum over blocks of dx/2 * sum over the block's k of |w| (the mins multiply the
    same quantized x as the codes). Plus fp32 rounding of the sums (far below the first
    term)."""
    m, k = x.shape
    kp = qt.k_padded
    xp = torch.nn.functional.pad(x.double(), (0, kp - k)).view(m, kp // 32, 32)
    half_step = (xp.abs().amax(dim=2) / 127 / 2)  # [M, blocks]
    w = qt.dequantize().double().abs()
    sq = torch.nn.functional.pad(w, (0, kp - k)).view(qt.shape[0], kp // 32, 32)
    bound = half_step @ sq.sum(dim=2).T
    magnitude = x.double().abs() @ qt.dequantize().double().abs().T
    return bound + 1e-5 * magnitude + 1e-6


def _reference(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ qt.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


@pytest.mark.parametrize("k,n", [(32, 1), (96, 7), (100, 33), (576, 576), (1536, 33)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 40, 300])
def test_linear_q_is_within_the_activation_quantization_bound(ops, k, n, m):
    """Every layout that fits K (groups dividing the padded K), one at a time and all of them
    as segments of one blob; a bias on odd M; from one row to a prefill's 300."""
    gen = torch.Generator().manual_seed(k * 1000 + n + m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if m % 2 else None
    fitting = [name for name, (_, group, *_) in LAYOUTS.items()
               if round_up(k, 32) % (group or 32) == 0]
    cases = [[name] for name in fitting] + [fitting]
    for i, layouts in enumerate(cases):
        qt = _matrix(layouts, n, k, seed=i)
        got = ops.linear_q(x, to_blob(qt), bias)
        want = _reference(x, qt, bias)
        bound = _activation_error_bound(x, qt)
        assert got.shape == (m, n) and got.dtype == torch.float32
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (layouts, float((err - bound).max()))
        # a real constraint: ~1 % of the products' magnitudes (amax / 254 against |x|)
        magnitude = x.double().abs() @ qt.dequantize().double().abs().T
        assert float(bound.sum() / magnitude.sum()) < 0.03, layouts


@pytest.mark.parametrize("m", [1, 3, 4, 13, 21, 40, 300])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_linear_q_is_exact_on_whole_numbers_its_int8_grid_holds(ops, m, layout):
    """Activations that are whole numbers with a 127 in every block of 32 (so the int8 step
    is exactly 1) and scales/mins that are powers of two: every product and sum is exact in
    fp32, so any indexing, nibble-order or scale-placement mistake shows as a difference."""
    kind, group, scale_dtype, with_mins, zero = LAYOUTS[layout]
    k, n = 640, 37  # sums stay far below 2^24 halves: exact in fp32
    gen = torch.Generator().manual_seed(m)
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x[:, ::32] = 127.0 * torch.sign(torch.randn(m, k // 32 + (k % 32 > 0), generator=gen))
    seg = _segment(kind, n, k, group, scale_dtype, with_mins, zero, gen)
    pow2 = 2.0 ** torch.randint(-1, 1, seg.scales.shape, generator=gen)
    mins = None if seg.mins is None else torch.randint(-2, 3, seg.scales.shape, generator=gen)
    if seg.two_level:  # small integers times powers of two
        signs = torch.tensor([-1, 1])[torch.randint(0, 2, seg.scales.shape, generator=gen)]
        scales = (torch.randint(1, 4, seg.scales.shape, generator=gen)
                  * (signs if scale_dtype == torch.int8 else 1)).to(scale_dtype)
        pow2_super = (2.0 ** torch.randint(-2, 0, seg.super_scales.shape, generator=gen)).half()
        half = None if mins is None else torch.full_like(seg.super_mins, 0.5)
        seg = QuantSegment(kind, seg.group, seg.codes, scales,
                           None if mins is None else mins.abs().to(scale_dtype), zero,
                           seg.super_group, pow2_super, half)
    else:
        seg = QuantSegment(kind, seg.group, seg.codes, pow2.to(scale_dtype),
                           None if mins is None else (mins / 2).to(scale_dtype), zero)
    qt = QuantTensor((n, k), (seg,))
    bias = torch.randint(-8, 8, (n,), generator=gen).float()
    got = ops.linear_q(x, to_blob(qt), bias)
    assert torch.equal(got.double(), _reference(x, qt, bias))


def test_linear_q_reads_strided_and_empty_inputs(ops):
    qt = _matrix(["u4_g32_fp16_mins", "s8_g32_fp16"], 50, 96, seed=3)
    blob = to_blob(qt)
    gen = torch.Generator().manual_seed(4)
    for m in (3, 70):  # both paths
        rows_apart = torch.randn(m, 2, 96, generator=gen)[:, 1]  # rows 192 floats apart
        padded = torch.randn(m, 101, generator=gen)[:, :96]      # a row stride of 101
        cols = torch.randn(96, m, generator=gen).t()             # columns contiguous
        for x in (rows_apart, padded, cols):
            want = ops.linear_q(x.contiguous(), blob, None)
            assert torch.equal(ops.linear_q(x, blob, None), want)
            err = (want.double() - _reference(x, qt, None)).abs()
            assert (err <= _activation_error_bound(x, qt)).all()
    assert ops.linear_q(torch.randn(0, 96), blob, None).shape == (0, 50)


def test_dequantize_q_and_embedding_q_equal_the_reference_exactly(ops):
    gen = torch.Generator().manual_seed(5)
    segs = [_segment(*layout[:1], 9, 128, *layout[1:], gen) for layout in LAYOUTS.values()]
    fp8 = torch.randn(5, 128, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    segs.append(QuantSegment(QuantKind.F8, 32, fp8, torch.rand(5, 4, generator=gen), None))
    qt = QuantTensor((9 * len(LAYOUTS) + 5, 100), tuple(segs))  # K padded 100 -> 128
    blob = to_blob(qt)
    dense = qt.dequantize()
    assert torch.equal(ops.dequantize_q(blob), dense)
    ids = torch.tensor([[0, 67, 8], [9, 66, 30]])
    assert torch.equal(ops.embedding_q(blob, ids), dense[ids])
    for bad in (-1, qt.shape[0]):
        with pytest.raises(RuntimeError, match=f"token id {bad} outside the vocabulary"):
            ops.embedding_q(blob, torch.tensor([0, bad]))


def _with(blob: torch.Tensor, offset: int, fmt: str, value) -> torch.Tensor:
    out = blob.clone()
    packed = struct.pack(fmt, value)
    out[offset: offset + len(packed)] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    return out


def test_malformed_blobs_raise_clear_errors(ops):
    qt = _matrix(["u4_g32_fp16_mins", "s8_g16_fp32"], 40, 64, seed=6)
    blob, x = to_blob(qt), torch.randn(2, 64)
    cases = [
        (_with(blob, 0, "4s", b"GGUF"), "not a kvray quantized blob"),
        (blob[:40], "not a kvray quantized blob"),
        (blob[: blob.numel() - 100], "do not fit in the blob"),  # the last mins cut off
        (blob[:100], "cannot hold its 2 segment entries"),
        (_with(blob, 24, "<q", 96), "corrupt blob header"),        # padded K != K rounded up
        (_with(blob, 64 + 32, "<q", 1 << 40), "do not fit in the blob"),  # codes offset
        (_with(blob, 64 + 40, "<q", 65), "do not fit in the blob"),      # unaligned scales
        (_with(blob, 64 + 4, "<i", 48), "corrupt entry"),          # group 48
        (_with(blob, 64 + 24, "<q", 41), "holds rows"),            # more rows than N
        (_with(blob, 64 + 56, "<i", 65), "corrupt entry"),         # code offset past 64
        (_with(blob, 64 + 128 + 56, "<i", 1), "corrupt entry"),    # a code offset on S8
        (_with(blob, 64 + 8, "<i", 2), "corrupt entry"),           # 8-bit scales, no super
        (blob.view(torch.int8), "contiguous 1-D uint8"),
    ]
    for bad, message in cases:
        for call in (lambda b: ops.linear_q(x, b, None), ops.dequantize_q,
                     lambda b: ops.embedding_q(b, torch.tensor([0]))):
            with pytest.raises(RuntimeError, match=message):
                call(bad)
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        ops.linear_q(torch.randn(2, 63), blob, None)
    with pytest.raises(RuntimeError, match="fp32 bias \\[N\\]"):
        ops.linear_q(x, blob, torch.randn(39))
    fp8 = QuantSegment(QuantKind.F8, 32, torch.zeros(4, 64, dtype=torch.uint8),
                       torch.ones(4, 2), None)
    with pytest.raises(RuntimeError, match="F8 weights have no CPU kernel"):
        ops.linear_q(x, to_blob(QuantTensor((4, 64), (fp8,))), None)


def _layer_weights(hidden: int, heads: int, kv_heads: int, dim: int, inter: int, seed: int
                   ) -> list[QuantTensor]:
    """Quantized qkv, o, gate_up, down of one layer (Q4_1-like; V rows as Q8_0, as a
    Q4_K_M file stores them), with scales giving activations of a sane size."""
    q4, q8 = "u4_g32_fp16_mins", "s8_g32_fp16"
    qkv = QuantTensor.cat_rows([_matrix([q4], (heads + kv_heads) * dim, hidden, seed),
                                _matrix([q8], kv_heads * dim, hidden, seed + 1)])
    return [qkv, _matrix([q4], hidden, heads * dim, seed + 2),
            _matrix([q4, q8], 2 * inter, hidden, seed + 3), _matrix([q4], hidden, inter, seed + 4)]


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("first_layer", [True, False])
def test_decode_layer_on_quantized_weights_follows_their_dequantized_values(ops, rows,
                                                                            first_layer):
    """The fused layer with blobs for weights computes what it computes on the same weights
    dequantized to fp32 (the small-M kernel), but for the activations' int8 rounding: for
    these inputs each linear's error is 0.5-1.2 % of its output's norm (within the bound
    above; the most for down, whose input silu(gate) * up is heavy-tailed). Along the chain
    qkv -> attention -> o -> gate_up -> silu * up (two factors' errors) -> down they add up
    to at most ~4 %: the K/V written, the attention's output (added into the residual
    stream) and the layer's output are held to 5 % (a wrong weight gives ~100 %)."""
    hidden, heads, kv_heads, dim, inter, block = 96, 3, 1, 32, 160, 4
    ext = ops.load_ops()
    quant = _layer_weights(hidden, heads, kv_heads, dim, inter, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    norms = [torch.rand(n, generator=gen) + 0.5 for n in (hidden, hidden)]
    empty = torch.empty(0)

    def weights(mats):
        return [norms[0], mats[0], empty, empty, mats[1], norms[1], mats[2], mats[3]]

    lens = torch.randint(3, 20, (rows,), generator=gen)
    tables = torch.arange(rows * 6).view(rows, 6)
    kv = torch.randn(2, kv_heads, rows * 6, block, dim, generator=gen)
    positions = lens - 1
    slots = tables[torch.arange(rows), positions // block] * block + positions % block
    angles = torch.arange(64).float()[:, None] * 0.1 / (1 + torch.arange(dim // 2).float())
    x = torch.randn(rows, hidden, generator=gen)
    residual = None if first_layer else torch.randn(rows, hidden, generator=gen)
    outs = []
    for mats in ([to_blob(q) for q in quant], [q.dequantize() for q in quant]):
        cache = kv.clone()
        res = None if residual is None else residual.clone()
        out, res = ext.decode_layer(x.clone(), res, weights(mats), [None] * 4,
                                    [heads, kv_heads, dim], 1e-5, positions, angles.cos(),
                                    angles.sin(), cache, tables, lens, slots, dim ** -0.5, -1)
        written = cache.view(2, kv_heads, -1, dim)[:, :, slots]
        added = res - x - (0 if residual is None else residual)  # the attention's output
        outs.append((out, added, written))
    for got, want, what in zip(outs[0], outs[1], ("output", "attention", "K/V written"),
                               strict=True):
        rel = float((got - want).norm() / want.norm())
        assert rel < 0.05, f"{what}: {rel:.4f} of its norm"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, layout):
    """Regression: rows computed alone (decode steps) and inside 300-row calls (prefill,
    recompute after preemption) are bit-identical, so greedy tokens do not change with the
    batch around them — also where a big call takes two tiles at a time (512-bit VNNI) and a
    small one a tile at a time, and at an odd, partial last tile (100 rows: 12.5 tiles)."""
    blob = to_blob(_matrix([layout], 100, 640, seed=7))
    gen = torch.Generator().manual_seed(8)
    x, bias = torch.randn(300, 640, generator=gen), torch.randn(100, generator=gen)
    together = ops.linear_q(x, blob, bias)
    for m in (0, 1, 63, 64, 299):
        assert torch.equal(ops.linear_q(x[m:m + 1].clone(), blob, bias)[0], together[m]), m
    for rows in (slice(0, 3), slice(5, 12), slice(3, 19), slice(3, 20), slice(0, 70),
                 slice(7, 28)):
        assert torch.equal(ops.linear_q(x[rows].clone(), blob, bias), together[rows]), rows


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_linear_q_gives_the_same_bits_with_any_number_of_threads(ops, threads):
    """Each thread streams its own run of tiles and then takes the rest of the others' runs
    (parallel_streams): every tile is computed exactly once whatever the thread count, and a
    row's result does not depend on which thread computed it. Uneven runs (5 threads over
    odd tile counts) make threads finish early and take from the others."""
    blob = to_blob(_matrix(["u4_g32_fp16_mins", "s8_g32_fp16"], 1001, 576, seed=11))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.linear_q(x, blob, None)
        torch.set_num_threads(threads)
        for _ in range(5):
            assert torch.equal(ops.linear_q(x, blob, None), alone)
    finally:
        torch.set_num_threads(before)


def test_the_kernel_uses_vnni_where_the_build_targets_it(ops):
    """A build for this CPU (-march=native) takes the VNNI dot product where the CPU has it
    (512-bit with AVX-512 VNNI, BW and VL; 256-bit with AVX-VNNI), else AVX2's;
    KVRAY_CPU_MARCH may target less."""
    import os
    from pathlib import Path

    from kvray.kernels import cpu_ops

    kind = cpu_ops.quant_dot()
    assert kind in ("vnni512", "vnni", "avx2", "none")
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if os.environ.get(cpu_ops.MARCH_ENV, "").strip() not in ("", "native") or not flags:
        return
    vnni = {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags
    wide = {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
    want = "vnni512" if wide else "vnni" if vnni else "avx2" if "avx2" in flags else "none"
    assert kind == want


def test_big_calls_take_the_amx_tiles_where_the_cpu_has_them(ops):
    """A native build on a CPU with AMX-INT8 runs calls of many rows on the tile unit (the
    identity and bound tests above then cover it at 40, 70 and 300 rows: bit-identical to
    the vector kernel of a single row); elsewhere never."""
    import os
    from pathlib import Path

    from kvray.kernels import cpu_ops

    rows = cpu_ops.quant_amx_rows()
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    native = os.environ.get(cpu_ops.MARCH_ENV, "").strip() in ("", "native")
    if native and os.environ.get("KVRAY_AMX", "") != "0" and {"amx_int8", "amx_tile"} <= flags \
            and cpu_ops.quant_dot() == "vnni512":
        assert rows == 16
    elif not {"amx_int8", "amx_tile"} <= flags:
        assert rows == 0
