# rnnserve developer commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test serve test lint gpu-test gpu-bench gpu-check gpu-wheels cpu-peers clean default-model

install: $(STAMP)

install-test: $(TEST_STAMP)

# Runtime dependencies only (what `make serve` needs); reinstall only when the package metadata changes.
# torch comes first, alone, from PyTorch's CPU index: on Linux, PyPI's torch of the same version is the CUDA
# build (GBs of nvidia-* packages). Where that index cannot be reached, pip's own configuration (a local CPU
# wheel, or PyPI) provides it; its dependencies come from the usual indexes either way.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps --retries 1 --index-url $(TORCH_INDEX_URL) "torch==$(TORCH_VERSION)" \
		|| echo "torch: $(TORCH_INDEX_URL) not reachable, installing it from pip's configured indexes"
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
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -q -m gpu tests/gpu tests/engine/test_looped.py
	$(MAKE) gpu-bench

# One table per model: decode and prefill tok/ms, HBM roofline, engine and HTTP vs offline, the Based paper's
# Table 1 beside them. The HTTP rows need fastapi/uvicorn/pydantic importable (carry wheels on GPU machines).
gpu-bench:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_bench.py $(ARGS)

# A machine lent for minutes: the wheels from .gpu-wheels, the gpu-marked tests, gpu-bench for issue 14's models and
# a batch-1 sweep of the decode stacks and a profile of the host loop at batch 256, each part time-limited, logs in
# $$OUT (scripts/gpu_check.sh).
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

# The serving stack as wheels for a CUDA image that has torch and Triton but not the web stack (Python 3.12,
# x86-64 by default), at the versions installed here: carry GPU_WHEELS to that machine, then
#   python3 -m pip install --no-index --no-deps --target /tmp/site GPU_WHEELS/*.whl
#   python3 -m pip install --no-index --no-deps --target /tmp/site GPU_WHEELS/optional/*.whl || true
#   PYTHONPATH=/tmp/site make gpu-bench
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
SERVING_STACK := fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions \
	annotated-doc opentelemetry-api anyio idna sniffio uvicorn h11 click httptools uvloop
# llguidance (structured outputs) is built for glibc 2.31+: it goes to GPU_WHEELS/optional, installed on its own so
# that an older image still gets the serving stack.
GPU_OPTIONAL := llguidance
PINNED = $(PY) -c "import importlib.metadata as m, sys; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))"
gpu-wheels: install
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_WHEELS) \
		$$($(PINNED) $(SERVING_STACK))
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp --platform manylinux_2_31_x86_64 $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS)/optional \
		$$($(PINNED) $(GPU_OPTIONAL))

# rnnserve vs llama.cpp on CPU with the same weights: offline decode, roofline, HTTP (not part of `make test`).
# Builds llama.cpp once into ~/.cache/rnnserve/peers; the converter needs transformers (the test extras).
cpu-peers: install-test
	$(PY) benchmarks/cpu_peers.py $(ARGS)

# Retrain the embedded model in engine/default_model/ (fetches Debian's `fortunes`; <= 30 min on 2 cores).
default-model: install
	$(PY) scripts/train_default_model.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
