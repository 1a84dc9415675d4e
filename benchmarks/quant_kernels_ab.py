"""Two builds of kvray's CPU kernels against each other in one process: ``linear_q`` on every
linear of a few layers of the built-in model's shapes, calls of the two builds interleaved,
median of 7 rounds, and whether their outputs are bit-identical.

Changes of 5-15 % to a kernel drown in the noise of separate runs on a shared host (single
runs move +-10 %); in one process, alternating, they show. Each build is the extension's
folder under its ``TORCH_EXTENSIONS_DIR`` (``kvray_cpu_ops_<hash>``, made by loading the
kernels from that checkout once), imported by path.

    python benchmarks/quant_kernels_ab.py BUILD_A BUILD_B [--formats Q8_0,int8,Q4_1]
        [--rows 1,16,48,256] [--layers 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from kvray.hardware import describe
from kvray.quant.blob import to_blob

try:
    from quant_kernels import LINEARS, _quantized
except ImportError:  # run from the repository root
    from benchmarks.quant_kernels import LINEARS, _quantized


def load_build(folder: Path) -> ModuleType:
    """The extension module in a build folder, imported by path."""
    so = next(folder.glob("*.so"))
    spec = importlib.util.spec_from_file_location(so.name.split(".")[0], so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_a", type=Path)
    parser.add_argument("build_b", type=Path)
    parser.add_argument("--formats", default="Q8_0,int8,Q4_1")
    parser.add_argument("--rows", default="1,16,48,256")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    a, b = load_build(args.build_a), load_build(args.build_b)
    print(describe())
    gen = torch.Generator().manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    print(f"{'format':6} {'M':>4} {'A ms/layer':>11} {'B ms/layer':>11} {'B speed-up':>10} "
          "identical")
    for fmt in args.formats.split(","):
        blobs = [(to_blob(_quantized(fmt, n, k, gen)), k)
                 for _ in range(args.layers) for _, n, k in LINEARS]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for _, _, k in LINEARS}
            same = all(torch.equal(a.linear_q(xs[k], w, None), b.linear_q(xs[k], w, None))
                       for w, k in blobs[:len(LINEARS)])
            reps = max(1, 200 // m)
            times: dict[int, list[float]] = {0: [], 1: []}
            for _ in range(7):
                for i, build in enumerate((a, b)):
                    t = time.perf_counter()
                    for _ in range(reps):
                        for w, k in blobs:
                            build.linear_q(xs[k], w, None)
                    times[i].append((time.perf_counter() - t) / reps / args.layers * 1e3)
            ta, tb = statistics.median(times[0]), statistics.median(times[1])
            print(f"{fmt:6} {m:>4} {ta:11.3f} {tb:11.3f} {ta / tb:9.2f}x {same}", flush=True)


if __name__ == "__main__":
    main()
