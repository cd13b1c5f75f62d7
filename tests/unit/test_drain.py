"""A proxy told to stop drains: every answer, streams included, closes its connection.

With `--drain-seconds`, answers after SIGTERM carry `Connection: close`, so a
client pool opens its next request on another pod instead of racing the close
of a kept-alive connection (chart-run's upgrade found that race).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dataplane.http.boundary import error_boundary, send_whole
from dataplane.http.requestid import RequestIds
from dataplane.http.state import DRAINING, METRICS, REQUEST_IDS, Draining
from dataplane.metrics import Metrics
from dataplane.settings import parse


async def plain(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def app() -> web.Application:
    m, draining, ids = Metrics(), Draining(), RequestIds()
    a = web.Application(middlewares=[error_boundary(m, draining, ids)])
    a[METRICS] = m
    a[DRAINING] = draining
    a[REQUEST_IDS] = ids
    a.router.add_get("/plain", plain, name="plain")
    a.router.add_get("/stream", stream, name="stream")
    return a


async def test_answers_keep_alive_until_draining_then_close() -> None:
    application = app()
    async with TestClient(TestServer(application)) as client:
        for path in ("/plain", "/stream"):
            resp = await client.get(path)
            assert resp.status == 200
            assert resp.headers.get("connection", "").lower() != "close"
            await resp.read()
        application[DRAINING].active = True
        for path in ("/plain", "/stream", "/missing"):
            resp = await client.get(path)
            assert resp.headers.get("connection", "").lower() == "close", path
            await resp.read()


@pytest.mark.parametrize("sent", [False, True], ids=["returned", "sent-by-its-handler"])
async def test_a_request_under_way_when_draining_begins_closes_its_connection_too(
    sent: bool,
) -> None:
    application = app()
    begun = asyncio.Event()
    go = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        begun.set()
        await go.wait()
        response = web.json_response({"ok": True})
        if sent:  # as the pipeline does (boundary.send_whole)
            await send_whole(request, response)
        return response

    application.router.add_get("/slow", slow, name="slow")
    async with TestClient(TestServer(application)) as client:
        pending = asyncio.ensure_future(client.get("/slow"))
        await begun.wait()
        application[DRAINING].active = True  # SIGTERM while it runs
        go.set()
        resp = await pending
        assert resp.status == 200
        assert resp.headers.get("connection", "").lower() == "close"
        await resp.read()


def test_drain_seconds_is_a_flag_with_a_clear_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--control-plane", "127.0.0.1:7000", "--region", "us-east"]
    assert parse([*base, "--drain-seconds", "5"]).drain_seconds == 5.0
    assert parse(base).drain_seconds == 0.0
    with pytest.raises(SystemExit) as exc:
        parse([*base, "--drain-seconds", "-1"])
    assert exc.value.code == 2
    assert "--drain-seconds must be 0 (no draining) or more" in capsys.readouterr().err


def test_a_control_plane_without_its_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Trial 17: `--control-plane 127.0.0.1` asked port 443."""
    with pytest.raises(SystemExit) as exc:
        parse(["--control-plane", "127.0.0.1", "--region", "us-east"])
    assert exc.value.code == 2
    assert "--control-plane: '127.0.0.1' is not HOST:PORT" in capsys.readouterr().err


def test_a_listen_address_without_its_port_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Trial 18: "error: expected HOST:PORT, got '127.0.0.1'", no flag named."""
    with pytest.raises(SystemExit):
        parse(["--control-plane", "127.0.0.1:7000", "--region", "us-east", "--listen", "x"])
    assert "--listen: expected HOST:PORT with a port 0-65535, got 'x'" in capsys.readouterr().err
