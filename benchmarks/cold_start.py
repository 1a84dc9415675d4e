"""Cold start of a replica: its engine's start-up by part (workers and weights, CPU kernels,
KV cache), with the model's files read from this node's disk vs taken from the Ray object
store (``share_weights``: what a node without the files does), on the built-in model.

On one machine both reads hit the same memory, so this measures what the object-store path
costs on top of a local read (the upload once per cluster, the fetch per node); across
nodes it replaces each node's own download or network-volume read.

    python benchmarks/cold_start.py [--model PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def start(model: str, dtype: str) -> dict:
    from kvray import LLM

    llm = LLM(model, dtype=dtype, kv_cache_memory=256 << 20)
    report = llm.llm_engine.startup
    llm.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from benchmarks.common import benchmark_dtype
    from kvray.actors import weights_store
    from kvray.models.default_model import resolve_model_path

    dtype = benchmark_dtype("auto", args.model)
    model = str(resolve_model_path(args.model))
    size = sum(p.stat().st_size for p in weights_store._files(Path(model)))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        t = time.perf_counter()
        weights_store.share(model)
        upload = time.perf_counter() - t
        reads, fetches, local = [], [], None
        for _ in range(args.repeats):
            t = time.perf_counter()
            for f in weights_store._files(Path(model)):
                f.read_bytes()
            reads.append(time.perf_counter() - t)
            target = Path(tempfile.mkdtemp()) / Path(model).name
            t = time.perf_counter()
            weights_store._fetch(ray, model, target, Path(model).suffix == ".gguf")
            fetches.append(time.perf_counter() - t)
            local = str(target)
        disk = [start(model, dtype) for _ in range(args.repeats)]
        store = [start(local, dtype) for _ in range(args.repeats)]
    finally:
        ray.shutdown()
    mib = size / 2**20
    print(f"\nmodel files: {mib:.0f} MiB; upload to the object store once: {upload:.2f} s")
    print("\n| source | read the files (s) | MiB/s | engine start-up (s) | workers and "
          "weights (s) | CPU kernels (s) | KV cache (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, times, reports in (("this node's disk", reads, disk),
                                 ("object store", fetches, store)):
        med = statistics.median(times)
        rank = [r["ranks"][0] for r in reports]
        print(f"| {name} | {med:.3f} | {mib / med:.0f} | "
              f"{statistics.median(r['total_s'] for r in reports):.2f} | "
              f"{statistics.median(r['workers_s'] for r in reports):.2f} | "
              f"{statistics.median(k['kernels']['seconds'] for k in rank):.2f} | "
              f"{statistics.median(r['kv_cache_s'] for r in reports):.2f} |")


if __name__ == "__main__":
    main()
