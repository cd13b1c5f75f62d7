"""The origin simulator's faults for hedging and continuation tests, over real HTTP.

Stalls (flag and ``x-sim-stall-ms``), streams cut after N content tokens, and
requests aborted when their client hangs up. Timings are never asserted: a
test waits for the running gauge instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from ponto.originsim import SimConfig, build_app
from ponto.originsim.__main__ import _parser, main

MakeClient = Callable[..., Awaitable["SimClient"]]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RUNNING = 'vllm:num_requests_running{model_name="sim-small"}'
WAITING = 'vllm:num_requests_waiting{model_name="sim-small"}'
# Far longer than any test runs: only an abort ends these waits in time.
FOREVER_MS = 600_000


class SimClient:
    """A simulator served by an AppRunner on loopback and a client session to it.

    Like aiohttp's TestClient, it closes every response it handed out at
    :meth:`close`, read or not.
    """

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.session = aiohttp.ClientSession()
        host, port = runner.addresses[0][:2]
        self.base = f"http://{host}:{port}"
        self._responses: list[aiohttp.ClientResponse] = []

    async def get(self, path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        resp = await self.session.get(self.base + path, **kwargs)
        self._responses.append(resp)
        return resp

    async def post(self, path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        resp = await self.session.post(self.base + path, **kwargs)
        self._responses.append(resp)
        return resp

    async def close(self) -> None:
        for resp in self._responses:
            resp.close()
        await self.session.close()
        await self.runner.cleanup()


@pytest.fixture(params=[False, True], ids=["watched", "handler-cancellation"])
async def make_client(request: pytest.FixtureRequest) -> AsyncIterator[MakeClient]:
    """Start simulators as the CLI serves them (aiohttp never cancels a handler
    whose client left; the simulator's own watch must) and as aiohttp's
    TestServer does (it cancels them)."""
    started: list[SimClient] = []

    async def make(**overrides: Any) -> SimClient:
        app = build_app(SimConfig(name="sim-f", **overrides))
        runner = web.AppRunner(app, handler_cancellation=request.param)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        client = SimClient(runner)
        started.append(client)
        return client

    yield make
    for client in started:
        await client.close()


def chat_body(**extra: Any) -> bytes:
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], **extra}
    return orjson.dumps(body)


async def metric(client: SimClient, prefix: str) -> float:
    """Return a sample's value, 0 for a series not there yet."""
    text = await (await client.get("/metrics")).text()
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


async def wait_for(client: SimClient, prefix: str, expected: float) -> None:
    for _ in range(200):
        if await metric(client, prefix) == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{prefix} never reached {expected}")


async def data_events(resp: aiohttp.ClientResponse) -> tuple[list[bytes], bool]:
    """Read a stream to its end; return its data payloads and whether it was cut."""
    events: list[bytes] = []
    try:
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[len(b"data: ") :].strip())
    except aiohttp.ClientPayloadError:
        return events, True
    return events, False


def no_warnings(caplog: pytest.LogCaptureFixture) -> None:
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# ---------------------------------------------------------------------------
# Stalls


