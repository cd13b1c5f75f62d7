"""One cache per region: 1, 2 and 4 proxies sharing a Redis against proxies caching alone.

    .venv/bin/python -m bench.regional_cache [--quick] [--out docs/benchmarks/regional-cache.json]

All real processes on loopback: etcd, a control plane, one simulated origin
(`ponto.originsim`, a fixed time to the first token), one redis-server, and eight
proxies of one region: four with `--redis` on that server, four without (each
caching alone, as proxies did before the regional cache). One run measures, side
by side:

- **Hit rate per proxy count.** A round-robin client (request i to proxy i mod N)
  replays the same sequence of requests through 1, 2 and 4 proxies, with and
  without Redis. Two workloads with repeats, both drawn Zipf-like (rank r with
  weight 1/r^s, a few questions asked often, most rarely) from CLINC150's
  validation queries (../shared/data/semcache/): *exact*, repeats of the same
  question text under a tenant with the exact cache; *paraphrases*, intents drawn
  Zipf-like and a random phrasing of the intent each time, under a tenant with the
  semantic cache (a repeat phrased differently is a semantic hit when it is close
  enough). Each configuration asks under its own model name, so no configuration
  sees another's entries. Sequential requests: the latencies are service times.
- **Latency by where the answer came from** (the `x-ponto-cache-tier` header): a
  proxy's own cache (`local`), the region's Redis (`region`), the origin (a miss,
  the simulator's fixed delay plus the proxy), against a Redis GET alone
  (redis-py, the floor of a region hit), from the runs with Redis.
- **Redis killed under load.** Concurrent round-robin clients on the four proxies
  with Redis, each new question asked once on every proxy (with Redis: a miss,
  then three region hits); redis-server is SIGKILLed at 30 % of the phase and
  started again (empty, same port) at 55 %. Every request that does not end in a
  200 counts as failed; region hits after the restart show the proxies came back
  to it without a restart of their own.

The aims (issue 16) print as pass or miss: with 4 proxies the region's hit rate
within 2 percentage points of 1 proxy's; a Redis hit under 1 ms p50 on loopback,
taken as what a region hit adds to a local hit's whole answer (p50 against p50:
the HTTP round trip and the proxy's own work are the same for both, and on a busy
2-core machine a local hit alone takes longer than 1 ms); 0 failed requests with
Redis killed; region hits after the restart.

Writes docs/benchmarks/regional-cache.json (tables that bench.report renders).
About 2 minutes on 2 cores (--quick: about 1).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.data import SEMCACHE
from bench.loadgen import percentile
from ponto.devenv import Redis, start_redis
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

REGION = RegionDef("us-east", 38.9, -77.4)
PROXY_COUNTS = (1, 2, 4)
MODES = ("redis", "alone")  # proxies sharing the region's Redis, proxies caching alone
TIERS = ("local", "region")
SIMILARITY = "x-ponto-cache-similarity"  # set on semantic hits only
DEFAULT_OUT = Path("docs/benchmarks/regional-cache.json")


@dataclass(frozen=True)
class Params:
    exact_requests: int = 800
    exact_pool: int = 400
    semantic_requests: int = 300
    zipf_s: float = 1.1
    origin_ttft_ms: int = 20
    fault_seconds: float = 20.0
    fault_clients: int = 4
    redis_gets: int = 2000
    seed: int = 7


QUICK = Params(
    exact_requests=300,
    exact_pool=150,
    semantic_requests=120,
    fault_seconds=14.0,
    redis_gets=500,
)


# ---------------------------------------------------------------- workload (pure)


def zipf_draw(items: int, draws: int, s: float, rng: random.Random) -> list[int]:
    """`draws` indexes into range(items), index r drawn with weight 1/(r+1)^s."""
    weights = [1.0 / (rank + 1) ** s for rank in range(items)]
    return rng.choices(range(items), weights=weights, k=draws)


@dataclass(frozen=True)
class Workload:
    exact: list[str]  # question texts, repeated as drawn
    semantic: list[str]  # phrasings of intents, intents repeated as drawn


def make_workload(intents: dict[str, list[str]], p: Params) -> Workload:
    """The two request sequences, the same for every configuration (seeded)."""
    rng = random.Random(p.seed)
    texts = sorted({t for phrasings in intents.values() for t in phrasings})
    rng.shuffle(texts)
    pool = texts[: p.exact_pool]
    exact = [pool[i] for i in zipf_draw(len(pool), p.exact_requests, p.zipf_s, rng)]
    labels = sorted(intents)
    rng.shuffle(labels)
    drawn = zipf_draw(len(labels), p.semantic_requests, p.zipf_s, rng)
    semantic = [rng.choice(intents[labels[i]]) for i in drawn]
    return Workload(exact, semantic)


def fault_question(i: int, proxies: int, spacing: int = 41) -> str:
    """The fault phase's request i (sent to proxy i mod `proxies`): each new question
    is asked once on every proxy, `spacing` requests apart (1 more than a multiple
    of `proxies`, so that each ask reaches another proxy). With Redis its first ask
    misses and the others are region hits; without Redis every ask misses, since
    the proxy asked has never seen the question."""
    assert spacing % proxies == 1, "each ask of a question must reach another proxy"
    block, pos = divmod(i, proxies * spacing)
    return f"fault question {block * spacing + pos % spacing}"


def load_intents(path: Path) -> dict[str, list[str]]:
    """CLINC150's in-scope validation queries by intent (20 phrasings each)."""
    data = json.loads(path.read_text())
    out: dict[str, list[str]] = {}
    for text, label in data["val"]:
        out.setdefault(label, []).append(text)
    return out


