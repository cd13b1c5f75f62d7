"""Rate limiting hot path, in-process: what admission adds to each request.

    .venv/bin/python -m bench.ratelimit_micro [--quick]

Times one request's worth of rate-limit work: `admit`, `release` with the
real token count, and `headers`, for a request limited by one scope (its
tenant), by two (tenant and key), by two near binding (a busy key, whose
remaining and reset headers are made anew each request), and by none (the
no-limit fast path). Also
a refused admission, the prompt estimate of a typical chat body, and one
leader round of `compute_shares`. Each figure is the best of many runs
(min), which is the least disturbed by other processes on a shared machine;
the median is shown beside it.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

from controlplane.quota import compute_shares
from dataplane.ratelimit import RateLimiter, ScopeLimits, Share, estimate_prompt_tokens
from ponto.quota_types import Demand

TENANT, KEY = "t/acme", "k/key-0001"
BODY = {
    "model": "llama-3-70b",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Summarise the following text in three bullet points. " * 20},
    ],
}


def per_call_us(fn: Callable[[], object], number: int, repeat: int) -> tuple[float, float]:
    runs = [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat)]
    return min(runs), statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs")
    args = parser.parse_args(argv)
    number, repeat = (2_000, 20) if args.quick else (10_000, 50)

    # Limits high enough that every admission passes: the common case.
    rl = RateLimiter()
    limits = {
        TENANT: ScopeLimits(rpm=10**9, tpm=10**12, concurrency=10**6),
        KEY: ScopeLimits(rpm=10**9, tpm=10**12),
        **{f"t/other-{i}": ScopeLimits(rpm=600, tpm=100_000) for i in range(10_000)},
    }
    rl.configure(limits, 0.0)
    rl.apply_shares({TENANT: Share(1 / 3, 10**5), KEY: Share(1 / 3)}, 0.0)
    clock = [100.0]

    def request(scopes: list[str]) -> Callable[[], object]:
        def run() -> object:
            clock[0] += 1e-4
            now = clock[0]
            adm = rl.admit(scopes, 250, now)
            adm.release(400, now)
            return rl.headers(scopes, now)

        return run

    # Limits near binding: each request takes a little more than the bucket
    # refills between two (0.9 of a request, 390 of its 400 tokens), so no
    # bucket is full again and the remaining and reset headers are made anew
    # each request (a busy key), yet none empties within the runs.
    busy = RateLimiter()
    busy.configure(
        {TENANT: ScopeLimits(rpm=540_000, tpm=234_000_000), KEY: ScopeLimits(rpm=540_000)}, 0.0
    )
    busy.apply_shares({TENANT: Share(1.0), KEY: Share(1.0)}, 0.0)
    busy_clock = [100.0]

    def near_binding() -> object:
        busy_clock[0] += 1e-4
        now = busy_clock[0]
        adm = busy.admit([TENANT, KEY], 250, now)
        adm.release(400, now)
        return busy.headers([TENANT, KEY], now)

    refuser = RateLimiter()
    refuser.configure({TENANT: ScopeLimits(rpm=60)}, 0.0)
    refuser.apply_shares({TENANT: Share(1 / 3)}, 0.0)

    def refused() -> object:
        refuser.admit([TENANT], 1, 0.5)
        return refuser.headers([TENANT], 0.5)

    def estimate() -> object:
        return estimate_prompt_tokens("chat.completions", BODY)

    rows = [
        ("admit + release + headers, 1 scope", request([TENANT])),
        ("admit + release + headers, 2 scopes", request([TENANT, KEY])),
        ("admit + release + headers, 2 scopes near binding", near_binding),
        ("admit + release + headers, no limits", request(["t/unlimited", "k/unlimited"])),
        ("refused admit + headers, 1 scope", refused),
        ("estimate_prompt_tokens, 2-message chat", estimate),
    ]
    print(f"{'per request':50} {'min µs':>8} {'median µs':>10}")
    for name, fn in rows:
        best, median = per_call_us(fn, number, repeat)
        print(f"{name:50} {best:8.2f} {median:10.2f}")

    # One leader round: 3 proxies, 10,000 scopes of which 1,000 had demand.
    proxies = ["p0", "p1", "p2"]
    active = {f"t/other-{i}": Demand(1.0 + i % 7, 300.0) for i in range(1000)}
    demand = {p: active for p in proxies}
    previous = compute_shares(limits, proxies, demand, {})
    previous = compute_shares(limits, proxies, demand, previous)
    best, median = per_call_us(
        lambda: compute_shares(limits, proxies, demand, previous), 1, 5 if args.quick else 10
    )
    name = "compute_shares, 3 proxies x 10,002 scopes"
    print(f"\n{name:44} {best / 1000:7.1f}ms {median / 1000:9.1f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
