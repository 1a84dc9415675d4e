"""Kernel launches per decoder layer of a decode step on the Triton path, fused and unfused,
counted on CPU under Triton's interpreter (:mod:`kvray.testing.kernel_count`): a tiny
random Llama's second layer, 2 sequences of 40 tokens, block tables 3 blocks wide (short
contexts: the one-pass decode) and 64 wide (long ones: split + merge), dense fp32 and FP8
bf16 weights. For FP8, torch._scaled_mm's CPU kernels stand in for a GPU's FP8 tensor cores
(``scaled_mm_possible`` patched), so the path is the GPU's. On a GPU, ``gpu_bench.py``
counts the CUDA kernels of a whole step with the profiler.

Usage: TRITON_INTERPRET=1 python benchmarks/kernels_per_layer.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvray.kernels import triton_quant  # noqa: E402
from kvray.testing.kernel_count import decode_layer_launches, tiny_llama, unfuse  # noqa: E402

CASES = (  # (name, dtype, quantization, block table width)
    ("dense fp32, short context", torch.float32, None, 3),
    ("dense fp32, long context", torch.float32, None, 64),
    ("fp8 bf16, short context", torch.bfloat16, "fp8", 3),
)


def main() -> None:
    triton_quant.scaled_mm_possible = (
        lambda seg, device, dtype: seg.kind == triton_quant.QuantKind.F8)
    print("| case | fused | unfused | fused launches |")
    print("|---|---|---|---|")
    for name, dtype, quantization, width in CASES:
        counts = []
        for fused in (True, False):
            model, plan = tiny_llama(dtype=dtype, quantization=quantization)
            if not fused:
                unfuse(model)
            counts.append(decode_layer_launches(model, plan, 40, table_blocks=width)[0])
        print(f"| {name} | {counts[0].total} | {counts[1].total} | "
              f"{counts[0].describe().split(': ', 1)[1]} |")


if __name__ == "__main__":
    main()
