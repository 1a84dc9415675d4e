"""The CPU kernels at each vector width they have: the build of this CPU (``native``) is what
the rest of the suite tests; on an AVX-512 machine the AVX2 code paths (the only ones an AVX2
CPU runs) are built with KVRAY_CPU_MARCH=haswell and put through the kernel tests too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvray.hardware import parse_cpuinfo
from kvray.kernels import cpu_ops
from tests.helpers.skips import NOT_THIS_HARDWARE

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_cpu_linear.py", "tests/test_cpu_fused.py",
                "tests/test_cpu_decode_layer.py", "tests/test_attention.py",
                "tests/test_cpu_moe.py", "tests/test_sampling.py"]


def _flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(parse_cpuinfo(f.read(), 0).flags)


def test_the_build_runs_the_vector_width_its_instruction_set_gives(cpu_kernels):
    flags, march = _flags(), os.environ.get(cpu_ops.MARCH_ENV, "native")
    if march == "haswell":
        expected = 8
    elif march != "native":
        pytest.skip(f"no expectation for {cpu_ops.MARCH_ENV}={march}")
    else:
        expected = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 1
    assert cpu_kernels.vector_lanes() == expected


@pytest.mark.skipif(os.environ.get(cpu_ops.MARCH_ENV) is not None,
                    reason="already a build for a chosen instruction set")
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_machine(cpu_kernels):
    if "avx512f" not in _flags():
        pytest.skip(f"{NOT_THIS_HARDWARE}: no AVX-512, the native build is the AVX2 one")
    env = {**os.environ, cpu_ops.MARCH_ENV: "haswell"}
    # Not this test itself: it would skip there, which CI=1 counts as a failure.
    itself = "tests/test_cpu_kernel_builds.py::" \
        "test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_machine"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_cpu_kernel_builds.py", *KERNEL_TESTS,
                          "--deselect", itself],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0 and " passed" in run.stdout, \
        run.stdout[-6000:] + run.stderr[-2000:]


def test_a_malformed_march_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_ops.MARCH_ENV, "native -fplugin=x")
    with pytest.raises(ValueError, match="KVRAY_CPU_MARCH"):
        cpu_ops._march()


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(cpu_kernels):
    """torch marks a running build with a ``lock`` file; a build killed midway leaves it and
    torch alone would wait on it forever. kvray's own flock proves no build is running, so
    a fresh process removes the stale file and loads the kernels."""
    stale = cpu_ops.build_directory() / "lock"
    stale.touch()
    code = "from kvray.kernels import cpu_ops; print(cpu_ops.load_ops() is not None)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.strip() == "True", run.stderr[-2000:]
    assert not stale.exists()
