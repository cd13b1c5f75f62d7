"""The models a tenant's and a key's callers may name, in the proxy's pipeline.

A tenant's list holds names as clients send them: an alias on it works while
its target, named directly, is refused; a key's list narrows its tenant's. A
model off the list is answered as one no origin serves (OpenAI's 404
`model_not_found`, which does not tell a model that exists from one that does
not), reaches no origin, takes nothing from the caller's limits and is logged
once without a traceback; `GET /v1/models` lists only what the caller may
name. In-process: the proxy's app before an origin simulator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest

from dataplane.http.refusals import refusals
from dataplane.http.state import HOLDER
from ponto.apikeys import issue_key
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import KEY, MODEL, Stack, chat, error_of, start_stack

LARGE = "sim-large"  # served, but off acme's list
FAST = "fast"  # acme's alias of LARGE, on its list
NARROW = issue_key()  # an acme key that may name MODEL only
OTHER = issue_key()  # tenant beta's key: beta has no list
ISSUER = "https://id.gamma.example"  # tenant gamma's JWTs: gamma may name MODEL
SECRET = "a-secret-of-gamma-long-enough-for-hs256-0123456789"


def gamma_token() -> str:
    claims = {"iss": ISSUER, "sub": "user-1", "exp": int(time.time()) + 300}
    return jwt.encode(claims, SECRET, algorithm="HS256")


def apply(
    stack: Stack, version: int, tenants: list[pb.Tenant], keys: list[pb.ApiKey] | None = None
) -> None:
    """A table of one origin serving MODEL and LARGE, with these tenants and
    keys (none: an open fleet), applied to the proxy."""
    origin = pb.Origin(
        name="o1",
        base_url=str(stack.origins[0].make_url("/v1")),
        region="r1",
        models=[MODEL, LARGE],
        weight=100,
        healthy=True,
    )
    t = pb.RouteTable(
        version=version,
        regions=[pb.Region(name="r1", latitude=0.0, longitude=0.0)],
        origins=[origin],
        tenants=tenants,
        keys=keys or [],
        auth_required=bool(keys),
    )
    t.etag = content_etag(t)
    stack.app[HOLDER].apply(t, "control-plane")


@pytest.fixture
async def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    monkeypatch.setenv("GAMMA_SECRET", SECRET)
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)])
    apply(
        s,
        3,
        [
            pb.Tenant(
                name="acme",
                prompt=pb.PromptPolicy(aliases={FAST: LARGE}),
                models=pb.ModelAccess(names=[FAST, MODEL]),
                limits=pb.Limits(rpm=2),
            ),
            pb.Tenant(name="beta"),
            pb.Tenant(
                name="gamma",
                jwt=pb.JwtIssuer(
                    issuer=ISSUER, algorithms=["HS256"], hs256_secret_env="GAMMA_SECRET"
                ),
                models=pb.ModelAccess(names=[MODEL]),
            ),
        ],
        [
            pb.ApiKey(id=KEY.key_id, hash=KEY.key_hash, tenant="acme"),
            pb.ApiKey(id=NARROW.key_id, hash=NARROW.key_hash, tenant="acme", models=[MODEL]),
            pb.ApiKey(id=OTHER.key_id, hash=OTHER.key_hash, tenant="beta"),
        ],
    )
    yield s
    await s.close()


@pytest.fixture(autouse=True)
def _refusals_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ponto.refusals")
    refusals.reset()


def sent_model(stack: Stack) -> Any:
    last = stack.origins[0].app[SIM_STATE].stats.last_request
    assert last is not None
    return last["body"]["model"]  # type: ignore[index]


async def refused(stack: Stack, model: str, key: str) -> dict[str, Any]:
    """The 404 for `model` asked with `key`, which reached no origin."""
    before = stack.origin_requests()
    resp = await stack.post(chat("hi", model=model), key=key)
    assert resp.status == 404
    assert stack.origin_requests() == before
    return error_of(await resp.json())


async def test_a_model_off_the_tenants_list_is_a_404_as_for_a_model_nobody_serves(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    off_list = await refused(stack, LARGE, KEY.key)
    unknown = await refused(stack, "no-such-model", OTHER.key)  # beta has no list
    assert off_list == {
        "message": f"The model '{LARGE}' does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert unknown["message"] == off_list["message"].replace(LARGE, "no-such-model")
    # Logged once each, without a traceback; the log says which list refused.
    lines = [r for r in caplog.records if r.name == "ponto.refusals"]
    assert len(lines) == 2
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in lines)
    assert all("model_not_found" in r.getMessage() for r in lines)
    assert "[not on the model list of tenant acme]" in lines[0].getMessage()
    assert "model list" not in lines[1].getMessage()
    # Nothing was taken from acme's 2 requests a minute.
    for model in (MODEL, FAST):
        resp = await stack.post(chat(f"after {model}", model=model), key=KEY.key)
        assert resp.status == 200, await resp.text()


async def test_an_alias_on_the_list_reaches_its_target_and_a_tenant_without_a_list_names_any(
    stack: Stack,
) -> None:
    resp = await stack.post(chat("hi", model=FAST), key=KEY.key)
    assert resp.status == 200
    assert sent_model(stack) == LARGE
    resp = await stack.post(chat("hi", model=LARGE), key=OTHER.key)
    assert resp.status == 200
    assert sent_model(stack) == LARGE


async def test_a_keys_list_narrows_its_tenants(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    assert (await refused(stack, FAST, NARROW.key))["code"] == "model_not_found"
    [line] = [r.getMessage() for r in caplog.records if r.name == "ponto.refusals"]
    assert f"[not on the model list of key {NARROW.key_id}]" in line
    resp = await stack.post(chat("hi"), key=NARROW.key)
    assert resp.status == 200
    assert sent_model(stack) == MODEL


@pytest.mark.parametrize(
    ("key", "listed"),
    [(KEY, [MODEL, FAST]), (NARROW, [MODEL]), (OTHER, [MODEL, LARGE])],
    ids=["tenant-list", "key-list", "no-list"],
)
async def test_the_model_list_holds_what_the_caller_may_name(
    stack: Stack, key: Any, listed: list[str]
) -> None:
    headers = {"authorization": f"Bearer {key.key}"}
    resp = await stack.client.get("/v1/models", headers=headers)
    assert resp.status == 200
    assert sorted(m["id"] for m in (await resp.json())["data"]) == sorted(listed)
    for model in (MODEL, LARGE, FAST):
        one = await stack.client.get(f"/v1/models/{model}", headers=headers)
        assert one.status == (200 if model in listed else 404)


async def test_a_model_lookup_refused_by_a_list_is_logged_with_the_list(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """`GET /v1/models/{model}` names the list that refused, as a chat call
    does (trial 29); a model nobody serves names none."""
    for model, key in ((LARGE, KEY), (FAST, NARROW), ("no-such-model", OTHER)):
        resp = await stack.client.get(
            f"/v1/models/{model}", headers={"authorization": f"Bearer {key.key}"}
        )
        assert resp.status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "ponto.refusals"]
    assert len(lines) == 3
    assert "[not on the model list of tenant acme]" in lines[0]
    assert f"[not on the model list of key {NARROW.key_id}]" in lines[1]
    assert "model list" not in lines[2] and "model_not_found" in lines[2]


async def test_a_jwt_caller_has_its_tenants_list(stack: Stack) -> None:
    assert (await refused(stack, LARGE, gamma_token()))["code"] == "model_not_found"
    resp = await stack.post(chat("hi"), key=gamma_token())
    assert resp.status == 200
    listed = await stack.client.get(
        "/v1/models", headers={"authorization": f"Bearer {gamma_token()}"}
    )
    assert [m["id"] for m in (await listed.json())["data"]] == [MODEL]


async def test_an_open_fleets_callers_have_tenant_defaults_list(stack: Stack) -> None:
    """No key or issuer: every caller is tenant `default`, and its list holds."""
    # As a proxy with no table yet: the stack's first table requires a key,
    # and a table that would open a closed proxy is refused (holder.refusal).
    stack.app[HOLDER].routes = None
    apply(stack, 4, [pb.Tenant(name="default", models=pb.ModelAccess(names=[LARGE]))])
    before = stack.origin_requests()
    resp = await stack.client.post("/v1/chat/completions", json=chat("hi"))
    assert resp.status == 404 and stack.origin_requests() == before
    resp = await stack.client.post("/v1/chat/completions", json=chat("hi", model=LARGE))
    assert resp.status == 200
    listed = await stack.client.get("/v1/models")
    assert [m["id"] for m in (await listed.json())["data"]] == [LARGE]
