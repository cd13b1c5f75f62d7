"""Responses API ids that name the origin that stored them, in one process: the
proxy's app and three origin simulators that store responses (as vLLM
replicas with their store on, each its own), driven by the official openai
SDK over loopback.

A follow-up (`previous_response_id`) goes to the origin that stored the
response, and only there; so do the stored-response routes (retrieve,
delete, cancel, input items). Another tenant's id, one forged from the
caller's own ids, one the gateway did not make (an origin's own id, which an
id of ours shows as its prefix), or one whose origin is not serving now,
reaches no origin.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from openai.types.responses import ResponseCompletedEvent

from dataplane.http.errors import PINNED_UNHEALTHY, PINNED_UNREACHABLE, UPSTREAM_FAILED
from dataplane.http.state import HOLDER, METRICS, PIPELINE
from dataplane.upstream.responseids import IdKeys, decode, origin_tag
from ponto.apikeys import issue_key
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import (
    ID_KEY,
    KEY,
    LIMITED_KEY,
    MODEL,
    Stack,
    stack_on,
    start_stack,
    table,
)

OTHER_KEY = issue_key()  # of tenant "other"
NAMES = ("o1", "o2", "o3")


def with_other_tenant(t: pb.RouteTable) -> pb.RouteTable:
    t.tenants.add(name="other")
    t.keys.add(id=OTHER_KEY.key_id, hash=OTHER_KEY.key_hash, tenant="other")
    t.version += 1
    t.etag = content_etag(t)
    return t


def origins_table(
    s: Stack,
    *,
    drained: str = "",
    removed: str = "",
    version: int,
    suspended: bool = False,
    unserved: str = "",
    unhealthy: str = "",
    keys: bool = True,
) -> None:
    """The three origins again, one of them drained or removed, or
    (`unserved`) serving another model than MODEL; `suspended`: tenant acme
    too; without `keys`, the table of a control plane older than the id keys."""
    served = [
        (name, str(o.make_url("/v1")))
        for name, o in zip(NAMES, s.origins, strict=True)
        if name != removed
    ]
    t = table(served, version=version)
    for o in t.origins:
        o.drained = o.name == drained
        o.healthy = o.name != unhealthy
        if o.name == unserved:
            o.models[:] = ["sim-other"]
    t.tenants[0].suspended = suspended
    if not keys:
        del t.response_id_keys[:]
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
    # The words of an id never made: nothing tells whose an id is.
    with pytest.raises(openai.BadRequestError) as never:
        await other.responses.create(model=MODEL, input="x", previous_response_id="resp_never_made")
    assert follow.value.message.replace(first.id, "resp_never_made") == never.value.message
    with pytest.raises(openai.NotFoundError) as retrieve:
        await other.responses.retrieve(first.id)
    assert retrieve.value.code == "not_found"
    assert retrieve.value.message.endswith(f"No response found with id '{first.id}'.")
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(first.id)
    assert stack.origin_requests() == before


def other_born(s: Stack, birth: int, key: Any, version: int, owners_from: int = 0) -> None:
    """Tenant "other", its record created at revision `birth`, with `key`;
    ids signed for records from revision `owners_from` (0: not said)."""
    served = [(name, str(o.make_url("/v1"))) for name, o in zip(NAMES, s.origins, strict=True)]
    t = table(served, version=version)
    t.response_id_owners_from = owners_from
    t.tenants.add(name="other")
    t.keys.add(id=key.key_id, hash=key.key_hash, tenant="other")
    t.purges.add(revision=birth, tenant="other", birth=True)
    t.etag = content_etag(t)
    s.app[HOLDER].apply(t, "control-plane")


async def test_a_tenant_made_again_under_a_deleted_ones_name_cannot_use_its_ids(
    stack: Stack,
) -> None:
    """Trial 62: a tenant deleted and made again under its name read the
    stored responses of the first (input items, follow-ups), where the
    caches start it from nothing. Ids are signed for the tenant's record
    (its birth); the record's own ids still work."""
    other_born(stack, 10, OTHER_KEY, version=4)
    first = await sdk(stack, OTHER_KEY.key).responses.create(model=MODEL, input="payroll 42")
    assert (await sdk(stack, OTHER_KEY.key).responses.retrieve(first.id)).id == first.id
    again = issue_key()
    other_born(stack, 20, again, version=5)  # deleted, made again
    before = stack.origin_requests()
    newcomer = sdk(stack, again.key)
    with pytest.raises(openai.NotFoundError):
        await newcomer.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as follow:
        await newcomer.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert follow.value.code == "previous_response_not_found"
    assert stack.origin_requests() == before


