"""What a caller is told before its request is admitted: a request naming two
callers is refused, and a known caller's refusals and model list carry its
`x-ratelimit-*` headers without taking from its limits. In-process: the
proxy's app before an origin simulator (tests.functional.test_pipeline)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from dataplane.http.refusals import refusals
from dataplane.http.state import HOLDER
from ponto.originsim.app import SimConfig
from ponto.routetable import content_etag
from tests.functional.test_pipeline import (
    KEY,
    LIMITED_KEY,
    MODEL,
    Stack,
    chat,
    error_of,
    start_stack,
    table,
)
from tests.logcheck import errors

REFUSALS = "ponto.refusals"
CHAT = "/v1/chat/completions"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)])
    yield s
    await s.close()


@pytest.fixture(autouse=True)
def _refusals_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REFUSALS)
    refusals.reset()  # a full line budget, whatever other tests refused


def authorizations(*keys: str) -> CIMultiDict[str]:
    return CIMultiDict(("authorization", f"Bearer {key}") for key in keys)


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    assert not errors(caplog.records)
    records = [r for r in caplog.records if r.name == REFUSALS]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    return records


# ---------------------------------------------------------------- two callers in one request


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", CHAT, chat("hi")), ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None)],
)
@pytest.mark.parametrize(
    "keys", [(KEY.key, LIMITED_KEY.key), (LIMITED_KEY.key, KEY.key), (KEY.key, KEY.key)]
)
async def test_two_authorization_headers_are_refused_and_reach_no_origin(
    stack: Stack,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    body: Any,
    keys: tuple[str, ...],
) -> None:
    # A load balancer reading the last header would see another caller than
    # a proxy reading the first: neither is billed, the request is refused.
    resp = await stack.client.request(method, path, json=body, headers=authorizations(*keys))
    assert resp.status == 400, await resp.text()
    err = error_of(await resp.json())
    assert (err["type"], err["code"]) == ("invalid_request_error", "multiple_authorization_headers")
    assert err["message"].startswith("Send one Authorization header: this request has 2")
    assert resp.headers["x-request-id"]
    assert not [h for h in resp.headers if h.lower().startswith("x-ratelimit-")]
    assert stack.origin_requests() == 0
    [line] = refusal_lines(caplog)
    assert "multiple_authorization_headers" in line.getMessage()
    metrics = await (await stack.client.get("/metrics")).text()
    assert "ponto_tenant_requests_total{" not in metrics  # billed to no key


async def test_one_authorization_header_still_passes(stack: Stack) -> None:
    resp = await stack.client.post(CHAT, json=chat("one"), headers=authorizations(KEY.key))
    assert resp.status == 200, await resp.text()


async def test_an_open_proxy_refuses_two_authorization_headers_too(stack: Stack) -> None:
    # Open (no keys): the header names nobody here, but may name someone to
    # what stands in front of the proxy.
    served = [("o1", str(stack.origins[0].make_url("/v1")))]
    open_table = table(served, version=3, limited=False)
    del open_table.keys[:]
    open_table.auth_required = False
    open_table.etag = content_etag(open_table)
    # As a proxy with no table yet: the stack's first table requires a key,
    # and a table that would open a closed proxy is refused (holder.refusal).
    stack.app[HOLDER].routes = None
    stack.app[HOLDER].apply(open_table, "control-plane")
    policy = stack.app[HOLDER].policy
    assert policy is not None and policy.authenticator.open
    one = await stack.client.post(CHAT, json=chat("open"), headers=authorizations("anything"))
    assert one.status == 200, await one.text()
    two = await stack.client.post(CHAT, json=chat("open"), headers=authorizations("a", "b"))
    assert two.status == 400
    assert error_of(await two.json())["code"] == "multiple_authorization_headers"
    assert stack.origin_requests() == 1


# ---------------------------------------------------------------- limits on every answer


async def test_a_limited_callers_refusals_and_model_list_carry_its_limits_and_take_none(
    stack: Stack,
) -> None:
    # LIMITED_KEY: 2 requests a minute, its bucket full (a key new to the table).
    headers = authorizations(LIMITED_KEY.key)
    answers = {
        "400 invalid_type": await stack.client.post(
            CHAT, json=chat("x", temperature="hot"), headers=headers
        ),
        "404 model_not_found": await stack.client.post(
            CHAT, json=chat("x", model="gpt-9"), headers=headers
        ),
        "415": await stack.client.post(CHAT, data={"a": "b"}, headers=headers),
        "GET /v1/models": await stack.client.get("/v1/models", headers=headers),
        "GET /v1/models/{model}": await stack.client.get(f"/v1/models/{MODEL}", headers=headers),
        "GET /v1/models/{unknown}": await stack.client.get("/v1/models/gpt-9", headers=headers),
    }
    statuses = {what: resp.status for what, resp in answers.items()}
    assert statuses == {
        "400 invalid_type": 400,
        "404 model_not_found": 404,
        "415": 415,
        "GET /v1/models": 200,
        "GET /v1/models/{model}": 200,
        "GET /v1/models/{unknown}": 404,
    }
    for what, resp in answers.items():
        assert resp.headers.get("x-ratelimit-limit-requests") == "2", what
        # None of them was admitted: nothing taken from the bucket.
        assert resp.headers.get("x-ratelimit-remaining-requests") == "2", what
    assert stack.origin_requests() == 0
    for i in range(2):
        ok = await stack.post(chat(f"after the refusals {i}"), key=LIMITED_KEY.key)
        assert ok.status == 200, await ok.text()


async def test_a_caller_without_limits_gets_no_limit_headers_on_refusals(stack: Stack) -> None:
    resp = await stack.post(chat("x", model="gpt-9"))
    assert resp.status == 404
    models = await stack.client.get("/v1/models", headers=authorizations(KEY.key))
    assert models.status == 200
    for answer in (resp, models):
        assert not [h for h in answer.headers if h.lower().startswith("x-ratelimit-")]


async def test_a_known_callers_refusals_are_logged_with_its_key_and_tenant(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 30: a 429's log line named neither (only the access log, when
    on, did), so an operator could not tell whose requests were refused."""
    refusals.reset()
    caplog.set_level(logging.INFO, logger=REFUSALS)
    for i in range(3):  # LIMITED_KEY: 2 requests a minute
        await stack.post(chat(f"limited {i}"), key=LIMITED_KEY.key)
    await stack.post(chat("x", temperature="hot"), key=KEY.key)
    await stack.post(chat("x"), key="sk-ponto-unknownid-secret")
    lines = [r.getMessage() for r in caplog.records if r.name == REFUSALS]
    assert len(lines) == 3, lines
    assert "429 rate_limit_exceeded" in lines[0]
    assert f"[key {LIMITED_KEY.key_id} of tenant acme]" in lines[0]
    assert f"[key {KEY.key_id} of tenant acme]" in lines[1] and "400 invalid_type" in lines[1]
    assert "401" in lines[2] and "[key " not in lines[2]  # nobody's: the key is unknown


# ---------------------------------------------------------------- forged lines


async def test_a_refusal_cannot_write_a_line_of_its_own_into_the_log(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 36: the path and a quoted value went into the refusal line as
    they came, line breaks and terminal escapes included: a client wrote
    lines that read as the proxy's own."""
    forged = "2026-12-04T23:59:59.000Z WARNING ponto.auth: admin login ok"
    path = "/v1/x%0A" + forged.replace(" ", "%20") + "%0D%1B%5B31mRED%00"
    resp = await stack.client.get(path, headers=authorizations(KEY.key))
    assert resp.status == 404
    body = chat("hi")
    body["messages"][0]["role"] = "user\r\x1b[31mRED\x00\n" + forged
    resp = await stack.post(body)
    assert resp.status == 400 and error_of(await resp.json())["param"] == "messages[0].role"
    lines = [r.getMessage() for r in refusal_lines(caplog)]
    assert len(lines) == 2
    for line in lines:
        assert not any(c in line for c in "\n\r\x1b\x00"), line
    # The path as sent, its escapes kept (the decoded one hid a %2F).
    assert path in lines[0]
    assert "\\n2026-12-04T23:59:59.000Z WARNING" in lines[1]
    assert "\\r\\x1b[31mRED\\x00" in lines[1]
