"""``kvray bench serve``'s command line: ``vllm bench serve``'s flags, checked by argparse
(a bad value exits 2 naming its flag). Importing this module loads nothing heavy; the run
itself (:mod:`kvray.bench.serve`) is imported when the command runs."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from kvray.bench.client import BACKENDS
from kvray.bench.metrics import METRICS, SLO_METRICS
from kvray.cli.flags import _positive_int


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("not a number: nan")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _range_ratio(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(METRICS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated names among {', '.join(METRICS)}")
    return list(dict.fromkeys(names))


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers in (0, 100]")
    return values


def _slo(text: str) -> tuple[str, float]:
    name, sep, limit = text.partition(":")
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: KEY:MILLISECONDS with KEY one of {', '.join(SLO_METRICS)}")
    return name, _non_negative_float(limit)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE")
    return key.strip(), value.strip()


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` (``serve``) to kvray's subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark a running server")
    actions = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    serve = actions.add_parser(
        "serve", help="online serving benchmark of any OpenAI-compatible server",
        description="Send a workload of streaming requests to an OpenAI-compatible server "
        "(kvray, vLLM, llama.cpp's llama-server...) at a request rate and concurrency, and "
        "report TTFT, TPOT, ITL, end-to-end latency and throughput, with the flags and "
        "result JSON of `vllm bench serve`.")
    _add_server_flags(serve)
    _add_workload_flags(serve)
    _add_load_flags(serve)
    _add_report_flags(serve)
    serve.set_defaults(func=_cmd_serve, bench_parser=serve)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, metavar="URL",
                   help="server URL, e.g. http://127.0.0.1:8000 (default: from --host, --port)")
    g.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="server host (default 127.0.0.1)")
    g.add_argument("--port", type=_positive_int, default=8000, metavar="PORT",
                   help="server port (default 8000)")
    g.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                   help="request format: openai (/v1/completions) or openai-chat "
                   "(/v1/chat/completions); default: from --endpoint, else openai")
    g.add_argument("--endpoint", default=None, metavar="PATH",
                   help="API path (default: the backend's, /v1/completions for openai)")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="model name to request (default: the first of the server's /v1/models)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY, if set)")


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local Hugging Face tokenizer directory or .gguf file that sizes "
                   "prompts and counts tokens the server does not report (default: the "
                   "built-in model's); nothing is downloaded")
    g.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random",
                   help="random token prompts (default) or ShareGPT conversations")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="ShareGPT-format JSON file (with --dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=_positive_int, default=1000, metavar="N",
                   help="requests to send (default 1000)")
    g.add_argument("--random-input-len", type=_positive_int, default=1024, metavar="N",
                   help="mean prompt tokens of random prompts (default 1024)")
    g.add_argument("--random-output-len", type=_positive_int, default=128, metavar="N",
                   help="mean output tokens of random prompts (default 128)")
    g.add_argument("--random-range-ratio", type=_range_ratio, default=0.0, metavar="R",
                   help="lengths drawn uniformly in mean*(1-r)..mean*(1+r), r in [0, 1) "
                   "(default 0: fixed lengths)")
    g.add_argument("--random-prefix-len", type=_non_negative_int, default=0, metavar="N",
                   help="random tokens shared by every prompt, before its own (default 0)")
    g.add_argument("--sharegpt-output-len", type=_positive_int, default=None, metavar="N",
                   help="output tokens of every ShareGPT request (default: its reply's)")
    g.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the workload and arrivals (default 0)")


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf, metavar="RPS",
                   help="requests per second (default inf: all at once); Poisson arrivals, "
                   "or gamma ones with --burstiness")
    g.add_argument("--burstiness", type=_positive_float, default=1.0, metavar="B",
                   help="shape of the gamma-distributed gaps between arrivals: 1 Poisson "
                   "(default), below 1 burstier, above 1 more even")
    g.add_argument("--max-concurrency", type=_positive_int, default=None, metavar="N",
                   help="most requests in flight at once (default: no limit)")
    g.add_argument("--num-warmups", type=_non_negative_int, default=0, metavar="N",
                   help="requests sent before the measured run, not counted (default 0)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate the full output length (always on for random prompts)")
    g.add_argument("--temperature", type=_non_negative_float, default=None, metavar="T",
                   help="sampling temperature (default: the server's)")


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--percentile-metrics", type=_metric_names, default=list(METRICS),
                   metavar="NAMES",
                   help="metrics to report, comma-separated among ttft,tpot,itl,e2el "
                   "(default all)")
    g.add_argument("--metric-percentiles", type=_percentiles, default=[99.0], metavar="PS",
                   help="percentiles to report, comma-separated, e.g. 50,90,99 (default 99)")
    g.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in milliseconds, e.g. ttft:500 tpot:50 e2el:5000: request "
                   "goodput counts the completed requests per second that meet them all")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=None, metavar="DIR",
                   help="its directory (default: the current one)")
    g.add_argument("--result-filename", default=None, metavar="NAME",
                   help="its name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    g.add_argument("--metadata", type=_key_value, nargs="*", default=None, metavar="KEY=VALUE",
                   help="extra KEY=VALUE pairs recorded in the result JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def resolve_backend(backend: str | None, endpoint: str | None) -> tuple[str, str]:
    """(backend, endpoint path) from the flags: each defaults from the other; they must
    agree. A ValueError names the flag at fault."""
    if endpoint is None:
        backend = backend or "openai"
        return backend, BACKENDS[backend]
    path = "/" + endpoint.lstrip("/")
    implied = "openai-chat" if path.endswith("chat/completions") else (
        "openai" if path.endswith("completions") else None)
    if implied is None:
        raise ValueError(f"--endpoint {endpoint}: must end in /completions or "
                         "/chat/completions")
    if backend is not None and backend != implied:
        raise ValueError(f"--endpoint {endpoint} does not fit --backend {backend} "
                         f"(which sends to {BACKENDS[backend]})")
    return implied, path


def check_dataset_flags(args: argparse.Namespace) -> None:
    """The dataset flags that only make sense together; a ValueError names the flag."""
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        raise ValueError("--dataset-path: required with --dataset-name sharegpt")
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise ValueError("--dataset-path: only for --dataset-name sharegpt; random prompts "
                         "are generated")


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        args.backend, args.endpoint = resolve_backend(args.backend, args.endpoint)
        check_dataset_flags(args)
    except ValueError as err:
        args.bench_parser.error(str(err))
    from kvray.bench.serve import BenchError, run_serve_benchmark

    try:
        result = run_serve_benchmark(args)
    except (BenchError, ValueError, FileNotFoundError) as err:
        print(f"kvray bench serve: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError | FileNotFoundError) else 1
    except KeyboardInterrupt:
        print("kvray bench serve: interrupted", file=sys.stderr)
        return 130
    return 0 if result["completed"] > 0 else 1