@pytest.mark.parametrize("owners_from", [0, 15])
async def test_an_id_signed_for_the_tenants_name_alone_still_works(
    stack: Stack, owners_from: int
) -> None:
    """Ids made by proxies from before ids were signed for a tenant's record
    (for its name alone) go on working for that name's record born before
    then (or when the table does not say when: an older control plane)."""
    other_born(stack, 10, OTHER_KEY, version=4, owners_from=owners_from)
    client = sdk(stack, OTHER_KEY.key)
    made = await client.responses.create(model=MODEL, input="made before the upgrade")
    decoded = decode(made.id)
    assert decoded is not None
    legacy = IdKeys([ID_KEY]).encode(decoded.original, decoded.origin, "other")
    assert legacy != made.id
    assert (await client.responses.retrieve(legacy)).id == legacy


async def test_a_record_born_after_ids_were_signed_for_records_takes_no_name_only_id(
    stack: Stack,
) -> None:
    """Review of f0455bc: ids signed for the name alone were taken by every
    later record of the name, so the hole stayed open for every id made
    before the upgrade. A record born after the revision from which ids are
    signed for records (the table's response_id_owners_from) had none made
    for it."""
    other_born(stack, 10, OTHER_KEY, version=4, owners_from=15)
    made = await sdk(stack, OTHER_KEY.key).responses.create(model=MODEL, input="old tenant")
    decoded = decode(made.id)
    assert decoded is not None
    legacy = IdKeys([ID_KEY]).encode(decoded.original, decoded.origin, "other")
    again = issue_key()
    other_born(stack, 20, again, version=5, owners_from=15)  # deleted, made again
    newcomer = sdk(stack, again.key)
    for sent in (legacy, made.id):
        with pytest.raises(openai.NotFoundError):
            await newcomer.responses.retrieve(sent)


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


