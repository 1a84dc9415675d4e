"""Quantized weights and KV cache on one GPU: what each format costs per linear, per decode
step and per batch-64 step, against the HBM roofline of the bytes it reads.

Two Llama-shaped stacks — a 1.1B one (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64,
MLP 8192, vocab 32000) and a Llama-3-8B one (hidden 4096, 32 layers, 32 / 8 heads of 128, MLP
14336, vocab 128256) — are generated on the device in each weight format (distinct random
weights per layer, so nothing stays in L2) and run through kvray's kernels:

- ``bf16``: ``F.linear`` (cuBLAS);
- ``fp8``: online FP8 (:func:`kvray.quant.fp8.quantize_fp8`, per-channel e4m3) through
  :func:`kvray.kernels.triton_quant.linear_quant` (``torch._scaled_mm`` on per-token e4m3
  rows on capability >= 8.9 — the norms before qkv and gate_up hand them over quantized —
  else the Triton dequant GEMM);
- ``int4 g128``: U4 codes with fp16 scales and mins per 128 columns (the layout AWQ and
  GPTQ checkpoints load into) through the Triton dequant GEMM.

Measured (CUDA events; replayed from a CUDA graph where capture works):

1. the decode step (:mod:`benchmarks.quant_step`: norms, linears, rotary + KV write,
   paged attention over ``context`` cached tokens, LM head) at batch 1 and 64: ms per step,
   output tokens/s, and % of the roofline of the bytes it reads (weights + K/V) at the
   measured copy bandwidth; each part timed alone over all layers (the breakdown); CUDA
   kernels per layer by the profiler;
2. per linear (qkv, o, gate_up, down) at M = 1 and M = 64: microseconds, bytes read
   (weights + activations) and % of the roofline;
3. paged decode attention (batch 64, 1024-token contexts, 8B shape) on a bf16 / int8 / fp8
   KV cache.

Prints markdown tables, writes ``gpu_quant_bench.md`` / ``.json`` under ``--out`` (rewritten
after every part). ``--smoke`` runs tiny shapes on CPU under Triton's interpreter (the
code path, not the numbers). Exit status 1 if a part failed.

    python benchmarks/gpu_quant_bench.py --out OUT_DIR
    TRITON_INTERPRET=1 python benchmarks/gpu_quant_bench.py --out OUT_DIR --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Without a GPU, Triton's kernels run in its interpreter (chosen before Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_step import (  # noqa: E402
    PARTS,
    DecodeStep,
    cuda_kernels,
    linear,
    new_caches,
    weight_bytes,
)
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor  # noqa: E402

FORMATS = ("bf16", "fp8", "int4 g128")
KV_FORMATS = {"bf16": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's linear shapes."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    batch: int = 64  # the throughput batch
    context: int = 1024  # KV tokens per sequence in the attention part
    block_size: int = 16

    def linears(self) -> dict[str, tuple[int, int]]:
        """name -> (N, K) of each linear of a layer."""
        q = self.heads * self.head_dim
        return {"qkv": (q + 2 * self.kv_heads * self.head_dim, self.hidden),
                "o": (self.hidden, q), "gate_up": (2 * self.intermediate, self.hidden),
                "down": (self.hidden, self.intermediate)}


LLAMA_1B = Shape("Llama 1.1B shape", hidden=2048, layers=16, heads=32, kv_heads=8,
                 head_dim=64, intermediate=8192, vocab=32000)
LLAMA_8B = Shape("Llama-3-8B shape", hidden=4096, layers=32, heads=32, kv_heads=8,
                 head_dim=128, intermediate=14336, vocab=128256)
SMOKE_SHAPES = (Shape("smoke 1B-like", hidden=128, layers=2, heads=4, kv_heads=1,
                      head_dim=32, intermediate=384, vocab=256, batch=4, context=40),
                Shape("smoke 8B-like", hidden=128, layers=2, heads=4, kv_heads=2,
                      head_dim=32, intermediate=256, vocab=256, batch=4, context=40))


# ---- weights ---------------------------------------------------------------------------------

def make_weight(fmt: str, n: int, k: int, device: torch.device, dtype: torch.dtype
                ) -> torch.Tensor | QuantTensor:
    """A random [n, k] weight in ``fmt`` on ``device``."""
    if fmt == "bf16":
        return torch.randn(n, k, device=device, dtype=dtype) * 0.02
    if fmt == "fp8":
        from kvray.quant.fp8 import quantize_fp8

        return quantize_fp8(torch.randn(n, k, device=device) * 0.02)
    if fmt == "int4 g128":
        group = 128
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scales = (torch.rand(n, k // group, device=device) * 0.004).half()
        mins = (-8 * scales.float()).half()
        return QuantTensor((n, k), (QuantSegment(QuantKind.U4, group, codes, scales, mins),),
                           source="int4 g128")
    raise ValueError(f"unknown weight format {fmt}")


# ---- timing ----------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, iters: int,
              use_graph: bool) -> tuple[float, bool]:
    """Seconds per ``fn()`` (best of 3 rounds of ``iters``), replayed from a CUDA graph when
    ``use_graph`` and capture succeeds; returns (seconds, whether a graph was used)."""
    fn()
    fn()
    synchronize(device)
    run, graphed = fn, False
    if use_graph and device.type == "cuda":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run, graphed = graph.replay, True
            run()
        except Exception as err:  # noqa: BLE001 - eager timing still means something
            print(f"  CUDA graph capture failed ({type(err).__name__}: {err}); timing eager",
                  flush=True)
            synchronize(device)
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            seconds = time.perf_counter() - t0
        best = min(best, seconds / iters)
    return best, graphed


def measure_copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second (read + written) of a large device-to-device copy."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = time_call(lambda: dst.copy_(src), device, 5, use_graph=False)
    return 2 * num_bytes / seconds


# ---- parts -----------------------------------------------------------------------------------

def bench_linears(fmt: str, layers: list[dict[str, Any]], shape: Shape, device: torch.device,
                  dtype: torch.dtype, bandwidth: float, iters: int) -> list[dict[str, Any]]:
    """Each linear at M = 1 and M = batch, cycling through the layers' copies (one CUDA
    graph per sweep: launch overhead would otherwise hide a 4-bit GEMV's few us)."""
    rows = []
    for name, (n, k) in shape.linears().items():
        for m in (1, shape.batch):
            x = torch.randn(m, k, device=device, dtype=dtype)
            ws = [layer[name] for layer in layers]

            def run(x: torch.Tensor = x, ws: list = ws) -> None:
                for w in ws:
                    linear(x, w)

            seconds, _ = time_call(run, device, iters, use_graph=True)
            per_call = seconds / len(ws)
            nbytes = weight_bytes(ws[0]) + (m * k + m * n) * x.element_size()
            rows.append({"format": fmt, "linear": name, "n": n, "k": k, "m": m,
                         "us": per_call * 1e6, "bytes": nbytes,
                         "roofline_pct": 100 * nbytes / bandwidth / per_call})
    return rows


