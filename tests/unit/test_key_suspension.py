"""A suspended API key (a key suspected leaked, or a caller to stop for a
while, could only be revoked, for good): stored, compiled, set through the
Admin API and audited, shown and set by pontoctl's `key suspend` and `key
resume`. The proxy's side: tests/functional/test_key_suspended.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from controlplane.catalog import REPLICAS, Catalog
from controlplane.cli import _AUDITED, _keys_text, _parser, _rows_keys, run
from controlplane.compile import compile_table
from controlplane.errors import FailedPrecondition, NotFound
from controlplane.model import (
    ApiKeyRecord,
    Limits,
    ProxyRecord,
    Tenant,
    decode_key,
    decode_proxy,
    encode,
)
from controlplane.store.memory import MemoryStore
from ponto.features import FEATURES, KEY_SUSPENSION
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import admin, warned


def test_the_flag_is_stored_and_read_back_and_old_records_are_not_suspended() -> None:
    key = ApiKeyRecord("abcdefghij", "00" * 32, "acme", suspended=True)
    assert decode_key(encode(key)) == key
    old = orjson.loads(encode(ApiKeyRecord("abcdefghij", "00" * 32, "acme")))
    del old["suspended"]  # a record written before suspension
    assert decode_key(orjson.dumps(old)).suspended is False


async def test_the_catalog_suspends_and_resumes_writing_only_changes() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme", limits=Limits(rpm=5), models=["m"])
    suspended, written = await catalog.set_key_suspended(record.id, True)
    assert suspended.suspended and written
    [stored] = (await catalog.snapshot()).keys
    assert stored.suspended
    revision = (await store.list("/")).revision
    again, written = await catalog.set_key_suspended(record.id, True)
    assert again == suspended and not written
    assert (await store.list("/")).revision == revision  # nothing written
    resumed, written = await catalog.set_key_suspended(record.id, False)
    assert written and resumed == record  # all else it had is kept
    with pytest.raises(NotFound):
        await catalog.set_key_suspended("zzzzzzzzzz", True)
    await catalog.revoke_key(record.id)
    with pytest.raises(FailedPrecondition, match="is revoked: its callers are refused for good"):
        await catalog.set_key_suspended(record.id, True)


async def test_a_suspended_key_is_in_the_table_flagged_and_a_revoked_one_is_not_at_all() -> None:
    catalog = Catalog(MemoryStore())
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    kept, _, _ = await catalog.create_key("acme")
    gone, _, _ = await catalog.create_key("acme")
    await catalog.set_key_suspended(kept.id, True)
    await catalog.set_key_suspended(gone.id, True)
    await catalog.revoke_key(gone.id)
    table = compile_table(await catalog.snapshot())
    assert [(k.id, k.suspended) for k in table.keys] == [(kept.id, True)]


async def test_the_admin_api_suspends_resumes_and_audits_each_as_its_own_action() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))
        key_id = created.key.id
        on = await stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=True))
        assert on.suspended and on.id == key_id and on.tenant == "acme"
        await stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=True))
        [listed] = (await stub.ListKeys(apb.ListKeysRequest())).keys
        assert listed.suspended
        off = await stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=False))
        assert not off.suspended
        entries = (await stub.ListAudit(apb.ListAuditRequest())).entries
        trail = [
            (e.action, e.target, e.detail["changes"])
            for e in entries
            if e.action in ("SuspendKey", "ResumeKey")
        ]
        assert sorted(trail) == sorted(
            [
                ("SuspendKey", f"key/{key_id}", "suspended false -> true"),
                ("SuspendKey", f"key/{key_id}", "nothing"),
                ("ResumeKey", f"key/{key_id}", "suspended true -> false"),
            ]
        )


class Stub:
    """The Admin calls of `key suspend` and `key resume`, over one key."""

    def __init__(self, key: apb.ApiKeyInfo) -> None:
        self.key = key
        self.sent: list[apb.SetKeySuspendedRequest] = []

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=[self.key])

    def SetKeySuspended(self, req: apb.SetKeySuspendedRequest) -> apb.ApiKeyInfo:
        self.sent.append(req)
        self.key.suspended = req.suspended
        return self.key

    tenant_suspended = False

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(
            tenants=[pb.Tenant(name="acme", suspended=self.tenant_suspended)]
        )


def pontoctl(stub: Any, *argv: str) -> str:
    return run(_parser().parse_args(list(argv)), stub)


def test_pontoctl_suspends_and_resumes_and_says_what_proxies_do() -> None:
    stub = Stub(apb.ApiKeyInfo(id="abcdefghij", tenant="acme"))
    said = pontoctl(stub, "key", "suspend", "abcdefghij")
    assert said == (
        "key abcdefghij of tenant acme suspended: proxies refuse its callers "
        "(403 api_key_suspended) once they take the next table; `pontoctl key resume "
        "abcdefghij` serves them again"
    )
    assert [r.suspended for r in stub.sent] == [True]
    assert pontoctl(stub, "key", "suspend", "abcdefghij") == (
        "key abcdefghij of tenant acme was already suspended: nothing changed"
    )
    assert pontoctl(stub, "key", "resume", "abcdefghij") == "key abcdefghij of tenant acme resumed"
    assert pontoctl(stub, "key", "resume", "abcdefghij") == (
        "key abcdefghij of tenant acme was not suspended: nothing changed"
    )


def test_resuming_a_key_of_a_suspended_tenant_says_its_callers_are_still_refused() -> None:
    """Trial 70: "resumed", exit 0, and the client still got 403 tenant_suspended."""
    stub = Stub(apb.ApiKeyInfo(id="abcdefghij", tenant="acme", suspended=True))
    stub.tenant_suspended = True
    assert pontoctl(stub, "key", "resume", "abcdefghij") == (
        "key abcdefghij of tenant acme resumed, but its tenant is suspended: proxies refuse "
        "its callers (403 tenant_suspended) until `pontoctl tenant set acme --suspended off`"
    )


def test_resuming_an_expired_key_says_it_is_still_refused() -> None:
    stub = Stub(apb.ApiKeyInfo(id="abcdefghij", tenant="acme", expires_at=1.0, suspended=True))
    said = pontoctl(stub, "key", "resume", "abcdefghij")
    assert said.startswith("key abcdefghij of tenant acme resumed, but it expired ")
    assert "proxies refuse it as expired" in said


@pytest.mark.parametrize(
    ("key", "state"),
    [
        (apb.ApiKeyInfo(suspended=True), "suspended"),
        (apb.ApiKeyInfo(suspended=True, expires_at=1.0), "expired,suspended"),
        (apb.ApiKeyInfo(suspended=True, revoked=True), "revoked"),
        (apb.ApiKeyInfo(), "active"),
    ],
)
def test_key_list_shows_the_state_in_one_field(key: apb.ApiKeyInfo, state: str) -> None:
    key.id, key.tenant = "abcdefghij", "acme"
    header, [row] = _rows_keys(apb.ListKeysResponse(keys=[key]))
    assert header[-1] == "STATE" and row[-1] == state


def test_key_list_active_hides_suspended_keys() -> None:
    class Listing(Stub):
        def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
            return apb.ListTenantsResponse(tenants=[pb.Tenant(name="acme")])

        def ListOrigins(self, req: apb.ListRequest) -> apb.ListOriginsResponse:
            return apb.ListOriginsResponse()

    stub = Listing(apb.ApiKeyInfo(id="abcdefghij", tenant="acme", suspended=True))
    assert "abcdefghij" in pontoctl(stub, "key", "list")
    assert "abcdefghij" not in pontoctl(stub, "key", "list", "--active")


def test_a_tables_summary_counts_suspended_keys_apart() -> None:
    keys = [pb.ApiKey(id="a"), pb.ApiKey(id="b", suspended=True), pb.ApiKey(id="c")]
    assert _keys_text(keys) == "3 keys (1 suspended)"
    assert _keys_text(keys[:1]) == "1 active keys"


def test_get_audit_filters_by_the_actions_a_suspension_is_recorded_as() -> None:
    assert {"SuspendKey", "ResumeKey"} <= _AUDITED and "SetKeySuspended" not in _AUDITED


async def test_suspending_warns_of_the_processes_of_a_build_without_it() -> None:
    """Trial 69: behind an older proxy, or while an older replica led, a
    suspended caller was served and nothing said so. Each process lists
    what it enforces (ponto/features.py); one that does not list key
    suspension is named with the write."""
    store = MemoryStore()
    lease = await store.grant_lease(60)
    catalog = Catalog(store)
    for name, features in (("p-new", FEATURES), ("p-old", ())):
        record = ProxyRecord(name, "r1", "", "0.1.0", "s-" + name, "cp-1", 0.0, features=features)
        await catalog.register_proxy(record, lease)
    for replica, listed in (("cp-new", list(FEATURES)), ("cp-old", None)):
        announced = {"id": replica, "address": "", "started_at": 0.0}
        if listed is not None:
            announced["features"] = listed
        await store.put(REPLICAS + replica, orjson.dumps(announced), lease=lease)
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        key_id = (await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))).key.id
        said = await warned(
            stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=True))
        )
        assert [w for w in said if KEY_SUSPENSION in w] == [
            f"proxies p-old are of a build without {KEY_SUSPENSION}, or registered through a "
            "replica of one (pontoctl get proxies, VERSION): they serve the key's callers "
            "until upgraded",
            f"control-plane replicas cp-old are of a build without {KEY_SUSPENSION} (pontoctl "
            "get controlplanes, VERSION): while one of them leads, the tables lack it and every "
            "proxy does the same",
        ]
        # Suspending it again changes nothing, and says nothing of builds.
        said = await warned(
            stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=True))
        )
        assert not [w for w in said if KEY_SUSPENSION in w]
        # Resuming needs no build: an older process never refused the key.
        said = await warned(
            stub.SetKeySuspended(apb.SetKeySuspendedRequest(id=key_id, suspended=False))
        )
        assert not [w for w in said if KEY_SUSPENSION in w]


def test_a_proxy_lists_what_it_enforces_when_it_registers() -> None:
    assert KEY_SUSPENSION in FEATURES
    record = ProxyRecord("p", "r1", "", "0.1.0", "s", "cp-1", 0.0, features=FEATURES)
    assert decode_proxy(encode(record)).features == FEATURES
    old = orjson.loads(encode(record))
    del old["features"]  # a registration written before the list
    assert decode_proxy(orjson.dumps(old)).features == ()
