"""Geography: one origin region for the world against Ponto, in an emulated world.

    .venv/bin/python -m bench.geo_world [--quick] [--out PATH]

Writes docs/benchmarks/geo.json (a --quick run writes only with --out). About
two minutes on two CPUs; --quick about one. Method, source and assumptions:
docs/benchmarks/geo-world.md.

Five user regions (us-east, eu-west, ap-southeast, sa-east, ap-northeast) on
one machine. Every inter-region hop goes through a user-space relay
(bench/relay.py) that adds the published P50 round trip between the two Azure
regions the labels stand for (bench/rtt.py names the source and date). Users
reach the nearest cloud edge over an access network of ACCESS_RTT_MS, an
assumption. Origins are origin simulators with a time to first token of
TTFT_MS, then TOKENS_PER_S.

Scenarios, each run on the same machine in one run, with the same requests:

* centralised: every user calls the one origin region (us-east) directly:
  access network, then the backbone to us-east.
* ponto: every user calls the proxy of their own region (access network only);
  the proxy serves from its cache or calls the nearest origin region that has
  GPUs (us-east, eu-west or ap-southeast) over the backbone.
* ponto-1-origin: the same proxies in front of the centralised origin only, so
  the gain of the edge and its cache is seen apart from that of more origins.

Workloads:

* Single-shot chat: streamed, temperature-0 questions drawn from the real user
  queries of CLINC150 and banking77 (../shared/data/semcache/) with Zipf
  popularity (s = ZIPF_S) shared by all regions. Each Ponto scenario first sends
  a warm-up of the same stream (not measured) so that the measured window sees
  a cache in steady state rather than an empty one; the exact-repeat rate of the
  measured window is computed from the stream and printed.
* Agent loop: 15 sequential non-streamed calls; each call's messages carry the
  previous answers and a tool observation unique to the loop, so after its first
  call a loop can hit no cache.

Reported: time to first token (TTFT) at the user, p50 and p95 per user region
and globally; whole response time; cache hits (read from the `x-ponto-cache`
response header, never assumed); and the fraction of requests that reached an
origin (from the simulators' /sim/stats counters). Side by side with the claims
Ponto was built on: global p50 340 ms -> 85 ms, origin load down 40-60 %.

A note on plumbing: proxies in different regions must reach the same origin
over different links, but a route table gives each origin one URL. Each
(proxy region, origin region) link is therefore registered as an origin of its
own, serving a model name private to that proxy region ("chat-sa-east"), and
users in a region ask for their region's model. Origins answer every name
alike; cache keys include the model, and each region's users only ever reach
their own proxy, so no cache sharing is lost that would otherwise exist.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import csv
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import uvloop

from bench import rtt
from bench.data import SEMCACHE
from bench.rtt import ACCESS_RTT_MS, INTRA_REGION_RTT_MS, REGION_NAMES, REGIONS
from ponto.devenv import Managed, python_entry, spawn
from ponto.fleet import Fleet, RegionDef
from ponto.originsim.app import DEFAULT_COMPLETION_TOKENS

REPO: Final = Path(__file__).resolve().parents[1]
DATA: Final = SEMCACHE  # ../shared/data/semcache, or $PONTO_SEMCACHE_DATA
OUT: Final = REPO / "docs" / "benchmarks" / "geo.json"

CENTRAL: Final = "us-east"
ORIGIN_REGIONS: Final = ("us-east", "eu-west", "ap-southeast")
TTFT_MS: Final = 200
TOKENS_PER_S: Final = 200
# No max_tokens is sent: the simulator reports every budgeted answer as cut
# (finish_reason "length"), and the cache rightly keeps no cut answers. Answers
# are then the simulator's default length.
ANSWER_TOKENS: Final = DEFAULT_COMPLETION_TOKENS
AGENT_CALLS: Final = 15
ZIPF_S: Final = 0.9
SEED: Final = 8
CHAT_PATH: Final = "/v1/chat/completions"
SYSTEM: Final = "You are the assistant of an online bank and a personal helper. Answer briefly."
AGENT_SYSTEM: Final = "You are an agent. Think, call a tool, read its observation, repeat."

CLAIMS: Final[dict[str, Any]] = {
    "global_p50_ms": {"centralised": 340, "ponto": 85, "reduction": 0.75},
    "origin_load_reduction": {"low": 0.40, "high": 0.60},
    "source": "the source material Ponto was built on, as summarised in ../shared/DESIGN.md",
}


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    users: int  # concurrent chat users per region, each with one kept-alive connection
    requests: int  # measured chat requests per user, sent one after another
    warmup: int  # cache warm-up requests per region before the measured window
    warmup_concurrency: int  # per region
    agents: int  # concurrent agent loops per region


FULL: Final = Profile("full", users=4, requests=40, warmup=300, warmup_concurrency=12, agents=2)
QUICK: Final = Profile("quick", users=2, requests=10, warmup=80, warmup_concurrency=8, agents=1)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    urls: dict[str, str]  # user region -> base URL (ending in /v1) as that region's users see it
    models: dict[str, str]  # user region -> model name
    cache_warmup: bool


# ----------------------------------------------------------------------------- the world


def _spawn_relays(workdir: Path, name: str, links: dict[str, tuple[str, float]]) -> Managed:
    """One relay process for `links` (name -> (target HOST:PORT, RTT ms))."""
    ready = workdir / f"{name}.json"
    argv = [*python_entry("bench.relay"), "--ready-file", str(ready)]
    argv += [f"--link={link}={target}@{rtt_ms}" for link, (target, rtt_ms) in links.items()]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return spawn(name, argv, workdir, ready_file=ready, env={"PYTHONPATH": path})


def _in_parallel(start: Callable[[str], object], names: Iterable[str]) -> None:
    """Start processes side by side (each waits for its own ready file)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(start, name) for name in names]:
            future.result()


