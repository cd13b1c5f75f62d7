"""A link to one origin that breaks streams on command: the cut of bench/resilience.py.

    .venv/bin/python -m bench.cutlink --listen 127.0.0.1:0 --origin http://127.0.0.1:9000 \
        [--header x-bench-cut-after] [--ready-file PATH]

A request ``METHOD /any/path`` goes to ``ORIGIN/any/path`` with its body and
Content-Type, as bench/passthrough.py does (the control plane's health probes
and load scrapes pass through too). When it carries ``HEADER: K`` and
the answer is a stream (``text/event-stream``), the link relays the first K
whole SSE events and then closes the connection to its client, without the
rest and without ``[DONE]``: to the proxy that called it, the origin died after
K events. Any other answer is relayed untouched.

Why not the simulator's own ``x-sim-cut-after``: the proxy sends a
continuation with the same forwarded headers, so the origin that continues
would be cut again. Here the cut belongs to the link in front of one origin
(the origin's own answer is never changed); the origin that continues is
reached directly and never sees a cut it would obey.

Whole events only: the proxy holds back a half event at a cut anyway
(docs/streams.md), so cutting inside one would test the same thing. SIGTERM or
SIGINT stops the link.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import aiohttp
import uvloop
from aiohttp import web

from ponto.cliargs import listen_address

SESSION: Final = web.AppKey("session", aiohttp.ClientSession)
ORIGIN: Final = web.AppKey("origin", str)
HEADER: Final = web.AppKey("header", str)
SSE: Final = "text/event-stream"
DEFAULT_HEADER: Final = "x-bench-cut-after"


async def forward(request: web.Request) -> web.StreamResponse:
    """Relay one request; cut its stream after the events its header asks for."""
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream")}
    raw = request.headers.get(request.app[HEADER], "")
    cut = int(raw) if raw.isdigit() else None
    try:
        async with request.app[SESSION].request(
            request.method, request.app[ORIGIN] + request.path_qs, data=body, headers=headers
        ) as upstream:
            if upstream.content_type != SSE:
                return web.Response(
                    status=upstream.status,
                    body=await upstream.read(),
                    headers={"Content-Type": upstream.headers.get("Content-Type", "")},
                )
            out = web.StreamResponse(status=upstream.status, headers={"Content-Type": SSE})
            await out.prepare(request)
            try:
                await _relay(upstream, out, cut)
            except ConnectionResetError:
                return out  # the client left; leaving `async with` closes the origin's
            if cut is not None and request.transport is not None:
                # close() rather than abort(): the events written still reach
                # the client, then the FIN, as when an origin process dies.
                request.transport.close()
            else:
                await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError) as exc:
        return web.Response(status=502, text=f"origin unreachable: {exc}\n")


async def _relay(
    upstream: aiohttp.ClientResponse, out: web.StreamResponse, cut: int | None
) -> None:
    """Write whole events until the origin ends or `cut` events were written."""
    pending = b""
    sent = 0
    while chunk := await upstream.content.readany():
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if cut is not None and sent >= cut:
                return
            await out.write(event + b"\n\n")
            sent += 1
        if cut is not None and sent >= cut:
            return
    if pending:
        await out.write(pending)


async def _session(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=1024, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
    app[SESSION] = aiohttp.ClientSession(connector=connector, timeout=timeout)
    yield
    await app[SESSION].close()


def build_app(origin: str, header: str = DEFAULT_HEADER) -> web.Application:
    app = web.Application()
    app[ORIGIN] = origin.rstrip("/")
    app[HEADER] = header.lower()
    app.cleanup_ctx.append(_session)
    app.router.add_route("*", "/{tail:.*}", forward)  # GET too: health probes, /metrics
    return app


async def serve(host: str, port: int, app: web.Application, ready_file: Path | None) -> None:
    """Serve until SIGTERM or SIGINT; write the bound address to `ready_file` once listening."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    if ready_file is not None:
        tmp = ready_file.with_name(f".{ready_file.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{host}:{runner.addresses[0][1]}")
        tmp.replace(ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench.cutlink", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--listen", type=listen_address, default=("127.0.0.1", 0), metavar="HOST:PORT")
    p.add_argument("--origin", required=True, help="origin base URL, e.g. http://127.0.0.1:9000")
    p.add_argument("--header", default=DEFAULT_HEADER, help="request header naming the cut")
    p.add_argument("--ready-file", type=Path, help="write the bound HOST:PORT here when serving")
    a = p.parse_args(argv)
    host, port = a.listen
    uvloop.run(serve(host, port, build_app(a.origin, a.header), a.ready_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
