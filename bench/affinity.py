"""LLM-aware routing inside a region: weighted vs least-loaded vs the affinity scorer.

    .venv/bin/python -m bench.affinity [--quick] [--out-dir DIR]

Writes docs/benchmarks/affinity.json (rendered by bench/report.py),
docs/benchmarks/affinity.md and its PNG plots; a --quick run (80 % load only,
shorter phases; about 3 minutes) writes nothing unless given --out-dir. The
full run takes about 11 minutes on two CPUs.

The system, all real processes on loopback: etcd, one control plane, two
proxies (``ponto-proxy``, one process each; every request goes to one of them
at random, as behind an L4 balancer, so affinity must agree across proxies
without shared state), and ten simulated replicas (``ponto-origin-sim``, one
process each): eight in the region under test and two in a second region that
takes spill. Each replica has a KV block cache (LRU) and one FIFO prefill
engine that takes ``uncached prompt tokens / PREFILL`` seconds per request, so a
replica's throughput is bound by prefill, as a GPU's is on long prompts.

Capacity. A workload's capacity is the open-loop request rate the eight
replicas' prefill engines sustain when no prompt finds anything in a KV cache:

    capacity = 8 * PREFILL / mean prompt tokens of the workload

(answers are short, and decode slots are sized not to bind). Load levels are
fractions of that: 50, 80 and 95 %. A policy that makes prompts hit the cache
does less prefill work and so runs further below saturation than the level
says; one that does not runs at the level.

Each phase (workload x load x policy): fresh KV caches (every replica restarted
or reset), the tenant's routing policy switched through the Admin API and
waited for on both proxies, a warm-up that is not measured, then a measured
window. Reported per phase: TTFT at the client (first SSE data event, from the
request's due time) p50/p90/p99, completed requests per second, failures,
per-replica KV hit rate (the replicas' prefix-cache counters, deltas over the
window), load imbalance (max/mean over the eight replicas of requests served
and of mean requests in flight), the route reasons (``x-ponto-route``) and the
CPU of every process (so the reader can see no Python process was saturated).
Last, one replica is SIGKILLed in the middle of an affinity run of the agent
workload: client-visible failures, and for every session that was on it, how
long until it was answered by another replica, and whether it stayed there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import grpc
import uvloop

from bench import affinity_load as load
from bench import affinity_report as report
from bench.procs import tree_cpu
from ponto.devenv import DevEnvError, python_entry
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

REPO: Final = Path(__file__).resolve().parents[1]
OUT_DIR: Final = REPO / "docs" / "benchmarks"

PRIMARY: Final = RegionDef("us-east", 38.9, -77.4)
SPILL: Final = RegionDef("us-central", 41.6, -93.6)
REPLICAS: Final = tuple(f"r{i}" for i in range(1, 9))
SPILL_REPLICAS: Final = ("spill-1", "spill-2")
PROXIES: Final = ("proxy-a", "proxy-b")
POLICIES: Final = ("weighted", "least-loaded", "affinity")
TENANT: Final = "default"  # requests without an API key belong to it


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Every replica's settings (scaled time: see the module docstring)."""

    prefill_tokens_per_s: int = 32_000
    ttft_ms: int = 10  # fixed cost on top of prefill
    tokens_per_s: int = 100  # decode pace of one answer
    answer_tokens: int = load.ANSWER_TOKENS
    max_concurrency: int = 32  # requests past it wait in the queue
    kv_block_tokens: int = 16
    # A replica's KV cache holds this multiple of (working set / replicas): the
    # fleet holds the working set KV_FLEET_FACTOR times over, one replica only
    # KV_FLEET_FACTOR / 8 of it, the regime in which placement decides hits.
    kv_fleet_factor: float = 2.0
    # Concurrent requests a replica serves well, given to the control plane
    # (OriginSpec.capacity): the region spills past 0.8 of their sum.
    capacity: int = 16

    def kv_tokens(self, workload: load.Workload) -> int:
        per_replica = self.kv_fleet_factor * workload.working_set_tokens / len(REPLICAS)
        # A workload that reuses nothing gets the agent workload's cache (same hardware).
        if per_replica == 0:
            per_replica = self.kv_fleet_factor * load.AGENT.working_set_tokens / len(REPLICAS)
        block = self.kv_block_tokens
        return int(math.ceil(per_replica / block) * block)

    def capacity_rps(self, workload: load.Workload) -> float:
        return len(REPLICAS) * self.prefill_tokens_per_s / workload.mean_prompt_tokens