@dataclass
class World:
    """Etcd, a control plane, origins, a proxy per region and the relays between them."""

    fleet: Fleet
    relays: list[Managed] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)  # link name -> HOST:PORT

    def start(self) -> None:
        f = self.fleet
        f.start_etcd()
        # Probes cross the emulated backbone too (up to ~0.7 s for a new connection).
        f.start_control(extra=["--probe-interval-ms", "2000", "--probe-timeout-ms", "5000"])
        for region in REGIONS:
            f.add_region(RegionDef(region.name, region.latitude, region.longitude))
        models = tuple(f"{kind}-{r}" for r in REGION_NAMES for kind in ("chat", "solo"))
        _in_parallel(
            lambda o: f.start_origin(f"origin-{o}", o, ttft_ms=TTFT_MS,
                                     tokens_per_s=TOKENS_PER_S, models=models),
            ORIGIN_REGIONS,
        )  # fmt: skip
        backbone: dict[str, tuple[str, float]] = {}
        for r in REGION_NAMES:
            for o in ORIGIN_REGIONS:
                backbone[f"{r}>{o}"] = (f.origins[f"origin-{o}"].address, rtt.rtt_ms(r, o))
            backbone[f"users-{r}>{CENTRAL}"] = (
                f.origins[f"origin-{CENTRAL}"].address,
                rtt.user_rtt_ms(r, CENTRAL),
            )
        self._relays("relay-backbone", backbone)
        for r in REGION_NAMES:
            for o in ORIGIN_REGIONS:
                served = [f"chat-{r}"] + ([f"solo-{r}"] if o == CENTRAL else [])
                url = f"http://{self.links[f'{r}>{o}']}/v1"
                f.add_origin(f"{o}-via-{r}", o, url, models=tuple(served))
        version = f.table_version(origins=len(REGION_NAMES) * len(ORIGIN_REGIONS))
        _in_parallel(
            lambda r: f.start_proxy(f"proxy-{r}", r, extra=["--log-level", "WARNING"]),
            REGION_NAMES,
        )
        f.wait_proxies_at(version, timeout=30)
        access = {
            f"users-{r}>proxy-{r}": (f.proxies[f"proxy-{r}"].address, ACCESS_RTT_MS)
            for r in REGION_NAMES
        }
        self._relays("relay-access", access)

    def _relays(self, name: str, links: dict[str, tuple[str, float]]) -> None:
        managed = _spawn_relays(self.fleet.workdir, name, links)
        self.relays.append(managed)
        self.links.update(json.loads(managed.address))

    def origin_addresses(self) -> list[str]:
        return [m.address for m in self.fleet.origins.values()]

    def scenarios(self) -> list[Scenario]:
        central = {r: f"http://{self.links[f'users-{r}>{CENTRAL}']}/v1" for r in REGION_NAMES}
        edge = {r: f"http://{self.links[f'users-{r}>proxy-{r}']}/v1" for r in REGION_NAMES}
        chat = {r: f"chat-{r}" for r in REGION_NAMES}
        solo = {r: f"solo-{r}" for r in REGION_NAMES}
        return [
            Scenario("centralised", f"every user calls the {CENTRAL} origin", central, chat, False),
            Scenario("ponto", "nearest proxy, nearest of 3 origin regions", edge, chat, True),
            Scenario("ponto-1-origin", f"nearest proxy, {CENTRAL} origin only", edge, solo, True),
        ]

    def stop(self) -> None:
        for managed in self.relays:
            managed.stop()
        self.fleet.stop()


