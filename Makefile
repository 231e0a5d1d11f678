# make run: set up and run pipe mode on the embedded default model.
# make test: set up and run the test suite.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup build bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard cython_ext/*) $(wildcard cuda_ops/*)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-build-isolation setuptools wheel "cython>=3.0" numpy
	$(BIN)/pip install -q --no-build-isolation -e '.[dev]'
	@touch $(STAMP)

build: setup
	$(BIN)/python setup.py -q build_ext --inplace

run: setup
	set -o pipefail; $(BIN)/pipeline run --ordered < tools/sample_prompts.txt \
	  | $(BIN)/python tools/show_completions.py tools/sample_prompts.txt

test: setup lint
	$(BIN)/python -m pytest -x -q -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check pipeline
	$(BIN)/mypy

bench: setup
	$(BIN)/pipeline bench ipc

clean:
	rm -rf build pipeline/_ext/*.so pipeline/_ext/*.c pipeline/_ext/*.cpp cython_ext/*.c cython_ext/*.cpp cuda_ops/*.cpp *.egg-info
