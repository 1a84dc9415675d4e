"""What this machine's CPU can multiply fast, and the dtype ``auto`` picks because of it.

Without AMX or AVX-512 BF16, PyTorch multiplies bf16 on the CPU through software
conversions, tens of times slower than fp32; with them, bf16 is several times faster than
fp32. So ``auto`` cannot be one fixed dtype: it is decided here, from /proc/cpuinfo (or the
GPU's bf16 support). No module-level torch import: the policy is unit-tested without
hardware, and benchmarks describe the machine before loading anything.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

# The flags that decide which dtype a CPU multiplies fast, in the order describe() prints.
RELEVANT_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CpuInfo:
    """The facts of this CPU that matter for speed."""

    model: str  # /proc/cpuinfo "model name"
    flags: tuple[str, ...]  # the RELEVANT_FLAGS present, in RELEVANT_FLAGS order
    num_cores: int  # logical cores this process may run on (its affinity mask)

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in NATIVE_BF16_FLAGS)


def parse_cpuinfo(text: str, num_cores: int) -> CpuInfo:
    """The first processor's model name and relevant flags from /proc/cpuinfo ``text``."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuInfo(model or "unknown CPU", tuple(f for f in RELEVANT_FLAGS if f in flags),
                   num_cores)


def cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo` (an unknown CPU without flags off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text, available_cores())


def cgroup_cpu_limit(cpu_max: str | None, cfs_quota: str | None = None,
                     cfs_period: str | None = None) -> int | None:
    """Whole cores a cgroup CPU quota allows (rounded up), from cgroup v2's ``cpu.max``
    ("200000 100000" or "max 100000") or v1's ``cpu.cfs_quota_us`` / ``cfs_period_us``
    (quota -1: none); None without a quota."""
    quota = period = None
    if cpu_max:
        fields = cpu_max.split()
        if len(fields) == 2 and fields[0] != "max":
            quota, period = fields
    elif cfs_quota and cfs_period and cfs_quota.strip() != "-1":
        quota, period = cfs_quota, cfs_period
    try:
        q, per = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return max(1, -(-q // per)) if q > 0 and per > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def available_cores() -> int:
    """Cores this process may actually use: its affinity mask, capped by a cgroup CPU quota
    (a container's ``--cpus`` / a Kubernetes CPU limit, which os.cpu_count() ignores: as
    many threads as the host has cores would then be throttled)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(_read("/sys/fs/cgroup/cpu.max"),
                             _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                             _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    return min(cores, limit) if limit else cores


def describe() -> str:
    """One line for benchmark headers: CPU model, relevant flags, usable cores."""
    info = cpu_info()
    bf16 = "native bf16" if info.native_bf16 else "no native bf16"
    flags = " ".join(info.flags) or "none"
    return f"CPU: {info.model}; flags: {flags} ({bf16}); {info.num_cores} cores"


def choose_dtype(requested: str, device_type: str, checkpoint_dtype: str | None,
                 cpu_flags: Collection[str], cuda_bf16: bool, cpu_model: str = "this CPU",
                 ) -> tuple[str, str]:
    """The dtype to run and why; a dtype other than ``auto`` is returned as requested.

    ``auto``: a float32 checkpoint stays float32 (going lower is the user's call). On CUDA,
    the checkpoint's dtype (bf16 when it names none usable), bf16 -> float16 on a GPU
    without bf16. On CPU, bf16 where the CPU multiplies it natively (AMX or AVX-512 BF16),
    else float32. Other devices get the checkpoint's dtype, else bf16.
    """
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPE_NAMES}, got {requested!r}")
        return requested, "requested"
    ckpt = checkpoint_dtype if checkpoint_dtype in DTYPE_NAMES else None
    if ckpt == "float32":
        return "float32", "the checkpoint is float32"
    if device_type == "cpu":
        native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags]
        if native:
            return "bfloat16", f"CPU '{cpu_model}' multiplies bf16 natively: {'/'.join(native)}"
        return "float32", (f"CPU '{cpu_model}' has no native bf16: no "
                           f"{'/'.join(NATIVE_BF16_FLAGS)}")
    source = f"the checkpoint is {ckpt}" if ckpt else "the checkpoint names no usable dtype"
    if device_type == "cuda" and (ckpt or "bfloat16") == "bfloat16" and not cuda_bf16:
        return "float16", f"{source}, but this GPU has no native bf16"
    return ckpt or "bfloat16", f"{source}, on {device_type}"


def machine_dtype(requested: str, device_type: str, checkpoint_dtype: str | None,
                  ) -> tuple[str, str]:
    """:func:`choose_dtype` with this machine's facts (the GPU is asked only for CUDA)."""
    if requested != "auto":
        return choose_dtype(requested, device_type, checkpoint_dtype, (), False)
    cuda_bf16 = False
    if device_type == "cuda":
        import torch

        cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    info = cpu_info()
    return choose_dtype(requested, device_type, checkpoint_dtype, info.flags, cuda_bf16,
                        cpu_model=info.model)
