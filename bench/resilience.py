"""Resilience: streams whose origin is cut mid-way, and origins that stall before the first token.

    .venv/bin/python -m bench.resilience [--quick] [--streams N] [--out-dir DIR]

Writes docs/benchmarks/resilience.{json,md,png} (a --quick run writes nothing
unless given --out-dir). About 3 minutes on two CPUs; --quick about 1.5. One
fleet of real processes (etcd, a control plane, origin simulators, one proxy),
torn down on exit, errors and Ctrl-C included.

Aims (the issue's words):

1. 1,000 streams whose origin is cut at a random point: 0 broken streams (today:
   every one breaks); continuation adds under 1 origin TTFT to the stream.
2. An origin pool where 5 % of requests stall 2 s before the first token:
   hedging cuts TTFT p99 at least 5x for at most 10 % extra origin requests; p50
   unchanged within noise.

Phase "cut streams". Origin A sits behind bench/cutlink.py, a link that relays
the first K SSE events of a stream and then closes the connection (K from the
request header x-bench-cut-after, which the proxy forwards). Origin B, in the
next region, is reached directly. Stream i always gets the same K, drawn
uniformly from 1..ANSWER_TOKENS (16; every content token but the finish chunk can
be the last one before the cut), so the runs below cut the same streams at the
same points:

* reference: every prompt asked of B directly (the uncut text, and the
  origin's own TTFT, the yardstick of aim 1);
* uncut: through Ponto without a cut (the uncut duration through Ponto);
* continuation off, then on: through Ponto, each stream cut.

The simulator's own x-sim-cut-after cannot be used: the proxy sends a
continuation with the same forwarded headers, so B would cut it too. A stream
is *broken* if its answer is not 200, it carries an error event, it misses
[DONE], or its text differs from the reference. *Added time* is a continued
stream's duration minus the uncut p50 through Ponto.

Phase "stalls". Three replicas, each stalling 5 % of requests (seeded draws,
distinct seeds) for 2 s before the first token, TTFT 50 ms otherwise. Open-loop
load at RATE (40) requests/s (request i due at t0 + i/RATE; TTFT from its due time
to its first content chunk at the client, so no coordinated omission); the
first WARMUP (4) seconds (which feed the auto hedge's p95) are not measured.
Configurations: no hedging, a fixed hedge delay (3 x TTFT), and "auto". Extra
origin requests = the simulators' request counters / client requests - 1.
When the proxy sends no hedge for a tenant with a hedge policy (probed before
the phase), the hedged configurations are reported as not available.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import matplotlib
import orjson

from bench.loadgen import percentile
from bench.procs import tree_cpu
from bench.report import git_commit, machine, md_table, versions
from ponto.devenv import python_entry, spawn
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

ROOT: Final = Path(__file__).resolve().parent.parent
DEFAULT_DIR: Final = ROOT / "docs" / "benchmarks"
HOME: Final = RegionDef("east-a", 38.9, -77.4)  # the proxy's region
NEXT: Final = RegionDef("east-b", 40.0, -83.0)  # the next one, where B is
CUT_MODEL: Final = "sim-small"
STALL_MODEL: Final = "sim-stall"
CUT_HEADER: Final = "x-bench-cut-after"
NO_CACHE: Final = {"content-type": "application/json", "cache-control": "no-cache, no-store"}

# Cut phase: a 16-token answer at 100 tokens/s after a 100 ms first token.
CUT_TTFT_MS: Final = 100
CUT_TOKENS_PER_S: Final = 100
ANSWER_TOKENS: Final = 16
CUT_CONCURRENCY: Final = 12

# Stall phase.
REPLICAS: Final = 3
STALL_TTFT_MS: Final = 50
STALL_RATE: Final = 0.05
STALL_MS: Final = 2000
HEDGE_MS: Final = 3 * STALL_TTFT_MS
RATE: Final = 40.0
P50_NOISE_MS: Final = 5.0  # |p50 change| under max(this, 10 % of p50) is noise
SEED: Final = 20261130


# ---------------------------------------------------------------- one stream


@dataclass
class Outcome:
    """One streamed answer as the client saw it; times in seconds from `t0`."""

    status: int = 0
    text: str = ""
    first: float = math.nan  # first content chunk
    end: float = math.nan  # end of the body
    done: bool = False  # saw data: [DONE]
    error: str = ""  # an error event, a status or an exception
    continued: int = 0  # the final chunk's "ponto": {"continued": N}
    hedged: bool = False  # x-ponto-hedged: 1

    def broken(self, expected: str | None) -> bool:
        wrong = expected is not None and self.text != expected
        return self.status != 200 or bool(self.error) or not self.done or wrong


def chat_body(model: str, prompt: str) -> bytes:
    message = {"role": "user", "content": prompt}
    return orjson.dumps({"model": model, "messages": [message], "stream": True})


async def read_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], t0: float
) -> Outcome:
    """POST a streamed chat request and read its SSE answer (a raw reader: it
    sees error events and a missing [DONE] that an SDK might hide or raise on)."""
    out = Outcome()
    parts: list[str] = []
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            out.status = resp.status
            out.hedged = resp.headers.get("x-ponto-hedged") == "1"
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out.done = True
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    out.error = str(event["error"])[:200]
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if piece:
                        if not parts:
                            out.first = time.monotonic() - t0
                        parts.append(piece)
                ponto = event.get("ponto")
                if isinstance(ponto, dict):
                    out.continued = max(out.continued, int(ponto.get("continued", 0)))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.end = time.monotonic() - t0
    out.text = "".join(parts)
    return out


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=30),
    )


async def closed_loop(
    url: str, bodies: Sequence[bytes], headers: Sequence[dict[str, str]], concurrency: int
) -> list[Outcome]:
    """`concurrency` clients, each sending its next stream when the last ended."""
    results: list[Outcome] = [Outcome() for _ in bodies]
    todo = iter(range(len(bodies)))
    async with _session() as session:

        async def client() -> None:
            for i in todo:
                results[i] = await read_stream(
                    session, url, bodies[i], headers[i], time.monotonic()
                )

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


async def open_loop(url: str, bodies: Sequence[bytes], rate: float) -> list[Outcome]:
    """Stream i is due at t0 + i / rate whatever happened before; times from its due time."""
    async with _session() as session:
        t0 = time.monotonic() + 0.05
        tasks = []
        for i, body in enumerate(bodies):
            due = t0 + i / rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(read_stream(session, url, body, NO_CACHE, due)))
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------- figures


def ms(values: Sequence[float], q: float) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return round(percentile(finite, q) * 1e3, 1) if finite else None


def quantiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    finite = [v for v in values if math.isfinite(v)]
    out: dict[str, Any] = {f"p{q:g}": ms(finite, q) for q in qs}
    out["max"] = round(max(finite) * 1e3, 1) if finite else None
    out["n"] = len(finite)
    return out


@dataclass
class CpuWatch:
    """The proxy's CPU share over a block of time (its process tree)."""

    pid: int
    cpu0: float = 0.0
    t0: float = 0.0
    share: float = 0.0

    def __enter__(self) -> CpuWatch:
        self.cpu0, self.t0 = tree_cpu([self.pid])[self.pid], time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = (tree_cpu([self.pid])[self.pid] - self.cpu0) / (time.monotonic() - self.t0)


