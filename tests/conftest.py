"""Shared fixtures: tiny random models on disk (built once per session)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

# Ray reads this once, when it is first imported: set before any test module imports ray
# (collection imports them all first), so that every cluster a test starts listens on
# loopback only (tests/test_distributed.py checks it).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest
import torch
import transformers

# Triton's kernels run on CPU tensors in its interpreter, which Triton reads when it is
# first imported: set it for the whole run where there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import ARCHS, make_tiny_model  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return a function arch -> path of a saved tiny model of that architecture."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, root / arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def all_archs():
    return list(ARCHS)


def skip_or_fail_in_ci(reason: str, ci_fix: str) -> NoReturn:
    """Skip a test whose prerequisite is missing here; in CI (``$CI`` set) fail instead, so a
    broken CI setup cannot pass by skipping the tests that need it."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} in CI: {ci_fix}")
    pytest.skip(reason)


def builtin_model_or_skip() -> Path:
    from kvray.default_model import default_model_dir, is_default_model_ready

    if not is_default_model_ready():
        skip_or_fail_in_ci("built-in model not set up (run `kvray setup`)",
                           ".ci/run must run `kvray setup`")
    return default_model_dir()


@pytest.fixture(scope="session")
def cpu_kernels():
    """kvray's compiled CPU ops (:mod:`kvray.kernels.cpu_ops`); CI must test the kernels the
    engine uses on CPU, not pass by skipping them."""
    from kvray.kernels import cpu_ops

    if cpu_ops.load_ops() is None:
        skip_or_fail_in_ci("no C++ compiler for the CPU kernels here",
                           "install a C++ compiler (g++) so the CPU kernels build")
    return cpu_ops


def wait_for_health(base: str, timeout_s: float, failed=lambda: None) -> None:
    """Poll ``base``/health until it answers 200; fail the test after ``timeout_s`` or as
    soon as ``failed()`` returns a message (the server process exited, say)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        why = failed()
        if why is None and time.monotonic() > deadline:
            why = f"no healthy answer from {base} within {timeout_s:g} s"
        if why is not None:
            pytest.fail(why)
        time.sleep(1)
