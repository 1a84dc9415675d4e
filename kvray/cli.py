"""``kvray`` command line: ``setup`` and ``generate``.

Every config key is also a flag (``block_size`` -> ``--block-size``); a flag overrides the
value from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, get_args

from kvray.config import FIELD_SECTION, SECTIONS, ConfigError, EngineConfig, load_config


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per config key (validated later, by pydantic)."""
    parser.add_argument("--config", metavar="FILE", help="flat YAML config file (see configs/)")
    group = parser.add_argument_group("config overrides (each overrides --config)")
    for section_cls in SECTIONS.values():
        for key, field in section_cls.model_fields.items():
            kwargs: dict[str, Any] = {"dest": key, "default": None, "help": field.description}
            if field.annotation is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                choices = [a for a in get_args(field.annotation) if isinstance(a, str)]
                kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else key.upper()
            group.add_argument(_flag(key), **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {key: getattr(args, key, None) for key in FIELD_SECTION}
    return load_config(args.config, **overrides)


def _cmd_setup(args: argparse.Namespace) -> int:
    from kvray.default_model import setup_default_model

    setup_default_model(force=args.force)
    return 0


class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` at each record (tests and Ray replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging must never break generation
            self.handleError(record)


def show_kvray_info_on_stderr() -> None:
    """Print kvray's INFO lines (e.g. the dtype ``auto`` chose, and why) on stderr; idempotent."""
    logger = logging.getLogger("kvray")
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvray.engine.llm import LLM
    from kvray.sampling_params import SamplingParams

    show_kvray_info_on_stderr()
    config = config_from_args(args)
    llm = LLM(**{k: v for k, v in config.to_flat().items() if v is not None})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed_sampling)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def served_model_name(config: EngineConfig, model_path) -> str:
    """``served_model_name``, else the model directory's (or GGUF file's) name."""
    from pathlib import Path

    if config.model.served_model_name:
        return config.model.served_model_name
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else path.name


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import time

    # Ray reads this at import; with 127.0.0.1 as node address every listener is loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray import serve

    from kvray.actors.ray_executor import ensure_ray
    from kvray.default_model import resolve_model_path
    from kvray.serve.deployment import build_app

    if args.model_positional is not None:
        args.model = args.model_positional
    config = config_from_args(args)
    model_path = resolve_model_path(config.model.model)
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    name = served_model_name(config, model_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    world = config.parallel.world_size
    ensure_ray(args.address, num_cpus=max(8, args.num_replicas * (world + 1) + 2),
               log_to_driver=True)
    flat = {k: v for k, v in config.to_flat().items() if v is not None}
    flat["model"] = str(model_path)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(flat, str(model_path), name, args.api_key, args.num_replicas,
                        args.max_waiting), name="kvray", route_prefix="/")
    print(f"kvray: serving {name} on http://{args.host}:{args.port}/v1 "
          f"({args.num_replicas} replica(s)); Ctrl-C stops", flush=True)
    try:
        _log_throughput(name, time)
    except KeyboardInterrupt:
        print("kvray: shutting down", flush=True)
    finally:
        serve.shutdown()
    return 0


def _log_throughput(name: str, time_mod, period: float = 10.0) -> None:
    """Every ``period`` seconds, one line with generation throughput over all replicas."""
    import ray

    from kvray.serve.deployment import STATS_NAMESPACE

    last = None
    while True:
        time_mod.sleep(period)
        try:
            board = ray.get_actor("kvray-stats-kvray", namespace=STATS_NAMESPACE)
            snap = ray.get(board.snapshot.remote(), timeout=5)
        except Exception as err:  # a missing stats line must not stop the server
            print(f"kvray: stats unavailable ({err.__class__.__name__})", flush=True)
            continue
        total = sum(s.get("generation_tokens_total", 0) for _, s in snap)
        running = sum(s.get("num_running", 0) for _, s in snap)
        waiting = sum(s.get("num_waiting", 0) for _, s in snap)
        if last is not None:
            print(f"kvray: {name}: {(total - last) / period:.1f} generated tok/s, "
                  f"{running} running, {waiting} waiting", flush=True)
        last = total


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvray", description="LLM inference and serving engine on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    setup = sub.add_parser("setup", help="download and convert the built-in SmolLM2 model")
    setup.add_argument("--force", action="store_true", help="redo even if already set up")
    setup.set_defaults(func=_cmd_setup)

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
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    srv.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                     help="model directory or .gguf file (default: the built-in SmolLM2)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=_positive_int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--num-replicas", type=_positive_int, default=1,
                     help="model replicas (data parallelism)")
    srv.add_argument("--address", default=None,
                     help="Ray cluster address, e.g. 'auto' for the cluster `ray start` runs "
                          "here (default: RAY_ADDRESS, else a new private cluster on "
                          "127.0.0.1)")
    srv.add_argument("--max-waiting", type=_positive_int, default=512,
                     help="waiting requests beyond which new ones get 503 (default 512)")
    add_config_flags(srv)
    srv.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"kvray {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
