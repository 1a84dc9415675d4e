"""Fixtures shared by the test modules, the test tiers, and CI's rule on skips.

Tiers (markers registered in pyproject.toml, where each is described; every test has
exactly one): ``unit``, ``parity``, ``engine``, ``serve``, ``cluster``, ``multinode``,
``tools`` and ``gpu`` (skipped without CUDA). ``make test-fast`` runs ``unit`` and ``parity``.

In CI (``$CI`` set, as ``.ci/run`` does) a skipped test fails the run, unless it is skipped
for want of a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

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

from tests.helpers.skips import EXPECTED_SKIPS, NO_GPU, in_ci, skip_or_fail_in_ci  # noqa: E402
from tests.helpers.tiny_models import ARCHS, make_tiny_model  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TIERS = ("unit", "parity", "engine", "serve", "cluster", "multinode", "tools", "gpu")


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


@pytest.fixture(scope="module")
def tiny_async_llm(tiny_model_dir):
    """Return a function ``**overrides`` -> an AsyncLLM on the tiny ``llama_gqa`` model (fp32,
    4-token blocks, then the overrides); each engine built is shut down after the module."""
    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM

    engines = []

    def build(**overrides):
        config = {"model": str(tiny_model_dir("llama_gqa")), "dtype": "float32",
                  "block_size": 4, **overrides}
        engines.append(AsyncLLM(config_from_flat(config)))
        return engines[-1]

    yield build
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="session")
def cpu_kernels():
    """kvray's compiled CPU ops (:mod:`kvray.kernels.cpu_ops`); CI must test the kernels the
    engine uses on CPU, not pass by skipping them."""
    from kvray.kernels import cpu_ops

    if cpu_ops.load_ops() is None:
        skip_or_fail_in_ci("no C++ compiler for the CPU kernels here",
                           "install a C++ compiler (g++) so the CPU kernels build")
    return cpu_ops


# ---- tiers -------------------------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check that every test has exactly one tier; skip the ``gpu`` tier without CUDA."""
    wrong = []
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(set(tiers)) != 1:
            wrong.append(f"{item.nodeid}: {sorted(set(tiers)) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(f"every test needs exactly one tier marker of {TIERS} "
                                "(a module's pytestmark, or on the test):\n  "
                                + "\n  ".join(wrong[:30]))
    if not torch.cuda.is_available():
        no_gpu = pytest.mark.skip(reason=f"{NO_GPU} (benchmarks/gpu_check.sh runs these on one)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(no_gpu)


# ---- CI: no unexpected skips -------------------------------------------------------------
def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


class UnexpectedSkips:
    """Collects the skips CI does not expect (anything but no GPU or a CPU feature this
    machine lacks) and fails the run on them: a CI machine missing a tool must not pass by
    skipping the tests that need it."""

    def __init__(self) -> None:
        self.reports: list[pytest.TestReport | pytest.CollectReport] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        if "gpu" not in getattr(report, "keywords", {}) and not any(
                e in _reason(report) for e in EXPECTED_SKIPS):
            self.reports.append(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.reports and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.reports:
            return
        terminalreporter.section("unexpected skips (CI)", red=True)
        for r in self.reports:
            terminalreporter.line(f"{r.nodeid}: {_reason(r)}")
        terminalreporter.line(f"{len(self.reports)} test(s) skipped in CI for a reason other "
                              "than no GPU: install what they need (or mark them gpu).",
                              red=True)


def pytest_configure(config: pytest.Config) -> None:
    if in_ci():
        config.pluginmanager.register(UnexpectedSkips(), "kvray-unexpected-skips")
