# The two set-up commands of the README: `make run` and `make test`.
# Everything they need is installed here, into .venv, at the versions of requirements/lock.txt.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV := $(VENV)/bin/uv
LOCK := requirements/lock.txt
# What the lock pins: both packages with the dev extra, and the installers (pip, uv).
LOCK_INPUTS := runtime/pyproject.toml operator/pyproject.toml requirements/tools.in
# `make lock LOCK_UPGRADE=--upgrade` takes the newest release of everything;
# `make lock LOCK_UPGRADE="--upgrade-package torch"` one package; plain `make lock` keeps every pin
# the pyproject files still allow.
LOCK_UPGRADE ?=

.PHONY: install run test lint testenv docs lock

install: $(STAMP)

# The venv is rebuilt from scratch whenever the lock or a pyproject file changes, so that it holds the
# lock and nothing else. pip installs the lock's uv (requirements/uv.txt), uv the lock, both refusing
# any file whose hash the lock does not list; uv builds a package that has no wheel with the lock's
# setuptools. tools/lock.py check then compares the venv with the lock.
$(STAMP): $(LOCK) requirements/uv.txt requirements/constraints.txt runtime/pyproject.toml operator/pyproject.toml
	@echo ">> creating $(VENV) from $(LOCK) (torch is large: the first run takes a few minutes)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps -r requirements/uv.txt
	$(UV) pip sync --python $(PY) --require-hashes --build-constraints requirements/constraints.txt $(LOCK)
	$(UV) pip install --python $(PY) --no-deps --no-build-isolation -e ./runtime -e ./operator
	$(PY) tools/lock.py check
	touch $(STAMP)

# Refreshes the lock on purpose (CONTRIBUTING.md says when), then what follows it: the two files
# derived from it, the venv, the gRPC stubs and the reference pages.
lock: install
	$(UV) pip compile $(LOCK_INPUTS) --extra dev --universal --python-version 3.10 \
	  --generate-hashes --custom-compile-command "make lock" $(LOCK_UPGRADE) -o $(LOCK)
	$(PY) tools/lock.py constraints > requirements/constraints.txt
	$(PY) tools/lock.py bootstrap > requirements/uv.txt
	$(MAKE) install
	$(PY) -m lopa.proto.generate
	$(PY) -m tools.docs.gen_reference

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
