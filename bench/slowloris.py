"""Slow-loris: a normal client's latency while N connections trickle their heads.

    .venv/bin/python -m bench.slowloris [--loris 2000] [--seconds 10] [--max-connections N]
        [--header-timeout S] [--out FILE --label NAME]

One real proxy process (`ponto-proxy --workers 1`, no control plane: the
edge is what is measured, not routing). N "loris" connections each send a
request line and then one header line a second, never finishing the head,
reconnecting when closed (an attacker keeps its count up), from a process of
their own. Meanwhile a normal
client opens a fresh connection 20 times a second (open loop: request i is
due at t0 + i/20, latency from its due time, so a stalled proxy is not
hidden by a stalled client) and sends `GET /healthz`. Reported: the normal
client's p50/p99/max, its failures, the loris connections held and closed
(by the head deadline or eviction), and the proxy's descriptors at the end.

Aim (issue 15): with 2,000 loris connections the normal client's p99 stays
under 50 ms. Run it with --max-connections below --loris to see eviction at
work. Both processes share this machine's cores: on a busy machine the
figures include that contention (the 1-minute load average is recorded).
With --out FILE the run is added to FILE under --label.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import tempfile
import time
from multiprocessing import Process, Queue
from pathlib import Path

from ponto.devenv import spawn

RATE = 20.0


async def loris(host: str, port: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(1)
            continue
        counts["opened"] += 1
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n")
        try:
            while not stop.is_set():
                await asyncio.sleep(1)
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
        except OSError:
            counts["closed_by_proxy"] += 1
        finally:
            writer.close()


async def normal(host: str, port: int, seconds: float) -> tuple[list[float], int]:
    latencies: list[float] = []
    failures = 0

    async def one(due: float) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        except (OSError, TimeoutError):
            failures += 1
            return
        if answer.startswith(b"HTTP/1.1 200"):
            latencies.append((time.perf_counter() - due) * 1000)
        else:
            failures += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t0 + i / RATE) for i in range(int(seconds * RATE))))
    return sorted(latencies), failures


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def loris_process(host: str, port: int, n: int, seconds: float, out: Queue[dict[str, int]]) -> None:
    """The loris connections, in their own process: their event loop's lag must
    not count as the proxy's."""

    async def main() -> dict[str, int]:
        stop = asyncio.Event()
        counts = {"opened": 0, "closed_by_proxy": 0, "connect_failed": 0}
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(loris(host, port, stop, counts)))
            if i % 100 == 99:
                await asyncio.sleep(0.05)  # no SYN flood: the backlog is 1,024
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        return counts

    out.put(asyncio.run(main()))


def run(a: argparse.Namespace, host: str, port: int, pid: int) -> dict[str, object]:
    ramp = a.loris / 100 * 0.05 + 2
    results: Queue[dict[str, int]] = Queue()
    child = Process(target=loris_process, args=(host, port, a.loris, ramp + a.seconds, results))
    child.start()
    time.sleep(ramp)
    latencies, failures = asyncio.run(normal(host, port, a.seconds))
    fds = descriptors(pid)
    counts = results.get(timeout=60)
    child.join()

    def pct(p: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(len(latencies) * p))], 2)

    return {
        "loris": a.loris,
        "max_connections": a.max_connections,
        "header_timeout_s": a.header_timeout,
        "normal_requests": len(latencies) + failures,
        "normal_failures": failures,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(latencies[-1], 2),
        "loris_connections_opened": counts["opened"],
        "loris_closed_by_proxy": counts["closed_by_proxy"],
        "loris_connect_failed": counts["connect_failed"],
        "proxy_descriptors_at_end": fds,
        "aim_p99_under_50ms": pct(0.99) < 50,
        # Other work on the machine competes for the same cores.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loris", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument(
        "--max-connections", type=int, default=0, help="the proxy's flag (0: its default)"
    )
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--out", type=Path, help="JSON file of runs by label (added to)")
    p.add_argument("--label", default="default", help="this run's key in --out")
    a = p.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="ponto-loris-") as tmp:
        work = Path(tmp)
        ready = work / "ready"
        proxy = spawn(
            "proxy",
            [
                "ponto-proxy",
                "--region=r1",
                "--control-plane=127.0.0.1:9",
                "--listen=127.0.0.1:0",
                "--workers=1",
                f"--ready-file={ready}",
                f"--max-connections={a.max_connections}",
                f"--max-connections-per-client={a.max_connections}",
                f"--header-timeout={a.header_timeout}",
                "--log-level=WARNING",
            ],
            work,
            ready_file=ready,
        )
        try:
            host, port = proxy.address.rsplit(":", 1)
            result = run(a, host, int(port), proxy.proc.pid)
        finally:
            proxy.stop()
    print(json.dumps(result, indent=2))
    if a.out:
        runs = json.loads(a.out.read_text()) if a.out.exists() else {}
        runs[a.label] = result
        a.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
