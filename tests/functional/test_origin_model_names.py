"""An origin that knows a public model by its own name (pb.Origin.model_names)
is sent that name, per attempt: a failover, a hedge or a continuation to
another origin sends that one's name, or the client's. Everything the proxy
keys or counts by model keeps the public name; an origin's own 404 for its
name reaches the client as model_not_found for the public one. The real
proxy app before scripted origins on loopback (tests/functional/
test_continuation.py's), and the Forwarder alone for the hedge and the retry
without the `stream_options` the proxy added."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS
from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.routes import Target
from dataplane.upstream.forwarder import Forwarder, UpstreamSettings
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import (
    MODEL,
    Handler,
    Origin,
    Proxy,
    first_origin,
    proxy,
    second_origin,
    text_of,
    whole_chat,
)
from tests.functional.test_pipeline import KEY, start_stack, table
from tests.functional.test_pipeline import MODEL as SIM_MODEL

OWN = "their-m:8b"  # the name a mapped origin knows MODEL by
__all__ = ["proxy"]  # fixtures


def named(p: Proxy, names: dict[str, str]) -> None:
    """Apply p's table again with origin -> its own name for MODEL."""
    t = pb.RouteTable()
    t.CopyFrom(p.table)
    t.version += 1
    for o in t.origins:
        if o.name in names:
            o.model_names[MODEL] = names[o.name]
    t.etag = content_etag(t)
    p.app[HOLDER].apply(t, "control-plane")
    p.table = t


def failing(status: int = 503) -> Handler:
    async def fail(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "down"}}, status=status)

    return fail


def echoing() -> Handler:
    """A whole chat answer whose `model` is the one the origin was asked."""

    async def answer(request: web.Request) -> web.StreamResponse:
        asked = (await request.json())["model"]
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 1, "model": asked,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })  # fmt: skip

    return answer


def asked(origin: Origin) -> list[str]:
    return [b["model"] for b in origin.bodies]


async def chat(p: Proxy, text: str = "hello") -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0}
    return await p.client.post("/v1/chat/completions", json=body)


# ---------------------------------------------------------------- the proxy


