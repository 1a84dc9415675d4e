#!/usr/bin/env bash
# One prepared check for a briefly lent GPU machine (budget ~10 min in all):
#   0. install the wheels in .whl/ (from benchmarks/gpu_wheels.sh) if the Python here
#      lacks them, and put the repo root on PYTHONPATH (kvray is not pip-installed);
#   1. print the environment (GPU, CPU, Python and library versions) and check that
#      kvray's offline path imports without ray, gguf and fastapi;
#   2. the GPU tests: pytest tests/test_triton_quant.py, test_gpu.py, test_triton_kernels.py,
#      test_triton_ops.py, test_triton_fused.py, test_triton_moe.py, test_cuda_graphs.py
#      (those that exist; KVRAY_GPU_CHECK_TESTS overrides the list), under `timeout`;
#   3. the quantization benchmark, benchmarks/gpu_quant_bench.py: bf16 / fp8 / int4 (AWQ and
#      GPTQ's layout) weights on a 1.1B and an 8B Llama shape, the whole decode step at
#      batch 1 and 64 (TPOT, tokens/s, % of the roofline of the bytes it reads, the step's
#      parts, kernels per layer by the profiler), and bf16 / int8 / fp8 KV caches, under
#      `timeout`; it writes gpu_quant_bench.md / gpu_quant_bench.json;
#   4. the benchmark, benchmarks/gpu_bench.py (kvray vs transformers, roofline), under
#      `timeout`; it writes gpu_bench.md / gpu_bench.json.
# The default timeouts on a GPU (150 + 270 + 150 s) keep the whole check under 10 minutes.
# A full (GPU) run unsets TRITON_INTERPRET: an exported one would time the interpreter.
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
# Logs and results go to $OUT (default /tmp/kvray-gpu-check): env.log, pytest.log, bench.log,
# gpu_bench.md, gpu_bench.json, quant.log, gpu_quant_bench.md, gpu_quant_bench.json,
# summary.txt.
#
#   bash benchmarks/gpu_check.sh                                # on the GPU machine
#   KVRAY_GPU_CHECK_SMOKE=1 OUT=/tmp/gpucheck bash benchmarks/gpu_check.sh   # CPU smoke run
#   bash benchmarks/gpu_check.sh --smoke                        # the same
#
# Knobs (environment): PYTHON (default: .venv/bin/python if present, else python3),
# KVRAY_GPU_CHECK_SITE (wheel target, default /tmp/site), KVRAY_GPU_CHECK_TEST_TIMEOUT (s,
# default 150; smoke 240), KVRAY_GPU_CHECK_BENCH_TIMEOUT (s, default 150; smoke 300),
# KVRAY_GPU_CHECK_QUANT_TIMEOUT (s, default 270; smoke 240; 0 skips step 4).
set -uo pipefail

START=$(date +%s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

SMOKE=${KVRAY_GPU_CHECK_SMOKE:-0}
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        *) echo "usage: $0 [--smoke]" >&2; exit 2 ;;
    esac
done
[ "$SMOKE" = 0 ] || [ "$SMOKE" = 1 ] || SMOKE=1
if [ "$SMOKE" = 0 ] && [ -n "${TRITON_INTERPRET:-}" ]; then
    echo "TRITON_INTERPRET=$TRITON_INTERPRET unset for a full run (the kernels compile)"
    unset TRITON_INTERPRET
fi

OUT=${OUT:-/tmp/kvray-gpu-check}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python
else
    PY=python3
fi
SITE=${KVRAY_GPU_CHECK_SITE:-/tmp/site}
# A CPU smoke run (Triton's interpreter) is slower than a GPU's: longer defaults there.
if [ "$SMOKE" = 1 ]; then DEFAULTS=(240 300 240); else DEFAULTS=(150 150 270); fi
TEST_TIMEOUT=${KVRAY_GPU_CHECK_TEST_TIMEOUT:-${DEFAULTS[0]}}
BENCH_TIMEOUT=${KVRAY_GPU_CHECK_BENCH_TIMEOUT:-${DEFAULTS[1]}}
QUANT_TIMEOUT=${KVRAY_GPU_CHECK_QUANT_TIMEOUT:-${DEFAULTS[2]}}

FAILED=()
STEPS=()
step_done() {  # name, exit status
    if [ "$2" -eq 0 ]; then
        STEPS+=("$1: ok")
    else
        STEPS+=("$1: FAILED (exit $2)")
        FAILED+=("$1")
    fi
}
banner() { printf '\n===== %s (%ss) =====\n' "$1" "$(( $(date +%s) - START ))"; }

