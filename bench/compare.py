"""Overhead side by side, in one run: the origin direct, the bare pass-through, Ponto, LiteLLM.

    .venv/bin/python -m bench.compare [--quick] [--no-litellm] [--ponto-features none]
        [--ponto-workers N] [--out PATH]

What is compared. "direct" sends the requests straight to the origin, so each
proxy's *added* latency is what its extra hop and its own work cost. The
origin simulator answers with no artificial delay (TTFT 0, tokens back to
back), so differences are proxy overhead. "pass-through" (bench/passthrough.py)
is the floor: an aiohttp + uvloop reverse proxy on Ponto's stack, run the way
Ponto runs (one ClientSession on a keep-alive connector, handler_cancellation,
no access log, one process), that forwards the body and Content-Type and
relays the answer (SSE chunk by chunk) and does nothing else. Ponto over the
pass-through ("Ponto / pass-through" in the table) is the cost of Ponto's own
work: routing, auth, limits, cache, metrics. Ponto runs with API-key auth,
rate limits and its exact cache on (configure_ponto_features; its exact cache
bounded at 32 MB); --ponto-features none measures its bare path. LiteLLM runs
with its master key (bench/litellm_env.py).

What runs where (two CPUs): each server under test (pass-through, Ponto,
LiteLLM: one process, one worker) alone on CPU 0; the origin simulator, the
canned origin, the load generators, etcd and Ponto's control plane on CPU 1.

Two origins. The simulator (ponto.originsim) is the origin of every latency
phase and of "max". The canned origin (bench/canned.py: Debian's nginx
answering one fixed chat completion for model "canned", some 13 us of CPU per
request) is the origin of "cpu" and of the workers phase. Why: CPU per request
is the server's own cost only when the server is saturated (below that, every
request also pays the wake-ups of an idle event loop, and the figure depends on
how far below). The simulator is Python and costs CPU 1 about as much per
request as the pass-through costs CPU 0, so against it CPU 1 (origin and
wrk) can saturate first and leave the server under test below its core's
capacity; against nginx the server under test is the bottleneck. Ponto
routes model "canned" to nginx (a second origin in its table) and the
simulator's model to the simulator; a second pass-through runs in front of
nginx.

How it measures. Server CPU per request and maximum throughput: wrk
(bench/wrk.py), a closed loop of N connections, each request with its own
prompt; CPU per request = the server's process tree's utime + stime over the
measured run (wrk's warm-up run is not in it) / answers; "per core" =
throughput / CPU busy. Latency: bench/loadgen.py, one request at
a time (a closed loop of one connection), and open loop at fixed rates
(requests evenly spaced at t0 + i/rate, latency from each request's due
time, so nothing is hidden by coordinated omission). Every phase alternates
the targets in rounds so that they share the machine's state, and every run
gets prompts of its own, so no cache answers a repeat (but the exact-cache
phase, which repeats one question on purpose). A rate far above a target's
maximum gets a short probe that shows it failing, not a full run. Peak RSS
is VmHWM of each server's process tree at the end.

Phases: max (wrk, simulator origin; its maxima set the open-loop probes and
the sustained rates); cpu (wrk, canned origin; direct is nginx itself,
LiteLLM is not in it: bench/litellm_env.py maps every model to one origin);
one at a time; exact-cache hit (Ponto, one question
repeated) against direct, twice: the usual origin beside the client, and a
second simulator alone on CPU 0 where the servers sit (the aim's comparison:
a call to a server on CPU 0 crosses CPUs twice, some 0.1 ms each here, and a
call to the origin beside the client none); 100/s and 1,000/s non-streaming;
100/s streaming (TTFT = first SSE event, and each server's CPU per stream of 16
tokens);
sustained (80 % or 50 % of each target's max); if
LiteLLM cannot hold 100/s, the latencies again at half its max, for a fair
ratio; with --ponto-workers N (N >= 2), a last phase where a one-worker Ponto
and the N-worker one get every CPU (shared with the canned origin and wrk,
which take little of them) for wrk.

Prints one table, the ratios, issue 8's goals and issue 17's aims (PASS or
MISS; a MISS never fails the run); writes JSON (default
docs/benchmarks/overhead.json, none with --quick) for bench/report.py.
Needs wrk and nginx (apt-get install -y wrk nginx-light; `make bench` installs both).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench import canned, litellm_env, wrk
from bench.compare_table import (
    SEAT,
    Phase,
    aims,
    build_table,
    figure,
    finite,
    goals,
    held,
    ok,
    scaling_table,
)
from bench.loadgen import LoadGenerator, LoadResult, LoadSpec, merge, summarize
from bench.procs import (
    CPUS_AT_START,
    affinity,
    cpus_available,
    largest_mb,
    pin_tree,
    process_tree,
    tree_mb,
)
from ponto.devenv import Managed, free_port, python_entry, spawn
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

Header = tuple[tuple[str, str], ...]

SERVER_CPU = 0  # the server under test, alone
LOAD_CPU = 1  # origins, load generators, etcd, control plane
MODEL = "sim-small"
DEFAULT_OUT = Path("docs/benchmarks/overhead.json")


def chat_body(model: str) -> bytes:
    """A non-streaming chat request for `model`; "{i}" becomes each request's index:
    distinct prompts, so no cache answers a repeat. temperature 0: deterministic,
    so Ponto's cache looks each request up (and misses)."""
    return json.dumps(
        {"model": model, "max_tokens": 8, "temperature": 0,
         "messages": [{"role": "user", "content": "ping {i}"}]}
    ).encode()  # fmt: skip


