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
	# The `structured` extra without its triton (285 MB of GPU kernels; on CPU the bitmask is
	# applied with torch). Its other needs (torch, transformers, pydantic, numpy) are above.
	$(BIN)/pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
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

# make gpu-wheels: the wheels tools/gpu_check.sh installs on a GPU machine that has no package
# registry, for its CPython (GPU_PY) on manylinux x86_64, into .whl/ (docs/gpu.md). No setup
# needed: any python3 with pip does.
# make gpu-check: tools/gpu_check.sh --dry-run here (the GPU run itself: docs/gpu.md).
GPU_PY ?= 3.12
GPU_TOOLS_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
.PHONY: gpu-wheels gpu-check

gpu-wheels:
	$(GPU_TOOLS_PY) tools/gpu_wheels.py download --python-version $(GPU_PY) --dest .whl

gpu-check: setup
	PYTHON=$(BIN)/python tools/gpu_check.sh --dry-run