# ----------------------------------------------------------------------------- workload


def load_texts(data: Path) -> list[str]:
    """Distinct user queries of CLINC150 (all splits) and banking77 (train and test)."""
    texts: list[str] = []
    clinc = json.loads((data / "clinc150_train_val.json").read_text(encoding="utf-8"))
    for split in sorted(clinc):
        texts.extend(text for text, _ in clinc[split])
    for part in ("train", "test"):
        with (data / "banking77" / f"{part}.csv").open(encoding="utf-8", newline="") as fh:
            texts.extend(row["text"] for row in csv.DictReader(fh))
    return list(dict.fromkeys(t.strip() for t in texts if t.strip()))


class Zipf:
    """Draws texts with Zipf popularity over one random ranking, shared by all regions."""

    def __init__(self, texts: list[str], s: float, seed: int) -> None:
        self.ranked = list(texts)
        random.Random(seed).shuffle(self.ranked)
        weights = (1.0 / (rank**s) for rank in range(1, len(self.ranked) + 1))
        self._cum = list(itertools.accumulate(weights))

    def draw(self, rng: random.Random, n: int) -> list[str]:
        total = self._cum[-1]
        return [self.ranked[bisect.bisect(self._cum, rng.random() * total)] for _ in range(n)]


_QUOTES: Final = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def normalise(text: str) -> str:
    """The normalisations DESIGN.md lists as safe: an upper bound of what exact caching merges."""
    folded = unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)
    return " ".join(folded.split()).rstrip("?.! ")


def repeat_rate(stream: list[str], start: int, key: Callable[[str], str] = str) -> float:
    """Fraction of stream[start:] whose text (under `key`) occurred earlier in the stream."""
    seen = {key(t) for t in stream[:start]}
    repeats = 0
    for text in stream[start:]:
        k = key(text)
        repeats += k in seen
        seen.add(k)
    return repeats / max(1, len(stream) - start)


# ----------------------------------------------------------------------------- clients


@dataclass(frozen=True, slots=True)
class Sample:
    ttft: float  # seconds to the first data event (first token or cached replay)
    total: float
    cache: str  # the x-ponto-cache header, "" when absent
    served_from: str  # x-ponto-region (the origin's region), "" when absent
    ok: bool


def is_hit(cache: str) -> bool:
    return "hit" in cache.lower()