def repeat_share(texts: Sequence[str]) -> float:
    """Share of requests whose text came before: an exact cache's best hit rate."""
    return 1 - len(set(texts)) / len(texts) if texts else 0.0


# ---------------------------------------------------------------- samples (pure)


@dataclass(frozen=True)
class Sample:
    proxy: int
    outcome: str  # local | region (hits), miss, bypass, error
    semantic: bool  # a semantic hit (not an exact one)
    seconds: float  # the whole answer, at the client
    at: float  # seconds since the phase began


def outcome_of(status: int, headers: dict[str, str]) -> str:
    """Where an answer came from, by the proxy's headers."""
    if status != 200:
        return "error"
    cache = headers.get("x-ponto-cache", "")
    if cache == "hit":
        return headers.get("x-ponto-cache-tier") or "local"
    return cache or "miss"


def hit_rate(samples: Sequence[Sample]) -> float:
    return sum(s.outcome in TIERS for s in samples) / len(samples) if samples else 0.0


def ms(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 3) if values else None


def latency_row(label: str, seconds: Sequence[float]) -> list[Any]:
    return [label, len(seconds), ms(seconds, 50), ms(seconds, 99)]


def windows(samples: Sequence[Sample], kill_at: float, restart_at: float) -> list[list[Any]]:
    """The fault phase by window: before the kill, Redis down, after the restart."""
    rows = []
    spans = (
        ("Redis up", 0.0, kill_at),
        ("Redis killed", kill_at, restart_at),
        ("Redis restarted (empty)", restart_at, float("inf")),
    )
    for label, start, end in spans:
        part = [s for s in samples if start <= s.at < end]
        counts = {k: sum(s.outcome == k for s in part) for k in ("local", "region", "miss")}
        failed = sum(s.outcome == "error" for s in part)
        answered = [s.seconds for s in part if s.outcome != "error"]
        hits = [counts["local"], counts["region"], counts["miss"]]
        rows.append([label, len(part), failed, *hits, ms(answered, 50), ms(answered, 99)])
    return rows


def verdict(goal: str, value: float | None, unit: str, ok: Callable[[float], bool]) -> list[Any]:
    met = None if value is None else ok(value)
    mark = {True: "pass", False: "miss", None: "not measured"}[met]
    return [goal, "-" if value is None else f"{value:.3g} {unit}".strip(), mark]


# ---------------------------------------------------------------- the run


