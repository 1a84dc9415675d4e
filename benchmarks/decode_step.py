"""Decode step time against the hardware's limits, batch 1 to 64.

At batch 1 a decode step must read every weight once: its floor is the bytes of weights the
step reads divided by the machine's read bandwidth, both measured in this run. At large
batches the step is compute-bound: its FLOP rate is compared with a square matmul's peak in
the same dtype, also measured here. Prints one table; compare ratios within one run only
(the machines are shared and differ).

With ``--neighbour`` a second process spins on one core during the decode steps, as the
Serve ingress, Ray or another tenant would. PyTorch's OpenMP threads spin at barriers by
default, which a busy neighbour turns into long stalls; compare with OMP_WAIT_POLICY=PASSIVE
in the environment (see benchmarks/RESULTS.md for the trade-off).

Usage:
    python benchmarks/decode_step.py [--batches 1,4,8,16,64] [--steps 48] [--dtype auto]
        [--neighbour] [--prompt-len 64] [--model PATH] [--quantization none|int8]

The default model is the built-in one as kvray runs it: its Q4_1 GGUF, read in place
(``--quantization none``: dequantized; ``--model`` the bf16 directory of
``kvray setup --dense-weights`` for the dense path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import read_bandwidth  # noqa: E402


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_decode_step(model: torch.nn.Module) -> int:
    """Bytes of the matrices a decode step multiplies (what the small-M kernel reads: the
    bf16 copies where they exist, a quantized layer's blob of codes and scales); norms and
    one embedding row are negligible."""
    from kvray.models.layers import SmallMMatmul

    total = 0
    for module in model.modules():
        if isinstance(module, SmallMMatmul):
            total += module.kernel_weight.numel() * module.kernel_weight.element_size()
    return total


def decode_steps(engine, batch: int, steps: int, prompt_len: int = 64) -> list[float]:
    """Wall seconds of each pure-decode engine step with ``batch`` running requests."""
    from kvray.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = [(1000 + 7 * i + j) % 30000 + 100 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and maybe the first decodes)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if len(engine.scheduler.running) == batch:
            times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def busy_neighbour(enabled: bool):
    """A process spinning on one core while the block runs (bounded: killed on exit)."""
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 600\n"
                             "while time.time() < end: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--neighbour", action="store_true", help="a busy process on one core")
    ap.add_argument("--model", default=None, help="default: the built-in model (its GGUF)")
    ap.add_argument("--quantization", default=None, help="none | int8 (default: as stored)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="auto | int8 | fp8 | fp8_e4m3 | fp8_e5m2 (the engine's kv_cache_dtype)")
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="prompt tokens per request: the context each step attends over "
                    "grows from here by one per step")
    args = ap.parse_args()

    from kvray.config import config_from_flat
    from kvray.engine.llm_engine import LLMEngine
    from kvray.hardware import describe
    from kvray.kernels import cpu_ops
    from kvray.models.layers import SmallMMatmul
    from kvray.quant.blob import from_blob

    print(describe())
    engine = LLMEngine(config_from_flat({"model": args.model, "dtype": args.dtype,
                                         "quantization": args.quantization,
                                         "kv_cache_dtype": args.kv_cache_dtype,
                                         "max_num_seqs": 256}))
    runner = engine.executor.worker.runner
    model, dtype = runner.model, runner.dtype
    spec = runner.spec
    quantized = sorted({from_blob(m.qweight).kinds[0].name for m in model.modules()
                        if isinstance(m, SmallMMatmul) and m.qweight is not None})
    print(f"model {Path(engine.model_path).name}, dtype {str(dtype).removeprefix('torch.')}, "
          f"weights {'quantized (' + ', '.join(quantized) + ' codes)' if quantized else 'dense'}"
          f", torch threads {torch.get_num_threads()}"
          + (f", int8 dot {cpu_ops.quant_dot()}" if quantized else ""))
    bandwidth = read_bandwidth()
    peak = matmul_peak(dtype)
    weight_bytes = weight_bytes_per_decode_step(model)

    def numel(m: SmallMMatmul) -> int:
        if m.qweight is not None:
            rows, cols = from_blob(m.qweight).shape
            return rows * cols
        return m.kernel_weight.numel()

    flops_per_token = 2 * sum(numel(m) for m in model.modules() if isinstance(m, SmallMMatmul))
    floor = weight_bytes / bandwidth
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per decode step "
          f"{weight_bytes / 2**20:.0f} MiB -> floor {floor * 1e3:.1f} ms; "
          f"{dtype} matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"{flops_per_token / 1e6:.0f} MFLOP per token (linear layers + LM head; "
          f"{spec.num_layers} layers)")

    print(f"kv_cache_dtype {args.kv_cache_dtype}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; busy neighbour: "
          f"{'yes' if args.neighbour else 'no'}; context {args.prompt_len}.."
          f"{args.prompt_len + args.steps} tokens")
    print("\n| batch | step ms (median) | tok/s | step / floor | GFLOP/s | % of matmul peak |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        with busy_neighbour(args.neighbour):
            step = statistics.median(decode_steps(engine, batch, args.steps,
                                                  args.prompt_len))
        flops = batch * flops_per_token / step
        print(f"| {batch} | {step * 1e3:.1f} | {batch / step:.1f} | {step / floor:.2f}x | "
              f"{flops / 1e9:.1f} | {100 * flops / peak:.0f} % |", flush=True)


if __name__ == "__main__":
    main()