@dataclass(frozen=True, slots=True)
class Timing:
    loads: tuple[float, ...]
    warmup_s: float
    duration_s: float
    grace_s: float
    death_s: float


FULL: Final = Timing(
    loads=(0.5, 0.8, 0.95), warmup_s=5.0, duration_s=10.0, grace_s=4.0, death_s=20.0
)
QUICK: Final = Timing(loads=(0.8,), warmup_s=4.0, duration_s=6.0, grace_s=3.0, death_s=12.0)


# ----------------------------------------------------------------------------- processes


def sim_flags() -> set[str]:
    """The options this checkout's simulator accepts (older ones lack the KV flags)."""
    done = subprocess.run(
        [*python_entry("ponto.originsim"), "--help"], capture_output=True, text=True, check=False
    )
    return {w.strip(",[]") for w in done.stdout.split() if w.startswith("--")}


def _in_parallel(fn: Callable[[str], object], names: Iterable[str]) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(fn, n) for n in names]:
            future.result()


@dataclass
class Testbed:
    """Owns the fleet; stop() ends every process it started."""

    fleet: Fleet
    sim: SimSettings
    flags: set[str] = field(default_factory=set)
    kv_tokens: int = 0
    policy_supported: bool | None = None
    notes: list[str] = field(default_factory=list)

    def start(self) -> None:
        f = self.fleet
        self.flags = sim_flags()
        f.start_etcd()
        f.start_control()
        for region in (PRIMARY, SPILL):
            f.add_region(region)
        self.start_sims(self.sim.kv_tokens(load.AGENT))
        # No API keys: every request is the default tenant's. Its exact cache is
        # off so that no answer comes from the proxy (none would: no request is
        # deterministic, but the figures must not depend on it).
        tenant = pb.Tenant(name=TENANT, cache=pb.CachePolicy(mode="off"))
        f.admin().PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=True), timeout=10)
        version = self.wait_healthy()
        _in_parallel(
            lambda p: f.start_proxy(p, PRIMARY.name, extra=["--log-level", "WARNING"]), PROXIES
        )
        f.wait_proxies_at(version, timeout=30)

    def all_replicas(self) -> tuple[str, ...]:
        return (*REPLICAS, *SPILL_REPLICAS)

    def sim_argv(self, kv_tokens: int) -> list[str]:
        s = self.sim
        wanted = {
            "--kv-cache-tokens": kv_tokens,
            "--kv-block-tokens": s.kv_block_tokens,
            "--prefill-tokens-per-s": s.prefill_tokens_per_s,
            "--answer-tokens": s.answer_tokens,
            "--max-concurrency": s.max_concurrency,
        }
        argv: list[str] = []
        for flag, value in wanted.items():
            if flag in self.flags:
                argv += [flag, str(value)]
            elif f"missing {flag}" not in self.notes:
                self.notes.append(f"missing {flag}")
        return argv

    def start_sims(self, kv_tokens: int) -> None:
        """Replace every replica by a new process with an empty cache, without a gap.

        New processes start on new ports while the old ones still serve; the
        origins are re-registered with the new URLs; once both proxies serve
        that table the old processes stop. (Restarting in place would leave the
        control plane to notice the gap a probe or two later and to take the
        replicas out of the table in the middle of the next measurement.)
        """
        f = self.fleet
        extra = self.sim_argv(kv_tokens)
        old = {name: f.origins[name] for name in self.all_replicas() if name in f.origins}

        def one(name: str) -> None:
            f.start_origin(
                name,
                self.region_of(name),
                ttft_ms=self.sim.ttft_ms,
                tokens_per_s=self.sim.tokens_per_s,
                models=(load.MODEL,),
                extra=extra,
            )

        try:
            _in_parallel(one, self.all_replicas())
            self._register_replicas()
        finally:
            # The old processes are the fleet's no more: stop them whatever happened.
            for managed in old.values():
                managed.stop()
        self.kv_tokens = kv_tokens

    def _register_replicas(self) -> None:
        f = self.fleet
        urls = {name: f.origin_url(name) for name in self.all_replicas()}
        for name, url in urls.items():
            spec = apb.OriginSpec(
                name=name,
                base_url=url,
                region=self.region_of(name),
                models=[load.MODEL],
                capacity=self.sim.capacity,
            )
            f.admin().PutOrigin(apb.PutOriginRequest(origin=spec, allow_update=True), timeout=10)
        version = f.wait_table(
            lambda t: {o.name: o.base_url for o in t.origins if o.healthy} == urls, timeout=30
        )
        if f.proxies:
            f.wait_proxies_at(version, timeout=30)

    def region_of(self, name: str) -> str:
        return PRIMARY.name if name in REPLICAS else SPILL.name

    def wait_healthy(self, timeout: float = 30.0) -> int:
        n = len(self.all_replicas())
        return self.fleet.wait_table(
            lambda t: len(t.origins) >= n and all(o.healthy for o in t.origins), timeout
        )

    def set_policy(self, mode: str) -> bool:
        """Switch the tenant's routing; False when this checkout cannot (then every
        phase runs today's weighted choice, and the report says so)."""
        request = apb.UpdateTenantRequest(name=TENANT, routing=pb.RoutingPolicy(mode=mode))
        try:
            tenant = self.fleet.admin().UpdateTenant(request, timeout=10)
        except grpc.RpcError as exc:
            self._unsupported(f"UpdateTenant(routing={mode!r}) failed: {exc.details()}")
            return False
        if tenant.routing.mode != mode:
            self._unsupported("the control plane ignores Tenant.routing")
            return False
        version = self.fleet.table_version()
        self.fleet.wait_proxies_at(version, timeout=30)
        self.policy_supported = True
        return True

    def _unsupported(self, why: str) -> None:
        self.policy_supported = False
        if why not in self.notes:
            self.notes.append(why)
            print(f"  routing policy not switched: {why}", flush=True)

    def pids(self) -> dict[str, list[int]]:
        f = self.fleet
        out = {
            "proxies": [m.proc.pid for m in f.proxies.values()],
            "replicas": [m.proc.pid for m in f.origins.values() if m.alive()],
            "control plane": [m.proc.pid for m in f.controls.values()],
        }
        if f.etcd is not None:
            out["etcd"] = [f.etcd.managed.proc.pid]
        return out

    def stop(self) -> None:
        self.fleet.stop()


