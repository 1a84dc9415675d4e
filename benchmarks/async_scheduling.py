"""Async scheduling against the synchronous engine, in one run, on the built-in model.

Offline greedy decoding (``ignore_eos``) at several batch sizes, each run with
``async_scheduling`` off and on, alternated ``--repeats`` times (these machines are shared
and noisy: the best of each counts). Reports output tokens/s, the time per output token of
one sequence (TPOT: the run's wall time over the tokens the longest sequence emitted), the
ratio async / sync, and the placeholders the async engine scheduled and wasted (requests that
ended while their next step ran). The outputs are checked identical.

On CPU the "device" is the same cores: the overlap wins back the engine's single-threaded
host work (scheduling, detokenizing, outputs) only where the forward leaves a core idle. On
a GPU the forward runs on the device and the host work hides behind it.

Usage: python benchmarks/async_scheduling.py [--batch 1,16] [--max-tokens 96] [--repeats 2]
           [--dtype auto] [--model DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import benchmark_dtype  # noqa: E402
from kvray import LLM, SamplingParams  # noqa: E402


def _prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(32, 96))]}
            for _ in range(count)]


def _run(llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                    default="auto")
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dtype = benchmark_dtype(args.dtype, args.model)
    batches = [int(b) for b in args.batch.split(",")]
    engines = {mode: LLM(args.model, dtype=dtype, async_scheduling=mode == "async",
                         max_num_seqs=max(batches))
               for mode in ("sync", "async")}
    rows = []
    for batch in batches:
        prompts = _prompts(batch, seed=batch)
        for llm in engines.values():  # warm-up: kernels, first-touch of the KV cache
            _run(llm, prompts[:1], 4)
        best: dict[str, float] = {}
        tokens: dict[str, list] = {}
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                sched = llm.llm_engine.scheduler
                before = (sched.num_placeholders, sched.num_wasted_placeholders)
                seconds, tokens[mode] = _run(llm, prompts, args.max_tokens)
                best[mode] = min(best.get(mode, seconds), seconds)
                if mode == "async":
                    placed = sched.num_placeholders - before[0]
                    wasted = sched.num_wasted_placeholders - before[1]
        assert tokens["sync"] == tokens["async"], "async scheduling changed greedy tokens"
        out_tokens = batch * args.max_tokens
        row = {"batch": batch, "max_tokens": args.max_tokens,
               "sync_tok_s": out_tokens / best["sync"], "async_tok_s": out_tokens / best["async"],
               "sync_tpot_ms": 1e3 * best["sync"] / args.max_tokens,
               "async_tpot_ms": 1e3 * best["async"] / args.max_tokens,
               "ratio": best["sync"] / best["async"], "placeholders": placed,
               "wasted": wasted}
        rows.append(row)
    for llm in engines.values():
        llm.shutdown()
    print(f"\n{args.repeats} alternated repeats, best of each; greedy, "
          f"{args.max_tokens} output tokens per request, prompts 32-96 tokens")
    print("| batch | sync tok/s | async tok/s | async / sync | sync TPOT ms | async TPOT ms "
          "| placeholders | wasted |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['sync_tok_s']:.1f} | {r['async_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['sync_tpot_ms']:.2f} | {r['async_tpot_ms']:.2f} | "
              f"{r['placeholders']} | {r['wasted']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