def sim_requests(fleet: Fleet, names: Sequence[str]) -> int:
    total = 0
    for name in names:
        url = f"http://{fleet.origins[name].address}/sim/stats"
        with urllib.request.urlopen(url, timeout=5) as resp:
            total += int(json.loads(resp.read())["requests"])
    return total


def proxy_metric(fleet: Fleet, name: str, labels: str) -> float:
    """A counter of the proxy's /metrics (0 when absent), e.g. ponto_hedges_total
    with labels 'outcome="started"'."""
    url = fleet.metrics_url("p")
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.escape(name) + r"\{" + re.escape(labels) + r"\} ([0-9.e+]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def verdict(
    goal: str, value: float | None, unit: str, ok: bool | None, target: str
) -> dict[str, Any]:
    return {"goal": goal, "value": value, "unit": unit, "pass": ok, "target": target}


# ---------------------------------------------------------------- the fleet


def start(fleet: Fleet) -> None:
    """etcd, a control plane, origin A behind the cut link, B, the stall pool, one proxy."""
    fleet.start_etcd()
    fleet.start_control()
    fleet.add_region(HOME)
    fleet.add_region(NEXT)
    pace = ["--answer-tokens", str(ANSWER_TOKENS)]
    for name in ("a", "b"):
        fleet.start_origin(
            name,
            HOME.name,
            ttft_ms=CUT_TTFT_MS,
            tokens_per_s=CUT_TOKENS_PER_S,
            models=(CUT_MODEL,),
            extra=pace,
        )
    ready = fleet.workdir / "cutlink.addr"
    argv = [
        *python_entry("bench.cutlink"),
        "--origin",
        f"http://{fleet.origins['a'].address}",
        "--header",
        CUT_HEADER,
        "--ready-file",
        str(ready),
    ]
    link = spawn("cutlink", argv, fleet.workdir, ready_file=ready)
    fleet.origins["cutlink"] = link  # stopped with the origins
    fleet.add_origin("a", HOME.name, f"http://{link.address}/v1", (CUT_MODEL,))
    fleet.add_origin("b", NEXT.name, fleet.origin_url("b"), (CUT_MODEL,))
    for i in range(REPLICAS):
        name = f"s{i}"
        fleet.start_origin(
            name,
            HOME.name,
            ttft_ms=STALL_TTFT_MS,
            tokens_per_s=200,
            models=(STALL_MODEL,),
            extra=[
                "--answer-tokens",
                "16",
                "--stall-rate",
                str(STALL_RATE),
                "--stall-ms",
                str(STALL_MS),
                "--seed",
                str(SEED + i),
            ],
        )
        fleet.add_origin(name, HOME.name, fleet.origin_url(name), (STALL_MODEL,))
    fleet.admin().PutTenant(
        apb.PutTenantRequest(tenant=pb.Tenant(name="default"), allow_update=True), timeout=10
    )
    version = fleet.wait_table(
        lambda t: len(t.origins) == 2 + REPLICAS and all(o.healthy for o in t.origins)
    )
    fleet.start_proxy("p", HOME.name, extra=["--forward-headers", f"{CUT_HEADER},x-sim-stall-ms"])
    fleet.wait_proxies_at(version)


