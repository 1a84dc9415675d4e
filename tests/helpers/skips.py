"""Skipping a test whose prerequisite is missing here, without letting CI pass by skipping.

Two kinds of skip are expected in CI: no GPU (a ``gpu``-marked test, or one that needs
CUDA) and a CPU/kernel feature this machine lacks (``not on this hardware: ...``).
Every other skip goes through :func:`skip_or_fail_in_ci`, and ``tests/conftest.py`` fails
a CI run that skipped anything else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

NO_GPU = "needs a CUDA GPU"  # the reason (prefix) of a skip CI expects
# The other skip CI expects: a property of the CPU or kernel it runs on (not a missing install).
NOT_THIS_HARDWARE = "not on this hardware"
EXPECTED_SKIPS = (NO_GPU, NOT_THIS_HARDWARE)


def in_ci() -> bool:
    """Whether this run is CI's (``.ci/run`` exports ``CI=1``)."""
    return bool(os.environ.get("CI"))


def skip_or_fail_in_ci(reason: str, ci_fix: str, allow_module_level: bool = False) -> NoReturn:
    """Skip a test (or, at import, its whole module) whose prerequisite is missing here; in
    CI (``$CI`` set) fail instead, so a broken CI setup cannot pass by skipping the tests
    that need it."""
    if in_ci():
        pytest.fail(f"{reason} in CI: {ci_fix}", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def builtin_model_or_skip() -> Path:
    """The built-in model's directory; skip (fail in CI) if `kvray setup` has not run."""
    from kvray.models.default_model import default_model_dir, is_default_model_ready

    if not is_default_model_ready():
        skip_or_fail_in_ci("built-in model not set up (run `kvray setup`)",
                           ".ci/run must run `kvray setup`")
    return default_model_dir()



def triton_or_skip() -> None:
    """At a Triton test module's import: skip it where Triton is not installed (not this
    hardware's stack), or where there is neither a GPU nor its interpreter
    (``TRITON_INTERPRET=1``, which tests/conftest.py sets before Triton's import; failing
    in CI)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip(f"{NOT_THIS_HARDWARE}: Triton is not installed", allow_module_level=True)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        skip_or_fail_in_ci("Triton needs a GPU or TRITON_INTERPRET=1 set before it is imported",
                           "tests/conftest.py sets TRITON_INTERPRET=1 before Triton's import",
                           allow_module_level=True)
