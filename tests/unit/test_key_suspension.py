"""A suspended API key (a key suspected leaked, or a caller to stop for a
while, could only be revoked, for good): stored, compiled, set through the
Admin API and audited, shown and set by pontoctl's `key suspend` and `key
resume`. The proxy's side: tests/functional/test_key_suspended.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import grpc
import orjson
import pytest

from controlplane.catalog import REPLICAS, Catalog
from controlplane.cli import _AUDITED, Shown, _keys_text, _parser, _rows_audit, _rows_keys, run
from controlplane.compile import compile_table
from controlplane.errors import FailedPrecondition, InvalidArgument, NotFound
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
    # A replica older than reasons resumed the key and kept the reason.
    why = replace(key, suspended_reason="leaked", suspended_at=5.0)
    assert decode_key(encode(why)) == why
    resumed = orjson.loads(encode(why)) | {"suspended": False}
    assert decode_key(orjson.dumps(resumed)) == replace(key, suspended=False)


async def test_the_catalog_suspends_and_resumes_writing_only_changes() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme", limits=Limits(rpm=5), models=["m"])
    suspended, before = await catalog.set_key_suspended(record.id, True)
    assert suspended.suspended and before == record
    [stored] = (await catalog.snapshot()).keys
    assert stored.suspended
    revision = (await store.list("/")).revision
    again, before = await catalog.set_key_suspended(record.id, True)
    assert again == suspended and before is None
    assert (await store.list("/")).revision == revision  # nothing written
    resumed, before = await catalog.set_key_suspended(record.id, False)
    assert before == suspended and resumed == record  # all else it had is kept
    with pytest.raises(NotFound):
        await catalog.set_key_suspended("zzzzzzzzzz", True)
    await catalog.revoke_key(record.id)
    with pytest.raises(FailedPrecondition, match="is revoked: its callers are refused for good"):
        await catalog.set_key_suspended(record.id, True)


async def test_a_suspension_keeps_its_reason_and_time_until_the_key_is_resumed() -> None:
    now = [1000.0]
    catalog = Catalog(MemoryStore(), clock=lambda: now[0])
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    suspended, _ = await catalog.set_key_suspended(record.id, True, "leaked in a CI log")
    assert (suspended.suspended_reason, suspended.suspended_at) == ("leaked in a CI log", 1000.0)
    [stored] = (await catalog.snapshot()).keys
    assert stored == suspended
    now[0] = 2000.0
    # Another reason replaces the reason; the key stays suspended since then.
    moved, before = await catalog.set_key_suspended(record.id, True, "rotated upstream")
    assert before == suspended
    assert (moved.suspended_reason, moved.suspended_at) == ("rotated upstream", 1000.0)
    # No reason, or the same one: nothing written.
    assert (await catalog.set_key_suspended(record.id, True))[1] is None
    assert (await catalog.set_key_suspended(record.id, True, "rotated upstream"))[1] is None
    resumed, _ = await catalog.set_key_suspended(record.id, False, "the app has a new key")
    assert resumed == record  # reason and time go with the suspension
    # Suspended again: the time is the new suspension's, the old reason gone.
    again, _ = await catalog.set_key_suspended(record.id, True)
    assert (again.suspended_reason, again.suspended_at) == ("", 2000.0)
    # The longest reason taken; spaces around one are not kept.
    longest, _ = await catalog.set_key_suspended(record.id, True, " " + "x" * 200 + " ")
    assert longest.suspended_reason == "x" * 200
    # None given keeps it; an empty one, or one of spaces, clears it (trial 72).
    assert (await catalog.set_key_suspended(record.id, True))[1] is None
    cleared, _ = await catalog.set_key_suspended(record.id, True, "   ")
    assert (cleared.suspended_reason, cleared.suspended_at) == ("", 2000.0)


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        ("x" * 201, "longer than 200 characters"),
        ("two\nlines", "hidden character"),
        ("\x1b[31mred", "hidden character"),
    ],
)
async def test_a_reason_is_one_short_line_of_printable_text(reason: str, said: str) -> None:
    catalog = Catalog(MemoryStore())
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    with pytest.raises(InvalidArgument, match=said):
        await catalog.set_key_suspended(record.id, True, reason)
    [stored] = (await catalog.snapshot()).keys
    assert stored == record


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


async def test_the_admin_api_keeps_a_reason_and_the_audit_trail_says_it() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        key_id = (await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))).key.id
        on = await stub.SetKeySuspended(
            apb.SetKeySuspendedRequest(id=key_id, suspended=True, reason="leaked")
        )
        assert on.suspended_reason == "leaked" and on.suspended_at > 0
        await stub.SetKeySuspended(
            apb.SetKeySuspendedRequest(id=key_id, suspended=True, reason="still leaked")
        )
        [listed] = (await stub.ListKeys(apb.ListKeysRequest())).keys
        assert (listed.suspended_reason, listed.suspended_at) == ("still leaked", on.suspended_at)
        off = await stub.SetKeySuspended(
            apb.SetKeySuspendedRequest(id=key_id, suspended=False, reason="new key deployed")
        )
        assert (off.suspended_reason, off.suspended_at) == ("", 0.0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetKeySuspended(
                apb.SetKeySuspendedRequest(id=key_id, suspended=True, reason="a\nb")
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        entries = (await stub.ListAudit(apb.ListAuditRequest())).entries
        trail = sorted(
            (e.action, e.detail.get("reason", ""), e.detail["changes"])
            for e in entries
            if e.action in ("SuspendKey", "ResumeKey") and e.result == "ok"
        )
        assert trail == [
            (
                "ResumeKey",
                "new key deployed",
                'suspended true -> false; suspended_reason "still leaked" -> removed',
            ),
            ("SuspendKey", "leaked", 'suspended false -> true; suspended_reason unset -> "leaked"'),
            ("SuspendKey", "still leaked", 'suspended_reason "leaked" -> "still leaked"'),
        ]


class Stub:
    """The Admin calls of `key suspend` and `key resume`, over one key."""

    def __init__(self, key: apb.ApiKeyInfo) -> None:
        self.key = key
        self.sent: list[apb.SetKeySuspendedRequest] = []

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=[self.key])

    def SetKeySuspended(self, req: apb.SetKeySuspendedRequest) -> apb.ApiKeyInfo:
        self.sent.append(req)
        answer = apb.ApiKeyInfo()
        answer.CopyFrom(self.key)
        answer.suspended = req.suspended
        if not req.suspended:
            answer.suspended_reason, answer.suspended_at = "", 0.0
        elif req.HasField("reason"):
            answer.suspended_reason = req.reason
        self.key = answer
        return answer

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


def test_pontoctl_sends_a_reason_and_says_it() -> None:
    stub = Stub(apb.ApiKeyInfo(id="abcdefghij", tenant="acme"))
    said = pontoctl(stub, "key", "suspend", "abcdefghij", "--reason", "leaked in a CI log")
    assert said.startswith("key abcdefghij of tenant acme suspended (leaked in a CI log): ")
    assert not isinstance(said, Shown) or not said.not_saved
    assert pontoctl(stub, "key", "suspend", "abcdefghij", "--reason", "rotated") == (
        "key abcdefghij of tenant acme was suspended: reason now 'rotated'"
    )
    # Not given: the reason is kept; empty: cleared (trial 72).
    pontoctl(stub, "key", "suspend", "abcdefghij")
    assert not stub.sent[-1].HasField("reason") and stub.key.suspended_reason == "rotated"
    assert pontoctl(stub, "key", "suspend", "abcdefghij", "--reason", "") == (
        "key abcdefghij of tenant acme was suspended: reason cleared"
    )
    pontoctl(stub, "key", "resume", "abcdefghij", "--reason", "new key deployed")
    assert [(r.suspended, r.reason) for r in stub.sent] == [
        (True, "leaked in a CI log"),
        (True, "rotated"),
        (True, ""),
        (True, ""),
        (False, "new key deployed"),
    ]


def test_a_reason_an_older_control_plane_dropped_is_not_saved() -> None:
    """Such a control plane suspends the key and answers without a reason."""

    class Older(Stub):
        def SetKeySuspended(self, req: apb.SetKeySuspendedRequest) -> apb.ApiKeyInfo:
            self.key.suspended = req.suspended
            return self.key

    said = pontoctl(Older(apb.ApiKeyInfo(id="abcdefghij", tenant="acme")), "key", "suspend",
                    "abcdefghij", "--reason", "leaked")  # fmt: skip
    assert said.startswith("key abcdefghij of tenant acme suspended: ")
    assert isinstance(said, Shown) and said.not_saved == ("reason",)
    stub = Older(apb.ApiKeyInfo(id="abcdefghij", tenant="acme", suspended=True))
    said = pontoctl(stub, "key", "suspend", "abcdefghij", "--reason", "leaked")
    assert isinstance(said, Shown) and said.not_saved == ("reason",)


class Listing(Stub):
    """`key list`'s calls, over `keys` (default: the one key)."""

    def __init__(self, key: apb.ApiKeyInfo, keys: list[apb.ApiKeyInfo] | None = None) -> None:
        super().__init__(key)
        self.keys = keys or [key]

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=self.keys)

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[pb.Tenant(name="acme")])

    def ListOrigins(self, req: apb.ListRequest) -> apb.ListOriginsResponse:
        return apb.ListOriginsResponse()


