"""``kvray setup`` and ``kvray generate``: the built-in model, and one prompt completed offline."""

from __future__ import annotations

import argparse
import logging
import sys

from kvray.cli.flags import config_from_args


def cmd_setup(args: argparse.Namespace) -> int:
    """Download the built-in model (again with ``--force``; its bf16 weights with
    ``--dense-weights``)."""
    from kvray.models.default_model import setup_default_model

    setup_default_model(force=args.force, dense_weights=args.dense_weights)
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


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete ``--prompt`` with the offline :class:`LLM` and print the text."""
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