def _session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=120)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def chat_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    ttft = math.nan
    try:
        async with session.post(url, json=body) as resp:
            cache = resp.headers.get("x-ponto-cache", "")
            served = resp.headers.get("x-ponto-region", "")
            done = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif math.isnan(ttft):
                    ttft = time.perf_counter() - t0
            ok = resp.status == 200 and done and not math.isnan(ttft)
    except (aiohttp.ClientError, TimeoutError):
        return Sample(math.nan, math.nan, "", "", False)
    return Sample(ttft, time.perf_counter() - t0, cache, served, ok)


def chat_body(model: str, text: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "temperature": 0,
        "stream": True,
    }


async def warm_connection(session: aiohttp.ClientSession, base: str) -> None:
    """Open the user's kept-alive connection (pays the handshake) without inference."""
    async with session.get(base + "/models") as resp:
        await resp.read()


async def warm_cache(scenario: Scenario, streams: dict[str, list[str]], n: int, conc: int) -> None:
    """Send the first `n` requests of each region's stream, `conc` at a time per region."""

    async def region(r: str) -> None:
        queue = iter(streams[r][:n])
        async with _session(conc) as session:

            async def worker() -> None:
                for text in queue:
                    await chat_once(session, scenario.urls[r] + "/chat/completions",
                                    chat_body(scenario.models[r], text))  # fmt: skip

            await asyncio.gather(*(worker() for _ in range(conc)))

    await asyncio.gather(*(region(r) for r in REGION_NAMES))


async def run_chat(
    scenario: Scenario, streams: dict[str, list[str]], start: int, profile: Profile
) -> dict[str, list[Sample]]:
    """The measured window: each region's users split stream[start:] and send it sequentially."""
    out: dict[str, list[Sample]] = {r: [] for r in REGION_NAMES}
    window = profile.users * profile.requests

    async def user(r: str, texts: list[str], session: aiohttp.ClientSession) -> None:
        url = scenario.urls[r] + "/chat/completions"
        for text in texts:
            out[r].append(await chat_once(session, url, chat_body(scenario.models[r], text)))

    sessions = {(r, u): _session(1) for r in REGION_NAMES for u in range(profile.users)}
    try:
        await asyncio.gather(
            *(warm_connection(s, scenario.urls[r]) for (r, _), s in sessions.items())
        )
        await asyncio.gather(
            *(
                user(r, streams[r][start : start + window][u :: profile.users], s)
                for (r, u), s in sessions.items()
            )
        )
    finally:
        await asyncio.gather(*(s.close() for s in sessions.values()))
    return out


@dataclass(frozen=True, slots=True)
class AgentRun:
    calls: list[float]  # seconds per call
    wall: float
    hits: int
    errors: int


async def agent_loop(session: aiohttp.ClientSession, url: str, model: str, task: str,
                     uid: str) -> AgentRun:  # fmt: skip
    messages: list[dict[str, str]] = [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": task},
    ]
    calls: list[float] = []
    hits = errors = 0
    t_loop = time.perf_counter()
    for i in range(AGENT_CALLS):
        body = {"model": model, "messages": messages, "temperature": 0}
        t0 = time.perf_counter()
        answer = ""
        try:
            async with session.post(url, json=body) as resp:
                data = await resp.json()
                hits += is_hit(resp.headers.get("x-ponto-cache", ""))
                if resp.status == 200:
                    answer = data["choices"][0]["message"]["content"]
                else:
                    errors += 1
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            errors += 1
        calls.append(time.perf_counter() - t0)
        # A tool observation no other loop shares: the next call cannot be a cache hit.
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Observation {i + 1}: tool run {uid}-{i} returned ok."},
        ]
    return AgentRun(calls, time.perf_counter() - t_loop, hits, errors)