def test_key_list_says_since_when_and_why_each_suspended_key_is() -> None:
    keys = [
        apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme", suspended=True,
                       suspended_reason="leaked in a CI log", suspended_at=1.7e9),
        apb.ApiKeyInfo(id="bbbbbbbbbb", tenant="acme", suspended=True),  # an older control plane's
        apb.ApiKeyInfo(id="cccccccccc", tenant="acme"),
        apb.ApiKeyInfo(id="dddddddddd", tenant="acme", revoked=True, suspended=True),
    ]  # fmt: skip
    keys[2].suspended, keys[2].suspended_at = True, 1.7e9  # no reason, hidden characters
    keys.append(apb.ApiKeyInfo(id="eeeeeeeeee", tenant="acme", suspended=True,
                               suspended_reason="\x1b[2Jgone", suspended_at=1.7e9))  # fmt: skip
    lines = pontoctl(Listing(keys[0], keys), "key", "list").splitlines()
    assert lines[-4:] == [
        "key aaaaaaaaaa suspended since 2023-11-14T22:13:20Z: leaked in a CI log",
        "key bbbbbbbbbb suspended: since when and why unknown (an older control plane's)",
        "key cccccccccc suspended since 2023-11-14T22:13:20Z: no reason given",
        "key eeeeeeeeee suspended since 2023-11-14T22:13:20Z: \\x1b[2Jgone",
    ]
    shown = orjson.loads(pontoctl(Listing(keys[0], keys), "key", "list", "-o", "json"))
    assert shown["keys"][0]["suspended_reason"] == "leaked in a CI log"


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


