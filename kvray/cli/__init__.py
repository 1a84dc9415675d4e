"""``kvray`` command line: ``setup``, ``generate``, ``run-batch``, ``serve``, ``bench``,
``cluster``, ``grafana``.

Every config key is also a flag (``block_size`` -> ``--block-size``); a flag overrides the
value from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvray.cli.flags import (
    _non_negative_float,
    _positive_int,
    add_config_flags,
    add_serve_arguments,
    config_from_args,
)
from kvray.cli.generate import cmd_generate, cmd_setup, show_kvray_info_on_stderr
from kvray.cli.run_batch import add_run_batch_parser
from kvray.cli.serve_command import SERVE_ENV, cmd_serve, resolve_api_key
from kvray.cli.serve_lifecycle import proxy_location
from kvray.config import ConfigError

__all__ = ["SERVE_ENV", "build_parser", "config_from_args", "main", "proxy_location",
           "resolve_api_key", "show_kvray_info_on_stderr"]


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("--prompt", required=True, help="prompt text (the user turn with --chat)")
    gen.add_argument("--max-tokens", type=_positive_int, default=64,
                     help="most new tokens (default 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="0 = greedy (default)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--seed-sampling", type=int, default=None, metavar="N",
                     help="per-request sampling seed (reproducible output with temperature)")
    add_config_flags(gen)
    gen.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvray`` parser; each subcommand's ``func`` runs it."""
    parser = argparse.ArgumentParser(
        prog="kvray", description="LLM inference and serving engine on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    setup = sub.add_parser("setup", help="download the built-in SmolLM2 model (its GGUF)")
    setup.add_argument("--force", action="store_true", help="redo even if already set up")
    setup.add_argument("--dense-weights", action="store_true",
                       help="also write its weights dequantized to bf16 as a Hugging Face "
                       "directory (for transformers; kvray runs the GGUF as shipped)")
    setup.set_defaults(func=cmd_setup)
    _add_generate_parser(sub)
    add_run_batch_parser(sub)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    add_serve_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    from kvray.bench.cli import add_bench_parser
    from kvray.ops.cluster import add_cluster_parser
    from kvray.ops.grafana import add_grafana_parser

    add_cluster_parser(sub)
    add_grafana_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvray`` with ``argv``; the exit code (2: a bad command line or config)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"kvray {args.command}: error: {err}", file=sys.stderr)
        return 2
