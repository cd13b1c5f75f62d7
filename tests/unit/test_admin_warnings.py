"""Writes the Admin API allows but warns of (trailing metadata `ponto-warning`,
as for aliases in test_alias_warnings.py): a drain that leaves a model no
origin to route to; an undrain of an origin whose region is drained, or of a
region whose origins are all drained (changed or not); a cache purge of a
model no origin serves. The calls go to a real gRPC server on
loopback over an in-memory store.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
import pytest

from controlplane.catalog import Catalog
from controlplane.cli import main as pontoctl
from controlplane.model import (
    MAX_NAMED_MODELS,
    Origin,
    OriginHealth,
    PromptPolicy,
    Region,
    Tenant,
    drain_warnings,
    routed_models,
    stranded_by_drain,
    unserved_purge,
)
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import ListFails, admin, warned
from tests.unit.test_audit import Clock, admin_server


def origin(name: str, region: str, *models: str, drained: bool = False) -> Origin:
    return Origin(name, "http://10.0.0.1:8000/v1", region, models, drained=drained)


US, EU = Region("us", 1, 1), Region("eu", 2, 2)
ORIGINS = (origin("o-us", "us", "llama", "mistral"), origin("o-eu", "eu", "llama"))


def drained(region: Region) -> Region:
    return Region(region.name, region.latitude, region.longitude, drained=True)


# ---------------------------------------------------------------- the rule


def test_a_drain_warns_of_the_models_it_leaves_no_origin() -> None:
    # mistral only in us: draining us leaves it none; llama still has eu.
    assert stranded_by_drain("region", "us", (drained(US), EU), ORIGINS) == (
        "no undrained origin serves model 'mistral' now (region 'us' was the last): proxies "
        "answer requests for it 503 no_healthy_origin until one is undrained",
    )
    # Then eu too: llama is left; mistral was gone before this drain.
    both = (drained(US), drained(EU))
    assert stranded_by_drain("region", "eu", both, ORIGINS) == (
        "no undrained origin serves model 'llama' now (region 'eu' was the last): proxies "
        "answer requests for it 503 no_healthy_origin until one is undrained",
    )
    # The same for an origin, named as the last.
    o_us = (origin("o-us", "us", "llama", "mistral", drained=True), ORIGINS[1])
    [warning] = stranded_by_drain("origin", "o-us", (US, EU), o_us)
    assert warning.startswith("no undrained origin serves model 'mistral' now (origin 'o-us'")


def test_no_warning_when_others_serve_or_nothing_changed() -> None:
    assert stranded_by_drain("region", "eu", (US, drained(EU)), ORIGINS) == ()
    # Not drained in this state (an undrain): nothing is left unserved by it.
    assert stranded_by_drain("region", "us", (US, EU), ORIGINS) == ()
    # An origin in a drained region took no requests before its drain either.
    o_us = (origin("o-us", "us", "llama", "mistral", drained=True), ORIGINS[1])
    assert stranded_by_drain("origin", "o-us", (drained(US), EU), o_us) == ()
    # Health does not count: proxies fall back to unhealthy origins (panic routing).


def test_an_origin_of_a_region_that_does_not_exist_routes_nothing() -> None:
    # The table leaves it out (compile_table), so proxies do not know its models.
    ghost = origin("o-ghost", "gone", "mistral", "phi")
    assert routed_models((US, EU), (*ORIGINS, ghost)) == {"llama", "mistral"}
    # So it does not keep a drain from stranding mistral...
    [warning] = stranded_by_drain("region", "us", (drained(US), EU), (*ORIGINS, ghost))
    assert warning.startswith("no undrained origin serves model 'mistral' now (region 'us'")
    # ...and its own drain strands nothing: it routed nothing before.
    drained_ghost = origin("o-ghost", "gone", "mistral", "phi", drained=True)
    assert stranded_by_drain("origin", "o-ghost", (US, EU), (*ORIGINS, drained_ghost)) == ()


def test_many_models_are_one_warning_naming_the_first() -> None:
    models = [f"m{i:02d}" for i in range(MAX_NAMED_MODELS + 3)]
    [warning] = stranded_by_drain("region", "us", (drained(US),), (origin("o", "us", *models),))
    named = ", ".join(repr(m) for m in models[:MAX_NAMED_MODELS])
    assert f"serves models {named} and 3 more now" in warning
    assert "requests for them 503" in warning


UNROUTED = (
    "origin o-us is undrained, but its region us is drained: it gets no traffic until "
    "`pontoctl undrain region us`"
)


def test_an_origin_undrained_in_a_drained_region_is_warned_of() -> None:
    assert drain_warnings("origin", "o-us", False, (drained(US), EU), ORIGINS) == (UNROUTED,)
    # Its region serving, or the origin drained again: it is not kept from traffic
    # by its region.
    assert drain_warnings("origin", "o-us", False, (US, EU), ORIGINS) == ()
    o_us = (origin("o-us", "us", "llama", "mistral", drained=True), ORIGINS[1])
    assert drain_warnings("origin", "o-us", False, (drained(US), EU), o_us) == ()
    # Undraining a region with an undrained origin, or an origin that is not
    # there, warns of nothing.
    assert drain_warnings("region", "us", False, (US, EU), ORIGINS) == ()
    assert drain_warnings("origin", "ghost", False, (drained(US), EU), ORIGINS) == ()
    # A drain warns of what it strands, as stranded_by_drain says.
    assert drain_warnings("region", "us", True, (drained(US), EU), ORIGINS) == stranded_by_drain(
        "region", "us", (drained(US), EU), ORIGINS
    )


IDLE_REGION = (
    "region us is undrained, but all its origins are drained (o-us, o-us2): it gets no "
    "traffic until one is undrained (`pontoctl undrain origin o-us`)"
)


def test_a_region_undrained_with_all_its_origins_drained_is_warned_of() -> None:
    both = (
        origin("o-us2", "us", "llama", drained=True),
        origin("o-us", "us", "llama", drained=True),
        ORIGINS[1],
    )
    assert drain_warnings("region", "us", False, (US, EU), both) == (IDLE_REGION,)
    # One of them undrained, the region drained, no origins at all, or no such
    # region: nothing to say.
    one = (replace(both[0], drained=False), *both[1:])
    assert drain_warnings("region", "us", False, (US, EU), one) == ()
    assert drain_warnings("region", "us", False, (drained(US), EU), both) == ()
    assert drain_warnings("region", "us", False, (US, EU), ORIGINS[1:]) == ()
    assert drain_warnings("region", "mars", False, (US, EU), both) == ()
    # Past MAX_NAMED_MODELS origins, the rest are counted.
    many = [origin(f"o{i:02d}", "us", "llama", drained=True) for i in range(MAX_NAMED_MODELS + 2)]
    [warning] = drain_warnings("region", "us", False, (US,), many)
    assert f"o{MAX_NAMED_MODELS - 1:02d} and 2 more): " in warning


NOSUCH = "no origin serves model 'nosuch'; purge sent anyway"


def test_a_purge_of_a_model_no_origin_lists_is_warned_of() -> None:
    tenants = [Tenant("acme"), Tenant("beta")]
    assert unserved_purge("nosuch", "acme", ORIGINS, tenants) == (NOSUCH,)
    assert unserved_purge("nosuch", "", ORIGINS, tenants) == (NOSUCH,)
    # A model some origin lists, drained or not, or no model at all: no warning.
    assert unserved_purge("mistral", "", (origin("o", "us", "mistral", drained=True),), []) == ()
    assert unserved_purge("", "acme", (), tenants) == ()


def test_a_purge_of_an_alias_names_the_model_it_stands_for() -> None:
    def aliased(name: str, target: str) -> Tenant:
        return Tenant(name, prompt=PromptPolicy(aliases=(("gpt-4o", target),)))

    tenants = [aliased("acme", "llama"), aliased("beta", "mistral"), Tenant("gamma")]
    [warning] = unserved_purge("gpt-4o", "acme", ORIGINS, tenants)
    assert warning == (
        "no origin serves model 'gpt-4o'; purge sent anyway (it is an alias: tenant 'acme' "
        "to 'llama'; answers are cached under the model an alias names, so purge that model "
        "for them)"
    )
    # Of every tenant, each one's alias is named; of a tenant without it, none.
    [warning] = unserved_purge("gpt-4o", "", ORIGINS, tenants)
    assert "alias: tenant 'acme' to 'llama', tenant 'beta' to 'mistral';" in warning
    assert unserved_purge("gpt-4o", "gamma", ORIGINS, tenants) == (
        "no origin serves model 'gpt-4o'; purge sent anyway",
    )


# ---------------------------------------------------------------- the Admin API


async def seed(stub: Any) -> None:
    """Regions us and eu; llama in both, mistral only in us."""
    for name in ("us", "eu"):
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name=name)))
    for o in ORIGINS:
        spec = apb.OriginSpec(name=o.name, base_url=o.base_url, region=o.region, models=o.models)
        await stub.PutOrigin(apb.PutOriginRequest(origin=spec))


async def test_drains_are_done_and_warned_of_models_left_without_an_origin() -> None:
    async with admin(MemoryStore()) as stub:
        await seed(stub)
        # llama still has o-us.
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="eu", drained=True))) == []
        [warning] = await warned(stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True)))
        assert warning.startswith("no undrained origin serves models 'llama', 'mistral' now")
        origins = (await stub.ListOrigins(apb.ListRequest())).origins
        assert {o.name: o.drained for o in origins} == {"o-us": True, "o-eu": False}
        # An undrain warns only of what keeps it from traffic: nothing here.
        undrain = apb.DrainRequest(name="o-us", drained=False)
        assert await warned(stub.DrainOrigin(undrain)) == []
        [warning] = await warned(stub.DrainRegion(apb.DrainRequest(name="us", drained=True)))
        assert "models 'llama', 'mistral'" in warning and "(region 'us' was the last)" in warning
        # The same drain again changes nothing, so it warns of nothing; an
        # undrain that changes nothing still says what keeps o-eu idle.
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="us", drained=True))) == []
        assert await warned(stub.DrainOrigin(apb.DrainRequest(name="o-eu", drained=False))) == [
            UNROUTED.replace("o-us", "o-eu").replace(" us", " eu")
        ]


async def test_every_write_warns_of_an_origin_that_cannot_continue_with_continuation_on() -> None:
    """Trial 66: TGI takes no continuation request; a cut stream continued
    there is spliced into a garbled answer, and nothing said so."""
    store = MemoryStore()
    async with admin(store) as stub:
        await seed(stub)
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="eu", drained=True))) == []
        # The probes find o-eu is a TGI server.
        await Catalog(store).put_health(OriginHealth("o-eu", True, server_kind="tgi"))
        undrain = apb.DrainRequest(name="eu", drained=False)
        [warning] = await warned(stub.DrainRegion(undrain))
        assert warning.startswith("origin o-eu is a TGI, which cannot continue")
        assert warning.endswith("run `pontoctl origin add o-eu --update --continuation off`")
        # The fix is warned of nothing, and so is every write after it.
        o = ORIGINS[1]
        spec = apb.OriginSpec(
            name=o.name, base_url=o.base_url, region=o.region, models=o.models, continuation="off"
        )
        fix = apb.PutOriginRequest(origin=spec, allow_update=True)
        assert await warned(stub.PutOrigin(fix)) == []
        assert await warned(stub.DrainRegion(undrain)) == []


async def test_a_drain_stands_when_its_models_cannot_be_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ListFails()
    async with admin(store) as stub:
        await seed(stub)
        store.failing = True
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="us", drained=True))) == []
        store.failing = False
        regions = (await stub.ListRegions(apb.ListRequest())).regions
        assert {r.name: r.drained for r in regions} == {"us": True, "eu": False}
    [line] = [r for r in caplog.records if "leaves unserved were not checked" in r.getMessage()]
    assert line.getMessage().startswith("region us drained;") and line.exc_info is None


async def test_undraining_an_origin_its_region_keeps_drained_is_done_and_warned_of() -> None:
    async with admin(MemoryStore()) as stub:
        await seed(stub)
        await stub.DrainRegion(apb.DrainRequest(name="us", drained=True))
        # Drained inside a drained region: it took no requests before either.
        assert await warned(stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True))) == []
        undrain = apb.DrainRequest(name="o-us", drained=False)
        assert await warned(stub.DrainOrigin(undrain)) == [UNROUTED]
        origins = (await stub.ListOrigins(apb.ListRequest())).origins
        assert {o.name: o.drained for o in origins} == {"o-us": False, "o-eu": False}
        # Undrained again, it changes nothing but is warned of the same: it is
        # still idle, and the operator trying again wants to know why.
        assert await warned(stub.DrainOrigin(undrain)) == [UNROUTED]
        # Once its region is undrained, neither that undrain nor the origin's warns.
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="us", drained=False))) == []
        await stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True))
        assert await warned(stub.DrainOrigin(undrain)) == []


async def test_undraining_a_region_whose_origins_are_all_drained_is_done_and_warned_of() -> None:
    async with admin(MemoryStore()) as stub:
        await seed(stub)
        await stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True))
        await stub.DrainRegion(apb.DrainRequest(name="us", drained=True))
        undrain = apb.DrainRequest(name="us", drained=False)
        warning = (
            "region us is undrained, but all its origins are drained (o-us): it gets no "
            "traffic until one is undrained (`pontoctl undrain origin o-us`)"
        )
        assert await warned(stub.DrainRegion(undrain)) == [warning]
        regions = (await stub.ListRegions(apb.ListRequest())).regions
        assert {r.name: r.drained for r in regions} == {"us": False, "eu": False}
        assert await warned(stub.DrainRegion(undrain)) == [warning]  # unchanged: the same
        await stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=False))
        assert await warned(stub.DrainRegion(undrain)) == []


async def test_pontoctl_prints_the_undrain_warning_on_stderr_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.DrainRegion(apb.DrainRequest(name="us", drained=True))
        await stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True))
        capsys.readouterr()
        # pontoctl's calls block: run in a thread, while this loop serves them.
        argv = ["--control-plane", stub.address, "undrain", "origin", "o-us"]
        assert await asyncio.to_thread(pontoctl, argv) == 0
        out = capsys.readouterr()
        assert (out.out, out.err) == ("origin o-us undrained\n", f"warning: {UNROUTED}\n")
        # Again: nothing changes, but why it gets no traffic is still said.
        assert await asyncio.to_thread(pontoctl, argv) == 0
        out = capsys.readouterr()
        assert (out.out, out.err) == (
            "origin o-us is not drained: nothing changed\n",
            f"warning: {UNROUTED}\n",
        )


async def test_an_undrain_stands_when_its_region_cannot_be_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ListFails()
    async with admin(store) as stub:
        await seed(stub)
        await stub.DrainRegion(apb.DrainRequest(name="us", drained=True))
        await stub.DrainOrigin(apb.DrainRequest(name="o-us", drained=True))
        store.failing = True
        undrain = apb.DrainRequest(name="o-us", drained=False)
        assert await warned(stub.DrainOrigin(undrain)) == []
        store.failing = False
        origins = (await stub.ListOrigins(apb.ListRequest())).origins
        assert {o.name: o.drained for o in origins}["o-us"] is False
    [line] = [r for r in caplog.records if "was not checked" in r.getMessage()]
    assert line.getMessage().startswith(
        "origin o-us undrained; whether its region is drained was not checked"
    )
    assert line.exc_info is None


async def test_purges_are_sent_and_warned_of_a_model_no_origin_serves() -> None:
    async with admin(MemoryStore()) as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        purge = stub.PurgeCache(apb.PurgeCacheRequest(tenant="acme", model="nosuch"))
        assert await warned(purge) == [NOSUCH]
        assert (await purge).purge.model == "nosuch"  # sent all the same
        assert await warned(stub.PurgeCache(apb.PurgeCacheRequest(model="nosuch"))) == [NOSUCH]
        for request in (
            apb.PurgeCacheRequest(tenant="acme", model="mistral"),
            apb.PurgeCacheRequest(tenant="acme"),
            apb.PurgeCacheRequest(),
        ):
            assert await warned(stub.PurgeCache(request)) == []
        # An unknown tenant is still refused: a misspelt one would purge nothing.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.PurgeCache(apb.PurgeCacheRequest(tenant="ghost", model="nosuch"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
