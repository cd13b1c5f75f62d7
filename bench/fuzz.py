"""Hostile clients against a real proxy: malformed JSON, framing, encodings, slow clients.

    .venv/bin/python -m bench.fuzz [--requests 100000] [--slow 2000] [--slow-seconds 30]
                                   [--seed 15] [--out docs/benchmarks/fuzz.md] [--workdir DIR]

One fleet (etcd, a control plane, one origin simulator, one proxy with
`--forward-headers x-sim-mark`), two tenants with a key each, one of them with a
system prompt (so an error must name the client's own message index, not one
shifted by the injected prompt). Every request carries a unique `x-sim-mark`;
the simulator lists the marks that reached it (GET /sim/marks), so "a refused
request reached the origin" is checked request by request.

Phases: the body cases (bench/fuzz_cases.py, aiohttp, bounded concurrency), one
round of every raw framing case per 2,000 body cases (raw sockets), then the
slow clients: `--slow` connections from 127.0.0.2-9 (slow-loris headers, slow
bodies, slow chunks, idle), each reopened when the proxy closes it, while a
normal client on 127.0.0.1 sends sequential requests (keep-alive, and on a new
connection each); then the slow clients hang up and the proxy's descriptors
must come back to where they were.

Definitions. A request "reached the application" when its whole head (request
line and headers, up to the empty line) was sent and an HTTP answer came back;
any error answer to it must be an OpenAI-style JSON error
(`{"error": {"message", "type", "param", "code"}}`, application/json). A crash
is the proxy process gone. A leak is a case marked "refuse" whose mark reached
the origin. Exit status 1 on a crash, a 5xx, a non-JSON error, a leak, a valid
request refused by the proxy, a refusal missed (a 2xx to a "refuse" case), a
required answer missing, an error naming the wrong message index, a traceback in
the proxy's log, descriptors not back to baseline, normal-client errors, or
the normal client's keep-alive p99 at or over 50 ms during the slow clients.

A "no answer" to a well-framed request usually means the proxy closed a kept-alive
connection without saying so (no `Connection: close`), after an error on the
request before it on that connection; the case named is the victim, not the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import random
import re
import resource
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.compare import cache_stats
from bench.fuzz_cases import (
    CHAT,
    MARK,
    BodyCase,
    Expect,
    RawCase,
    SlowKind,
    body_cases,
    raw_cases,
    slow_kinds,
)
from bench.procs import cpu_seconds, status_kb
from ponto.devenv import Managed
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

P99_BAR_MS = 50.0
SLOW_SOURCES = tuple(f"127.0.0.{i}" for i in range(2, 10))
# Descriptors the proxy may hold beyond its baseline once clients are gone: pooled
# upstream connections and the like.
FD_SLACK = 8


# ---------------------------------------------------------------- the system


@dataclass
class System:
    fleet: Fleet
    keys: tuple[str, ...]

    @property
    def proxy(self) -> Managed:
        return self.fleet.proxies["fuzz-proxy"]

    @property
    def metrics_address(self) -> str:
        """The proxy's metrics port (its /metrics)."""
        return self.fleet.metrics_addresses["fuzz-proxy"]

    @property
    def origin(self) -> Managed:
        return self.fleet.origins["fuzz-origin"]

    @property
    def base(self) -> str:
        return f"http://{self.proxy.address}"

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.proxy.address.rsplit(":", 1)
        return host, int(port)


@contextlib.contextmanager
def start_system(
    workdir: Path, proxy_args: list[str] | None = None, cache: pb.CachePolicy | None = None
) -> Iterator[System]:
    """The fleet above (the proxy also gets `proxy_args`, both tenants the `cache`
    policy if given); stops every process it started on the way out."""
    with Fleet(workdir) as fleet:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("us-east", 38.9, -77.4))
        fleet.start_origin("fuzz-origin", "us-east", models=("sim-small",))
        fleet.add_origin("fuzz-origin", "us-east", fleet.origin_url("fuzz-origin"), ("sim-small",))
        admin = fleet.admin()
        prompted = pb.PromptPolicy(system_prompt="You answer for the fuzz tenant.")
        tenants = {
            "fuzz-plain": pb.Tenant(name="fuzz-plain", cache=cache),
            "fuzz-prompted": pb.Tenant(name="fuzz-prompted", prompt=prompted, cache=cache),
        }
        for tenant in tenants.values():
            admin.PutTenant(apb.PutTenantRequest(tenant=tenant), timeout=10)
        keys = tuple(
            admin.CreateKey(apb.CreateKeyRequest(tenant=name), timeout=10).secret
            for name in tenants
        )
        version = fleet.wait_table(lambda t: len(t.keys) == 2 and len(t.origins) == 1)
        fleet.start_proxy(
            "fuzz-proxy", "us-east", extra=["--forward-headers", MARK, *(proxy_args or [])]
        )
        fleet.wait_proxies_at(version)
        yield System(fleet, keys)


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def rss_mb(pid: int) -> float:
    return status_kb(pid, "VmRSS") / 1024


