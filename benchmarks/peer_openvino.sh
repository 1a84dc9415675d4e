#!/usr/bin/env bash
# Sets up OpenVINO GenAI, the CPU peer of `benchmarks/throughput.py --peer openvino`: its own
# virtual environment (it is not a kvray dependency) and the built-in model exported to
# OpenVINO IR with int8 weights by optimum-intel. Both are made once and kept.
#
#   $PEER_DIR/openvino-venv            torch (pinned, CPU build), openvino-genai,
#                                      optimum-intel[openvino]; torchvision removed (a
#                                      torchvision wheel beside torch 2.13 breaks
#                                      `import transformers` there)
#   $PEER_DIR/openvino/<model>-<fmt>   `optimum-cli export openvino --weight-format <fmt>`
#                                      of the built-in model's Hugging Face directory
#
# Usage: benchmarks/peer_openvino.sh [int8|fp32|int4 ...]   (default int8)
# Prints the exported directory of each format, one per line, last on stdout.
# Env:   PEER_DIR (default ~/.cache/kvray/peer), PYTHON (default .venv/bin/python: finds the
#        built-in model), TORCH_VERSION (default: the one in kvray's .venv)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/kvray/peer}"
VENV="$PEER_DIR/openvino-venv"
FORMATS=("$@")
[ ${#FORMATS[@]} -gt 0 ] || FORMATS=(int8)
mkdir -p "$PEER_DIR/openvino"

if [ ! -f "$VENV/.kvray-complete" ]; then
    # an unpinned torch resolves to a multi-GB CUDA build: pin kvray's (a CPU build here)
    TORCH_VERSION="${TORCH_VERSION:-$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')}"
    BASE_PYTHON="$("$PYTHON" -c 'import sys; print(sys._base_executable)')"
    echo "creating $VENV (torch==$TORCH_VERSION, openvino-genai, optimum-intel[openvino])" >&2
    rm -rf "$VENV"
    "$BASE_PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" openvino-genai 'optimum-intel[openvino]' >&2
    "$VENV/bin/pip" uninstall -y -q torchvision >&2 2>/dev/null || true
    "$VENV/bin/python" -c 'import transformers, openvino_genai, optimum.intel' >&2
    touch "$VENV/.kvray-complete"
fi

# optimum exports from Hugging Face weights: `kvray setup` keeps only the GGUF unless asked
MODEL_DIR="$("$PYTHON" -c 'from kvray.models.default_model import default_model_dir, setup_default_model
setup_default_model(dense_weights=True, log=lambda *a, **k: None)
print(default_model_dir())')"
for fmt in "${FORMATS[@]}"; do
    out="$PEER_DIR/openvino/$(basename "$MODEL_DIR")-$fmt"
    if [ ! -f "$out/.kvray-complete" ]; then
        echo "exporting $MODEL_DIR to OpenVINO IR, $fmt weights -> $out" >&2
        rm -rf "$out"
        "$VENV/bin/optimum-cli" export openvino --model "$MODEL_DIR" \
            --task text-generation-with-past --weight-format "$fmt" "$out" >"$out.log" 2>&1 \
            || { tail -20 "$out.log" >&2; exit 1; }
        touch "$out/.kvray-complete"
    fi
    echo "$out"
done
