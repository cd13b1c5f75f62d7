"""The bare pass-through: the least an aiohttp reverse proxy can do, as a floor for Ponto.

    .venv/bin/python -m bench.passthrough --listen 127.0.0.1:0 --origin http://127.0.0.1:9000 \
        [--ready-file PATH]

A request ``POST /any/path?query`` goes to ``ORIGIN/any/path?query`` (the
origin URL's own path, if any, is a prefix) with its body and its
Content-Type, and nothing else. The answer comes back with the origin's status
and Content-Type: an SSE answer (``text/event-stream``) chunk by chunk as the
origin sends it (``readany`` then ``write``, so backpressure reaches the
origin), any other answer read whole and sent with a Content-Length.

Why it is the floor for Ponto's proxy: it runs the same stack the same way
(aiohttp server and client, uvloop, one ``ClientSession`` on a keep-alive
connector sized like Ponto's, ``handler_cancellation=True``, ``access_log=None``,
one process) and does nothing else: no JSON parsing, no routing table, no
auth, limits, cache, metrics, logging or request ids, and no retries (an
origin that cannot be reached gets a 502). Whatever Ponto costs above it is
Ponto's own work; what it costs above the origin direct is the price of a
Python hop that any proxy on this stack pays.

With ``--ready-file`` the bound ``HOST:PORT`` is written there (atomically)
once it listens, as ponto-proxy does, so that callers can bind port 0.
SIGTERM or SIGINT stops it.
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
SSE: Final = "text/event-stream"


async def forward(request: web.Request) -> web.StreamResponse:
    """Relay one request to the origin and its answer back (see the module docstring)."""
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream")}
    url = request.app[ORIGIN] + request.path_qs
    try:
        async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
            if upstream.content_type == SSE:
                return await _relay_stream(request, upstream)
            data = await upstream.read()
            return web.Response(
                status=upstream.status,
                body=data,
                headers={"Content-Type": upstream.headers.get("Content-Type", "")},
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Before the answer started only: after that, the client sees a cut stream.
        return web.Response(status=502, text=f"origin unreachable: {exc}\n")


async def _relay_stream(
    request: web.Request, upstream: aiohttp.ClientResponse
) -> web.StreamResponse:
    out = web.StreamResponse(status=upstream.status, headers={"Content-Type": SSE})
    await out.prepare(request)
    try:
        while chunk := await upstream.content.readany():
            await out.write(chunk)  # waits for the client's socket: backpressure
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left; leaving the `async with` closes the origin connection
    except (aiohttp.ClientError, TimeoutError):
        # The origin cut the stream: cut the client's too (aiohttp would otherwise
        # end the chunked body cleanly and hide the cut).
        if request.transport is not None:
            request.transport.close()
    return out


async def _session(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: the one client session, with Ponto's connector settings.

    No total timeout (aiohttp's default arms a 5-minute timer per request) and no
    read timeout (it re-arms a timer per chunk): the floor does no timer work. A
    client that gives up cancels its handler (handler_cancellation), and with it
    the origin request.
    """
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=1024, ttl_dns_cache=60, keepalive_timeout=30
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
    app[SESSION] = aiohttp.ClientSession(connector=connector, timeout=timeout)
    yield
    await app[SESSION].close()


def build_app(origin: str) -> web.Application:
    """An app that forwards every POST to `origin` (a URL without a trailing slash)."""
    app = web.Application()
    app[ORIGIN] = origin.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_post("/{tail:.*}", forward)
    return app


async def serve(host: str, port: int, origin: str, ready_file: Path | None) -> None:
    """Serve until SIGTERM or SIGINT; write the bound address to `ready_file` once listening."""
    runner = web.AppRunner(build_app(origin), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0]
    if ready_file is not None:
        tmp = ready_file.with_name(f".{ready_file.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{host}:{bound[1]}")
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
        prog="bench.passthrough", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--listen", type=listen_address, default=("127.0.0.1", 0), metavar="HOST:PORT")
    p.add_argument("--origin", required=True, help="origin base URL, e.g. http://127.0.0.1:9000")
    p.add_argument("--ready-file", type=Path, help="write the bound HOST:PORT here when serving")
    a = p.parse_args(argv)
    if not a.origin.startswith(("http://", "https://")):
        p.error(f"--origin must be an http:// or https:// URL, got {a.origin!r}")
    host, port = a.listen
    uvloop.run(serve(host, port, a.origin, a.ready_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