def conversation_body(model: str, kb: int) -> bytes:
    """A non-streaming chat request for `model` of about `kb` KB: a system
    prompt, then user turns of prose and assistant turns of prose with code
    (lines, indents: text whose lines the cache key reads and keeps), an
    agent's conversation, whose every turn the proxy reads: to check it,
    estimate its tokens, place it and key it. Last a user turn with "{i}"
    (each request's own, so no cache answers a repeat)."""
    question = " ".join(["The build failed again after the last change to the parser."] * 4)
    answer = (
        "The parser now keeps the line ending. Change it so:\n\n```python\n"
        "def feed(self, chunk: bytes) -> list[Event]:\n"
        "    if not chunk:\n        return []\n    return self._lines(chunk)\n```\n\n"
        "Then run the tests again."
    )
    messages = [{"role": "system", "content": "You are a careful coding assistant."}]
    while len(json.dumps(messages)) < kb * 1024:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": "And now? {i}"})
    return json.dumps(
        {"model": model, "max_tokens": 8, "temperature": 0, "messages": messages}
    ).encode()


BODY = chat_body(MODEL)
# The "cpu" and workers phases' requests: Ponto routes them to the canned origin.
CANNED_BODY = chat_body(canned.CANNED_MODEL)


def stream_body(tokens: int) -> bytes:
    """A streamed chat request for an answer of `tokens` tokens (the origin
    simulator makes max_tokens of them), each request unique ({i})."""
    return json.dumps(
        {
            "model": MODEL,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "count to sixteen {i}"}],
        }
    ).encode()


STREAM_BODY = stream_body(16)
# The exact-cache phase repeats this one question: after the first, every answer is a hit.
HIT_BODY = BODY.replace(b"{i}", b"asked again and again")
# Ponto's exact cache is bounded so that its peak RSS is that of a production
# worker with a small cache (issue 17: one worker < 80 MB with 32 MB of cache).
CACHE_MAX_MB = 32
PONTO_ARGS = ("--log-level", "WARNING", "--cache-max-mb", str(CACHE_MAX_MB))
# An empty limit bucket's refill to full (dataplane.ratelimit.limiter), and a margin.
BUCKETS_FILL_S = 62.0
CHAT = "chat.completions"  # the endpoint label of Ponto's chat completions in its metrics
OVERLOAD = 1.5  # an open-loop rate over 1.5x a target's closed-loop max gets a short probe
PROBE_S = 2.0  # duration and timeout of such a probe
MAX_OPEN_S = 30.0  # ... but no open-loop run lasts longer than this


# ---------------------------------------------------------------- targets


@dataclass
class Target:
    """Something to send chat completions to, with the process that serves them."""

    key: str  # direct | passthrough | ponto | litellm (ponto-1, ponto-N: scaling)
    label: str
    url: str
    pid: int  # the server process (its tree is measured)
    headers: Header = ()
    rss_start_mb: float = 0.0

    def pids(self) -> tuple[int, ...]:
        return tuple(process_tree(self.pid))


def start_ponto(
    fleet: Fleet, proxy_args: Sequence[str] = (), launcher: Sequence[str] = ()
) -> tuple[Managed, Managed]:
    """etcd, one control plane, one origin (no delays) and one proxy, which runs alone on
    SERVER_CPU with PONTO_ARGS (then `proxy_args`, which may override them) and
    `launcher` before its interpreter; returns (origin, proxy) once the proxy
    serves the origin."""
    fleet.start_etcd()
    fleet.start_control()
    fleet.add_region(RegionDef("local", 0.0, 0.0))
    origin = start_simulator(fleet)
    table = fleet.table_version(origins=1)
    proxy = start_proxy_alone(fleet, "proxy", proxy_args, launcher)
    fleet.wait_proxies_at(table)
    return origin, proxy


def start_simulator(fleet: Fleet) -> Managed:
    """The origin simulator (no delays) as origin "origin" of region "local",
    serving MODEL, on the caller's CPUs, registered with the control plane."""
    origin = fleet.start_origin("origin", "local", models=(MODEL,))
    fleet.add_origin("origin", "local", fleet.origin_url("origin"), models=(MODEL,))
    return origin


def start_seat_origin(fleet: Fleet) -> Managed:
    """A second origin simulator, "seat" (not in the route table), alone on
    SERVER_CPU: the bare origin of the exact-cache phase, called where the
    servers under test sit. The usual origin shares LOAD_CPU with the load
    generator, so a call to it crosses no CPU, where a call to any server on
    SERVER_CPU crosses two (some 0.1 ms each on this VM); against that origin a
    hit would be timed against an origin that skips the hop."""
    with affinity({SERVER_CPU}):
        seat = fleet.start_origin("seat", "local", models=(MODEL,))
    pin_tree(seat.proc.pid, {SERVER_CPU})
    return seat


