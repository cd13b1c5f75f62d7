"""pontoctl's read-then-write commands against another operator's change made
between its read and its write (trial 52: two `tenant set --alias` at once
kept one alias, and both said "changed"; two `limit set --tenant` kept one
limit). Each write carries what it read (`expected`); the control plane
refuses it when the record changed, and pontoctl reads and writes again, so
both changes are kept and what pontoctl says it changed is what it changed."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from controlplane.catalog import TENANTS
from controlplane.cli import CHANGED_TRIES, KeptChanging, Missing, UsageError, _parser, run
from controlplane.errors import InvalidArgument
from controlplane.model import ModelAccess, PromptPolicy, Tenant, encode
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import CallDefaults
from ponto.routetable import OPEN_TENANT
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_admin_warnings import seed
from tests.unit.test_audit import Authorized, Clock, admin_server
from tests.unit.test_cli_drain import Racing


def pontoctl(address: str, racing: tuple[str, Any, int | None] | None, *argv: str) -> str:
    """pontoctl argv against the Admin server at address; with `racing`
    (listing, meanwhile, times), another operator's call after the listing."""
    with grpc.insecure_channel(address) as channel:
        stub: Any = admin_pb2_grpc.AdminStub(channel)
        if racing is not None:
            stub = Racing(stub, *racing)
        return run(_parser().parse_args(list(argv)), CallDefaults(stub, timeout=5))


async def tenant(stub: Authorized, name: str) -> pb.Tenant:
    tenants = (await stub.ListTenants(apb.ListRequest())).tenants
    found: pb.Tenant = next(t for t in tenants if t.name == name)
    return found


def alias_a1(stub: Any, _: Any) -> None:
    prompt = pb.PromptPolicy(aliases={"a1": "llama"})
    stub.UpdateTenant.with_call(apb.UpdateTenantRequest(name="acme", prompt=prompt), timeout=5)


async def test_two_alias_changes_at_once_are_both_kept() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        racing = ("ListTenants", alias_a1, 1)
        said = await asyncio.to_thread(
            pontoctl, stub.address, racing, "tenant", "set", "acme", "--alias", "a2=llama"
        )
        assert dict((await tenant(stub, "acme")).prompt.aliases) == {"a1": "llama", "a2": "llama"}
        # What it changed of what it read last: a2 alone, as the trail says.
        assert said.endswith('changed: prompt.aliases.a2 unset -> "llama"'), said
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
        assert sorted((e.result, e.detail["changes"]) for e in entries if e.result == "ok") == [
            ("ok", 'prompt unset -> {"aliases":{"a1":"llama"}}'),  # the other's
            ("ok", 'prompt.aliases.a2 unset -> "llama"'),
        ]
        # The write refused is in the trail too, as every refusal is.
        assert [e.result for e in entries if e.result != "ok"] == ["FAILED_PRECONDITION"]


def concurrency_5(stub: Any, _: Any) -> None:
    limits = pb.Limits(concurrency=5)
    stub.UpdateTenant.with_call(apb.UpdateTenantRequest(name="acme", limits=limits), timeout=5)


async def test_two_limit_changes_of_a_tenant_at_once_are_both_kept() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        racing = ("ListTenants", concurrency_5, 1)
        said = await asyncio.to_thread(
            pontoctl, stub.address, racing, "limit", "set", "--tenant", "acme", "--rpm", "500"
        )
        limits = (await tenant(stub, "acme")).limits
        assert (limits.rpm, limits.concurrency) == (500, 5)
        assert said.startswith("limits of tenant acme set: rpm=500 concurrency=5 (were: "), said


async def test_two_limit_changes_of_a_key_at_once_are_both_kept() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        key = (await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))).key

        def rpm_9(real: Any, _: Any) -> None:
            request = apb.SetKeyLimitsRequest(id=key.id, limits=pb.Limits(rpm=9))
            real.SetKeyLimits.with_call(request, timeout=5)

        racing = ("ListKeys", rpm_9, 1)
        await asyncio.to_thread(
            pontoctl, stub.address, racing, "limit", "set", "--key", key.id, "--tpm", "50"
        )
        (listed,) = (await stub.ListKeys(apb.ListKeysRequest())).keys
        assert (listed.limits.rpm, listed.limits.tpm) == (9, 50)


