"""The benchmark load generator (bench/loadgen.py) against a tiny aiohttp server on loopback.

These check structure, never speed: the schedule is evenly spaced, latency is
measured from each request's due time, and every answer is classified. The
machine may be busy, so no assertion depends on how long anything took.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from aiohttp import web

from bench.loadgen import (
    LoadSpec,
    due_times,
    merge,
    percentile,
    quantiles_ms,
    run_async,
    summarize,
)
from ponto.devenv import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start an aiohttp server for one handler on loopback; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/v1/test", handler)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}/v1/test"

    yield start
    for runner in runners:
        await runner.cleanup()


async def echo_index(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"got": orjson.loads(body)["n"]})


def test_schedule_is_evenly_spaced_from_t0() -> None:
    due = due_times(250.0, 1000, t0=5.0)
    assert due[0] == 5.0
    gaps = [b - a for a, b in itertools.pairwise(due)]
    assert all(math.isclose(g, 1 / 250, rel_tol=0, abs_tol=1e-9) for g in gaps)
    # No accumulated drift: the last one is exactly where i / rate puts it.
    assert due[-1] == 5.0 + 999 / 250


async def test_open_loop_measures_latency_from_due_time(serve: Serve) -> None:
    seen: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        response = await echo_index(request)
        seen.append(orjson.loads(await request.read())["n"])
        return response

    url = await serve(handler)
    spec = LoadSpec(url=url, body=b'{"n": {i}}', rate=200.0, duration=0.25, warmup=0.05)
    result = await run_async(spec)

    assert result.requests == 50  # duration x rate; the 10 warm-up requests are not measured
    assert result.errors() == {}
    assert result.ok == result.requests
    # Measured requests keep the open-loop schedule: due at i / rate after t0.
    assert all(
        math.isclose(b - a, 1 / 200, abs_tol=1e-9) for a, b in itertools.pairwise(result.due)
    )
    assert math.isclose(result.due[0], 0.05, abs_tol=1e-9)
    for due, sent, first, done in zip(
        result.due, result.sent, result.first, result.done, strict=True
    ):
        assert due <= sent + 1e-9  # never sent before it was due
        assert sent <= first <= done
    # Latency runs from the due time, so it includes any lateness in sending.
    assert result.latency() == [d - u for d, u in zip(result.done, result.due, strict=True)]
    assert all(
        lat >= svc - 1e-9 for lat, svc in zip(result.latency(), result.service(), strict=True)
    )
    # Each request carried its own index, warm-up included.
    assert sorted(seen) == list(range(60))


async def test_chunked_stream_is_read_to_done(serve: Serve) -> None:
    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for word in ("alpha", "beta", "gamma"):
            await response.write(b'data: {"w": "%s"}\n\n' % word.encode())
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    url = await serve(sse)
    spec = LoadSpec(url=url, body=b"{}", rate=100.0, duration=0.1, warmup=0.0, stream=True)
    result = await run_async(spec)
    assert result.requests == 10
    assert result.errors() == {}
    assert all(f <= d for f, d in zip(result.first, result.done, strict=True))
    assert len(result.ttfb()) == 10


async def test_a_stream_without_done_is_an_error(serve: Serve) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"w": "only"}\n\n')
        await response.write_eof()
        return response

    url = await serve(cut)
    spec = LoadSpec(url=url, rate=100.0, duration=0.05, warmup=0.0, stream=True)
    result = await run_async(spec)
    assert result.errors() == {"incomplete_stream": result.requests}
    assert result.ok == 0


async def test_http_errors_are_counted_by_status(serve: Serve) -> None:
    async def unavailable(request: web.Request) -> web.Response:
        return web.json_response({"error": "busy"}, status=503)

    url = await serve(unavailable)
    result = await run_async(LoadSpec(url=url, rate=100.0, duration=0.1, warmup=0.0))
    assert result.errors() == {"http_503": 10}
    assert result.error_ratio() == 1.0
    assert result.latency() == []
    assert set(result.status) == {0}


async def test_a_slow_answer_times_out_and_the_run_still_ends(serve: Serve) -> None:
    async def stuck(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    url = await serve(stuck)
    spec = LoadSpec(url=url, rate=50.0, duration=0.1, warmup=0.0, timeout=0.2)
    result = await asyncio.wait_for(run_async(spec), 10)
    assert result.errors() == {"timeout": 5}
    assert all(math.isnan(d) for d in result.done)


async def test_connection_close_answers_reopen_connections(serve: Serve) -> None:
    async def closing(request: web.Request) -> web.Response:
        response = web.json_response({"ok": True})
        response.force_close()
        return response

    url = await serve(closing)
    result = await run_async(LoadSpec(url=url, rate=100.0, duration=0.1, warmup=0.0))
    assert result.errors() == {}
    assert result.connections_opened > 2  # more than the pool opened up front


async def test_closed_loop_sends_back_to_back_on_its_connections(serve: Serve) -> None:
    url = await serve(echo_index)
    spec = LoadSpec(
        url=url, body=b'{"n": {i}}', mode="closed", connections=3, duration=0.2, warmup=0.05
    )
    # The checks below hold for every answer measured; a loop starved for the
    # whole 0.2 s window (a busy CI machine) measures none, so run it again.
    for _ in range(5):
        result = await run_async(spec)
        if result.requests:
            break
    assert result.requests > 0
    assert result.errors() == {}
    assert result.connections_opened == 3
    # In a closed loop a request is due when it is sent: latency is service time.
    assert all(u <= s for u, s in zip(result.due, result.sent, strict=True))
    # Measured are the answers that ended inside the window.
    assert all(result.window[0] <= d < result.window[1] for d in result.done)


async def test_nothing_listening_fails_fast() -> None:
    spec = LoadSpec(url=f"http://127.0.0.1:{free_port()}/", rate=10.0, duration=0.1)
    with pytest.raises(ConnectionError):
        await run_async(spec)


async def test_merge_and_summary_shapes(serve: Serve) -> None:
    url = await serve(echo_index)
    spec = LoadSpec(url=url, body=b'{"n": {i}}', rate=100.0, duration=0.1, warmup=0.0)
    a, b = await run_async(spec), await run_async(spec)
    merged = merge([a, b])
    assert merged.requests == a.requests + b.requests
    assert math.isclose(merged.elapsed, a.elapsed + b.elapsed)
    summary = summarize(merged)
    assert summary["requests"] == 20
    assert summary["error_ratio"] == 0.0
    latency = summary["latency_ms"]
    assert isinstance(latency, dict)
    assert set(latency) == {"p50", "p90", "p99", "p99.9", "max", "mean"}


def test_percentiles_are_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert math.isnan(percentile([], 50))
    assert quantiles_ms([]) == {
        "p50": None,
        "p90": None,
        "p99": None,
        "p99.9": None,
        "max": None,
        "mean": None,
    }


def test_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        LoadSpec(url="http://x/", rate=0.0)
    with pytest.raises(ValueError):
        LoadSpec(url="http://x/", mode="closed", connections=0)
    with pytest.raises(ValueError):
        LoadSpec(url="http://x/", body=b"{i}{i}")
