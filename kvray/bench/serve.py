"""``kvray bench serve``: one benchmark run against a running OpenAI-compatible server.

Ask the server for its model (unless ``--model`` names it), build the workload with a
local tokenizer, send it (warm-up requests first, uncounted), print vLLM's ``Serving
Benchmark Result`` block and, with ``--save-result``, write the result JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from kvray.bench.client import Endpoint, RequestOutput
from kvray.bench.datasets import (
    SampleRequest,
    load_tokenizer_for_bench,
    sample_random,
    sample_sharegpt,
)
from kvray.bench.load import run_load
from kvray.bench.metrics import compute_metrics
from kvray.bench.report import build_result, format_summary, result_filename

PROBE_TIMEOUT_S = 30
MAX_ERRORS_SHOWN = 10


class BenchError(RuntimeError):
    """The benchmark cannot run against this server; the message says why in one line."""


def base_url(args: argparse.Namespace) -> str:
    """The server's root URL: ``--base-url`` (a trailing ``/v1`` dropped, as OpenAI clients
    take it with one), else ``http://HOST:PORT``."""
    if args.base_url is None:
        return f"http://{args.host}:{args.port}"
    url = args.base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def server_model(base: str, api_key: str | None, model: str | None) -> str:
    """``model``, or the first model the server lists; a :class:`BenchError` when the
    server cannot be reached (or, asked for its models, names none)."""
    import aiohttp

    url = f"{base}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url, headers=headers) as resp:
            if model is not None:
                return model  # reachable; whether it lists models does not matter
            if resp.status == 401:
                raise BenchError(f"{url} answered 401 Unauthorized: pass --api-key or set "
                                 "OPENAI_API_KEY")
            if resp.status != 200:
                raise BenchError(f"{url} answered HTTP {resp.status}; name the model with "
                                 "--model")
            data = (await resp.json(content_type=None)).get("data") or []
    except aiohttp.InvalidURL:
        raise ValueError(f"--base-url {base}: not a URL") from None
    except (aiohttp.ClientError, TimeoutError, OSError) as err:
        raise BenchError(f"cannot reach the server at {base}: "
                         f"{str(err) or type(err).__name__}") from None
    except (json.JSONDecodeError, AttributeError):
        raise BenchError(f"{url} did not answer a JSON model list; name the model with "
                         "--model") from None
    if not data or "id" not in data[0]:
        raise BenchError(f"{url} lists no model; name one with --model")
    return data[0]["id"]


def build_workload(args: argparse.Namespace, tokenizer: Any, count: int) -> list[SampleRequest]:
    """``count`` requests of the dataset the flags name."""
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(tokenizer, args.dataset_path, count, args.seed,
                               args.sharegpt_output_len)
    return sample_random(tokenizer, count, args.random_input_len, args.random_output_len,
                         args.random_range_ratio, args.random_prefix_len, args.seed)


def make_endpoint(args: argparse.Namespace, base: str, model: str,
                  api_key: str | None) -> Endpoint:
    """Where requests go and the sampling fields each carries. Random prompts always
    ignore EOS, as in vLLM: their outputs run to the length asked for."""
    extra: dict[str, Any] = {}
    if args.ignore_eos or args.dataset_name == "random":
        extra["ignore_eos"] = True
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    return Endpoint(f"{base}{args.endpoint}", args.backend, model, api_key, extra)


def _progress(total: int, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=disabled, file=sys.stderr)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    base = base_url(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    model = await server_model(base, api_key, args.model)
    tokenizer, tokenizer_id = load_tokenizer_for_bench(args.tokenizer)
    requests = build_workload(args, tokenizer, args.num_prompts + args.num_warmups)
    warmups, requests = requests[args.num_prompts:], requests[: args.num_prompts]
    endpoint = make_endpoint(args, base, model, api_key)
    print(f"Model: {model} at {endpoint.url} ({args.backend})")
    if warmups:
        print(f"Warming up with {len(warmups)} requests...")
        await run_load(endpoint, warmups, math.inf, max_concurrency=args.max_concurrency)
    shape = "Poisson process" if args.burstiness == 1 else "gamma distribution"
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} "
          f"({shape})\nMaximum request concurrency: {args.max_concurrency}", flush=True)
    bar = _progress(len(requests), args.disable_tqdm)
    with bar:
        outputs, duration = await run_load(endpoint, requests, args.request_rate,
                                           args.burstiness, args.max_concurrency, args.seed,
                                           on_done=bar.update)
    slos = dict(args.goodput) if args.goodput else None
    metrics = compute_metrics(outputs, duration, args.metric_percentiles, slos, tokenizer)
    report_failures(outputs)
    print(format_summary(metrics, args.percentile_metrics, args.request_rate,
                         args.max_concurrency))
    header = _header(args, model, tokenizer_id)
    return build_result(header, metrics, outputs, args.percentile_metrics)


def report_failures(outputs: list[RequestOutput]) -> None:
    """Print how many requests failed and their first distinct errors, with counts."""
    errors = Counter((o.error.splitlines() or ["(no message)"])[0]
                     for o in outputs if not o.success)
    if errors:
        print(f"{errors.total()} of {len(outputs)} requests failed; the first errors:")
        for error, count in list(errors.items())[:MAX_ERRORS_SHOWN]:
            print(f"  {count} x {error}")


def _number(value: float) -> float | str:
    """JSON has no infinity: vLLM writes it as the string ``"inf"``."""
    return "inf" if math.isinf(value) else value


def _header(args: argparse.Namespace, model: str, tokenizer_id: str) -> dict[str, Any]:
    header: dict[str, Any] = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                              "backend": args.backend, "model_id": model,
                              "tokenizer_id": tokenizer_id, "num_prompts": args.num_prompts}
    header.update(dict(args.metadata or []))
    header.update({"request_rate": _number(args.request_rate),
                   "burstiness": _number(args.burstiness),
                   "max_concurrency": args.max_concurrency})
    return header


def save_result(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """Write ``result`` where ``--result-dir`` / ``--result-filename`` say."""
    name = args.result_filename or result_filename(
        args.backend, args.request_rate, args.max_concurrency, result["model_id"],
        result["date"])
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result), encoding="utf-8")
    return path


def run_serve_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``kvray bench serve`` with parsed ``args``; its result (as saved)."""
    result = asyncio.run(_run(args))
    if args.save_result:
        print(f"Result saved to {save_result(args, result)}")
    return result
