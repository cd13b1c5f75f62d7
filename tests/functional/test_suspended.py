"""A suspended tenant's callers at the proxy: 403 tenant_suspended before
anything else reads their requests (a bad body, a model off a list), no
origin reached, nothing taken from their limits, logged once with the
caller; other tenants served; lifting it serves them again. In-process: the
proxy's app before an origin simulator (tests.functional.test_pipeline)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dataplane.http.refusals import refusals
from dataplane.http.state import HOLDER
from ponto.originsim.app import SimConfig
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_model_access import (
    NARROW,
    OTHER,
    apply,
    gamma_token,
)
from tests.functional.test_pipeline import KEY, MODEL, Stack, chat, error_of, start_stack

REFUSALS = "ponto.refusals"


def tenants(*suspended: str) -> list[pb.Tenant]:
    return [
        pb.Tenant(name="acme", limits=pb.Limits(rpm=2), suspended="acme" in suspended),
        pb.Tenant(name="beta", suspended="beta" in suspended),
        pb.Tenant(
            name="gamma",
            jwt=pb.JwtIssuer(
                issuer="https://id.gamma.example",
                algorithms=["HS256"],
                hs256_secret_env="GAMMA_SECRET",
            ),
            suspended="gamma" in suspended,
        ),
    ]


KEYS = [
    pb.ApiKey(id=KEY.key_id, hash=KEY.key_hash, tenant="acme"),
    pb.ApiKey(id=NARROW.key_id, hash=NARROW.key_hash, tenant="acme", models=[MODEL]),
    pb.ApiKey(id=OTHER.key_id, hash=OTHER.key_hash, tenant="beta"),
]


@pytest.fixture
async def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    monkeypatch.setenv("GAMMA_SECRET", "a-secret-of-gamma-long-enough-for-hs256-0123456789")
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)])
    apply(s, 3, tenants("acme", "gamma"), KEYS)
    refusals.reset()
    yield s
    await s.close()


async def test_a_suspended_tenants_callers_are_refused_before_anything_reads_their_requests(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REFUSALS)
    bodies = [
        chat("hi"),
        chat("x", temperature="hot"),  # a bad body: the suspension first
        chat("x", model="sim-large"),  # off NARROW's list: the same
    ]
    before = stack.origin_requests()
    for key in (KEY.key, NARROW.key, gamma_token()):
        for body in bodies:
            resp = await stack.post(body, key=key)
            assert resp.status == 403, await resp.text()
            assert error_of(await resp.json()) == {
                "message": "This account is suspended: its requests are refused. Contact the "
                "operator of this gateway.",
                "type": "invalid_request_error",
                "param": None,
                "code": "tenant_suspended",
            }
            assert "x-ratelimit-limit-requests" not in resp.headers
        listed = await stack.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert listed.status == 403
    assert stack.origin_requests() == before
    lines = [r for r in caplog.records if r.name == REFUSALS]
    assert len(lines) == 12
    assert all(r.exc_info is None and "403 tenant_suspended" in r.getMessage() for r in lines)
    assert f"[key {KEY.key_id} of tenant acme]" in lines[0].getMessage()
    # Another tenant's callers are served.
    resp = await stack.post(chat("hi"), key=OTHER.key)
    assert resp.status == 200


async def test_lifting_it_serves_them_with_their_limits_untouched(stack: Stack) -> None:
    for _ in range(3):
        assert (await stack.post(chat("hi"), key=KEY.key)).status == 403
    apply(stack, 4, tenants(), KEYS)
    for i in range(2):  # acme's 2 requests a minute: nothing was taken by the refusals
        resp = await stack.post(chat(f"back {i}"), key=KEY.key)
        assert resp.status == 200, await resp.text()
    assert (await stack.post(chat("hi"), key=gamma_token())).status == 200


async def test_an_open_fleets_callers_are_refused_when_tenant_default_is_suspended(
    stack: Stack,
) -> None:
    # As a proxy with no table yet: the stack's first table requires a key,
    # and a table that would open a closed proxy is refused (holder.refusal).
    stack.app[HOLDER].routes = None
    apply(stack, 4, [pb.Tenant(name="default", suspended=True)])
    before = stack.origin_requests()
    resp = await stack.client.post("/v1/chat/completions", json=chat("hi"))
    assert resp.status == 403 and stack.origin_requests() == before
    assert error_of(await resp.json())["code"] == "tenant_suspended"
