"""Quantized weights and KV cache on one GPU: what each format costs per linear, per decode
step and per batch-64 step, against the HBM roofline of the bytes it reads.

A Llama-3-8B-shaped stack (hidden 4096, 32 layers, 32 heads / 8 KV heads of 128, MLP 14336,
vocab 128256) is generated on the device in each weight format — distinct random weights
per layer, so nothing stays in L2 — and run through kvray's kernels:

- ``bf16``: ``F.linear`` (cuBLAS);
- ``fp8``: online FP8 (:func:`kvray.quant.fp8.quantize_fp8`, per-channel e4m3) through
  :func:`kvray.kernels.triton_quant.linear_quant` (``torch._scaled_mm`` with per-token
  activation scales on capability >= 8.9, else the Triton dequant GEMM);
- ``int4 g128``: U4 codes with fp16 scales and mins per 128 columns (AWQ's format) through
  the Triton dequant GEMM.

Measured (CUDA events; the step replayed from a CUDA graph where capture works):

1. per linear (qkv, o, gate_up, down) at M = 1 and M = 64: microseconds, bytes read
   (weights + activations) and % of the roofline (bytes / measured copy bandwidth);
2. the step: per layer RMSNorm -> qkv -> o (the attention output stood in by q) -> RMSNorm ->
   gate_up -> SiLU-and-mul -> down, then the bf16 LM head: batch-1 TPOT and its roofline
   floor (every weight read once), batch-64 output tokens/s. Attention is left out (it is
   the same in every weight format; table 3 measures it);
3. paged decode attention (batch 64, 1024-token contexts) on a bf16 / int8 / fp8 KV cache.

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
import torch.nn.functional as F

# Without a GPU, Triton's kernels run in its interpreter (chosen before Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


LLAMA_8B = Shape("Llama-3-8B shape", hidden=4096, layers=32, heads=32, kv_heads=8,
                 head_dim=128, intermediate=14336, vocab=128256)
SMOKE = Shape("smoke", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
              intermediate=256, vocab=256, batch=4, context=40)


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


def weight_bytes(w: torch.Tensor | QuantTensor) -> int:
    return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()


def linear(x: torch.Tensor, w: torch.Tensor | QuantTensor) -> torch.Tensor:
    if isinstance(w, QuantTensor):
        from kvray.kernels.triton_quant import linear_quant

        return linear_quant(x, w)
    return F.linear(x, w)


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


def decode_step_fn(layers: list[dict[str, Any]], lm_head: torch.Tensor, shape: Shape,
                   x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One forward of the stack's linears (attention excluded) for the rows of ``x``."""
    from kvray.kernels import triton_ops

    norm_w = torch.ones(shape.hidden, device=x.device, dtype=x.dtype)
    q_width = shape.heads * shape.head_dim

    def step() -> torch.Tensor:
        h = x
        for layer in layers:
            qkv = linear(triton_ops.rms_norm(h, norm_w, 1e-5), layer["qkv"])
            h = h + linear(qkv[:, :q_width], layer["o"])
            gate_up = linear(triton_ops.rms_norm(h, norm_w, 1e-5), layer["gate_up"])
            h = h + linear(triton_ops.silu_and_mul(gate_up), layer["down"])
        return F.linear(triton_ops.rms_norm(h, norm_w, 1e-5), lm_head)

    return step