def set_streams(fleet: Fleet, policy: pb.StreamPolicy) -> None:
    """The default tenant's stream policy, once every proxy serves it."""
    fleet.admin().UpdateTenant(apb.UpdateTenantRequest(name="default", streams=policy), timeout=10)

    def has(table: pb.RouteTable) -> bool:
        return any(t.name == "default" and t.streams == policy for t in table.tenants)

    fleet.wait_proxies_at(fleet.wait_table(has))


# ---------------------------------------------------------------- phase 1: cut streams


@dataclass
class CutRun:
    label: str
    outcomes: list[Outcome]
    cpu: float
    seconds: float
    broken: int = 0
    added: list[float] = field(default_factory=list)


def cut_phase(fleet: Fleet, n: int) -> dict[str, Any]:
    rng = random.Random(SEED)
    prompts = [f"Tell me how a lighthouse works, story {i}" for i in range(n)]
    cuts = [rng.randint(1, ANSWER_TOKENS) for _ in range(n)]
    bodies = [chat_body(CUT_MODEL, p) for p in prompts]
    cut_headers = [{**NO_CACHE, CUT_HEADER: str(k)} for k in cuts]
    plain = [NO_CACHE] * n
    proxy = fleet.proxies["p"]
    url = fleet.proxy_url("p") + "/chat/completions"

    print(f"## Cut streams: {n} streams, {CUT_CONCURRENCY} at a time", flush=True)
    t = time.monotonic()
    ref = asyncio.run(
        closed_loop(fleet.origin_url("b") + "/chat/completions", bodies, plain, CUT_CONCURRENCY)
    )
    bad_ref = sum(o.broken(None) for o in ref)
    if bad_ref:
        raise RuntimeError(f"{bad_ref} reference answers from B failed: {ref[0].error}")
    expected = [o.text for o in ref]
    print(f"  reference (B direct): {time.monotonic() - t:.1f} s", flush=True)

    runs: dict[str, CutRun] = {}
    for key, label, policy, headers in (
        ("uncut", "uncut, through Ponto", pb.StreamPolicy(continuation="on"), plain),
        ("off", "cut, continuation off", pb.StreamPolicy(continuation="off"), cut_headers),
        ("on", "cut, continuation on", pb.StreamPolicy(continuation="on"), cut_headers),
    ):
        set_streams(fleet, policy)
        t = time.monotonic()
        with CpuWatch(proxy.proc.pid) as cpu:
            outcomes = asyncio.run(closed_loop(url, bodies, headers, CUT_CONCURRENCY))
        run = runs[key] = CutRun(label, outcomes, cpu.share, time.monotonic() - t)
        run.broken = sum(o.broken(e) for o, e in zip(outcomes, expected, strict=True))
        print(
            f"  {label}: {run.seconds:.1f} s, {run.broken} broken, proxy CPU "
            f"{100 * cpu.share:.0f} %",
            flush=True,
        )

    origin_ttft = ms([o.first for o in ref], 50) or math.nan
    uncut_p50 = ms([o.end for o in runs["uncut"].outcomes], 50) or math.nan
    on = runs["on"]
    on.added = [o.end - uncut_p50 / 1e3 for o in on.outcomes if not o.broken(None)]
    examples = [o.error for o in runs["off"].outcomes if o.error][:1]
    return {
        "streams": n,
        "concurrency": CUT_CONCURRENCY,
        "cut_points_tokens": {"min": min(cuts), "max": max(cuts), "mean": sum(cuts) / n},
        "origin": {
            "ttft_ms": CUT_TTFT_MS,
            "tokens_per_s": CUT_TOKENS_PER_S,
            "answer_tokens": ANSWER_TOKENS,
        },
        "reference_direct": {
            "ttft_ms": quantiles([o.first for o in ref]),
            "duration_ms": quantiles([o.end for o in ref]),
        },
        "origin_ttft_p50_ms": origin_ttft,
        "uncut_duration_p50_ms": uncut_p50,
        "runs": {
            key: {
                "label": r.label,
                "broken": r.broken,
                "error_events": sum(bool(o.error) for o in r.outcomes),
                "missing_done": sum(not o.done for o in r.outcomes),
                "wrong_text": sum(
                    o.status == 200 and o.done and not o.error and o.text != e
                    for o, e in zip(r.outcomes, expected, strict=True)
                ),
                "continued": {
                    str(c): sum(o.continued == c for o in r.outcomes)
                    for c in sorted({o.continued for o in r.outcomes})
                },
                "duration_ms": quantiles([o.end for o in r.outcomes]),
                "ttft_ms": quantiles([o.first for o in r.outcomes]),
                "proxy_cpu_percent": round(100 * r.cpu, 1),
                "seconds": round(r.seconds, 1),
            }
            for key, r in runs.items()
        },
        "added_ms": quantiles(on.added, (50, 90)),
        # The continuing origin must produce a first token (its TTFT), while the
        # token that was due next would have come one decode gap later anyway.
        "floor_ms": round(origin_ttft - 1000 / CUT_TOKENS_PER_S, 1),
        "error_example": examples[0] if examples else "",
        "_added": on.added,
        "_durations": {k: [o.end for o in r.outcomes] for k, r in runs.items()},
    }