# ---------------------------------------------------------------- answers


@dataclass(frozen=True)
class Answer:
    status: int
    json_error: bool  # an OpenAI-style error object in an application/json body
    content_type: str
    snippet: str
    param: str | None = None


@dataclass
class Outcome:
    label: str
    kind: str  # "body" or "raw"
    expects: tuple[Expect, ...]  # one per answer a correct server sends
    marks: tuple[str, ...]
    required: int  # answers a correct server must send
    head_complete: bool
    answers: list[Answer] = field(default_factory=list)
    error: str = ""
    index: int | None = None
    seconds: float = 0.0  # from the first byte sent to the last answer or the give-up


def read_answer(status: int, content_type: str, body: bytes) -> Answer:
    json_error, param = False, None
    if content_type.split(";", 1)[0].strip().lower() == "application/json":
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(body)
            err = doc.get("error") if isinstance(doc, dict) else None
            json_error = (
                isinstance(err, dict)
                and isinstance(err.get("message"), str)
                and isinstance(err.get("type"), str)
                and {"param", "code"} <= err.keys()
            )
            if json_error and isinstance(err, dict) and isinstance(err.get("param"), str):
                param = err["param"]
    snippet = body[:160].decode("utf-8", "replace")
    return Answer(status, json_error, content_type, snippet, param)


async def send_body(
    session: aiohttp.ClientSession, base: str, case: BodyCase, mark: str, key: str
) -> Outcome:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json", MARK: mark}
    headers.update(case.headers)
    # A body over the proxy's limit may be cut off mid-send by its answer and close.
    required = 0 if len(case.body) > 4_000_000 else 1
    out = Outcome(case.label, "body", (case.expect,), (mark,), required, True, index=case.index)
    t0 = time.perf_counter()
    try:
        async with session.post(
            base + case.path, data=io.BytesIO(case.body), headers=headers
        ) as resp:
            body = await resp.read()
            out.answers.append(read_answer(resp.status, resp.headers.get("content-type", ""), body))
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.seconds = time.perf_counter() - t0
    return out


