"""An alias to a model no origin serves: accepted (origins may register later),
with a warning in the Admin reply's trailing metadata. The Admin calls go to a
real gRPC server on loopback over an in-memory store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest

from controlplane.api.admin import (
    WARNINGS_BYTES,
    WARNINGS_READ_S,
    AdminService,
    checked,
    warnings_metadata,
)
from controlplane.apply import Current, parse, plan
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.model import Origin, PromptPolicy, Region, Tenant, unserved_aliases
from controlplane.store import StoreUnavailable
from controlplane.store.memory import MemoryStore
from dataplane.assemble import PromptRules, assemble
from ponto.grpcconn import WARNING_METADATA
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

WARNING = (
    "no origin serves model 'sim-huge' now; requests for alias 'big' of tenant 'acme' "
    "will get 404 until one does"
)


def acme(**aliases: str) -> Tenant:
    return Tenant("acme", prompt=PromptPolicy(aliases=tuple(sorted(aliases.items()))))


def origin(name: str, *models: str, drained: bool = False) -> Origin:
    return Origin(name, "http://10.0.0.1:8000/v1", "us", models, drained=drained)


# ---------------------------------------------------------------- the rule


def test_a_warning_for_each_alias_whose_target_no_origin_lists() -> None:
    tenant = acme(big="sim-huge", small="sim-small", huge="sim-huge")
    assert unserved_aliases(tenant, [origin("o1", "sim-small")]) == (
        WARNING,
        WARNING.replace("'big'", "'huge'"),
    )
    assert unserved_aliases(tenant, [origin("o1", "sim-small", "sim-huge")]) == ()
    # Drained (or unhealthy) origins still make the model known: proxies answer
    # 503 for it while none can take it, not 404.
    assert unserved_aliases(tenant, [origin("o1", "sim-small", "sim-huge", drained=True)]) == ()
    assert unserved_aliases(Tenant("plain"), []) == ()


def test_apply_warns_against_the_origins_of_its_result() -> None:
    doc: dict[str, Any] = {
        "regions": [{"name": "us", "lat": 1, "lon": 1}],
        "origins": [{"name": "o1", "region": "us", "url": "http://h/v1", "models": ["sim-huge"]}],
        "tenants": [{"name": "acme", "prompt": {"aliases": {"big": "sim-huge"}}}],
    }
    # Served by an origin the same document adds.
    assert plan(parse(doc), Current(), prune=False).warnings == ()
    # Served by an origin the control plane has and the document leaves alone...
    have = Current(regions={"us": Region("us", 1, 1)}, origins={"o2": origin("o2", "sim-huge")})
    tenants_only = parse({"tenants": doc["tenants"]})
    assert plan(tenants_only, have, prune=False).warnings == ()
    # ...unless --prune deletes it (the document lists origins: none).
    pruning = parse({"regions": doc["regions"], "origins": [], "tenants": doc["tenants"]})
    assert plan(pruning, have, prune=True).warnings == (WARNING,)
    # Tenants outside the document are not its business.
    assert (
        plan(parse({}), Current(tenants={"acme": acme(big="sim-huge")}), prune=False).warnings == ()
    )


def test_warnings_stay_under_the_metadata_limit_and_count_the_rest() -> None:
    many = [WARNING] * 100
    sent = warnings_metadata(many)
    assert {key for key, _ in sent} == {WARNING_METADATA}
    assert sum(len(value) for _, value in sent) <= WARNINGS_BYTES + 100
    kept = len(sent) - 1
    assert sent[-1][1] == f"and {100 - kept} more warnings like these"
    assert warnings_metadata([WARNING]) == ((WARNING_METADATA, WARNING),)


# ---------------------------------------------------------------- the Admin API


class ListFails(MemoryStore):
    """A store whose range reads fail once `failing` is set (etcd gone mid-call)."""

    failing = False

    async def list(self, prefix: str) -> Any:
        if self.failing:
            raise StoreUnavailable("etcd list failed: connection refused")
        return await super().list(prefix)


@contextlib.asynccontextmanager
async def admin(store: MemoryStore) -> AsyncIterator[Any]:
    """The Admin service (no token) on loopback, and an aio stub for it (Any: the
    generated stubs are typed for sync channels)."""
    server = grpc.aio.server()
    service = AdminService(
        Catalog(store), Publisher("cp-1"), AuditLog(store, replica="cp-1"), token_required=False
    )
    admin_pb2_grpc.add_AdminServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield admin_pb2_grpc.AdminStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def warned(call: Any) -> list[str]:
    """The call's warnings, once it has succeeded."""
    await call
    return [str(v) for k, v in await call.trailing_metadata() or () if k == WARNING_METADATA]


def prompt(**aliases: str) -> pb.PromptPolicy:
    return pb.PromptPolicy(aliases=aliases)


