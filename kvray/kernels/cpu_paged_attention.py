"""CPU fast path for paged decode attention: a small C++ kernel built on first use.

The PyTorch reference (``attention._decode``) must first gather each sequence's blocks into a
contiguous tensor, which on CPU costs more memory traffic than the attention itself. This
kernel reads K/V straight from the paged cache: one pass over K for the scores, one over V
for the output, parallel over (sequence, kv head). Its source, ``csrc/cpu_paged_attention.cpp``,
is compiled with the system C++ compiler through ``torch.utils.cpp_extension`` the first time
it is needed (cached under ``~/.cache/torch_extensions``); if that fails, kvray falls back to
the reference and says so once. Tests check it against the reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE_PATH = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def load_kernel():
    """The compiled extension, or None if it cannot be built here (logged once)."""
    with _lock:
        if "ext" not in _state:
            _state["ext"] = _build()
        return _state["ext"]


def _build():
    try:
        from torch.utils.cpp_extension import load

        return load(name=f"kvray_cpu_paged_attention_{_cpu_tag()}",
                    sources=[str(_SOURCE_PATH)], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # a missing compiler must not stop the engine
        logger.warning("kvray: CPU paged-attention kernel unavailable (%s); using the "
                       "PyTorch reference path", err)
        return None


def _cpu_tag() -> str:
    """Part of the build name: built with -march=native, a binary must not be reused on a CPU
    with other instruction sets, nor after the source changed (the extension cache under
    ~/.cache/torch_extensions is keyed by name)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode() + _SOURCE_PATH.read_bytes()).hexdigest()[:12]


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None
                 ) -> torch.Tensor:
    """q: [B, Hq, D]; kv_cache: [2, Hk, num_blocks, block_size, D] -> [B, Hq, D]."""
    ext = load_kernel()
    assert ext is not None, "call load_kernel() first and check it is available"
    return ext.paged_decode(q.contiguous(), kv_cache, block_tables.contiguous(),
                            seq_lens.contiguous(), float(scale), sliding_window or -1)
