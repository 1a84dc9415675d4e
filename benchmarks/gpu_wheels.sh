#!/usr/bin/env bash
# Fill .whl/ (at the repo root) with the wheels the GPU machine lacks for kvray's offline
# path and benchmarks/gpu_bench.py: pydantic and what it depends on, and peft (the LoRA
# test's reference) with accelerate. Run it HERE (it needs
# PyPI); the GPU machine has no network and installs them with benchmarks/gpu_check.sh.
#
# The GPU image (Python 3.12, x86-64) has torch, triton, transformers, tokenizers,
# safetensors, numpy, pyyaml, tqdm, psutil, pytest and jinja2, but not pydantic,
# pydantic-core, annotated-types or typing-inspection; pydantic also needs a newer
# typing-extensions than the image may have. The versions are the ones installed in this
# checkout's .venv (what kvray is tested with); pydantic-core is the exact version the
# chosen pydantic pins.
#
#   bash benchmarks/gpu_wheels.sh            # then: ls -la .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

# name==version for each wheel, read from the venv and from pydantic's own metadata.
mapfile -t REQS < <("$PY" - <<'PYEOF'
import re
from importlib.metadata import requires, version

pyd = version("pydantic")
major = int(pyd.split(".")[0])
assert major == 2, f"pyproject.toml wants pydantic>=2.6,<3; the venv has {pyd}"
core = next(re.sub(r"\s+", "", r) for r in requires("pydantic")
            if re.match(r"pydantic[-_]core\s*==", r))
print(f"pydantic=={pyd}")
print(core.replace("_", "-"))
for name in ("annotated-types", "typing-inspection", "typing-extensions",
             "peft", "accelerate"):  # peft: the LoRA test's reference (accelerate: its dep)
    print(f"{name}=={version(name)}")
PYEOF
)

mkdir -p .whl
for req in "${REQS[@]}"; do
    echo "downloading $req"
    "$PY" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$req"
done

# .whl/ travels to the GPU machine but never into git.
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

ls -la .whl
du -sh .whl
