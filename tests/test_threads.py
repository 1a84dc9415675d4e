"""Importing kvray makes PyTorch's OpenMP threads wait passively (unless the user chose),
so a busy neighbour process cannot stall every barrier of a decode step."""

from __future__ import annotations

import os
import subprocess
import sys


def _policy_after_import(env: dict[str, str]) -> str:
    code = "import os, kvray, torch; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_kvray_sets_passive_omp_waiting_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_after_import(env) == "PASSIVE"


def test_an_explicit_omp_wait_policy_is_kept():
    assert _policy_after_import({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