@dataclass
class Setup:
    fleet: Fleet
    redis: Redis
    keys: dict[str, str]  # tenant -> API key
    urls: dict[str, list[str]]  # mode -> the chat URLs of its four proxies


def models(counts: Sequence[int] = PROXY_COUNTS) -> tuple[str, ...]:
    per_config = [f"{w}-{m}-{n}" for w in ("exact", "para") for m in MODES for n in counts]
    return ("warm", "fault", *per_config)


def start(workdir: Path, p: Params) -> Setup:
    fleet = Fleet(workdir)
    redis = start_redis(workdir, maxmemory_mb=128)
    try:
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(REGION)
        fleet.start_origin(
            "origin",
            REGION.name,
            models=models(),
            ttft_ms=p.origin_ttft_ms,
            extra=["--answer-tokens", "16"],
        )
        fleet.add_origin("origin", REGION.name, fleet.origin_url("origin"), models())
        admin = fleet.admin()
        keys, ids = {}, set()
        for tenant, mode in (("exact", "exact"), ("para", "semantic")):
            # No limits: a proxy that has just started holds no share of one yet.
            spec = pb.Tenant(name=f"bench-{tenant}", cache=pb.CachePolicy(mode=mode))
            admin.PutTenant(apb.PutTenantRequest(tenant=spec, allow_update=True), timeout=10)
            created = admin.CreateKey(apb.CreateKeyRequest(tenant=spec.name), timeout=10)
            keys[tenant] = created.secret
            ids.add(created.key.id)
        version = fleet.wait_table(lambda t: ids <= {k.id for k in t.keys} and len(t.origins) == 1)
        urls: dict[str, list[str]] = {m: [] for m in MODES}
        for mode in MODES:
            for i in range(max(PROXY_COUNTS)):
                name = f"{mode}-{i + 1}"
                extra = ["--redis", redis.url] if mode == "redis" else []
                fleet.start_proxy(name, REGION.name, extra=extra)
                urls[mode].append(fleet.proxy_url(name) + "/chat/completions")
        fleet.wait_proxies_at(version)
    except BaseException:
        fleet.stop()
        redis.stop()
        raise
    return Setup(fleet, redis, keys, urls)


