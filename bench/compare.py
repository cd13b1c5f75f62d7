"""Overhead side by side: the origin direct, through Ponto, and through LiteLLM, in one run.

    .venv/bin/python -m bench.compare [--quick] [--no-litellm] [--out PATH]

What runs where (two CPUs): the server under test (Ponto's proxy or LiteLLM's,
one process, one worker) alone on CPU 0; the origin simulator, the load
generator, etcd and Ponto's control plane on CPU 1. "direct" sends the same
requests straight to the origin, so "added" latency is what the extra hop and
the proxy's own work cost. The origin simulator answers with no artificial
delay (TTFT 0, tokens back to back), so the difference is proxy overhead.

How it measures (bench/loadgen.py): open loop at fixed rates, requests evenly
spaced at t0 + i/rate, latency from each request's due time; every phase
alternates the targets in rounds so that they share the machine's state; each
request carries its own prompt (no cache can answer a repeat). A rate far above
a target's maximum gets a short probe that shows it failing, not a full run.
The maximum rate comes from a closed loop (N connections back to back), and is
checked with an open loop at 80 % of it (50 % if that does not hold: under 1 %
errors and p99 under 1 s). "Per core" divides a throughput by the CPU
the server process used meanwhile (utime + stime over the measured window), so
it holds even when CPU 1 (origin + generator) is the bottleneck. Peak RSS is
VmHWM of each server's process tree at the end.

Phases: max (closed loop), 100/s and 1,000/s non-streaming, 100/s streaming
(TTFT = first SSE event), sustained (80 % or 50 % of each target's max); and,
if LiteLLM cannot hold 100/s, the three again at half its max, for a fair ratio.

Ponto runs with API-key auth, rate limits and its exact cache on (see
configure_ponto_features; --ponto-features none for the bare path); LiteLLM
with its master key (see bench/litellm_env.py).

Prints one table and the issue's goals; writes JSON (default
docs/benchmarks/overhead.json, none with --quick) for bench/report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import grpc

from bench import litellm_env
from bench.loadgen import LoadGenerator, LoadResult, LoadSpec, merge, summarize
from ponto.devenv import Managed, free_port
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

Header = tuple[tuple[str, str], ...]

SERVER_CPU = 0  # the proxy under test, alone
LOAD_CPU = 1  # origin, load generator, etcd, control plane
MODEL = "sim-small"
DEFAULT_OUT = Path("docs/benchmarks/overhead.json")
# "{i}" becomes each request's index: distinct prompts, so no cache answers a repeat.
# temperature 0: deterministic, so Ponto's cache looks each request up (and misses).
BODY = json.dumps(
    {"model": MODEL, "max_tokens": 8, "temperature": 0,
     "messages": [{"role": "user", "content": "ping {i}"}]}
).encode()  # fmt: skip
STREAM_BODY = json.dumps(
    {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "count to sixteen {i}"}],
    }
).encode()
MAX_ERRORS = 0.01  # "sustained" means under 1 % errors ...
SUSTAINED_P99_MS = 1000.0  # ... and no queue building up
OVERLOAD = 1.5  # an open-loop rate over 1.5x a target's closed-loop max gets a short probe
PROBE_S = 2.0  # duration and timeout of such a probe
MAX_OPEN_S = 30.0  # ... but no open-loop run lasts longer than this


# ---------------------------------------------------------------- processes


def cpus_available() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """Pin this thread to `cpus` for the block; processes started inside inherit it."""
    if cpus is None or not cpus_available():
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def pin_tree(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid and its descendants (threads made later inherit it)."""
    if not cpus_available():
        return
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), cpus)


def status_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in kB (VmHWM, VmRSS); 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_mb(pid: int, key: str) -> float:
    return round(sum(status_kb(p, key) for p in process_tree(pid)) / 1024, 1)


# ---------------------------------------------------------------- targets


@dataclass
class Target:
    """Something to send chat completions to, with the process that serves them."""

    key: str  # direct | ponto | litellm
    label: str
    url: str
    pid: int  # the server process (its tree is measured)
    headers: Header = ()
    rss_start_mb: float = 0.0

    def pids(self) -> tuple[int, ...]:
        return tuple(process_tree(self.pid))


