"""A suspended tenant (trial 30: a tenant could only be stopped by revoking
every key and deleting it): stored, compiled, applied, audited and shown by
the control plane; pontoctl's `tenant set --suspended on|off`. The proxy's
side: tests/functional/test_suspended.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from controlplane.apply import document, parse, tenant_changes
from controlplane.catalog import Catalog
from controlplane.cli import Shown, UsageError, _parser, _rows_tenants, _tenant_notes, run
from controlplane.compile import compile_table, tenant_pb
from controlplane.errors import InvalidArgument
from controlplane.messages import tenant_of
from controlplane.model import Limits, State, Tenant, decode_tenant, encode, suspension_stamped
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import admin
from tests.unit.test_apply import errors_of


def test_the_flag_is_stored_and_read_back_and_old_records_are_not_suspended() -> None:
    suspended = Tenant("acme", suspended=True)
    assert decode_tenant(encode(suspended)) == suspended
    old = orjson.loads(encode(Tenant("acme")))
    del old["suspended"]  # a record written before suspension
    assert decode_tenant(orjson.dumps(old)).suspended is False
    assert tenant_of(tenant_pb(suspended)) == suspended


def test_a_file_suspends_a_tenant_and_its_export_says_so() -> None:
    [t] = parse({"tenants": [{"name": "acme", "suspended": True}]}).tenants
    assert t.suspended
    assert document(tenants=[t])["tenants"] == [
        {"name": "acme", "cache": {"mode": "exact"}, "suspended": True}
    ]
    assert "suspended" not in document(tenants=[Tenant("acme")])["tenants"][0]
    assert errors_of({"tenants": [{"name": "acme", "suspended": "yes"}]}) == [
        "tenants[0].suspended: expected true or false, got 'yes'"
    ]
    assert tenant_changes(Tenant("acme"), t) == "suspended false -> true"


async def test_the_admin_api_suspends_lifts_audits_and_compiles() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        on = await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", suspended=True))
        assert on.suspended
        [tenant] = compile_table(await Catalog(store).snapshot()).tenants
        assert tenant.suspended
        # An update without the field keeps it.
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=5)))
        [kept] = (await stub.ListTenants(apb.ListRequest())).tenants
        assert kept.suspended
        off = await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", suspended=False))
        assert not off.suspended
        audit = (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
        changes = [e.detail["changes"] for e in audit]
        assert "suspended false -> true" in changes and "suspended true -> false" in changes


class Stub:
    """The Admin calls of `tenant set`; keeps what was sent. `drops`: a
    control plane from before suspension, which drops the field."""

    def __init__(self, *, drops: bool = False) -> None:
        self.current = pb.Tenant(name="acme")
        self.sent: list[apb.UpdateTenantRequest] = []
        self.drops = drops

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[self.current])

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        self.sent.append(req)
        if req.HasField("suspended") and not self.drops:
            self.current.suspended = req.suspended
            if not req.suspended:
                self.current.suspended_reason = ""
        if req.HasField("suspended_reason") and not self.drops:
            self.current.suspended_reason = req.suspended_reason
        return self.current


def pontoctl(stub: Any, *argv: str) -> str:
    return run(_parser().parse_args(list(argv)), stub)


def sent_flag(stub: Stub) -> bool | None:
    """The last request's `suspended`, None when it did not set it."""
    last = stub.sent[-1]
    return last.suspended if last.HasField("suspended") else None


def test_tenant_set_suspends_and_lifts_and_says_so() -> None:
    stub = Stub()
    said = pontoctl(stub, "tenant", "set", "acme", "--suspended", "on")
    assert said.splitlines() == [
        "tenant acme saved (cache ; routing default) SUSPENDED: its callers are refused "
        "(403 tenant_suspended)",
        "  changed: suspended false -> true",
    ]
    assert sent_flag(stub) is True
    assert "unchanged" in pontoctl(stub, "tenant", "set", "acme", "--suspended", "on")
    assert len(stub.sent) == 1
    said = pontoctl(stub, "tenant", "set", "acme", "--suspended", "off")
    assert "SUSPENDED" not in said and not stub.current.suspended
    assert sent_flag(stub) is False
    # Another setting leaves the flag alone.
    pontoctl(stub, "tenant", "set", "acme", "--cache", "off")
    assert sent_flag(stub) is None


