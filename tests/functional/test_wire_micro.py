"""bench.wire_micro's three clients make the calls it times: each gets the
origin's 200 over kept-alive connections (so a round measures calls, not
failures or reconnects)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from bench import wire_micro


@pytest.mark.parametrize("kind", wire_micro.KINDS)
async def test_each_client_calls_the_origin_over_kept_alive_connections(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bytes] = []
    peers: set[object] = set()

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.read())
        peers.add(request.transport)
        return web.json_response({"object": "chat.completion"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    monkeypatch.setattr(wire_micro, "WARMUP", 2)
    try:
        url = URL(str(server.make_url("/v1/chat/completions")))
        us_per_call = await wire_micro._round(kind, url, calls=8 * wire_micro.CONCURRENCY)
    finally:
        await server.close()
    assert us_per_call > 0
    assert seen == [wire_micro.BODY] * (10 * wire_micro.CONCURRENCY)
    assert len(peers) <= wire_micro.CONCURRENCY  # one connection per loop at most