# ----------------------------------------------------------------------------- replica metrics


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> value summed over its label sets."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] += float(value)
    return dict(out)


async def scrape(session: aiohttp.ClientSession, addresses: dict[str, str]) -> dict[str, Any]:
    """Every replica's metrics (a dead one: absent)."""

    async def one(name: str, address: str) -> tuple[str, dict[str, float] | None]:
        try:
            async with session.get(f"http://{address}/metrics") as resp:
                return name, parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            return name, None

    got = await asyncio.gather(*(one(n, a) for n, a in addresses.items()))
    return {name: m for name, m in got if m is not None}


HITS: Final = "vllm:prefix_cache_hits_total"
QUERIES: Final = "vllm:prefix_cache_queries_total"
RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"


def cpu_snapshot(bed: Testbed) -> dict[str, float]:
    out = {k: sum(tree_cpu(v).values()) for k, v in bed.pids().items()}
    for name, m in bed.fleet.proxies.items():
        out[name] = sum(tree_cpu([m.proc.pid]).values())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["load generator"] = usage.ru_utime + usage.ru_stime
    return out


# ----------------------------------------------------------------------------- one phase


@dataclass
class PhaseResult:
    samples: list[load.Sample]
    window: tuple[float, float]
    kv: dict[str, dict[str, float]]  # replica -> hits, queries (deltas)
    inflight: dict[str, float]  # replica -> mean running + waiting over the window
    cpu: dict[str, float]  # process group -> CPU seconds over the window
    events: dict[str, float] = field(default_factory=dict)