@pytest.mark.parametrize(
    ("url", "warns"),
    [
        ("http://vllm.example:8000", True),
        ("http://vllm.example:8000/openai", True),
        ("http://vllm.example:8000/v1", False),
        ("https://gateway.example/openai/v1", False),
        ("https://gateway.example/openai/V1", True),  # servers match paths case-sensitively
        ("http://vllm.example:8000/v1/v1", True),
    ],
)
async def test_an_origin_url_not_ending_with_v1_is_saved_and_warned_of(
    url: str, warns: bool
) -> None:
    async with admin(MemoryStore()) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="us")))
        spec = apb.OriginSpec(name="o1", base_url=url, region="us", models=["m"])
        warnings = await warned(stub.PutOrigin(apb.PutOriginRequest(origin=spec)))
        assert [o.name for o in (await stub.ListOrigins(apb.ListRequest())).origins] == ["o1"]
    if warns:
        [warning] = warnings
        assert warning.startswith(f"origin 'o1': base URL {url!r} ")
        assert f"{url + '/chat/completions'!r}" in warning
    else:
        assert warnings == []


async def test_tenant_writes_are_accepted_and_warned_of_unserved_targets() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        put = pb.Tenant(name="acme", prompt=prompt(big="sim-huge", small="sim-small"))
        assert await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put))) == [
            WARNING,
            WARNING.replace("sim-huge", "sim-small").replace("'big'", "'small'"),
        ]
        stored = (await stub.ListTenants(apb.ListRequest())).tenants[0]
        assert dict(stored.prompt.aliases) == {"big": "sim-huge", "small": "sim-small"}
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="us")))
        spec = apb.OriginSpec(name="o1", base_url="http://h/v1", region="us", models=["sim-small"])
        await stub.PutOrigin(apb.PutOriginRequest(origin=spec))
        update = apb.UpdateTenantRequest(name="acme", prompt=prompt(big="sim-huge"))
        assert await warned(stub.UpdateTenant(update)) == [WARNING]
        # An update that leaves the prompt alone does not repeat the warning.
        limits = apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=60))
        assert await warned(stub.UpdateTenant(limits)) == []
        update = apb.UpdateTenantRequest(name="acme", prompt=prompt(big="sim-small"))
        assert await warned(stub.UpdateTenant(update)) == []


async def test_apply_and_its_dry_run_are_warned() -> None:
    doc = {"tenants": [{"name": "acme", "prompt": {"aliases": {"big": "sim-huge"}}}]}
    async with admin(MemoryStore()) as stub:
        for dry_run in (True, False):
            request = apb.ApplyRequest(document=orjson.dumps(doc).decode(), dry_run=dry_run)
            assert await warned(stub.Apply(request)) == [WARNING]
        assert (await stub.ListTenants(apb.ListRequest())).tenants[0].name == "acme"


async def test_a_write_stands_when_its_aliases_cannot_be_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ListFails()
    async with admin(store) as stub:
        store.failing = True
        put = pb.Tenant(name="acme", prompt=prompt(big="sim-huge"))
        assert await warned(stub.PutTenant(apb.PutTenantRequest(tenant=put))) == []
        store.failing = False
        assert [t.name for t in (await stub.ListTenants(apb.ListRequest())).tenants] == ["acme"]
    [line] = [r for r in caplog.records if "aliases were not checked" in r.getMessage()]
    assert line.exc_info is None


async def test_a_token_default_above_the_max_tokens_ceiling_is_warned_of() -> None:
    """Trial 52: `tenant set acme --max-tokens 100 --default max_tokens=5000`
    was saved without a word; the proxies clamp the default to the ceiling."""
    clamped = (
        "default {0} 5000 of tenant 'acme' is above its max_tokens ceiling 100: the proxies "
        "clamp it, so requests without {0} get 100"
    )
    defaults = {"max_tokens": "5000", "max_output_tokens": "5000", "temperature": "0"}
    async with admin(MemoryStore()) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        capped = pb.PromptPolicy(max_tokens_ceiling=100, defaults=defaults)
        update = apb.UpdateTenantRequest(name="acme", prompt=capped)
        assert await warned(stub.UpdateTenant(update)) == [
            clamped.format("max_output_tokens"),
            clamped.format("max_tokens"),
        ]
        within = pb.PromptPolicy(max_tokens_ceiling=5000, defaults=defaults)
        update = apb.UpdateTenantRequest(name="acme", prompt=within)
        assert await warned(stub.UpdateTenant(update)) == []
        prompt = {"max_tokens": 100, "defaults": {"max_completion_tokens": 5000}}
        doc = {"tenants": [{"name": "acme", "prompt": prompt}]}
        request = apb.ApplyRequest(document=orjson.dumps(doc).decode(), dry_run=True)
        assert await warned(stub.Apply(request)) == [clamped.format("max_completion_tokens")]
    # What the warning says the proxies do.
    body: dict[str, Any] = {"model": "m", "messages": []}
    assemble(
        "chat.completions", body, PromptRules(defaults={"max_tokens": 5000}, max_tokens_ceiling=100)
    )
    assert body["max_tokens"] == 100


async def test_a_warnings_read_that_times_out_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A write's warnings not read in time are logged with why, not with an
    empty reason (trial 83: `... refuse the route table: ` at 20,000 keys)."""

    async def late() -> list[str]:
        raise TimeoutError

    with caplog.at_level("WARNING", logger="controlplane.api.admin"):
        assert await checked(late(), "write saved; not checked") == ()
    assert [r.getMessage() for r in caplog.records] == [
        f"write saved; not checked: no answer within {WARNINGS_READ_S:g} s"
    ]