async def read_http(reader: asyncio.StreamReader) -> Answer | None:
    """One HTTP/1.x response (skipping 1xx); None at EOF before a status line."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            continue
        body = b""
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        elif status not in (204, 304):
            body = await reader.read()
        return read_answer(status, headers.get("content-type", ""), body)


async def send_raw(
    host: str, port: int, case: RawCase, marks: tuple[str, ...], key: str, wait: float
) -> Outcome:
    data = case.data.replace(b"KEY", key.encode())
    for i, mark in enumerate(marks):
        data = data.replace(b"MARK%d" % i, mark.encode())
    expects = case.each or (case.expect,) * max(case.answers, 1)
    out = Outcome(case.label, "raw", expects, marks, case.answers, case.head_complete)
    writer = None
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 22), wait
        )
        writer.write(data)
        await writer.drain()
        if case.shut_write and writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(wait):
            while len(out.answers) < max(case.answers, 1):
                answer = await read_http(reader)
                if answer is None:
                    break
                out.answers.append(answer)
    except (
        OSError,
        TimeoutError,
        ValueError,
        asyncio.IncompleteReadError,
        asyncio.LimitOverrunError,
    ) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    out.seconds = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------- judging

_INDEX = re.compile(r"messages\[(\d+)\]")


@dataclass
class Verdict:
    """Every finding, by kind, with up to a few examples each; `counts` per label."""

    findings: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    info: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    slowest: dict[str, float] = field(default_factory=dict)  # label -> longest seconds
    requests: int = 0

    # kind -> case label -> how many
    by_case: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, kind: str, label: str, example: str, *, failing: bool = True) -> None:
        (self.findings if failing else self.info)[kind].append(example)
        self.by_case[kind][label] += 1


def judge(outcomes: list[Outcome], reached: set[str], verdict: Verdict) -> None:
    """Add each outcome's findings: `reached` holds the marks the origin saw."""
    for out in outcomes:
        verdict.requests += max(len(out.marks), 1)
        got = ",".join(str(a.status) for a in out.answers) or "no answer"
        verdict.counts[out.label][got] += 1
        verdict.slowest[out.label] = max(verdict.slowest.get(out.label, 0.0), out.seconds)
        where = f"{out.label}: {got}"
        if len(out.answers) < out.required:
            verdict.add("no answer", out.label, f"{where} {out.error}")
        for i, answer in enumerate(out.answers):
            expect = out.expects[i] if i < len(out.expects) else "any"
            mark = out.marks[i] if i < len(out.marks) else ""
            detail = f"{out.label} -> {answer.status} {answer.content_type} {answer.snippet!r}"
            if answer.status >= 500:
                verdict.add("5xx", out.label, detail)
            if answer.status >= 400 and out.head_complete and not answer.json_error:
                verdict.add("non-JSON error", out.label, detail)
            if expect == "refuse" and 200 <= answer.status < 300:
                verdict.add("refusal missed (2xx)", out.label, detail)
            if expect == "accept" and 400 <= answer.status < 500:
                if mark in reached:
                    verdict.add("valid, refused by the origin", out.label, detail, failing=False)
                else:
                    verdict.add("valid, refused by the proxy", out.label, detail)
            if expect != "refuse" and 400 <= answer.status < 500 and mark in reached:
                verdict.add("origin's 4xx relayed", out.label, detail, failing=False)
            m = _INDEX.search(answer.param or "")
            if out.index is not None and m and int(m.group(1)) != out.index:
                verdict.add("wrong message index", out.label, f"{detail} (sent at {out.index})")
        for i, mark in enumerate(out.marks):
            expect = out.expects[i] if i < len(out.expects) else "any"
            if expect == "refuse" and mark in reached:
                verdict.add(
                    "refused request reached the origin", out.label, f"{out.label} ({mark})"
                )


# ---------------------------------------------------------------- running


class Marks:
    def __init__(self, run: str) -> None:
        self.run, self.n = run, 0

    def next(self) -> str:
        self.n += 1
        return f"{self.run}-{self.n}"


async def run_cases(
    system: System,
    bodies: list[BodyCase],
    raws: list[RawCase],
    *,
    rng: random.Random,
    concurrency: int,
    marks: Marks,
    raw_timeout: float = 5.0,
) -> list[Outcome]:
    """Send every case, at most `concurrency` at a time, in a shuffled order."""
    host, port = system.host_port
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    # Idle pooled connections are dropped after 2 s, well before any server's idle
    # timeout, so a server closing an idle connection never shows as "no answer".
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=2)
    jobs: list[tuple[str, BodyCase | RawCase]] = [("b", c) for c in bodies] + [
        ("r", c) for c in raws
    ]
    rng.shuffle(jobs)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(kind: str, case: BodyCase | RawCase) -> Outcome:
            key = rng.choice(system.keys)
            async with gate:
                if isinstance(case, BodyCase):
                    return await send_body(session, system.base, case, marks.next(), key)
                ids = tuple(marks.next() for _ in range(case.marks))
                return await send_raw(host, port, case, ids, key, raw_timeout)

        return list(await asyncio.gather(*(one(k, c) for k, c in jobs)))


async def origin_marks(system: System) -> set[str]:
    url = f"http://{system.origin.address}/sim/marks"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return set((await resp.json())["marks"])


