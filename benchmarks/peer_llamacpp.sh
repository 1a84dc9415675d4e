#!/usr/bin/env bash
# kvray serve vs llama.cpp's llama-server on the built-in model, the same requests through
# HTTP, back to back (benchmarks/serve.py --peer); and llama.cpp's own KL divergence of its
# quantized GGUFs (llama-perplexity) for benchmarks/quality.py to compare with.
#
# Builds llama-server, llama-quantize and llama-perplexity from the llama-cpp-python sdist
# on PyPI (its vendor/llama.cpp; ~10 min on 2 cores, once: the build is kept under
# $PEER_DIR).
#
# Modes:
#   (default)        llama-server on a GGUF converted from the built-in model's Hugging Face
#                    directory by llama.cpp's own converter, in the precision kvray runs
#                    (float32 on a CPU without native bf16; GGUF_TYPE=bf16 gives llama-server
#                    kvray's bf16 decode weights), against each of kvray's front ends
#                    (`--ingress process`, `replica`, then the default Ray Serve graph), each
#                    started afresh for each load, at concurrency 1, 8 and 16.
#   --quant Q        both servers on the SAME quantized GGUF: Q4_1 = the built-in file as
#                    shipped; Q8_0 / Q4_K_M = made by llama-quantize from an f32 GGUF holding
#                    exactly the shipped file's weights (the Q4_1 file dequantized by
#                    llama-quantize --allow-requantize). kvray serves it with its defaults
#                    (`quantization: null`: the GGUF as it is). 64 prompts of 64-256 tokens,
#                    outputs 64-128, ignore_eos, llama-server -np 16 -t <cores>, concurrency
#                    1 and 16, kvray's default front end and `--ingress process`.
#   --kld            llama-perplexity --kl-divergence-base on that f32 GGUF over
#                    benchmarks/data/quality_text.txt (windows of KLD_CTX tokens, the second
#                    half scored), then --kl-divergence on the f32 file itself (the floor of
#                    its 16-bit stored log-probs) and on each quantized GGUF (Q4_1, Q8_0,
#                    Q4_K_M); prints llama.cpp's mean KLD, PPL and same-top rate per format
#                    and writes them to $PEER_DIR/llamacpp_kld.json, which quality.py reads.
#                    With --quant as well, the serving benchmark runs afterwards.
#
# Usage: benchmarks/peer_llamacpp.sh [--quant Q4_1|Q8_0|Q4_K_M] [--kld]
#            [extra serve.py flags, e.g. --num-requests 32 --concurrency 1]
# Env:   PEER_DIR (default ~/.cache/kvray/peer), GGUF_TYPE (f32|bf16|f16, default f32; the
#        default mode only), THREADS (default: the cores this process may use), PYTHON
#        (default .venv/bin/python), KVRAY_INGRESS (serve.py's --ingress; default
#        process,replica,serve, with --quant serve,process), KLD_CTX (default 512, as
#        quality.py's --ctx), LLAMA_ARGS (extra flags for llama-server and llama-perplexity;
#        default -nr on a CPU with AMX, whose repacked path crashed on the Q4_1 file)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/kvray/peer}"
GGUF_TYPE="${GGUF_TYPE:-f32}"
THREADS="${THREADS:-$(nproc)}"
KLD_CTX="${KLD_CTX:-512}"
SLOTS=16
CTX=$((SLOTS * 512))  # every slot holds a 256-token prompt + 128 outputs with room to spare

QUANT=""
KLD=0
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quant) QUANT="${2:?--quant needs Q4_1, Q8_0 or Q4_K_M}"; shift 2 ;;
        --quant=*) QUANT="${1#*=}"; shift ;;
        --kld) KLD=1; shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
case "$QUANT" in
    "" | Q4_1 | Q8_0 | Q4_K_M) ;;
    *) echo "--quant $QUANT: one of Q4_1, Q8_0, Q4_K_M" >&2; exit 2 ;;
esac
if [ -z "${LLAMA_ARGS+set}" ]; then
    LLAMA_ARGS=""
    grep -qw amx_int8 /proc/cpuinfo && LLAMA_ARGS="-nr"
