"""Distributed runtime costs on the built-in SmolLM2, in one run:

1. TP=1 in-process vs TP=1 through one Ray worker actor (the actor boundary; target >= 0.9x),
   with the per-step broadcast time (ray.put of the SchedulerOutput) against the step time;
2. TP=3 and PP=2 against TP=1 (on a 2-core machine these share the same 2 cores); PP=2
   with one step at a time (stages take turns) and with 2 micro-batches in flight;
3. swap vs recompute for long requests preempted under a small KV cache.

Every run uses the dtype kvray's ``auto`` picks for this CPU (bf16 only where it is native,
else fp32) unless ``--dtype`` says otherwise.

Usage: python benchmarks/distributed.py [--num-requests 32] [--skip-parallel] [--skip-swap]
    [--dtype D]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from benchmarks.common import benchmark_dtype  # noqa: E402
from kvray import LLM, SamplingParams  # noqa: E402


def workload(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(100, 49000)
                                             for _ in range(rng.randint(32, 256))]})
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(32, 96),
                                     ignore_eos=True))
    return prompts, params


def run(label: str, prompts, params, **kwargs) -> dict:
    llm = LLM(None, **kwargs)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    steps0, bcast0 = engine.stats.num_steps, engine.executor.broadcast_s
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.stats.num_steps - steps0
    result = dict(label=label, wall=wall, tok_s=tokens / wall, steps=steps,
                  broadcast_ms=1e3 * (engine.executor.broadcast_s - bcast0) / max(steps, 1),
                  step_ms=1e3 * wall / max(steps, 1), swaps=engine.stats.num_swaps_out,
                  preemptions=engine.stats.num_preemptions,
                  tokens=[o.outputs[0].token_ids for o in outs])
    llm.shutdown()
    print(f"  {label}: {result['tok_s']:.1f} tok/s, {wall:.1f} s", flush=True)
    return result


def table(rows: list[dict], base: dict, dtype: str) -> None:
    print(f"dtype: {dtype}")
    print("| setup | output tok/s | wall s | vs baseline | step ms | broadcast ms/step |"
          " preemptions | swaps |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['tok_s']:.1f} | {r['wall']:.1f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}x | {r['step_ms']:.1f} | "
              f"{r['broadcast_ms']:.2f} | {r['preemptions']} | {r['swaps']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--skip-swap", action="store_true")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                    default="auto", help="dtype of every run (default auto: kvray's choice "
                    "for this CPU)")
    args = ap.parse_args()
    dtype = benchmark_dtype(args.dtype)
    ray.init(num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    prompts, params = workload(args.num_requests, args.seed)
    print(f"{args.num_requests} requests, SmolLM2-135M {dtype}, {os.cpu_count()} cores")
    base = run("TP=1 in-process", prompts, params, dtype=dtype)
    rows = [base, run("TP=1 one Ray actor", prompts, params, dtype=dtype,
                      distributed_executor_backend="ray")]
    if not args.skip_parallel:
        # SmolLM2 has 9 heads and 3 KV heads: TP must divide them (3 actors on 2 cores).
        rows.append(run("TP=3 (3 actors)", prompts, params, dtype=dtype,
                        tensor_parallel_size=3))
        rows.append(run("PP=2 (2 actors), one step at a time", prompts, params, dtype=dtype,
                        pipeline_parallel_size=2, pipeline_micro_batches=1))
        rows.append(run("PP=2 (2 actors), 2 micro-batches in flight", prompts, params,
                        dtype=dtype, pipeline_parallel_size=2))
    table(rows, base, dtype)
    same = all(r["tokens"] == base["tokens"] for r in rows[:2])
    print(f"\nactor boundary ratio: {rows[1]['tok_s'] / base['tok_s']:.2f}x (target >= 0.9x); "
          f"tokens identical to in-process: {same}")
    if not args.skip_parallel:
        off, on, one = rows[-2], rows[-1], rows[1]
        print(f"PP=2 micro-batching: {on['tok_s'] / off['tok_s']:.2f}x of PP=2 without; "
              f"{on['tok_s'] / one['tok_s']:.2f}x of TP=1 in one actor (the ideal, when each "
              f"stage has cores of its own: {os.cpu_count()} cores here for 2 stages and the "
              f"driver); PP tokens identical to in-process: "
              f"{all(r['tokens'] == base['tokens'] for r in rows[-2:])}")
    if not args.skip_swap:
        swap_bench(args.seed, dtype)
    ray.shutdown()


def swap_bench(seed: int, dtype: str) -> None:
    """Four 300-token prompts growing by 500 tokens each in a cache for about two of them: the
    latest requests are preempted mid-generation and later resumed by swap or recompute."""
    rng = random.Random(seed + 1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(300)]}
               for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)] * 4
    common = dict(dtype=dtype, distributed_executor_backend="ray", num_gpu_blocks_override=100,
                  max_num_batched_tokens=1024, enable_prefix_caching=False)
    print("\nlong preempted requests (4 x 300-token prompts, 500 new tokens, 100 blocks):")
    rows = [run("recompute", prompts, params, preemption_mode="recompute", **common),
            run("swap", prompts, params, preemption_mode="swap", swap_space=1.0, **common)]
    table(rows, rows[0], dtype)
    print(f"swap tokens identical to recompute: {rows[0]['tokens'] == rows[1]['tokens']}")


if __name__ == "__main__":
    main()