async def test_a_record_that_keeps_changing_is_refused_after_a_few_tries() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        tries = 0

        def another_alias_each_time(real: Any, _: Any) -> None:
            nonlocal tries
            tries += 1
            prompt = pb.PromptPolicy(aliases={f"b{tries}": "llama"})
            request = apb.UpdateTenantRequest(name="acme", prompt=prompt)
            real.UpdateTenant.with_call(request, timeout=5)

        with pytest.raises(KeptChanging) as caught:
            await asyncio.to_thread(
                pontoctl,
                stub.address,
                ("ListTenants", another_alias_each_time, None),
                *("tenant", "set", "acme", "--alias", "a2=llama"),
            )
        assert str(caught.value) == (
            "tenant 'acme' was changed since it was read; nothing was saved (read and "
            f"written {CHANGED_TRIES} times, each time changed by another write meanwhile): "
            "run it again"
        )
        assert tries == CHANGED_TRIES
        aliases = dict((await tenant(stub, "acme")).prompt.aliases)
        assert aliases == {f"b{CHANGED_TRIES}": "llama"}  # the other operator's last


async def test_the_control_plane_refuses_a_write_of_a_tenant_changed_since_read() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        read = await tenant(stub, "acme")
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=1)))
        stale = apb.UpdateTenantRequest(name="acme", limits=pb.Limits(tpm=2), expected=read)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.UpdateTenant(stale)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (await tenant(stub, "acme")).limits == pb.Limits(rpm=1)  # nothing written
        # As read now: written.
        fresh = apb.UpdateTenantRequest(
            name="acme", limits=pb.Limits(tpm=2), expected=await tenant(stub, "acme")
        )
        await stub.UpdateTenant(fresh)
        assert (await tenant(stub, "acme")).limits == pb.Limits(tpm=2)
        # The open tenant before it has a record: read as its name alone.
        first = apb.UpdateTenantRequest(
            name=OPEN_TENANT, limits=pb.Limits(rpm=3), expected=pb.Tenant(name=OPEN_TENANT)
        )
        await stub.UpdateTenant(first)
        assert (await tenant(stub, OPEN_TENANT)).limits == pb.Limits(rpm=3)
        again = apb.UpdateTenantRequest(
            name=OPEN_TENANT, limits=pb.Limits(rpm=4), expected=pb.Tenant(name=OPEN_TENANT)
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.UpdateTenant(again)  # it has a record now, with a limit


async def test_the_control_plane_refuses_key_limits_changed_since_read() -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        key = (await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))).key
        await stub.SetKeyLimits(apb.SetKeyLimitsRequest(id=key.id, limits=pb.Limits(rpm=9)))
        stale = apb.SetKeyLimitsRequest(id=key.id, limits=pb.Limits(tpm=5), expected=pb.Limits())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetKeyLimits(stale)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the limits of key" in (caught.value.details() or "")
        (listed,) = (await stub.ListKeys(apb.ListKeysRequest())).keys
        assert listed.limits == pb.Limits(rpm=9)


async def test_a_region_update_keeps_what_it_is_not_given_and_says_what_changed() -> None:
    """Trial 52: `region add --update` needed --lat and --lon again, reset
    the region's RTTs and spill threshold, and said nothing of it."""
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)  # us and eu
        address = stub.address

        def ctl(*argv: str, racing: tuple[str, Any, int | None] | None = None) -> str:
            return pontoctl(address, racing, "region", "add", *argv)

        said = await asyncio.to_thread(
            ctl, "north", "--lat", "10", "--lon", "10", "--rtt", "us=80", "--spill-threshold", "0.5"
        )
        assert said == "region north (10, 10) saved"
        said = await asyncio.to_thread(ctl, "north", "--update", "--spill-threshold", "0.6")
        assert said == "region north (10, 10) saved; changed: spill_threshold 0.5 -> 0.6"
        said = await asyncio.to_thread(ctl, "north", "--update", "--lat", "12", "--rtt", "")
        assert said == "region north (12, 10) saved; changed: lat 10 -> 12; rtt us=80 -> -"
        said = await asyncio.to_thread(ctl, "north", "--update", "--lat", "12")
        assert said.endswith("; unchanged")
        regions = {r.name: r for r in (await stub.ListRegions(apb.ListRequest())).regions}
        north = regions["north"]
        assert (north.latitude, north.longitude, dict(north.rtt_ms)) == (12, 10, {})
        assert north.spill_threshold == pytest.approx(0.6)

        # Another operator's drain and RTT between its read and its write: kept.
        def rtt_and_drain(real: Any, _: Any) -> None:
            spec = apb.RegionSpec(name="north", latitude=12, longitude=10, rtt_ms={"eu": 9})
            spec.spill_threshold = 0.6
            real.PutRegion.with_call(
                apb.PutRegionRequest(region=spec, allow_update=True), timeout=5
            )
            real.DrainRegion.with_call(apb.DrainRequest(name="north", drained=True), timeout=5)

        said = await asyncio.to_thread(
            ctl, "north", "--update", "--lon", "11", racing=("ListRegions", rtt_and_drain, 1)
        )
        assert said == "region north (12, 11) saved; changed: lon 10 -> 11"
        regions = {r.name: r for r in (await stub.ListRegions(apb.ListRequest())).regions}
        north = regions["north"]
        assert (north.longitude, dict(north.rtt_ms), north.drained) == (11, {"eu": 9}, True)


