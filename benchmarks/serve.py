"""Online serving benchmark, like `vllm bench serve`: requests over HTTP with Poisson arrivals
at given rates (or a fixed concurrency), streaming, measuring TTFT / TPOT / ITL / E2E.

By default it launches `kvray serve` on the built-in SmolLM2 on a free loopback port, runs
each load, stops the server, then runs the same workload through the offline `LLM` to
compare throughput (target: server >= 0.85x offline). Both run the dtype kvray's `auto`
picks for this CPU (bf16 only where it is native, else fp32) unless `--dtype` says otherwise.

`--ingress serve,replica,process` runs each of kvray's front ends in turn (Ray Serve's,
Ray Serve's with the app inside the model replica, and `kvray serve --ingress process`: the
OpenAI app and the engine in one process).

Peer mode (`--peer URL`): the same requests, at each `--concurrency`, against kvray (a fresh
server per front end and load) and then against any other OpenAI-compatible server (e.g.
llama.cpp's llama-server, see benchmarks/peer_llamacpp.sh), back to back, with a kvray /
peer ratio table per front end.

Every load (and the warm-up) sends prompts of its own, the same to every server: servers
that cache prompts must not answer one load from the KV of another. The prompts follow from
`--seed` and the load's label, so against a server that stays up (`--base-url`) give each
run a new `--seed`: a repeated run is answered from the prefix cache (at concurrency 16 on
a 2-core Xeon: 176 instead of 124 output tok/s).

Requests, loads and metrics are `kvray bench serve`'s (kvray.bench); this script adds the
launched servers, the fresh prompts per load, the tables and the peer ratios.

Usage:
    python benchmarks/serve.py [--rates 1,2,4,inf] [--concurrency N[,N...]] [--num-requests 64]
        [--base-url http://127.0.0.1:8000] [--skip-offline] [--dtype D]
        [--prompt-len 32,256] [--output-len 32,128] [--ingress serve,replica,process]
    python benchmarks/serve.py --peer http://127.0.0.1:8080 [--peer-name NAME]
        (defaults then: --concurrency 1,8,16, prompts 64..256, outputs 64..128, no rates)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvray.bench.client import Endpoint, RequestOutput  # noqa: E402
from kvray.bench.datasets import SampleRequest  # noqa: E402
from kvray.bench.load import run_load  # noqa: E402
from kvray.bench.metrics import compute_metrics, output_token_count  # noqa: E402


def workload(n: int, seed: int, prompt_len: tuple[int, int] = (32, 256),
             output_len: tuple[int, int] = (32, 128)) -> list[SampleRequest]:
    """n requests of random token ids (no special tokens), lengths uniform in the ranges."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_len))]
        reqs.append(SampleRequest(prompt, len(prompt), rng.randint(*output_len)))
    return reqs


def _checked(output: RequestOutput, request: SampleRequest) -> RequestOutput:
    """A request that ended short of its ``max_tokens`` (ignore_eos is set) failed. A peer
    that reports no usage is counted by its text chunks."""
    got = output_token_count(output, None)
    if output.success and got != request.output_len:
        return replace(output, success=False, error=f"got {got}/{request.output_len} tokens")
    return output


def measure(base: str, model: str, reqs: list[SampleRequest], rate: float,
            concurrency: int | None, seed: int) -> tuple[list[RequestOutput], float]:
    """One load through :func:`kvray.bench.load.run_load`: greedy, EOS ignored."""
    endpoint = Endpoint(f"{base}/v1/completions", "openai", model,
                        extra_body={"temperature": 0, "ignore_eos": True})
    outputs, duration = asyncio.run(run_load(endpoint, reqs, rate, 1.0, concurrency, seed))
    return [_checked(o, r) for o, r in zip(outputs, reqs, strict=True)], duration


