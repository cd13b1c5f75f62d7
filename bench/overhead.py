"""Proxy overhead against calling the origin directly, side by side in one run.

    .venv/bin/python -m bench.overhead [--requests N]

Starts etcd, a control plane, one unpaced origin simulator and one proxy as
real processes. One keep-alive client sends the same non-streaming and
streaming requests, alternating in blocks between direct and through the
proxy, so that both see the same machine state. Prints p50 and p99 of each
and the added latency, plus time to first token for streams.

This is a first figure, from a closed-loop sequential client. The open-loop,
multi-rate comparison against LiteLLM belongs to the benchmark issue.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from ponto.fleet import Fleet, RegionDef

BODY = {"model": "sim-small", "max_tokens": 8, "messages": [{"role": "user", "content": "ping"}]}
STREAM = {**BODY, "stream": True}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> tuple[float, float]:
    """(total seconds, seconds to first body byte)."""
    t0 = time.perf_counter()
    async with session.post(url, json=STREAM if stream else BODY) as resp:
        first = await resp.content.readany()
        t_first = time.perf_counter() - t0
        assert resp.status == 200 and first, resp.status
        await resp.read()
    return time.perf_counter() - t0, t_first


async def measure(direct: str, proxied: str, n: int, stream: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "proxy": [], "direct_ttfb": [], "proxy_ttfb": []}
    async with aiohttp.ClientSession() as session:
        for url in (direct, proxied):  # warm connections and code paths
            for _ in range(50):
                await one(session, url, stream)
        block = 50
        for _ in range(max(1, n // block)):
            for name, url in (("direct", direct), ("proxy", proxied)):
                for _ in range(block):
                    total, first = await one(session, url, stream)
                    out[name].append(total)
                    out[f"{name}_ttfb"].append(first)
    return out


def report(label: str, r: dict[str, list[float]]) -> None:
    d50, p50 = statistics.median(r["direct"]), statistics.median(r["proxy"])
    d99, p99 = pct(r["direct"], 0.99), pct(r["proxy"], 0.99)
    print(f"## {label} ({len(r['direct'])} requests each, sequential, keep-alive)")
    print(f"  direct  p50 {d50 * 1e3:.3f} ms  p99 {d99 * 1e3:.3f} ms")
    print(f"  proxy   p50 {p50 * 1e3:.3f} ms  p99 {p99 * 1e3:.3f} ms")
    print(f"  added   p50 {(p50 - d50) * 1e3:.3f} ms  p99 {(p99 - d99) * 1e3:.3f} ms  "
          f"(proxy/direct p50 = {p50 / d50:.2f}x)")  # fmt: skip
    if label == "streaming":
        dt, pt = statistics.median(r["direct_ttfb"]), statistics.median(r["proxy_ttfb"])
        print(f"  time to first chunk p50: direct {dt * 1e3:.3f} ms, proxy {pt * 1e3:.3f} ms "
              f"(+{(pt - dt) * 1e3:.3f} ms)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        fleet.start_origin("origin", "local")
        fleet.add_origin("origin", "local", fleet.origin_url("origin"))
        version = fleet.table_version(origins=1)
        fleet.start_proxy("proxy", "local", extra=["--log-level", "WARNING"])
        fleet.wait_proxies_at(version)
        direct = fleet.origin_url("origin") + "/chat/completions"
        proxied = fleet.proxy_url("proxy") + "/chat/completions"
        report("non-streaming", asyncio.run(measure(direct, proxied, args.requests, False)))
        report("streaming", asyncio.run(measure(direct, proxied, args.requests // 2, True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