@pytest.mark.parametrize("stream", [False, True])
async def test_a_background_response_is_refused_and_reaches_no_origin(
    stack: Stack, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Its create answer has no usage (`queued`) and its retrieve is charged no
    tokens: let through, its tokens would reach no limit or budget (trial 80)."""
    client = sdk(stack)
    with caplog.at_level(logging.INFO), pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model=MODEL, input="a long essay", background=True, stream=stream
        )
    error = refused.value
    assert (error.code, error.param) == ("invalid_value", "background")
    assert "count their tokens" in error.message
    assert stack.origin_requests() == 0
    lines = [r for r in caplog.records if "background" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    answer = await client.responses.create(model=MODEL, input="now", background=False)
    assert answer.status == "completed"


async def test_a_follow_up_with_a_conversation_too_is_refused_and_reaches_no_origin(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Two sources of earlier turns, which OpenAI refuses together (trial 80)."""
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="x")
    before = stack.origin_requests()
    with caplog.at_level(logging.INFO), pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model=MODEL, input="y", previous_response_id=first.id, conversation="conv_1"
        )
    error = refused.value
    assert (error.code, error.param) == ("invalid_value", "previous_response_id")
    assert "'conversation'" in error.message
    assert stack.origin_requests() == before
    lines = [r for r in caplog.records if "'conversation'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


async def test_a_follow_up_whose_origin_is_unhealthy_is_a_503_to_retry(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe's verdict may pass with the origin's store intact: the client is
    told to retry (as for the 502 of that origin unreachable before the probes
    marked it), not the 400 that says to start again, and the conversation
    goes on once the origin is healthy (trial 80)."""
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="before the probe failed")
    home = storing_origin(stack, first.id)
    origins_table(stack, version=4, unhealthy=home)
    before = stack.origin_requests()
    for stream in (False, True):
        with caplog.at_level(logging.INFO), pytest.raises(openai.InternalServerError) as follow:
            await client.responses.create(
                model=MODEL, input="after it", previous_response_id=first.id, stream=stream
            )
        error = follow.value
        assert error.status_code == 503 and error.response.headers["retry-after"] == "5"
        assert (error.code, error.param) == ("no_healthy_origin", "previous_response_id")
        assert error.message.endswith(PINNED_UNHEALTHY)
    with pytest.raises(openai.InternalServerError) as retrieve:
        await client.responses.retrieve(first.id)
    assert (retrieve.value.status_code, retrieve.value.code) == (503, "no_healthy_origin")
    assert first.id in retrieve.value.message
    assert stack.origin_requests() == before
    lines = [r for r in caplog.records if "is unhealthy now" in r.getMessage()]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
    origins_table(stack, version=5)
    after = await client.responses.create(
        model=MODEL, input="after it", previous_response_id=first.id
    )
    assert storing_origin(stack, after.id) == home


def original_of(shown: str) -> str:
    decoded = decode(shown)
    assert decoded is not None
    return decoded.original


async def test_an_id_the_gateway_did_not_make_is_refused_and_reaches_no_origin(
    stack: Stack,
) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="mine only")
    before = stack.origin_requests()
    # An origin's own id, as every id of ours shows it (its prefix): the
    # review's tenant B continued A's conversation with it whenever placement
    # landed on the storing origin. Refused for its own tenant too.
    for key, sent in (
        (OTHER_KEY.key, original_of(first.id)),
        (KEY.key, original_of(first.id)),
        (KEY.key, "resp_made_elsewhere"),
    ):
        with pytest.raises(openai.BadRequestError) as follow:
            await sdk(stack, key).responses.create(
                model=MODEL, input="x", previous_response_id=sent
            )
        error = follow.value
        assert (error.code, error.param) == ("previous_response_not_found", "previous_response_id")
        assert f"Previous response with id '{sent}' not found" in error.message
        assert "this gateway" in error.message
    # A stored response's route needs an id of the proxy's: no origin is asked.
    with pytest.raises(openai.NotFoundError) as retrieve:
        await sdk(stack).responses.retrieve(original_of(first.id))
    assert retrieve.value.code == "not_found" and retrieve.value.param == "response_id"
    assert stack.origin_requests() == before


async def test_another_tenant_cannot_forge_an_id_from_one_of_its_own(stack: Stack) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="mine only")
    home = storing_origin(stack, first.id)
    other = sdk(stack, OTHER_KEY.key)
    # The other tenant's own id of the same origin: with unkeyed tags its
    # suffix made any original good for that tenant.
    for turn in range(60):
        own = await other.responses.create(model=MODEL, input=f"my own, number {turn}")
        if storing_origin(stack, own.id) == home:
            break
    else:
        pytest.fail("the other tenant's answers never landed on the storing origin")
    forged = original_of(first.id) + own.id[len(original_of(own.id)) :]
    assert forged != first.id
    before = stack.origin_requests()
    with pytest.raises(openai.BadRequestError) as follow:
        await other.responses.create(model=MODEL, input="x", previous_response_id=forged)
    assert follow.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(forged)
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(forged)
    with pytest.raises(openai.NotFoundError):
        await other.responses.input_items.list(forged)
    assert stack.origin_requests() == before
    assert original_of(first.id) in stack.origins[NAMES.index(home)].app[SIM_STATE].responses


@pytest.mark.parametrize("dots", [".", ".."])
async def test_a_dot_segment_id_reaches_no_origin(stack: Stack, dots: str) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="x")
    sent = dots + first.id[len(original_of(first.id)) :]
    auth = {"authorization": f"Bearer {KEY.key}"}
    before = stack.origin_requests()
    for method, path in (
        ("POST", f"/v1/responses/{sent}/cancel"),
        ("GET", f"/v1/responses/{sent}"),
        ("DELETE", f"/v1/responses/{sent}"),
        ("GET", f"/v1/responses/{sent}/input_items"),
    ):
        resp = await stack.client.request(method, path, headers=auth)
        assert resp.status == 400, (method, path)
        error = (await resp.json())["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "response_id")
    with pytest.raises(openai.BadRequestError) as follow:
        await sdk(stack).responses.create(model=MODEL, input="x", previous_response_id=sent)
    assert follow.value.code == "previous_response_not_found"
    assert stack.origin_requests() == before


@pytest.mark.parametrize("how", ["500", "refused"])
async def test_a_pinned_follow_up_whose_origin_fails_is_a_5xx_and_no_other_origin_is_called(
    stack: Stack, how: str
) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="before it fails")
    home = storing_origin(stack, first.id)
    server = stack.origins[NAMES.index(home)]
    if how == "500":
        state = server.app[SIM_STATE]
        state.config = dataclasses.replace(state.config, mode="fail", fail_status=500)
    else:
        await server.close()  # connection refused
    before = requests_by_origin(stack)
    with pytest.raises(openai.APIStatusError) as follow:
        await client.responses.create(model=MODEL, input="after", previous_response_id=first.id)
    assert 500 <= follow.value.status_code < 600
    # Said to be the pinned origin's failure (trial 64: a bare "retry shortly").
    assert follow.value.response.headers["x-ponto-route"] == "pinned"
    after = requests_by_origin(stack)
    assert {n: c for n, c in after.items() if n != home} == {
        n: c for n, c in before.items() if n != home
    }
    if how == "500":
        assert after[home]["/v1/responses"] > before[home]["/v1/responses"]
        assert follow.value.body == {  # it was reached: said as it is
            "message": UPSTREAM_FAILED, "type": "upstream_error", "param": None,
            "code": "upstream_unavailable",
        }  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pinned_follow_up_whose_origin_is_down_says_where_its_response_lives(
    stack: Stack, stream: bool
) -> None:
    """Trial 64: "could not be reached; retry shortly", which never helps if
    the origin is gone for good, and nothing said the previous response lives
    on that one origin, nor that the conversation sent again goes elsewhere."""
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="before it stops")
    home = storing_origin(stack, first.id)
    await stack.origins[NAMES.index(home)].close()
    with pytest.raises(openai.APIStatusError) as follow:
        await client.responses.create(
            model=MODEL, input="after", previous_response_id=first.id, stream=stream
        )
    error = follow.value
    assert error.status_code == 502
    assert error.response.headers["x-ponto-route"] == "pinned"
    body = error.response.json()["error"]
    assert body == {
        "message": PINNED_UNREACHABLE,
        "type": "upstream_error",
        "param": "previous_response_id",
        "code": "upstream_unavailable",
    }
    assert "stored on one origin" in body["message"]
    # As it says: the conversation sent again without the id is answered elsewhere.
    again = await client.responses.create(model=MODEL, input="before it stops\nafter")
    assert storing_origin(stack, again.id) != home


async def test_a_follow_up_for_a_model_its_origin_does_not_serve_is_a_400(stack: Stack) -> None:
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="x")
    home = storing_origin(stack, first.id)
    origins_table(stack, version=4, unserved=home)
    before = stack.origin_requests()
    with pytest.raises(openai.BadRequestError) as follow:
        await client.responses.create(model=MODEL, input="y", previous_response_id=first.id)
    assert follow.value.code == "previous_response_not_found"
    # The origin serves: not the words of one drained or removed (trial 80).
    assert f"does not serve model '{MODEL}'" in follow.value.message
    assert "drained" not in follow.value.message
    assert stack.origin_requests() == before


@pytest.mark.parametrize("gone", ["deleted", "not stored"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_follow_up_its_origin_no_longer_holds_is_a_400_naming_the_clients_id(
    stack: Stack, gone: str, stream: bool
) -> None:
    """vLLM answers 404 `Response with id '...' not found`, which the SDK
    raises as NotFoundError (as for a wrong URL); OpenAI, and the proxy for an
    origin that left, answer 400 previous_response_not_found (trial 80)."""
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="x", store=gone != "not stored")
    home = storing_origin(stack, first.id) if gone == "deleted" else None
    if gone == "deleted":
        await client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as follow:
        await client.responses.create(
            model=MODEL, input="y", previous_response_id=first.id, stream=stream
        )
    error = follow.value
    assert (error.code, error.param) == ("previous_response_not_found", "previous_response_id")
    assert f"Previous response with id '{first.id}' not found" in error.message
    assert "no longer holds it" in error.message
    assert f"'{original_of(first.id)}'" not in error.message
    assert error.response.headers["x-ponto-route"] == "pinned"
    if home is not None:  # the origin was asked: only it knows
        assert requests_by_origin(stack)[home]["/v1/responses"] == 2


async def test_a_pinned_origins_404_that_names_no_id_is_passed_on(stack: Stack) -> None:
    """A 404 of another cause (an origin that does not know the model after
    all) is no word on the previous response: relayed as it came."""
    client = sdk(stack)
    first = await client.responses.create(model=MODEL, input="x")
    state = stack.origins[NAMES.index(storing_origin(stack, first.id))].app[SIM_STATE]
    state.config = dataclasses.replace(state.config, mode="fail", fail_status=404)
    with pytest.raises(openai.NotFoundError) as follow:
        await client.responses.create(model=MODEL, input="y", previous_response_id=first.id)
    assert follow.value.code != "previous_response_not_found"
    assert "Injected failure" in follow.value.message


async def test_a_table_without_id_keys_pins_nothing_and_says_so_once(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    first = await sdk(stack).responses.create(model=MODEL, input="x")
    with caplog.at_level(logging.WARNING):
        origins_table(stack, version=4, keys=False)
        origins_table(stack, version=5, keys=False, drained="o1")
    said = [r for r in caplog.records if "no response id keys" in r.getMessage()]
    assert len(said) == 1
    client = sdk(stack)
    made = await client.responses.create(model=MODEL, input="x")
    assert decode(made.id) is None  # the origin's id, as it made it
    # An id goes on as it came, to whichever origin placement picks.
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(
            model=MODEL, input="y", previous_response_id="resp_made_elsewhere"
        )
    before = stack.origin_requests()
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)  # no id can be checked
    assert stack.origin_requests() == before


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/responses/" + "r" * 300, 400, "invalid_value"),
        ("/v1/responses/resp%20x", 400, "invalid_value"),
        ("/v1/responses/resp%22x/cancel", 400, "invalid_value"),
        ("/v1/responses/resp.x", 400, "invalid_value"),
        ("/v1/responses/resp~x/cancel", 400, "invalid_value"),
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


async def test_a_response_created_longer_than_the_held_opening_is_rewritten(
    tmp_path: Path,
) -> None:
    # response.created echoes the request's instructions: 100 KB of them,
    # past the 64 KiB the forwarder holds of a stream's opening, in 30 KB writes.
    instructions = "i" * 100_000
    events = [
        {
            "type": "response.created",
            "sequence_number": 0,
            "response": {
                **WHOLE,
                "status": "in_progress",
                "output": [],
                "instructions": instructions,
            },
        },
        {
            "type": "response.output_text.delta",
            "sequence_number": 1,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "id resp_whole1",
        },
        {
            "type": "response.completed",
            "sequence_number": 2,
            "response": {**WHOLE, "instructions": instructions},
        },
    ]
    data = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)

    async def streamed(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for at in range(0, len(data), 30_000):
            await out.write(data[at : at + 30_000])
            await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    s = await stack_on(tmp_path, streamed, path="/v1/responses")
    try:
        resp = await s.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "stream": True, "instructions": instructions},
            headers={"authorization": f"Bearer {KEY.key}"},
        )
        assert resp.status == 200
        raw = (await resp.read()).decode()
        datas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        assert [d["type"] for d in datas] == [e["type"] for e in events]
        ids = {d["response"]["id"] for d in datas if "response" in d}
        assert len(ids) == 1
        (shown,) = ids
        decoded = decode(shown)
        assert decoded is not None and decoded.original == "resp_whole1"
        assert decoded.origin == origin_tag("custom")
        assert datas[1]["delta"] == "id resp_whole1"
        assert datas[0]["response"]["instructions"] == instructions
    finally:
        await s.close()


async def test_a_stored_route_takes_the_callers_tenants_share(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of f0455bc: the stored-response routes passed the ids' owner
    ("acme\\0<birth>") as the tenant whose share of the origin's connections
    the call takes, a second share to the tenant, and one that made its own
    share bind against itself."""
    other_born(stack, 10, OTHER_KEY, version=4)
    client = sdk(stack, OTHER_KEY.key)
    made = await client.responses.create(model=MODEL, input="kept")
    forwarder = stack.app[PIPELINE].forwarder
    real = forwarder.forward
    tenants: list[str] = []

    async def forward(*args: Any, **kw: Any) -> Any:
        tenants.append(kw["tenant"])
        return await real(*args, **kw)

    monkeypatch.setattr(forwarder, "forward", forward)
    await client.responses.retrieve(made.id)
    assert tenants == ["other"]
