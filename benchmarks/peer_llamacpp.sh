#!/usr/bin/env bash
# kvray serve vs llama.cpp's llama-server on the built-in model, the same requests through
# HTTP, back to back at concurrency 1, 8 and 16 (benchmarks/serve.py --peer).
#
# Builds llama-server from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp; ~7 min
# on 2 cores, once: the build is kept under $PEER_DIR), converts the built-in model to a
# GGUF with llama.cpp's own converter, in the precision kvray runs (float32 on a CPU without
# native bf16; set GGUF_TYPE=bf16 to give llama-server kvray's bf16 decode weights), starts
# it with one slot per concurrent request and runs the benchmark against each of kvray's
# front ends (`kvray serve --ingress process`, `--ingress replica`, then the default Ray Serve
# graph), each started afresh for each load.
#
# Usage: benchmarks/peer_llamacpp.sh [extra serve.py flags, e.g. --num-requests 32]
# Env:   PEER_DIR (default ~/.cache/kvray/peer), GGUF_TYPE (f32|bf16|f16, default f32),
#        THREADS (default: the cores this process may use), PYTHON (default .venv/bin/python),
#        KVRAY_INGRESS (default process,replica,serve: serve.py's --ingress)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/kvray/peer}"
GGUF_TYPE="${GGUF_TYPE:-f32}"
THREADS="${THREADS:-$(nproc)}"
SLOTS=16
CTX=$((SLOTS * 512))  # every slot holds a 256-token prompt + 128 outputs with room to spare
mkdir -p "$PEER_DIR"
cd "$PEER_DIR"

# 1. the sdist: newest llama-cpp-python, found through PyPI's JSON API
if [ ! -d src ]; then
    "$PYTHON" - <<'EOF'
import json, urllib.parse, urllib.request
api = "https://pypi.org/pypi/llama-cpp-python/json"
meta = json.load(urllib.request.urlopen(api, timeout=60))
sdist = next(f for f in meta["urls"] if f["packagetype"] == "sdist")
url = urllib.parse.urljoin(api, sdist["url"])  # the registry may answer with a relative URL
print("downloading", sdist["filename"], f"({sdist['size'] / 2**20:.0f} MiB)", flush=True)
urllib.request.urlretrieve(url, "sdist.tar.gz")
EOF
    mkdir -p src.tmp && tar -xzf sdist.tar.gz -C src.tmp --strip-components=1
    mv src.tmp src && rm sdist.tar.gz
fi
LLAMA="$PEER_DIR/src/vendor/llama.cpp"

# 2. llama-server, native to this CPU
if [ ! -x build/bin/llama-server ]; then
    cmake -S "$LLAMA" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >build.log
    cmake --build build --target llama-server -j "$(nproc)" >>build.log
fi

# 3. the built-in model as a GGUF, converted by llama.cpp's own script
MODEL_DIR="$("$PYTHON" -c 'from kvray.models.default_model import default_model_dir; print(default_model_dir())')"
GGUF="$PEER_DIR/$(basename "$MODEL_DIR").$GGUF_TYPE.gguf"
if [ ! -f "$GGUF" ]; then
    # the converter imports sentencepiece even for a BPE tokenizer: keep it out of .venv
    [ -d pydeps/sentencepiece ] || "$PYTHON" -m pip install -q --target pydeps sentencepiece
    PYTHONPATH="$LLAMA/gguf-py:$PEER_DIR/pydeps" "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" "$MODEL_DIR" \
        --outtype "$GGUF_TYPE" --outfile "$GGUF" >convert.log 2>&1
fi

# 4. llama-server: one slot per concurrent request, all the cores kvray gets
PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
build/bin/llama-server -m "$GGUF" --host 127.0.0.1 --port "$PORT" -np "$SLOTS" -t "$THREADS" \
    -c "$CTX" --no-webui >server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat server.log; exit 1; }
    sleep 1
done

# 5. the servers, back to back
cd "$ROOT"
"$PYTHON" benchmarks/serve.py --peer "http://127.0.0.1:$PORT" \
    --ingress "${KVRAY_INGRESS:-process,replica,serve}" \
    --peer-name "llama-server ($GGUF_TYPE GGUF, -np $SLOTS -t $THREADS)" "$@"
