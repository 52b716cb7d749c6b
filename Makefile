# One entry point. `make lab` sets up and opens the course; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch wheel to install when the venv has none. On a laptop without a GPU, the CPU-only
# build is much smaller:  make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# JupyterLab refuses to run as root (containers, CI) unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lab test test-browser test-gpu grade notebooks clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/kvlab check
	touch $@

lab: setup
	$(BIN)/jupyter lab notebooks/ $(LAB_ARGS)

# Everything CI runs: unit, property, kernel (Triton interpreter), graded, notebook and browser
# tests. -rs lists every skipped test with its reason (the browser test needs /usr/bin/chromium).
test: setup
	KVLAB_PROFILE=cpu $(BIN)/python -m pytest tests notebooks --nbval-lax -q -rs $(PYTEST_ARGS)

# Chapter 2 in JupyterLab, driven by Chromium (screenshot in build/browser/).
test-browser: setup
	KVLAB_PROFILE=cpu $(BIN)/python -m pytest tests/browser -q -rs $(PYTEST_ARGS)

# On a machine with an NVIDIA GPU: the kernel tests at larger sizes, compiled natively.
test-gpu: setup
	KVLAB_PROFILE=gpu $(BIN)/python -m pytest tests -q $(PYTEST_ARGS)

# Grade one chapter of your exercises:  make grade CH=ch02
grade: setup
	$(BIN)/kvlab grade $(CH)

# Re-execute every notebook in place (on a GPU machine this records the GPU outputs).
notebooks: setup
	$(BIN)/python -m kvlab.notebooks run notebooks/*.ipynb

clean:
	rm -rf $(VENV) build *.egg-info