def test_adding_a_region_needs_its_coordinates() -> None:
    class NoRegions:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"{name} called")

    calls = CallDefaults(NoRegions(), timeout=5)
    with pytest.raises(UsageError, match="adding region x needs --lon"):
        run(_parser().parse_args(["region", "add", "x", "--lat", "1"]), calls)


async def test_a_tenant_stored_out_of_its_normal_form_takes_a_change() -> None:
    """Review 200: ListTenants shows a record in its normal form (models and
    aliases sorted); one stored otherwise (by hand, by another version) never
    compared equal to it, and every `tenant set` and `limit set` was refused
    as changed meanwhile. One that cannot be listed at all is compared as
    unlisted, so the write says what is wrong with it."""
    store = MemoryStore()
    raw = Tenant(
        "acme",
        prompt=PromptPolicy(aliases=(("zeta", "llama"), ("alpha", "llama"))),
        models=ModelAccess(names=("z-model", "a-model")),
    )
    await store.put(TENANTS + "acme", encode(raw))
    async with admin_server(store, Clock(), admin_token="") as stub:
        await seed(stub)
        said = await asyncio.to_thread(
            pontoctl, stub.address, None, "limit", "set", "--tenant", "acme", "--rpm", "5"
        )
        assert said.startswith("limits of tenant acme set: rpm=5"), said
        assert (await tenant(stub, "acme")).limits.rpm == 5
        # The audit entry says what was asked, not the tenant as read.
        (entry,) = [
            e
            for e in (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
            if e.result == "OK" or e.result == "ok"
        ]
        assert "expected" not in entry.detail and "name" not in entry.detail
        # A record that cannot be listed (an alias to itself): the write says why.
        await store.put(
            TENANTS + "broken", encode(Tenant("broken", prompt=PromptPolicy(aliases=(("x", "x"),))))
        )
        with pytest.raises(grpc.RpcError) as caught:
            await asyncio.to_thread(
                pontoctl, stub.address, None, "limit", "set", "--tenant", "broken", "--rpm", "5"
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_prompt_stored_before_the_control_rule_does_not_block_other_changes() -> None:
    """Review 200: a tenant saved before control characters were refused in
    prompts could no longer be suspended or limited: every write checked its
    prompt. Only a prompt being set is checked."""
    store = MemoryStore()
    await store.put(
        TENANTS + "acme", encode(Tenant("acme", prompt=PromptPolicy(system_prompt="a\x1bb")))
    )
    async with admin_server(store, Clock(), admin_token="") as stub:
        await seed(stub)
        await asyncio.to_thread(
            pontoctl, stub.address, None, "tenant", "set", "acme", "--suspended", "on"
        )
        assert (await tenant(stub, "acme")).suspended
        with pytest.raises(InvalidArgument):  # pontoctl's own check, before the call
            await asyncio.to_thread(
                pontoctl, stub.address, None, "tenant", "set", "acme", "--system-prompt", "c\x01d"
            )
        request = apb.UpdateTenantRequest(
            name="acme", prompt=pb.PromptPolicy(system_prompt="c\x01d")
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.UpdateTenant(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_update_that_changes_nothing_writes_nothing() -> None:
    """Trial 54: `region add --update` and `origin add --update` with the
    values they had said "unchanged" but wrote (and audited) the record; one
    of a name that is not there exits 1, as the control plane's NOT_FOUND."""
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)
        before = len((await stub.ListAudit(apb.ListAuditRequest())).entries)
        said = await asyncio.to_thread(
            pontoctl, stub.address, None, "region", "add", "us", "--update"
        )
        assert said == "region us (0, 0) saved; unchanged"
        (o_us,) = [
            o for o in (await stub.ListOrigins(apb.ListRequest())).origins if o.name == "o-us"
        ]
        said = await asyncio.to_thread(
            pontoctl,
            stub.address,
            None,
            "origin",
            "add",
            "o-us",
            "--update",
            "--weight",
            str(o_us.weight),
        )
        assert said.endswith("; unchanged")
        assert len((await stub.ListAudit(apb.ListAuditRequest())).entries) == before
        with pytest.raises(Missing, match="region nowhere not found"):
            await asyncio.to_thread(
                pontoctl,
                stub.address,
                None,
                "region",
                "add",
                "nowhere",
                "--update",
                "--spill-threshold",
                "0.5",
            )
