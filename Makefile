# Two commands do all set-up on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
DEMO_STAMP := $(VENV)/.demo-installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# An NVIDIA GPU on this machine: a device node (what jaxzero.xla_flags.gpu_present checks) or
# nvidia-smi listing one.
GPU := $(shell { ls /dev/nvidia[0-9]* || nvidia-smi -L; } >/dev/null 2>&1 && echo 1)
COMMA := ,
# `make demo`: the core and the demo's extra, plus jax's CUDA 12 wheels on a GPU machine.
DEMO_EXTRAS := demo$(if $(GPU),$(COMMA)cuda12)
# `make test` (and lint, bench, ...): pytest, torch, DeepSpeed, the demo's extra and, for the
# deviceless XLA:GPU compiles, jax's CUDA plugin with cuDNN only (gpu-compile); on a GPU machine
# the full jax[cuda12].
TEST_EXTRAS := dev,torch,$(if $(GPU),cuda12,gpu-compile)
DOCS_STAMP := $(VENV)/.docs-installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# 2 pytest workers on the 2-core CI machine; each worker simulates 8 CPU devices.
PYTEST_WORKERS ?= 2

.PHONY: install demo test test-all test-loaded lint bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install -q -e '.[$(TEST_EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

$(DEMO_STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install -q -e '.[$(DEMO_EXTRAS)]'
	rm -f $(VENV)/.demo-installed-*
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" tests

test-loaded: $(STAMP)
	bash tests/loaded.sh

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) tests

lint: $(STAMP)
	$(BIN)/ruff check jaxzero tests examples benchmarks
	$(BIN)/ruff format --check jaxzero tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/ema.py

# The API reference and guides (docs/), HTML in docs/_build/html; every warning is an error.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	rm -f $(VENV)/.docs-installed-*
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build
