"""Multi-turn chat through several model replicas: how much of the prompts the replicas'
prefix caches serve, against what one unbounded cache would, per routing policy.

Workload: ``--sessions`` chat sessions arrive at random over ``--arrival-s`` seconds, in
groups of ``--group`` sharing a system prompt (lengths drawn from ``--system-len``); each
session runs ``--turns`` turns, every turn sending the whole conversation so far (its
history grows by the answer and a new question). For each ``--routing`` policy the script
starts ``kvray serve --num-replicas N --routing P`` on the built-in model, runs the same
workload (same seed: the same prompts), and reads each replica's prefix-cache counters from
``/metrics``.

The ideal hit rate is computed from the run itself: the prompts as the server tokenized
them (``/tokenize``), looked up in order of arrival in one unbounded cache of full blocks
that holds every earlier prompt and, once a request finished, its answer, leaving one token
to compute as the engine does.

Reported per run: hit rate over all replicas (device caches and KV tier) and its ratio to
the ideal, the busiest replica's prompt tokens over the mean, prompt tokens computed, hits
by tier (device / this replica's tier copies / another replica's), mean TTFT of first and
follow-up turns, and wall time.

``--tier BYTES`` adds runs with prefix routing and a device cache of ``--small-cache``
bytes per replica, small enough to evict: without the KV tier, and with it
(``kv_offload_bytes`` = BYTES) in each ``kv_offload_mode``; ``--autoscale`` one more: the
tier on (computed), replicas autoscaled from 1 up to ``--replicas`` mid-run, whose new
replicas fetch what the first one computed. ``--routing none`` skips the routing runs.

    python benchmarks/cluster_serve.py [--replicas 3] [--routing prefix,load]
        [--sessions 24] [--group 4] [--turns 3] [--system-len 300,900] [--extra "..."]
        [--tier 536870912 --small-cache 67108864 --autoscale]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve import launch_server, stop_server  # noqa: E402

WORDS = ("order", "parcel", "shipping", "address", "customer", "refund", "policy",
         "warehouse", "invoice", "delivery", "tracking", "weight", "carrier", "label",
         "return", "damaged", "express", "standard", "region", "tax", "price",
         "discount", "support", "ticket", "account", "password", "schedule", "route",
         "driver", "depot", "pallet", "container", "customs", "declaration", "insurance",
         "claim", "priority", "weekend", "holiday")
BLOCK_SIZE = 16  # the engine's default; the ideal is computed in the same blocks


@dataclass
class Turn:
    session: int
    turn: int
    messages: list[dict]
    sent: float = 0.0
    done: float = 0.0
    ttft: float = 0.0
    answer: str = ""
    completion_tokens: int = 0


@dataclass
class Session:
    index: int
    system: str
    start: float
    questions: list[str]
    turns: list[Turn] = field(default_factory=list)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_sessions(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    lo, hi = args.system_len
    groups = -(-args.sessions // args.group)
    # ~1.3 tokens per word of this vocabulary: a system prompt of lo..hi tokens
    systems = [f"You are support agent #{g}. Rules: " + _text(rng, int(rng.randint(lo, hi) / 1.3))
               for g in range(groups)]
    sessions = []
    for i in range(args.sessions):
        questions = [f"Question {t} from customer {i}: " + _text(rng, rng.randint(12, 30))
                     for t in range(args.turns)]
        sessions.append(Session(i, systems[i // args.group],
                                rng.uniform(0, args.arrival_s), questions))
    return sessions


async def run_session(client: httpx.AsyncClient, model: str, s: Session, t0: float,
                      max_tokens: int) -> None:
    await asyncio.sleep(max(0.0, s.start - (time.perf_counter() - t0)))
    messages = [{"role": "system", "content": s.system}]
    for k, question in enumerate(s.questions):
        messages = [*messages, {"role": "user", "content": question}]
        turn = Turn(s.index, k, messages, sent=time.perf_counter() - t0)
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("usage"):
                    turn.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and not turn.answer:
                        turn.ttft = time.perf_counter() - t0 - turn.sent
                    turn.answer += text
        turn.done = time.perf_counter() - t0
        s.turns.append(turn)
        messages = [*messages, {"role": "assistant", "content": turn.answer}]


def by_replica(base: str, series: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.findall(rf'^{series}\{{[^}}]*replica="([^"]+)"[^}}]*\}} (\S+)', text, re.M)
    return {replica: float(value) for replica, value in found}


def settled(base: str, series: str) -> dict[str, float]:
    """``series`` once two reads 0.7 s apart agree (replica stats arrive every 0.5 s)."""
    last: dict[str, float] | None = None
    for _ in range(60):
        now = by_replica(base, series)
        if now == last:
            return now
        last = now
        time.sleep(0.7)
    return last or {}


def ideal_hit_rate(client: httpx.Client, model: str, turns: list[Turn]) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of one unbounded cache on this run's requests."""
    events = []
    for t in turns:
        prompt = client.post("/tokenize", json={"model": model, "messages": t.messages}
                             ).json()["tokens"]
        full = client.post("/tokenize", json={
            "model": model, "add_generation_prompt": False,
            "messages": [*t.messages, {"role": "assistant", "content": t.answer}]}
        ).json()["tokens"]
        computed = full[:len(prompt) + max(0, t.completion_tokens - 1)]
        events += [(t.sent, 0, prompt), (t.done, 1, computed)]
    cache: set[int] = set()
    hits = queries = 0
    for _, kind, tokens in sorted(events, key=lambda e: (e[0], e[1])):
        hashes, parent = [], None
        for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE):
            parent = hash((parent, tuple(tokens[end - BLOCK_SIZE:end])))
            hashes.append(parent)
        if kind == 0:
            usable = (len(tokens) - 1) // BLOCK_SIZE
            matched = 0
            while matched < min(usable, len(hashes)) and hashes[matched] in cache:
                matched += 1
            hits += matched * BLOCK_SIZE
            queries += len(tokens)
        cache.update(hashes)
    return hits, queries


