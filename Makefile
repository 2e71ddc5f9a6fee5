# rnnserve developer commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test serve test lint gpu-test gpu-bench cpu-peers clean default-model

install: $(STAMP)

install-test: $(TEST_STAMP)

# Runtime dependencies only (what `make serve` needs); reinstall only when the package metadata changes.
# torch is pinned so pip never pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e . "torch==$(TORCH_VERSION)"
	touch $(STAMP)

# The test extras (pytest, ruff, triton for the interpreter tests, transformers and openai for comparisons).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test]" "torch==$(TORCH_VERSION)"
	touch $(TEST_STAMP)

serve: install
	$(VENV)/bin/rnnserve serve $(ARGS)

test: install-test
	$(PY) -m ruff check rnnserve engine kernels server clients tests benchmarks scripts examples
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: install-test
	$(PY) -m ruff check rnnserve engine kernels server clients tests benchmarks scripts examples

# On a CUDA machine whose Python already has torch and triton (no install: GPU machines may be offline):
# the gpu-marked tests, then gpu-bench.
gpu-test:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -m gpu tests/gpu tests/engine/test_looped.py
	$(MAKE) gpu-bench

# One table per model: decode and prefill tok/ms, HBM roofline, engine and HTTP vs offline, the Based paper's
# Table 1 beside them. The HTTP rows need fastapi/uvicorn/pydantic importable (carry wheels on GPU machines).
gpu-bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/gpu_bench.py $(ARGS)

# rnnserve vs llama.cpp on CPU with the same weights: offline decode, roofline, HTTP (not part of `make test`).
# Builds llama.cpp once into ~/.cache/rnnserve/peers; the converter needs transformers (the test extras).
cpu-peers: install-test
	$(PY) benchmarks/cpu_peers.py $(ARGS)

# Retrain the embedded model in engine/default_model/ (fetches Debian's `fortunes`; <= 30 min on 2 cores).
default-model: install
	$(PY) scripts/train_default_model.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
