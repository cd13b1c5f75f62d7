"""Closed-loop load with wrk (Debian's package): maximum throughput and server CPU per request.

    .venv/bin/python -m bench.wrk URL [--connections 16] [--duration 5] [--body JSON] \
        [-H NAME:VALUE] [--cpus 1] [--watch PID]

Why wrk and not bench/loadgen.py for this: at the maximum rate the generator
shares CPU 1 with the origin, and every microsecond it spends is one the
origin cannot. wrk is C on an epoll loop and spends a fraction of what the
Python generator does per request, so a closed loop from it reaches the
server's limit rather than the generator's. It cannot pace requests at a
fixed rate (wrk2 can, Debian does not package it) and it reports latency as
service time, so the open-loop phases (latency at fixed rates, one request at
a time) stay with bench/loadgen.py.

What one run does: ``connections`` keep-alive connections each POST their
next request as soon as the previous answer ends, for ``duration`` whole
seconds (after an unmeasured warm-up run of ``warmup`` seconds). A Lua script
written for the run gives every request its own prompt: the body's ``{i}``
becomes a tag unique to the run, wrk's thread number and a counter, so no
cache can answer a repeat, within a run or across runs. Its ``done()`` hook
prints the figures as one JSON line, parsed here.

Server CPU: utime + stime of every process in ``watch_pids`` (and their
descendants), read from /proc just before wrk starts and just after it exits;
wrk's own start-up and its connection set-up fall inside that window, a few
milliseconds of an idle server. CPU per request divides it by the answers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import tree_cpu

INDEX_MARK = b"{i}"
RESULT_MARK = "WRK_RESULT "
_RUNS = itertools.count()
INSTALL_HINT = "apt-get install -y wrk (as root; `make bench` does it)"


class WrkMissing(RuntimeError):
    """wrk is not on PATH; the message says how to install it."""


def find_wrk() -> str:
    """The wrk binary's path; raises WrkMissing with the install command if there is none."""
    found = shutil.which("wrk")
    if found is None:
        raise WrkMissing(f"wrk is not installed (closed-loop load needs it): {INSTALL_HINT}")
    return found


@dataclass(frozen=True, slots=True)
class WrkSpec:
    """One closed-loop run of wrk against one URL.

    Attributes:
        url: ``http://host:port/path``.
        body: POST body; its ``{i}`` (at most once) becomes a prompt tag unique
            to the request. Without ``{i}`` every request is the same.
        headers: Extra request headers (Content-Type: application/json is always sent).
        connections: Concurrent keep-alive connections.
        threads: wrk threads (each an epoll loop); at most ``connections``.
        duration: Whole seconds measured (wrk takes no fractions).
        warmup: Whole seconds of the same load run first and not measured (0: none).
        timeout: Whole seconds after which wrk counts a request as timed out.
        cpus: Run wrk on these CPUs (taskset); None inherits the caller's mask.
        watch_pids: Processes whose CPU time (with their descendants') is measured.
    """

    url: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    connections: int = 16
    threads: int = 1
    duration: int = 5
    warmup: int = 1
    timeout: int = 5
    cpus: frozenset[int] | None = None
    watch_pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= self.connections:
            raise ValueError("need 1 <= threads <= connections")
        if self.duration < 1 or self.timeout < 1 or self.warmup < 0:
            raise ValueError("duration and timeout must be >= 1 s, warmup >= 0")
        if self.body.count(INDEX_MARK) > 1:
            raise ValueError("the body may hold {i} at most once")


@dataclass(slots=True)
class WrkResult:
    """What one measured run saw. Latencies are wrk's (service times), in microseconds."""

    spec: WrkSpec
    requests: int  # answers read, whatever their status
    duration_s: float
    errors: dict[str, int]  # connect, read, write, status (>= 400), timeout
    latency_us: dict[str, float]
    watched_cpu_s: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return max(0, self.requests - self.errors.get("status", 0))

    def error_ratio(self) -> float:
        failed = sum(self.errors.values())
        attempts = self.requests + failed - self.errors.get("status", 0)
        return failed / attempts if attempts else 1.0

    def throughput(self) -> float:
        """Ok answers per second of the run."""
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0


# ---------------------------------------------------------------- the Lua script


