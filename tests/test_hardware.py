"""dtype ``auto``: the policy per CPU/GPU, /proc/cpuinfo parsing, and the one log line."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from kvray import hardware
from kvray.cli import main
from kvray.hardware import CpuInfo, choose_dtype, parse_cpuinfo
from kvray.models.loader import load_model

pytestmark = pytest.mark.unit

SAPPHIRE_RAPIDS = ("fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8")
AVX2_ONLY = ("fpu sse2 avx avx2 fma f16c")


def _cpu(flags: str, ckpt: str | None = "bfloat16") -> tuple[str, str]:
    return choose_dtype("auto", "cpu", ckpt, flags.split(), False, cpu_model="Test CPU")


def test_amx_cpu_runs_bf16():
    dtype, reason = _cpu(SAPPHIRE_RAPIDS)
    assert dtype == "bfloat16"
    assert "amx_bf16" in reason


def test_avx512_bf16_without_amx_runs_bf16():
    assert _cpu("avx2 fma avx512f avx512_bf16")[0] == "bfloat16"


def test_avx2_only_cpu_runs_float32_and_says_why():
    dtype, reason = _cpu(AVX2_ONLY)
    assert dtype == "float32"
    assert reason == "CPU 'Test CPU' has no native bf16: no amx_bf16/avx512_bf16"


def test_avx2_only_cpu_runs_float32_whatever_the_checkpoint_says():
    assert _cpu(AVX2_ONLY, "float16")[0] == "float32"
    assert _cpu(AVX2_ONLY, None)[0] == "float32"


def test_float32_checkpoint_stays_float32_even_on_amx():
    assert _cpu(SAPPHIRE_RAPIDS, "float32")[0] == "float32"


@pytest.mark.parametrize("ckpt, cuda_bf16, expected", [
    ("bfloat16", True, "bfloat16"),
    ("bfloat16", False, "float16"),
    ("float16", True, "float16"),
    (None, True, "bfloat16"),
    ("int8", False, "float16"),
    ("float32", True, "float32"),
    ("float32", False, "float32"),
])
def test_cuda_runs_the_checkpoint_dtype_with_fp16_when_bf16_is_missing(ckpt, cuda_bf16,
                                                                      expected):
    dtype, reason = choose_dtype("auto", "cuda", ckpt, (), cuda_bf16)
    assert dtype == expected
    assert reason


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "float32"])
def test_explicit_dtype_is_used_as_given(requested):
    assert choose_dtype(requested, "cpu", "float32", (), False) == (requested, "requested")
    assert choose_dtype(requested, "cuda", "bfloat16", (), False)[0] == requested


def test_unknown_dtype_is_rejected_with_the_allowed_names():
    with pytest.raises(ValueError, match="float64"):
        choose_dtype("float64", "cpu", None, (), False)


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse2 avx fma avx2 f16c rdrand
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse2 avx fma avx2 f16c rdrand
"""


def test_cpuinfo_text_gives_model_relevant_flags_and_cores():
    info = parse_cpuinfo(CPUINFO, num_cores=2)
    assert info == CpuInfo("AMD EPYC 7B13", ("avx2", "fma"), 2)
    assert not info.native_bf16


def test_cpuinfo_of_an_amx_cpu_lists_its_bf16_flags_in_order():
    info = parse_cpuinfo(f"model name\t: Xeon\nflags\t\t: {SAPPHIRE_RAPIDS}\n", 8)
    assert info.flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
    assert info.native_bf16


def test_empty_cpuinfo_is_an_unknown_cpu_without_flags():
    assert parse_cpuinfo("", 1) == CpuInfo("unknown CPU", (), 1)


def test_describe_is_one_line_with_model_and_cores():
    line = hardware.describe()
    assert "\n" not in line
    assert f"{hardware.cpu_info().num_cores} cores" in line


def test_generate_without_dtype_logs_the_choice_once(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir("llama_gqa")), "--prompt", "Hello",
               "--max-tokens", "3"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("kvray: dtype auto -> float32 (the checkpoint is float32)") == 1


def test_bf16_checkpoint_on_an_avx2_cpu_loads_in_float32(tiny_model_dir, tmp_path,
                                                       monkeypatch, caplog):
    path = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir("llama_gqa"), path)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(hardware, "cpu_info",
                        lambda: CpuInfo("AMD EPYC", ("avx2", "fma"), 2))
    with caplog.at_level(logging.INFO, logger="kvray"):
        model, _ = load_model(path, "auto")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()] == [
        "kvray: dtype auto -> float32 (CPU 'AMD EPYC' has no native bf16: "
        "no amx_bf16/avx512_bf16)"]


@pytest.mark.parametrize("cpu_max,quota,period,expected", [
    ("200000 100000", None, None, 2),  # cgroup v2, --cpus=2
    ("150000 100000", None, None, 2),  # 1.5 CPUs: round up, never 0 threads
    ("50000 100000", None, None, 1),
    ("max 100000", None, None, None),  # no quota
    (None, "400000", "100000", 4),  # cgroup v1
    (None, "-1", "100000", None),
    (None, None, None, None),  # no cgroup files (not Linux)
    ("garbage", None, None, None),
])
def test_cgroup_cpu_quota_caps_the_cores_used(cpu_max, quota, period, expected):
    assert hardware.cgroup_cpu_limit(cpu_max, quota, period) == expected


def test_available_cores_never_exceed_the_affinity_mask():
    import os

    assert 1 <= hardware.available_cores() <= len(os.sched_getaffinity(0))
