"""What the benchmark scripts share: the header that says what ran on which machine."""

from __future__ import annotations

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
