# The two set-up commands of the README: `make run` and `make test`.
# Everything they need is installed here, into .venv (torch from PyPI).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint testenv docs

install: $(STAMP)

$(STAMP): runtime/pyproject.toml operator/pyproject.toml
	@echo ">> creating $(VENV) and installing lopa + lopa-operator (torch is large: first run takes a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade --quiet pip
	$(VENV)/bin/pip install --progress-bar off -e './runtime[dev]' -e ./operator
	touch $(STAMP)

# A local master + 2 branch workers (gloo, CPU) on the bundled model answer one request.
run: install
	$(VENV)/bin/lopa serve --workers 2 --branches 3 --prompt "$${PROMPT:-tail:gcecjki.ZVvrtus.WVbuklw=}"

# Builds (once per machine, cached) the Kubernetes test control plane and Kueue from the Go module proxy.
testenv:
	@if [ -x tools/k8s-testenv/build.sh ]; then tools/k8s-testenv/build.sh; fi
	@if [ -x tools/k8s-testenv/kueue.sh ]; then tools/k8s-testenv/kueue.sh; fi

# The documentation site: regenerate the reference pages from the code, then build site/ (strict).
docs: install
	$(PY) -m tools.docs.gen_reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) tools/function_length.py

# Three test processes, each taking whole test files (the operator suite as one: one control plane);
# tests/conftest.py says how. The operator suite mostly waits on the API server, the other two share
# the cores.
test: install testenv lint
	$(PY) -m pytest -n 3 tests