def run_policy(label: str, flags: list[str], args: argparse.Namespace) -> dict:
    proc, base = launch_server([*flags, *shlex.split(args.extra)])
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        with httpx.Client(base_url=base, timeout=600) as client:
            for i in range(args.replicas * 2):  # warm every replica (kernels, first steps)
                client.post("/v1/completions", json={"model": model, "prompt": f"warm {i}",
                                                     "max_tokens": 2})
            hits0 = settled(base, "kvray:prefix_cache_hits_total")
            queries0 = settled(base, "kvray:prefix_cache_queries_total")
            tiers0 = tier_hits(base)
            sessions = make_sessions(args)

            async def all_sessions() -> float:
                limits = httpx.Limits(max_connections=args.sessions + 4)
                async with httpx.AsyncClient(base_url=base, timeout=600,
                                             limits=limits) as aclient:
                    t0 = time.perf_counter()
                    await asyncio.gather(*(run_session(aclient, model, s, t0, args.max_tokens)
                                           for s in sessions))
                    return time.perf_counter() - t0

            wall = asyncio.run(all_sessions())
            hits = settled(base, "kvray:prefix_cache_hits_total")
            queries = settled(base, "kvray:prefix_cache_queries_total")
            tiers = tier_hits(base)
            turns = [t for s in sessions for t in s.turns]
            ideal_hits, ideal_queries = ideal_hit_rate(client, model, turns)
    finally:
        stop_server(proc)
    asked = {r: queries[r] - queries0.get(r, 0) for r in queries}
    by_tier = {t: tiers.get(t, 0) - tiers0.get(t, 0) for t in ("local", "remote")}
    by_tier["device"] = sum(hits[r] - hits0.get(r, 0) for r in hits)
    hit_rate = sum(by_tier.values()) / max(1, sum(asked.values()))
    ideal = ideal_hits / max(1, ideal_queries)
    mean_load = sum(asked.values()) / len(asked)
    return {"label": label, "hit_rate": hit_rate, "ideal": ideal,
            "vs_ideal": hit_rate / ideal if ideal else 0.0,
            "max_over_mean": max(asked.values()) / mean_load if mean_load else 0.0,
            "ttft_first": statistics.mean(t.ttft for t in turns if t.turn == 0),
            "ttft_follow": statistics.mean(t.ttft for t in turns if t.turn > 0),
            "computed": sum(asked.values()) - sum(by_tier.values()), "wall": wall,
            "tiers": by_tier, "per_replica": sorted(int(v) for v in asked.values())}