async def run_phase(
    bed: Testbed,
    workload: load.Workload,
    rate: float,
    tag: str,
    timing: Timing,
    pool: list[str],
    *,
    duration: float | None = None,
    kill_at: float | None = None,
    kill: str = "",
) -> PhaseResult:
    """Offer `rate` for warm-up + duration; measure the window after the warm-up.
    With `kill_at`, SIGKILL replica `kill` that many seconds into the window."""
    measured = timing.duration_s if duration is None else duration
    start = time.monotonic() + 0.3
    warmup = timing.warmup_s
    if workload is load.AGENT:
        # Every loop met at the start sends its first, cold request within one
        # think time (sessions / rate), a burst of cold prefill whose backlog
        # must drain before the window opens.
        warmup = max(warmup, 1.5 * load.AGENT_SESSIONS / rate)
    window = (start + warmup, start + warmup + measured)
    run = load.Run(rate, start, window[1], tag)
    addresses = {n: m.address for n, m in bed.fleet.origins.items()}
    urls = [bed.fleet.proxy_url(p) + "/chat/completions" for p in PROXIES]
    events: dict[str, float] = {}
    loads: dict[str, list[float]] = defaultdict(list)
    async with (
        load.Client(urls, random.Random(f"client-{tag}")) as client,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http,
    ):
        driver = load.DRIVERS[workload.name]
        drive = asyncio.create_task(driver(client, run, pool))

        async def watch() -> tuple[dict[str, Any], dict[str, Any], dict[str, float], float]:
            await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
            before = await scrape(http, addresses)
            cpu0 = cpu_snapshot(bed)
            t_cpu0 = time.monotonic()
            killed = False
            while time.monotonic() < window[1]:
                await asyncio.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
                if kill_at is not None and not killed and time.monotonic() >= window[0] + kill_at:
                    events["kill"] = time.monotonic()
                    bed.fleet.origins[kill].proc.send_signal(signal.SIGKILL)
                    killed = True
                    addresses.pop(kill, None)
                    continue
                for name, m in (await scrape(http, addresses)).items():
                    loads[name].append(m.get(RUNNING, 0.0) + m.get(WAITING, 0.0))
            after = await scrape(http, addresses)
            cpu1 = cpu_snapshot(bed)
            spent = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
            return before, after, spent, time.monotonic() - t_cpu0

        async def lag_monitor() -> None:
            # How late this loop wakes from a short sleep: when the generator
            # itself stalls, its requests go out late and the figures say so.
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                if window[0] <= t < window[1]:
                    lags.append(time.monotonic() - t - 0.01)

        lags: list[float] = []
        monitor = asyncio.create_task(lag_monitor())
        watcher = asyncio.create_task(watch())
        tasks = await drive
        before, after, spent, wall = await watcher
        remaining = window[1] + timing.grace_s - time.monotonic()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.1, remaining))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        monitor.cancel()
    kv = {}
    for name, m in after.items():
        b = before.get(name, {})
        kv[name] = {
            "hits": m.get(HITS, 0.0) - b.get(HITS, 0.0),
            "queries": m.get(QUERIES, 0.0) - b.get(QUERIES, 0.0),
        }
    inflight = {n: sum(v) / len(v) for n, v in loads.items() if v}
    cpu = {k: v / wall for k, v in spent.items()}  # fraction of one core
    events["loop_lag_p99"] = pct(lags, 99)
    events["loop_lag_max"] = max(lags, default=math.nan)
    return PhaseResult(client.samples, window, kv, inflight, cpu, events)


