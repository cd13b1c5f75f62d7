"""A per-model routing policy or hedge delay that applies to nothing: one for a
model no origin lists (a typo, or a model added later) is accepted with a
warning in the Admin reply's trailing metadata, as aliases are
(test_alias_warnings.py); one for an alias is warned of as never applying.
The calls go to a real gRPC server on loopback over an in-memory store.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import orjson
import pytest

from controlplane.apply import Current, parse, plan
from controlplane.cli import main as pontoctl
from controlplane.model import (
    Origin,
    PromptPolicy,
    Region,
    RoutingPolicy,
    StreamPolicy,
    Tenant,
    unserved_settings,
)
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import ListFails, admin, warned
from tests.unit.test_audit import Clock, admin_server

TYPO = "no origin serves model 'lama'; its routing policy (tenant 'acme') applies once one does"
ALIASED = (
    "model 'big' is an alias of tenant 'acme', to 'llama': its routing policy never applies, "
    "as requests are routed by the model an alias names (set the policy of 'llama')"
)
HEDGE_TYPO = "no origin serves model 'lama'; its hedge delay (tenant 'acme') applies once one does"
HEDGE_ALIASED = (
    "model 'big' is an alias of tenant 'acme', to 'llama': its hedge delay never applies, "
    "as requests are hedged by the model an alias names (set the delay of 'llama')"
)


def acme(aliases: dict[str, str] | None = None, **models: str) -> Tenant:
    return Tenant(
        "acme",
        prompt=PromptPolicy(aliases=tuple(sorted((aliases or {}).items()))),
        routing=RoutingPolicy(models=tuple(sorted(models.items()))),
    )


def origin(name: str, *models: str, drained: bool = False) -> Origin:
    return Origin(name, "http://10.0.0.1:8000/v1", "us", models, drained=drained)


# ---------------------------------------------------------------- the rule


def test_a_warning_for_each_routed_model_no_origin_lists_and_each_alias() -> None:
    origins = [origin("o1", "llama")]
    assert unserved_settings(acme(llama="affinity"), origins, "routing") == ()
    assert unserved_settings(acme(lama="weighted", llama="affinity"), origins, "routing") == (TYPO,)
    # An alias's policy never applies, served or not: requests are routed by its target.
    tenant = acme({"big": "llama"}, big="least-loaded")
    assert unserved_settings(tenant, origins, "routing") == (ALIASED,)
    assert unserved_settings(tenant, [*origins, origin("o2", "big")], "routing") == (ALIASED,)
    # A model only a drained origin lists is known, as for aliases.
    drained = [origin("o1", "lama", drained=True)]
    assert unserved_settings(acme(lama="weighted"), drained, "routing") == ()
    assert unserved_settings(Tenant("plain"), [], "routing") == ()


def hedged(aliases: dict[str, str] | None = None, **models: str) -> Tenant:
    return replace(acme(aliases), streams=StreamPolicy(hedge_models=tuple(sorted(models.items()))))


def test_a_warning_for_each_hedged_model_no_origin_lists_and_each_alias() -> None:
    origins = [origin("o1", "llama")]
    assert unserved_settings(hedged(llama="800"), origins, "hedging") == ()
    assert unserved_settings(hedged(lama="800", llama="auto"), origins, "hedging") == (HEDGE_TYPO,)
    # Hedge delays are picked by the model an alias names too; "0" (off) is a setting.
    tenant = hedged({"big": "llama"}, big="0")
    assert unserved_settings(tenant, origins, "hedging") == (HEDGE_ALIASED,)
    # Each setting warns of its own models only.
    assert unserved_settings(hedged(lama="800"), origins, "routing") == ()
    assert unserved_settings(acme(lama="weighted"), origins, "hedging") == ()


def test_apply_warns_of_the_documents_routing_too() -> None:
    doc: dict[str, Any] = {
        "regions": [{"name": "us", "lat": 1, "lon": 1}],
        "origins": [{"name": "o1", "region": "us", "url": "http://h/v1", "models": ["llama"]}],
        "tenants": [{"name": "acme", "routing": {"models": {"lama": "weighted"}}}],
    }
    assert plan(parse(doc), Current(), prune=False).warnings == (TYPO,)
    doc["tenants"][0]["routing"]["models"] = {"llama": "weighted"}
    assert plan(parse(doc), Current(), prune=False).warnings == ()
    have = Current(regions={"us": Region("us", 1, 1)}, origins={"o1": origin("o1", "lama")})
    assert plan(parse({"tenants": [{"name": "acme"}]}), have, prune=False).warnings == ()
    doc["tenants"][0]["streams"] = {"hedge_models": {"lama": 800}}
    assert plan(parse(doc), Current(), prune=False).warnings == (HEDGE_TYPO,)


# ---------------------------------------------------------------- the Admin API


def routing(**models: str) -> pb.RoutingPolicy:
    return pb.RoutingPolicy(models=models)


def streams(**hedge_models: str) -> pb.StreamPolicy:
    return pb.StreamPolicy(hedge_models=hedge_models)


async def serve_llama(stub: Any) -> None:
    await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="us")))
    spec = apb.OriginSpec(name="o1", base_url="http://h/v1", region="us", models=["llama"])
    await stub.PutOrigin(apb.PutOriginRequest(origin=spec))


async def test_tenant_writes_are_accepted_and_warned_of_routing_that_routes_nothing() -> None:
    async with admin(MemoryStore()) as stub:
        await serve_llama(stub)
        put = pb.Tenant(name="acme", routing=routing(lama="weighted"))
        assert await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put))) == [TYPO]
        stored = (await stub.ListTenants(apb.ListRequest())).tenants[0]
        assert dict(stored.routing.models) == {"lama": "weighted"}
        # An update that leaves the routing alone does not repeat the warning.
        limits = apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=60))
        assert await warned(stub.UpdateTenant(limits)) == []
        prompt = apb.UpdateTenantRequest(name="acme", prompt=pb.PromptPolicy(max_tokens_ceiling=9))
        assert await warned(stub.UpdateTenant(prompt)) == []
        update = apb.UpdateTenantRequest(
            name="acme", routing=routing(lama="weighted", x="weighted")
        )
        assert await warned(stub.UpdateTenant(update)) == [TYPO, TYPO.replace("'lama'", "'x'")]
        aliased = apb.UpdateTenantRequest(
            name="acme",
            prompt=pb.PromptPolicy(aliases={"big": "llama"}),
            routing=routing(big="least-loaded", llama="affinity"),
        )
        assert await warned(stub.UpdateTenant(aliased)) == [ALIASED]
        fixed = apb.UpdateTenantRequest(name="acme", routing=routing(llama="weighted"))
        assert await warned(stub.UpdateTenant(fixed)) == []


async def test_tenant_writes_are_accepted_and_warned_of_hedge_delays_that_apply_to_nothing() -> (
    None
):
    async with admin(MemoryStore()) as stub:
        await serve_llama(stub)
        put = pb.Tenant(name="acme", streams=streams(lama="800"))
        assert await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put))) == [HEDGE_TYPO]
        stored = (await stub.ListTenants(apb.ListRequest())).tenants[0]
        assert dict(stored.streams.hedge_models) == {"lama": "800"}
        # Updates that leave the streams alone do not repeat it, a routing one neither.
        limits = apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=60))
        assert await warned(stub.UpdateTenant(limits)) == []
        routed = apb.UpdateTenantRequest(name="acme", routing=routing(llama="weighted"))
        assert await warned(stub.UpdateTenant(routed)) == []
        update = apb.UpdateTenantRequest(name="acme", streams=streams(lama="auto"))
        assert await warned(stub.UpdateTenant(update)) == [HEDGE_TYPO]
        # An alias added over a hedged model makes its delay dead.
        alias = apb.UpdateTenantRequest(
            name="acme", prompt=pb.PromptPolicy(aliases={"big": "llama"})
        )
        update = apb.UpdateTenantRequest(name="acme", streams=streams(big="800"))
        assert await warned(stub.UpdateTenant(update)) == [HEDGE_TYPO.replace("'lama'", "'big'")]
        assert await warned(stub.UpdateTenant(alias)) == [HEDGE_ALIASED]
        fixed = apb.UpdateTenantRequest(name="acme", streams=streams(llama="800"))
        assert await warned(stub.UpdateTenant(fixed)) == []


async def test_apply_sends_the_routing_warnings() -> None:
    doc = {"tenants": [{"name": "acme", "routing": {"models": {"lama": "weighted"}}}]}
    async with admin(MemoryStore()) as stub:
        await serve_llama(stub)
        for dry_run in (True, False):
            request = apb.ApplyRequest(document=orjson.dumps(doc).decode(), dry_run=dry_run)
            assert await warned(stub.Apply(request)) == [TYPO]


async def test_a_routing_write_stands_when_its_models_cannot_be_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ListFails()
    async with admin(store) as stub:
        store.failing = True
        put = pb.Tenant(name="acme", routing=routing(lama="weighted"))
        assert await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put))) == []
        store.failing = False
        stored = (await stub.ListTenants(apb.ListRequest())).tenants[0]
        assert dict(stored.routing.models) == {"lama": "weighted"}
    [line] = [r for r in caplog.records if "were not checked" in r.getMessage()]
    assert line.getMessage().startswith("tenant acme saved; its per-model settings and aliases")
    assert line.exc_info is None


async def test_pontoctl_prints_the_routing_warning_on_stderr_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await serve_llama(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        capsys.readouterr()
        # pontoctl's calls block: run in a thread, while this loop serves them.
        argv = ["--control-plane", stub.address, "tenant", "set", "acme"]
        assert await asyncio.to_thread(pontoctl, [*argv, "--model-routing", "lama=weighted"]) == 0
        out = capsys.readouterr()
        assert out.out.startswith("tenant acme saved") and out.err == f"warning: {TYPO}\n"
        assert await asyncio.to_thread(pontoctl, [*argv, "--model-routing", "lama=default"]) == 0
        assert capsys.readouterr().err == ""
        assert await asyncio.to_thread(pontoctl, [*argv, "--model-hedge-ms", "lama=800"]) == 0
        out = capsys.readouterr()
        assert out.out.startswith("tenant acme saved") and out.err == f"warning: {HEDGE_TYPO}\n"


async def test_an_alias_added_over_a_routed_model_is_warned_of() -> None:
    # `pontoctl tenant set acme --alias big=llama` sends the prompt alone; the
    # alias makes the 'big' policy dead, as PutTenant of the same state says.
    async with admin(MemoryStore()) as stub:
        await serve_llama(stub)
        put = pb.Tenant(name="acme", routing=routing(big="least-loaded"))
        await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put)))
        alias = apb.UpdateTenantRequest(
            name="acme", prompt=pb.PromptPolicy(aliases={"big": "llama"})
        )
        assert await warned(stub.UpdateTenant(alias)) == [ALIASED]
