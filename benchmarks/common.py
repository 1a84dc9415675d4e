"""What the benchmark scripts share: the header that says what ran on which machine, and the
memory read bandwidth that read floors divide by."""

from __future__ import annotations

import time

import torch

from kvray.hardware import describe, machine_dtype
from kvray.models.default_model import default_model_dir
from kvray.models.loader import checkpoint_dtype


def benchmark_dtype(requested: str, model_dir: str | None = None) -> str:
    """The dtype :func:`~kvray.hardware.machine_dtype` picks for the checkpoint at
    ``model_dir`` (the built-in model when None) on this CPU; prints the hardware line and
    the dtype with its reason, and returns the dtype."""
    dtype, why = machine_dtype(requested, "cpu",
                               checkpoint_dtype(model_dir or default_model_dir()))
    print(describe())
    print(f"dtype: {dtype} ({why})", flush=True)
    return dtype


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second two reductions over a buffer far larger than the caches reach: the
    better of a plain buffer and one on huge pages (the engine's weights sit on huge pages
    where Linux allows it, so the floor is measured on the same kind of memory)."""
    from kvray.kernels.huge_pages import zeros_on_huge_pages

    best = float("inf")
    for buf in (torch.ones(num_bytes // 4), zeros_on_huge_pages(1, (num_bytes // 4,),
                                                                torch.float32)[0]):
        buf.fill_(1.0)
        buf.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        del buf
    return num_bytes / best
