"""An exact cache hit at the proxy against a round trip to the origin, in one run.

    .venv/bin/python -m bench.cache_hit [--quick]

One fleet, two origins: "bare" answers at once (the pure HTTP round trip of an
origin), "gpu" paces like a model (200 ms to the first token, then 100
tokens/s). For each, sequential keep-alive requests: direct to the origin,
through the proxy as a miss (a new question each time) and through the proxy as
a hit (the same question again). Non-streaming total time and streaming time to
first byte; the ratios are what a user of the cache sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from ponto.fleet import Fleet, RegionDef


def body(model: str, question: str, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": question}],
    }


async def timed(session: aiohttp.ClientSession, url: str, payload: dict[str, object]) -> float:
    """Seconds to the first body byte (streams) or to the whole body."""
    t0 = time.perf_counter()
    async with session.post(url, json=payload) as resp:
        if payload["stream"]:
            await resp.content.readany()
            elapsed = time.perf_counter() - t0
            await resp.read()
        else:
            await resp.read()
            elapsed = time.perf_counter() - t0
        assert resp.status == 200, resp.status
    return elapsed


async def run(direct: str, proxy: str, model: str, n: int, stream: bool) -> dict[str, float]:
    out: dict[str, list[float]] = {"direct": [], "miss": [], "hit": []}
    async with aiohttp.ClientSession() as session:
        await timed(session, proxy, body(model, "warm-up", stream))
        hit = body(model, "the same question every time", stream)
        await timed(session, proxy, hit)
        for i in range(n):
            fresh = body(model, f"question number {i} {time.time_ns()}", stream)
            out["direct"].append(await timed(session, direct, fresh))
            out["miss"].append(await timed(session, proxy, {**fresh, "seed": i}))
            out["hit"].append(await timed(session, proxy, hit))
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("us-east", 38.9, -77.4))
        fleet.start_origin("bare", "us-east", models=("bare",))
        fleet.start_origin(
            "gpu", "us-east", models=("gpu",), ttft_ms=200, tokens_per_s=100,
            extra=["--answer-tokens", "16"],
        )  # fmt: skip
        fleet.add_origin("bare", "us-east", fleet.origin_url("bare"), ("bare",))
        fleet.add_origin("gpu", "us-east", fleet.origin_url("gpu"), ("gpu",))
        version = fleet.table_version(origins=2)
        fleet.start_proxy("p1", "us-east")
        fleet.wait_proxies_at(version)
        proxy = fleet.proxy_url("p1") + "/chat/completions"
        for origin, n in (
            ("bare", 300 if not args.quick else 60),
            ("gpu", 20 if not args.quick else 5),
        ):
            direct = fleet.origin_url(origin) + "/chat/completions"
            for stream in (False, True):
                label = f"{origin} {'stream TTFB' if stream else 'whole answer'}"
                results[label] = asyncio.run(run(direct, proxy, origin, n, stream))
    print("## exact cache hit vs origin round trip (p50 ms, sequential keep-alive)")
    head = ("origin / measure", "direct", "proxy miss", "proxy hit", "hit/direct")
    print(f"  {head[0]:<26}{head[1]:>10}{head[2]:>12}{head[3]:>11}{head[4]:>12}")
    for label, r in results.items():
        print(f"  {label:<26}{r['direct']:>10.3f}{r['miss']:>12.3f}{r['hit']:>11.3f}"
              f"{r['hit'] / r['direct']:>12.3f}")  # fmt: skip
    out = Path("docs/benchmarks/cache_hit.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"name": "cache_hit", "p50_ms": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