def summarize(label: str, outputs: list[RequestOutput], duration: float) -> dict:
    metrics = compute_metrics(outputs, duration, [99.0])

    def ms(name: str) -> tuple[float, float, float]:
        stats = metrics.stats[name]
        return stats.mean, stats.median, stats.percentiles[99.0]

    row = {"load": label, "ok": metrics.completed, "failed": metrics.failed,
           "duration_s": duration, "req_s": metrics.request_throughput,
           "out_tok_s": metrics.output_throughput, "ttft": ms("ttft"), "tpot": ms("tpot"),
           "itl": ms("itl"), "e2e": ms("e2el")}
    errors = {o.error for o in outputs if not o.success}
    if errors:
        print(f"  {label}: errors {sorted(errors)[:3]}")
    print(f"  {label}: {row['out_tok_s']:.1f} output tok/s, p99 TTFT {row['ttft'][2]:.0f} ms, "
          f"median TPOT {row['tpot'][1]:.1f} ms", flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    print("| load | ok | failed | duration s | req/s | output tok/s | TTFT ms mean/med/p99 |"
          " TPOT ms mean/med/p99 | ITL ms mean/med/p99 | E2E ms mean/med/p99 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def fmt(t):
            return "/".join(f"{x:.0f}" for x in t)

        print(f"| {r['load']} | {r['ok']} | {r['failed']} | {r['duration_s']:.1f} | "
              f"{r['req_s']:.2f} | {r['out_tok_s']:.1f} | {fmt(r['ttft'])} | "
              f"{fmt(r['tpot'])} | {fmt(r['itl'])} | {fmt(r['e2e'])} |")


def launch_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvray.cli", "serve", "--port", str(port),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.kill()
    raise RuntimeError("kvray serve did not start")


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM (a drain and a clean shutdown, like Ctrl-C), then SIGKILL if it takes longer
    than ``grace_s``. Not SIGINT: a benchmark started in the background of a
    non-interactive shell runs with SIGINT ignored, and so does the server it starts."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"  kvray serve did not stop within {grace_s:.0f} s of SIGTERM; killed",
              flush=True)
        proc.kill()
        proc.wait()


def offline(reqs, dtype: str, model: str | None = None) -> float:
    from kvray import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype)
    llm.generate([{"prompt_token_ids": [5] * 16}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def load_workload(n: int, seed: int, load: str, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[SampleRequest]:
    """The requests of one load: fresh prompts per load (and per warm-up), the same for
    every server. A server that caches prompts (kvray's prefix cache, llama-server's slot
    cache) would otherwise answer a later load's prompts from an earlier load's KV and
    skip their prefill: llama-server's log showed 1-token prompt evaluations for whole
    loads when every load reused one prompt set."""
    return workload(n, zlib.crc32(f"{seed}:{load}".encode()), prompt_len, output_len)


def run_loads(base: str, n: int, rates: list[str], concurrencies: list[int], seed: int,
              prompt_len: tuple[int, int], output_len: tuple[int, int],
              label: str = "") -> list[dict]:
    """Warm the server up, then one run per Poisson rate and per fixed concurrency, each
    on its own prompts (:func:`load_workload`)."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    warmup = load_workload(4, seed, "warm-up", prompt_len, output_len)
    measure(base, model, warmup, float("inf"), None, 0)
    rows = []
    for rate_text in rates:
        load = f"rate {rate_text} req/s"
        reqs = load_workload(n, seed, load, prompt_len, output_len)
        results, dur = measure(base, model, reqs, float(rate_text), None, seed)
        rows.append(summarize(f"{label}{load}", results, dur))
    for conc in concurrencies:
        load = f"concurrency {conc}"
        reqs = load_workload(n, seed, load, prompt_len, output_len)
        results, dur = measure(base, model, reqs, float("inf"), conc, seed)
        rows.append(summarize(f"{label}{load}", results, dur))
    return rows


def print_peer_ratios(ours: list[dict], theirs: list[dict], concurrencies: list[int],
                      peer: str) -> None:
    print(f"\n| concurrency | output tok/s kvray / {peer} | ratio | p99 TTFT ms kvray / peer |"
          " median TPOT ms kvray / peer |")
    print("|---|---|---|---|---|")
    for conc, a, b in zip(concurrencies, ours, theirs, strict=True):
        ratio = a["out_tok_s"] / b["out_tok_s"] if b["out_tok_s"] else float("nan")
        print(f"| {conc} | {a['out_tok_s']:.1f} / {b['out_tok_s']:.1f} | {ratio:.2f}x | "
              f"{a['ttft'][2]:.0f} / {b['ttft'][2]:.0f} | {a['tpot'][1]:.1f} / "
              f"{b['tpot'][1]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default=None,
                    help="Poisson request rates (req/s); default 1,2,4,inf (none with --peer)")
    ap.add_argument("--concurrency", default=None,
                    help="fixed-concurrency runs, comma-separated (default none; 1,8,16 "
                    "with --peer)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=_pair, default=None,
                    help="min,max prompt tokens (default 32,256; 64,256 with --peer)")
    ap.add_argument("--output-len", type=_pair, default=None,
                    help="min,max output tokens (default 32,128; 64,128 with --peer)")
    ap.add_argument("--base-url", default=None, help="use a running kvray server instead")
    ap.add_argument("--peer", default=None,
                    help="base URL of another OpenAI-compatible server to run the same "
                    "requests against, after kvray at each concurrency")
    ap.add_argument("--peer-name", default="peer")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--model", default=None,
                    help="the model kvray serves (and the offline run loads): a Hugging Face "
                    "directory or a .gguf file (default: the built-in model)")
    ap.add_argument("--ingress", default="serve",
                    help="the kvray front ends to launch, comma-separated: serve (Ray Serve, "
                    "the default), replica (`--ingress replica`) and/or process (`kvray "
                    "serve --ingress process`); each "
                    "gets a fresh server per load in peer mode")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                    default="auto", help="dtype of the launched server and the offline run "
                    "(default auto: kvray's choice for this CPU)")
    args = ap.parse_args()
    peer = args.peer
    rates_text = args.rates if args.rates is not None else ("" if peer else "1,2,4,inf")
    rates = [r for r in rates_text.split(",") if r]
    conc_text = args.concurrency if args.concurrency is not None else ("1,8,16" if peer else "")
    concurrencies = [int(c) for c in conc_text.split(",") if c]
    prompt_len = args.prompt_len or ((64, 256) if peer else (32, 256))
    output_len = args.output_len or ((64, 128) if peer else (32, 128))
    from benchmarks.common import benchmark_dtype

    dtype = benchmark_dtype(args.dtype)  # what both sides run on this CPU
    ingresses = [i for i in args.ingress.split(",") if i]
    if not ingresses or set(ingresses) - {"serve", "replica", "process"}:
        ap.error(f"--ingress {args.ingress!r}: serve, replica and/or process")

    def loads(base: str, label: str, concs: list[int], load_rates: list[str]) -> list[dict]:
        return run_loads(base, args.num_requests, load_rates, concs, args.seed, prompt_len,
                         output_len, label)

    def on_kvray(ingress: str, label: str, concs: list[int],
                 load_rates: list[str]) -> list[dict]:
        """The loads on the running server (--base-url), else on a fresh one."""
        if args.base_url:
            return loads(args.base_url, label, concs, load_rates)
        model_flag = ["--model", args.model] if args.model else []
        proc, base = launch_server(["--dtype", dtype, "--ingress", ingress, *model_flag])
        try:
            return loads(base, label, concs, load_rates)
        finally:
            stop_server(proc)

    if args.base_url is not None:
        ingresses = ["running"]
    ours: dict[str, list[dict]] = {i: [] for i in ingresses}
    rows, theirs = [], []
    if peer is None:
        for ingress in ingresses:
            label = "" if len(ingresses) == 1 else f"kvray ({ingress}) "
            ours[ingress] = on_kvray(ingress, label, concurrencies, rates)
            rows += ours[ingress]
    else:  # one load at a time on each server, back to back, so both see the same noise
        for conc in concurrencies:
            for ingress in ingresses:
                label = "kvray " if len(ingresses) == 1 else f"kvray ({ingress}) "
                ours[ingress] += on_kvray(ingress, label, [conc], [])
                rows.append(ours[ingress][-1])
            theirs += loads(peer, f"{args.peer_name} ", [conc], [])
            rows.append(theirs[-1])
    if args.base_url:
        model = httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    elif args.model:
        model = Path(args.model).name
    else:
        from kvray.models.default_model import default_model_dir

        model = default_model_dir().name
    print(f"\n{args.num_requests} requests, prompts {prompt_len[0]}..{prompt_len[1]}, outputs "
          f"{output_len[0]}..{output_len[1]} tokens (ignore_eos), model {model}")
    server_dtype = dtype if args.base_url is None else "the running server's own"
    offline_dtype = "" if args.skip_offline or peer else f", {dtype} (offline)"
    print(f"dtype: {server_dtype} (server){offline_dtype}\n")
    print_table(rows)
    if peer is not None:
        for ingress, mine in ours.items():
            if len(ours) > 1:
                print(f"\nkvray serve --ingress {ingress}:")
            print_peer_ratios(mine, theirs, concurrencies, args.peer_name)
    elif not args.skip_offline:
        best = max(r["out_tok_s"] for r in rows)
        off = offline(load_workload(args.num_requests, args.seed, "offline", prompt_len,
                                    output_len), dtype, args.model)
        print(f"\noffline LLM on the same workload: {off:.1f} output tok/s; best server load "
              f"{best:.1f} tok/s = {best / off:.2f}x offline (target >= 0.85x)")


if __name__ == "__main__":
    main()
