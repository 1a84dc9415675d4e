"""benchmarks/gpu_bench.py on CPU (``--smoke``): the script a lent GPU runs once, checked
here so that it still runs against today's engine and reports every part it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_reports_the_step_breakdown_of_each_model(tmp_path):
    """Regression: the step breakdown timed ``ModelRunner._sample``, gone when sampling moved
    to ``StepSampler``; every GPU run would have reported an AttributeError in its place."""
    run = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--smoke", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    defaults = [r for r in report["results"] if r["system"] == "kvray default"]
    assert defaults and all(not r["error"] for r in report["results"])
    for r in defaults:
        step = r["details"]["step_ms"]
        assert "error" not in step, step
        assert step["steps"] > 0 and step["sampling"] > 0 and step["forward"] > 0
