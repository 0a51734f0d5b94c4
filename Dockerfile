# syntax=docker/dockerfile:1
# pd-extproc: the Envoy ext_proc server for disaggregated prefill/decode.
#   docker build -t pd-extproc:0.1.0 .
#   docker run --rm -e PD_EXTPROC_GRPC_LISTEN=0.0.0.0:50051 -p 50051:50051 -p 9190:9190 pd-extproc:0.1.0
# Configuration is PD_EXTPROC_* variables only (see envoy/pd-extproc.env, k8s/pd-extproc.env).
# Pin the base by digest where you build: append @sha256:<digest> of this tag to PYTHON_IMAGE.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# Build stage: resolve and install the exact pins into a virtualenv. Every dependency ships a
# manylinux wheel, so no compiler is installed here either.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/pd-extproc
COPY pyproject.toml constraints.txt README.md ./
COPY extproc ./extproc
# --only-binary: a dependency without a wheel fails the build instead of pulling in a compiler.
RUN /opt/pd-extproc/bin/pip install --only-binary=:all: -c constraints.txt . \
    && /opt/pd-extproc/bin/pip uninstall -y pip \
    && /opt/pd-extproc/bin/pd-extproc serve --help > /dev/null

# Final stage: the interpreter, the virtualenv and nothing else; runs as an unprivileged user.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pd-extproc" \
      org.opencontainers.image.description="Envoy ext_proc service for disaggregated prefill/decode LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/pd-extproc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 pd-extproc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin pd-extproc \
    && install -d -o 10001 -g 10001 -m 0750 /var/run/pd-extproc
COPY --from=build /opt/pd-extproc /opt/pd-extproc
USER 10001:10001
# 9190: /metrics, /healthz, /readyz (PD_EXTPROC_METRICS_LISTEN). The ext_proc gRPC listener is
# PD_EXTPROC_GRPC_LISTEN: a Unix socket under /var/run/pd-extproc (shared with Envoy) or host:port.
EXPOSE 9190
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('PD_EXTPROC_METRICS_LISTEN', '0.0.0.0:9190').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pd-extproc"]
CMD ["serve"]
