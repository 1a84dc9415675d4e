"""The CPU kernels on quantized weights (``cpu_ops.linear_q``) against the read floor.

Every linear of one decode step of the built-in model (SmolLM2-135M: hidden 576,
intermediate 1536, 9 heads x 64, 3 KV heads, 30 layers; random codes of its shapes, each
layer's weights distinct so that a step streams them from memory as a real one does) at
M = 1, 4, 8, 16, 32 rows and a prefill chunk of 256, for Q4_1 (U4, groups of 32, fp16
scales and mins) and Q8_0 (S8, groups of 32, fp16 scales), and with ``--formats`` int8
(S8, one fp32 scale per row: ``quantization: int8``) and the other GGUF layouts: Q4_0 (U4,
code offset 8), Q5_0 (U5, offset 16), Q4_K (U4, two-level u8 x fp16 scales and mins), Q5_K
(the same in U5), Q6_K (U6, groups of 16, offset 32, two-level i8 x fp16), Q3_K (3-bit
codes in U4, groups of 16, offset 4, two-level i8 x fp16), Q2_K (2-bit codes in U4, groups
of 16, two-level u8 x fp16 scales and mins). For each: the time of the step's linears, the
GB/s of the bytes actually read (codes, scales, mins), that as a % of the read bandwidth
measured in the same run (``torch.sum`` over 512 MiB with the same threads), and the step
time over the read floor (bytes / bandwidth); at M = 256 GFLOP/s against the fp32 path
(``cpu_ops.linear_packed`` on packed fp32 weights of the same shapes). Formats and paths
are timed alternating in one process (median of the rounds).

    python benchmarks/quant_kernels.py [--rounds 7] [--threads N] [--formats Q4_1,Q8_0,...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvray.hardware import describe
from kvray.kernels import cpu_ops
from kvray.quant.blob import to_blob
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor, pack_u4

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 576, 1536, 9, 3, 64, 30
# (name, N, K) of one layer's linears, QKV and gate_up fused as kvray runs them
LINEARS = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), ("o", HIDDEN, HEADS * HEAD_DIM),
           ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)]
ROWS = (1, 4, 8, 16, 32, 256)


def _quantized(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantTensor:
    """Random codes of ``fmt``'s layout (scales of a sane size; a K-quant's super-blocks of
    256 may end partway along K = 576: the kernel reads them the same way)."""
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    if fmt in ("Q4_1", "Q4_0"):
        codes = pack_u4(torch.randint(0, 16, (n, k), generator=gen))
        if fmt == "Q4_0":
            seg = QuantSegment(QuantKind.U4, 32, codes, scales, zero=8)
        else:
            mins = (torch.randn(n, k // 32, generator=gen) * 0.05).half()
            seg = QuantSegment(QuantKind.U4, 32, codes, scales, mins)
    elif fmt == "Q5_0":
        codes = torch.randint(0, 32, (n, k), generator=gen).to(torch.uint8)
        seg = QuantSegment(QuantKind.U5, 32, codes, scales, zero=16)
    elif fmt in ("Q4_K", "Q5_K", "Q2_K"):
        group, levels = (16, 4) if fmt == "Q2_K" else (32, 16 if fmt == "Q4_K" else 32)
        raw = torch.randint(0, levels, (n, k), generator=gen)
        kind = QuantKind.U5 if fmt == "Q5_K" else QuantKind.U4
        codes = raw.to(torch.uint8) if kind == QuantKind.U5 else pack_u4(raw)
        sub = torch.randint(0, 16 if fmt == "Q2_K" else 64, (n, k // group),
                            generator=gen).to(torch.uint8)
        sup = (torch.rand(n, -(-k // 256), generator=gen) * 1e-3).half()
        seg = QuantSegment(kind, group, codes, sub, sub.flip(1), 0, 256 // group, sup, -sup)
    elif fmt == "Q3_K":
        codes = pack_u4(torch.randint(0, 8, (n, k), generator=gen))
        sub = torch.randint(-32, 32, (n, k // 16), generator=gen).to(torch.int8)
        sup = (torch.rand(n, -(-k // 256), generator=gen) * 1e-3).half()
        seg = QuantSegment(QuantKind.U4, 16, codes, sub, zero=4, super_group=16,
                           super_scales=sup)
    elif fmt == "Q6_K":
        codes = torch.randint(0, 64, (n, k), generator=gen).to(torch.uint8)
        sub = torch.randint(-64, 64, (n, k // 16), generator=gen).to(torch.int8)
        sup = (torch.rand(n, -(-k // 256), generator=gen) * 1e-4).half()
        seg = QuantSegment(QuantKind.U6, 16, codes, sub, zero=32, super_group=16,
                           super_scales=sup)
    elif fmt == "Q8_0":
        codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
        seg = QuantSegment(QuantKind.S8, 32, codes, scales)
    elif fmt == "int8":  # `quantization: int8`: S8, one fp32 scale per row
        codes = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
        seg = QuantSegment(QuantKind.S8, k, codes, torch.rand(n, 1, generator=gen) * 0.01)
    else:
        raise SystemExit(f"--formats: unknown format {fmt!r} (Q4_1, Q8_0, int8, Q4_0, Q5_0, "
                         "Q4_K, Q5_K, Q6_K, Q3_K, Q2_K)")
    return QuantTensor((n, k), (seg,))


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s of torch.sum over 512 MiB (the best of ``repeats``)."""
    big = torch.ones(128 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--formats", default="Q4_1,Q8_0",
                        help="comma-separated: Q4_1, Q8_0, int8, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K, "
                        "Q3_K, Q2_K")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.load_ops() is not None, "the CPU kernels do not build here"
    print(describe())
    print(f"threads: {args.threads}; vector lanes: {cpu_ops.vector_lanes()}; "
          f"int8 dot: {cpu_ops.quant_dot()}; AMX from "
          f"{cpu_ops.quant_amx_rows() or '(never)'} rows", flush=True)

    gen = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _ in range(LAYERS) for _, n, k in LINEARS]
    formats = [f for f in args.formats.split(",") if f]
    mats = {fmt: [_quantized(fmt, n, k, gen) for n, k in shapes] for fmt in formats}
    blobs = {fmt: [to_blob(m) for m in ms] for fmt, ms in mats.items()}
    read = {fmt: sum(m.nbytes for m in ms) for fmt, ms in mats.items()}
    packed = [cpu_ops.pack_linear_weight(m.dequantize()) for m in mats[formats[0]]]
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in (HIDDEN, INTER)} for m in ROWS}

    def step(fmt: str, m: int) -> Callable[[], None]:
        def run() -> None:
            for blob, (_, k) in zip(blobs[fmt], shapes, strict=True):
                cpu_ops.linear_q(xs[m][k], blob, None)
        return run

    def fp32_step(m: int) -> Callable[[], None]:
        def run() -> None:
            for w, (n, k) in zip(packed, shapes, strict=True):
                cpu_ops.linear_packed(xs[m][k], w, n, None)
        return run

    cases = {(fmt, m): step(fmt, m) for m in ROWS for fmt in blobs}
    cases[("fp32", 256)] = fp32_step(256)
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    bandwidths = []
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.rounds):
        bandwidths.append(read_bandwidth(2))
        for case, fn in cases.items():
            times[case].append(_timed(fn))
    bw = statistics.median(bandwidths)
    flops = {m: 2 * m * sum(n * k for n, k in shapes) for m in ROWS}
    print(f"read bandwidth: {bw:.1f} GB/s (torch.sum over 512 MiB, {args.threads} threads)")
    fp32_mb = 4 * sum(n * k for n, k in shapes) / 1e6
    print("bytes read per step: " + ", ".join(f"{f} {read[f] / 1e6:.1f} MB" for f in formats)
          + f" (fp32: {fp32_mb:.0f} MB)")
    print(f"{'format':7} {'M':>4} {'ms/step':>8} {'GB/s':>6} {'% bw':>5} {'x floor':>7} "
          f"{'GFLOP/s':>8}")
    for (fmt, m), ts in times.items():
        t = statistics.median(ts)
        gflops = flops[m] / t / 1e9
        if fmt == "fp32":
            print(f"{fmt:7} {m:>4} {t * 1e3:8.2f} {'':>6} {'':>5} {'':>7} {gflops:8.1f}")
            continue
        gbs = read[fmt] / t / 1e9
        print(f"{fmt:7} {m:>4} {t * 1e3:8.2f} {gbs:6.1f} {100 * gbs / bw:5.0f} "
              f"{t / (read[fmt] / bw / 1e9):7.2f} {gflops:8.1f}")
    fp32 = statistics.median(times[("fp32", 256)])
    for fmt in blobs:
        ratio = fp32 / statistics.median(times[(fmt, 256)])
        print(f"M = 256: {fmt} at {ratio:.2f}x the fp32 path's GFLOP/s")


if __name__ == "__main__":
    main()