@dataclass
class SlowFigures:
    connections: int = 0
    opened: int = 0
    closed_by_proxy: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    peak_fds: int = 0
    keepalive_ms: list[float] = field(default_factory=list)
    fresh_ms: list[float] = field(default_factory=list)
    normal_errors: list[str] = field(default_factory=list)
    bad_answers: list[str] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _slow_one(
    host: str,
    port: int,
    kind: SlowKind,
    source: str,
    key: str,
    stop: asyncio.Event,
    fig: SlowFigures,
) -> None:
    """One slow client: connect, send the head, drip a byte a second; reconnect when closed."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            fig.closed_by_proxy[f"{kind.name} (connect refused)"] += 1
            await asyncio.sleep(1)
            continue
        fig.opened += 1
        closed = asyncio.ensure_future(read_http(reader))
        try:
            writer.write(kind.head.replace(b"KEY", key.encode()))
            for byte in kind.drip or iter(int, 1):
                done, _ = await asyncio.wait({closed}, timeout=1.0)
                if done or stop.is_set():
                    break
                if kind.drip:
                    writer.write(bytes([byte]))
        except OSError:
            pass
        if closed.done() and not stop.is_set():
            fig.closed_by_proxy[kind.name] += 1
            with contextlib.suppress(Exception):
                answer = closed.result()
                if answer is not None:
                    fig.answers[f"{kind.name} {answer.status}"] += 1
                    if answer.status >= 500 or (kind.head_complete and not answer.json_error):
                        fig.bad_answers.append(f"{kind.name} -> {answer.status} {answer.snippet!r}")
        closed.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _normal_client(system: System, seconds: float, fig: SlowFigures, marks: Marks) -> None:
    """Sequential unique chat requests, alternating a keep-alive session and a new connection."""
    key = system.keys[0]
    url = system.base + CHAT
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as keep,
        aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)
        ) as fresh,
    ):
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            i += 1
            session, sink = (keep, fig.keepalive_ms) if i % 2 else (fresh, fig.fresh_ms)
            body = {
                "model": "sim-small",
                "temperature": 0,
                "messages": [{"role": "user", "content": f"normal {marks.run} {i}"}],
            }
            headers = {"authorization": f"Bearer {key}", MARK: marks.next()}
            t0 = time.perf_counter()
            try:
                async with session.post(url, json=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        fig.normal_errors.append(f"status {resp.status}")
                        continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                fig.normal_errors.append(f"{type(exc).__name__}: {exc}"[:120])
                continue
            sink.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.01)


async def slow_phase(system: System, connections: int, seconds: float, marks: Marks) -> SlowFigures:
    """`connections` slow clients for `seconds` with the normal client measuring meanwhile."""
    host, port = system.host_port
    fig = SlowFigures(connections=connections)
    stop = asyncio.Event()
    kinds = slow_kinds()
    tasks = []
    for i in range(connections):
        kind, source = kinds[i % len(kinds)], SLOW_SOURCES[i % len(SLOW_SOURCES)]
        tasks.append(
            asyncio.ensure_future(_slow_one(host, port, kind, source, system.keys[0], stop, fig))
        )
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # under the listen backlog

    async def watch() -> None:
        while not stop.is_set():
            fig.peak_fds = max(fig.peak_fds, open_fds(system.proxy.proc.pid))
            await asyncio.sleep(0.5)

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(1.0)
    await _normal_client(system, seconds, fig, marks)
    stop.set()
    await asyncio.gather(*tasks, watcher)
    return fig


async def settle_fds(pid: int, baseline: int, seconds: float = 20.0) -> int:
    """The proxy's descriptor count once back within FD_SLACK of `baseline`, or after `seconds`."""
    deadline = time.monotonic() + seconds
    count = open_fds(pid)
    while count > baseline + FD_SLACK and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        count = open_fds(pid)
    return count


@dataclass
class FuzzConfig:
    requests: int = 100_000
    slow: int = 2_000
    slow_seconds: float = 30.0
    seed: int = 15
    concurrency: int = 32
    bomb_mb: int = 64
    raw_every: int = 2000  # one round of every raw case per this many body cases
    p99_bar: bool = True  # count the normal client's p99 in the verdict (not in tests)


@dataclass
class FuzzReport:
    config: FuzzConfig
    verdict: Verdict
    slow: SlowFigures
    seconds: float
    raw_connections: int
    proxy_cpu: float  # CPU seconds the proxy spent on the body and raw cases
    fds: dict[str, int]
    rss_mb: dict[str, float]
    tracebacks: int
    proxy_alive: bool
    origin_alive: bool
    cache_bytes: float

    def failures(self) -> dict[str, list[str]]:
        out = {k: v for k, v in self.verdict.findings.items() if v}
        if not self.proxy_alive:
            out["crash"] = ["the proxy process exited"]
        if self.tracebacks:
            out["traceback in the proxy's log"] = [f"{self.tracebacks} tracebacks"]
        if self.fds["after"] > self.fds["before"] + FD_SLACK:
            out["descriptors not back to baseline"] = [
                f"{self.fds['before']} before, {self.fds['after']} after the slow clients left"
            ]
        if self.slow.normal_errors:
            out["normal client errors during slow clients"] = self.slow.normal_errors
        if self.slow.bad_answers:
            out["slow clients: 5xx or non-JSON answers"] = self.slow.bad_answers
        p99 = pct(self.slow.keepalive_ms, 0.99)
        if self.config.p99_bar and self.slow.connections and not p99 < P99_BAR_MS:
            out["normal client p99 >= 50 ms"] = [f"{p99:.1f} ms"]
        return out