# ---------------------------------------------------------------- phase 2: stalls


def hedging_available(fleet: Fleet) -> bool:
    """Whether the proxy hedges for a tenant with a hedge policy: three
    requests that stall 400 ms with a 50 ms hedge delay, and the proxy's
    ponto_hedges_total{outcome="started"} before and after."""
    set_streams(fleet, pb.StreamPolicy(continuation="on", hedge_ms=50))
    before = proxy_metric(fleet, "ponto_hedges_total", 'outcome="started"')
    url = fleet.proxy_url("p") + "/chat/completions"

    async def probe() -> None:
        async with _session() as session:
            for i in range(3):
                headers = {**NO_CACHE, "x-sim-stall-ms": "400"}
                body = chat_body(STALL_MODEL, f"hedge probe {i}")
                await read_stream(session, url, body, headers, time.monotonic())

    asyncio.run(probe())
    return proxy_metric(fleet, "ponto_hedges_total", 'outcome="started"') > before


def stall_phase(fleet: Fleet, measure_s: float, warmup_s: float) -> dict[str, Any]:
    names = [f"s{i}" for i in range(REPLICAS)]
    proxy = fleet.proxies["p"]
    url = fleet.proxy_url("p") + "/chat/completions"
    warm = int(warmup_s * RATE)
    count = warm + int(measure_s * RATE)
    print(
        f"\n## Stalls: {REPLICAS} replicas, {100 * STALL_RATE:g} % of requests stall "
        f"{STALL_MS} ms; {RATE:g} requests/s open loop, {warmup_s:g} s warm-up + "
        f"{measure_s:g} s measured per configuration",
        flush=True,
    )
    available = hedging_available(fleet)
    if not available:
        print(
            "  hedging not available: the proxy sent no hedge for a tenant with a hedge "
            "policy (ponto_hedges_total unchanged)",
            flush=True,
        )
    configs: list[tuple[str, str, pb.StreamPolicy]] = [
        ("none", "no hedging", pb.StreamPolicy(continuation="on"))
    ]
    if available:
        configs += [
            (
                "fixed",
                f"hedge {HEDGE_MS} ms",
                pb.StreamPolicy(continuation="on", hedge_ms=HEDGE_MS),
            ),
            ("auto", "hedge auto", pb.StreamPolicy(continuation="on", hedge_auto=True)),
        ]
    results: dict[str, Any] = {}
    ttfts: dict[str, list[float]] = {}
    for key, label, policy in configs:
        set_streams(fleet, policy)
        bodies = [chat_body(STALL_MODEL, f"{key} request {i}") for i in range(count)]
        sent0 = sim_requests(fleet, names)
        started0 = proxy_metric(fleet, "ponto_hedges_total", 'outcome="started"')
        won0 = proxy_metric(fleet, "ponto_hedges_total", 'outcome="won"')
        t = time.monotonic()
        with CpuWatch(proxy.proc.pid) as cpu:
            outcomes = asyncio.run(open_loop(url, bodies, RATE))
        seconds = time.monotonic() - t
        sent = sim_requests(fleet, names) - sent0
        measured = outcomes[warm:]
        ttfts[key] = [o.first for o in measured]
        failed = sum(o.broken(None) for o in outcomes)
        results[key] = {
            "label": label,
            "requests": count,
            "measured": len(measured),
            "failed": failed,
            "ttft_ms": quantiles(ttfts[key]),
            "hedged_answers": sum(o.hedged for o in outcomes),
            "hedges_started": proxy_metric(fleet, "ponto_hedges_total", 'outcome="started"')
            - started0,
            "hedges_won": proxy_metric(fleet, "ponto_hedges_total", 'outcome="won"') - won0,
            "origin_requests": sent,
            "extra_origin_requests_percent": round(100 * (sent / count - 1), 2),
            "proxy_cpu_percent": round(100 * cpu.share, 1),
            "seconds": round(seconds, 1),
        }
        r = results[key]
        print(
            f"  {label}: TTFT p50 {r['ttft_ms']['p50']} ms, p99 {r['ttft_ms']['p99']} ms; "
            f"extra origin requests {r['extra_origin_requests_percent']} %; "
            f"{failed} failed; proxy CPU {r['proxy_cpu_percent']} %",
            flush=True,
        )
    return {
        "replicas": REPLICAS,
        "stall_rate": STALL_RATE,
        "stall_ms": STALL_MS,
        "ttft_ms": STALL_TTFT_MS,
        "rate_per_s": RATE,
        "warmup_s": warmup_s,
        "measure_s": measure_s,
        "hedge_ms": HEDGE_MS,
        "hedging_available": available,
        "configs": results,
        "_ttfts": ttfts,
    }