# ----------------------------------------------------------------------------- figures


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) where inf stands for 'never answered'."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def in_window(samples: list[load.Sample], window: tuple[float, float]) -> list[load.Sample]:
    return [s for s in samples if window[0] <= s.due < window[1]]


def figures(result: PhaseResult) -> dict[str, Any]:
    w0, w1 = result.window
    span = w1 - w0
    mine = in_window(result.samples, result.window)
    ok = [s for s in mine if s.ok]
    # Requests due in the window but not answered when the phase ended count as
    # never answered (inf), so an overload shows in the tail instead of vanishing.
    ttft = [s.first - s.due for s in ok] + [
        math.inf for s in mine if not s.ok and s.error == "unfinished"
    ]
    failed = [s for s in mine if not s.ok and s.error != "unfinished"]
    completed = [s for s in result.samples if s.ok and w0 <= s.done < w1]
    by_origin = Counter(s.origin for s in ok)
    primary = [by_origin.get(r, 0) for r in REPLICAS]
    mean_req = sum(primary) / len(primary)
    inflight = [result.inflight.get(r, 0.0) for r in REPLICAS]
    mean_inflight = sum(inflight) / len(inflight)
    hits = sum(v["hits"] for v in result.kv.values())
    queries = sum(v["queries"] for v in result.kv.values())
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(max(0, s.cached) for s in ok)
    late = [s.sent - s.due for s in mine if not math.isnan(s.sent)]
    return {
        "requests": len(mine),
        "offered_rps": round(len(mine) / span, 2),
        "completed_rps": round(len(completed) / span, 2),
        "ttft_ms": {f"p{q}": _ms(pct(ttft, q)) for q in (50, 90, 99)},
        "failed": len(failed),
        "unfinished": len(ttft) - len(ok),
        "errors": dict(Counter(s.error for s in failed)),
        "kv_hit_rate": round(hits / queries, 4) if queries else None,
        "kv_hit_rate_client": round(cached / prompt, 4)
        if prompt and any(s.cached >= 0 for s in ok)
        else None,
        "replicas": {
            name: {
                "requests": by_origin.get(name, 0),
                "kv_hit_rate": round(v["hits"] / v["queries"], 4) if v["queries"] else None,
                "mean_inflight": round(result.inflight.get(name, 0.0), 2),
            }
            for name, v in sorted(result.kv.items())
        },
        "imbalance_requests": round(max(primary) / mean_req, 3) if mean_req else None,
        "imbalance_inflight": round(max(inflight) / mean_inflight, 3) if mean_inflight else None,
        "spill_share": round(sum(by_origin.get(r, 0) for r in SPILL_REPLICAS) / len(ok), 4)
        if ok
        else None,
        "routes": dict(Counter(s.route or "(none)" for s in ok)),
        "late_p99_ms": _ms(pct(late, 99)),
        "generator_lag_ms": {
            "p99": _ms(result.events["loop_lag_p99"]),
            "max": _ms(result.events["loop_lag_max"]),
        },
        "cpu_core_fraction": {k: round(v, 3) for k, v in result.cpu.items()},
    }


def _ms(seconds: float) -> float | None:
    if math.isnan(seconds):
        return None
    if math.isinf(seconds):
        return math.inf
    return round(seconds * 1000, 1)