def test_a_key_reason_of_spaces_is_none_and_not_called_unsaved() -> None:
    stub = Stub(apb.ApiKeyInfo(id="abcdefghij", tenant="acme"))
    said = pontoctl(stub, "key", "suspend", "abcdefghij", "--reason", "   ")
    assert stub.sent[-1].reason == ""
    assert not isinstance(said, Shown) or not said.not_saved


def test_get_audit_says_why_a_key_was_resumed() -> None:
    """Trial 72: a resumption's reason was in `-o json` alone."""

    def entry(action: str, changes: str, reason: str) -> apb.AuditEntry:
        return apb.AuditEntry(
            action=action, target="key/k", detail={"changes": changes, "reason": reason}
        )

    resumed = entry("ResumeKey", 'suspended true -> false; suspended_reason "x" -> removed', "ok")
    suspended = entry("SuspendKey", 'suspended false -> true; suspended_reason unset -> "x"', "x")
    _, rows = _rows_audit(apb.ListAuditResponse(entries=[resumed, suspended]))
    changes = [row[5] for row in rows]
    assert changes == [
        'suspended true -> false; suspended_reason "x" -> removed (reason: ok)',
        'suspended false -> true; suspended_reason unset -> "x"',  # said already
    ]


def test_a_clear_an_older_control_plane_did_not_apply_is_not_saved() -> None:
    """Review 281: one before reasons could be cleared keeps the reason, and
    pontoctl said nothing changed, exit 0."""

    class Older(Stub):
        def SetKeySuspended(self, req: apb.SetKeySuspendedRequest) -> apb.ApiKeyInfo:
            self.sent.append(req)
            return self.key  # already suspended; an empty reason read as none

    key = apb.ApiKeyInfo(id="abcdefghij", tenant="acme", suspended=True, suspended_reason="x")
    said = pontoctl(Older(key), "key", "suspend", "abcdefghij", "--reason", "")
    assert isinstance(said, Shown) and said.not_saved == ("reason",)


def test_get_audit_says_a_resumptions_reason_even_when_it_was_the_suspensions() -> None:
    resumed = apb.AuditEntry(
        action="ResumeKey",
        detail={
            "changes": 'suspended true -> false; suspended_reason "x" -> removed',
            "reason": "x",
        },
    )
    _, [row] = _rows_audit(apb.ListAuditResponse(entries=[resumed]))
    assert row[5].endswith("(reason: x)")