fi
read -r -a LLAMA_EXTRA <<<"$LLAMA_ARGS"
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

# 2. llama-server, llama-quantize and llama-perplexity, native to this CPU: a build made on
# another CPU (these machines change between sessions; $PEER_DIR may be kept) is rebuilt
CPU_TAG="$(grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^cpu family' /proc/cpuinfo;
           grep -m1 '^model\s' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo)"
if [ -d build ] && [ "$(cat build/cpu_tag 2>/dev/null)" != "$CPU_TAG" ]; then
    echo "llama.cpp was built on another CPU: rebuilding it for this one" >&2
    rm -rf build
fi
TARGETS=(llama-server llama-quantize llama-perplexity)
for t in "${TARGETS[@]}"; do
    if [ ! -x "build/bin/$t" ]; then
        echo "building ${TARGETS[*]} (log: $PEER_DIR/build.log)" >&2
        cmake -S "$LLAMA" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >build.log
        cmake --build build --target "${TARGETS[@]}" -j "$(nproc)" >>build.log
        echo "$CPU_TAG" >build/cpu_tag
        break
    fi
done

SHIPPED="$("$PYTHON" -c 'from kvray.models.default_model import default_gguf_path; print(default_gguf_path())')"
NAME="$(basename "$SHIPPED" .Q4_1.gguf)"
F32Q="$PEER_DIR/$NAME.f32-from-Q4_1.gguf"  # the shipped file's weights, exactly, in f32

# The f32 GGUF of the shipped file's weights (made once).
f32_of_shipped() {
    if [ ! -f "$F32Q" ]; then
        build/bin/llama-quantize --allow-requantize "$SHIPPED" "$F32Q.tmp" F32 "$THREADS" \
            >quantize.log 2>&1 || { tail -20 quantize.log >&2; exit 1; }
        mv "$F32Q.tmp" "$F32Q"
    fi
    echo "$F32Q"
}

# The GGUF of one format: the shipped Q4_1, or one made from f32_of_shipped (made once).
gguf_of() {
    local q="$1"
    if [ "$q" = Q4_1 ]; then
        echo "$SHIPPED"
        return
    fi
    local out="$PEER_DIR/$NAME.$q.gguf"
    if [ ! -f "$out" ]; then
        local f32
        f32="$(f32_of_shipped)"
        build/bin/llama-quantize "$f32" "$out.tmp" "$q" "$THREADS" >>quantize.log 2>&1 \
            || { tail -20 quantize.log >&2; exit 1; }
        mv "$out.tmp" "$out"
    fi
    echo "$out"
}

# 3. --kld: llama.cpp's KL divergence of each quantized GGUF against the f32 one
if [ "$KLD" = 1 ]; then
    TEXT="$ROOT/benchmarks/data/quality_text.txt"
    BASE_FILE="$PEER_DIR/kld_base.c$KLD_CTX.bin"
    F32="$(f32_of_shipped)"
    for q in Q4_1 Q8_0 Q4_K_M; do gguf_of "$q" >/dev/null; done
    build/bin/llama-perplexity -m "$F32" -f "$TEXT" -c "$KLD_CTX" -t "$THREADS" \
        "${LLAMA_EXTRA[@]}" --kl-divergence-base "$BASE_FILE" >kld_f32_base.log 2>&1 \
        || { tail -20 kld_f32_base.log >&2; exit 1; }
    for q in f32 Q4_1 Q8_0 Q4_K_M; do
        file="$F32"
        [ "$q" = f32 ] || file="$(gguf_of "$q")"
        build/bin/llama-perplexity -m "$file" -c "$KLD_CTX" -t "$THREADS" "${LLAMA_EXTRA[@]}" \
            --kl-divergence-base "$BASE_FILE" --kl-divergence >"kld_$q.log" 2>&1 \
            || { tail -20 "kld_$q.log" >&2; exit 1; }
    done
    "$PYTHON" - "$PEER_DIR" "$KLD_CTX" "$F32" "$SHIPPED" "$NAME" <<'EOF'
import json, os, re, sys
from pathlib import Path