def bench_format(fmt: str, shape: Shape, device: torch.device, dtype: torch.dtype,
                 lm_head: torch.Tensor, caches: dict[int, list[torch.Tensor]],
                 bandwidth: float, smoke: bool) -> dict[str, Any]:
    """Build the stack in ``fmt``; time its step at batch 1 and ``shape.batch`` (whole and by
    part), count its kernels per layer, and time its linears."""
    t0 = time.perf_counter()
    layers = [{name: make_weight(fmt, n, k, device, dtype)
               for name, (n, k) in shape.linears().items()} for _ in range(shape.layers)]
    synchronize(device)
    result: dict[str, Any] = {"format": fmt, "build_s": round(time.perf_counter() - t0, 2)}
    iters = 1 if smoke else 10
    for m, kv in caches.items():
        step = DecodeStep(layers, lm_head, shape, m, kv, device, dtype)
        seconds, graphed = time_call(step.step, device, iters, use_graph=True)
        floor = step.bytes_read() / bandwidth
        parts = {name: time_call(fn, device, iters, use_graph=True)[0] * 1e3
                 for name, fn in step.parts().items()}
        kernels = cuda_kernels(step.step)
        head = cuda_kernels(step.parts()["lm_head"])
        result[f"b{m}"] = {
            "step_ms": seconds * 1e3, "tokens_per_s": m / seconds, "cuda_graph": graphed,
            "bytes_read": step.bytes_read(), "floor_ms": floor * 1e3,
            "roofline_pct": 100 * floor / seconds, "parts_ms": parts,
            "kernels_per_layer": None if kernels is None
            else (kernels - head) / shape.layers}
        del step
    result["linears"] = bench_linears(fmt, layers, shape, device, dtype, bandwidth,
                                      iters=1 if smoke else 5)
    return result