async def run_agents(
    scenario: Scenario, tasks: dict[str, list[str]], profile: Profile, tag: str
) -> dict[str, list[AgentRun]]:
    out: dict[str, list[AgentRun]] = {r: [] for r in REGION_NAMES}

    async def one(r: str, a: int, session: aiohttp.ClientSession) -> None:
        url = scenario.urls[r] + "/chat/completions"
        uid = f"{tag}-{r}-{a}"
        out[r].append(await agent_loop(session, url, scenario.models[r], tasks[r][a], uid))

    sessions = {(r, a): _session(1) for r in REGION_NAMES for a in range(profile.agents)}
    try:
        await asyncio.gather(
            *(warm_connection(s, scenario.urls[r]) for (r, _), s in sessions.items())
        )
        await asyncio.gather(*(one(r, a, s) for (r, a), s in sessions.items()))
    finally:
        await asyncio.gather(*(s.close() for s in sessions.values()))
    return out


async def origins_reset(addresses: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.post(f"http://{address}/sim/reset") as resp:
                resp.raise_for_status()


async def origins_chat_requests(addresses: list[str]) -> int:
    total = 0
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.get(f"http://{address}/sim/stats") as resp:
                stats = await resp.json()
                total += int(stats["by_endpoint"].get(CHAT_PATH, 0))
    return total


# ----------------------------------------------------------------------------- figures


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); NaN for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def chat_figures(samples: dict[str, list[Sample]], origin_requests: int) -> dict[str, Any]:
    regions: dict[str, Any] = {}
    everyone: list[Sample] = []
    for r, group in samples.items():
        good = [s for s in group if s.ok]
        everyone += group
        regions[r] = {
            "requests": len(group),
            "errors": len(group) - len(good),
            "ttft_p50_ms": ms(pct([s.ttft for s in good], 0.5)),
            "ttft_p95_ms": ms(pct([s.ttft for s in good], 0.95)),
            "total_p50_ms": ms(pct([s.total for s in good], 0.5)),
            "total_p95_ms": ms(pct([s.total for s in good], 0.95)),
            "cache_hits": sum(is_hit(s.cache) for s in good),
            "cache_header": dict(Counter(s.cache for s in good if s.cache)),
            "served_from": dict(Counter(s.served_from for s in good if s.served_from)),
        }
    good = [s for s in everyone if s.ok]
    return {
        "regions": regions,
        "global": {
            "requests": len(everyone),
            "errors": len(everyone) - len(good),
            "ttft_p50_ms": ms(pct([s.ttft for s in good], 0.5)),
            "ttft_p95_ms": ms(pct([s.ttft for s in good], 0.95)),
            "total_p50_ms": ms(pct([s.total for s in good], 0.5)),
            "total_p95_ms": ms(pct([s.total for s in good], 0.95)),
            "cache_hits": sum(is_hit(s.cache) for s in good),
            "hit_rate": round(sum(is_hit(s.cache) for s in good) / max(1, len(good)), 4),
            "hit_ttft_p50_ms": ms(pct([s.ttft for s in good if is_hit(s.cache)], 0.5)),
            "miss_ttft_p50_ms": ms(pct([s.ttft for s in good if not is_hit(s.cache)], 0.5)),
        },
        "origin_requests": origin_requests,
        "origin_fraction": round(origin_requests / max(1, len(everyone)), 4),
    }


def agent_figures(runs: dict[str, list[AgentRun]], origin_requests: int) -> dict[str, Any]:
    regions: dict[str, Any] = {}
    calls_all: list[float] = []
    walls_all: list[float] = []
    n_calls = hits = 0
    for r, group in runs.items():
        calls = [c for run in group for c in run.calls]
        walls = [run.wall for run in group]
        calls_all += calls
        walls_all += walls
        n_calls += len(calls)
        hits += sum(run.hits for run in group)
        regions[r] = {
            "loops": len(group),
            "errors": sum(run.errors for run in group),
            "call_p50_ms": ms(pct(calls, 0.5)),
            "call_p95_ms": ms(pct(calls, 0.95)),
            "loop_p50_s": round(pct(walls, 0.5), 3),
            "cache_hits": sum(run.hits for run in group),
        }
    return {
        "regions": regions,
        "global": {
            "calls": n_calls,
            "call_p50_ms": ms(pct(calls_all, 0.5)),
            "call_p95_ms": ms(pct(calls_all, 0.95)),
            "loop_p50_s": round(pct(walls_all, 0.5), 3),
            "cache_hits": hits,
        },
        "origin_requests": origin_requests,
        "origin_fraction": round(origin_requests / max(1, n_calls), 4),
    }