def start_ponto(fleet: Fleet, proxy_args: Sequence[str] = ()) -> tuple[Managed, Managed]:
    """etcd, one control plane, one origin (no delays) and one proxy, which runs alone on
    SERVER_CPU; returns (origin, proxy) once the proxy serves the origin."""
    fleet.start_etcd()
    fleet.start_control()
    fleet.add_region(RegionDef("local", 0.0, 0.0))
    origin = fleet.start_origin("origin", "local", models=(MODEL,))
    fleet.add_origin("origin", "local", fleet.origin_url("origin"), models=(MODEL,))
    table = fleet.table_version(origins=1)
    with affinity({SERVER_CPU}):
        proxy = fleet.start_proxy("proxy", "local", extra=["--log-level", "WARNING", *proxy_args])
    pin_tree(proxy.proc.pid, {SERVER_CPU})
    fleet.wait_proxies_at(table)
    return origin, proxy


def configure_ponto_features(fleet: Fleet, features: str) -> tuple[Header, str]:
    """Turn on what a production proxy runs per request; say what was turned on.

    "auth-limits-cache" (issue 8 asks for >= 8,000 req/s per core with these
    on): a tenant with request and token limits far above the load, so every
    request is counted but none refused; an exact cache (requests are
    deterministic, temperature 0, and each has its own prompt, so every lookup
    runs and misses); and an API key that every request presents. Returns the headers Ponto's
    requests need. If the Admin API lacks a call, runs with defaults and says so.
    """
    if features == "none":
        return (), "defaults (no auth, rate limit or cache)"
    try:
        tenant = pb.Tenant(
            name="bench",
            limits=pb.Limits(rpm=10**9, tpm=10**12),
            cache=pb.CachePolicy(mode="exact"),
        )
        admin = fleet.admin()
        admin.PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=True), timeout=10)
        created = admin.CreateKey(
            apb.CreateKeyRequest(
                tenant="bench", description="bench/compare.py", limits=pb.Limits(rpm=10**9)
            ),
            timeout=10,
        )
        key_id = created.key.id
        fleet.wait_proxies_at(fleet.wait_table(lambda t: any(k.id == key_id for k in t.keys)))
    except (AttributeError, ValueError, grpc.RpcError) as exc:
        print(f"Ponto features not configured ({exc}); measuring defaults", file=sys.stderr)
        return (), f"defaults: could not configure auth, limits and cache ({exc})"
    return (
        (("Authorization", f"Bearer {created.secret}"),),
        "API key auth, rate limits (not binding) and exact-cache lookup on (every lookup misses)",
    )


def wait_ready(fleet: Fleet, name: str, timeout: float = 15.0) -> None:
    """Until proxy `name` answers /readyz: it serves a table and, when tenants have
    limits, holds its share of them (before that it answers 429)."""
    url = f"http://{fleet.proxies[name].address}/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"proxy {name} not ready (/readyz) after {timeout:.0f} s")