peer, ctx, f32, shipped, name = Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:]
files = {"f32": f32, "Q4_1": shipped, **{q: str(peer / f"{name}.{q}.gguf")
                                          for q in ("Q8_0", "Q4_K_M")}}
sys.path.insert(0, os.getcwd())
pat = {"mean_kld": r"Mean\s+KLD:\s+([-\d.e+]+)", "ppl": r"Mean PPL\(Q\)\s+:\s+([-\d.e+]+)",
       "ppl_base": r"Mean PPL\(base\)\s+:\s+([-\d.e+]+)",
       "same_top_pct": r"Same top p:\s+([-\d.e+]+)", "kld_p99": r"99\.0%\s+KLD:\s+([-\d.e+]+)"}
out = {"ctx": ctx, "text": "benchmarks/data/quality_text.txt", "formats": {}}
cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")), "?")
print(f"\nllama.cpp llama-perplexity --kl-divergence vs {Path(f32).name}, -c {ctx}, CPU {cpu}")
print("| format | file MiB | PPL | mean KLD | p99 KLD | same top % |")
print("|---|---|---|---|---|---|")
for q, path in files.items():
    log = (peer / f"kld_{q}.log").read_text(errors="replace")
    row = {k: (float(m.group(1)) if (m := re.search(p, log)) else None) for k, p in pat.items()}
    row["file"] = path
    row["file_mib"] = os.path.getsize(path) / 2**20
    out["formats"][q] = row
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"| {q} | {row['file_mib']:.1f} | {fmt(row['ppl'], '.4f')} | "
          f"{fmt(row['mean_kld'], '.6f')} | {fmt(row['kld_p99'], '.5f')} | "
          f"{fmt(row['same_top_pct'], '.2f')} |")
(peer / "llamacpp_kld.json").write_text(json.dumps(out, indent=2) + "\n")
print(f"wrote {peer / 'llamacpp_kld.json'} (f32: the floor of llama.cpp's 16-bit base "
      "log-probs)")
EOF
    [ -n "$QUANT" ] || exit 0
fi

# 4. the GGUF llama-server serves
if [ -n "$QUANT" ]; then
    GGUF="$(gguf_of "$QUANT")"
    LABEL="$QUANT GGUF"
    KVRAY_INGRESS="${KVRAY_INGRESS:-serve,process}"
    SERVE_ARGS=(--model "$GGUF" --concurrency 1,16)
else
    MODEL_DIR="$("$PYTHON" -c 'from kvray.models.default_model import default_model_dir; print(default_model_dir())')"
    GGUF="$PEER_DIR/$(basename "$MODEL_DIR").$GGUF_TYPE.gguf"
    if [ ! -f "$GGUF" ]; then
        # the converter imports sentencepiece even for a BPE tokenizer: keep it out of .venv
        [ -d pydeps/sentencepiece ] || "$PYTHON" -m pip install -q --target pydeps sentencepiece
        PYTHONPATH="$LLAMA/gguf-py:$PEER_DIR/pydeps" "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" \
            "$MODEL_DIR" --outtype "$GGUF_TYPE" --outfile "$GGUF" >convert.log 2>&1
    fi
    LABEL="$GGUF_TYPE GGUF"
    KVRAY_INGRESS="${KVRAY_INGRESS:-process,replica,serve}"
    SERVE_ARGS=()
fi

# 5. llama-server: one slot per concurrent request, all the cores kvray gets
PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
build/bin/llama-server -m "$GGUF" --host 127.0.0.1 --port "$PORT" -np "$SLOTS" -t "$THREADS" \
    -c "$CTX" --no-webui "${LLAMA_EXTRA[@]}" >server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat server.log; exit 1; }
    sleep 1
done

# 6. the servers, back to back (serve.py prints the CPU, its flags and the dtype)
cd "$ROOT"
echo "GGUF: $GGUF ($(du -m "$GGUF" | cut -f1) MiB)"
"$PYTHON" benchmarks/serve.py --peer "http://127.0.0.1:$PORT" --ingress "$KVRAY_INGRESS" \
    --peer-name "llama-server ($LABEL, -np $SLOTS -t $THREADS)" "${SERVE_ARGS[@]}" "${PASS[@]}"
