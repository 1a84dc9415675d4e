"""Command-line flags shared by ``kvray`` and the tools that read its command lines
(``kvray cluster check`` parses the ``kvray serve`` a cluster config starts), and the
config they make.

Every config key is also a flag (``block_size`` -> ``--block-size``); a flag overrides the
value from ``--config FILE``.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from kvray.config import FIELD_SECTION, SECTIONS, ConfigError, EngineConfig, load_config


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of ``--config FILE`` with every config flag given laid over it."""
    overrides = {key: getattr(args, key, None) for key in FIELD_SECTION}
    for flag, key in (("disable_log_requests", "log_requests"),
                      ("disable_log_stats", "log_stats")):  # vLLM's spellings
        if getattr(args, flag, False) and overrides[key] is None:
            overrides[key] = False
    return load_config(args.config, **overrides)


def resolve_num_replicas(args: argparse.Namespace) -> int:
    """``--num-replicas``, or vLLM's ``--data-parallel-size`` for it (equal when both)."""
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        return args.num_replicas
    if args.num_replicas not in (1, dp):
        raise ConfigError(f"--data-parallel-size {dp} and --num-replicas {args.num_replicas} "
                          "disagree: give one of them")
    return dp


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1-65535, got {value}")
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
            elif key == "lora_modules":  # vLLM's `--lora-modules a=/p/a b=/p/b`
                kwargs["nargs"] = "+"
                kwargs["metavar"] = "NAME=PATH"
            else:
                choices = [a for a in get_args(field.annotation) if isinstance(a, str)]
                kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else key.upper()
            group.add_argument(_flag(key), **kwargs)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``kvray serve``."""
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="model directory or .gguf file (default: the built-in SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (visible in ps: prefer "
                             "KVRAY_API_KEY or --api-key-file)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="read the API key from the first line of FILE")
    parser.add_argument("--num-replicas", type=_positive_int, default=1,
                        help="model replicas (data parallelism)")
    parser.add_argument("--ingress", choices=("serve", "replica", "process"), default="serve",
                        help="serve (default): Ray Serve (HTTP proxy -> OpenAI ingress -> model "
                             "replicas; --num-replicas, autoscaling, KubeRay); replica: Ray "
                             "Serve with the OpenAI app inside the one model replica (one Ray "
                             "hop per token fewer; a killed replica cuts its streams); "
                             "process: the "
                             "OpenAI app and the engine core in this process (uvicorn), Ray "
                             "only for TP x PP workers: one replica, no Ray hop per token "
                             "(the faster choice for one replica on a small host)")
    parser.add_argument("--data-parallel-size", type=_positive_int, default=None,
                        metavar="N", help="vLLM's name for --num-replicas")
    _add_vllm_compat_flags(parser)
    parser.add_argument("--address", default=None,
                        help="Ray cluster address, e.g. 'auto' for the cluster `ray start` runs "
                             "here (default: RAY_ADDRESS, else a new private cluster on "
                             "127.0.0.1)")
    add_config_flags(parser)


def _add_vllm_compat_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM flags that need nothing more here, accepted so a vLLM command line (a Helm
    chart's args) runs unchanged."""
    group = parser.add_argument_group("vLLM flags accepted as they are")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="no effect: kvray runs its own code for the architectures it "
                            "supports, never a checkpoint's")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="no effect: tool_choice 'auto' is always on (calls found by "
                            "--tool-call-parser)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="the same as --no-log-requests")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="the same as --no-log-stats")