def start_proxy_alone(
    fleet: Fleet, name: str, proxy_args: Sequence[str] = (), launcher: Sequence[str] = ()
) -> Managed:
    """Proxy `name` of region "local", alone on SERVER_CPU, with PONTO_ARGS then
    `proxy_args` (and `launcher` before its interpreter, as Fleet.start_proxy);
    its environment (PYTHONPATH: which Ponto it runs) is the caller's."""
    with affinity({SERVER_CPU}):
        proxy = fleet.start_proxy(
            name, "local", extra=[*PONTO_ARGS, *proxy_args], launcher=launcher
        )
    pin_tree(proxy.proc.pid, {SERVER_CPU})
    return proxy


def start_passthrough(fleet: Fleet, origin: str, name: str = "passthrough") -> Managed:
    """bench/passthrough.py in front of the origin at `origin` (HOST:PORT), alone on
    SERVER_CPU like the proxies; `name` names its files in the fleet's work dir.

    The caller owns the process (the fleet does not know it) and must stop it.
    """
    ready = fleet.workdir / f"{name}.addr"
    ready.unlink(missing_ok=True)
    argv = [*python_entry("bench.passthrough"), "--listen", "127.0.0.1:0",
            "--origin", f"http://{origin}", "--ready-file", str(ready)]  # fmt: skip
    with affinity({SERVER_CPU}):
        managed = spawn(name, argv, fleet.workdir, ready_file=ready)
    pin_tree(managed.proc.pid, {SERVER_CPU})
    return managed


def start_canned(fleet: Fleet, workdir: Path) -> canned.CannedOrigin:
    """The canned origin (nginx) on LOAD_CPU, registered as origin "canned" for
    CANNED_MODEL; returns once every proxy serves a table with it.

    The caller owns nginx and must stop it; `workdir` is its directory.
    """
    origin = canned.CannedOrigin(workdir, cpus={LOAD_CPU})  # affinity() skips it when unpinned
    origin.start()
    try:
        fleet.add_origin("canned", "local", origin.url, models=(canned.CANNED_MODEL,))
        fleet.wait_proxies_at(
            fleet.wait_table(lambda t: any(o.name == "canned" for o in t.origins))
        )
    except BaseException:
        origin.stop()
        raise
    return origin


