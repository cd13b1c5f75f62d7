"""What tracing costs the proxy: CPU per request with tracing off, on but
sampling nothing, and on exporting every request, side by side in one run.

    .venv/bin/python -m bench.tracing [--requests N] [--rounds R]

Real processes on loopback: etcd, a control plane, one unpaced origin
simulator, an OTLP receiver (`python -m ponto.otlpsink`, http/protobuf,
writing to /dev/null) and three proxies that differ only in their OTEL_*
variables:

    off    none set (no OpenTelemetry code is loaded)
    zero   OTEL_TRACES_SAMPLER=parentbased_traceidratio, _ARG=0, exporting
           to the receiver: every span is created and dropped unsampled
    full   the SDK's default sampler (every request), exporting to the receiver

With `--baseline-src DIR` (a checkout of an earlier commit, e.g. made with
`git worktree add`), a fourth proxy, "before", runs that code with tracing
off: "off" against "before" is what the tracing hooks, the GenAI metrics and
the access log's boundary check cost together when all are off.

One keep-alive client sends the same non-streaming chat request (temperature
0.7: a cache bypass, so every request reaches the origin and makes an origin
span) through each proxy in turn, in rounds, so that all three see the same
machine state. The figure is the proxy process's CPU time (user + system,
from /proc) over a round divided by its requests; the median round is
reported, with its ratio to "off". The full variant's CPU includes the batch
export thread's protobuf encoding and HTTP posts. About 30 s with the
defaults on two CPUs; timings belong here, never in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from bench.procs import cpu_seconds
from ponto.devenv import python_entry, spawn
from ponto.fleet import Fleet, RegionDef

BODY = {
    "model": "sim-small",
    "max_tokens": 8,
    "temperature": 0.7,
    "messages": [{"role": "user", "content": "ping"}],
}
CONCURRENCY = 4


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """os.environ with `variables` set, for the processes started inside."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def load(url: str, n: int) -> None:
    """`n` requests from CONCURRENCY keep-alive workers; every answer must be a 200."""
    remaining = n
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url, json=BODY) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}")

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1500, help="per proxy and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--baseline-src",
        type=Path,
        help="source tree of an earlier commit, run as a fourth proxy 'before'",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        fleet.start_origin("origin", "local")
        fleet.add_origin("origin", "local", fleet.origin_url("origin"))
        version = fleet.table_version(origins=1)
        ready = Path(tmp) / "sink.addr"
        sink = spawn(
            "sink",
            [
                *python_entry("ponto.otlpsink"),
                "--listen",
                "127.0.0.1:0",
                "--out",
                os.devnull,
                "--ready-file",
                str(ready),
            ],
            Path(tmp),
            ready_file=ready,
        )
        try:
            exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.address}"}
            modes = {
                "off": {},
                "zero": {
                    **exporting,
                    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": "0",
                },
                "full": exporting,
            }
            if args.baseline_src is not None:
                modes["before"] = {"PYTHONPATH": str(args.baseline_src.resolve())}
            for mode, variables in modes.items():
                with environment(variables):
                    fleet.start_proxy(mode, "local", extra=["--log-level", "WARNING"])
            fleet.wait_proxies_at(version)
            for mode in modes:  # warm-up: connections, caches, first-call imports
                asyncio.run(load(fleet.proxy_url(mode) + "/chat/completions", 200))
            per_request: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    pid = fleet.proxies[mode].pid
                    before = cpu_seconds(pid)
                    asyncio.run(load(fleet.proxy_url(mode) + "/chat/completions", args.requests))
                    spent = cpu_seconds(pid) - before
                    per_request[mode].append(spent / args.requests * 1e6)
        finally:
            sink.stop()
    base = statistics.median(per_request["off"])
    print(f"proxy CPU per request, median of {args.rounds} rounds of {args.requests}:")
    for mode, values in per_request.items():
        us = statistics.median(values)
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {mode:<5} {us:7.1f} us  x{us / base:.3f}   (rounds: {rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
