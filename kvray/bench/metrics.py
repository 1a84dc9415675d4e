"""Latency and throughput of a benchmark run, as ``vllm bench serve`` defines them.

- TTFT: request sent to its first text chunk. ITL: between consecutive text chunks.
- TPOT: per output token after the first, ``(latency - ttft) / (output_tokens - 1)``; a
  request of one token has none (and counts as 0 against a TPOT SLO).
- E2EL: request sent to its stream's end.
- Throughputs divide completed requests / tokens by the run's wall time; request goodput
  counts only the completed requests that meet every SLO given (DistServe's goodput).

Latencies are reported in milliseconds: mean, median, population standard deviation and
percentiles interpolated linearly between the two nearest ranks (numpy's default).
Failed requests count in ``failed`` and nowhere else.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.bench.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between ranks; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LatencyStats:
    """One latency metric over a run, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile (0..100) -> value


def latency_stats(seconds: list[float], percentiles: Sequence[float]) -> LatencyStats:
    """:class:`LatencyStats` of ``seconds``; all zero when there are none (as vLLM)."""
    ms = [s * 1000 for s in seconds]
    if not ms:
        return LatencyStats(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    return LatencyStats(statistics.fmean(ms), statistics.median(ms), statistics.pstdev(ms),
                        {p: percentile(ms, p) for p in percentiles})


def output_token_count(output: RequestOutput, tokenizer: Any | None) -> int:
    """Tokens a request generated: the server's usage; else its text re-tokenized; else,
    without a tokenizer, its text chunks (one token each on most servers)."""
    if output.output_tokens:
        return output.output_tokens
    if tokenizer is not None and output.generated_text:
        return len(tokenizer.encode(output.generated_text, add_special_tokens=False))
    return output.num_chunks


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Seconds per output token after the first; None for fewer than two tokens."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None


def meets_slos(ttft: float, tpot_s: float | None, e2el: float,
               slos_ms: dict[str, float]) -> bool:
    """Whether a request meets every SLO in ``slos_ms`` (metric -> milliseconds)."""
    seen = {"ttft": ttft, "tpot": tpot_s or 0.0, "e2el": e2el}
    return all(seen[name] * 1000 <= limit for name, limit in slos_ms.items())


@dataclass
class BenchmarkMetrics:
    """What a run measured; the ``*_lens`` lists hold one entry per request sent."""

    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    output_throughput: float
    total_token_throughput: float
    input_lens: list[int]
    output_lens: list[int]  # 0 for a failed request
    stats: dict[str, LatencyStats] = field(default_factory=dict)  # METRICS -> stats


def compute_metrics(outputs: list[RequestOutput], duration: float,
                    percentiles: Sequence[float] = (99.0,), slos_ms: dict[str, float] | None = None,
                    tokenizer: Any | None = None) -> BenchmarkMetrics:
    """Fold a run's ``outputs`` (``duration`` seconds of wall time) into its metrics."""
    ok = [o for o in outputs if o.success]
    counts = {id(o): output_token_count(o, tokenizer) for o in ok}
    per_token = [tpot(o.latency, o.ttft, counts[id(o)]) for o in ok]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(counts.values())
    goodput = None
    if slos_ms:
        good = sum(meets_slos(o.ttft, t, o.latency, slos_ms)
                   for o, t in zip(ok, per_token, strict=True))
        goodput = good / duration
    series = {"ttft": [o.ttft for o in ok], "tpot": [t for t in per_token if t is not None],
              "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok]}
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), duration=duration,
        total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / duration, request_goodput=goodput,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        input_lens=[o.prompt_len for o in outputs],
        output_lens=[counts.get(id(o), 0) for o in outputs],
        stats={name: latency_stats(values, list(percentiles))
               for name, values in series.items()})