# ----------------------------------------------------------------------------- the run


async def measure(world: World, profile: Profile, data: Path) -> dict[str, Any]:
    zipf = Zipf(load_texts(data), ZIPF_S, SEED)
    window = profile.users * profile.requests
    streams = {
        r: zipf.draw(random.Random(f"{SEED}-chat-{r}"), profile.warmup + window)
        for r in REGION_NAMES
    }
    tasks = {r: zipf.draw(random.Random(f"{SEED}-agent-{r}"), profile.agents) for r in REGION_NAMES}
    origins = world.origin_addresses()
    results: dict[str, Any] = {}
    for scenario in world.scenarios():
        t0 = time.monotonic()
        if scenario.cache_warmup:
            await warm_cache(scenario, streams, profile.warmup, profile.warmup_concurrency)
        await origins_reset(origins)
        chat = await run_chat(scenario, streams, profile.warmup, profile)
        chat_fig = chat_figures(chat, await origins_chat_requests(origins))
        await origins_reset(origins)
        agents = await run_agents(scenario, tasks, profile, f"{scenario.name}-{SEED}")
        agent_fig = agent_figures(agents, await origins_chat_requests(origins))
        results[scenario.name] = {
            "title": scenario.title,
            "chat": chat_fig,
            "agent": agent_fig,
            "seconds": round(time.monotonic() - t0, 1),
        }
        print(f"  {scenario.name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    workload: dict[str, Any] = {
        "chat_requests_per_region": window,
        "chat_users_per_region": profile.users,
        "warmup_requests_per_region": profile.warmup,
        "zipf_s": ZIPF_S,
        "texts": len(zipf.ranked),
        "exact_repeat_rate": {
            r: round(repeat_rate(s, profile.warmup), 4) for r, s in streams.items()
        },
        "normalised_repeat_rate": {
            r: round(repeat_rate(s, profile.warmup, normalise), 4) for r, s in streams.items()
        },
        "agent_loops_per_region": profile.agents,
        "agent_calls_per_loop": AGENT_CALLS,
    }
    for kind in ("exact", "normalised"):
        rates = list(workload[f"{kind}_repeat_rate"].values())
        workload[f"{kind}_repeat_rate_mean"] = round(statistics.fmean(rates), 4)
    return {"scenarios": results, "workload": workload}


def comparison(scenarios: dict[str, Any]) -> dict[str, Any]:
    base = scenarios["centralised"]
    out: dict[str, Any] = {}
    for name in ("ponto", "ponto-1-origin"):
        s = scenarios[name]
        b50, p50 = base["chat"]["global"]["ttft_p50_ms"], s["chat"]["global"]["ttft_p50_ms"]
        b_or, p_or = base["chat"]["origin_requests"], s["chat"]["origin_requests"]
        bl, pl = base["agent"]["global"]["loop_p50_s"], s["agent"]["global"]["loop_p50_s"]
        out[name] = {
            "chat_global_ttft_p50_ms": {
                "centralised": b50,
                name: p50,
                "ratio": round(p50 / b50, 3),
                "reduction": round(1 - p50 / b50, 3),
            },
            "chat_origin_load_reduction": round(1 - p_or / max(1, b_or), 3),
            "agent_loop_p50_s": {"centralised": bl, name: pl, "ratio": round(pl / bl, 3)},
        }
    return out


def _cell(a: float, b: float) -> str:
    return f"{a:6.0f} /{b:5.0f}"


