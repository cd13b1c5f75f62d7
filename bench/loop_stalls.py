"""How long one big request holds a proxy's event loop from everyone else's.

    .venv/bin/python -m bench.loop_stalls [--rounds 4] [--scenarios tools,chat,embeddings]
    .venv/bin/python -m bench.loop_stalls --steps

Starts an origin simulator and one proxy worker (`--workers 1`, the exact
cache on: bench.body_rss's state directory) and sends it, one at a time,
`--rounds` big requests of each scenario while small requests probe it every
20 ms (a chat request the cache answers, so the proxy alone answers it). A
probe answered late was waiting for the loop, which the big request's steps
held: the probes' added latency (over their median with no big request
under way) is printed per scenario, p50 / p99 / max. The big requests are
sent by `curl` from files, so no work of this process's own delays a probe.

Scenarios, each within the proxy's default limits (8 MiB bodies, 64 MiB
answers):

- tools: a chat request offering 10,000 tools (5.4 MB), the parse and
  validation walks (too many values to key);
- chat: a chat conversation of 20,000 turns (7.9 MB), keyed: the cache
  key's walk over every message;
- embeddings: 100,000 inputs, whose 15 MB answer is parsed, counted and
  kept after it is sent.

`--watch FILE` runs the proxy under bench.stallwatch, which writes each of
its loop's stalls over 20 ms, with the stacks that held it, to FILE (then
`python -m bench.stallwatch --summary FILE`). `--steps` times each pure
step on those bodies in this process, one call each (the best of three).
Bounded: one run, the processes stopped and the directory removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.body_rss import free_port, ready, state_dir
from dataplane import jsonio

MODEL = "sim-small"
PROBE_EVERY_S = 0.02


def tools_body(n: int = 10_000) -> dict[str, Any]:
    """A chat request offering `n` tools of a small schema each."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city, e.g. Paris or São Paulo"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city"],
    }
    about = "Look up the weather in a city and return it as a short summary. " * 3
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": about, "parameters": schema},
        }
        for i in range(n)
    ]
    return {
        "model": MODEL,
        "temperature": 0,
        "messages": [{"role": "user", "content": "what is the weather?"}],
        "tools": tools,
    }


def chat_body(n: int = 20_000, salt: str = "") -> dict[str, Any]:
    """A chat conversation of `n` turns of some 400 bytes each."""
    turn = "Tell me more about the history of the city and its people. " * 6
    messages = [
        {"role": "assistant" if i % 2 else "user", "content": f"{salt}turn {i}: {turn}"}
        for i in range(n)
    ]
    return {"model": MODEL, "temperature": 0, "messages": messages}


def embeddings_body(n: int = 100_000, salt: str = "") -> dict[str, Any]:
    """An embeddings request of `n` short inputs."""
    return {"model": MODEL, "input": [f"{salt}sentence {i} about things" for i in range(n)]}


SCENARIOS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "tools": ("chat/completions", lambda salt: {**tools_body(), "user": salt}),
    "chat": ("chat/completions", lambda salt: chat_body(salt=salt)),
    "embeddings": ("embeddings", lambda salt: embeddings_body(salt=salt)),
}


def summary(added_ms: list[float]) -> str:
    if not added_ms:
        return "no probes"
    ordered = sorted(added_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{len(ordered)} probes, added p50 {statistics.median(ordered):6.1f} ms, "
        f"p99 {p99:6.1f} ms, max {ordered[-1]:6.1f} ms"
    )


async def probes(session: aiohttp.ClientSession, url: str, until: asyncio.Event) -> list[float]:
    """Latencies (ms) of small cached chat requests sent every PROBE_EVERY_S
    until `until` is set, each on its own task (open loop)."""
    small = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}

    async def one() -> float:
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=small) as r:
            await r.read()
            assert r.status == 200, r.status
        return (time.perf_counter() - started) * 1000

    tasks = []
    while not until.is_set():
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(PROBE_EVERY_S)
    return list(await asyncio.gather(*tasks))


async def big(url: str, path: str, files: list[Path]) -> list[str]:
    """Send each file as a request's body, one at a time (curl); their statuses."""
    statuses = []
    for f in files:
        curl = await asyncio.create_subprocess_exec(
            *("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"),
            *("-H", "content-type: application/json", "--data-binary", f"@{f}"),
            f"{url}/v1/{path}",
            stdout=subprocess.PIPE,
        )
        out, _ = await curl.communicate()
        statuses.append(out.decode())
    return statuses


