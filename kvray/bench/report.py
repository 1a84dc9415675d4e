"""The printed ``Serving Benchmark Result`` block and the result JSON, with the layout and
key names of ``vllm bench serve`` so that tooling written for its files reads ours."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvray.bench.client import RequestOutput
from kvray.bench.metrics import BenchmarkMetrics

WIDTH = 50
TITLES = {"ttft": ("TTFT", "Time to First Token"),
          "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"),
          "e2el": ("E2EL", "End-to-end Latency")}


def percentile_label(p: float) -> str:
    """``99`` for 99.0, ``99.9`` for 99.9: the ``p{N}`` of the result keys."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text}"


def format_summary(metrics: BenchmarkMetrics, percentile_metrics: Sequence[str],
                   request_rate: float, max_concurrency: int | None) -> str:
    """The result block printed at the end of a run."""
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}",
             _row("Successful requests:", metrics.completed),
             _row("Failed requests:", metrics.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [_row("Benchmark duration (s):", metrics.duration),
              _row("Total input tokens:", metrics.total_input),
              _row("Total generated tokens:", metrics.total_output),
              _row("Request throughput (req/s):", metrics.request_throughput)]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines += [_row("Output token throughput (tok/s):", metrics.output_throughput),
              _row("Total token throughput (tok/s):", metrics.total_token_throughput)]
    for name in percentile_metrics:
        short, title = TITLES[name]
        stats = metrics.stats[name]
        lines += [f"{title:-^{WIDTH}}", _row(f"Mean {short} (ms):", stats.mean),
                  _row(f"Median {short} (ms):", stats.median)]
        lines += [_row(f"P{percentile_label(p)} {short} (ms):", value)
                  for p, value in stats.percentiles.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def build_result(header: dict[str, Any], metrics: BenchmarkMetrics,
                 outputs: list[RequestOutput],
                 percentile_metrics: Sequence[str]) -> dict[str, Any]:
    """The result JSON: ``header`` (date, backend, model, load settings, metadata) first,
    then the totals, the per-request lists and each selected metric's statistics."""
    result = {
        **header,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": metrics.input_lens,
        "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for name in percentile_metrics:
        stats = metrics.stats[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            result[f"p{percentile_label(p)}_{name}_ms"] = value
    return result


def result_filename(backend: str, request_rate: float, max_concurrency: int | None,
                    model_id: str, date: str) -> str:
    """vLLM's default name: ``{backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    model = model_id.rstrip("/").split("/")[-1]
    return f"{backend}-{request_rate}qps{concurrency}-{model}-{date}.json"
