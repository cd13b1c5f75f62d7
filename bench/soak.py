"""A steady mixed load on one proxy for a long time: is its memory and descriptor use flat?

    .venv/bin/python -m bench.soak [--minutes 60] [--rate 25] [--cache-mb 2]
                                   [--semantic] [--out docs/benchmarks/soak.md]

`SOAK_MINUTES` in the environment sets the default for --minutes. The fleet is
bench/fuzz.py's (etcd, a control plane, an origin simulator, one proxy, two
tenants with a key each), the proxy's exact cache bounded at --cache-mb so that
it is full early and evicting for the rest of the run. The load is an open loop
at --rate requests a second: chat (a third of them streamed), completions and
embeddings; two in five are repeats of 200 fixed questions (exact-cache hits
once seen), the rest new. Every 10 s: the proxy's RSS, its open descriptors (the
fewest seen in checks a second apart, so connections in flight do not count and a
leak does) and the cache's bytes, entries and evictions (its /metrics).

With --semantic both tenants cache semantically (the MiniLM model, an embedding
per request) and every request is a chat with a new question, so each one adds
an exact entry and a semantic entry until the bound (--cache-mb, shared by both)
is reached: the run shows whether RSS stays flat once it is. --out then writes
(or replaces) the "Semantic caching on" section of the file, keeping the rest.

The slopes (least squares, MB/min and descriptors/min) are taken over the
samples after the caches are full: from the later of 20 % of the run and the
first sample with an eviction. Flat means that an hour at that slope adds less
than 5 % of the mean RSS and fewer than 5 descriptors. Exit status 1 if either
slope is not flat or more than 0.1 % of the requests failed (a 5xx, a non-2xx,
or no answer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.compare import cache_stats
from bench.fuzz import System, open_fds, pct, rss_mb, start_system
from ponto.v1 import routing_pb2 as pb

REPEATS = 200
MAX_IN_FLIGHT = 64


@dataclass
class Sample:
    t: float  # seconds since the load began
    rss_mb: float
    fds: (
        int  # the fewest open descriptors seen in the second-by-second checks since the last sample
    )
    cache: dict[str, float]
    requests: int


@dataclass
class Load:
    statuses: Counter[str] = field(default_factory=Counter)
    latency_ms: list[float] = field(default_factory=list)
    in_flight: int = 0
    skipped: int = 0  # ticks with MAX_IN_FLIGHT requests already under way

    @property
    def done(self) -> int:
        return sum(self.statuses.values())


WORDS = (
    "invoice", "refund", "password", "router", "printer", "battery", "contract",
    "delivery", "account", "warranty", "subscription", "firmware", "calendar",
    "passport", "mortgage", "recipe", "garden", "license", "backup", "upgrade",
)  # fmt: skip


def semantic_request_for(rng: random.Random, n: int) -> tuple[str, dict[str, Any], bool]:
    """A chat with a question never asked before (its number is an entity, so it
    never hits another), a third of them streamed."""
    a, b, c = rng.sample(WORDS, 3)
    text = f"question {n}: how do I move my {a} and my {b} to the new {c} plan"
    return _chat(text, rng.random() < 0.33)


def _chat(text: str, stream: bool) -> tuple[str, dict[str, Any], bool]:
    """A deterministic chat request asking `text`."""
    body: dict[str, Any] = {
        "model": "sim-small",
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }
    return "/v1/chat/completions", body, stream


def request_for(rng: random.Random, n: int) -> tuple[str, dict[str, Any], bool]:
    """(path, body, is_stream) of the n-th request of the mix."""
    repeat = rng.random() < 0.4
    text = (
        f"soak question {rng.randrange(REPEATS)}" if repeat else f"soak unique {n} {rng.random()}"
    )
    roll = rng.random()
    if roll < 0.7:
        return _chat(text, rng.random() < 0.33)
    if roll < 0.85:
        return "/v1/completions", {"model": "sim-small", "temperature": 0, "prompt": text}, False
    return "/v1/embeddings", {"model": "sim-small", "input": text}, False


async def one(
    session: aiohttp.ClientSession,
    system: System,
    load: Load,
    rng: random.Random,
    n: int,
    semantic: bool = False,
) -> None:
    path, body, stream = (semantic_request_for if semantic else request_for)(rng, n)
    key = system.keys[n % len(system.keys)]
    load.in_flight += 1
    t0 = time.perf_counter()
    try:
        async with session.post(
            system.base + path, json=body, headers={"authorization": f"Bearer {key}"}
        ) as resp:
            if stream:
                async for _ in resp.content.iter_any():
                    pass
            else:
                await resp.read()
            load.statuses[str(resp.status)] += 1
            if resp.status == 200:
                load.latency_ms.append((time.perf_counter() - t0) * 1000)
    except (aiohttp.ClientError, TimeoutError) as exc:
        load.statuses[type(exc).__name__] += 1
    finally:
        load.in_flight -= 1


def proxy_stats(address: str) -> dict[str, float]:
    """cache_stats plus the semantic index's entries and bytes (part of "bytes")."""
    stats = cache_stats(address)
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return stats
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in ("ponto_semantic_entries", "ponto_semantic_bytes"):
            stats[name.removeprefix("ponto_")] = float(value)
    return stats