async def test_a_mapped_origin_is_sent_its_own_name_and_the_rest_the_public_one(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    a = Origin(echoing())
    p = await proxy([(a, True)], extra=["--access-log=on"])
    named(p, {"o0": OWN})
    resp = await chat(p)
    assert resp.status == 200
    answer = await resp.json()
    assert asked(a) == [OWN]
    # Nothing else of the body changed.
    assert a.bodies[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert a.bodies[0]["temperature"] == 0
    # The answer's model is passed as the origin wrote it (documented).
    assert answer["model"] == OWN
    # The cache keys it by the public name: the same request is a hit.
    again = await chat(p)
    assert again.status == 200 and again.headers["x-ponto-cache"] == "hit"
    assert len(a.bodies) == 1
    # The access log and the GenAI metrics name the public model.
    p.app[ACCESS_LOG].flush()
    logged = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert [line["model"] for line in logged] == [MODEL, MODEL]
    registry = p.app[METRICS].registry
    models = {
        s.labels.get("gen_ai_request_model")
        for family in registry.collect()
        if family.name == "gen_ai_client_operation_duration_seconds"
        for s in family.samples
    }
    assert models == {MODEL}


async def test_failover_from_a_mapped_origin_sends_each_origin_its_name(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = Origin(failing()), Origin(echoing())
    p = await proxy([(a, True), (b, True)])
    named(p, {"o0": OWN})
    resp = await chat(p)
    assert resp.status == 200 and resp.headers["x-ponto-origin"] == "o1"
    assert (asked(a), asked(b)) == ([OWN], [MODEL])
    # And the other way round: from an unmapped origin to a mapped one.
    c, d = Origin(failing()), Origin(echoing())
    q = await proxy([(c, True), (d, True)])
    named(q, {"o1": "other-name"})
    resp = await chat(q, "again")
    assert resp.status == 200
    assert (asked(c), asked(d)) == ([MODEL], ["other-name"])


OLLAMA_404 = {"error": f"model '{OWN}' not found, try pulling it first"}


async def test_an_origins_404_for_its_own_name_names_the_public_one(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    async def lacks(request: web.Request) -> web.StreamResponse:
        return web.json_response(OLLAMA_404, status=404)

    a = Origin(lacks)
    p = await proxy([(a, True)])
    named(p, {"o0": OWN})
    resp = await chat(p)
    assert resp.status == 404
    err = (await resp.json())["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert MODEL in err["message"] and OWN not in err["message"]
    assert asked(a) == [OWN]
    # The operator is told the name the origin was sent (review: the public
    # one alone sent them to pull a model that a typo in the own name lacked).
    told = [r.getMessage() for r in caplog.records]
    lines = [x for x in told if "which the route table lists it for" in x]
    assert lines, "nothing said of the missing model"
    assert all(f"lacks model {MODEL} (sent as its own name {OWN!r})" in x for x in lines), lines


async def test_a_cut_stream_continues_on_a_mapped_origin_under_its_name(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0))
    named(p, {"o1": OWN})
    chunks, raw = await p.stream()
    assert "error" not in raw and text_of(chunks) == "Hello world"
    assert (asked(a), asked(b)) == ([MODEL], [OWN])
    # The continuation asks the mapped origin to go on from the partial text.
    assert b.bodies[0]["messages"][-1] == {"role": "assistant", "content": "Hello"}
    # The client reads one stream, under the first origin's model.
    assert {c["model"] for c in chunks} == {MODEL}


async def test_a_stream_starts_on_a_mapped_origin_and_continues_on_an_unmapped_one(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0))
    named(p, {"o0": OWN})
    chunks, raw = await p.stream()
    assert "error" not in raw and text_of(chunks) == "Hello world"
    assert (asked(a), asked(b)) == ([OWN], [MODEL])


# ---------------------------------------------------------------- the forwarder


class Recorded:
    """Origins for the Forwarder alone: each records the bodies it is sent."""

    def __init__(self) -> None:
        self.servers: list[TestServer] = []
        self.bodies: dict[str, list[dict[str, Any]]] = {}

    async def target(self, name: str, handler: Handler, **kw: Any) -> Target:
        bodies = self.bodies.setdefault(name, [])

        async def handle(request: web.Request) -> web.StreamResponse:
            bodies.append(await request.json())
            return await handler(request)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        server = TestServer(app)
        await server.start_server()
        self.servers.append(server)
        return Target(name, "r1", str(server.make_url("/v1")), 100, **kw)

    def asked(self, name: str) -> list[str]:
        return [b["model"] for b in self.bodies.get(name, [])]


@pytest.fixture
async def recorded() -> AsyncIterator[Recorded]:
    r = Recorded()
    yield r
    for server in r.servers:
        await server.close()


async def forward(targets: list[Target], body: dict[str, Any], **kw: Any) -> Any:
    forwarder = Forwarder(Metrics(), UpstreamSettings(), loads=LoadBoard())
    try:
        headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
        answer = await forwarder.forward(
            "/chat/completions", jsonio.dumps(body), headers, targets, model=MODEL, **kw
        )
        answer.release()
        return answer
    finally:
        await forwarder.close()


async def test_a_hedge_to_a_mapped_origin_sends_its_name(recorded: Recorded) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await release.wait()  # until the hedge has answered: cancelled before
        return web.json_response({})

    first = await recorded.target("slow", slow)
    hedge = await recorded.target("fast", whole_chat("x"), model_names={MODEL: OWN})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    try:
        answer = await forward([first, hedge], body, hedge=0.02)
    finally:
        release.set()
    assert answer.target.name == "fast" and answer.hedged
    assert (recorded.asked("slow"), recorded.asked("fast")) == ([MODEL], [OWN])


async def test_the_body_without_the_usage_the_proxy_added_is_renamed_too(
    recorded: Recorded,
) -> None:
    """An origin refusing the `stream_options` the proxy added is asked again
    with the plain body: under its own name, as the first time."""

    async def refuses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "stream_options" in body:
            return web.json_response(
                {"error": {"message": "Unrecognized request argument: stream_options"}},
                status=400,
            )
        return await whole_chat("x")(request)

    target = await recorded.target("azure", refuses, model_names={MODEL: OWN})
    plain = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    added = {**plain, "stream_options": {"include_usage": True}}
    answer = await forward([target], added, plain_body=lambda: jsonio.dumps(plain))
    assert answer.status == 200
    assert recorded.asked("azure") == [OWN, OWN]
    assert "stream_options" not in recorded.bodies["azure"][1]


async def test_only_a_body_for_a_mapped_origin_is_encoded_again(recorded: Recorded) -> None:
    """An origin without names, or without one for the request's model, is
    sent the bytes it was given (the client's, spacing and all): the common
    request pays nothing for the feature."""
    sent: dict[str, bytes] = {}

    def keeping(name: str) -> Handler:
        async def raw(request: web.Request) -> web.StreamResponse:
            sent[name] = await request.read()
            return await whole_chat("x")(request)

        return raw

    plain = await recorded.target("plain", keeping("plain"))
    other = await recorded.target("other", keeping("other"), model_names={"another": OWN})
    mapped = await recorded.target("mapped", keeping("mapped"), model_names={MODEL: OWN})
    body = b'{"model":  "m", "messages": [{"role": "user", "content": "hi"}]}'
    for t in (plain, other, mapped):
        forwarder = Forwarder(Metrics(), UpstreamSettings(), loads=LoadBoard())
        headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
        answer = await forwarder.forward("/chat/completions", body, headers, [t], model=MODEL)
        answer.release()
        await forwarder.close()
    assert sent["plain"] == sent["other"] == body
    assert jsonio.loads(sent["mapped"]) == {**jsonio.loads(body), "model": OWN}


# ---------------------------------------------------------------- pinned follow-ups


async def test_a_pinned_follow_up_reaches_its_origin_under_that_origins_name(
    tmp_path: Path,
) -> None:
    """Origin simulators that serve only their own names (any other is a
    404, as vLLM's --served-model-name makes it): a Responses conversation
    goes on at the origin that stored it, each turn under its name."""
    names = ("o1", "o2")
    configs = [SimConfig(name=n, models=(f"{n}-own",), store_responses=10) for n in names]
    s = await start_stack(tmp_path, configs)
    try:
        t = table([(n, str(o.make_url("/v1"))) for n, o in zip(names, s.origins, strict=True)])
        for o in t.origins:
            o.model_names[SIM_MODEL] = f"{o.name}-own"
        t.version = 3
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        headers = {"authorization": f"Bearer {KEY.key}"}
        previous = None
        for turn in range(4):
            body: dict[str, Any] = {"model": SIM_MODEL, "input": f"turn {turn}"}
            if previous is not None:
                body["previous_response_id"] = previous
            resp = await s.client.post("/v1/responses", json=body, headers=headers)
            answer = await resp.json()
            assert resp.status == 200, answer
            if previous is not None:
                assert resp.headers["x-ponto-route"] == "pinned"
            previous = answer["id"]
        served = [o.app[SIM_STATE].stats.by_endpoint.get("/v1/responses", 0) for o in s.origins]
        assert sorted(served) == [0, 4]
    finally:
        await s.close()
