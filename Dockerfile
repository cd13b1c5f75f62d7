# syntax=docker/dockerfile:1
# One image for every Ponto process: ponto-control, ponto-proxy, pontoctl and
# ponto-origin-sim; the container's command picks one (the Helm chart sets it).
#
#   docker build --build-arg BUILD_COMMIT=$(git rev-parse HEAD) -t ponto:dev .
#
# BUILD_COMMIT is optional: with it, every process reports its version as
# 0.1.0+<commit> (pontoctl get proxies, get controlplanes), so a rolling
# upgrade shows which processes run the new build (ponto/version.py).
#   docker run --rm ponto:dev ponto-proxy --help
#
# Two stages. The builder turns the dependencies and the project into wheels and
# installs them into a virtual environment at /opt/ponto. The runtime stage copies
# only that environment onto a clean base: no compiler, no wheel cache, no pip, no
# source tree. Both stages use the same base image, so the environment's interpreter
# link (/usr/local/bin/python3.11) is valid in both.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first, read from pyproject.toml: this layer is rebuilt only when
# pyproject.toml changes, not on every source edit.
# hnswlib has no wheel for every platform and builds from source: a C++ compiler
# in this stage only, and no -march=native, so the image runs on any x86-64.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV HNSWLIB_NO_NATIVE=1
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip wheel --wheel-dir /wheels --requirement requirements.txt
COPY controlplane controlplane
COPY dataplane dataplane
COPY ponto ponto
ARG BUILD_COMMIT=""
RUN if [ -n "$BUILD_COMMIT" ]; then echo "$BUILD_COMMIT" > ponto/_build.txt; \
    else rm -f ponto/_build.txt; fi \
    && pip wheel --no-deps --wheel-dir /wheels . \
    && python -m venv /opt/ponto \
    && /opt/ponto/bin/pip install --no-index --find-links /wheels ponto \
    && /opt/ponto/bin/pip uninstall --yes pip setuptools \
    && /opt/ponto/bin/python -m compileall -q -o 0 -o 2 -x '/tests?/' /opt/ponto/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="ponto" \
      org.opencontainers.image.description="Edge layer for LLM inference: ponto-control, ponto-proxy, pontoctl, ponto-origin-sim" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric user, so Kubernetes can check runAsNonRoot; the chart runs as it.
RUN groupadd --system --gid 10001 ponto \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin ponto
COPY --from=builder /opt/ponto /opt/ponto
# Bytecode is compiled at build time, for the default level and for
# PYTHONOPTIMIZE=2 (docs/architecture.md, "Memory"), the standard library's
# too: the root filesystem may be read-only, and a module compiled at start
# leaves the compiler's garbage in the heap (some 2 MB of a proxy's RSS).
# Not the base image's site-packages (pip, setuptools): the venv never
# imports them, and their bytecode at two levels is some 23 MB.
RUN python -m compileall -q -o 0 -o 2 -x '/(tests?|site-packages)/' /usr/local/lib/python3.11
ENV PATH=/opt/ponto/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
# 7000: ponto-control (gRPC); 8080: ponto-proxy (HTTP, /metrics included).
EXPOSE 7000 8080
CMD ["ponto-proxy", "--help"]
