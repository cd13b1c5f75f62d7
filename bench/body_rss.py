"""What a request's body costs a proxy worker while the request is under way.

    .venv/bin/python -m bench.body_rss [--mode whole|stream] [--requests 30] [--mb 7.5]

Starts an origin simulator that waits 6 s before its first token (so every
request is under way at once) and one proxy worker (`--workers 1`) serving the
route table from its state directory (no control plane), then sends
`--requests` concurrent chat requests, each of a distinct body of `--mb` MB
(one base64 image, as an app that sends pictures does), and samples the
worker's RSS every 50 ms. Prints its RSS before, at the peak and after, and
the rise per request as a multiple of the body: what docs/architecture.md,
"Memory" ("Requests under way") quotes. Bounded: one run, the processes
stopped and the directory removed at the end. Timings play no part.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

MODEL = "sim-small"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def state_dir(origin_port: int) -> Path:
    """A proxy state directory holding a route table (one origin, an open
    fleet: tenant `default`, exact cache on) and quota shares."""
    d = Path(tempfile.mkdtemp(prefix="ponto-body-rss-"))
    t = pb.RouteTable(
        version=1,
        regions=[pb.Region(name="r1")],
        origins=[
            pb.Origin(
                name="o1",
                base_url=f"http://127.0.0.1:{origin_port}/v1",
                region="r1",
                models=[MODEL],
                weight=100,
                healthy=True,
            )
        ],
        auth_required=False,
        response_id_keys=[b"k" * 32],
    )
    t.etag = content_etag(t)
    (d / "route_table.pb").write_bytes(t.SerializeToString())
    shares = pb.QuotaShares(generation=1, default_fraction=1.0)
    (d / "quota_shares.pb").write_bytes(shares.SerializeToString())
    return d


def body(i: int, size_mb: float, stream: bool) -> bytes:
    image = base64.b64encode(os.urandom(int(size_mb * 1e6 * 3 / 4))).decode()
    content = [
        {"type": "text", "text": f"what is in picture {i}?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
    ]
    request = {
        "model": MODEL,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    }
    return json.dumps(request).encode()


async def ready(s: aiohttp.ClientSession, url: str) -> None:
    """Once the proxy at `url` says it is ready (RuntimeError after 30 s)."""
    for _ in range(150):
        try:
            async with s.get(f"{url}/readyz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the proxy did not become ready")


async def measure(proxy: subprocess.Popen[bytes], url: str, args: argparse.Namespace) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await ready(s, url)
        small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(f"{url}/v1/chat/completions", json=small) as r:
            await r.read()
        await asyncio.sleep(1)
        base = peak = rss_mb(proxy.pid)
        bodies = [body(i, args.mb, args.mode == "stream") for i in range(args.requests)]
        done = False

        async def sample() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, rss_mb(proxy.pid))
                await asyncio.sleep(0.05)

        async def one(raw: bytes) -> int:
            headers = {"content-type": "application/json"}
            async with s.post(f"{url}/v1/chat/completions", data=raw, headers=headers) as r:
                await r.read()
                return r.status

        sampler = asyncio.create_task(sample())
        statuses = await asyncio.gather(*(one(b) for b in bodies))
        done = True
        await sampler
        after = rss_mb(proxy.pid)
    size = len(bodies[0]) / 1e6
    rise = (peak - base) * 2**20 / 1e6 / args.requests
    return (
        f"{args.mode}: {args.requests} requests of {size:.2f} MB, "
        f"statuses {sorted(set(statuses))}; "
        f"RSS {base:.0f} MB before, {peak:.0f} MB at the peak, {after:.0f} MB after: "
        f"{rise:.1f} MB a request, {rise / size:.2f} x the body"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mode", choices=("whole", "stream"), default="whole")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--mb", type=float, default=7.5, help="each body's size (default 7.5)")
    args = p.parse_args()
    origin_port, proxy_port = free_port(), free_port()
    d = state_dir(origin_port)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    quiet = subprocess.DEVNULL
    origin = subprocess.Popen(
        [
            *(sys.executable, "-m", "ponto.originsim", f"--listen=127.0.0.1:{origin_port}"),
            *("--ttft-ms=6000", "--answer-tokens=8"),
        ],
        env=env,
        stdout=quiet,
        stderr=quiet,
    )
    proxy = subprocess.Popen(
        [
            *(sys.executable, "-m", "dataplane", "--workers=1", "--control-plane=127.0.0.1:9"),
            *(f"--state-dir={d}", f"--listen=127.0.0.1:{proxy_port}", "--region=r1"),
            *("--name=body-rss", "--log-level=ERROR", "--connect-timeout=30"),
        ],
        env=env,
        stdout=quiet,
        stderr=quiet,
    )
    try:
        print(asyncio.run(measure(proxy, f"http://127.0.0.1:{proxy_port}", args)))
    finally:
        for process in (proxy, origin):
            process.terminate()
            process.wait(20)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
