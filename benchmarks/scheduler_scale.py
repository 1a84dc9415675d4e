"""The central scheduler at scale: step rate and SchedulerOutput size with many requests
running, without a model (docs/scaling.md extrapolates from it).

One engine replica has one scheduler loop, and every step's ``SchedulerOutput`` is put
into Ray's object store once and read by every worker. Both limit how fast a big replica
can step. With ``N`` requests decoding (prompts of ``--prompt-len`` tokens already
computed), each step is timed in its parts: ``schedule()``, a pickled ``SchedulerOutput``
(the bytes each worker receives), ``ray.put`` of it, and ``update_from_output`` with one
sampled token per request (what the engine does with the workers' answer). Prints one
table. Steps in which a request finishes or a block boundary is crossed are included (as
in real decoding: one request in ``block_size`` needs a new block each step).

Usage: python benchmarks/scheduler_scale.py [--running 100,1000,4000] [--steps 64]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvray.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvray.sampling_params import SamplingParams  # noqa: E402
from kvray.scheduler.output import ModelRunnerOutput  # noqa: E402
from kvray.scheduler.request import Request  # noqa: E402
from kvray.scheduler.scheduler import Scheduler  # noqa: E402


def measure(running: int, steps: int, prompt_len: int, block_size: int,
            put) -> dict[str, float]:
    budget = max(8192, 2 * running)  # decodes leave at least half of it to prefills
    # Long enough that no request finishes while the others still prefill.
    max_tokens = 2 * running * prompt_len // budget + steps + 64
    blocks = running * (-(-(prompt_len + max_tokens) // block_size) + 1)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=budget),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=True))
    sched = Scheduler(config, blocks, prompt_len + max_tokens + 8)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(running):
        prompt = [rng.randrange(100, 100_000) for _ in range(prompt_len)]
        sched.add_request(Request(str(i), prompt, params, max_tokens=max_tokens))

    def fake_result(out) -> ModelRunnerOutput:
        ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        sampled = [[rng.randrange(100, 100_000)] if reqs[r].num_computed_tokens + n
                   >= reqs[r].num_tokens else [] for r, n in out.num_scheduled_tokens.items()]
        return ModelRunnerOutput(ids, sampled, [None] * len(ids), [[] for _ in ids])

    rows: dict[str, list[float]] = {k: [] for k in ("schedule", "pickle", "put", "update",
                                                    "bytes")}
    while sched.has_unfinished_requests():  # prefill, not timed
        out = sched.schedule()
        decoding = all(n == 1 for n in out.num_scheduled_tokens.values()) and \
            len(out.num_scheduled_tokens) == running
        if decoding:
            break
        sched.update_from_output(out, fake_result(out))
    sched.update_from_output(out, fake_result(out))
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        data = pickle.dumps(out, protocol=5)
        t2 = time.perf_counter()
        if put is not None:
            put(out)
        result = fake_result(out)  # what the workers would send back: not timed
        t3 = time.perf_counter()
        sched.update_from_output(out, result)
        t4 = time.perf_counter()
        rows["schedule"].append(t1 - t0)
        rows["pickle"].append(t2 - t1)
        rows["put"].append(t3 - t2)
        rows["update"].append(t4 - t3)
        rows["bytes"].append(len(data))
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", default="100,1000,4000")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-ray", action="store_true", help="skip timing ray.put")
    args = parser.parse_args()
    put = None
    if not args.no_ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
        put = ray.put
    from kvray.hardware import describe

    print(describe())
    print(f"prompts {args.prompt_len} tokens, block size "
          f"{args.block_size}, one decode token per request per step; medians of "
          f"{args.steps} steps")
    print("| running | schedule ms | pickle ms | ray.put ms | update ms | host ms/step "
          "| max steps/s | SchedulerOutput bytes | bytes/request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.running.split(",")):
        r = measure(n, args.steps, args.prompt_len, args.block_size, put)
        host = r["schedule"] + r["put"] + r["update"]
        print(f"| {n} | {r['schedule'] * 1e3:.2f} | {r['pickle'] * 1e3:.2f} | "
              f"{r['put'] * 1e3:.2f} | {r['update'] * 1e3:.2f} | {host * 1e3:.2f} | "
              f"{1 / host:.0f} | {r['bytes']:,.0f} | {r['bytes'] / n:.0f} |", flush=True)


if __name__ == "__main__":
    main()