# ---------------------------------------------------------------- aims and report


def aims(cut: dict[str, Any], stalls: dict[str, Any]) -> list[dict[str, Any]]:
    runs = cut["runs"]
    ttft = cut["origin_ttft_p50_ms"]
    out = [
        verdict(
            "cut streams broken, continuation off (today)",
            runs["off"]["broken"],
            f"of {cut['streams']}",
            None,
            "every one",
        ),
        verdict(
            "cut streams broken, continuation on",
            runs["on"]["broken"],
            f"of {cut['streams']}",
            runs["on"]["broken"] == 0,
            "0",
        ),
    ]
    for q in ("p50", "p90"):
        added = cut["added_ms"][q]
        ok = None if added is None else added < ttft
        out.append(
            verdict(
                f"time continuation adds, {q}", added, "ms", ok, f"< 1 origin TTFT ({ttft:g} ms)"
            )
        )
    configs = stalls["configs"]
    none = configs["none"]["ttft_ms"]
    for key in ("fixed", "auto"):
        if key not in configs:
            out.append(
                verdict(
                    f"hedging ({key}): TTFT p99 cut",
                    None,
                    "x",
                    None,
                    ">= 5x (hedging not available)",
                )
            )
            continue
        c = configs[key]
        p99 = c["ttft_ms"]["p99"]
        ratio = round(none["p99"] / p99, 1) if p99 else None
        c["p99_ratio"] = ratio
        extra = c["extra_origin_requests_percent"]
        p50_change = round(c["ttft_ms"]["p50"] - none["p50"], 1)
        noise = max(P50_NOISE_MS, 0.1 * none["p50"])
        label = c["label"]
        out += [
            verdict(
                f"{label}: TTFT p99 no hedge / hedged",
                ratio,
                "x",
                ratio is not None and ratio >= 5,
                ">= 5x",
            ),
            verdict(f"{label}: extra origin requests", extra, "%", extra <= 10, "<= 10 %"),
            verdict(
                f"{label}: TTFT p50 change",
                p50_change,
                "ms",
                abs(p50_change) <= noise,
                f"within noise (|change| <= {noise:.0f} ms)",
            ),
        ]
    return out


