"""A suspended API key's callers at the proxy: 403 api_key_suspended before
anything else reads their requests (a bad body, a model off the key's list),
no origin reached, nothing taken from the key's or its tenant's limits,
logged once with the caller; the tenant's other keys served; resuming it
serves it again; a suspended tenant is said before a suspended key.
In-process: the proxy's app before an origin simulator
(tests.functional.test_pipeline). The control plane's side:
tests/unit/test_key_suspension.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from dataplane.http.refusals import refusals
from dataplane.http.state import METRICS
from ponto.originsim.app import SimConfig
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_model_access import NARROW, OTHER, apply
from tests.functional.test_pipeline import KEY, MODEL, Stack, chat, error_of, start_stack

REFUSALS = "ponto.refusals"
SUSPENDED = {
    "message": "This API key is suspended: its requests are refused until it is resumed. "
    "Contact the operator of this gateway.",
    "type": "invalid_request_error",
    "param": None,
    "code": "api_key_suspended",
}


def keys(*suspended: str) -> list[pb.ApiKey]:
    """KEY (2 requests a minute) and NARROW (MODEL only) of acme, OTHER of
    beta; those named suspended."""
    return [
        pb.ApiKey(
            id=KEY.key_id,
            hash=KEY.key_hash,
            tenant="acme",
            limits=pb.Limits(rpm=2),
            suspended=KEY.key_id in suspended,
        ),
        pb.ApiKey(
            id=NARROW.key_id,
            hash=NARROW.key_hash,
            tenant="acme",
            models=[MODEL],
            suspended=NARROW.key_id in suspended,
        ),
        pb.ApiKey(id=OTHER.key_id, hash=OTHER.key_hash, tenant="beta"),
    ]


def tenants(*suspended: str) -> list[pb.Tenant]:
    return [
        pb.Tenant(name="acme", limits=pb.Limits(rpm=3), suspended="acme" in suspended),
        pb.Tenant(name="beta"),
    ]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)])
    apply(s, 3, tenants(), keys(KEY.key_id, NARROW.key_id))
    refusals.reset()
    yield s
    await s.close()


async def test_a_suspended_keys_callers_are_refused_before_anything_reads_their_requests(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REFUSALS)
    bodies = [
        chat("hi"),
        chat("x", temperature="hot"),  # a bad body: the suspension first
        chat("x", model="sim-large"),  # off NARROW's list: the same
    ]
    before = stack.origin_requests()
    for key in (KEY.key, NARROW.key):
        for body in bodies:
            resp = await stack.post(body, key=key)
            assert resp.status == 403, await resp.text()
            assert error_of(await resp.json()) == SUSPENDED
            assert "x-ratelimit-limit-requests" not in resp.headers
        headers = {"authorization": f"Bearer {key}"}
        listed = await stack.client.get("/v1/models", headers=headers)
        assert listed.status == 403
        assert error_of(await listed.json())["code"] == "api_key_suspended"
        stored = await stack.client.get("/v1/responses/resp_x", headers=headers)
        assert stored.status == 403
        assert error_of(await stored.json())["code"] == "api_key_suspended"
    assert stack.origin_requests() == before
    lines = [r for r in caplog.records if r.name == REFUSALS]
    assert len(lines) == 10
    assert all(r.exc_info is None and "403 api_key_suspended" in r.getMessage() for r in lines)
    assert f"[key {KEY.key_id} of tenant acme]" in lines[0].getMessage()
    # A key of another tenant is served, and so, below, is the tenant's
    # other key once its suspension alone is lifted.
    assert (await stack.post(chat("hi"), key=OTHER.key)).status == 200
    apply(stack, 4, tenants(), keys(KEY.key_id))
    assert (await stack.post(chat("hi"), key=NARROW.key)).status == 200
    assert (await stack.post(chat("hi"), key=KEY.key)).status == 403


async def test_resuming_it_serves_it_with_its_limits_untouched(stack: Stack) -> None:
    for _ in range(3):
        assert (await stack.post(chat("hi"), key=KEY.key)).status == 403
    apply(stack, 4, tenants(), keys())
    for i in range(2):  # the key's 2 requests a minute: nothing was taken by the refusals
        resp = await stack.post(chat(f"back {i}"), key=KEY.key)
        assert resp.status == 200, await resp.text()
    resp = await stack.post(chat("one too many"), key=KEY.key)
    assert resp.status == 429


async def test_a_suspended_tenant_is_said_before_a_suspended_key(stack: Stack) -> None:
    apply(stack, 4, tenants("acme"), keys(KEY.key_id))
    resp = await stack.post(chat("hi"), key=KEY.key)
    assert resp.status == 403 and error_of(await resp.json())["code"] == "tenant_suspended"
    # Resuming the key alone serves nothing while its tenant is suspended.
    apply(stack, 5, tenants("acme"), keys())
    resp = await stack.post(chat("hi"), key=KEY.key)
    assert error_of(await resp.json())["code"] == "tenant_suspended"


async def test_a_deleted_tenants_series_leave_the_metrics_with_it(stack: Stack) -> None:
    """Trial 68: a deleted tenant's requests and tokens were exported until
    the proxy restarted, two series per deleted tenant per proxy for good."""

    def tenants_exported() -> set[str]:
        text = generate_latest(stack.app[METRICS].registry).decode()
        return {
            line.split('tenant="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith(("ponto_tenant_requests_total{", "ponto_tenant_tokens_total{"))
        }

    assert (await stack.post(chat("hi"), key=OTHER.key)).status == 200
    assert (await stack.post(chat("hi"), key=KEY.key)).status == 403  # suspended: counted too
    assert tenants_exported() == {"acme", "beta"}
    apply(stack, 4, tenants()[:1], keys(KEY.key_id)[:2])  # beta and its key deleted
    assert tenants_exported() == {"acme"}


async def test_a_revoked_keys_series_leave_the_metrics_with_it(stack: Stack) -> None:
    """Trial 82: a revoked key's requests and tokens were exported until the
    proxy restarted, three series or more per key ever used per process."""

    def keys_exported() -> set[str]:
        text = generate_latest(stack.app[METRICS].registry).decode()
        return {
            line.split('key="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith(("ponto_tenant_requests_total{", "ponto_tenant_tokens_total{"))
        }

    apply(stack, 4, tenants(), keys())
    for key in (KEY, NARROW):
        assert (await stack.post(chat("hi"), key=key.key)).status == 200
    assert keys_exported() == {KEY.key_id, NARROW.key_id}
    apply(stack, 5, tenants(), [k for k in keys() if k.id != NARROW.key_id])  # NARROW revoked
    assert keys_exported() == {KEY.key_id}