def print_report(doc: dict[str, Any]) -> None:
    sc = doc["scenarios"]
    names = list(sc)
    wl = doc["workload"]
    print()
    print(f"Geography ({doc['profile']} profile, {doc['seconds']:.0f} s): 5 user regions; "
          f"GPUs in {CENTRAL} (centralised) or {', '.join(ORIGIN_REGIONS)} (ponto)")  # fmt: skip
    print(f"RTT source: {doc['source']}")
    load = doc["load_average"]
    print(f"Machine: {os.cpu_count()} CPUs, load average {load['start']:.1f} at start, "
          f"{load['end']:.1f} at end (other work on the machine inflates tails)")  # fmt: skip
    print(f"Assumed: user to nearest edge {ACCESS_RTT_MS:.0f} ms RTT, same region "
          f"{INTRA_REGION_RTT_MS:.0f} ms, 1 RTT handshake per new (kept-alive) connection; "
          f"origin TTFT {TTFT_MS} ms then {TOKENS_PER_S} tokens/s")  # fmt: skip
    print(f"Chat workload: {wl['chat_requests_per_region']} streamed requests/region "
          f"({ANSWER_TOKENS}-token answers, temperature 0) from {wl['texts']} CLINC150+banking77 "
          f"queries, Zipf s={ZIPF_S}, after {wl['warmup_requests_per_region']} warm-up requests; "
          f"repeats in the measured window {wl['exact_repeat_rate_mean']:.0%} exact, "
          f"{wl['normalised_repeat_rate_mean']:.0%} after normalising")  # fmt: skip
    print()
    print("Single-shot chat: time to first token at the user, ms, p50 / p95")
    header = f"{'user region':<14}{'RTT to ' + CENTRAL:>15}" + "".join(f"{n:>18}" for n in names)
    print(header + f"{'hits (ponto)':>14}")
    for r in REGION_NAMES:
        row = f"{r:<14}{rtt.user_rtt_ms(r, CENTRAL):>12.0f} ms"
        for n in names:
            g = sc[n]["chat"]["regions"][r]
            row += f"{_cell(g['ttft_p50_ms'], g['ttft_p95_ms']):>18}"
        g = sc["ponto"]["chat"]["regions"][r]
        row += f"{g['cache_hits']:>8}/{g['requests'] - g['errors']}"
        print(row)
    row = f"{'global':<14}{'':>15}"
    for n in names:
        g = sc[n]["chat"]["global"]
        row += f"{_cell(g['ttft_p50_ms'], g['ttft_p95_ms']):>18}"
    g = sc["ponto"]["chat"]["global"]
    print(row + f"{g['cache_hits']:>8}/{g['requests'] - g['errors']}")
    row = f"{'whole answer p50':<29}"
    for n in names:
        row += f"{sc[n]['chat']['global']['total_p50_ms']:>15.0f} ms"
    print(row)
    row = f"{'reached an origin':<29}"
    for n in names:
        row += f"{sc[n]['chat']['origin_fraction']:>18.0%}"
    print(row)
    row = f"{'TTFT p50 hit / miss':<29}"
    for n in names:
        g = sc[n]["chat"]["global"]
        hit = "-" if math.isnan(g["hit_ttft_p50_ms"]) else f"{g['hit_ttft_p50_ms']:.0f}"
        row += f"{hit + ' / ' + format(g['miss_ttft_p50_ms'], '.0f'):>18}"
    print(row)
    errors = sum(sc[n]["chat"]["global"]["errors"] for n in names)
    if errors:
        print(f"  ({errors} failed requests left out of the percentiles)")
    print()
    print(f"Agent loop, {AGENT_CALLS} sequential calls: loop time p50 (s); per call p50 (ms)")
    print(f"{'user region':<14}{'':>15}" + "".join(f"{n:>18}" for n in names))
    for r in [*REGION_NAMES, "global"]:
        row = f"{r:<29}"
        for n in names:
            a = sc[n]["agent"]["global" if r == "global" else "regions"]
            g = a if r == "global" else a[r]
            row += f"{g['loop_p50_s']:>9.2f} s {g['call_p50_ms']:>4.0f}ms"
        print(row)
    row = f"{'reached an origin':<29}"
    for n in names:
        row += f"{sc[n]['agent']['origin_fraction']:>18.0%}"
    print(row)
    print()
    cmp = doc["comparison"]["ponto"]
    t = cmp["chat_global_ttft_p50_ms"]
    claim = doc["claims"]
    print(f"Claim: global p50 {claim['global_p50_ms']['centralised']} ms -> "
          f"{claim['global_p50_ms']['ponto']} ms (-{claim['global_p50_ms']['reduction']:.0%}); "
          f"origin load -{claim['origin_load_reduction']['low']:.0%}.."
          f"{claim['origin_load_reduction']['high']:.0%}")  # fmt: skip
    print(f"Here:  global p50 TTFT {t['centralised']:.0f} ms -> {t['ponto']:.0f} ms "
          f"({-t['reduction']:+.0%}, ratio {t['ratio']:.2f}); origin load "
          f"{-cmp['chat_origin_load_reduction']:+.0%} on chat; agent loop p50 "
          f"x{cmp['agent_loop_p50_s']['ratio']:.2f}")  # fmt: skip
    one = doc["comparison"]["ponto-1-origin"]
    t1 = one["chat_global_ttft_p50_ms"]
    print(f"       edge and cache alone (ponto-1-origin): {t1['centralised']:.0f} ms -> "
          f"{t1['ponto-1-origin']:.0f} ms ({-t1['reduction']:+.0%}); origin load "
          f"{-one['chat_origin_load_reduction']:+.0%}; agent loop "
          f"x{one['agent_loop_p50_s']['ratio']:.2f}")  # fmt: skip