def _minus(a: float | None, b: float) -> float | None:
    return None if a is None else round(a - b, 1)


def _v(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def tables(
    cut: dict[str, Any], stalls: dict[str, Any], goals: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    out = [
        {
            "title": "Aims",
            "columns": ["aim", "measured", "target", "verdict"],
            "rows": [
                [
                    g["goal"],
                    f"{_v(g['value'])} {g['unit']}",
                    g["target"],
                    {True: "PASS", False: "MISS", None: "n/a"}[g["pass"]],
                ]
                for g in goals
            ],
        }
    ]
    runs = cut["runs"]
    keys = list(runs)

    def row(name: str, get: Callable[[dict[str, Any]], Any]) -> list[Any]:
        return [name, *[_v(get(runs[k])) for k in keys]]

    cut_rows = [
        row("broken streams", lambda r: f"{r['broken']} of {cut['streams']}"),
        row("  with an error event", lambda r: r["error_events"]),
        row("  without [DONE]", lambda r: r["missing_done"]),
        row("  with wrong text", lambda r: r["wrong_text"]),
        row(
            "continued (count: streams)",
            lambda r: ", ".join(f"{k}: {v}" for k, v in r["continued"].items()),
        ),
        row(
            "duration p50 / p90 / max, ms",
            lambda r: " / ".join(_v(r["duration_ms"][q]) for q in ("p50", "p90", "max")),
        ),
        row(
            "TTFT p50 / p99, ms", lambda r: " / ".join(_v(r["ttft_ms"][q]) for q in ("p50", "p99"))
        ),
        row("proxy CPU, % of a core", lambda r: r["proxy_cpu_percent"]),
    ]
    added = cut["added_ms"]
    cut_rows.append(
        [
            "added by continuation p50 / p90 / max, ms",
            "",
            "",
            " / ".join(_v(added[q]) for q in ("p50", "p90", "max")),
        ]
    )
    cut_rows.append(
        [
            "added beyond the floor (B's TTFT - 1 token gap) p50 / p90, ms",
            "",
            "",
            " / ".join(_v(_minus(added[q], cut["floor_ms"])) for q in ("p50", "p90")),
        ]
    )
    out.append(
        {
            "title": f"Cut streams (origin TTFT p50 {_v(cut['origin_ttft_p50_ms'])} ms, B direct)",
            "columns": ["", *[runs[k]["label"] for k in keys]],
            "rows": cut_rows,
        }
    )
    configs = stalls["configs"]
    ckeys = list(configs)

    def srow(name: str, get: Callable[[dict[str, Any]], Any]) -> list[Any]:
        return [name, *[_v(get(configs[k])) for k in ckeys]]

    stall_rows = [
        srow("requests measured (after warm-up)", lambda c: c["measured"]),
        srow("TTFT p50, ms", lambda c: c["ttft_ms"]["p50"]),
        srow("TTFT p90, ms", lambda c: c["ttft_ms"]["p90"]),
        srow("TTFT p99, ms", lambda c: c["ttft_ms"]["p99"]),
        srow("TTFT max, ms", lambda c: c["ttft_ms"]["max"]),
        srow("p99 no hedge / this", lambda c: c.get("p99_ratio", 1.0)),
        srow("hedges started / won", lambda c: f"{c['hedges_started']:g} / {c['hedges_won']:g}"),
        srow("answers with x-ponto-hedged", lambda c: c["hedged_answers"]),
        srow("extra origin requests, %", lambda c: c["extra_origin_requests_percent"]),
        srow("failed requests", lambda c: c["failed"]),
        srow("proxy CPU, % of a core", lambda c: c["proxy_cpu_percent"]),
    ]
    title = "Stalls" + ("" if stalls["hedging_available"] else " (hedging not available)")
    out.append(
        {"title": title, "columns": ["", *[configs[k]["label"] for k in ckeys]], "rows": stall_rows}
    )
    return out


def print_tables(ts: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for t in ts:
        cols = [str(c) for c in t["columns"]]
        rows = [[str(v) for v in r] for r in t["rows"]]
        widths = [max(len(x) for x in col) for col in zip(cols, *rows, strict=True)]
        lines += ["", t["title"]]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def plot(cut: dict[str, Any], stalls: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, values in cut["_durations"].items():
        xs = sorted(v * 1e3 for v in values if math.isfinite(v))
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        left.plot(xs, ys, label=cut["runs"][key]["label"])
    left.set_xlabel("stream duration at the client, ms")
    left.set_ylabel("fraction of streams")
    left.set_title(f"Cut streams ({cut['streams']})", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    for key, values in stalls["_ttfts"].items():
        xs = sorted(v * 1e3 for v in values if math.isfinite(v))
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        right.plot(xs, ys, label=stalls["configs"][key]["label"])
    right.set_xscale("log")
    right.set_ylim(0.9, 1.001)
    right.set_xlabel("TTFT at the client, ms (log)")
    right.set_ylabel("fraction of requests (upper 10 %)")
    right.set_title(f"Stalls: {100 * STALL_RATE:g} % stall {STALL_MS} ms", fontsize=10)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


METHOD = __doc__.split('Phase "cut streams".', 1)[1] if __doc__ else ""


def markdown(report: dict[str, Any], ts: list[dict[str, Any]]) -> str:
    m = report["machine"]
    parts = [
        "# Resilience: cut streams and stalled origins",
        "",
        f"`python -m bench.resilience` (in `make bench`), run {report['date']} in "
        f"{report['seconds']:.0f} s on {m['CPU']}, {m['cores']} cores, {m['memory']}, "
        f"Linux {m['kernel']}, Python {m['Python']}; git {report['git_commit']}. "
        "Data: [resilience.json](resilience.json). Everything (etcd, control plane, "
        "simulators, the cut link, the proxy and the client) shares these cores.",
        "",
        "## Method",
        "",
        'Phase "cut streams".' + METHOD.rstrip(),
        "",
    ]
    for t in ts:
        parts += [f"## {t['title']}", "", md_table(t["columns"], t["rows"]), ""]
    cut = report["cut"]
    added = cut["added_ms"]
    parts += [
        "## Reading the figures",
        "",
        f"- A continuation cannot cost less than the continuing origin's own time to "
        f"first token: it has to prefill the prompt plus the text so far and produce a "
        f"token. What it saves is the decode gap to the token that was due next "
        f"({1000 / CUT_TOKENS_PER_S:g} ms at {CUT_TOKENS_PER_S} tokens/s). The floor is "
        f"therefore B's TTFT minus one gap, {_v(cut['floor_ms'])} ms here; the p50 added "
        f"time was {_v(added['p50'])} ms, {_v(_minus(added['p50'], cut['floor_ms']))} ms "
        "above it (the proxy's detection of the cut, the continuation request, and CPU "
        "shared with every other process of the run).",
        "- The aim of under 1 origin TTFT thus leaves one decode gap of room for the "
        "proxy: met at slow decode rates, tight at fast ones.",
        "- Extra origin requests count every request the simulators received, hedges "
        "that were cancelled included, over the whole run (warm-up included).",
        f"- Load average of the machine before / after the run: {report['loadavg']}. "
        "Other work on the machine during the run shows up in every column alike.",
        "",
    ]
    example = report["cut"].get("error_example")
    if example:
        parts += [f"With continuation off, a cut stream ends with: `{example}`", ""]
    parts += ["![TTFT and stream durations](resilience.png)", ""]
    return "\n".join(parts)


def public(data: Any) -> Any:
    """`data` without the raw samples (keys starting with _)."""
    if isinstance(data, dict):
        return {k: public(v) for k, v in data.items() if not str(k).startswith("_")}
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="300 streams, shorter stall runs")
    p.add_argument("--streams", type=int, help="streams in the cut phase (default 1000)")
    p.add_argument(
        "--out-dir",
        type=Path,
        help=f"where to write resilience.* (default {DEFAULT_DIR}; none if --quick)",
    )
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too
    n = a.streams or (300 if a.quick else 1000)
    measure_s, warmup_s = (8.0, 3.0) if a.quick else (20.0, 4.0)
    out_dir = a.out_dir or (None if a.quick else DEFAULT_DIR)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ponto-resilience-") as tmp, Fleet(Path(tmp)) as fleet:
        start(fleet)
        cut = cut_phase(fleet, n)
        stalls = stall_phase(fleet, measure_s, warmup_s)
    goals = aims(cut, stalls)
    ts = tables(cut, stalls, goals)
    text = print_tables(ts)
    print(text)
    seconds = time.monotonic() - started
    print(f"\n{seconds:.0f} s in all")
    if out_dir is None:
        return 0
    report = {
        "name": "resilience",
        "title": "Resilience: cut streams and stalled origins",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(seconds, 1),
        "images": ["resilience.png"],
        "machine": machine(),
        "versions": versions({}),
        "git_commit": git_commit(),
        "loadavg": f"{load_before:.2f} / {os.getloadavg()[0]:.2f}",
        "cut": public(cut),
        "stalls": public(stalls),
        "aims": goals,
        "tables": ts,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(cut, stalls, out_dir / "resilience.png")
    (out_dir / "resilience.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "resilience.md").write_text(markdown(report, ts))
    print(f"wrote {out_dir}/resilience.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