class Client:
    """Chat requests with a tenant's key; each answer becomes a Sample."""

    def __init__(self, session: aiohttp.ClientSession, keys: dict[str, str]) -> None:
        self.session = session
        self.keys = keys

    async def post(
        self, url: str, tenant: str, model: str, text: str
    ) -> tuple[int, dict[str, str], bytes]:
        body = {
            "model": model,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": text}],
        }
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        async with self.session.post(url, json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def ask(
        self, url: str, proxy: int, tenant: str, model: str, text: str, t0: float
    ) -> Sample:
        start = time.perf_counter()
        try:
            status, headers, _ = await self.post(url, tenant, model, text)
            outcome = outcome_of(status, headers)
        except (aiohttp.ClientError, TimeoutError):
            outcome, headers = "error", {}
        end = time.perf_counter()
        semantic = SIMILARITY in headers and outcome in TIERS
        return Sample(proxy, outcome, semantic, end - start, start - t0)


async def replay(
    client: Client, urls: Sequence[str], tenant: str, model: str, texts: Sequence[str]
) -> list[Sample]:
    """The texts in order, request i to urls[i mod N], one at a time."""
    t0 = time.perf_counter()
    out = []
    for i, text in enumerate(texts):
        n = i % len(urls)
        out.append(await client.ask(urls[n], n, tenant, model, text, t0))
    return out


async def warm_up(client: Client, setup: Setup) -> None:
    """A first request of each tenant on every proxy (the semantic one loads the model)."""
    for mode in MODES:
        for n, url in enumerate(setup.urls[mode]):
            for tenant in ("exact", "para"):
                status, _, body = await client.post(url, tenant, "warm", f"warm-up {mode} {n}")
                if status != 200:
                    raise RuntimeError(f"warm-up request to {url}: {status} {body[:300]!r}")


async def redis_floor(url: str, gets: int) -> list[float]:
    """Sequential GETs of a 1 KB value with redis-py: the round trip a region hit adds."""
    import redis.asyncio as aioredis  # noqa: PLC0415

    client = aioredis.Redis.from_url(url)
    try:
        await client.set("bench:floor", b"x" * 1024)
        for _ in range(50):
            await client.get("bench:floor")
        out = []
        for _ in range(gets):
            start = time.perf_counter()
            await client.get("bench:floor")
            out.append(time.perf_counter() - start)
        await client.delete("bench:floor")
        return out
    finally:
        await client.aclose()


async def fault_phase(client: Client, setup: Setup, p: Params) -> tuple[list[Sample], float, float]:
    """Concurrent round-robin clients on the Redis proxies; Redis killed, then restarted."""
    urls = setup.urls["redis"]
    # Time after the restart for the proxies' breakers to try Redis again.
    kill_at, restart_at = 0.3 * p.fault_seconds, 0.55 * p.fault_seconds
    counter = itertools.count()
    samples: list[Sample] = []
    t0 = time.perf_counter()

    async def loop() -> None:
        while time.perf_counter() - t0 < p.fault_seconds:
            i = next(counter)
            n = i % len(urls)
            text = fault_question(i, len(urls))
            samples.append(await client.ask(urls[n], n, "exact", "fault", text, t0))

    async def chaos() -> None:
        await asyncio.sleep(kill_at)
        setup.redis.kill()
        await asyncio.sleep(restart_at - kill_at)
        workdir = setup.fleet.workdir
        port = setup.redis.port
        setup.redis = await asyncio.to_thread(start_redis, workdir, port=port, maxmemory_mb=128)

    await asyncio.gather(chaos(), *(loop() for _ in range(p.fault_clients)))
    return samples, kill_at, restart_at


async def measure(setup: Setup, work: Workload, p: Params) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = Client(session, setup.keys)
        await warm_up(client, setup)
        runs: dict[tuple[str, str, int], list[Sample]] = {}
        for n in PROXY_COUNTS:
            for mode in MODES:
                urls = setup.urls[mode][:n]
                for tenant, texts in (("exact", work.exact), ("para", work.semantic)):
                    model = f"{tenant}-{mode}-{n}"
                    runs[(tenant, mode, n)] = await replay(client, urls, tenant, model, texts)
                    print(
                        f"  {tenant:<5} {mode:<5} {n} proxies: hit rate "
                        f"{hit_rate(runs[(tenant, mode, n)]):.3f}",
                        flush=True,
                    )
        floor = await redis_floor(setup.redis.url, p.redis_gets)
        fault, kill_at, restart_at = await fault_phase(client, setup, p)
    return {
        "runs": runs,
        "floor": floor,
        "fault": fault,
        "kill_at": kill_at,
        "restart_at": restart_at,
    }


# ---------------------------------------------------------------- the report (pure)


def report(work: Workload, m: dict[str, Any], p: Params, seconds: float) -> dict[str, Any]:
    runs: dict[tuple[str, str, int], list[Sample]] = m["runs"]
    hit_rows = []
    for n in PROXY_COUNTS:
        row: list[Any] = [n]
        for tenant in ("exact", "para"):
            for mode in MODES:
                row.append(round(hit_rate(runs[(tenant, mode, n)]), 4))
        region = runs[("exact", "redis", n)]
        row.append(round(sum(s.outcome == "region" for s in region) / len(region), 4))
        hit_rows.append(row)
    best = round(repeat_share(work.exact), 4)
    hit_rows.append(["best possible (repeated texts)", best, best, "-", "-", "-"])

    # Latency from the Redis runs with more than one proxy (where region hits happen).
    shared = [s for (t, mode, n), ss in runs.items() if mode == "redis" and n > 1 for s in ss]

    def of(outcome: str, semantic: bool | None = None) -> list[float]:
        return [
            s.seconds
            for s in shared
            if s.outcome == outcome and (semantic is None or s.semantic == semantic)
        ]

    latency_rows = [
        latency_row("local hit (exact)", of("local", False)),
        latency_row("region hit (exact)", of("region", False)),
        latency_row("local hit (semantic)", of("local", True)),
        latency_row("region hit (semantic)", of("region", True)),
        latency_row(f"miss: origin round trip ({p.origin_ttft_ms} ms to first token)", of("miss")),
        latency_row("Redis GET alone (redis-py, 1 KB)", m["floor"]),
    ]
    fault_rows = windows(m["fault"], m["kill_at"], m["restart_at"])

    one = hit_rate(runs[("exact", "redis", 1)])
    four = hit_rate(runs[("exact", "redis", max(PROXY_COUNTS))])
    region_p50 = ms(of("region", False), 50)
    local_p50 = ms(of("local", False), 50)
    failed = sum(s.outcome == "error" for s in m["fault"])
    after = [s.at for s in m["fault"] if s.outcome == "region" and s.at >= m["restart_at"]]
    aims = [
        verdict(
            "4 proxies' hit rate within 2 points of 1 proxy's (exact, shared Redis)",
            round((one - four) * 100, 2),
            "points below",
            lambda v: v <= 2.0,
        ),
        verdict(
            "a region (Redis) hit under 1 ms p50 on loopback: what it adds to a local hit",
            None if region_p50 is None or local_p50 is None else region_p50 - local_p50,
            "ms",
            lambda v: v < 1.0,
        ),
        verdict(
            "Redis killed under load: 0 failed requests", float(failed), "failed", lambda v: v == 0
        ),
    ]
    resumed = "region hits resume after Redis restarts (no proxy restarted)"
    if after:
        aims.append(verdict(resumed, min(after) - m["restart_at"], "s later", lambda v: True))
    else:
        aims.append([resumed, "none by the end of the phase", "miss"])
    return {
        "name": "regional-cache",
        "title": "Regional cache: 1, 2 and 4 proxies sharing one Redis (bench/regional_cache.py)",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(seconds),
        "params": asdict(p),
        "tables": [
            {
                "title": "Hit rate per proxy count, round-robin client, the same requests each "
                "time (region hits: the share answered from Redis)",
                "columns": [
                    "proxies",
                    "exact, shared Redis",
                    "exact, caching alone",
                    "paraphrases, shared Redis",
                    "paraphrases, caching alone",
                    "region hits (exact, Redis)",
                ],
                "rows": hit_rows,
            },
            {
                "title": "Whole answer at the client by where it came from (ms; runs with "
                "Redis and 2 or 4 proxies; sequential keep-alive requests)",
                "columns": ["answer", "count", "p50 ms", "p99 ms"],
                "rows": latency_rows,
            },
            {
                "title": f"Redis killed under load ({p.fault_clients} clients round-robin on 4 "
                f"proxies for {p.fault_seconds:g} s; SIGKILL at {m['kill_at']:.1f} s, "
                f"started again at {m['restart_at']:.1f} s)",
                "columns": [
                    "window",
                    "requests",
                    "failed",
                    "local hits",
                    "region hits",
                    "misses",
                    "p50 ms",
                    "p99 ms",
                ],
                "rows": fault_rows,
            },
            {"title": "Aims (issue 16)", "columns": ["aim", "measured", "verdict"], "rows": aims},
        ],
    }


def print_tables(result: dict[str, Any]) -> None:
    for table in result["tables"]:
        print(f"\n## {table['title']}")
        rows = [table["columns"], *table["rows"]]
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(table["columns"]))]
        for r in rows:
            print("  " + "  ".join(f"{v!s:<{w}}" for v, w in zip(r, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, a shorter fault")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="", help="a line shown under the tables")
    args = parser.parse_args(argv)
    p = QUICK if args.quick else Params()
    work = make_workload(load_intents(SEMCACHE / "clinc150_train_val.json"), p)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ponto-regional-") as tmp:
        print("starting etcd, a control plane, an origin, redis-server and 8 proxies", flush=True)
        setup = start(Path(tmp), p)
        try:
            measured = asyncio.run(measure(setup, work, p))
        finally:
            setup.fleet.stop()
            setup.redis.stop()
    result = report(work, measured, p, time.monotonic() - began)
    if args.note:
        result["text"] = args.note
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