def bench_format(fmt: str, shape: Shape, device: torch.device, dtype: torch.dtype,
                 lm_head: torch.Tensor, bandwidth: float, smoke: bool) -> dict[str, Any]:
    """Build the stack in ``fmt``, time its linears and its step at batch 1 and batch."""
    t0 = time.perf_counter()
    layers = [{name: make_weight(fmt, n, k, device, dtype)
               for name, (n, k) in shape.linears().items()} for _ in range(shape.layers)]
    synchronize(device)
    built_s = time.perf_counter() - t0
    layer_bytes = sum(weight_bytes(w) for w in layers[0].values())
    step_bytes = layer_bytes * shape.layers + lm_head.numel() * lm_head.element_size()
    result: dict[str, Any] = {"format": fmt, "build_s": round(built_s, 2),
                              "weight_bytes": step_bytes,
                              "tpot_floor_ms": step_bytes / bandwidth * 1e3}
    result["linears"] = bench_linears(fmt, layers, shape, device, dtype, bandwidth,
                                      iters=1 if smoke else 5)
    for label, m in (("b1", 1), (f"b{shape.batch}", shape.batch)):
        x = torch.randn(m, shape.hidden, device=device, dtype=dtype)
        seconds, graphed = time_call(decode_step_fn(layers, lm_head, shape, x), device,
                                     iters=1 if smoke else 10, use_graph=True)
        result[f"{label}_step_ms"] = seconds * 1e3
        result[f"{label}_cuda_graph"] = graphed
    result["b1_tokens_per_s"] = 1e3 / result["b1_step_ms"]
    result["batch_tokens_per_s"] = shape.batch * 1e3 / result[f"b{shape.batch}_step_ms"]
    result["roofline_pct"] = 100 * result["tpot_floor_ms"] / result["b1_step_ms"]
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
    shape, bw = report["shape"], report["copy_bandwidth_bytes_per_s"]
    b = shape["batch"]
    lines = [f"{report['device_name']} | copy bandwidth {fmt(bw / 1e12, 2)} TB/s (read + "
             f"write) | {shape['name']}: hidden {shape['hidden']}, {shape['layers']} layers, "
             f"MLP {shape['intermediate']}, vocab {shape['vocab']} | activations "
             f"{report['dtype']}", "",
             "Decode step of the linears (+ norms, SiLU, bf16 LM head; no attention):", "",
             f"| weights | GB read | b1 TPOT ms | floor ms | % of roofline | b1 tok/s "
             f"| b{b} step ms | b{b} tok/s | CUDA graph |", "|---|" + "---:|" * 8]
    for r in report["formats"]:
        if r.get("error"):
            lines.append(f"| {r['format']} | failed: {r['error'][:120]} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['format']} | {fmt(r['weight_bytes'] / 1e9, 2)} | {fmt(r['b1_step_ms'], 3)} "
            f"| {fmt(r['tpot_floor_ms'], 3)} | {fmt(r['roofline_pct'])} "
            f"| {fmt(r['b1_tokens_per_s'])} | {fmt(r[f'b{b}_step_ms'], 3)} "
            f"| {fmt(r['batch_tokens_per_s'])} | {'yes' if r['b1_cuda_graph'] else 'no'} |")
    lines += ["", "Per linear (each call reads a different layer's copy):", "",
              "| weights | linear | N x K | M | us | MB read | % of roofline |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in report["formats"]:
        for lin in r.get("linears", []):
            lines.append(f"| {lin['format']} | {lin['linear']} | {lin['n']} x {lin['k']} "
                         f"| {lin['m']} | {fmt(lin['us'])} | {fmt(lin['bytes'] / 1e6, 2)} "
                         f"| {fmt(lin['roofline_pct'])} |")
    if report["kv"]:
        lines += ["", f"Paged decode attention, one layer: batch {b}, {shape['context']}-token "
                  f"contexts, {shape['heads']} q / {shape['kv_heads']} KV heads of "
                  f"{shape['head_dim']}:", "",
                  "| kv_cache_dtype | bytes/token/layer | us | MB read | % of roofline |",
                  "|---|---:|---:|---:|---:|"]
        for r in report["kv"]:
            if r.get("error"):
                lines.append(f"| {r['kv_cache_dtype']} | failed: {r['error'][:120]} | | | |")
                continue
            lines.append(f"| {r['kv_cache_dtype']} | {r['bytes_per_token_per_layer']} "
                         f"| {fmt(r['us_per_layer'])} | {fmt(r['bytes'] / 1e6, 1)} "
                         f"| {fmt(r['roofline_pct'])} |")
    return "\n".join(lines)


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
    """Run one format's part, record it (or its error / the time budget), rewrite the report."""
    if time.monotonic() > deadline:
        report[key].append({what: name, "error": "skipped: past the time budget"})
    else:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - record it, go on with the next
            traceback.print_exc()
            result = {what: name, "error": f"{type(err).__name__}: {err}"}
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        report[key].append(result)
        print(f"[{name}] {json.dumps({k: v for k, v in result.items() if k != 'linears'})}",
              flush=True)
    release_memory()
    write_report(report, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (on CPU: Triton's interpreter) to check the script")
    parser.add_argument("--time-budget", type=float, default=150.0,
                        help="seconds after which no further part starts (default 150)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SMOKE if args.smoke or device.type != "cuda" else LLAMA_8B
    out = Path(args.out)
    deadline = time.monotonic() + args.time_budget
    torch.manual_seed(0)
    bandwidth = measure_copy_bandwidth(device, (2 << 30) if device.type == "cuda" else 1 << 24)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    report: dict[str, Any] = {"device_name": name, "dtype": str(dtype).removeprefix("torch."),
                              "shape": asdict(shape), "copy_bandwidth_bytes_per_s": bandwidth,
                              "formats": [], "kv": []}
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    lm_head = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype) * 0.02
    for fmt_name in FORMATS:
        run_part("format", lambda f=fmt_name: bench_format(f, shape, device, dtype, lm_head,
                                                           bandwidth, args.smoke),
                 "formats", fmt_name, report, out, deadline)
    for kv in KV_FORMATS:
        run_part("kv_cache_dtype", lambda k=kv: bench_kv_attention(k, shape, device, dtype,
                                                                  bandwidth, args.smoke),
                 "kv", kv, report, out, deadline)
    text = write_report(report, out)
    print("\n" + text, flush=True)
    failed = [r for r in report["formats"] + report["kv"] if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
