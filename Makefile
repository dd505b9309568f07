# Two commands do all set-up on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
DOCS_STAMP := $(VENV)/.docs-installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# 2 pytest workers on the 2-core CI machine; each worker simulates 8 CPU devices.
PYTEST_WORKERS ?= 2

.PHONY: demo test test-all test-loaded lint bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install -q -e '.[dev,torch,cuda12]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
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