def lua_string(text: str) -> str:
    """A Lua long-bracket literal holding `text` verbatim (no escapes are interpreted)."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    # A newline right after the opening bracket would be dropped: keep a leading one.
    return f"[{eq}[{chr(10) if text.startswith(chr(10)) else ''}{text}]{eq}]"


def lua_script(body: bytes, headers: Iterable[tuple[str, str]], tag: str) -> str:
    """wrk's script for one run: POSTs `body`, each request with its own prompt if the body
    holds {i}, and a done() hook printing the figures as one JSON line."""
    lines = [
        "-- written by bench/wrk.py for one run",
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        *(f"wrk.headers[ {lua_string(k)} ] = {lua_string(v)}" for k, v in headers),
    ]
    head, sep, tail = body.decode().partition(INDEX_MARK.decode())
    if sep:
        lines += [
            f"local head = {lua_string(head + tag + '-')}",
            f"local tail = {lua_string(tail)}",
            "local threads = 0",
            "function setup(thread)",
            '  thread:set("tid", threads)',
            "  threads = threads + 1",
            "end",
            "local n = 0",
            "function request()",
            "  n = n + 1",
            '  return wrk.format(nil, nil, nil, head .. tid .. "-" .. n .. tail)',
            "end",
        ]
    else:
        lines.append(f"wrk.body = {lua_string(head)}")
    lines += [
        "function done(summary, latency, requests)",
        "  local e = summary.errors",
        "  local q = function(p) return latency:percentile(p) end",
        f"  io.write({lua_string(RESULT_MARK)} .. string.format("
        '\'{"requests": %d, "duration_us": %d, "errors": {"connect": %d, "read": %d, '
        '"write": %d, "status": %d, "timeout": %d}, "latency_us": {"p50": %d, "p90": %d, '
        '"p99": %d, "p99.9": %d, "max": %d, "mean": %.1f}}\\n\', '
        "summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout, "
        "q(50), q(90), q(99), q(99.9), latency.max, latency.mean))",
        "end",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running


def _argv(binary: str, spec: WrkSpec, script: Path, seconds: int) -> list[str]:
    argv = [binary, "-t", str(spec.threads), "-c", str(spec.connections), "-d", f"{seconds}s",
            "--timeout", f"{spec.timeout}s", "-s", str(script), spec.url]  # fmt: skip
    taskset = shutil.which("taskset")
    if spec.cpus is not None and taskset is not None:
        argv = [taskset, "-c", ",".join(str(c) for c in sorted(spec.cpus)), *argv]
    return argv


def _wrk(argv: list[str], seconds: int, timeout: int) -> dict[str, Any]:
    """Run wrk once and return the JSON its done() hook printed."""
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + timeout + 30, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            parsed: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            return parsed
    raise RuntimeError(
        f"wrk exited with {done.returncode} and no result: {(done.stderr or done.stdout)[-500:]}"
    )


def run(spec: WrkSpec) -> WrkResult:
    """Warm up, then one measured run of `spec`; blocks for about warmup + duration seconds."""
    binary = find_wrk()
    tag = f"w{os.getpid()}.{time.time_ns() % 10**9}.{next(_RUNS)}"
    with tempfile.TemporaryDirectory(prefix="ponto-wrk-") as tmp:
        script = Path(tmp) / "run.lua"
        if spec.warmup:
            script.write_text(lua_script(spec.body, spec.headers, tag + "w"))
            _wrk(_argv(binary, spec, script, spec.warmup), spec.warmup, spec.timeout)
        script.write_text(lua_script(spec.body, spec.headers, tag))
        before = tree_cpu(spec.watch_pids)
        raw = _wrk(_argv(binary, spec, script, spec.duration), spec.duration, spec.timeout)
        after = tree_cpu(spec.watch_pids)
    return WrkResult(
        spec=spec,
        requests=int(raw["requests"]),
        duration_s=raw["duration_us"] / 1e6,
        errors={k: int(v) for k, v in raw["errors"].items() if v},
        latency_us={k: float(v) for k, v in raw["latency_us"].items()},
        watched_cpu_s={pid: after[pid] - before[pid] for pid in spec.watch_pids},
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("url")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=int, default=5, help="whole seconds")
    p.add_argument("--warmup", type=int, default=1, help="whole seconds, not measured")
    p.add_argument("--body", default="", help="POST body; {i} becomes a unique tag per request")
    p.add_argument("-H", "--header", action="append", default=[], metavar="NAME:VALUE")
    p.add_argument("--cpus", default="", help="comma-separated CPUs to run wrk on")
    p.add_argument("--watch", type=int, action="append", default=[], metavar="PID")
    a = p.parse_args(argv)
    headers = tuple((k.strip(), v.strip()) for k, _, v in (h.partition(":") for h in a.header))
    cpus = frozenset(int(c) for c in a.cpus.split(",") if c.strip()) or None
    spec = WrkSpec(a.url, a.body.encode(), headers, a.connections, a.threads, a.duration,
                   a.warmup, cpus=cpus, watch_pids=tuple(a.watch))  # fmt: skip
    try:
        result = run(spec)
    except WrkMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    cpu = sum(result.watched_cpu_s.values())
    print(f"{result.ok} ok in {result.duration_s:.2f} s: {result.throughput():,.0f} req/s, "
          f"errors {result.errors}, latency us {result.latency_us}")  # fmt: skip
    if result.ok and spec.watch_pids:
        print(f"watched CPU {cpu:.3f} s: {cpu / result.ok * 1e6:.1f} us per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