async def test_stall_header_holds_a_running_slot_then_answers(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        CHAT, data=chat_body(stream=True, max_tokens=3), headers={"x-sim-stall-ms": "200"}
    )
    # Headers are out; the first token is not, and the request counts as running.
    assert resp.status == 200
    assert await metric(client, RUNNING) == 1.0
    events, was_cut = await data_events(resp)
    assert not was_cut
    assert events[-1] == b"[DONE]"
    assert len(events) == 3 + 2
    await wait_for(client, RUNNING, 0.0)


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_during_stall_aborts_at_once(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    client = await make_client(stall_rate=1.0, stall_ms=FOREVER_MS, seed=3)
    request = asyncio.create_task(client.post(CHAT, data=chat_body(stream=stream)))
    await wait_for(client, RUNNING, 1.0)
    if stream:
        (await request).close()
    else:
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_for(client, RUNNING, 0.0)
    assert (await client.get("/health")).status == 200
    no_warnings(caplog)


async def test_stall_rate_zero_never_stalls_and_header_zero_does_not_either(
    make_client: MakeClient,
) -> None:
    client = await make_client(stall_rate=0.0, stall_ms=FOREVER_MS)
    resp = await client.post(CHAT, data=chat_body())
    assert resp.status == 200
    await client.post("/sim/config", data=orjson.dumps({"stall_rate": 1.0}))
    resp = await client.post(CHAT, data=chat_body(), headers={"x-sim-stall-ms": "0"})
    assert resp.status == 200


async def test_bad_stall_header_is_400(make_client: MakeClient) -> None:
    client = await make_client()
    for value in ("-1", "soon", "3600001"):
        resp = await client.post(CHAT, data=chat_body(), headers={"x-sim-stall-ms": value})
        assert resp.status == 400
        assert orjson.loads(await resp.read())["error"]["param"] == "x-sim-stall-ms"
    assert await metric(client, RUNNING) == 0.0


# ---------------------------------------------------------------------------
# Disconnects outside stalls


async def test_disconnect_between_slow_tokens_aborts_at_once(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # One token every 100 s: the next write, which would notice the hang-up, is far off.
    client = await make_client(tokens_per_s=0.01)
    resp = await client.post(CHAT, data=chat_body(stream=True))
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()
    await wait_for(client, RUNNING, 0.0)
    no_warnings(caplog)


async def test_disconnect_of_a_non_streamed_request_aborts_it(make_client: MakeClient) -> None:
    client = await make_client(ttft_ms=FOREVER_MS)
    request = asyncio.create_task(client.post(CHAT, data=chat_body()))
    await wait_for(client, RUNNING, 1.0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await wait_for(client, RUNNING, 0.0)
    # Aborted by the simulator itself (or cancelled by aiohttp, when it does).
    dropped = 'ponto_sim_requests_total{endpoint="/v1/chat/completions",status="dropped"}'
    cancelled = dropped.replace("dropped", "cancelled")
    assert await metric(client, dropped) + await metric(client, cancelled) == 1.0


async def test_disconnect_while_queued_leaves_the_queue(make_client: MakeClient) -> None:
    client = await make_client(max_concurrency=1)
    first = await client.post(
        CHAT, data=chat_body(stream=True), headers={"x-sim-stall-ms": str(FOREVER_MS)}
    )
    queued = asyncio.create_task(client.post(CHAT, data=chat_body()))
    await wait_for(client, WAITING, 1.0)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await wait_for(client, WAITING, 0.0)
    assert await metric(client, RUNNING) == 1.0
    first.close()
    await wait_for(client, RUNNING, 0.0)


# ---------------------------------------------------------------------------
# Cuts


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_cut_after_tokens_closes_streams_after_n_content_tokens(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    client = await make_client(cut_after_tokens=3)
    body: dict[str, Any] = {"model": "sim-small", "stream": True, "max_tokens": 10}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    events, was_cut = await data_events(await client.post(path, data=orjson.dumps(body)))
    assert was_cut
    assert len(events) == 3
    chunks = [orjson.loads(e) for e in events]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)

    # A shorter answer ends normally; non-streamed answers are never cut.
    events, was_cut = await data_events(
        await client.post(path, data=orjson.dumps({**body, "max_tokens": 2}))
    )
    assert (was_cut, events[-1]) == (False, b"[DONE]")
    resp = await client.post(path, data=orjson.dumps({**body, "stream": False}))
    assert orjson.loads(await resp.read())["usage"]["completion_tokens"] == 10
    await wait_for(client, RUNNING, 0.0)
    no_warnings(caplog)


async def test_cut_after_header_still_counts_events(make_client: MakeClient) -> None:
    client = await make_client(cut_after_tokens=5)
    resp = await client.post(CHAT, data=chat_body(stream=True), headers={"x-sim-cut-after": "2"})
    events, was_cut = await data_events(resp)
    assert (was_cut, len(events)) == (True, 2)


# ---------------------------------------------------------------------------
# Settings


async def test_sim_config_sets_and_shows_fault_knobs(make_client: MakeClient) -> None:
    client = await make_client()
    knobs = await (await client.get("/sim/config")).json()
    assert (knobs["stall_rate"], knobs["stall_ms"], knobs["cut_after_tokens"]) == (0.0, 0.0, 0)
    change = {"stall_rate": 0.25, "stall_ms": 40, "cut_after_tokens": 7}
    resp = await client.post("/sim/config", data=orjson.dumps(change))
    assert resp.status == 200
    assert {key: (await resp.json())[key] for key in change} == change
    knobs = await (await client.get("/sim/config")).json()
    assert {key: knobs[key] for key in change} == change


@pytest.mark.parametrize(
    "change",
    [
        {"stall_rate": 1.5},
        {"stall_rate": "often"},
        {"stall_ms": -1},
        {"cut_after_tokens": -1},
        {"cut_after_tokens": 2.5},
        {"cut_after_tokens": True},
    ],
)
async def test_sim_config_rejects_bad_fault_knobs(
    make_client: MakeClient, change: dict[str, object]
) -> None:
    client = await make_client()
    resp = await client.post("/sim/config", data=orjson.dumps(change))
    assert resp.status == 400
    assert orjson.loads(await resp.read())["error"]["message"]
    knobs = await (await client.get("/sim/config")).json()
    assert (knobs["stall_rate"], knobs["stall_ms"], knobs["cut_after_tokens"]) == (0.0, 0.0, 0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"stall_rate": -0.1}, "stall_rate"),
        ({"stall_rate": 2.0}, "stall_rate"),
        ({"stall_ms": float("nan")}, "stall_ms"),
        ({"stall_ms": -5.0}, "stall_ms"),
        ({"cut_after_tokens": -1}, "cut_after_tokens"),
    ],
)
def test_sim_config_validates_fault_knobs(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimConfig(**fields)


def test_cli_fault_flags() -> None:
    args = _parser().parse_args(
        ["--stall-rate", "0.5", "--stall-ms", "250", "--cut-after-tokens", "12", "--seed", "4"]
    )
    assert (args.stall_rate, args.stall_ms, args.cut_after_tokens, args.seed) == (
        0.5,
        250.0,
        12,
        4,
    )
    defaults = _parser().parse_args([])
    assert (defaults.stall_rate, defaults.stall_ms, defaults.cut_after_tokens) == (0.0, 0.0, 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--stall-rate", "2"],
        ["--stall-rate", "x"],
        ["--stall-ms", "-1"],
        ["--cut-after-tokens", "-3"],
        ["--cut-after-tokens", "1.5"],
    ],
)
def test_cli_rejects_bad_fault_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


async def test_disconnect_while_held_ends_the_request(make_client: MakeClient) -> None:
    """A held request whose client left ends then, not at a release that may
    never come."""
    client = await make_client()
    held = asyncio.create_task(client.post(CHAT, data=chat_body(), headers={"x-sim-hold": "h"}))
    for _ in range(200):
        if (await (await client.get("/sim/stats")).json())["requests"] == 1:
            break
        await asyncio.sleep(0.01)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    dropped = 'ponto_sim_requests_total{endpoint="/v1/chat/completions",status="dropped"}'
    cancelled = dropped.replace("dropped", "cancelled")
    for _ in range(200):
        if await metric(client, dropped) + await metric(client, cancelled) == 1.0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the held request outlived its client")
