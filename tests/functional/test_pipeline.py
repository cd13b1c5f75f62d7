"""The request pipeline in one process: the proxy's app and the origin simulator's
app on aiohttp test servers, driven with real HTTP on loopback.

No control plane: each test applies a route table to the proxy's holder and
gives it its rate-limit shares, as the control-plane link would. Every answer
is checked against what the origin saw (its own request counter), so a refusal
that reached an origin, or a hit that did, fails here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict, CIMultiDictProxy

from dataplane import jsonio
from dataplane.cache import textform
from dataplane.cache.keys import NORMALISE_BUDGET, QUOTE_BUDGET
from dataplane.http.errors import ApiError
from dataplane.http.pipeline import ENDPOINTS, Exchange
from dataplane.http.requestid import RequestIds
from dataplane.http.server import build_app
from dataplane.http.state import HOLDER, METRICS, PIPELINE, QUOTA
from dataplane.settings import parse as parse_proxy
from dataplane.streaming.usage import Usage
from ponto.apikeys import issue_key
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.originsim.app import build_app as sim_app
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

MODEL = "sim-small"
KEY = issue_key()
LIMITED_KEY = issue_key()


def chat(text: str, **fields: Any) -> dict[str, Any]:
    fields.setdefault("temperature", 0)  # deterministic: cacheable
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


# The fleet's key of the Responses ids (RouteTable.response_id_keys).
ID_KEY = b"functional-tests-response-id-key"


def table(
    origins: list[tuple[str, str]], *, version: int = 2, limited: bool = True
) -> pb.RouteTable:
    """One region; the given (name, base URL) origins; tenant acme with a free key
    and (if `limited`) a key limited to 2 requests a minute."""
    t = pb.RouteTable(
        version=version,
        regions=[pb.Region(name="r1", latitude=0.0, longitude=0.0)],
        origins=[
            pb.Origin(
                name=name, base_url=url, region="r1", models=[MODEL], weight=100, healthy=True
            )
            for name, url in origins
        ],
        tenants=[pb.Tenant(name="acme")],
        keys=[
            pb.ApiKey(id=KEY.key_id, hash=KEY.key_hash, tenant="acme"),
            pb.ApiKey(
                id=LIMITED_KEY.key_id,
                hash=LIMITED_KEY.key_hash,
                tenant="acme",
                limits=pb.Limits(rpm=2),
            ),
        ][: 2 if limited else 1],
        auth_required=True,
        response_id_keys=[ID_KEY],
    )
    t.etag = content_etag(t)
    return t


@dataclass
class Stack:
    client: TestClient[web.Request, web.Application]
    app: web.Application
    origins: list[TestServer]  # origin simulators
    others: list[TestServer] = field(default_factory=list)  # origins a test wrote

    async def close(self) -> None:
        await self.client.close()
        for server in (*self.origins, *self.others):
            await server.close()

    def origin_requests(self) -> int:
        return sum(o.app[SIM_STATE].stats.requests for o in self.origins)

    async def post(self, body: Any, *, key: str = KEY.key, **kw: Any) -> Any:
        headers = {"authorization": f"Bearer {key}", **kw.pop("headers", {})}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers, **kw)

    async def post_raw(self, raw: bytes) -> Any:
        """A chat request whose body is `raw`, as written (JSON the client built)."""
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY.key}"}
        return await self.client.post("/v1/chat/completions", data=raw, headers=headers)


async def start_stack(
    tmp_path: Path,
    configs: list[SimConfig],
    extra: list[str] | None = None,
    *,
    shutdown_timeout: float = 60.0,
) -> Stack:
    """The proxy's app before origin simulators of `configs`, with tables
    applied; `shutdown_timeout`: how long closing the proxy's server waits for
    its handlers before cancelling them (aiohttp's default, as the proxy's)."""
    origins = [TestServer(sim_app(c)) for c in configs]
    for o in origins:
        await o.start_server()
    settings = parse_proxy(
        [
            "--region=r1",
            "--name=functional",
            "--control-plane=127.0.0.1:9",  # never answers: tables are applied below
            f"--state-dir={tmp_path}",
            "--metrics-key-labels=on",  # the accounting tests read per-key series
            *(extra or []),
        ]
    )
    app = build_app(settings)
    server = TestServer(app)
    await server.start_server(shutdown_timeout=shutdown_timeout)
    client = TestClient(server)
    served = [(c.name, str(o.make_url("/v1"))) for c, o in zip(configs, origins, strict=True)]
    # The limited key arrives with the second table, as a key created while the
    # proxy runs: its bucket starts full (at boot a proxy's buckets start empty).
    app[HOLDER].apply(table(served, version=1, limited=False), "control-plane")
    app[HOLDER].apply(table(served, version=2), "control-plane")
    app[QUOTA].on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    return Stack(client, app, origins)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=6, seed=1)])
    yield s
    await s.close()


def error_of(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


async def read_sse(resp: Any) -> list[str]:
    text = (await resp.read()).decode()
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


# ---------------------------------------------------------------- answers


async def test_a_miss_goes_to_the_origin_and_a_repeat_is_answered_from_the_cache(
    stack: Stack,
) -> None:
    first = await stack.post(chat("hello there"))
    assert first.status == 200
    body = await first.json()
    assert first.headers["x-ponto-cache"] == "miss"
    assert first.headers["x-ponto-origin"] == "o1"
    assert first.headers["x-ponto-region"] == "r1"
    assert first.headers["x-ponto-attempts"] == "1"
    assert len(first.headers["x-request-id"]) == 32
    assert body["choices"][0]["message"]["content"]
    assert stack.origin_requests() == 1

    again = await stack.post(chat("hello there"), headers={"x-request-id": "mine-1"})
    assert again.status == 200
    assert again.headers["x-ponto-cache"] == "hit"
    assert again.headers["x-ponto-cache-tier"] == "local"  # no --redis: memory only
    assert again.headers["age"] == "0"  # whole seconds since it was made
    assert "age" not in first.headers
    assert again.headers["x-request-id"] == "mine-1"
    assert "x-ponto-origin" not in again.headers
    assert await again.json() == body
    assert stack.origin_requests() == 1


async def test_code_that_differs_in_indentation_is_not_answered_from_the_cache(
    stack: Stack,
) -> None:
    # Two programs: b() inside the loop, or after it. Only line ends and the
    # blank lines around a text may differ for a hit.
    inside = "What does this print?\n\nfor x in range(3):\n    a()\n    b()"
    after = "What does this print?\n\nfor x in range(3):\n    a()\nb()"
    for text, cache in (
        (inside, "miss"),
        (after, "miss"),
        (inside.replace("\n", "  \r\n") + "\n", "hit"),
        (after, "hit"),
    ):
        resp = await stack.post(chat(text))
        assert resp.status == 200
        assert resp.headers["x-ponto-cache"] == cache, text
        await resp.read()
    assert stack.origin_requests() == 2


async def test_a_stream_is_relayed_recorded_and_replayed(stack: Stack) -> None:
    request = chat("stream me", stream=True, stream_options={"include_usage": True})
    first = await stack.post(request)
    assert first.status == 200
    assert first.headers["content-type"].startswith("text/event-stream")
    assert first.headers["x-ponto-cache"] == "miss"
    events = await read_sse(first)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    assert text
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6

    replay = await stack.post(request)
    assert replay.headers["x-ponto-cache"] == "hit"
    assert await read_sse(replay) == events
    # The same question without streaming: the recorded stream, assembled.
    whole = await stack.post(chat("stream me"))
    assert whole.headers["x-ponto-cache"] == "hit"
    assert (await whole.json())["choices"][0]["message"]["content"] == text
    assert stack.origin_requests() == 1


async def test_tokens_are_accounted_once_per_answer_from_the_origin(stack: Stack) -> None:
    m = stack.app[METRICS]

    def spent() -> float:
        value = m.registry.get_sample_value(
            "ponto_tenant_tokens_total",
            {"tenant": "acme", "key": KEY.key_id, "kind": "completion"},
        )
        return value or 0.0

    await (await stack.post(chat("count me"))).read()
    await (await stack.post(chat("count me", stream=True, seed=2))).read()
    await (await stack.post(chat("count me"))).read()  # a hit spends nothing
    assert spent() == 12


async def test_identical_concurrent_requests_make_one_origin_call(tmp_path: Path) -> None:
    s = await start_stack(tmp_path, [SimConfig(name="slow", answer_tokens=4, ttft_ms=300, seed=3)])
    try:
        answers = await asyncio.gather(*(s.post(chat("together")) for _ in range(3)))
        bodies = [await a.json() for a in answers]
        assert all(a.status == 200 for a in answers)
        assert bodies[0] == bodies[1] == bodies[2]
        assert sorted(a.headers.get("x-ponto-coalesced", "0") for a in answers) == ["0", "1", "1"]
        assert s.origin_requests() == 1
    finally:
        await s.close()


async def test_a_failing_origin_is_replaced_before_the_first_byte(tmp_path: Path) -> None:
    s = await start_stack(
        tmp_path,
        [
            SimConfig(name="bad", mode="fail", fail_status=503),
            SimConfig(name="good", answer_tokens=3, seed=4),
        ],
    )
    try:
        for i in range(6):  # the weighted order puts "bad" first about half the time
            resp = await s.post(chat(f"failover {i}"))
            assert resp.status == 200
            assert resp.headers["x-ponto-origin"] == "good"
            await resp.read()
    finally:
        await s.close()


async def test_no_origin_answering_is_a_502_in_the_openai_shape(tmp_path: Path) -> None:
    s = await start_stack(tmp_path, [SimConfig(name="down", mode="fail", fail_status=500)])
    try:
        resp = await s.post(chat("nobody home"))
        assert resp.status == 502
        err = error_of(await resp.json())
        assert err["type"] == "upstream_error"
        assert err["code"] == "upstream_unavailable"
        assert "down" not in err["message"] and "500" not in err["message"]
        assert resp.headers["x-request-id"]
    finally:
        await s.close()


async def test_a_region_failing_as_a_whole_fails_over_to_the_next(tmp_path: Path) -> None:
    """Trial 19: with three replicas at home answering 500 at once, the three
    attempts all went to them and the client got a 502, while the next region
    was healthy; the last attempt now goes there."""
    configs = [SimConfig(name=f"home{i}", mode="fail", fail_status=500) for i in range(3)]
    s = await start_stack(tmp_path, [*configs, SimConfig(name="away", answer_tokens=3, seed=4)])
    try:
        t = pb.RouteTable(version=3, tenants=[pb.Tenant(name="acme")], auth_required=True)
        t.regions.add(name="r1", latitude=0.0, longitude=0.0)
        t.regions.add(name="r2", latitude=10.0, longitude=10.0)
        for origin in s.origins:
            name = origin.app[SIM_STATE].config.name
            t.origins.add(
                name=name, base_url=str(origin.make_url("/v1")), models=[MODEL], weight=100,
                region="r2" if name == "away" else "r1", healthy=True,
            )  # fmt: skip
        t.keys.add(id=KEY.key_id, hash=KEY.key_hash, tenant="acme")
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        resp = await s.post(chat("the whole region is down"))
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ponto-origin"] == "away"
        assert resp.headers["x-ponto-attempts"] == "3"
        assert resp.headers["x-ponto-route"] == "failover"
        await resp.read()
        tried = [o.app[SIM_STATE].stats.requests for o in s.origins]
        assert sum(tried[:3]) == 2 and tried[3] == 1
        # Counted by the origin that answered (trial 33: which replica took
        # what, and why, was in no series).
        decisions = s.app[METRICS].registry.get_sample_value
        assert decisions("ponto_route_decisions_total", {"reason": "failover", "origin": "away"})
    finally:
        await s.close()


# ---------------------------------------------------------------- refusals


BAD = [
    ("no key", None, {"json": chat("x")}, 401, "missing_api_key"),
    ("wrong key", "sk-ponto-aaaaaaaaaa-nope", {"json": chat("x")}, 401, None),
    (
        "not json",
        KEY.key,
        {"data": b"{nope", "headers": {"content-type": "application/json"}},
        400,
        "invalid_json",
    ),
    ("not an object", KEY.key, {"json": [1, 2]}, 400, "invalid_json"),
    (
        "empty body",
        KEY.key,
        {"data": b"", "headers": {"content-type": "application/json"}},
        400,
        "invalid_json",
    ),
    ("form", KEY.key, {"data": {"a": "b"}}, 415, "unsupported_media_type"),
    ("no messages", KEY.key, {"json": {"model": MODEL}}, 400, None),
    ("empty messages", KEY.key, {"json": {"model": MODEL, "messages": []}}, 400, None),
    ("unknown model", KEY.key, {"json": chat("x", model="gpt-9")}, 404, "model_not_found"),
    ("stream not bool", KEY.key, {"json": chat("x", stream="yes")}, 400, None),
    ("too large", KEY.key, {"json": chat("x" * 70_000)}, 413, "body_too_large"),
    ("content a number", KEY.key,
     {"json": {"model": MODEL, "messages": [{"role": "user", "content": 5}]}}, 400, None),
    ("content an object", KEY.key,
     {"json": {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]}}, 400, None),
    ("text part without text", KEY.key,
     {"json": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}},
     400, None),
    ("stream_options a string", KEY.key,
     {"json": chat("x", stream=True, stream_options="yes")}, 400, None),
    ("include_usage a string", KEY.key,
     {"json": chat("x", stream=True, stream_options={"include_usage": "yes"})}, 400, None),
    ("stream_options without stream", KEY.key,
     {"json": chat("x", stream_options={"include_usage": True})}, 400, None),
    ("max_tokens negative", KEY.key, {"json": chat("x", max_tokens=-1)}, 400, None),
    ("max_tokens fractional", KEY.key, {"json": chat("x", max_tokens=1.5)}, 400, None),
    ("max_tokens huge", KEY.key, {"json": chat("x", max_tokens=10**30)}, 400, None),
    ("n zero", KEY.key, {"json": chat("x", n=0)}, 400, None),
    ("temperature negative", KEY.key, {"json": chat("x", temperature=-1)}, 400, None),
    ("prompt_cache_key a number", KEY.key, {"json": chat("x", prompt_cache_key=123)}, 400, None),
    ("user an object", KEY.key, {"json": chat("x", user={"id": 1})}, 400, None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "key", "kw", "status", "code"), BAD, ids=[b[0] for b in BAD])
async def test_bad_requests_get_a_clear_error_and_reach_no_origin(
    tmp_path: Path, case: str, key: str | None, kw: dict[str, Any], status: int, code: str | None
) -> None:
    s = await start_stack(tmp_path, [SimConfig(name="o1")], ["--max-body-bytes=65536"])
    try:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        resp = await s.client.post("/v1/chat/completions", headers=headers, **kw)
        assert resp.status == status, await resp.text()
        err = error_of(await resp.json())
        if code is not None:
            assert err["code"] == code
        assert s.origin_requests() == 0
    finally:
        await s.close()


async def test_a_missing_content_type_is_called_missing(stack: Stack) -> None:
    # aiohttp reports a missing Content-Type as application/octet-stream (RFC
    # 9110's default), which the client never wrote.
    resp = await stack.client.post(
        "/v1/chat/completions",
        data=b"{}",
        headers={"authorization": f"Bearer {KEY.key}"},
        skip_auto_headers=["Content-Type"],
    )
    assert resp.status == 415
    err = error_of(await resp.json())
    assert err["message"] == "Content-Type must be application/json, not missing"
    assert stack.origin_requests() == 0


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        (" application/json", 200),
        ("text/plain; charset=utf-8", 415),
        ("application/jsonx", 415),
    ],
)
async def test_a_content_type_is_its_media_type(stack: Stack, sent: str, status: int) -> None:
    # The value as sent decides alone only when it is exactly application/json;
    # any other is read for its media type, lowercased, without parameters.
    resp = await stack.client.post(
        "/v1/chat/completions",
        data=json.dumps(chat(f"type {sent}")).encode(),
        headers={"authorization": f"Bearer {KEY.key}", "content-type": sent},
    )
    assert resp.status == status, await resp.text()
    if status == 415:
        shown = sent.partition(";")[0].strip().lower()
        message = error_of(await resp.json())["message"]
        assert message == f"Content-Type must be application/json, not {shown}"
        assert stack.origin_requests() == 0


async def test_a_body_that_is_not_utf8_is_told_where(stack: Stack) -> None:
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "\xff\xfe"}]}' % (
        MODEL.encode()
    )
    resp = await stack.post_raw(raw)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert err["code"] == "invalid_json"
    at = raw.index(b"\xff")
    assert err["message"] == f"request body is not valid UTF-8 (at byte {at})"
    assert stack.origin_requests() == 0


@pytest.mark.parametrize(
    ("tail", "path"),
    [
        (b', "max_tokens": 1e400}', "max_tokens"),
        (b', "temperature": -1E999}', "temperature"),
        (b', "metadata": {"a": [1, 2e308]}}', "metadata.a[1]"),
        (b', "seed": 1%s}' % (b"0" * 400), "seed"),  # an integer no float holds
        # Past what Python's int() reads (4,300 digits; trial 36).
        (b', "top_k": -%s}' % (b"9" * 4301), "top_k"),
        # A key is quoted as far as 256 characters (trial 91: 100 KB, twice).
        (b', "metadata": {"%s": 1e400}}' % (b"k" * 100_000), "metadata." + "k" * 247),
    ],
)
async def test_a_number_past_a_64_bit_float_names_its_field(
    stack: Stack, tail: bytes, path: str
) -> None:
    """The JSON parser refused `"max_tokens": 1e400` as invalid JSON at a
    character, with no param (noticed in notes 14 to 17)."""
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "1e400"}]%s' % (
        MODEL.encode(),
        tail,
    )
    resp = await stack.post_raw(raw)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert (err["code"], err["param"]) == ("number_out_of_range", path)
    assert err["message"] == f"'{path}' is a number too large for a 64-bit float"
    assert stack.origin_requests() == 0


async def test_a_large_body_with_a_number_past_a_float_is_told_where_cheaply(
    stack: Stack,
) -> None:
    """Review 41: finding the field read the body again and made a path for
    each of its values (8 MB: 2.2 s of the event loop, 1.1 GB); past
    PAST_FLOAT_READ_MAX it is invalid JSON at a character, as before."""
    numbers = b"0," * (jsonio.PAST_FLOAT_READ_MAX // 2)
    raw = b'{"model": "%s", "messages": [], "metadata": [%s1e400]}' % (MODEL.encode(), numbers)
    resp = await stack.post_raw(raw)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert (err["code"], err["param"]) == ("invalid_json", None)
    assert "number is infinity" in err["message"]


@pytest.mark.parametrize(
    ("field", "written", "code"),
    [
        ("max_tokens", b"100000000000000000000", "integer_above_max_value"),
        ("seed", b"99999999999999999999999", "integer_above_max_value"),
        ("seed", b"-99999999999999999999999", "integer_below_min_value"),
    ],
)
async def test_an_integer_past_64_bits_is_out_of_range_not_a_decimal(
    stack: Stack, field: str, written: bytes, code: str
) -> None:
    # The JSON parser reads such an integer as a float.
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (
        MODEL.encode(),
        field.encode(),
        written,
    )
    resp = await stack.post_raw(raw)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert (err["code"], err["param"]) == (code, field)
    assert "decimal" not in err["message"]
    assert stack.origin_requests() == 0


async def test_past_its_limit_a_key_gets_429_with_retry_after(stack: Stack) -> None:
    for i in range(2):
        ok = await stack.post(chat(f"limited {i}"), key=LIMITED_KEY.key)
        assert ok.status == 200
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
    refused = await stack.post(chat("limited 3"), key=LIMITED_KEY.key)
    assert refused.status == 429
    assert error_of(await refused.json())["code"] == "rate_limit_exceeded"
    assert float(refused.headers["retry-after"]) > 0
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-request-id"]
    assert stack.origin_requests() == 2
    metrics = await (await stack.client.get("/metrics")).text()
    assert 'ponto_ratelimit_refusals_total{limit="requests"} 1.0' in metrics
    # The key's refusal is its tenant's in the report to the control plane.
    assert stack.app[METRICS].limited == {"acme": [1, 0]}


# ---------------------------------------------------------------- origins that misbehave


OriginHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def stack_on(
    tmp_path: Path,
    handler: OriginHandler,
    path: str = "/v1/chat/completions",
    args: list[str] | None = None,
) -> Stack:
    """A proxy (with `args`) whose one origin is `handler` at `path`."""
    origin_app = web.Application()
    origin_app.router.add_post(path, handler)
    origin = TestServer(origin_app)
    await origin.start_server()
    s = await start_stack(tmp_path, [], args)
    s.others.append(origin)
    s.app[HOLDER].apply(
        table([("custom", str(origin.make_url("/v1")))], version=3), "control-plane"
    )
    return s


# A stream's first chunk, as an origin sends it.
FIRST_CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}],
}


async def test_a_stream_cut_after_its_first_chunk_ends_with_an_error_event(
    tmp_path: Path,
) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps(FIRST_CHUNK).encode() + b"\n\n")
        assert request.transport is not None
        request.transport.close()  # the origin dies mid-answer
        return out

    s = await stack_on(tmp_path, cut)
    try:
        resp = await s.post(chat("cut me", stream=True))
        assert resp.status == 200
        events = await read_sse(resp)
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "par"
        assert json.loads(events[1])["error"]["code"] == "upstream_stream_broken"
        assert events[-1] == "[DONE]"
        # A cut answer is not kept: the next one goes to the origin again.
        again = await s.post(chat("cut me", stream=True))
        assert again.headers["x-ponto-cache"] == "miss"
        await again.read()
    finally:
        await s.close()


COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "created": 1,
    "model": MODEL,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


@pytest.mark.parametrize(
    ("origin", "status", "given_back"),
    [
        ("400", 400, True),  # a prompt past the model's context
        ("429", 429, True),  # busy: the proxy's own 429 (upstream_busy)
        ("refused", 502, True),  # no connection: never sent
        ("drained", 503, True),  # no origin to call
        # Billing trial 76: every origin answered 500; the budgets kept the
        # estimate (14 a request) that the access log and the metrics never saw.
        ("500", 502, True),
    ],
)
async def test_a_request_no_origin_answered_gives_its_estimate_back(
    tmp_path: Path, origin: str, status: int, given_back: bool
) -> None:
    # The tokens admission took for the prompt come back, as for a cache hit,
    # when no origin answered the request: a client fixing its request is not
    # also waiting out a minute of tokens, nor paying for an answer it never got.
    async def answer(request: web.Request) -> web.StreamResponse:
        error = {"message": "no", "type": "invalid_request_error", "code": None}
        return web.json_response({"error": error}, status=int(origin))

    s = await stack_on(tmp_path, answer)
    try:
        url = str(s.others[0].make_url("/v1"))
        if origin == "refused":
            url = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
        t = table([("custom", url)], version=4)
        t.keys[1].limits.CopyFrom(pb.Limits(tpm=1000))
        t.origins[0].drained = origin == "drained"
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        prompt = "word " * 300  # estimated at hundreds of tokens
        remaining = []
        for _ in range(2):
            resp = await s.post(chat(prompt), key=LIMITED_KEY.key)
            assert resp.status == status, await resp.text()
            await resp.read()
            remaining.append(int(resp.headers["x-ratelimit-remaining-tokens"]))
        if given_back:  # the second admission saw the whole minute's tokens
            assert remaining[0] == remaining[1] > 0, remaining
        else:
            assert remaining[0] > remaining[1], remaining
    finally:
        await s.close()


async def test_a_refusal_after_an_origin_failed_with_the_request_charges_nothing(
    tmp_path: Path,
) -> None:
    """The home origin took the request and answered 500, the next answered
    400: no origin answered, so nothing is charged. Review 49 kept the
    estimate here (the first origin's prefill may be spent), but only the
    budgets and buckets saw that charge, never the access log nor
    ponto_tenant_tokens_total (billing trial 76)."""

    calls: list[str] = []

    async def failing(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls.append("home")
        return web.json_response({"error": {"message": "engine died"}}, status=500)

    async def refusing(request: web.Request) -> web.StreamResponse:
        calls.append("far")
        error = {"message": "too long", "type": "invalid_request_error", "code": None}
        return web.json_response({"error": error}, status=400)

    s = await stack_on(tmp_path, failing)
    far_app = web.Application()
    far_app.router.add_post("/v1/chat/completions", refusing)
    far = TestServer(far_app)
    await far.start_server()
    s.others.append(far)
    try:
        t = table([("home", str(s.others[0].make_url("/v1")))], version=4)
        t.regions.append(pb.Region(name="r2", latitude=40.0, longitude=100.0))
        t.origins.append(
            pb.Origin(
                name="far",
                base_url=str(far.make_url("/v1")),
                region="r2",
                models=[MODEL],
                weight=100,
                healthy=True,
            )
        )
        t.keys[1].limits.CopyFrom(pb.Limits(tpm=1000))
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        remaining = []
        for _ in range(2):
            resp = await s.post(chat("word " * 300), key=LIMITED_KEY.key)
            assert resp.status == 400, await resp.text()
            await resp.read()
            remaining.append(int(resp.headers["x-ratelimit-remaining-tokens"]))
        assert calls == ["home", "far"] * 2
        assert remaining[0] == remaining[1] > 0, remaining
    finally:
        await s.close()


@pytest.mark.parametrize(
    ("inputs", "advice"),
    [
        (["word " * 400] * 3, "Send its 3 inputs in smaller batches"),
        ([[7] * 600, [8] * 600], "Send its 2 inputs in smaller batches"),
        ("word " * 1000, "Shorten the input, or"),
    ],
    ids=["texts", "token-arrays", "one-text"],
)
async def test_an_embeddings_batch_past_a_whole_limit_is_told_to_split_it(
    tmp_path: Path, inputs: Any, advice: str
) -> None:
    """Trial 79: a RAG app's batch past its key's whole tokens-per-minute
    limit was told to shorten its prompt, and that max_tokens did not count:
    an embeddings request has neither; its inputs can be sent in batches."""
    calls: list[bytes] = []

    async def embed(request: web.Request) -> web.StreamResponse:
        calls.append(await request.read())
        return web.json_response({"object": "list", "data": []})

    s = await stack_on(tmp_path, embed, "/v1/embeddings")
    try:
        t = table([("custom", str(s.others[0].make_url("/v1")))], version=4)
        t.keys[1].limits.CopyFrom(pb.Limits(tpm=1000))
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        headers = {"authorization": f"Bearer {LIMITED_KEY.key}"}
        body = {"model": MODEL, "input": inputs}
        resp = await s.client.post("/v1/embeddings", json=body, headers=headers)
        assert resp.status == 400, await resp.text()
        err = error_of(await resp.json())
        assert err["code"] == "tokens_over_limit"
        assert err["message"].startswith(
            "Request too large for the tokens-per-minute limit: its input is estimated at "
        )
        assert advice in err["message"]
        assert "max_tokens" not in err["message"] and "prompt" not in err["message"]
        assert calls == []
    finally:
        await s.close()


# What a hosted API sends with every answer about the operator's account.
ACCOUNT_HEADERS = {
    "openai-organization": "operator-org",
    "openai-project": "proj_operator",
    "anthropic-organization-id": "operator-org",
    "anthropic-ratelimit-requests-limit": "4000",
    "ratelimit-policy": "100;w=60",
    "x-ratelimitbysize-limit-minute": "500000",
    "x-ratelimit-limit-requests": "10000",
    "x-ratelimit-remaining-tokens": "1999000",
    "alt-svc": 'h3=":443"; ma=86400',
    "strict-transport-security": "max-age=31536000",
    "set-cookie": "__cf_bm=operator; path=/",
    "www-authenticate": 'Bearer realm="internal"',
}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_origins_account_headers_stay_at_the_edge(tmp_path: Path, stream: bool) -> None:
    async def hosted(request: web.Request) -> web.StreamResponse:
        headers = {
            **ACCOUNT_HEADERS,
            "openai-processing-ms": "42",
            # Hop-by-hop by the origin's say (trial 36), and its own name.
            "connection": "keep-alive, X-Node",
            "x-node": "node-7.internal:8000",
            "server": "uvicorn",
        }
        if not stream:
            return web.json_response(COMPLETION, headers=headers)
        out = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(STREAM_203)
        await out.write_eof()
        return out

    s = await stack_on(tmp_path, hosted)
    try:
        resp = await s.post(chat("whose account", stream=stream))
        assert resp.status == 200
        await resp.read()
        # About the answer: passed on. About the operator's account: not.
        assert resp.headers["openai-processing-ms"] == "42"
        for name in ACCOUNT_HEADERS:
            assert name not in resp.headers, name
        assert "x-node" not in resp.headers
        assert resp.headers.getall("server") == ["ponto"]
        # The unlimited key's answer carries no rate-limit headers at all.
        assert not [h for h in resp.headers if h.lower().startswith("x-ratelimit-")]
        # A limited key sees its own limits, never the origin's.
        limited = await s.post(chat("whose limits", stream=stream), key=LIMITED_KEY.key)
        await limited.read()
        assert limited.headers["x-ratelimit-limit-requests"] == "2"
        assert "x-ratelimit-remaining-tokens" not in limited.headers
    finally:
        await s.close()


STREAM_203 = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"sim-small",'
    b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


async def test_only_a_200_stream_is_kept(tmp_path: Path) -> None:
    calls = 0

    async def non_authoritative(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        out = web.StreamResponse(status=203, headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(STREAM_203)
        await out.write_eof()
        return out

    s = await stack_on(tmp_path, non_authoritative)
    try:
        for _ in range(2):
            resp = await s.post(chat("two hundred and three", stream=True))
            assert resp.status == 203
            assert resp.headers["x-ponto-cache"] == "miss"
            assert (await read_sse(resp))[-1] == "[DONE]"
        assert calls == 2
    finally:
        await s.close()


async def test_an_origin_4xx_is_passed_on_and_not_kept(tmp_path: Path) -> None:
    calls = 0

    async def refuses(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        return web.json_response(
            {"error": {"message": "context too long", "type": "invalid_request_error"}},
            status=400,
        )

    s = await stack_on(tmp_path, refuses)
    try:
        for _ in range(2):
            resp = await s.post(chat("too long"))
            assert resp.status == 400
            assert (await resp.json())["error"]["message"] == "context too long"
            assert "x-ponto-origin" not in resp.headers  # errors name no origin
        assert calls == 2
        spent = s.app[METRICS].registry.get_sample_value(
            "ponto_tenant_tokens_total", {"tenant": "acme", "key": KEY.key_id, "kind": "prompt"}
        )
        assert spent is None  # a refusal spent no tokens
    finally:
        await s.close()


async def test_a_follower_whose_leader_failed_before_a_byte_calls_the_origin_itself(
    tmp_path: Path,
) -> None:
    calls = 0

    async def first_fails(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.3)  # long enough for the second request to follow
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response(
            {
                "id": "ok",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "fine"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    s = await stack_on(tmp_path, first_fails)
    try:
        leader = asyncio.create_task(s.post(chat("shared fate")))
        await asyncio.sleep(0.1)
        follower = await s.post(chat("shared fate"))
        assert follower.status == 200
        assert (await follower.json())["choices"][0]["message"]["content"] == "fine"
        assert follower.headers["x-ponto-cache"] == "miss"
        assert "x-ponto-coalesced" not in follower.headers
        assert (await leader).status == 502
        assert calls == 2
        # The follower's own answer was kept.
        again = await s.post(chat("shared fate"))
        assert again.headers["x-ponto-cache"] == "hit"
        assert calls == 2
    finally:
        await s.close()


async def test_building_the_app_reads_nothing_and_its_start_loads_the_saved_state(
    tmp_path: Path,
) -> None:
    # A proxy that served before left its table and shares in the state dir.
    first = await start_stack(tmp_path, [SimConfig(name="o1")])
    await first.close()  # the stop step flushes both files

    settings = parse_proxy(
        ["--region=r1", "--name=again", "--control-plane=127.0.0.1:9", f"--state-dir={tmp_path}"]
    )
    app = build_app(settings)
    assert app[HOLDER].routes is None and app[QUOTA].heard is False
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        routes = app[HOLDER].routes
        assert app[HOLDER].source == "disk" and routes is not None
        assert routes.version == 2
        assert app[QUOTA].heard
    finally:
        await client.close()


# ---------------------------------------------------------------- steps without HTTP


def exchange(stack: Stack, body: dict[str, Any], key: str) -> Exchange:
    holder = stack.app[HOLDER]
    assert holder.routes is not None and holder.policy is not None
    headers = CIMultiDictProxy(CIMultiDict({"authorization": f"Bearer {key}"}))
    ex = Exchange(
        ENDPOINTS["chat.completions"], headers, "127.0.0.1", "rid", holder.routes, holder.policy
    )
    ex.body = body
    return ex


async def test_the_steps_run_on_an_exchange_without_a_server(stack: Stack) -> None:
    pipeline = stack.app[PIPELINE]
    ex = exchange(stack, chat("steps"), LIMITED_KEY.key)
    pipeline.authenticate(ex)
    assert (ex.principal.tenant, ex.principal.key_id) == ("acme", LIMITED_KEY.key_id)
    pipeline.assemble(ex)
    assert ex.model == MODEL and ex.tenant is not None and not ex.rewritten
    await pipeline.admit(ex)
    assert ex.admission is not None and ex.estimate > 0
    assert ("x-ratelimit-limit-requests", "2") in ex.limit_headers
    pipeline.settle(ex)

    unknown = exchange(stack, chat("steps", model="nope"), KEY.key)
    pipeline.authenticate(unknown)
    with pytest.raises(ApiError) as refused:
        pipeline.assemble(unknown)
    assert refused.value.status == 404
    assert stack.origin_requests() == 0


@pytest.mark.parametrize("continued", [0, 1])
async def test_an_origins_prefix_cache_is_counted_of_its_own_call(
    stack: Stack, continued: int
) -> None:
    """Review 49: a hedge's prompt, added to what the request spent, was
    counted as the winner's own prompt, halving its hit ratio; a continued
    stream's usage sums calls to several origins and is not counted."""
    pipeline = stack.app[PIPELINE]
    ex = exchange(stack, chat("hedged"), KEY.key)
    pipeline.authenticate(ex)
    ex.origin, ex.continued = "o1", continued
    ex.usage = Usage(1000, 10, exact=True, cached_tokens=900)
    ex.hedge_prompt = 1000  # a cancelled hedge's prefill, spent at another origin
    pipeline.settle(ex)
    assert ex.usage is not None and ex.usage.prompt_tokens == 2000  # both charged
    registry = stack.app[METRICS].registry
    prompt = registry.get_sample_value("ponto_origin_prompt_tokens_total", {"origin": "o1"})
    cached = registry.get_sample_value("ponto_origin_cached_prompt_tokens_total", {"origin": "o1"})
    assert (prompt, cached) == ((None, None) if continued else (1000, 900))


def test_request_ids_are_32_hex_digits_and_do_not_repeat() -> None:
    first, second = RequestIds(), RequestIds()
    ids = [first.next() for _ in range(1000)] + [second.next() for _ in range(1000)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)


def test_request_ids_do_not_count_the_proxys_traffic() -> None:
    """Trial 62: an id's tail was a counter, so any client, with a key or
    none, read how many requests of every tenant a proxy had answered
    between two of its own. Consecutive ids now differ unpredictably."""
    ids = RequestIds()
    tails = [int(ids.next()[16:], 16) for _ in range(200)]
    steps = {b - a for a, b in itertools.pairwise(tails)}
    assert len(steps) == len(tails) - 1  # no constant step, no counter
    assert sorted(tails) != tails


# ---------------------------------------------------------------- bounded cost


async def test_a_body_of_too_many_values_to_key_is_answered_but_not_cached(stack: Stack) -> None:
    # Cacheable (temperature 0), but 150,000 numbers in a field the proxy does
    # not know: keying it would walk every one on the event loop.
    body = chat("count these", x_numbers=[1] * 150_000)
    for _ in range(2):
        resp = await stack.post(body)
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ponto-cache"] == "bypass"
    assert stack.origin_requests() == 2
    bypass = stack.app[METRICS].registry.get_sample_value(
        "ponto_cache_requests_total", {"result": "bypass", "kind": "too-large"}
    )
    assert bypass == 2


async def test_text_too_costly_to_normalise_is_answered_but_not_cached(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial 36: NFKC makes U+FDFA 18 characters, at about a microsecond
    each, on the event loop: 2.7 million of them (8 MB) held a proxy for
    3.4 s. Past NORMALISE_BUDGET characters NFKC changes, the request is not
    keyed; text NFKC keeps (as much of it, in any script) is keyed as before."""
    normalised: list[int] = []
    real = textform._nfkc

    def counting(text: str) -> str:
        normalised.append(len(text))
        return real(text)

    monkeypatch.setattr(textform, "_nfkc", counting)
    over = NORMALISE_BUDGET // 2 + 1
    # Two messages, each under the budget, over it together.
    body = chat("\ufdfa" * over)
    body["messages"].insert(0, {"role": "system", "content": "\u3300" * over})
    for _ in range(2):
        resp = await stack.post(body)
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ponto-cache"] == "bypass"
        assert resp.headers["x-ponto-cache-reason"] == "too-large"
    assert normalised == [] and stack.origin_requests() == 2
    # As long, but already in NFKC (ideographs), or changed but within the
    # budget: keyed, and the repeat a hit.
    for text in ("\u4e2d" * (NORMALISE_BUDGET + 1), "\ufdfa" * (NORMALISE_BUDGET // 2)):
        for cache in ("miss", "hit"):
            resp = await stack.post(chat(text))
            assert resp.headers["x-ponto-cache"] == cache
    assert stack.origin_requests() == 4


async def test_text_of_too_many_quotes_is_answered_but_not_cached(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-tenant trial: 8 MB of `" "`, ASCII that no NFKC budget
    counts, held a proxy's loop for 3.1 s for every tenant, each quoted span
    a step in Python of the key. Past QUOTE_BUDGET quote characters the
    request is answered and not keyed; a long prompt that quotes less is
    keyed as before."""
    walked: list[str] = []
    real = textform.between

    def counting(kept: re.Pattern[str], text: str, change: Callable[[str], str]) -> str:
        walked.append(text[:20])
        return real(kept, text, change)

    monkeypatch.setattr(textform, "between", counting)
    for text in ('" "' * (QUOTE_BUDGET + 2), ' "a" "b' * (2 * QUOTE_BUDGET // 3 + 2)):
        resp = await stack.post(chat(text))
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ponto-cache"] == "bypass"
        assert resp.headers["x-ponto-cache-reason"] == "too-large"
    assert walked == [] and stack.origin_requests() == 2
    quoting = ' What is "carpe diem" in `French`?' * (QUOTE_BUDGET // 8)
    for cache in ("miss", "hit"):
        resp = await stack.post(chat(quoting))
        assert resp.headers["x-ponto-cache"] == cache
    assert stack.origin_requests() == 3


async def test_a_body_of_too_many_arrays_is_a_400_before_its_parse(stack: Stack) -> None:
    resp = await stack.post(chat("nest", x_lists=[[] for _ in range(100_001)]))
    assert resp.status == 400
    err = error_of(await resp.json())
    assert err["code"] == "invalid_json" and "100000 arrays and objects" in err["message"]
    assert stack.origin_requests() == 0


async def test_an_answer_leaves_before_the_work_after_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keeping the answer in the cache (then settling its admission, the metrics,
    # the access log) is not in the client's wait: with the cache's settling
    # held, the client has its whole answer; once it goes on, nothing was lost.
    cache = stack.app[PIPELINE].cache
    settle = cache.settle_body
    gate, kept = asyncio.Event(), asyncio.Event()

    async def held_settle(*args: Any, **kwargs: Any) -> None:
        await gate.wait()
        try:
            await settle(*args, **kwargs)
        finally:
            kept.set()

    monkeypatch.setattr(cache, "settle_body", held_settle)
    async with asyncio.timeout(10):  # the old order waited for the put: it never came
        first = await stack.post(chat("kept after it left"))
        assert first.status == 200 and first.headers["x-ponto-cache"] == "miss"
        body = await first.json()
    assert not kept.is_set()
    gate.set()
    await kept.wait()
    again = await stack.post(chat("kept after it left"))
    assert again.headers["x-ponto-cache"] == "hit"
    assert await again.json() == body
    assert stack.origin_requests() == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_failure_after_the_answer_began_gets_no_second_answer(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # A bug in the work after the answer (here the cache's settlement) must not
    # put a 500 on the connection behind the 200: the client would read it as
    # its next request's answer. The answer ended, so its connection serves
    # on (the stream is asked for with Connection: close, to read it whole).
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug after the answer")

    cache = stack.app[PIPELINE].cache
    monkeypatch.setattr(cache, "settle_stream" if stream else "settle_body", broken)

    CLOSE = "Connection: close\r\n"

    def request(text: str) -> bytes:
        body = json.dumps(chat(text, stream=stream)).encode()
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {KEY.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{CLOSE if stream else ''}\r\n"
        ).encode() + body

    assert stack.client.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.client.server.port)
    try:
        async with asyncio.timeout(10):
            if stream:
                writer.write(request("then a bug"))
                received = await reader.read()  # to the connection's end
            else:
                writer.write(request("then a bug") + request("and then another"))
                received = b""
                for _ in range(2):
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    received += head + await reader.readexactly(length)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b" 500 " not in received
    if stream:
        assert received.count(b"HTTP/1.1 ") == 1 and b"data: [DONE]" in received
    else:  # the pipelined second request was answered on the same connection
        assert received.count(b"HTTP/1.1 200 OK\r\n") == 2
    bugs = [r for r in caplog.records if "after its answer began" in r.getMessage()]
    assert len(bugs) == 1 + (not stream) and all(r.exc_info for r in bugs)
    assert (await stack.post(chat("after the bug"))).status == 200
