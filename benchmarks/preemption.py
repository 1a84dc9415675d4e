"""Preemption modes on workloads whose victims differ: recompute, swap and auto (issue 9).

Three parts, each run in a KV cache too small for its requests, so requests are preempted
mid-generation and resumed:

- ``long``: distinct long prompts. A victim has hundreds of computed tokens that no other
  request shares: recomputing it re-prefills all of them; swapping copies its blocks.
- ``shared``: short requests behind one long common prefix (a system prompt). A victim's
  prefix stays cached (other requests hold it): recomputing it costs only its own tail;
  swapping copies its whole context and brings it back into private blocks, prefix
  included, so it needs ~17 free blocks to return instead of ~2.
- ``mixed``: both kinds at once, so ``auto`` can choose per victim.

Each part runs with ``preemption_mode`` recompute, swap and auto on the built-in
SmolLM2-135M (or ``--model``), in-process, greedy with EOS ignored, after a short warm-up;
the modes take turns, ``--rounds`` times with fresh prompts, and each keeps its fastest
round (the 2 cores are shared: a burst of other work must not decide a row). The table
gives wall time, output tokens/s, preemptions, swaps and the tokens/s ratio to the better
fixed mode of that part. Every mode must produce the same tokens.

Usage: python benchmarks/preemption.py [--model PATH] [--dtype D] [--parts long,shared,mixed]
    [--rounds 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import benchmark_dtype  # noqa: E402
from kvray import LLM, SamplingParams  # noqa: E402
from kvray.models.default_model import resolve_model_path  # noqa: E402

MODES = ("recompute", "swap", "auto")
BLOCK_SIZE = 16


@dataclass
class Part:
    """One workload: its prompts, output lengths and a KV cache too small for them."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    num_blocks: int


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def long_requests(rng: random.Random, vocab: int, n: int) -> tuple[list, list]:
    """``n`` distinct 256-token prompts, 24 new tokens each."""
    return [_tokens(rng, 256, vocab) for _ in range(n)], [24] * n


def shared_requests(rng: random.Random, vocab: int, n: int) -> tuple[list, list]:
    """``n`` requests: one 256-token prefix + 8 tokens of their own, 24 new tokens each."""
    prefix = _tokens(rng, 256, vocab)
    return [prefix + _tokens(rng, 8, vocab) for _ in range(n)], [24] * n


def make_parts(seed: int, vocab: int) -> dict[str, Part]:
    """The three parts, their caches sized (with the pure scheduler) so that requests are
    preempted as they grow. A long request needs 16 blocks for its prompt and 18 at the end;
    a shared one the 16 shared blocks plus 1 (prompt tail) to 2 of its own."""
    rng = random.Random(seed)
    long_p, long_t = long_requests(rng, vocab, n=3)
    shared_p, shared_t = shared_requests(rng, vocab, n=12)
    lp, lt = long_requests(rng, vocab, n=2)
    sp, st = shared_requests(rng, vocab, n=6)
    # 3 shared, long, 3 shared, long: both kinds run, and both are preempted.
    mixed_p = sp[:3] + lp[:1] + sp[3:] + lp[1:]
    mixed_t = st[:3] + lt[:1] + st[3:] + lt[1:]
    return {"long": Part("long", long_p, long_t, 34),
            "shared": Part("shared", shared_p, shared_t, 30),
            "mixed": Part("mixed", mixed_p, mixed_t, 36)}


def build(model: str, dtype: str, part: Part, mode: str) -> LLM:
    """An engine for ``part`` with ``mode``, warmed up by one short request."""
    llm = LLM(model, dtype=dtype, block_size=BLOCK_SIZE, num_gpu_blocks_override=part.num_blocks,
              preemption_mode=mode, swap_space=1.0)
    warm = [{"prompt_token_ids": part.prompts[0][:32]}]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def generate(llm: LLM, part: Part) -> dict:
    """Run ``part`` once; its wall time, counters and tokens."""
    stats = llm.llm_engine.stats
    before = (stats.num_preemptions, stats.num_swaps_out, stats.num_swaps_in)
    params = [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
              for t in part.max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in part.prompts], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return dict(wall=wall, tok_s=sum(map(len, tokens)) / wall, tokens=tokens,
                preemptions=stats.num_preemptions - before[0],
                swaps_out=stats.num_swaps_out - before[1],
                swaps_in=stats.num_swaps_in - before[2])


def run_part(model: str, dtype: str, rounds: list[Part]) -> list[dict]:
    """Every mode on the part, the modes interleaved round by round (each round has its own
    prompts, so no round hits another's prefix cache); per mode its fastest round."""
    engines = {mode: build(model, dtype, rounds[0], mode) for mode in MODES}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for part in rounds:
        for mode, llm in engines.items():
            runs[mode].append(generate(llm, part))
            r = runs[mode][-1]
            print(f"  {part.name} / {mode}: {r['wall']:.1f} s, {r['preemptions']} preemptions, "
                  f"{r['swaps_out']} swaps", flush=True)
    rows = []
    for mode, llm in engines.items():
        stats = llm.llm_engine.stats
        best = min(runs[mode], key=lambda r: r["wall"])
        rows.append(dict(best, part=rounds[0].name, mode=mode,
                         tokens=[r["tokens"] for r in runs[mode]],
                         prefill_ms_per_token=1e3 * stats.prefill_s_per_token,
                         swap_ns_per_byte=1e9 * stats.swap_s_per_byte))
        llm.shutdown()
    return rows


def print_table(rows: list[dict]) -> None:
    print("| part | mode | wall s | output tok/s | preemptions | swaps out/in | "
          "vs best fixed mode |")
    print("|---|---|---|---|---|---|---|")
    for part in dict.fromkeys(r["part"] for r in rows):
        mine = [r for r in rows if r["part"] == part]
        best = max(r["tok_s"] for r in mine if r["mode"] != "auto")
        for r in mine:
            print(f"| {part} | {r['mode']} | {r['wall']:.1f} | {r['tok_s']:.1f} | "
                  f"{r['preemptions']} | {r['swaps_out']}/{r['swaps_in']} | "
                  f"{r['tok_s'] / best:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: built-in)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                    default="auto", help="default auto: kvray's choice for this CPU")
    ap.add_argument("--parts", default="long,shared,mixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode; the fastest counts")
    args = ap.parse_args()
    model = str(resolve_model_path(args.model))
    dtype = benchmark_dtype(args.dtype, model)
    print(f"model: {Path(model).name}; block_size {BLOCK_SIZE}", flush=True)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rounds = [make_parts(args.seed + r, vocab) for r in range(args.rounds)]
    start = time.perf_counter()
    rows = []
    for name in args.parts.split(","):
        rows += run_part(model, dtype, [parts[name] for parts in rounds])
    print()
    print_table(rows)
    auto = [r for r in rows if r["mode"] == "auto"]
    print(f"\nauto measured at start-up: prefill {auto[0]['prefill_ms_per_token']:.3f} "
          f"ms/token, swap {auto[0]['swap_ns_per_byte']:.2f} ns/byte (out + in)")
    same = all(r["tokens"] == next(x for x in rows if x["part"] == r["part"])["tokens"]
               for r in rows)
    print(f"tokens identical across modes: {same}")
    print(f"total time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
