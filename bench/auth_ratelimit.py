"""What authentication and rate limiting add to a request, measured two ways in one run.

    .venv/bin/python -m bench.auth_ratelimit [--quick]

1. In process, the exact steps the handler adds (dataplane/http/pipeline.py): check
   the key, estimate prompt tokens, admit against the tenant and key limits,
   build the x-ratelimit-* headers, release with the real usage. A table of
   1,000 keys over 100 limited tenants; CPU time per request, beside parsing
   the same 1 kB request body as a yardstick. The aim is under 50 µs.
2. Over HTTP through a real proxy: the same requests in open mode (no keys)
   and then with a key whose tenant and key both have (generous) limits,
   alternating in blocks; the difference of the p50s is the added latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from dataplane.policy import build_policy
from dataplane.ratelimit.limiter import RateLimiter
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from ponto.apikeys import issue_key
from ponto.fleet import Fleet, RegionDef
from ponto.quota_types import Share
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

BODY = {
    "model": "sim-small",
    "max_tokens": 8,
    "temperature": 0.7,  # not cached: every request reaches the origin
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "What is the capital of Portugal? " * 8},
    ],
}


def in_process(n: int) -> dict[str, float]:
    table = pb.RouteTable(version=1)
    keys = []
    for t in range(100):
        table.tenants.append(
            pb.Tenant(name=f"t{t}", limits=pb.Limits(rpm=10**9, tpm=10**12, concurrency=10**6))
        )
    for i in range(1000):
        issued = issue_key()
        keys.append(issued.key)
        table.keys.append(
            pb.ApiKey(
                id=issued.key_id,
                hash=issued.key_hash,
                tenant=f"t{i % 100}",
                limits=pb.Limits(rpm=10**9),
            )
        )
    policy = build_policy(table)
    limiter = RateLimiter()
    now = time.monotonic()
    limiter.configure(policy.limits, now)
    limiter.apply_shares({scope: Share(1.0, 10**6) for scope in policy.limits}, now)
    raw = json.dumps(BODY).encode()
    headers = [f"Bearer {k}" for k in keys]

    def parse_only() -> None:
        for i in range(n):
            json.loads(raw)
            del i

    def pipeline() -> None:
        auth = policy.authenticator
        for i in range(n):
            t = time.time()
            principal = auth.authenticate(headers[i % len(headers)], t)
            est = estimate_prompt_tokens("chat.completions", BODY)
            m = time.monotonic()
            admission = limiter.admit(principal.scopes, est, m)
            limiter.headers(principal.scopes, m)
            admission.release(est + 8, m)

    out = {}
    for name, fn in (("json_parse_1kB", parse_only), ("auth_and_limits", pipeline)):
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        out[name] = best / n * 1e6
    return out


async def _timed(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=BODY, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200, (resp.status, await resp.text(), dict(resp.headers))
    return time.perf_counter() - t0


async def interleaved(
    open_url: str, keyed_url: str, auth: dict[str, str], n: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"open": [], "keyed": []}
    async with aiohttp.ClientSession() as session:
        for url, headers in ((open_url, {}), (keyed_url, auth)):
            for _ in range(50):  # warm connections and code paths
                await _timed(session, url, headers)
        block = 50
        for _ in range(max(1, n // block)):
            for name, url, headers in (("open", open_url, {}), ("keyed", keyed_url, auth)):
                for _ in range(block):
                    out[name].append(await _timed(session, url, headers))
    return out


@contextlib.contextmanager
def _fleet(workdir: Path) -> Iterator[Fleet]:
    with Fleet(workdir) as fleet:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("us-east", 38.9, -77.4))
        fleet.start_origin("o1", "us-east")
        fleet.add_origin("o1", "us-east", fleet.origin_url("o1"))
        version = fleet.table_version(origins=1)
        fleet.start_proxy("p1", "us-east")
        fleet.wait_proxies_at(version)
        yield fleet


def _wait_ready(fleet: Fleet) -> None:
    """Until the proxy holds its rate-limit shares (/readyz)."""
    url = f"http://{fleet.proxies['p1'].address}/readyz"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2):
            return
        time.sleep(0.1)
    raise RuntimeError("the proxy never got its rate-limit shares")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n = 20_000 if not args.quick else 2_000
    micro = in_process(n)
    added = micro["auth_and_limits"]
    print("## auth + rate limiting, in process (best of 5, CPU time per request)")
    print(f"  1 kB JSON parse (yardstick)      {micro['json_parse_1kB']:.2f} µs")
    print(f"  key check + estimate + admit + headers + release  {added:.2f} µs "
          f"({added / micro['json_parse_1kB']:.1f}x the parse; aim < 50 µs)")  # fmt: skip

    requests = 2000 if not args.quick else 300
    # Two fleets side by side: one open, one with a key and limits; the
    # client alternates between them in blocks so both see the same machine.
    with (
        tempfile.TemporaryDirectory() as tmp,
        _fleet(Path(tmp) / "open") as open_fleet,
        _fleet(Path(tmp) / "keyed") as keyed_fleet,
    ):
        admin = keyed_fleet.admin()
        limits = pb.Limits(rpm=10**9, tpm=10**12, concurrency=10**6)
        admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="bench", limits=limits)))
        created = admin.CreateKey(apb.CreateKeyRequest(tenant="bench", limits=limits), timeout=5)
        keyed_fleet.wait_proxies_at(keyed_fleet.wait_table(lambda t: len(t.keys) == 1))
        _wait_ready(keyed_fleet)
        times = asyncio.run(
            interleaved(
                open_fleet.proxy_url("p1") + "/chat/completions",
                keyed_fleet.proxy_url("p1") + "/chat/completions",
                {"authorization": f"Bearer {created.secret}"},
                requests,
            )
        )
    o50, k50 = statistics.median(times["open"]), statistics.median(times["keyed"])
    print(f"## through a proxy over HTTP ({requests} sequential requests each, interleaved)")
    print(f"  open mode               p50 {o50 * 1e3:.3f} ms")
    print(f"  key + tenant/key limits p50 {k50 * 1e3:.3f} ms")
    print(f"  added by auth + limits  p50 {(k50 - o50) * 1e6:.0f} µs (ratio {k50 / o50:.3f})")
    out = Path("docs/benchmarks/auth_ratelimit.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "name": "auth_ratelimit",
                "in_process_us": micro,
                "http_p50_ms": {"open": o50 * 1e3, "key_and_limits": k50 * 1e3},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