def death_figures(result: PhaseResult, dead: str) -> dict[str, Any]:
    """Who was on the dead replica, and how long until each was answered elsewhere."""
    kill = result.events["kill"]
    by_session: dict[str, list[load.Sample]] = defaultdict(list)
    for s in result.samples:
        by_session[s.session].append(s)
    affected: list[dict[str, Any]] = []
    for name, ss in by_session.items():
        ss.sort(key=lambda s: s.due)
        before = [s for s in ss if s.ok and s.done < kill]
        if not before or before[-1].origin != dead:
            continue
        later = [s for s in ss if s.sent >= kill or (s.done >= kill) or not s.ok]
        later = [s for s in later if s not in before]
        answered = next((s for s in later if s.ok and s.origin != dead), None)
        if answered is None:
            continue  # the session made no further request in the phase
        after = [s for s in later if s.ok and s.due > answered.due]
        affected.append(
            {
                "session": name,
                "from_kill_s": answered.first - kill,
                "request_ttft_s": answered.first - answered.due,
                "new": answered.origin,
                "stayed": all(s.origin == answered.origin for s in after),
                "later_requests": len(after),
                "failed_between": sum(1 for s in later if not s.ok and s.due < answered.due),
            }
        )
    w0, w1 = result.window
    mine = in_window(result.samples, result.window)
    failed = [s for s in result.samples if not s.ok and s.error != "unfinished" and s.due >= w0]
    at_kill = [s for s in result.samples if s.sent < kill and (math.isnan(s.done) or s.done > kill)]
    at_kill_dead = [s for s in at_kill if s.origin == dead]
    failovers = [s for s in mine if s.route == "failover"]
    waits = [a["from_kill_s"] for a in affected]
    ttfts = [a["request_ttft_s"] for a in affected]
    return {
        "killed": dead,
        "kill_at_s": round(kill - w0, 2),
        "requests": len(mine),
        "failed": len(failed),
        "errors": dict(Counter(s.error for s in failed)),
        "in_flight_at_kill_on_dead": len(at_kill_dead),
        "in_flight_at_kill_on_dead_failed": sum(1 for s in at_kill_dead if not s.ok),
        "sessions_on_dead": len(affected),
        "repin_from_kill_s": {"p50": _r(pct(waits, 50)), "max": _r(max(waits, default=math.nan))},
        "repin_request_ttft_s": {
            "p50": _r(pct(ttfts, 50)),
            "max": _r(max(ttfts, default=math.nan)),
        },
        "stayed_on_new_replica": sum(1 for a in affected if a["stayed"]),
        "failovers": len(failovers),
        "last_failover_after_kill_s": _r(max((s.sent - kill for s in failovers), default=math.nan)),
        "answers_from_dead_after_kill": sum(
            1 for s in mine if s.ok and s.origin == dead and s.sent > kill
        ),
        "timeline": [
            [round(s.due - kill, 3), _ms(s.first - s.due) if s.ok else None, s.origin, s.ok]
            for s in result.samples
            if w0 <= s.due < w1
        ],
        "window_s": round(w1 - w0, 1),
    }


def _r(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 3)


# ----------------------------------------------------------------------------- the run


def tag_of(workload: str, level: float) -> str:
    """Seeds a phase's requests: the three policies of a level get the same stream."""
    return f"{workload}-{round(level * 100)}"


