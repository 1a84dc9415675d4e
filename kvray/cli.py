"""``kvray`` command line: ``setup`` and ``generate``.

Every config key is also a flag (``block_size`` -> ``--block-size``); a flag overrides the
value from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, get_args

from kvray.config import _SECTIONS as SECTIONS
from kvray.config import FIELD_SECTION, ConfigError, EngineConfig, load_config


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


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvray.engine.llm import LLM
    from kvray.sampling_params import SamplingParams

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