def tier_hits(base: str) -> dict[str, float]:
    """Hit tokens from the KV tier over all replicas, by tier (local / remote)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for tier, value in re.findall(r'^kvray:prefix_cache_hits_by_tier_total\{[^}]*tier="'
                                  r'([a-z]+)"[^}]*\} (\S+)', text, re.M):
        out[tier] = out.get(tier, 0.0) + float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--routing", default="prefix,load")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-len", default="300,900",
                        type=lambda v: tuple(int(x) for x in v.split(",")))
    parser.add_argument("--arrival-s", type=float, default=6.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", default="", help="more `kvray serve` flags, quoted")
    parser.add_argument("--tier", type=int, default=0, metavar="BYTES",
                        help="also run a small device cache without and with a KV tier of "
                             "BYTES per replica")
    parser.add_argument("--small-cache", type=int, default=64 << 20, metavar="BYTES",
                        help="the device cache per replica of the --tier runs")
    parser.add_argument("--autoscale", action="store_true",
                        help="with --tier: a run autoscaled from 1 replica, tier on")
    args = parser.parse_args()

    from benchmarks.common import benchmark_dtype

    benchmark_dtype("auto")
    print(f"{args.replicas} replicas, {args.sessions} sessions in groups of {args.group}, "
          f"{args.turns} turns, system prompts {args.system_len} tokens, arrivals over "
          f"{args.arrival_s:.0f} s, {args.max_tokens} tokens per answer; serve flags: "
          f"{args.extra or '(none)'}", flush=True)
    fixed = ["--num-replicas", str(args.replicas)]
    runs = [(f"routing {p}", [*fixed, "--routing", p])
            for p in args.routing.split(",") if p != "none"]
    if args.tier:
        small = [*fixed, "--kv-cache-memory", str(args.small_cache)]
        tier = ["--kv-offload-bytes", str(args.tier)]
        runs += [("prefix, small cache", small),
                 ("prefix, small cache + tier (evicted)", [*small, *tier]),
                 ("prefix, small cache + tier (computed)",
                  [*small, *tier, "--kv-offload-mode", "computed"])]
        if args.autoscale:
            runs.append(("autoscaled 1->N, small cache + tier (computed)",
                         ["--kv-cache-memory", str(args.small_cache), *tier,
                          "--kv-offload-mode", "computed", "--min-replicas", "1",
                          "--max-replicas", str(args.replicas), "--target-ongoing-requests",
                          "4", "--upscale-delay-s", "2", "--autoscaling-interval-s", "1"]))
    rows = []
    for label, flags in runs:
        rows.append(run_policy(label, flags, args))
        print(f"  {label}: done in {rows[-1]['wall']:.1f} s", flush=True)
    print("\n| run | prefix hit rate | ideal | vs ideal | busiest / mean prompt tokens "
          "| prompt tokens computed | hits device / tier local / tier remote "
          "| mean TTFT turn 1 (s) | mean TTFT later turns (s) | wall (s) "
          "| prompt tokens per replica |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tiers"]
        print(f"| {r['label']} | {r['hit_rate']:.1%} | {r['ideal']:.1%} | "
              f"{r['vs_ideal']:.2f} | {r['max_over_mean']:.2f} | {r['computed']:.0f} | "
              f"{t['device']:.0f} / {t['local']:.0f} / {t['remote']:.0f} | "
              f"{r['ttft_first']:.2f} | {r['ttft_follow']:.2f} | {r['wall']:.1f} | "
              f"{r['per_replica']} |")


if __name__ == "__main__":
    main()