# ---- 0. wheels and PYTHONPATH -------------------------------------------------------------
banner "setup"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
WHEELS=(.whl/*.whl)
shopt -u nullglob
if "$PY" -c "import pydantic, peft" 2>/dev/null; then
    echo "pydantic and peft importable: no wheels to install"
    step_done "wheels" 0
elif [ ${#WHEELS[@]} -gt 0 ]; then
    echo "installing ${#WHEELS[@]} wheels from .whl/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${WHEELS[@]}"
    rc=$?
    export PYTHONPATH="$SITE:$PYTHONPATH"
    step_done "wheels" $rc
else
    echo "pydantic or peft is missing and there is no .whl/ (run benchmarks/gpu_wheels.sh first)"
    step_done "wheels" 1
fi
echo "python: $PY; PYTHONPATH=$PYTHONPATH"

# ---- 1. environment and imports -----------------------------------------------------------
banner "environment"
{
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
            --format=csv 2>/dev/null
    else
        echo "nvidia-smi: not present"
    fi
    if command -v lscpu >/dev/null 2>&1; then
        lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Socket\(s\))'
    else
        grep -m1 'model name' /proc/cpuinfo
    fi
    echo "cores available: $(nproc)"
    "$PY" - <<'EOF'
import platform

import torch
import transformers

try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
print(f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda})"
      f" | triton {triton_version} | transformers {transformers.__version__}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"CUDA device 0: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
          f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}")
else:
    print("CUDA: not available (CPU only)")
EOF
} 2>&1 | tee "$OUT/env.log"
step_done "environment" "${PIPESTATUS[0]}"

banner "offline imports"
# kvray's offline TP=1 path must not need what the GPU image lacks: block those imports.
"$PY" - <<'EOF' 2>&1 | tee "$OUT/imports.log"
import sys

for name in ("ray", "gguf", "fastapi", "openai", "starlette", "prometheus_client"):
    sys.modules[name] = None  # an import of it now raises ImportError
import kvray.actors.uniproc_executor
import kvray.engine.llm
from kvray import LLM, SamplingParams
from kvray.config import FIELD_SECTION

print("kvray offline path imports without ray/gguf/fastapi/openai/prometheus_client;",
      "enforce_eager key:", "enforce_eager" in FIELD_SECTION)
EOF
step_done "imports" "${PIPESTATUS[0]}"

# ---- 2. GPU tests -------------------------------------------------------------------------
banner "pytest"
if [ -n "${KVRAY_GPU_CHECK_TESTS:-}" ]; then
    read -r -a CANDIDATES <<< "$KVRAY_GPU_CHECK_TESTS"
else
    CANDIDATES=(tests/test_triton_quant.py tests/test_gpu.py tests/test_triton_kernels.py
                tests/test_triton_ops.py tests/test_triton_fused.py tests/test_triton_moe.py
                tests/test_cuda_graphs.py)
fi
TESTS=()
for f in "${CANDIDATES[@]}"; do
    if [ -e "$f" ]; then TESTS+=("$f"); else echo "no $f: skipped"; fi
done
if [ ${#TESTS[@]} -gt 0 ]; then
    timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
        2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "pytest: timed out after ${TEST_TIMEOUT}s" | tee -a "$OUT/pytest.log"
    step_done "pytest" "$rc"
else
    echo "no test files found" | tee "$OUT/pytest.log"
    step_done "pytest" 1
fi

# ---- 3. quantization benchmark (first: the numbers never measured on a GPU yet) ------------
banner "quantization benchmark"
if [ "$QUANT_TIMEOUT" -gt 0 ] && [ -e benchmarks/gpu_quant_bench.py ]; then
    QUANT_ARGS=(--out "$OUT" --time-budget $(( QUANT_TIMEOUT * 3 / 4 )))
    [ "$SMOKE" = 1 ] && QUANT_ARGS+=(--smoke)
    timeout -k 10 "$QUANT_TIMEOUT" "$PY" benchmarks/gpu_quant_bench.py "${QUANT_ARGS[@]}" \
        2>&1 | tee "$OUT/quant.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "quantization benchmark: timed out after ${QUANT_TIMEOUT}s" \
        | tee -a "$OUT/quant.log"
    step_done "quantization benchmark" "$rc"
else
    echo "quantization benchmark: skipped (KVRAY_GPU_CHECK_QUANT_TIMEOUT=0 or no script)"
fi

# ---- 4. benchmark -------------------------------------------------------------------------
banner "benchmark"
BENCH_ARGS=(--out "$OUT" --time-budget $(( BENCH_TIMEOUT * 2 / 3 )))
[ "$SMOKE" = 1 ] && BENCH_ARGS+=(--smoke)
timeout -k 10 "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_bench.py "${BENCH_ARGS[@]}" \
    2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "benchmark: timed out after ${BENCH_TIMEOUT}s" | tee -a "$OUT/bench.log"
step_done "benchmark" "$rc"

# ---- summary ------------------------------------------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
MODE=$([ "$SMOKE" = 1 ] && echo "smoke" || echo "full")
if [ ${#FAILED[@]} -eq 0 ]; then
    VERDICT="PASS"
else
    VERDICT="FAIL (${FAILED[*]})"
fi
{
    echo
    echo "===== summary ====="
    printf '%s\n' "${STEPS[@]}"
    echo "gpu_check ($MODE) $VERDICT in ${ELAPSED}s; results in $OUT"
} | tee "$OUT/summary.txt"
[ ${#FAILED[@]} -eq 0 ]