def configure_ponto_features(fleet: Fleet, features: str) -> tuple[Header, str]:
    """Turn on what a production proxy runs per request; say what was turned on.

    "auth-limits-cache" (issue 8 asks for >= 8,000 req/s per core with these
    on): a tenant with request and token limits far above the load, so every
    request is counted but none refused; an exact cache (requests are
    deterministic, temperature 0, and each has its own prompt, so every lookup
    runs and misses); and an API key that every request presents. The cache
    keeps answers cut by max_tokens (store_truncated; BODY's all are), so every
    miss is stored as a production cache's would be and the cache fills up to
    its bound (CACHE_MAX_MB): peak RSS is that of a full cache. Returns the
    headers Ponto's requests need. If the Admin API lacks a call, runs with
    defaults and says so.
    """
    if features == "none":
        # Ponto's default cache policy still looks every request up (a miss), and keeps
        # no answer cut by max_tokens, so nothing is stored.
        return (), "defaults (no API keys or limits; exact-cache lookups that miss, nothing stored)"
    try:
        tenant = pb.Tenant(
            name="bench",
            limits=pb.Limits(rpm=10**9, tpm=10**12),
            cache=pb.CachePolicy(mode="exact", store_truncated=True),
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
        "API key auth, rate limits (not binding) and the exact cache on (every lookup misses and "
        f"every answer is stored; the cache is bounded at {CACHE_MAX_MB} MB)",
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


def cache_stats(address: str) -> dict[str, float]:
    """Ponto's exact-cache counters from its /metrics at `address` (its metrics
    port, Fleet.metrics_addresses): hit, miss, entries, bytes, evictions (0 for
    what is absent); {} if the proxy does not answer."""
    names = {
        'ponto_cache_requests_total{kind="exact",result="hit"}': "hit",
        'ponto_cache_requests_total{kind="exact",result="miss"}': "miss",
        "ponto_cache_entries": "entries",
        "ponto_cache_bytes": "bytes",
        "ponto_cache_evictions_total": "evictions",
    }
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


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


def check_until_ok(target: Target, limit: float = 20.0, body: bytes = BODY) -> None:
    """`check`, retried for up to `limit` seconds: a proxy that has just joined
    answers 429 for a limited key until the leader's next rebalance gives it a
    share that matches its demand (docs/rate-limits.md)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            check(target, body)
            return
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.25)


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
    closed_s: float  # wrk's measured seconds, over all rounds
    sequential_s: float  # one request at a time, over all rounds
    warmup: float
    connections: int  # wrk's
    rates: tuple[float, ...]
    stream_rate: float
    sustained: bool
    timeout: float = 5.0
    min_samples: int = 400  # open-loop runs last long enough for this many requests ...
    settle_s: float = 20.0  # longest wait for an overloaded server's backlog to drain

    def wrk_seconds(self) -> tuple[int, int]:
        """(measured, warm-up) whole seconds of one wrk round: wrk takes no fractions."""
        return max(1, round(self.closed_s / self.rounds)), max(1, math.ceil(self.warmup))


FULL = Plan(
    rounds=2,
    open_s=10.0,
    closed_s=8.0,
    sequential_s=10.0,
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
    sequential_s=2.0,
    warmup=0.5,
    connections=16,
    rates=(100.0, 1000.0),
    stream_rate=100.0,
    sustained=False,
    timeout=2.0,
    min_samples=0,
    settle_s=5.0,
)

BodyFor = Callable[[Target], bytes]


class Runner:
    """Runs phases against the targets; owns nothing but the generator it is given.

    Not thread-safe; one phase at a time.
    """

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
        self._runs = itertools.count()

    def overloaded(self, target: Target, rate: float) -> bool:
        best = self.maxima.get(target.key)
        return best is not None and rate > OVERLOAD * best

    def tagged(self, body: bytes) -> bytes:
        """`body` with a tag unique to this run before its {i}: loadgen numbers every
        run's requests from 0, and a prompt seen in an earlier run would be a cache hit."""
        return body.replace(b"{i}", b"r%d-{i}" % next(self._runs))

    def spec(
        self, target: Target, *, mode: str, rate: float, body: bytes, stream: bool, probe: bool
    ) -> LoadSpec:
        """mode "open": paced at `rate`; "sequential": one request at a time."""
        p = self.plan
        if mode == "sequential":
            duration = p.sequential_s / p.rounds
        else:
            # Enough requests for a p99 that is not just the maximum, within reason.
            duration = max(p.open_s, min(MAX_OPEN_S, p.min_samples / rate)) / p.rounds
        return LoadSpec(
            url=target.url,
            body=self.tagged(body),
            headers=target.headers,
            mode="closed" if mode == "sequential" else "open",
            rate=rate,
            connections=1 if mode == "sequential" else 0,
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
        body: BodyFor | None = None,
    ) -> Phase:
        """Run every target with bench/loadgen.py, alternating them over the plan's
        rounds; results merged. `body` picks a target's body (default BODY or STREAM_BODY)."""
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
                payload = body(target) if body else STREAM_BODY if stream else BODY
                spec = self.spec(
                    target, mode=mode, rate=r, body=payload, stream=stream, probe=probe
                )
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
        s.update(_cpu_figures(server_cpu, origin_cpu, elapsed, result.ok))
        s.pop("watched_cpu", None)
        return s


def wrk_phase(
    name: str,
    targets: Sequence[Target],
    origin_pid: int,
    plan: Plan,
    cpus: frozenset[int] | None = None,
    body: bytes = BODY,
) -> Phase:
    """Maximum rate: wrk's closed loop of `body` (its {i} made unique per request)
    against every target, alternating over the plan's rounds. wrk runs on `cpus`
    (None: this process's, CPU 1), one thread per CPU. `origin_pid` is the origin
    behind the targets (its CPU is reported beside each server's)."""
    seconds, warmup = plan.wrk_seconds()
    phase = Phase(name, "wrk", False, None)
    runs: dict[str, list[wrk.WrkResult]] = {t.key: [] for t in targets}
    started = time.monotonic()
    for _ in range(plan.rounds):
        for target in targets:
            spec = wrk.WrkSpec(
                url=target.url,
                body=body,
                headers=target.headers,
                connections=plan.connections,
                threads=len(cpus) if cpus else 1,
                duration=seconds,
                warmup=warmup,
                timeout=max(1, math.ceil(plan.timeout)),
                cpus=cpus,
                watch_pids=(target.pid, origin_pid),
            )
            try:
                result = wrk.run(spec)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                print(f"  {name}: {target.label}: {exc}", file=sys.stderr)
                settle(target, plan.settle_s)
                continue
            runs[target.key].append(result)
            if result.errors:
                settle(target, plan.settle_s)
    for target in targets:
        phase.results[target.key] = _wrk_summary(target, runs[target.key], origin_pid, plan)
    print(f"  {name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return phase


def _wrk_summary(
    target: Target, results: list[wrk.WrkResult], origin_pid: int, plan: Plan
) -> dict[str, Any]:
    """Rounds added up; latency percentiles are the mean of the rounds' (wrk's
    histograms are not merged), and are service times."""
    elapsed = sum(r.duration_s for r in results)
    ok_ = sum(r.ok for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for kind, n in r.errors.items():
            errors[kind] = errors.get(kind, 0) + n
    failed = sum(errors.values())
    attempts = sum(r.requests for r in results) + failed - errors.get("status", 0)
    server_cpu = sum(r.watched_cpu_s.get(target.pid, 0.0) for r in results)
    origin_cpu = sum(r.watched_cpu_s.get(origin_pid, 0.0) for r in results)
    latency = {
        q: round(sum(r.latency_us.get(q, 0.0) for r in results) / len(results) / 1e3, 4)
        for q in ("p50", "p90", "p99", "p99.9", "max", "mean")
    } if results else {}  # fmt: skip
    return {
        "mode": "wrk",
        "rate": None,
        "connections": plan.connections,
        "rounds": len(results),
        "duration_s": round(elapsed, 3),
        "requests": attempts,
        "ok": ok_,
        "errors": errors,
        "error_ratio": round(failed / attempts, 5) if attempts else 1.0,
        "throughput": round(ok_ / elapsed, 1) if elapsed else 0.0,
        "latency_ms": latency,
        **_cpu_figures(server_cpu, origin_cpu, elapsed, ok_),
    }


def _cpu_figures(server_cpu: float, origin_cpu: float, elapsed: float, ok_: int) -> dict[str, Any]:
    """CPU busy (cores), CPU per ok answer and answers per core-second of the server."""
    return {
        "server_cpu": _round(server_cpu / elapsed, 3) if elapsed else None,
        "origin_cpu": _round(origin_cpu / elapsed, 3) if elapsed else None,
        "cpu_us_per_request": _round(server_cpu / ok_ * 1e6, 1) if ok_ else None,
        "per_core": _round(ok_ / server_cpu, 0) if server_cpu > 0 else None,
    }


def _p99(result: LoadResult) -> float:
    latencies = sorted(result.latency())
    return latencies[int(0.99 * (len(latencies) - 1))] if latencies else math.inf


def _round(value: float, digits: int) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


@dataclass(frozen=True)
class CannedTargets:
    """The "cpu" phase's targets (nginx direct, a pass-through in front of it, Ponto
    asked for its model) and nginx's pid."""

    targets: list[Target]
    origin_pid: int


def measure(
    targets: list[Target],
    origin_pid: int,
    plan: Plan,
    *,
    ponto_cache: str | None,
    cpu: CannedTargets | None = None,
    seat: Target | None = None,
) -> dict[str, Phase]:
    """Every phase but scaling, in order (see the module docstring); the exact-cache
    phase only with `ponto_cache`, the metrics port of a Ponto whose cache is on, and
    against `seat` (the bare origin where the servers sit) too when given; "cpu"
    only with `cpu`."""
    phases: dict[str, Phase] = {}
    with LoadGenerator() as gen:
        runner = Runner(gen, targets, origin_pid, plan)
        phases["max"] = wrk_phase("max", targets, origin_pid, plan)
        runner.maxima = {k: r.get("throughput") or 0.0 for k, r in phases["max"].results.items()}
        if cpu is not None:
            phases["cpu"] = wrk_phase("cpu", cpu.targets, cpu.origin_pid, plan, body=CANNED_BODY)
        phases["sequential"] = runner.phase("sequential", mode="sequential")
        if ponto_cache is not None:
            phases["cache-hit"] = cache_hit(runner, ponto_cache, seat)
        for rate in plan.rates:
            phases[f"open-{rate:g}"] = runner.phase(f"open-{rate:g}", mode="open", rate=rate)
        phases["stream"] = runner.phase("stream", mode="open", stream=True, rate=plan.stream_rate)
        if plan.sustained:
            phases["sustained"] = sustained(runner)
        lite = phases["max"].results.get("litellm")
        low = plan.rates[0]
        if plan.sustained and lite and not ok(phases.get(f"open-{low:g}"), "litellm"):
            pace = max(5.0, math.floor(0.5 * (lite.get("throughput") or 10.0)))
            phase = runner.phase("ratio", mode="open", rate=pace)
            phases["ratio"] = phase
    return phases


def cache_hit(runner: Runner, address: str, seat: Target | None = None) -> Phase:
    """One request at a time: Ponto asked the same question again and again (answered
    from its exact cache after the first, in the warm-up), the origin direct asked new
    ones. Issue 17: a hit must be faster than a direct call to a bare origin; with
    `seat` (key SEAT: that origin on the servers' CPU, start_seat_origin) that call
    is timed from where Ponto's is, the usual direct one beside the client too.
    Ponto's result says how many answers its cache gave meanwhile ("cache_hits"),
    warm-up included, so that a cache that did not answer shows."""
    chosen = [t for t in runner.targets if t.key in ("direct", "ponto")]
    if seat is not None:
        chosen.insert(1, seat)
    before = cache_stats(address).get("hit", math.nan)
    phase = runner.phase(
        "cache-hit",
        mode="sequential",
        targets=chosen,
        body=lambda t: HIT_BODY if t.key == "ponto" else BODY,
    )
    phase.results["ponto"]["cache_hits"] = cache_stats(address).get("hit", math.nan) - before
    return phase


def sustained(runner: Runner) -> Phase:
    """Open loop at 80 % of each target's closed-loop max; where that does not hold
    (see held), at 50 %. Each target's entry is the higher rate that held."""
    maxima = runner.maxima
    first = runner.phase(
        "sustained", mode="open", rate=lambda t: max(5.0, round(0.8 * maxima[t.key]))
    )
    failed = [t for t in runner.targets if not held(first, t.key)]
    if failed:
        second = runner.phase(
            "sustained-50",
            mode="open",
            rate=lambda t: max(5.0, round(0.5 * maxima[t.key])),
            targets=failed,
        )
        for t in failed:
            if held(second, t.key):
                first.results[t.key] = {**second.results[t.key], "fraction_of_max": 0.5}
    for result in first.results.values():
        result.setdefault("fraction_of_max", 0.8)
    return first


def scaling(
    fleet: Fleet,
    ponto: Target,
    origin: canned.CannedOrigin,
    plan: Plan,
    workers: int,
    proxy_args: list[str],
) -> Phase:
    """`workers` workers against one, both Ponto, with every CPU open to every process.

    The one-worker proxy is the table's; an N-worker proxy (same arguments but
    --workers N) is started for this phase. Both are asked for the canned
    origin's model (CANNED_BODY): nginx costs a few percent of what a proxy
    does per request, so the origin does not bound the ratio as the simulator,
    as costly as the proxy, would. Both proxies, nginx and wrk get every CPU
    this run started with (one wrk thread per CPU); wrk's share still does
    bound it on a small machine: the table shows the CPU each side used. Runs
    last: the placement of the other phases is not restored.
    """
    every = set(CPUS_AT_START) | {SERVER_CPU, LOAD_CPU}
    with affinity(every):
        group = fleet.start_proxy(
            "proxy-n", "local", workers=workers, extra=[*PONTO_ARGS, *proxy_args]
        )
    fleet.wait_proxies_at(fleet.table_version(origins=1))
    tabled = time.monotonic()
    wait_ready(fleet, "proxy-n")
    for pid in (ponto.pid, origin.pid, group.proc.pid):
        pin_tree(pid, every)
    one = Target("ponto-1", "Ponto, 1 worker", ponto.url, ponto.pid, ponto.headers)
    many = Target(f"ponto-{workers}", f"Ponto, {workers} workers",
                  fleet.proxy_url("proxy-n") + "/chat/completions", group.proc.pid,
                  ponto.headers)  # fmt: skip
    check_until_ok(many, body=CANNED_BODY)
    if ponto.headers:
        # Limits on (the features' key): the scopes of a proxy's first table
        # start with empty buckets, which fill in a minute (ratelimit.limiter),
        # and while a bucket fills each admission makes its remaining and reset
        # headers afresh, some 13,000 instructions a request (bench.instructions)
        # that the one-worker proxy, its buckets long full, does not pay. The
        # group is measured once its buckets are full too.
        time.sleep(max(0.0, tabled + BUCKETS_FILL_S - time.monotonic()))
    before = worker_answers(fleet.metrics_addresses[group.name])
    phase = wrk_phase("scaling", [one, many], origin.pid, plan, frozenset(every), body=CANNED_BODY)
    after = worker_answers(fleet.metrics_addresses[group.name])
    if many.key in phase.results and after:
        # How the kernel spread wrk's connections (SO_REUSEPORT hashes each
        # one to a worker): the warm-ups' answers are in it too.
        phase.results[many.key]["worker_answers"] = {
            w: n - before.get(w, 0.0) for w, n in sorted(after.items())
        }
    return phase


def worker_answers(address: str) -> dict[str, float]:
    """Chat completions each worker of the group whose metrics port is
    `address` has answered, by its index (the group's /metrics,
    ponto_requests_total); {} if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            return answers_by_worker(resp.read().decode())
    except OSError:
        return {}


def answers_by_worker(exposition: str) -> dict[str, float]:
    """ponto_requests_total of chat completions in a group's /metrics, summed
    over status codes, by the `worker` label."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "ponto_requests_total" and labels.get("endpoint") == CHAT:
                found[labels["worker"]] = found.get(labels["worker"], 0.0) + sample.value
    return found


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
    done = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    out["wrk"] = (done.stdout or done.stderr).split(" [", 1)[0].removeprefix("wrk ").strip()
    return out


def start_litellm(tmp: Path, fleet: Fleet, report: dict[str, Any]) -> litellm_env.LiteLLMProxy:
    """LiteLLM alone on SERVER_CPU; raises LiteLLMUnavailable (noted in the report)."""
    try:
        litellm = litellm_env.start(
            tmp / "litellm",
            fleet.origin_url("origin"),
            port=free_port(),
            models=(MODEL,),
            cpus={SERVER_CPU} if cpus_available() else None,
        )
    except litellm_env.LiteLLMUnavailable as exc:
        report["litellm"]["error"] = str(exc)
        print(f"\nLiteLLM NOT MEASURED: {exc}\n", file=sys.stderr)
        raise
    pin_tree(litellm.pid, {SERVER_CPU})
    return litellm


CANNED_NOTE = (
    "server CPU per request is measured against a canned origin (bench/canned.py: nginx "
    "answering one fixed chat completion, ~13 us of CPU per request) so that the server "
    "under test, not the origin, saturates its CPU; the simulator stays the origin of the "
    "max rate and the latency phases. LiteLLM is not in that phase (bench/litellm_env.py "
    "maps every model to one origin)"
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    pinned = cpus_available()
    if pinned:
        os.sched_setaffinity(0, {LOAD_CPU})  # everything started from here inherits CPU 1
    report: dict[str, Any] = {
        "name": "overhead",
        "title": "Proxy overhead: direct vs pass-through vs Ponto vs LiteLLM"
        + (" (Ponto's defaults)" if args.ponto_features == "none" else ""),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
        "versions": versions(),
        "placement": (
            f"CPU {SERVER_CPU}: server under test alone; CPU {LOAD_CPU}: origins (simulator, "
            "canned nginx), load generators (wrk, bench/loadgen.py), etcd, control plane"
            if pinned
            else "not pinned (fewer than 2 CPUs)"
        ),
        "plan": asdict(plan),
        "ponto_workers": args.ponto_workers,
        "passthrough": "bench/passthrough.py: aiohttp + uvloop, one ClientSession, body and "
        "Content-Type forwarded, SSE relayed chunk by chunk, nothing else",
        "canned_origin": CANNED_NOTE,
    }
    started = time.monotonic()
    measured = measure_all(args, plan, report)
    add_results(report, measured, args, plan)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


@dataclass
class Measured:
    """What a run measured, before it is judged (see add_results)."""

    targets: list[Target]
    phases: dict[str, Phase]
    rss: dict[str, float]  # peak RSS of each target's process tree
    largest: dict[str, float]  # ... and of its largest process
    cache_on: bool  # Ponto's exact cache stores answers (the cache-hit phase ran)
    scaled: Phase | None = None


def measure_all(args: argparse.Namespace, plan: Plan, report: dict[str, Any]) -> Measured:
    """Start every target, measure every phase, stop them; notes set-up facts in `report`."""
    started = time.monotonic()
    litellm: litellm_env.LiteLLMProxy | None = None
    passthrough: Managed | None = None
    passthrough_canned: Managed | None = None
    nginx: canned.CannedOrigin | None = None
    with tempfile.TemporaryDirectory(prefix="ponto-compare-") as tmp, Fleet(Path(tmp)) as fleet:
        try:
            # One worker, like every other server in the table; --ponto-workers
            # adds a last phase with an N-worker proxy (scaling).
            origin, proxy = start_ponto(fleet, [*args.ponto_arg, "--workers", "1"])
            seat_origin = start_seat_origin(fleet)
            nginx = start_canned(fleet, Path(tmp) / "canned")
            passthrough = start_passthrough(fleet, origin.address)
            passthrough_canned = start_passthrough(fleet, nginx.address, "passthrough-canned")
            headers, features = configure_ponto_features(fleet, args.ponto_features)
            headers += tuple(_header(h) for h in args.ponto_header)
            wait_ready(fleet, "proxy")
            targets = [
                Target("direct", "direct", fleet.origin_url("origin") + "/chat/completions",
                       origin.proc.pid),
                Target("passthrough", "pass-through",
                       f"http://{passthrough.address}/v1/chat/completions", passthrough.proc.pid),
                Target("ponto", "Ponto", fleet.proxy_url("proxy") + "/chat/completions",
                       proxy.proc.pid, headers),
            ]  # fmt: skip
            # The same keys as above, so that the "cpu" rows fall in the same columns.
            canned_targets = [
                Target("direct", "direct (nginx)", nginx.url + "/chat/completions", nginx.pid),
                Target("passthrough", "pass-through (nginx)",
                       f"http://{passthrough_canned.address}/v1/chat/completions",
                       passthrough_canned.proc.pid),
                Target("ponto", "Ponto (model canned)",
                       fleet.proxy_url("proxy") + "/chat/completions", proxy.proc.pid, headers),
            ]  # fmt: skip
            cpu = CannedTargets(canned_targets, nginx.pid)
            seat_url = fleet.origin_url("seat") + "/chat/completions"
            seat = Target(SEAT, "direct, origin on CPU 0", seat_url, seat_origin.proc.pid)
            report["ponto_features"] = features
            report["litellm"] = {"version": litellm_env.LITELLM_VERSION, "error": None}
            if args.no_litellm:
                report["litellm"]["error"] = "skipped (--no-litellm)"
            else:
                with contextlib.suppress(litellm_env.LiteLLMUnavailable):
                    litellm = start_litellm(Path(tmp), fleet, report)
                    key = ("Authorization", f"Bearer {litellm_env.MASTER_KEY}")
                    url = litellm.base_url + "/chat/completions"
                    targets.append(Target("litellm", "LiteLLM", url, litellm.pid, (key,)))
            for t in targets:
                check(t)
                check(t, STREAM_BODY)
                t.rss_start_mb = tree_mb(t.pid, "VmRSS")
            for t in cpu.targets:
                check(t, CANNED_BODY)
            check(seat)
            print(
                f"started in {time.monotonic() - started:.0f} s; measuring "
                f"{', '.join(t.label for t in targets)}",
                file=sys.stderr,
            )
            cache_on = args.ponto_features != "none" and bool(headers)
            phases = measure(
                targets,
                origin.proc.pid,
                plan,
                ponto_cache=fleet.metrics_addresses[proxy.name] if cache_on else None,
                cpu=cpu,
                seat=seat,
            )
            report["ponto_cache_at_end"] = cache_stats(fleet.metrics_addresses[proxy.name])
            # Before scaling, which loads the proxy on every CPU.
            measured = Measured(
                targets,
                phases,
                rss={t.key: tree_mb(t.pid, "VmHWM") for t in targets},
                largest={t.key: largest_mb(t.pid, "VmHWM") for t in targets},
                cache_on=cache_on,
            )
            if args.ponto_workers and args.ponto_workers > 1:
                ponto = next(t for t in targets if t.key == "ponto")
                measured.scaled = scaling(
                    fleet, ponto, nginx, plan, args.ponto_workers, args.ponto_arg
                )
        finally:
            if litellm is not None:
                litellm.stop()
            for server in (passthrough, passthrough_canned):
                if server is not None:
                    server.stop()
            if nginx is not None:
                nginx.stop()
    return measured


def add_results(report: dict[str, Any], m: Measured, args: argparse.Namespace, plan: Plan) -> None:
    """The table, ratios, goals and aims of `m`, and its raw phases, into `report`."""
    verdicts = build_table({t.key: t.label for t in m.targets}, m.phases, m.rss, m.largest,
                           plan.rates)  # fmt: skip
    report["targets"] = {
        t.key: {
            "label": t.label,
            "rss_start_mb": t.rss_start_mb,
            "rss_peak_mb": m.rss[t.key],
            "rss_peak_largest_process_mb": m.largest[t.key],
        }
        for t in m.targets
    }
    phases = {**m.phases, **({"scaling": m.scaled} if m.scaled is not None else {})}
    report["phases"] = [
        {"name": p.name, "mode": p.mode, "stream": p.stream, "rate": p.rate, "results": p.results}
        for p in phases.values()
    ]
    report["ratios"] = verdicts.litellm
    report["floor_ratios"] = verdicts.floor
    # Read when the peak RSS was (measure_all): the RSS verdicts say what it held.
    cache_bytes = (report.get("ponto_cache_at_end") or {}).get("bytes")
    report["goals"] = goals(
        phases, m.rss, verdicts.litellm, report["ponto_features"], cache_bytes=cache_bytes
    )
    # Features asked for but not configured: neither CPU aim applies.
    features = args.ponto_features if m.cache_on or args.ponto_features == "none" else "failed"
    report["aims"] = aims(
        phases,
        m.largest.get("ponto"),
        features=features,
        workers=args.ponto_workers,
        cache_bytes=cache_bytes,
    )
    report["table"] = {"columns": verdicts.table.columns, "rows": verdicts.table.rows}
    report["text"] = verdicts.table.render()
    workers_table = scaling_table(m.scaled, args.ponto_workers or 0)
    if workers_table is not None:
        report["scaling_table"] = {"columns": workers_table.columns, "rows": workers_table.rows}
        report["scaling_text"] = workers_table.render()


def _header(value: str) -> tuple[str, str]:
    name, sep, rest = value.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {value!r}")
    return name.strip(), rest.strip()


def print_verdicts(title: str, verdicts: list[dict[str, Any]]) -> None:
    """Each aim with its value and PASS / MISS (n/a: not measured in this run)."""
    print(f"\n{title}:")
    for g in verdicts:
        mark = {True: "PASS", False: "MISS", None: "n/a "}[g["pass"]]
        value = "not measured" if g["value"] is None else f"{figure(g['value'])} {g['unit']}"
        print(f"  [{mark}] {g['goal']}: {value}")


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"\n## {report['title']}")
    print(
        f"{m['cpu']}, {m['cpus']} CPUs, load average before {m['loadavg_before'][0]}; "
        f"{report['placement']}"
    )
    lite = report["litellm"]
    setup = lite["error"] or "1 worker, master key, logging and telemetry off"
    print(f"Ponto, 1 worker: {report['ponto_features']}. LiteLLM {lite['version']}: {setup}")
    print(f"Pass-through: {report['passthrough']}.")
    print(
        "Max rate: wrk closed loop. Latency: bench/loadgen.py, one at a time, and open loop "
        "evenly spaced (latency from each request's due time); added = minus direct."
    )
    print(f"Canned origin: {report['canned_origin']}.\n")
    print(report["text"])
    cache = report.get("ponto_cache_at_end") or {}
    if cache.get("hit") or cache.get("miss"):
        print(
            f"\nPonto's exact cache at the end: {cache['entries']:,.0f} entries, "
            f"{cache['bytes'] / 2**20:.1f} MB (bound {CACHE_MAX_MB} MB), "
            f"{cache['evictions']:,.0f} evicted; {cache['hit']:,.0f} hits, "
            f"{cache['miss']:,.0f} misses"
        )
    if report.get("scaling_text"):
        print(
            "\nWorkers: every CPU open to the proxy, the canned origin (nginx) and wrk alike; "
            "nginx's few us per request do not bound the ratio\n"
        )
        print(report["scaling_text"])
    print_verdicts("Goals (issue 8)", report["goals"])
    print_verdicts("Aims (issue 17): Ponto against the floor", report["aims"])
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
        "--ponto-workers",
        type=int,
        metavar="N",
        help="N >= 2 adds a last phase: an N-worker ponto-proxy against the table's one-worker "
        "one, both on every CPU (the table's servers are one process each)",
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
    if args.ponto_workers is not None and args.ponto_workers < 1:
        p.error("--ponto-workers must be at least 1")
    try:
        wrk.find_wrk()
        canned.find_nginx()
    except (wrk.WrkMissing, canned.NginxMissing) as exc:
        print(f"bench.compare: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up processes on SIGTERM too
    report = run(args)
    print_report(report)
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(finite(report), indent=2, allow_nan=False, default=str) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