def count_tracebacks(log: Path, offset: int) -> int:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().count(b"Traceback (most recent call last)")


def _quiet_upload_resets(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop the reset of an upload the proxy cut short by answering (a 413 mid-body):
    aiohttp's writer task reports it, though the answer has been read; log the rest."""
    if not isinstance(context.get("exception"), aiohttp.ClientConnectionResetError):
        loop.default_exception_handler(context)


async def fuzz(system: System, config: FuzzConfig) -> FuzzReport:
    """Run every phase against `system` and judge it."""
    asyncio.get_running_loop().set_exception_handler(_quiet_upload_resets)
    rng = random.Random(config.seed)
    marks = Marks(f"fz{config.seed}")
    pid = system.proxy.proc.pid
    log_offset = system.proxy.log_path.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The harness holds a descriptor per slow client; the proxy keeps its own limit.
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    t0 = time.monotonic()
    verdict = Verdict()
    port = system.host_port[1]
    # Warm-up at full concurrency: the upstream pool at its working size and lazy
    # imports count in the baseline.
    warm = [c for c in body_cases(rng, 20 * config.concurrency, bomb_mb=0) if c.expect == "accept"]
    await run_cases(system, warm, [], rng=rng, concurrency=config.concurrency, marks=marks)
    fds = {"before": open_fds(pid)}
    cpu_before = cpu_seconds(pid)
    rss = {"before": round(rss_mb(pid), 1)}
    done = raw_connections = 0
    batch = max(config.raw_every, 1)
    while done < config.requests:
        n = min(batch, config.requests - done)
        bodies = body_cases(rng, n, bomb_mb=config.bomb_mb)
        raws = raw_cases(rng, port)
        raw_connections += len(raws)
        outcomes = await run_cases(
            system,
            bodies,
            raws,
            rng=rng,
            concurrency=config.concurrency,
            marks=marks,
        )
        judge(outcomes, await origin_marks(system), verdict)
        done += n
        if not system.proxy.alive():
            break
    rss["after fuzz"] = round(rss_mb(pid), 1)
    proxy_cpu = cpu_seconds(pid) - cpu_before
    fds["after fuzz"] = await settle_fds(pid, fds["before"])
    slow = SlowFigures()
    if config.slow and system.proxy.alive():
        slow = await slow_phase(system, config.slow, config.slow_seconds, marks)
        verdict.requests += slow.opened + len(slow.keepalive_ms) + len(slow.fresh_ms)
    fds["peak"] = max(slow.peak_fds, fds["after fuzz"])
    fds["after"] = await settle_fds(pid, fds["before"])
    rss["after"] = round(rss_mb(pid), 1)
    rss["peak"] = round(status_kb(pid, "VmHWM") / 1024, 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return FuzzReport(
        config=config,
        verdict=verdict,
        slow=slow,
        seconds=time.monotonic() - t0,
        proxy_cpu=proxy_cpu,
        raw_connections=raw_connections,
        fds=fds,
        rss_mb=rss,
        tracebacks=count_tracebacks(system.proxy.log_path, log_offset),
        proxy_alive=system.proxy.alive(),
        origin_alive=system.origin.alive(),
        cache_bytes=cache_stats(system.metrics_address).get("bytes", 0.0),
    )


# ---------------------------------------------------------------- the page


def by_case_lines(v: Verdict, kind: str, examples: list[str], cases: int) -> list[str]:
    """The cases with the most findings of `kind`, each with its count and one example."""
    if kind not in v.by_case:  # findings made outside judge(): no per-case split
        return [f"  - `{e[:200]}`" for e in examples[:cases]]
    out = []
    for label, n in v.by_case[kind].most_common(cases):
        example = next((e for e in examples if e.startswith(label)), "")
        out.append(f"  - {label} x{n}: `{example[len(label) :][:180].strip(' :->')}`")
    if len(v.by_case[kind]) > cases:
        out.append(f"  - and {len(v.by_case[kind]) - cases} more cases")
    return out


def markdown(report: FuzzReport) -> str:
    cfg, v, slow = report.config, report.verdict, report.slow
    failures = report.failures()
    lines = [
        "# Fuzz run (`make fuzz`)",
        "",
        "Written by `python -m bench.fuzz` (bench/fuzz.py, cases in bench/fuzz_cases.py):"
        " one proxy, one origin simulator that logs every request's `x-sim-mark`, etcd and"
        " a control plane, on this machine's 2 shared cores.",
        "",
        f"- seed {cfg.seed}; {v.requests:,} requests in {report.seconds:.0f} s"
        f" ({cfg.requests:,} body cases, {report.raw_connections:,} raw-socket connections,"
        f" {slow.opened:,} slow connections"
        f" opened, {len(slow.keepalive_ms) + len(slow.fresh_ms):,} normal-client requests)",
        f"- the proxy's CPU for the body and raw cases: {report.proxy_cpu:.0f} s"
        f" ({report.proxy_cpu / max(v.requests, 1) * 1e3:.2f} ms a request)",
        f"- verdict: **{'PASS' if not failures else 'FAIL'}**",
        f"- proxy alive at the end: {report.proxy_alive}; origin alive: {report.origin_alive};"
        f" tracebacks in the proxy's log: {report.tracebacks}",
        f"- descriptors: {report.fds['before']} before, {report.fds['after fuzz']} after the"
        f" fuzz, peak {report.fds['peak']} during the slow clients, {report.fds['after']}"
        " after they left",
        f"- RSS: {report.rss_mb['before']} MB before, {report.rss_mb['after fuzz']} MB after the"
        f" fuzz, {report.rss_mb['after']} MB at the end (peak {report.rss_mb['peak']} MB);"
        f" exact cache {report.cache_bytes / 2**20:.1f} MB",
        "",
        f"## Slow clients ({slow.connections:,} at a time, {cfg.slow_seconds:.0f} s)",
        "",
        f"- normal client, keep-alive: p50 {pct(slow.keepalive_ms, 0.5):.1f} ms,"
        f" p99 {pct(slow.keepalive_ms, 0.99):.1f} ms ({len(slow.keepalive_ms)} requests;"
        f" bar: p99 under {P99_BAR_MS:.0f} ms)",
        f"- normal client, new connection each: p50 {pct(slow.fresh_ms, 0.5):.1f} ms,"
        f" p99 {pct(slow.fresh_ms, 0.99):.1f} ms ({len(slow.fresh_ms)} requests)",
        f"- normal-client errors: {len(slow.normal_errors)}",
        f"- slow connections closed by the proxy: {dict(slow.closed_by_proxy) or 'none'};"
        f" answers they got: {dict(slow.answers) or 'none'}",
        "",
        "## Findings",
        "",
    ]
    if not failures:
        lines.append("None: 0 crashes, 0 5xx, 0 non-JSON errors, 0 refused requests at the origin.")
    for kind, examples in sorted(failures.items()):
        lines.append(f"- **{kind}**: {len(examples):,}")
        lines += by_case_lines(v, kind, examples, 12)
    if v.info:
        lines += ["", "Not counted against the proxy:", ""]
        for kind, examples in sorted(v.info.items()):
            lines.append(f"- {kind}: {len(examples):,}")
            lines += by_case_lines(v, kind, examples, 4)
    lines += [
        "",
        "## Answers per case",
        "",
        "| case | n | answers | slowest (s) |",
        "|---|---:|---|---:|",
    ]
    for label in sorted(v.counts):
        c = v.counts[label]
        shown = ", ".join(f"{k} x{n}" for k, n in c.most_common(4))
        lines.append(
            f"| {label.replace('|', '/')} | {sum(c.values()):,} | {shown}"
            f" | {v.slowest.get(label, 0.0):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000, help="body cases to send")
    p.add_argument("--slow", type=int, default=2_000, help="slow connections at a time")
    p.add_argument("--slow-seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--out", type=Path, help="write the figures as Markdown here")
    p.add_argument(
        "--workdir", type=Path, help="keep the processes' logs here (default: a removed temp dir)"
    )
    args = p.parse_args(argv)
    config = FuzzConfig(
        requests=args.requests,
        slow=args.slow,
        slow_seconds=args.slow_seconds,
        seed=args.seed,
        concurrency=args.concurrency,
    )
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="ponto-fuzz-"))
        )
        system = stack.enter_context(start_system(workdir))
        report = asyncio.run(fuzz(system, config))
    text = markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    failures = report.failures()
    summary = ", ".join(f"{k}: {len(v)}" for k, v in sorted(failures.items())) or "none"
    print(f"[{'FAIL' if failures else 'PASS'}] findings: {summary}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