async def measure(url: str, args: argparse.Namespace, work: Path) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        await ready(s, url)
        done = asyncio.Event()
        waiting = asyncio.create_task(probes(s, url, done))
        await asyncio.sleep(3)
        done.set()
        base = statistics.median(await waiting)
        print(f"probes alone: median {base:.1f} ms")
        for name in args.scenarios.split(","):
            path, make = SCENARIOS[name]
            files = []
            for i in range(args.rounds):
                f = work / f"{name}-{i}.json"
                f.write_bytes(jsonio.dumps(make(f"{time.time_ns()}-{i} ")))
                files.append(f)
            done = asyncio.Event()
            waiting = asyncio.create_task(probes(s, url, done))
            statuses = await big(url, path, files)
            await asyncio.sleep(0.5)
            done.set()
            added = [ms - base for ms in await waiting]
            size = files[0].stat().st_size / 1e6
            print(f"{name:10s} ({size:.1f} MB, statuses {sorted(set(statuses))}): {summary(added)}")


def steps() -> None:
    """Each pure step's time on the scenarios' bodies, here, best of three."""
    for name, (path, make) in SCENARIOS.items():
        raw = jsonio.dumps(make(""))
        print(f"{name} ({len(raw) / 1e6:.1f} MB):")
        for step, took in step_times(path.replace("/", "."), raw):
            print(f"  {step:20s} {took:7.1f} ms")


def step_times(endpoint: str, raw: bytes) -> list[tuple[str, float]]:
    """(step, its best time of three in ms) of a request to `endpoint` of body `raw`."""
    from dataplane.cache.keys import cache_key, context_hash, costly_to_normalise  # noqa: PLC0415
    from dataplane.http.fields import too_many_values  # noqa: PLC0415
    from dataplane.http.pipeline import ENDPOINTS, parse_json, validate  # noqa: PLC0415
    from dataplane.ratelimit.tokens import estimate_prompt_tokens  # noqa: PLC0415

    body = parse_json(raw)
    rows: dict[str, Callable[[], object]] = {
        "orjson.loads": lambda: jsonio.loads(raw),
        "parse_json": lambda: parse_json(raw),
        "validate": lambda: validate(ENDPOINTS[endpoint], body),
        "too_many_values": lambda: too_many_values(raw),
        "costly_to_normalise": lambda: costly_to_normalise(body),
        "estimate": lambda: estimate_prompt_tokens(endpoint, body),
        "cache_key": lambda: cache_key(endpoint, body, tenant="t", model=MODEL),
    }
    if "messages" in body:
        rows["context_hash"] = lambda: context_hash(body["messages"])
    times = []
    for step, call in rows.items():
        took = []
        for _ in range(3):
            started = time.perf_counter()
            call()
            took.append(time.perf_counter() - started)
        times.append((step, min(took) * 1000))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=4, help="big requests of each scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--steps", action="store_true", help="time each step here instead")
    p.add_argument("--watch", metavar="FILE", help="the proxy's stalls to FILE (see above)")
    p.add_argument("--port-base", type=int, default=0, help="the origin's; the proxy's next")
    args = p.parse_args()
    if args.steps:
        steps()
        return
    origin_port, proxy_port = (
        (args.port_base, args.port_base + 1) if args.port_base else (free_port(), free_port())
    )
    d = state_dir(origin_port)
    work = Path(tempfile.mkdtemp(prefix="ponto-loop-stalls-"))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    quiet = subprocess.DEVNULL
    origin = subprocess.Popen(
        [sys.executable, "-m", "ponto.originsim", f"--listen=127.0.0.1:{origin_port}"],
        env=env,
        stdout=quiet,
        stderr=quiet,
    )
    run: tuple[str, ...] = ("-m", "dataplane")
    if args.watch:
        env["STALL_OUT"] = args.watch
        run = ("-m", "bench.stallwatch", "--proxy")
    proxy = subprocess.Popen(
        [
            *(sys.executable, *run, "--workers=1", "--control-plane=127.0.0.1:9"),
            *(f"--state-dir={d}", f"--listen=127.0.0.1:{proxy_port}", "--region=r1"),
            *("--name=loop-stalls", "--log-level=ERROR"),
        ],
        env=env,
        stdout=quiet,
        stderr=quiet,
    )
    try:
        asyncio.run(measure(f"http://127.0.0.1:{proxy_port}", args, work))
    finally:
        for process in (proxy, origin):
            process.terminate()
            process.wait(20)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