def _no_nan(value: Any) -> Any:
    """NaN (a percentile of nothing) as null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="a smaller run, for a smoke check")
    p.add_argument(
        "--out",
        type=Path,
        help=f"where to write the JSON results (default {OUT.relative_to(REPO)}; "
        "a --quick run writes none unless asked)",
    )
    p.add_argument("--data", type=Path, default=DATA, help="the semcache data directory")
    args = p.parse_args(argv)
    if not (args.data / "clinc150_train_val.json").is_file():
        p.error(f"no semcache data in {args.data} (see ../shared/data/semcache/README.md)")
    profile = QUICK if args.quick else FULL
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ponto-geo-") as tmp:
        world = World(Fleet(Path(tmp)))
        try:
            print("starting the world (etcd, control plane, 3 origins, 5 proxies, relays)",
                  flush=True)  # fmt: skip
            world.start()
            print(f"  up in {time.monotonic() - started:.0f} s", flush=True)
            measured = uvloop.run(measure(world, profile, args.data))
        finally:
            world.stop()
    doc: dict[str, Any] = {
        "source": rtt.SOURCE,
        "claims": CLAIMS,
        "scenarios": measured["scenarios"],
        "comparison": comparison(measured["scenarios"]),
        "workload": measured["workload"],
        "profile": profile.name,
        "seconds": round(time.monotonic() - started, 1),
        "load_average": {"start": load_start, "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "world": {
            "regions": {
                r.name: {
                    "azure": r.azure,
                    "city": r.city,
                    "latitude": r.latitude,
                    "longitude": r.longitude,
                }
                for r in REGIONS
            },
            "origin_regions": {
                "centralised": [CENTRAL],
                "ponto": list(ORIGIN_REGIONS),
                "ponto-1-origin": [CENTRAL],
            },
            "rtt_ms": rtt.matrix(),
            "rtt_source_date": rtt.SOURCE_DATE,
            "access_rtt_ms": ACCESS_RTT_MS,
            "intra_region_rtt_ms": INTRA_REGION_RTT_MS,
            "handshake_rtts": 1,
            "origin": {
                "ttft_ms": TTFT_MS,
                "tokens_per_s": TOKENS_PER_S,
                "answer_tokens": ANSWER_TOKENS,
            },
            "latency_metric": "time to first token at the user (first SSE data event)",
        },
    }
    print_report(doc)
    out: Path | None = args.out or (None if args.quick else OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_no_nan(doc), indent=2, allow_nan=False)
        out.write_text(text + "\n", encoding="utf-8")
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
