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

.PHONY: install demo test test-all test-loaded lint bench docs clean test-latest plan-versions

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

# `make test` in two passes: the first compiles with XLA:CPU's fast codegen
# (JAXZERO_TEST_CODEGEN=fast, tests/conftest.py), the second runs the `bitwise` tests, which
# hold two XLA programs to each other bit for bit, under XLA's default codegen. `make test-all`
# runs every test under the default codegen.
FAST := JAXZERO_TEST_CODEGEN=fast
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(FAST) $(PYTEST) -m "not slow and not bitwise" tests
	$(PYTEST) -m "not slow and bitwise" tests

test-loaded: $(STAMP)
	bash tests/loaded.sh

test-all: $(STAMP)
	$(PYTEST) tests

lint: $(STAMP)
	$(BIN)/ruff check jaxzero tests examples benchmarks
	$(BIN)/ruff format --check jaxzero tests examples benchmarks
	$(BIN)/lint-imports --no-cache --no-logo

bench: $(STAMP)
	$(BIN)/python benchmarks/ema.py

# The API reference and guides (docs/), HTML in docs/_build/html; every warning is an error.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	rm -f $(VENV)/.docs-installed-*
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

# `make test-latest`: the other end of the supported range, the newest jax (pinned in
# constraints-latest.txt) on Python >= 3.12, in its own venv. The interpreter: LATEST_PY when
# given, else python3.13 / python3.12 on PATH, else the newest of pyenv's 3.13.x / 3.12.x builds.
# torch and DeepSpeed are not installed there (PyPI's torch for Python >= 3.12 is the CUDA build,
# several GB), so the interop-marked tests are deselected and the run says how many.
LATEST_VENV := .venv-latest
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_STAMP := $(LATEST_VENV)/.installed-$(shell cat pyproject.toml Makefile constraints-latest.txt | cksum | cut -d' ' -f1)
LATEST_PY ?= $(shell for p in python3.13 python3.12 $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.1[23].*/bin/python3.1[23] 2>/dev/null | sort -rV); do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; break; }; done)

$(LATEST_BIN)/python:
	@test -n "$(LATEST_PY)" || { echo "make test-latest: no Python >= 3.12 found (looked for python3.13/python3.12 on PATH and in pyenv's versions). Install one (e.g. pyenv install 3.12) or pass LATEST_PY=/path/to/python3.12." >&2; exit 1; }
	@$(LATEST_PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' || { echo "make test-latest: LATEST_PY=$(LATEST_PY) is older than Python 3.12, which jax >= 0.11 needs; pass LATEST_PY=/path/to/python3.12 (or 3.13)." >&2; exit 1; }
	$(LATEST_PY) -m venv $(LATEST_VENV)
	$(LATEST_BIN)/python -m pip install -q --upgrade pip

$(LATEST_STAMP): $(LATEST_BIN)/python pyproject.toml Makefile constraints-latest.txt
	$(LATEST_BIN)/python -m pip install -q -c constraints-latest.txt -e '.[dev,gpu-compile-cuda13]'
	rm -f $(LATEST_VENV)/.installed-*
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	@$(LATEST_BIN)/python -c 'import sys, jax, flax; print(f"make test-latest: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")'
	$(LATEST_BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow and not interop" tests

# `make plan-versions`: the same deviceless `jaxzero plan` table (LLaMA-7B on 64 H100s, the
# recommended XLA flags) and benchmarks/plain_script.py (units=, XLA's defaults) under both ends of
# the supported jax range, then the diff: a regression in a new jax (decision 49) shows up as a
# changed line. Minutes per venv on 2 cores; the outputs stay in runs/plan-versions/.
PLAN_VERSIONS_ARGS ?= --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \
	--batch 1 --gpu h100 --devices 64 --stage 3 --stage3 per-layer --xla-flags
plan-versions: $(STAMP) $(LATEST_STAMP)
	@mkdir -p runs/plan-versions
	@for v in $(BIN) $(LATEST_BIN); do \
		j=$$($$v/python -c 'from importlib.metadata import version; print(version("jax"))'); \
		echo "jax $$j: jaxzero plan $(PLAN_VERSIONS_ARGS)"; \
		{ $$v/jaxzero plan $(PLAN_VERSIONS_ARGS) && $$v/python benchmarks/plain_script.py; } \
			> runs/plan-versions/jax-$$j.txt || exit 1; \
	done
	@diff -u runs/plan-versions/jax-$$($(BIN)/python -c 'from importlib.metadata import version; print(version("jax"))').txt \
		runs/plan-versions/jax-$$($(LATEST_BIN)/python -c 'from importlib.metadata import version; print(version("jax"))').txt \
		&& echo "plan-versions: the same table under both jax versions" || true

clean:
	rm -rf $(VENV) $(LATEST_VENV) runs .pytest_cache docs/_build