def check(target: Target, body: bytes = BODY, timeout: float = 30.0) -> None:
    """One request must succeed before any measuring (catches a misconfiguration)."""
    request = urllib.request.Request(
        target.url,
        data=body.replace(b"{i}", b"check"),
        headers={"content-type": "application/json", **dict(target.headers)},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{target.label}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc


def settle(target: Target, limit: float = 20.0) -> None:
    """After an overload, wait until the server answers promptly again (its backlog drained)."""
    deadline = time.monotonic() + limit
    quick_in_a_row = 0
    while time.monotonic() < deadline and quick_in_a_row < 3:
        t0 = time.monotonic()
        try:
            check(target, timeout=max(0.5, min(5.0, deadline - t0)))
        except (OSError, RuntimeError):
            quick_in_a_row = 0
            time.sleep(0.1)
            continue
        quick_in_a_row = quick_in_a_row + 1 if time.monotonic() - t0 < 0.2 else 0


# ---------------------------------------------------------------- phases


@dataclass(frozen=True)
class Plan:
    rounds: int
    open_s: float
    closed_s: float
    warmup: float
    connections: int
    rates: tuple[float, ...]
    stream_rate: float
    sustained: bool
    timeout: float = 5.0
    min_samples: int = 400  # open-loop runs last long enough for this many requests ...
    settle_s: float = 20.0  # longest wait for an overloaded server's backlog to drain


FULL = Plan(
    rounds=2,
    open_s=10.0,
    closed_s=8.0,
    warmup=1.0,
    connections=16,
    rates=(100.0, 1000.0),
    stream_rate=100.0,
    sustained=True,
)
QUICK = Plan(
    rounds=1,
    open_s=2.0,
    closed_s=2.0,
    warmup=0.5,
    connections=16,
    rates=(100.0, 1000.0),
    stream_rate=100.0,
    sustained=False,
    timeout=2.0,
    min_samples=0,
    settle_s=5.0,
)


@dataclass
class Phase:
    name: str
    mode: str
    stream: bool
    rate: float | None  # None: closed loop, or a rate per target
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


class Runner:
    def __init__(
        self, gen: LoadGenerator, targets: list[Target], origin_pid: int, plan: Plan
    ) -> None:
        self.gen = gen
        self.targets = targets
        self.origin_pid = origin_pid
        self.plan = plan
        # Closed-loop throughput per target, once measured: an open-loop rate far
        # above it only needs a short probe to show that the target fails there.
        self.maxima: dict[str, float] = {}

    def overloaded(self, target: Target, rate: float) -> bool:
        best = self.maxima.get(target.key)
        return best is not None and rate > OVERLOAD * best

    def spec(
        self, target: Target, *, mode: str, rate: float, stream: bool, probe: bool = False
    ) -> LoadSpec:
        p = self.plan
        if mode == "closed":
            duration = p.closed_s / p.rounds
        else:
            # Enough requests for a p99 that is not just the maximum, within reason.
            duration = max(p.open_s, min(MAX_OPEN_S, p.min_samples / rate)) / p.rounds
        return LoadSpec(
            url=target.url,
            body=STREAM_BODY if stream else BODY,
            headers=target.headers,
            mode="closed" if mode == "closed" else "open",
            rate=rate,
            connections=p.connections if mode == "closed" else 0,
            duration=PROBE_S if probe else duration,
            warmup=min(p.warmup, 0.5) if probe else p.warmup,
            timeout=PROBE_S if probe else p.timeout,
            stream=stream,
            cpu=LOAD_CPU if cpus_available() else None,
            watch_pids=(*target.pids(), self.origin_pid),
        )

    def phase(
        self,
        name: str,
        *,
        mode: str,
        stream: bool = False,
        rate: float | Callable[[Target], float] = 0.0,
        targets: Sequence[Target] | None = None,
    ) -> Phase:
        """Run every target, alternating them over the plan's rounds; results merged."""
        chosen = list(targets or self.targets)
        fixed = None if callable(rate) else rate
        phase = Phase(name, mode, stream, fixed if mode == "open" else None)
        runs: dict[str, list[LoadResult]] = {t.key: [] for t in chosen}
        started = time.monotonic()
        for round_ in range(self.plan.rounds):
            for target in chosen:
                r = rate(target) if callable(rate) else rate
                probe = mode == "open" and self.overloaded(target, r)
                if probe and round_ > 0:
                    continue  # one short probe is enough to show the failure
                spec = self.spec(target, mode=mode, rate=r, stream=stream, probe=probe)
                try:
                    result = self.gen.run(spec)
                except (ConnectionError, OSError) as exc:
                    # The server is gone or refuses connections: a failed run, not a crash.
                    print(f"  {name}: {target.label}: {exc}", file=sys.stderr)
                    result = LoadResult(spec=spec, window=(0.0, 0.0))
                runs[target.key].append(result)
                if result.error_ratio() > 0 or _p99(result) > 1.0:
                    settle(target, self.plan.settle_s)
        for target in chosen:
            phase.results[target.key] = self._summary(target, merge(runs[target.key]))
        print(f"  {name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
        return phase

    def _summary(self, target: Target, result: LoadResult) -> dict[str, Any]:
        s: dict[str, Any] = summarize(result)
        elapsed = result.elapsed
        server_pids = [p for p in result.watched_cpu_s if p != self.origin_pid]
        if target.key == "direct":
            server_pids = [self.origin_pid]
        server_cpu = sum(result.watched_cpu_s[p] for p in server_pids)
        origin_cpu = result.watched_cpu_s.get(self.origin_pid, math.nan)
        s["rate"] = result.spec.rate if result.spec.mode == "open" else None
        s["server_cpu"] = _round(server_cpu / elapsed, 3) if elapsed else None
        s["origin_cpu"] = _round(origin_cpu / elapsed, 3) if elapsed else None
        s["cpu_us_per_request"] = _round(server_cpu / result.ok * 1e6, 1) if result.ok else None
        s["per_core"] = (
            _round(result.throughput() / (server_cpu / elapsed), 0)
            if elapsed and server_cpu > 0
            else None
        )
        s.pop("watched_cpu", None)
        return s


def _p99(result: LoadResult) -> float:
    latencies = sorted(result.latency())
    return latencies[int(0.99 * (len(latencies) - 1))] if latencies else math.inf


def _round(value: float, digits: int) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


# ---------------------------------------------------------------- report


def _get(phase: Phase | None, key: str, *path: str) -> float | None:
    if phase is None or key not in phase.results:
        return None
    value: Any = phase.results[key]
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, int | float) else None


def _ok(phase: Phase | None, key: str) -> bool:
    ratio = _get(phase, key, "error_ratio")
    return ratio is not None and ratio < MAX_ERRORS


def _held(phase: Phase | None, key: str) -> bool:
    """A rate is sustained when under 1 % fail and the queue does not grow: a p99
    of seconds from the due time means requests were waiting, not being served."""
    p99 = _get(phase, key, "latency_ms", "p99")
    return _ok(phase, key) and p99 is not None and p99 < SUSTAINED_P99_MS


def added(phase: Phase | None, key: str, q: str, metric: str = "latency_ms") -> float | None:
    """Target's percentile minus direct's, in ms; None if either failed the phase."""
    if not (_ok(phase, key) and _ok(phase, "direct")):
        return None
    mine, base = _get(phase, key, metric, q), _get(phase, "direct", metric, q)
    return None if mine is None or base is None else round(mine - base, 4)


def _fmt(value: float | None, digits: int = 3, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _cell(phase: Phase | None, key: str, fn: Callable[[], str]) -> str:
    if phase is None or key not in phase.results:
        return "n/a"
    if not _ok(phase, key):
        ratio = _get(phase, key, "error_ratio") or 0.0
        kinds: dict[str, int] = phase.results[key].get("errors") or {}
        worst = max(kinds, key=lambda kind: kinds[kind]) if kinds else "errors"
        return f"fails: {ratio:.0%} {worst}"
    return fn()


def figure(value: float) -> str:
    """A number with the digits it deserves: 12,345 / 12.35 / 0.123."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def _times(a: float | None, b: float | None, word: str) -> str:
    """'N x word' for a/b, when both are positive."""
    if a is None or b is None or a <= 0 or b <= 0:
        return "-"
    return f"{a / b:,.1f}x {word}"


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def render(self) -> str:
        widths = [
            max(len(r[i]) for r in [self.columns, *self.rows]) for i in range(len(self.columns))
        ]
        lines = []
        for n, row in enumerate([self.columns, *self.rows]):
            first = row[0].ljust(widths[0])
            rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join([first, *rest]))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def build_table(
    targets: list[Target], phases: dict[str, Phase], rss: dict[str, float], rates: Sequence[float]
) -> tuple[Table, dict[str, Any]]:
    """The printed table (one column per target) and the LiteLLM/Ponto ratios."""
    keys = [t.key for t in targets]
    has_litellm = "litellm" in keys
    table = Table(["", *[t.label for t in targets], *(["LiteLLM vs Ponto"] if has_litellm else [])])
    ratios: dict[str, Any] = {}

    def row(label: str, cell: Callable[[str], str], ratio: str = "") -> None:
        table.add(label, *[cell(k) for k in keys], *([ratio] if has_litellm else []))

    def latency_rows(phase: Phase | None, title: str, metric: str = "latency_ms") -> None:
        if phase is None:
            return
        for q in ("p50", "p99"):

            def value(k: str, q: str = q) -> str:
                return _cell(phase, k, lambda: _fmt(_get(phase, k, metric, q)))

            row(f"{title} {q} (ms)", value)
        for q in ("p50", "p99"):
            a_p, a_l = added(phase, "ponto", q, metric), added(phase, "litellm", q, metric)
            ratios[f"{phase.name}_added_{metric}_{q}"] = (
                round(a_l / a_p, 2) if a_p is not None and a_l is not None and a_p > 0 else None
            )

            def extra(k: str, q: str = q) -> str:
                if k == "direct":
                    return "-"
                return _cell(phase, k, lambda: _fmt(added(phase, k, q, metric)))

            row(f"  added {q} (ms)", extra, _times(a_l, a_p, "more"))

        def late(k: str) -> str:
            return _fmt(_get(phase, k, "lateness_ms", "p99"))

        # The generator's own delay in sending (CPU 1 busy); latencies include it.
        row("  sent late, p99 (ms)", late)

    for rate in rates:
        latency_rows(phases.get(f"open-{rate:g}"), f"latency @ {rate:,.0f}/s")
    pace = phases.get("ratio")
    if pace is not None and pace.rate is not None:
        latency_rows(pace, f"latency @ {pace.rate:,.0f}/s (LiteLLM's pace)")
    stream = phases.get("stream")
    if stream is not None and stream.rate is not None:
        latency_rows(stream, f"TTFT, streams @ {stream.rate:,.0f}/s", "ttfb_ms")
    mx = phases.get("max")
    if mx is not None:
        conns = _get(mx, "direct", "connections") or 0

        def throughput(k: str) -> str:
            text = _fmt(_get(mx, k, "throughput"), 0)
            return text if _ok(mx, k) else f"{text} ({_get(mx, k, 'error_ratio') or 0:.0%} err)"

        row(f"max rate, closed loop, {conns:.0f} conns (req/s)", throughput)
        row("  server CPU busy meanwhile", lambda k: _fmt(_get(mx, k, "server_cpu"), 2))
        row("  origin CPU busy meanwhile", lambda k: _fmt(_get(mx, k, "origin_cpu"), 2))
        pc_p, pc_l = _get(mx, "ponto", "per_core"), _get(mx, "litellm", "per_core")
        ratios["per_core"] = round(pc_p / pc_l, 2) if pc_p and pc_l else None
        row(
            "  req/s per core of the server",
            lambda k: _cell(mx, k, lambda: _fmt(_get(mx, k, "per_core"), 0)),
            _times(pc_p, pc_l, "fewer"),
        )
        cpu_p = _get(mx, "ponto", "cpu_us_per_request")
        cpu_l = _get(mx, "litellm", "cpu_us_per_request")
        ratios["cpu_per_request"] = round(cpu_l / cpu_p, 2) if cpu_p and cpu_l else None
        row(
            "  server CPU per request (us)",
            lambda k: _fmt(_get(mx, k, "cpu_us_per_request"), 0),
            _times(cpu_l, cpu_p, "more"),
        )
    sus = phases.get("sustained")
    if sus is not None:
        row(
            "sustained: 80 % (else 50 %) of max (req/s)",
            lambda k: _fmt(_get(sus, k, "rate"), 0),
        )
        row("  errors", lambda k: _fmt((_get(sus, k, "error_ratio") or 0) * 100, 2, " %"))
        row("  held (errors < 1 %, p99 < 1 s)", lambda k: "yes" if _held(sus, k) else "no")
        row("  latency p99 (ms)", lambda k: _fmt(_get(sus, k, "latency_ms", "p99")))
    row(
        "peak RSS (MB)",
        lambda k: _fmt(rss.get(k), 1),
        _times(rss.get("litellm"), rss.get("ponto"), "more"),
    )
    ratios["rss"] = (
        round(rss["litellm"] / rss["ponto"], 2) if rss.get("litellm") and rss.get("ponto") else None
    )
    return table, ratios


def goals(
    phases: dict[str, Phase], rss: dict[str, float], ratios: dict[str, Any], features: str
) -> list[dict[str, Any]]:
    """The issue's targets for Ponto, each with its measured value and verdict."""
    at1000 = phases.get("open-1000")
    pace = "ratio" if "ratio" in phases else "open-100"
    checks: list[tuple[str, float | None, Callable[[float], bool], str]] = [
        (
            "Ponto added p50 at 1,000/s under 0.3 ms",
            added(at1000, "ponto", "p50"),
            lambda v: v < 0.3,
            "ms",
        ),
        (
            "Ponto added p99 at 1,000/s under 1 ms",
            added(at1000, "ponto", "p99"),
            lambda v: v < 1.0,
            "ms",
        ),
        (
            f"Ponto at least 8,000 req/s per core [{features}]",
            _get(phases.get("max"), "ponto", "per_core"),
            lambda v: v >= 8000,
            "req/s",
        ),
        ("Ponto peak RSS under 80 MB", rss.get("ponto"), lambda v: v < 80, "MB"),
        (
            "at least 20x less added latency than LiteLLM (p50, same rate)",
            ratios.get(f"{pace}_added_latency_ms_p50"),
            lambda v: v >= 20,
            "x",
        ),
    ]
    return [
        {"goal": g, "value": v, "unit": unit, "pass": None if v is None else test(v)}
        for g, v, test, unit in checks
    ]


# ---------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for dist in ("aiohttp", "uvloop", "orjson", "grpcio"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    pinned = cpus_available()
    if pinned:
        os.sched_setaffinity(0, {LOAD_CPU})  # everything started from here inherits CPU 1
    report: dict[str, Any] = {
        "name": "overhead",
        "title": "Proxy overhead: direct vs Ponto vs LiteLLM",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
        "versions": versions(),
        "placement": (
            f"CPU {SERVER_CPU}: server under test alone; CPU {LOAD_CPU}: origin, load generator, "
            "etcd, control plane"
            if pinned
            else "not pinned (fewer than 2 CPUs)"
        ),
        "plan": asdict(plan),
    }
    started = time.monotonic()
    litellm: litellm_env.LiteLLMProxy | None = None
    with tempfile.TemporaryDirectory(prefix="ponto-compare-") as tmp, Fleet(Path(tmp)) as fleet:
        try:
            origin, proxy = start_ponto(fleet, args.ponto_arg)
            headers, features = configure_ponto_features(fleet, args.ponto_features)
            headers += tuple(_header(h) for h in args.ponto_header)
            wait_ready(fleet, "proxy")
            targets = [
                Target(
                    "direct",
                    "direct",
                    fleet.origin_url("origin") + "/chat/completions",
                    origin.proc.pid,
                ),
                Target(
                    "ponto",
                    "Ponto",
                    fleet.proxy_url("proxy") + "/chat/completions",
                    proxy.proc.pid,
                    headers,
                ),
            ]
            report["ponto_features"] = features
            report["litellm"] = {"version": litellm_env.LITELLM_VERSION, "error": None}
            if args.no_litellm:
                report["litellm"]["error"] = "skipped (--no-litellm)"
            else:
                try:
                    litellm = litellm_env.start(
                        Path(tmp) / "litellm",
                        fleet.origin_url("origin"),
                        port=free_port(),
                        models=(MODEL,),
                        cpus={SERVER_CPU} if pinned else None,
                    )
                    pin_tree(litellm.pid, {SERVER_CPU})
                    key = ("Authorization", f"Bearer {litellm_env.MASTER_KEY}")
                    url = litellm.base_url + "/chat/completions"
                    targets.append(Target("litellm", "LiteLLM", url, litellm.pid, (key,)))
                except litellm_env.LiteLLMUnavailable as exc:
                    report["litellm"]["error"] = str(exc)
                    print(f"\nLiteLLM NOT MEASURED: {exc}\n", file=sys.stderr)
            for t in targets:
                check(t)
                check(t, STREAM_BODY)
                t.rss_start_mb = tree_mb(t.pid, "VmRSS")
            print(
                f"started in {time.monotonic() - started:.0f} s; measuring "
                f"{', '.join(t.label for t in targets)}",
                file=sys.stderr,
            )
            phases = measure(targets, origin.proc.pid, plan)
            rss = {t.key: tree_mb(t.pid, "VmHWM") for t in targets}
        finally:
            if litellm is not None:
                litellm.stop()
    table, ratios = build_table(targets, phases, rss, plan.rates)
    report["targets"] = {
        t.key: {"label": t.label, "rss_start_mb": t.rss_start_mb, "rss_peak_mb": rss[t.key]}
        for t in targets
    }
    report["phases"] = [
        {"name": p.name, "mode": p.mode, "stream": p.stream, "rate": p.rate, "results": p.results}
        for p in phases.values()
    ]
    report["ratios"] = ratios
    report["goals"] = goals(phases, rss, ratios, report["ponto_features"])
    report["table"] = {"columns": table.columns, "rows": table.rows}
    report["text"] = table.render()
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def measure(targets: list[Target], origin_pid: int, plan: Plan) -> dict[str, Phase]:
    phases: dict[str, Phase] = {}
    with LoadGenerator() as gen:
        runner = Runner(gen, targets, origin_pid, plan)
        phases["max"] = runner.phase("max", mode="closed")
        runner.maxima = {k: r.get("throughput") or 0.0 for k, r in phases["max"].results.items()}
        for rate in plan.rates:
            phases[f"open-{rate:g}"] = runner.phase(f"open-{rate:g}", mode="open", rate=rate)
        phases["stream"] = runner.phase("stream", mode="open", stream=True, rate=plan.stream_rate)
        if plan.sustained:
            phases["sustained"] = sustained(runner)
        lite = phases["max"].results.get("litellm")
        low = plan.rates[0]
        if plan.sustained and lite and not _ok(phases.get(f"open-{low:g}"), "litellm"):
            pace = max(5.0, math.floor(0.5 * (lite.get("throughput") or 10.0)))
            phase = runner.phase("ratio", mode="open", rate=pace)
            phases["ratio"] = phase
    return phases


def sustained(runner: Runner) -> Phase:
    """Open loop at 80 % of each target's closed-loop max; where that does not hold
    (see _held), at 50 %. Each target's entry is the higher rate that held."""
    maxima = runner.maxima
    first = runner.phase(
        "sustained", mode="open", rate=lambda t: max(5.0, round(0.8 * maxima[t.key]))
    )
    failed = [t for t in runner.targets if not _held(first, t.key)]
    if failed:
        second = runner.phase(
            "sustained-50",
            mode="open",
            rate=lambda t: max(5.0, round(0.5 * maxima[t.key])),
            targets=failed,
        )
        for t in failed:
            if _held(second, t.key):
                first.results[t.key] = {**second.results[t.key], "fraction_of_max": 0.5}
    for result in first.results.values():
        result.setdefault("fraction_of_max", 0.8)
    return first


def _finite(value: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _header(value: str) -> tuple[str, str]:
    name, sep, rest = value.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {value!r}")
    return name.strip(), rest.strip()


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"\n## {report['title']}")
    print(
        f"{m['cpu']}, {m['cpus']} CPUs, load average before {m['loadavg_before'][0]}; "
        f"{report['placement']}"
    )
    lite = report["litellm"]
    setup = lite["error"] or "1 worker, master key, logging and telemetry off"
    print(f"Ponto: {report['ponto_features']}. LiteLLM {lite['version']}: {setup}")
    print("Open loop, evenly spaced; latency from each request's due time; added = minus direct.\n")
    print(report["text"])
    print("\nGoals (issue 8):")
    for g in report["goals"]:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[g["pass"]]
        value = "not measured" if g["value"] is None else f"{figure(g['value'])} {g['unit']}"
        print(f"  [{mark}] {g['goal']}: {value}")
    print(f"\n{report['seconds']:.0f} s in all")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="a 1-minute smoke run (no JSON unless --out)"
    )
    p.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    p.add_argument(
        "--ponto-features",
        choices=("auth-limits-cache", "none"),
        default="auth-limits-cache",
        help="what Ponto runs per request (default: auth, rate limits and cache lookup on)",
    )
    p.add_argument(
        "--out", type=Path, help=f"JSON results (default {DEFAULT_OUT}; none if --quick)"
    )
    p.add_argument(
        "--ponto-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra ponto-proxy argument (repeatable), e.g. --ponto-arg=--flag",
    )
    p.add_argument(
        "--ponto-header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra header on Ponto's requests (repeatable), e.g. an API key",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up processes on SIGTERM too
    report = run(args)
    print_report(report)
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(report), indent=2, allow_nan=False, default=str) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
