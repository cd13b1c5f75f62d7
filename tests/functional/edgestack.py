"""The proxy's app on its production listener, for the functional tests that
need the real edge (EdgeRunner, handler cancellation on) rather than
aiohttp's test server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from dataplane.http.edge import EdgeLimits, EdgeRunner
from dataplane.http.server import build_app
from dataplane.http.state import HOLDER, QUOTA
from dataplane.settings import parse as parse_proxy
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import table


async def listen(
    app: web.Application, limits: EdgeLimits | None = None
) -> tuple[EdgeRunner, web.TCPSite, int]:
    """`app` on EdgeRunner, with `limits` (default: the defaults), on a free
    loopback port: its runner (the caller cleans it up), its site and the port."""
    runner = EdgeRunner(app, limits or EdgeLimits(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@dataclass
class Served:
    app: web.Application
    runner: EdgeRunner
    port: int


async def serve_on_edge(
    tmp_path: Path, origin_url: str, *flags: str, shutdown_timeout: float = 60.0
) -> Served:
    """The proxy's app with `flags` on EdgeRunner, on a free loopback port,
    with a table of one origin "o1" at `origin_url` (its /v1 base) applied
    and the whole rate-limit share (no control plane: 127.0.0.1:9 never
    answers); its cleanup waits `shutdown_timeout` for running requests
    (aiohttp's default, as the proxy's). The caller cleans up the runner."""
    settings = parse_proxy(
        [
            "--region=r1",
            "--name=edge",
            "--control-plane=127.0.0.1:9",
            f"--state-dir={tmp_path}",
            *flags,
        ]
    )
    app = build_app(settings)
    runner = EdgeRunner(
        app,
        settings.edge,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app[HOLDER].apply(table([("o1", origin_url)], version=1, limited=False), "control-plane")
    app[QUOTA].on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    return Served(app, runner, site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
