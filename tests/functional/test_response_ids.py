"""Responses API ids that name the origin that stored them, in one process: the
proxy's app and three origin simulators that store responses (as vLLM
replicas with their store on, each its own), driven by the official openai
SDK over loopback.

A follow-up (`previous_response_id`) goes to the origin that stored the
response, and only there; so do the stored-response routes (retrieve,
delete, cancel, input items). Another tenant's id, or one whose origin is
not serving now, reaches no origin; an id that is not the proxy's goes on
as it came.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from openai.types.responses import ResponseCompletedEvent

from dataplane.http.state import HOLDER, METRICS
from dataplane.upstream.responseids import decode, origin_tag
from ponto.apikeys import issue_key
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import KEY, LIMITED_KEY, MODEL, Stack, start_stack, table

OTHER_KEY = issue_key()  # of tenant "other"
NAMES = ("o1", "o2", "o3")


def with_other_tenant(t: pb.RouteTable) -> pb.RouteTable:
    t.tenants.add(name="other")
    t.keys.add(id=OTHER_KEY.key_id, hash=OTHER_KEY.key_hash, tenant="other")
    t.version += 1
    t.etag = content_etag(t)
    return t


def origins_table(
    s: Stack, *, drained: str = "", removed: str = "", version: int, suspended: bool = False
) -> None:
    """The three origins again, one of them drained or removed; `suspended`:
    tenant acme too."""
    served = [
        (name, str(o.make_url("/v1")))
        for name, o in zip(NAMES, s.origins, strict=True)
        if name != removed
    ]
    t = table(served, version=version)
    for o in t.origins:
        o.drained = o.name == drained
    t.tenants[0].suspended = suspended
    s.app[HOLDER].apply(with_other_tenant(t), "control-plane")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    configs = [SimConfig(name=n, answer_tokens=5, store_responses=100) for n in NAMES]
    s = await start_stack(tmp_path, configs)
    origins_table(s, version=3)
    yield s
    while SDKS:
        await SDKS.pop().close()
    await s.close()


SDKS: list[openai.AsyncOpenAI] = []  # closed by the stack fixture


def sdk(s: Stack, key: str = KEY.key) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=str(s.client.make_url("/v1")), api_key=key, max_retries=0)
    SDKS.append(client)
    return client


def requests_by_origin(s: Stack) -> dict[str, dict[str, int]]:
    return {
        name: dict(o.app[SIM_STATE].stats.by_endpoint)
        for name, o in zip(NAMES, s.origins, strict=True)
    }


def storing_origin(s: Stack, response_id: str) -> str:
    """The origin whose store holds the response the client knows as `response_id`."""
    decoded = decode(response_id)
    assert decoded is not None, response_id
    holders = [
        name
        for name, o in zip(NAMES, s.origins, strict=True)
        if decoded.original in o.app[SIM_STATE].responses
    ]
    assert len(holders) == 1
    assert decoded.origin == origin_tag(holders[0])
    return holders[0]


async def test_every_follow_up_goes_to_the_origin_that_stored_its_previous_response(
    stack: Stack,
) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="the first turn")
    assert first.id.startswith("resp_")
    home = storing_origin(stack, first.id)
    assert home not in first.id  # the tag is a hash, not the origin's name
    previous = first.id
    for turn in range(20):
        answer = await client.responses.create(
            model=MODEL, input=f"follow-up number {turn}", previous_response_id=previous
        )
        assert answer.previous_response_id == previous  # shown as the client sent it
        assert answer.output_text
        assert storing_origin(stack, answer.id) == home
        previous = answer.id
    counts = requests_by_origin(stack)
    assert counts[home] == {"/v1/responses": 21}
    assert all(not c for name, c in counts.items() if name != home)
    routes = stack.app[METRICS].registry.get_sample_value(
        "ponto_route_decisions_total", {"reason": "pinned", "origin": home}
    )
    assert routes == 20


async def test_a_streamed_follow_up_is_pinned_and_shows_every_id_as_the_clients(
    stack: Stack,
) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="stream me later")
    home = storing_origin(stack, first.id)
    previous = first.id
    for turn in range(20):
        events = [
            e
            async for e in await client.responses.create(
                model=MODEL,
                input=f"streamed turn {turn}",
                previous_response_id=previous,
                stream=True,
            )
        ]
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        created, completed = events[0].response, events[-1].response  # type: ignore[union-attr]
        assert created.id == completed.id
        assert completed.previous_response_id == created.previous_response_id == previous
        assert storing_origin(stack, completed.id) == home
        previous = completed.id
    assert requests_by_origin(stack)[home] == {"/v1/responses": 21}


async def test_the_stored_routes_reach_the_storing_origin_through_the_sdk(
    stack: Stack,
) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="the question")
    second = await client.responses.create(
        model=MODEL, input="and another", previous_response_id=first.id
    )
    home = storing_origin(stack, second.id)

    got = await client.responses.retrieve(second.id)
    assert got.id == second.id and got.previous_response_id == first.id
    assert got.output_text == second.output_text

    events = [e async for e in await client.responses.retrieve(second.id, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    assert last.response.id == second.id
    assert last.response.previous_response_id == first.id

    items = await client.responses.input_items.list(second.id)
    texts = [i.model_dump()["content"][0]["text"] for i in items.data]
    assert texts == ["and another"]

    with pytest.raises(openai.BadRequestError) as cancelled:
        await client.responses.cancel(second.id)
    assert "Cannot cancel a synchronous response" in cancelled.value.message

    await client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.retrieve(second.id)
    # The origin's message, naming the id the client knows.
    assert f"Response with id '{second.id}' not found." in gone.value.message

    counts = requests_by_origin(stack)
    one = "/v1/responses/{response_id}"
    assert counts[home] == {
        "/v1/responses": 2,
        one: 4,
        one + "/input_items": 1,
        one + "/cancel": 1,
    }
    assert all(not c for name, c in counts.items() if name != home)
    registry = stack.app[METRICS].registry
    for endpoint, status, count in (
        ("responses.retrieve", "200", 2),
        ("responses.retrieve", "404", 1),
        ("responses.input_items", "200", 1),
        ("responses.cancel", "400", 1),
        ("responses.delete", "200", 1),
    ):
        sample = registry.get_sample_value(
            "ponto_requests_total", {"endpoint": endpoint, "code": status}
        )
        assert sample == count, (endpoint, status)


async def test_another_tenant_cannot_use_an_id(stack: Stack) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="mine only")
    before = stack.origin_requests()
    other = sdk(stack, OTHER_KEY.key)
    with pytest.raises(openai.BadRequestError) as follow:
        await other.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert follow.value.code == "previous_response_not_found"
    assert follow.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as retrieve:
        await other.responses.retrieve(first.id)
    assert retrieve.value.code == "not_found"
    assert retrieve.value.message.endswith(f"No response found with id '{first.id}'.")
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(first.id)
    assert stack.origin_requests() == before


@pytest.mark.parametrize("how", ["drained", "removed"])
async def test_an_origin_not_serving_now_is_a_400_and_no_origin_is_reached(
    stack: Stack, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="before the drain")
    home = storing_origin(stack, first.id)
    if how == "drained":
        origins_table(stack, version=4, drained=home)
    else:
        origins_table(stack, version=4, removed=home)
    before = stack.origin_requests()
    with caplog.at_level(logging.INFO), pytest.raises(openai.BadRequestError) as follow:
        await client.responses.create(model=MODEL, input="after it", previous_response_id=first.id)
    error = follow.value
    assert error.code == "previous_response_not_found"
    assert "not serving" in error.message
    assert stack.origin_requests() == before
    lines = [r for r in caplog.records if first.id in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    assert stack.origin_requests() == before


async def test_an_id_not_the_proxys_goes_on_unpinned(stack: Stack) -> None:
    client = sdk(stack)
    with pytest.raises(openai.NotFoundError) as follow:
        await client.responses.create(
            model=MODEL, input="x", previous_response_id="resp_made_elsewhere"
        )
    # The origin's own 404 (vLLM's words), for the id as it was sent.
    assert "Response with id 'resp_made_elsewhere' not found" in follow.value.message
    sent = [
        o.app[SIM_STATE].stats.last_request
        for o in stack.origins
        if o.app[SIM_STATE].stats.requests
    ]
    assert len(sent) == 1 and sent[0] is not None
    body = sent[0]["body"]
    assert isinstance(body, dict) and body["previous_response_id"] == "resp_made_elsewhere"
    # A stored response's route needs an id of the proxy's: no origin is asked.
    with pytest.raises(openai.NotFoundError) as retrieve:
        await client.responses.retrieve("resp_made_elsewhere")
    assert retrieve.value.code == "not_found" and retrieve.value.param == "response_id"
    assert stack.origin_requests() == 1


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/responses/" + "r" * 300, 400, "invalid_value"),
        ("/v1/responses/resp%20x", 400, "invalid_value"),
        ("/v1/responses/resp%22x/cancel", 400, "invalid_value"),
        ("/v1/responses/resp_x_ponto" + "0" * 24 + "/input_items", 404, "not_found"),
    ],
)
async def test_a_bad_id_reaches_no_origin(stack: Stack, path: str, status: int, code: str) -> None:
    auth = {"authorization": f"Bearer {KEY.key}"}
    method = "POST" if path.endswith("/cancel") else "GET"
    resp = await stack.client.request(method, path, headers=auth)
    assert resp.status == status
    body = await resp.json()
    assert body["error"]["code"] == code and body["error"]["param"] == "response_id"
    assert stack.origin_requests() == 0
    unauthenticated = await stack.client.request(method, path)
    assert unauthenticated.status == 401


async def test_a_suspended_tenant_is_refused_the_stored_routes(stack: Stack) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="before")
    origins_table(stack, version=4, suspended=True)
    before = stack.origin_requests()
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await sdk(stack).responses.retrieve(first.id)
    assert refused.value.code == "tenant_suspended"
    assert stack.origin_requests() == before


async def test_a_stored_route_is_a_request_under_the_keys_limit(stack: Stack) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="limit me")
    limited = sdk(stack, LIMITED_KEY.key)
    for _ in range(2):  # the key's 2 requests a minute
        await limited.responses.retrieve(first.id)
    with pytest.raises(openai.RateLimitError):
        await limited.responses.retrieve(first.id)
    assert stack.origin_requests() == 3


WHOLE = {
    "id": "resp_whole1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": MODEL,
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "id resp_whole1", "annotations": []}],
        }
    ],
    "previous_response_id": None,
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
}


async def test_a_whole_answer_turned_into_a_stream_shows_the_proxys_id(
    tmp_path: Path,
) -> None:
    async def whole(request: web.Request) -> web.Response:
        return web.json_response(WHOLE)  # the stream asked for, ignored

    from tests.functional.test_pipeline import stack_on  # noqa: PLC0415

    s = await stack_on(tmp_path, whole, path="/v1/responses")
    try:
        resp = await s.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "stream": True},
            headers={"authorization": f"Bearer {KEY.key}"},
        )
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
        datas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        ids = {d["response"]["id"] for d in datas if "response" in d}
        assert len(ids) == 1
        (shown,) = ids
        decoded = decode(shown)
        assert decoded is not None and decoded.original == "resp_whole1"
        assert decoded.origin == origin_tag("custom")
        # Only the id as a JSON string is rewritten: the text that holds it is not.
        texts = [d["delta"] for d in datas if d.get("type") == "response.output_text.delta"]
        assert "".join(texts) == "id resp_whole1"
        plain = await s.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x"},
            headers={"authorization": f"Bearer {KEY.key}"},
        )
        body: dict[str, Any] = await plain.json()
        assert body["id"] == shown
    finally:
        await s.close()


async def test_an_origin_without_the_stored_routes_answers_404_and_stays_healthy(
    tmp_path: Path,
) -> None:
    async def whole(request: web.Request) -> web.Response:
        return web.json_response({**WHOLE, "id": "resp_only_made"})

    from tests.functional.test_pipeline import stack_on  # noqa: PLC0415

    # aiohttp's own 404 for GET /v1/responses/...: no OpenAI-style error.
    s = await stack_on(tmp_path, whole, path="/v1/responses")
    auth = {"authorization": f"Bearer {KEY.key}"}
    try:
        made = await s.client.post(
            "/v1/responses", json={"model": MODEL, "input": "x"}, headers=auth
        )
        shown = (await made.json())["id"]
        for _ in range(6):  # past the outlier detector's failures in a row
            resp = await s.client.get(f"/v1/responses/{shown}", headers=auth)
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "upstream_error"
        registry = s.app[METRICS].registry
        ejections = registry.get_sample_value("ponto_origin_ejections_total", {"origin": "custom"})
        assert not ejections
        failed = registry.get_sample_value(
            "ponto_upstream_attempts_total", {"origin": "custom", "outcome": "bad_answer"}
        )
        assert not failed
    finally:
        await s.close()