def test_a_control_plane_that_drops_the_flag_is_called_out() -> None:
    said = pontoctl(Stub(drops=True), "tenant", "set", "acme", "--suspended", "on")
    assert "NOT SUSPENDED: the control plane does not support suspension" in said


@pytest.mark.parametrize(("suspended", "state"), [(True, "suspended"), (False, "serving")])
def test_get_tenants_shows_the_state_last(suspended: bool, state: str) -> None:
    header, [row] = _rows_tenants(
        apb.ListTenantsResponse(tenants=[pb.Tenant(name="acme", suspended=suspended)])
    )
    assert header[-1] == "STATE" and row[-1] == state


def test_a_reason_is_stored_applied_and_exported_but_never_in_a_table() -> None:
    t = Tenant("acme", suspended=True, suspended_reason="invoice unpaid")
    assert decode_tenant(encode(t)) == t
    # A replica older than reasons lifted the suspension and kept the reason.
    lifted = orjson.loads(encode(t)) | {"suspended": False}
    assert decode_tenant(orjson.dumps(lifted)) == Tenant("acme")
    assert tenant_of(tenant_pb(t)) == t
    [applied] = parse(
        {"tenants": [{"name": "acme", "suspended": True, "suspended_reason": "invoice unpaid"}]}
    ).tenants
    assert applied == t.validated()
    assert replace(t, suspended_reason=" unpaid ").validated().suspended_reason == "unpaid"
    assert document(tenants=[t])["tenants"][0]["suspended_reason"] == "invoice unpaid"
    assert tenant_changes(Tenant("acme", suspended=True), t) == (
        'suspended_reason unset -> "invoice unpaid"'
    )
    table = compile_table(State(revision=7, tenants=(t,)))
    assert [x.suspended_reason for x in table.tenants] == [""]
    # A new reason is no new content for the proxies (the etag they compare).
    without = compile_table(State(revision=7, tenants=(Tenant("acme", suspended=True),)))
    assert table.etag == without.etag


@pytest.mark.parametrize(
    ("tenant", "said"),
    [
        (Tenant("acme", suspended_reason="why"), "the tenant is not suspended"),
        (Tenant("acme", suspended=True, suspended_reason="x" * 201), "longer than 200"),
        (Tenant("acme", suspended=True, suspended_reason="a\nb"), "hidden character"),
    ],
)
def test_a_reason_is_one_short_line_for_a_suspended_tenant(tenant: Tenant, said: str) -> None:
    with pytest.raises(InvalidArgument, match=said):
        tenant.validated()
    if tenant.suspended:  # as stored, read (review 279: the tenant left the table)
        read = decode_tenant(encode(tenant)).validated(stored=True)
        assert read.suspended and read.suspended_reason in ("x" * 200, "a\\nb")
    assert errors_of(
        {"tenants": [{"name": "acme", "suspended": tenant.suspended,
                      "suspended_reason": tenant.suspended_reason}]}
    )[0].startswith("tenants[0].suspended_reason: ")  # fmt: skip


