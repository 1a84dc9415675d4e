"""Where a decode step's time goes with 64 and 256 requests running, in-process.

The step is cut into the engine's host-side work — scheduling, the workers' state update and
input preparation, sampling, applying the sampled tokens (detokenizing, stop checks, outputs)
— and the model's forward pass (attention and matmuls, including the LM head). Only steps in
which every running request decodes one token count. The target: the host-side work at
most 5 % of the step. Each part is timed by wrapping the method that does it.

Usage: python benchmarks/step_overhead.py [--running 64,256] [--steps 32] [--dtype auto]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import benchmark_dtype  # noqa: E402
from kvray import LLM, SamplingParams  # noqa: E402

# The parts of a step that Timers.wrap_step times, in the order a step runs them.
STEP_PARTS = ("schedule", "update states", "prepare inputs", "forward", "logits", "sampling")
PARTS = (*STEP_PARTS, "apply outputs")


class Timers:
    """Wall time per part within the current step. With ``sync`` (e.g. a CUDA synchronize),
    each part synchronizes the device before and after, so device work is charged to the
    part that launched it."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.sync = sync
        self._wrapped: list[tuple[object, str]] = []

    def wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if self.sync is not None:
                self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.current[part] += time.perf_counter() - start

        setattr(obj, name, timed)  # an instance attribute: delattr restores the method
        self._wrapped.append((obj, name))

    def wrap_step(self, engine, runner) -> None:
        """Time each of :data:`STEP_PARTS` of ``engine``'s steps (``runner``: its
        in-process model runner)."""
        for (obj, name), part in zip(
                ((engine.scheduler, "schedule"), (runner, "_update_states"),
                 (runner, "_prepare_inputs"), (runner, "_forward"),
                 (runner.model, "compute_logits"), (runner.sampler, "sample")), STEP_PARTS,
                strict=True):
            self.wrap(obj, name, part)

    def unwrap(self) -> None:
        """Put the wrapped methods back."""
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped.clear()


def measure(running: int, steps: int, dtype: str, seed: int) -> dict[str, float]:
    """Mean seconds per pure-decode step for each part, with ``running`` requests."""
    prompt_len, max_tokens = 32, steps + 8
    blocks_per_req = -(-(prompt_len + max_tokens) // 16) + 1
    llm = LLM(dtype=dtype, max_num_seqs=running, max_num_batched_tokens=max(2048, running),
              num_gpu_blocks_override=running * blocks_per_req, enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.executor.worker.runner
    timers = Timers()
    timers.wrap_step(engine, runner)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(running):
        engine.add_request(str(i), [rng.randrange(100, 49000) for _ in range(prompt_len)],
                           params)
    totals: dict[str, float] = defaultdict(float)
    counted = 0
    while engine.has_unfinished_requests() and counted < steps:
        timers.current.clear()
        decoding = len(engine.scheduler.running) == running and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if not decoding:
            continue
        counted += 1
        totals["step"] += wall
        inner = sum(timers.current.values())
        for part in PARTS[:-1]:
            totals[part] += timers.current[part]
        totals["apply outputs"] += wall - inner  # update_from_output, detokenize, outputs
    llm.shutdown()
    return {k: v / max(counted, 1) for k, v in totals.items()} | {"steps": counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", default="64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                    default="auto")
    args = ap.parse_args()
    dtype = benchmark_dtype(args.dtype)
    print("SmolLM2-135M, 32-token prompts, decode steps only\n")
    results = {n: measure(n, args.steps, dtype, args.seed)
               for n in (int(x) for x in args.running.split(","))}
    sizes = list(results)
    print("| part (ms per decode step) | " + " | ".join(f"{n} running" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for part in ("step", *PARTS):
        cells = []
        for n in sizes:
            r = results[n]
            cells.append(f"{1e3 * r[part]:.2f}" + ("" if part == "step" else
                                                   f" ({100 * r[part] / r['step']:.1f} %)"))
        print(f"| {part} | " + " | ".join(cells) + " |")
    host = [p for p in PARTS if p not in ("forward", "logits")]
    cells = [f"{100 * sum(results[n][p] for p in host) / results[n]['step']:.1f} %"
             for n in sizes]
    print(f"| host-side total ({', '.join(host)}) | " + " | ".join(cells) + " |")
    print(f"\ndecode steps measured: {', '.join(str(results[n]['steps']) for n in sizes)}; "
          "target: host-side total <= 5 % of the step")


if __name__ == "__main__":
    main()
