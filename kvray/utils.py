"""vLLM's argument helpers, for scripts written against vLLM: :class:`EngineArgs` (every
config key as a keyword or a command-line flag) and :class:`FlexibleArgumentParser` (flags
spelled with ``-`` or ``_``). ``LLM(**vars(parser.parse_args()))`` then works as in vLLM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvray.config import FIELD_SECTION, EngineConfig, load_config


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes ``--max_model_len`` for ``--max-model-len``."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


class EngineArgs:
    """Engine arguments by vLLM's name: keywords that are kvray config keys (plus
    ``config``, a YAML file under them); ``add_cli_args`` adds one flag per key."""

    def __init__(self, model: str | None = None, config: str | None = None,
                 **kwargs: Any) -> None:
        self.config = config
        self.kwargs = {"model": model, **kwargs}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``--config`` and a flag per config key (unset flags keep the file's values)."""
        from kvray.cli.flags import add_config_flags

        add_config_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine's keys of parsed flags (a script's own flags are left out)."""
        given = vars(args)
        return cls(config=given.get("config"),
                   **{k: v for k, v in given.items() if k in FIELD_SECTION})

    def create_engine_config(self) -> EngineConfig:
        """The validated config (keys left None keep the file's or the default value)."""
        return load_config(self.config, **self.kwargs)


AsyncEngineArgs = EngineArgs