async def test_the_admin_api_keeps_a_reason_until_the_suspension_is_lifted() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        on = await stub.UpdateTenant(
            apb.UpdateTenantRequest(name="acme", suspended=True, suspended_reason="unpaid")
        )
        assert (on.suspended, on.suspended_reason) == (True, "unpaid")
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=5)))
        [kept] = (await stub.ListTenants(apb.ListRequest())).tenants
        assert kept.suspended_reason == "unpaid"
        off = await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", suspended=False))
        assert (off.suspended, off.suspended_reason) == (False, "")
        audit = (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
        changes = [e.detail["changes"] for e in audit]
        assert 'suspended false -> true; suspended_reason unset -> "unpaid"' in changes
        assert 'suspended true -> false; suspended_reason "unpaid" -> removed' in changes


def test_tenant_set_sends_a_reason_and_says_it() -> None:
    stub = Stub()
    said = pontoctl(stub, "tenant", "set", "acme", "--suspended", "on", "--reason", "unpaid")
    assert said.splitlines()[0].endswith("SUSPENDED: its callers are refused "
                                         "(403 tenant_suspended) (unpaid)")  # fmt: skip
    assert stub.sent[-1].suspended_reason == "unpaid"
    # Of a suspended tenant, --reason alone replaces the reason.
    pontoctl(stub, "tenant", "set", "acme", "--reason", "fraud review")
    assert stub.sent[-1].suspended_reason == "fraud review"
    assert not stub.sent[-1].HasField("suspended")
    notes = _tenant_notes([stub.current, pb.Tenant(name="b", suspended=True)], served=())
    assert notes == ["tenant acme suspended: fraud review"]  # b has no reason to say
    pontoctl(stub, "tenant", "set", "acme", "--suspended", "off")
    assert stub.current.suspended_reason == ""


@pytest.mark.parametrize("argv", [("--reason", "why"), ("--suspended", "off", "--reason", "why")])
def test_a_reason_for_a_tenant_left_serving_is_refused_before_anything_is_sent(
    argv: tuple[str, ...],
) -> None:
    stub = Stub()
    with pytest.raises(UsageError, match="--reason says why a tenant is suspended"):
        pontoctl(stub, "tenant", "set", "acme", *argv)
    assert stub.sent == []


def test_a_reason_an_older_control_plane_dropped_is_not_saved() -> None:
    """A control plane that knows suspension but not reasons."""

    class Older(Stub):
        def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
            self.sent.append(req)
            self.current.suspended = req.suspended
            return self.current

    said = pontoctl(Older(), "tenant", "set", "acme", "--suspended", "on", "--reason", "unpaid")
    assert isinstance(said, Shown) and said.not_saved == ("suspended_reason",)


def test_a_reason_of_spaces_is_none_and_not_called_unsaved() -> None:
    """Review 279: the control plane keeps none, so pontoctl said NOT SAVED."""
    stub = Stub()
    said = pontoctl(stub, "tenant", "set", "acme", "--suspended", "on", "--reason", "   ")
    assert not stub.sent[-1].HasField("suspended_reason")
    assert not isinstance(said, Shown) or not said.not_saved


async def test_a_tenant_keeps_since_when_it_is_suspended_on_every_write_path() -> None:
    """Trial 72: a tenant's suspension kept no time (the page said none, and
    `get audit` was the only way to learn how long). The catalog stamps it on
    the write that suspends, keeps it while suspended, clears it on lifting;
    a file or a caller cannot set it."""
    now = [100.0]
    catalog = Catalog(MemoryStore(), clock=lambda: now[0])

    async def since(name: str) -> float:
        [t] = [t for t in (await catalog.snapshot()).tenants if t.name == name]
        return t.suspended_at

    await catalog.put_tenant(Tenant("acme", suspended=True, suspended_at=5.0), allow_update=False)
    assert await since("acme") == 100.0  # put: stamped, the caller's time not taken
    now[0] = 200.0
    await catalog.update_tenant("acme", lambda t: replace(t, limits=Limits(rpm=5)))
    assert await since("acme") == 100.0  # still suspended: kept
    await catalog.put_tenant(Tenant("acme", suspended=True), allow_update=True)
    assert await since("acme") == 100.0
    doc = {"tenants": [{"name": "acme", "suspended": True, "suspended_reason": "unpaid"}]}
    await catalog.apply(doc, prune=False, dry_run=False)
    assert await since("acme") == 100.0  # apply: kept, the file says nothing of it
    await catalog.update_tenant("acme", lambda t: replace(t, suspended=False, suspended_reason=""))
    assert await since("acme") == 0.0
    now[0] = 300.0
    await catalog.apply(
        {"tenants": [{"name": "acme", "suspended": True}, {"name": "beta", "suspended": True}]},
        prune=False,
        dry_run=False,
    )
    assert (await since("acme"), await since("beta")) == (300.0, 300.0)
    # Not the proxies': no table carries it, and it is no new content.
    state = await catalog.snapshot()
    table = compile_table(state)
    assert {t.suspended_at for t in table.tenants} == {0.0}
    notes = _tenant_notes([tenant_pb(t) for t in state.tenants], served=())
    assert notes == [
        "tenant acme suspended since 1970-01-01T00:05:00Z: no reason given",
        "tenant beta suspended since 1970-01-01T00:05:00Z: no reason given",
    ]


def test_a_suspension_older_than_the_time_stays_of_unknown_time() -> None:
    """A write to a tenant suspended before the time was kept must not say
    it was suspended then."""
    old = Tenant("acme", suspended=True)  # suspended_at 0: not known
    kept = suspension_stamped(replace(old, limits=Limits(rpm=1)), old, lambda: 500.0)
    assert kept.suspended_at == 0.0
    assert (
        suspension_stamped(Tenant("acme", suspended=True), None, lambda: 500.0).suspended_at
        == 500.0
    )
    assert suspension_stamped(Tenant("acme"), old, lambda: 500.0).suspended_at == 0.0
