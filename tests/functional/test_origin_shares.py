"""A proxy's connections to one origin, shared between tenants, through the
pipeline and the Forwarder against origins on loopback.

A trial found one tenant's 1,024 streams holding every connection of a proxy
to an origin, and another tenant's ordinary request waiting behind them,
untimed, past its client's timeout. Here the cap is a few connections
(--max-origin-connections): a tenant past its share is refused while another
is served; a call that finds no connection within --origin-queue-timeout is
asked of the next origin, or answered 503 origin_busy, reaching no origin.
The held streams wait for an event, not a clock; the one timeout is the
behaviour under test (QUEUE, short).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from dataplane.http.errors import ApiError
from dataplane.http.state import HOLDER, METRICS, PIPELINE
from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from dataplane.routes import Target
from dataplane.upstream.forwarder import Forwarder, UpstreamSettings
from dataplane.upstream.outlier import RetryBudget
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import (
    COMPLETION,
    FIRST_CHUNK,
    Stack,
    chat,
    error_of,
    read_sse,
    start_stack,
    table,
)

ALPHA = issue_key()
BETA = issue_key()
QUEUE = 0.05  # --origin-queue-timeout where a wait must run out
BOUND = 5.0  # what a wait that must end may take before the test fails


@dataclass
class Holding:
    """An origin whose streams send their first chunk and then wait for
    `done`; a whole answer comes at once. Counts what it was asked."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0
    whole: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            self.whole += 1
            return web.json_response(COMPLETION)
        self.streams += 1
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps(FIRST_CHUNK).encode() + b"\n\n")
        await self.done.wait()
        last = {**FIRST_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await out.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        return out

    async def serve(self) -> TestServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        server = TestServer(app)
        await server.start_server()
        return server


def tenants_table(origins: list[tuple[str, str]], version: int) -> pb.RouteTable:
    """The pipeline tests' table, with tenants alpha and beta, a key each,
    neither with a concurrency limit (the default)."""
    t = table(origins, version=version, limited=False)
    t.tenants.extend([pb.Tenant(name="alpha"), pb.Tenant(name="beta")])
    t.keys.add(id=ALPHA.key_id, hash=ALPHA.key_hash, tenant="alpha")
    t.keys.add(id=BETA.key_id, hash=BETA.key_hash, tenant="beta")
    t.etag = content_etag(t)
    return t


@dataclass
class Shared:
    stack: Stack
    origin: Holding

    def attempts(self, outcome: str) -> float:
        registry = self.stack.app[METRICS].registry
        labels = {"origin": "held", "outcome": outcome}
        return registry.get_sample_value("ponto_upstream_attempts_total", labels) or 0.0

    async def hold(self, n: int, before: int = 0) -> list[Any]:
        """`n` streams of beta, each with its first chunk relayed (so holding
        its connection until `origin.done`), after `before` streams already
        held."""
        held = []
        for i in range(n):
            resp = await self.stack.post(chat(f"beta stream {i}", stream=True), key=BETA.key)
            assert resp.status == 200
            held.append(resp)
        assert self.origin.streams == before + n
        return held


async def shared(tmp_path: Path, *flags: str) -> AsyncIterator[Shared]:
    origin = Holding()
    server = await origin.serve()
    stack = await start_stack(tmp_path, [], list(flags))
    stack.others.append(server)
    stack.app[HOLDER].apply(
        tenants_table([("held", str(server.make_url("/v1")))], version=3), "control-plane"
    )
    try:
        yield Shared(stack, origin)
    finally:
        origin.done.set()  # the held streams end before their origin closes
        await stack.close()


@pytest.fixture
async def by_share(tmp_path: Path) -> AsyncIterator[Shared]:
    """Four connections: each tenant's share is two (half, the default)."""
    async for s in shared(tmp_path, "--max-origin-connections=4"):
        yield s


@pytest.fixture
async def by_queue(tmp_path: Path) -> AsyncIterator[Shared]:
    """Two connections, which one tenant may hold; a wait of QUEUE for one."""
    flags = (
        "--max-origin-connections=2",
        "--max-origin-connections-per-tenant=2",
        f"--origin-queue-timeout={QUEUE}",
    )
    async for s in shared(tmp_path, *flags):
        yield s


def busy(body: Any, resp: Any) -> None:
    """`resp` is the 503 origin_busy, in OpenAI's shape, with a Retry-After."""
    assert resp.status == 503
    assert error_of(body)["code"] == "origin_busy"
    assert resp.headers["retry-after"] == "1"


async def test_a_tenant_past_its_share_is_refused_while_another_is_served(
    by_share: Shared, caplog: pytest.LogCaptureFixture
) -> None:
    s = by_share
    alpha = await s.stack.post(chat("alpha streams", stream=True), key=ALPHA.key)
    assert alpha.status == 200  # alpha has a call to the origin under way
    held = await s.hold(2, before=1)
    caplog.set_level(logging.INFO)
    # Beta's third stream, past its share while alpha has calls: refused at
    # once, sent nowhere.
    third = await s.stack.post(chat("beta stream 2", stream=True), key=BETA.key)
    busy(await third.json(), third)
    assert s.origin.streams == 3
    # Alpha, within its share, is served beside beta's streams.
    resp = await s.stack.post(chat("alpha asks"), key=ALPHA.key)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "hi"
    assert s.origin.whole == 1
    held.append(alpha)
    assert s.attempts("tenant_share") == 1
    # One line for the refused request, naming why, with no traceback; none
    # counts against the origin's health.
    lines = [r for r in caplog.records if r.name == "dataplane.upstream.forwarder"]
    assert len(lines) == 1 and not lines[0].exc_info
    assert third.headers["x-request-id"] in lines[0].getMessage()
    assert "its share of this proxy's connections" in lines[0].getMessage()
    assert not s.stack.app[METRICS].registry.get_sample_value(
        "ponto_origin_ejections_total", {"origin": "held"}
    )
    # Once beta's streams end, its share is free again.
    s.origin.done.set()
    for resp in held:
        assert (await read_sse(resp))[-1] == "[DONE]"
    again = await s.stack.post(chat("beta stream 3", stream=True), key=BETA.key)
    assert again.status == 200
    assert (await read_sse(again))[-1] == "[DONE]"


async def test_a_tenant_alone_on_an_origin_may_use_all_but_a_reserve(by_share: Shared) -> None:
    """The share binds only while another tenant has calls to the origin: an
    open fleet's `default`, or a deployment of one tenant, takes all of the
    pool but an eighth (at least one connection), which a tenant coming
    after it finds free."""
    s = by_share
    held = await s.hold(3)  # four connections, beta's share two, one kept
    assert s.attempts("tenant_share") == 0
    fourth = await s.stack.post(chat("beta stream 3", stream=True), key=BETA.key)
    busy(await fourth.json(), fourth)
    late = await s.stack.post(chat("alpha asks"), key=ALPHA.key)
    assert late.status == 200
    s.origin.done.set()
    for resp in held:
        assert (await read_sse(resp))[-1] == "[DONE]"


async def test_a_call_with_no_connection_within_the_queue_timeout_is_a_503(
    by_queue: Shared,
) -> None:
    s = by_queue
    held = await s.hold(2)
    resp = await s.stack.post(chat("alpha asks"), key=ALPHA.key)
    busy(await resp.json(), resp)
    assert s.origin.whole == 0  # reached no origin
    assert s.attempts("origin_busy") == 1
    # The call that gave up left the pool's queue: once a connection is free,
    # the next call takes it.
    s.origin.done.set()
    for stream in held:
        await read_sse(stream)
    served = await s.stack.post(chat("alpha asks again"), key=ALPHA.key)
    assert served.status == 200
    assert s.origin.whole == 1


@pytest.fixture
async def queued(tmp_path: Path) -> AsyncIterator[Shared]:
    """Two connections, which one tenant may hold; a wait for one that the
    test ends, not a clock (the queue timeout is a bound)."""
    flags = (
        "--max-origin-connections=2",
        "--max-origin-connections-per-tenant=2",
        "--origin-queue-timeout=60",
    )
    async for s in shared(tmp_path, *flags):
        yield s


async def test_a_client_that_left_while_its_call_waited_for_a_connection_is_charged_as_sent(
    queued: Shared,
) -> None:
    """Its call had begun, though it sent nothing: one of its line's
    attempts, and charged the prompt's estimate as a client that left after
    its prompt was sent is (docs/rate-limits.md, "No count"), not the 0 of one
    that left before any call began."""
    s = queued
    await s.hold(2)
    forwarder = s.stack.app[PIPELINE].forwarder
    body = chat("alpha asks")
    call = asyncio.create_task(s.stack.post(body, key=ALPHA.key))
    async with asyncio.timeout(BOUND):
        while forwarder.loads.outstanding("held") < 3:  # its call waits in the queue
            await asyncio.sleep(0.005)
    call.cancel()  # the client leaves
    with pytest.raises(asyncio.CancelledError):
        await call
    sample = s.stack.app[METRICS].registry.get_sample_value
    async with asyncio.timeout(BOUND):
        while sample("ponto_requests_total", {"endpoint": "chat.completions", "code": "499"}) != 1:
            await asyncio.sleep(0.005)
    assert s.origin.whole == 0  # reached no origin
    assert s.attempts("cancelled") == 1
    who = {"tenant": "alpha", "key": ALPHA.key_id}
    estimate = estimate_prompt_tokens("chat.completions", body)
    assert sample("ponto_tenant_tokens_total", {**who, "kind": "prompt"}) == estimate > 0


# ---------------------------------------------------------------- failover


@pytest.fixture
async def origins() -> AsyncIterator[list[tuple[Holding, Target]]]:
    """Two holding origins, o1 and o2, as the Forwarder's targets."""
    made: list[tuple[Holding, Target]] = []
    servers = []
    for name in ("o1", "o2"):
        origin = Holding()
        server = await origin.serve()
        servers.append(server)
        made.append((origin, Target(name, "r1", str(server.make_url("/v1")), 100)))
    yield made
    for origin, _ in made:
        origin.done.set()
    for server in servers:
        await server.close()


async def test_a_call_with_no_connection_in_time_fails_over_to_the_next_origin(
    origins: list[tuple[Holding, Target]],
) -> None:
    (first, o1), (second, o2) = origins
    metrics = Metrics()
    settings = UpstreamSettings(max_origin_connections=1, origin_queue_timeout=QUEUE)
    # No retry token: a call never sent takes none to fail over.
    budget = RetryBudget(ratio=0.0, floor_per_s=0.0, cap=0.0)
    forwarder = Forwarder(metrics, settings, loads=LoadBoard(), budget=budget)

    def headers(request_id: str) -> CIMultiDict[str]:
        return CIMultiDict({"x-request-id": request_id})

    try:
        stream = await forwarder.forward(
            "/chat/completions", b'{"stream": true}', headers("r1"), [o1], tenant="beta"
        )
        try:
            async with asyncio.timeout(BOUND):
                answer = await forwarder.forward(
                    "/chat/completions", b"{}", headers("r2"), [o1, o2], tenant="alpha"
                )
            answer.release()
            assert answer.target.name == "o2" and answer.calls == 2
            assert (first.whole, second.whole) == (0, 1)
            sample = metrics.registry.get_sample_value
            labels = {"origin": "o1", "outcome": "origin_busy"}
            assert sample("ponto_upstream_attempts_total", labels) == 1
            # With no other origin: the 503, having sent nothing.
            with pytest.raises(ApiError) as refused:
                await forwarder.forward(
                    "/chat/completions", b"{}", headers("r3"), [o1], tenant="alpha"
                )
            assert (refused.value.status, refused.value.code) == (503, "origin_busy")
            assert not refused.value.spent
            assert first.whole == 0
        finally:
            stream.release()
    finally:
        await forwarder.close()