async def soak(
    system: System, minutes: float, rate: float, sample_s: float, semantic: bool = False
) -> tuple[Load, list[Sample]]:
    rng = random.Random(15)
    load, samples = Load(), []
    pid = system.proxy.proc.pid
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic()
        end = start + minutes * 60
        next_sample = next_check = start
        fewest_fds = open_fds(pid)
        n = 0
        while (now := time.monotonic()) < end:
            if now >= next_check:
                # The floor over a sample's checks: connections in flight come and go,
                # a leaked descriptor stays.
                fewest_fds = min(fewest_fds, open_fds(pid))
                next_check += 1.0
            if now >= next_sample:
                stats = await asyncio.to_thread(proxy_stats, system.metrics_address)
                samples.append(
                    Sample(now - start, round(rss_mb(pid), 2), fewest_fds, stats, load.done)
                )
                if len(samples) % max(1, round(60 / sample_s)) == 1:
                    print(progress(samples[-1]), file=sys.stderr, flush=True)
                fewest_fds = open_fds(pid)
                next_sample += sample_s
            if load.in_flight >= MAX_IN_FLIGHT:
                load.skipped += 1
            else:
                task = asyncio.ensure_future(one(session, system, load, rng, n, semantic))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        await asyncio.gather(*tasks)
    stats = proxy_stats(system.metrics_address)
    samples.append(
        Sample(time.monotonic() - start, round(rss_mb(pid), 2), open_fds(pid), stats, load.done)
    )
    return load, samples


def progress(s: Sample) -> str:
    c = s.cache
    return (
        f"{s.t:5.0f} s  RSS {s.rss_mb:7.2f} MB  cache {c.get('bytes', 0) / 2**20:6.2f} MB"
        f" ({c.get('entries', 0):,.0f} exact, {c.get('semantic_entries', 0):,.0f} semantic"
        f" = {c.get('semantic_bytes', 0) / 2**20:.2f} MB)  evictions {c.get('evictions', 0):,.0f}"
        f"  requests {s.requests:,}"
    )


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute; 0 for fewer than 2."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 60


@dataclass
class SoakReport:
    minutes: float
    rate: float
    cache_mb: int
    load: Load
    samples: list[Sample]
    window_from: float = 0.0
    rss_slope: float = 0.0
    fd_slope: float = 0.0
    cache_slope: float = 0.0
    failures: list[str] = field(default_factory=list)
    semantic: bool = False


def judge(
    minutes: float, rate: float, cache_mb: int, load: Load, samples: list[Sample]
) -> SoakReport:
    full = next((s.t for s in samples if s.cache.get("evictions", 0) > 0), None)
    window_from = max(0.2 * minutes * 60, full if full is not None else 0.0)
    window = [s for s in samples if s.t >= window_from] or samples[-2:]
    report = SoakReport(minutes, rate, cache_mb, load, samples, window_from)
    report.rss_slope = slope_per_min([(s.t, s.rss_mb) for s in window])
    report.fd_slope = slope_per_min([(s.t, s.fds) for s in window])
    report.cache_slope = slope_per_min([(s.t, s.cache.get("bytes", 0) / 2**20) for s in window])
    mean_rss = statistics.fmean(s.rss_mb for s in window)
    if report.rss_slope * 60 >= 0.05 * mean_rss:
        report.failures.append(f"RSS grows {report.rss_slope:.3f} MB/min")
    if report.fd_slope * 60 >= 5:
        report.failures.append(f"descriptors grow {report.fd_slope:.3f}/min")
    bad = sum(n for status, n in load.statuses.items() if status != "200")
    if load.done and bad > 0.001 * load.done:
        report.failures.append(f"{bad} of {load.done} requests failed: {dict(load.statuses)}")
    if full is None:
        report.failures.append("the cache never filled (no eviction): slopes include its growth")
    return report