def bench_kv_attention(kv: str, shape: Shape, device: torch.device, dtype: torch.dtype,
                       bandwidth: float, smoke: bool) -> dict[str, Any]:
    """Triton paged decode, batch ``shape.batch`` at ``shape.context`` tokens each."""
    from kvray.kernels import triton_attention

    cache_dtype = KV_FORMATS[kv]
    b, ctx, bs, d = shape.batch, shape.context, shape.block_size, shape.head_dim
    blocks_per_seq = -(-ctx // bs)
    num_blocks = b * blocks_per_seq
    row = d + (triton_attention.SCALE_BYTES if cache_dtype is not None else 0)
    cache = torch.zeros(2, shape.kv_heads, num_blocks, bs, row, device=device,
                        dtype=cache_dtype or dtype)
    chunk = 4096  # tokens per write_kv call while filling
    for start in range(0, num_blocks * bs, chunk):
        n = min(chunk, num_blocks * bs - start)
        kv_vals = torch.randn(2, n, shape.kv_heads, d, device=device, dtype=dtype)
        triton_attention.write_kv(kv_vals[0], kv_vals[1], cache,
                                  torch.arange(start, start + n, device=device))
    tables = torch.arange(num_blocks, device=device, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(b, shape.heads, d, device=device, dtype=dtype)
    seconds, _ = time_call(
        lambda: triton_attention.paged_decode(q, cache, tables, lens, d ** -0.5, None),
        device, iters=1 if smoke else 20, use_graph=True)
    nbytes = 2 * b * ctx * shape.kv_heads * row * cache.element_size()
    return {"kv_cache_dtype": kv, "us_per_layer": seconds * 1e6, "bytes": nbytes,
            "bytes_per_token_per_layer": 2 * shape.kv_heads * row * cache.element_size(),
            "roofline_pct": 100 * nbytes / bandwidth / seconds}


# ---- report ----------------------------------------------------------------------------------

def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def render(report: dict[str, Any]) -> str:
    bw = report["copy_bandwidth_bytes_per_s"]
    lines = [f"{report['device_name']} | copy bandwidth {fmt(bw / 1e12, 2)} TB/s (read + "
             f"write) | activations {report['dtype']}"]
    for run in report["runs"]:
        lines += [""] + render_run(run)
    return "\n".join(lines)


def render_run(run: dict[str, Any]) -> list[str]:
    """One shape's tables: the step, its parts, its linears, its KV caches."""
    shape = run["shape"]
    lines = [f"## {shape['name']}: hidden {shape['hidden']}, {shape['layers']} layers, "
             f"{shape['heads']} / {shape['kv_heads']} heads of {shape['head_dim']}, MLP "
             f"{shape['intermediate']}, vocab {shape['vocab']}; {shape['context']}-token "
             "contexts", "",
             "Decode step (norms, linears, rotary + KV write, attention, LM head):", "",
             "| weights | batch | GB read | ms/step | floor ms | % of roofline | tok/s "
             "| kernels/layer | CUDA graph |", "|---|---:|" + "---:|" * 6 + "---|"]
    for r in run["formats"]:
        if r.get("error"):
            lines.append(f"| {r['format']} | failed: {r['error'][:120]} |" + " |" * 7)
            continue
        for key in sorted((k for k in r if k.startswith("b") and k[1:].isdigit()),
                          key=lambda k: int(k[1:])):
            b = r[key]
            lines.append(
                f"| {r['format']} | {key[1:]} | {fmt(b['bytes_read'] / 1e9, 2)} "
                f"| {fmt(b['step_ms'], 3)} | {fmt(b['floor_ms'], 3)} "
                f"| {fmt(b['roofline_pct'])} | {fmt(b['tokens_per_s'])} "
                f"| {fmt(b['kernels_per_layer'])} | {'yes' if b['cuda_graph'] else 'no'} |")
    lines += ["", "Step breakdown, ms per step (each part alone over all layers):", "",
              "| weights | batch | " + " | ".join(PARTS) + " |",
              "|---|---:|" + "---:|" * len(PARTS)]
    for r in run["formats"]:
        for key, b in r.items():
            if isinstance(b, dict) and "parts_ms" in b:
                lines.append(f"| {r['format']} | {key[1:]} | "
                             + " | ".join(fmt(b["parts_ms"][p], 3) for p in PARTS) + " |")
    lines += ["", "Per linear (each call reads a different layer's copy):", "",
              "| weights | linear | N x K | M | us | MB read | % of roofline |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in run["formats"]:
        for lin in r.get("linears", []):
            lines.append(f"| {lin['format']} | {lin['linear']} | {lin['n']} x {lin['k']} "
                         f"| {lin['m']} | {fmt(lin['us'])} | {fmt(lin['bytes'] / 1e6, 2)} "
                         f"| {fmt(lin['roofline_pct'])} |")
    if run["kv"]:
        lines += ["", f"Paged decode attention, one layer: batch {shape['batch']}, "
                  f"{shape['context']}-token contexts:", "",
                  "| kv_cache_dtype | bytes/token/layer | us | MB read | % of roofline |",
                  "|---|---:|---:|---:|---:|"]
        for r in run["kv"]:
            if r.get("error"):
                lines.append(f"| {r['kv_cache_dtype']} | failed: {r['error'][:120]} | | | |")
                continue
            lines.append(f"| {r['kv_cache_dtype']} | {r['bytes_per_token_per_layer']} "
                         f"| {fmt(r['us_per_layer'])} | {fmt(r['bytes'] / 1e6, 1)} "
                         f"| {fmt(r['roofline_pct'])} |")
    return lines


def write_report(report: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = render(report)
    (out / "gpu_quant_bench.md").write_text(text + "\n")
    (out / "gpu_quant_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return text


def release_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_part(what: str, fn: Callable[[], dict[str, Any]], key: str, name: str,
             report: dict[str, Any], out: Path, deadline: float) -> None:
    """Run one format's part, record it in the last run (or its error / the time budget),
    rewrite the report."""
    if time.monotonic() > deadline:
        report["runs"][-1][key].append({what: name, "error": "skipped: past the time budget"})
    else:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - record it, go on with the next
            traceback.print_exc()
            result = {what: name, "error": f"{type(err).__name__}: {err}"}
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        report["runs"][-1][key].append(result)
        print(f"[{name}] {json.dumps({k: v for k, v in result.items() if k != 'linears'})}",
              flush=True)
    release_memory()
    write_report(report, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (on CPU: Triton's interpreter) to check the script")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds after which no further part starts (default 240)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke or device.type != "cuda" else (LLAMA_1B, LLAMA_8B)
    out = Path(args.out)
    deadline = time.monotonic() + args.time_budget
    torch.manual_seed(0)
    bandwidth = measure_copy_bandwidth(device, (2 << 30) if device.type == "cuda" else 1 << 24)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    report: dict[str, Any] = {"device_name": name, "dtype": str(dtype).removeprefix("torch."),
                              "copy_bandwidth_bytes_per_s": bandwidth, "runs": []}
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    for shape in shapes:
        report["runs"].append({"shape": asdict(shape), "formats": [], "kv": []})
        bench_shape(shape, device, dtype, bandwidth, report, out, deadline, args.smoke,
                    with_kv=shape is shapes[-1])
    text = write_report(report, out)
    print("\n" + text, flush=True)
    failed = [r for run in report["runs"] for r in run["formats"] + run["kv"] if r.get("error")]
    return 1 if failed else 0


def bench_shape(shape: Shape, device: torch.device, dtype: torch.dtype, bandwidth: float,
                report: dict[str, Any], out: Path, deadline: float, smoke: bool,
                with_kv: bool) -> None:
    """Every weight format's step and linears on ``shape`` (and the KV cache formats'
    attention with ``with_kv``)."""
    lm_head = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype) * 0.02
    caches = {m: new_caches(shape, m, device, dtype) for m in (1, shape.batch)}
    for fmt_name in FORMATS:
        run_part("format", lambda f=fmt_name: bench_format(f, shape, device, dtype, lm_head,
                                                           caches, bandwidth, smoke),
                 "formats", f"{shape.name}: {fmt_name}", report, out, deadline)
    caches.clear()  # the formats' steps are done: free the K/V before the attention part
    release_memory()
    for kv in KV_FORMATS if with_kv else ():
        run_part("kv_cache_dtype", lambda k=kv: bench_kv_attention(k, shape, device, dtype,
                                                                  bandwidth, smoke),
                 "kv", kv, report, out, deadline)


if __name__ == "__main__":
    sys.exit(main())
