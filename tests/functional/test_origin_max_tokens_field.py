"""A tenant's max-tokens ceiling that the proxy adds to a chat request naming
no limit is sent to each origin in its own field (pb.Origin.max_tokens_field),
per attempt: OpenAI's reasoning models refuse `max_tokens` (trial 71: every
request of a tenant with a ceiling failed at a hosted OpenAI origin with a 400
naming a field its client never sent). A field the client sent goes as sent.
The real proxy app before scripted origins on loopback
(tests/functional/test_continuation.py's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from dataplane.http.state import HOLDER
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

__all__ = ["proxy"]  # fixtures

CEILING = 1000

# What OpenAI answers a reasoning model's request (o-series, gpt-5) that
# names max_tokens.
UNSUPPORTED = {
    "error": {
        "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
        "Use 'max_completion_tokens' instead.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "unsupported_parameter",
    }
}


def reasoning_model() -> Handler:
    """An origin that refuses max_tokens as OpenAI does for o-series models,
    and answers otherwise."""
    answer = whole_chat("reasoned")

    async def handle(request: web.Request) -> web.StreamResponse:
        if "max_tokens" in await request.json():
            return web.json_response(UNSUPPORTED, status=400)
        return await answer(request)

    return handle


def failing() -> Handler:
    async def fail(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "down"}}, status=503)

    return fail


def configured(p: Proxy, fields: dict[str, str], ceiling: int = CEILING) -> None:
    """Apply p's table again with the tenant's ceiling and, for each origin
    named in `fields`, its max_tokens_field."""
    t = pb.RouteTable()
    t.CopyFrom(p.table)
    t.version += 1
    for o in t.origins:
        o.max_tokens_field = fields.get(o.name, "")
    for tenant in t.tenants:
        tenant.prompt.max_tokens_ceiling = ceiling
    t.etag = content_etag(t)
    p.app[HOLDER].apply(t, "control-plane")
    p.table = t


async def chat(p: Proxy, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **fields}
    return await p.client.post("/v1/chat/completions", json=body)


def limits(origin: Origin) -> list[dict[str, Any]]:
    """The token limits each request to `origin` named."""
    return [
        {k: v for k, v in b.items() if k in ("max_tokens", "max_completion_tokens")}
        for b in origin.bodies
    ]


async def test_the_added_ceiling_reaches_a_reasoning_model_as_max_completion_tokens(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a = Origin(reasoning_model())
    p = await proxy([(a, True)])
    configured(p, {"o0": "max_completion_tokens"})
    resp = await chat(p)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["id"] == "reasoned"
    assert limits(a) == [{"max_completion_tokens": CEILING}]
    # Nothing else of the body changed.
    assert a.bodies[0]["messages"] == [{"role": "user", "content": "hello"}]
    # A client's null is no limit: the ceiling is added, in the origin's field.
    resp = await chat(p, max_tokens=None, temperature=0.5)
    assert resp.status == 200, await resp.text()
    assert limits(a)[1] == {"max_completion_tokens": CEILING}


async def test_without_the_setting_the_origin_is_sent_max_tokens_as_before(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """The default (and what an origin like Ollama, which reads only
    max_tokens, needs): the reasoning model's 400 reaches the client."""
    a = Origin(reasoning_model())
    p = await proxy([(a, True)])
    configured(p, {})
    resp = await chat(p)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "unsupported_parameter"
    assert limits(a) == [{"max_tokens": CEILING}]


async def test_failover_sends_each_origin_the_ceiling_in_its_own_field(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = Origin(failing()), Origin(whole_chat("second"))
    p = await proxy([(a, True), (b, True)])
    configured(p, {"o0": "max_completion_tokens"})
    resp = await chat(p)
    assert resp.status == 200 and resp.headers["x-ponto-origin"] == "o1"
    assert (limits(a), limits(b)) == (
        [{"max_completion_tokens": CEILING}],
        [{"max_tokens": CEILING}],
    )
    # And the other way round: from an origin on the default to one that is not.
    c, d = Origin(failing()), Origin(reasoning_model())
    q = await proxy([(c, True), (d, True)])
    configured(q, {"o1": "max_completion_tokens"})
    resp = await chat(q, temperature=0.1)
    assert resp.status == 200, await resp.text()
    assert (limits(c), limits(d)) == (
        [{"max_tokens": CEILING}],
        [{"max_completion_tokens": CEILING}],
    )


async def test_a_clients_own_field_is_capped_but_never_renamed(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a = Origin(whole_chat("own"))
    p = await proxy([(a, True)])
    configured(p, {"o0": "max_completion_tokens"})
    for sent, expected in [
        ({"max_tokens": 5000}, {"max_tokens": CEILING}),
        ({"max_tokens": 7}, {"max_tokens": 7}),
        ({"max_completion_tokens": 5000}, {"max_completion_tokens": CEILING}),
        ({"max_tokens": 5000, "max_completion_tokens": 9}, {"max_tokens": CEILING,
                                                           "max_completion_tokens": 9}),
    ]:  # fmt: skip
        resp = await chat(p, **sent)
        assert resp.status == 200, await resp.text()
        assert limits(a)[-1] == expected, sent


async def test_a_continuation_sends_the_next_origin_what_is_left_in_its_field(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0))
    configured(p, {"o1": "max_completion_tokens"})
    # Continuations read the limit the ceiling set: null is the client's "none".
    chunks, raw = await p.stream(max_tokens=None)
    assert "error" not in raw and text_of(chunks) == "Hello world"
    assert limits(a) == [{"max_tokens": CEILING}]
    assert limits(b) == [{"max_completion_tokens": CEILING - 2}]