SEMANTIC_HEADING = "## Semantic caching on"


def semantic_markdown(r: SoakReport) -> str:
    """The --semantic run as a section of docs/benchmarks/soak.md."""
    first, last = r.samples[0], r.samples[-1]
    window = [s for s in r.samples if s.t >= r.window_from]
    at_bound = window[0] if window else last
    cache = last.cache
    lines = [
        SEMANTIC_HEADING,
        "",
        f"`python -m bench.soak --semantic --minutes {r.minutes:g} --rate {r.rate:g}"
        f" --cache-mb {r.cache_mb}`: the same fleet, both tenants caching semantically"
        " (MiniLM, one embedding per request), every request a chat with a new question"
        " (a third streamed), so each adds an exact and a semantic entry until the bound,"
        " which both share, is reached.",
        "",
        f"- {r.minutes:g} min at {r.rate:g} requests/s: {r.load.done:,} requests,"
        f" statuses {dict(r.load.statuses)}, {r.load.skipped} ticks skipped",
        f"- latency of 200s: p50 {pct(r.load.latency_ms, 0.5):.1f} ms,"
        f" p99 {pct(r.load.latency_ms, 0.99):.1f} ms",
        f"- bound {r.cache_mb} MB: at the end the cache held"
        f" {cache.get('bytes', 0) / 2**20:.2f} MB, of which the semantic index"
        f" {cache.get('semantic_bytes', 0) / 2**20:.2f} MB"
        f" ({cache.get('semantic_entries', 0):,.0f} entries) and the exact store"
        f" {cache.get('entries', 0):,.0f} entries; {cache.get('evictions', 0):,.0f} evictions",
        f"- RSS {first.rss_mb} MB at the start, {at_bound.rss_mb} MB when the bound was"
        f" reached ({r.window_from:.0f} s), {last.rss_mb} MB at the end",
        f"- slopes from {r.window_from:.0f} s on: RSS {r.rss_slope:+.3f} MB/min,"
        f" descriptors {r.fd_slope:+.3f}/min, cache bytes {r.cache_slope:+.3f} MB/min",
        f"- verdict: **{'FLAT' if not r.failures else 'NOT FLAT'}**"
        + ("" if not r.failures else " (" + "; ".join(r.failures) + ")"),
        "",
        "| t (s) | RSS (MB) | cache (MB) | semantic (MB) | exact entries | semantic entries"
        " | evictions | requests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r.samples:
        c = s.cache
        lines.append(
            f"| {s.t:.0f} | {s.rss_mb} | {c.get('bytes', 0) / 2**20:.2f}"
            f" | {c.get('semantic_bytes', 0) / 2**20:.2f} | {c.get('entries', 0):,.0f}"
            f" | {c.get('semantic_entries', 0):,.0f} | {c.get('evictions', 0):,.0f}"
            f" | {s.requests:,} |"
        )
    return "\n".join(lines) + "\n"


def replace_section(document: str, heading: str, section: str) -> str:
    """`document` with the section under `heading` (to the next "## " heading or
    the end) replaced by `section`, or `section` appended."""
    start = document.find(heading + "\n")
    if start < 0:
        return document.rstrip("\n") + "\n\n" + section
    end = document.find("\n## ", start + len(heading))
    rest = document[end + 1 :] if end >= 0 else ""
    return document[:start] + section + ("\n" + rest if rest else "")


def markdown(r: SoakReport) -> str:
    first, last = r.samples[0], r.samples[-1]
    cache = last.cache
    lines = [
        "# Soak run (`make soak`)",
        "",
        "Written by `python -m bench.soak` (bench/soak.py): one proxy, one origin simulator,"
        " etcd and a control plane on this machine's 2 shared cores; an open loop of"
        " mixed requests (chat, a third streamed; completions; embeddings; 40 % repeats of"
        " 200 questions, so exact-cache hits) from two tenants with a key each.",
        "",
        f"- {r.minutes:g} min at {r.rate:g} requests/s: {r.load.done:,} requests,"
        f" statuses {dict(r.load.statuses)}, {r.load.skipped} ticks skipped"
        f" ({MAX_IN_FLIGHT} in flight)",
        f"- latency of 200s: p50 {pct(r.load.latency_ms, 0.5):.1f} ms,"
        f" p99 {pct(r.load.latency_ms, 0.99):.1f} ms",
        f"- exact cache bounded at {r.cache_mb} MB: {cache.get('bytes', 0) / 2**20:.2f} MB"
        f" held at the end, {cache.get('entries', 0):,.0f} entries,"
        f" {cache.get('evictions', 0):,.0f} evictions, {cache.get('hit', 0):,.0f} hits,"
        f" {cache.get('miss', 0):,.0f} misses",
        f"- RSS {first.rss_mb} MB at the start, {last.rss_mb} MB at the end;"
        f" descriptors {first.fds} at the start, {last.fds} at the end",
        f"- slopes from {r.window_from:.0f} s on (caches full): RSS {r.rss_slope:+.3f} MB/min,"
        f" descriptors {r.fd_slope:+.3f}/min, cache bytes {r.cache_slope:+.3f} MB/min",
        f"- verdict: **{'FLAT' if not r.failures else 'NOT FLAT'}**"
        + ("" if not r.failures else " (" + "; ".join(r.failures) + ")"),
        "",
        "| t (s) | RSS (MB) | descriptors | cache (MB) | cache entries | evictions | requests |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r.samples:
        lines.append(
            f"| {s.t:.0f} | {s.rss_mb} | {s.fds} | {s.cache.get('bytes', 0) / 2**20:.2f}"
            f" | {s.cache.get('entries', 0):,.0f} | {s.cache.get('evictions', 0):,.0f}"
            f" | {s.requests:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "60")))
    p.add_argument("--rate", type=float, default=25.0, help="requests a second")
    p.add_argument("--cache-mb", type=int, default=2, help="the proxy's exact-cache bound")
    p.add_argument("--sample-seconds", type=float, default=10.0)
    p.add_argument(
        "--semantic",
        action="store_true",
        help="semantic caching on, every request a new chat question (see above)",
    )
    p.add_argument("--out", type=Path, help="write the figures as Markdown here")
    args = p.parse_args(argv)
    cache = pb.CachePolicy(mode="semantic") if args.semantic else None
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ponto-soak-")))
        system = stack.enter_context(
            start_system(tmp, proxy_args=["--cache-max-mb", str(args.cache_mb)], cache=cache)
        )
        if args.semantic:
            wait_semantic(system)
        load, samples = asyncio.run(
            soak(system, args.minutes, args.rate, args.sample_seconds, args.semantic)
        )
        if not system.proxy.alive():
            print("the proxy died during the soak", file=sys.stderr)
            return 1
    report = judge(args.minutes, args.rate, args.cache_mb, load, samples)
    report.semantic = args.semantic
    text = semantic_markdown(report) if args.semantic else markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.semantic:
            old = args.out.read_text() if args.out.exists() else ""
            text = replace_section(old, SEMANTIC_HEADING, text)
        args.out.write_text(text)
    return 1 if report.failures else 0


def wait_semantic(system: System, timeout: float = 120.0) -> None:
    """Until the proxy's semantic index is loaded (the model loads on the first
    table that asks for it) and indexes answers: a warm-up question a second."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        body = {
            "model": "sim-small",
            "temperature": 0,
            "messages": [{"role": "user", "content": f"warm-up question {n}"}],
        }
        request = urllib.request.Request(
            system.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={
                "content-type": "application/json",
                "authorization": f"Bearer {system.keys[0]}",
            },
        )
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=10).close()
        if proxy_stats(system.metrics_address).get("semantic_entries", 0) > 0:
            return
        time.sleep(1.0)
    raise SystemExit("the proxy's semantic index did not load")


if __name__ == "__main__":
    raise SystemExit(main())