async def measure(
    bed: Testbed, timing: Timing, pool: list[str], workloads: list[str]
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for wname in workloads:
        workload = load.WORKLOADS[wname]
        kv = bed.sim.kv_tokens(workload)
        capacity = bed.sim.capacity_rps(workload)
        results[wname] = {"capacity_rps": round(capacity, 2), "kv_cache_tokens": kv, "levels": {}}
        print(
            f"\n{workload.title}: capacity {capacity:.1f} req/s "
            f"(8 x {bed.sim.prefill_tokens_per_s:,} / {workload.mean_prompt_tokens:,.0f}), "
            f"KV cache {kv:,} tokens per replica",
            flush=True,
        )
        for level in timing.loads:
            rate = capacity * level
            per_policy: dict[str, Any] = {}
            for policy in POLICIES:
                t0 = time.monotonic()
                await asyncio.to_thread(fresh_start, bed, kv, policy)
                result = await run_phase(bed, workload, rate, tag_of(wname, level), timing, pool)
                fig = figures(result)
                fig["policy_applied"] = bool(bed.policy_supported)
                per_policy[policy] = fig
                print(
                    f"  {round(level * 100)} % {policy:<13} offered {fig['offered_rps']:6.1f}/s"
                    f"  done {fig['completed_rps']:6.1f}/s  TTFT p50/p90/p99 "
                    f"{_fmt_ms(fig['ttft_ms']['p50'])}/{_fmt_ms(fig['ttft_ms']['p90'])}/"
                    f"{_fmt_ms(fig['ttft_ms']['p99'])} ms  KV hit "
                    f"{_fmt_pct(fig['kv_hit_rate'])}  failed {fig['failed']}  "
                    f"late p99 {_fmt_ms(fig['late_p99_ms'])} ms  "
                    f"({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
            results[wname]["levels"][str(round(level * 100))] = {
                "rate_rps": round(rate, 2),
                "policies": per_policy,
            }
    return results


def fresh_start(bed: Testbed, kv_tokens: int, policy: str) -> None:
    """Empty every replica's KV cache (a restart; the simulator has no cache reset)
    and switch the policy; wait until both proxies serve the resulting table."""
    bed.start_sims(kv_tokens)
    bed.set_policy(policy)


async def replica_death(bed: Testbed, timing: Timing, pool: list[str]) -> dict[str, Any]:
    workload = load.AGENT
    rate = bed.sim.capacity_rps(workload) * 0.8
    await asyncio.to_thread(fresh_start, bed, bed.sim.kv_tokens(workload), "affinity")
    dead = REPLICAS[2]
    print(
        f"\nreplica death: agent loops at 80 % ({rate:.1f} req/s), affinity; SIGKILL {dead} "
        f"{timing.death_s / 2:.0f} s into a {timing.death_s:.0f} s window",
        flush=True,
    )
    result = await run_phase(
        bed,
        workload,
        rate,
        "death",
        timing,
        pool,
        duration=timing.death_s,
        kill_at=timing.death_s / 2,
        kill=dead,
    )
    out = death_figures(result, dead)
    out["policy_applied"] = bool(bed.policy_supported)
    out["cpu_core_fraction"] = {k: round(v, 3) for k, v in result.cpu.items()}
    return out


def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.0f}"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


@contextlib.contextmanager
def stopped_on_signal() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so that `finally` blocks stop the fleet."""

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="80 %% load only, shorter phases")
    p.add_argument(
        "--out-dir",
        type=Path,
        help=f"where to write (default {OUT_DIR}; a --quick run writes nothing unless asked)",
    )
    p.add_argument("--prefill-tokens-per-s", type=int, default=32_000)
    p.add_argument(
        "--workloads",
        type=lambda v: v.split(","),
        default=list(load.WORKLOADS),
        help="comma-separated subset of agent,prefix,unique (for iterating)",
    )
    p.add_argument("--no-death", action="store_true", help="skip the replica-death phase")
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only write the tables, Markdown and plots again from a run's JSON",
    )
    args = p.parse_args(argv)
    if args.render is not None:
        for path in report.rerender(args.render):
            print(f"wrote {path}")
        return 0
    timing = QUICK if args.quick else FULL
    sim = SimSettings(prefill_tokens_per_s=args.prefill_tokens_per_s)
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    pool = load.word_pool(2026)
    with stopped_on_signal(), tempfile.TemporaryDirectory(prefix="ponto-affinity-") as tmp:
        bed = Testbed(Fleet(Path(tmp)), sim)
        try:
            print("starting etcd, a control plane, 10 replicas, 2 proxies", flush=True)
            bed.start()
            print(f"  up in {time.monotonic() - started:.0f} s", flush=True)
            phases = uvloop.run(measure(bed, timing, pool, args.workloads))
            death = None if args.no_death else uvloop.run(replica_death(bed, timing, pool))
        except DevEnvError as exc:
            print(f"could not run: {exc}", file=sys.stderr)
            return 1
        finally:
            bed.stop()
    doc = report.document(
        phases=phases,
        death=death,
        sim=sim,
        timing=timing,
        notes=bed.notes,
        policy_supported=bool(bed.policy_supported),
        profile="quick" if args.quick else "full",
        seconds=time.monotonic() - started,
        load_average=(load_start, os.getloadavg()[0]),
    )
    print()
    print(doc["text"])
    out_dir: Path | None = args.out_dir or (None if args.quick else OUT_DIR)
    if out_dir is not None:
        for path in report.write(doc, out_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
