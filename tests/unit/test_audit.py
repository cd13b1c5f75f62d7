"""The audit trail: entries, reads, trimming, write failures, and the Admin
calls that record them (in-memory store, a real gRPC server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
import orjson
import pytest

from controlplane import audit
from controlplane.api import auditing
from controlplane.api.admin import AdminService, audit_entry_pb
from controlplane.api.auditing import actor_of
from controlplane.api.guard import TokenGuard
from controlplane.app import ControlPlane
from controlplane.audit import PREFIX, AuditLog
from controlplane.catalog import ORIGINS, TENANTS, Catalog
from controlplane.cli import AUDIT_CHANGES_CHARS, _rows_audit
from controlplane.cli import main as pontoctl
from controlplane.distribute import Publisher
from controlplane.model import Limits, Origin, PromptPolicy, Tenant, encode
from controlplane.settings import parse
from controlplane.store import StateStore
from controlplane.store.memory import MemoryStore
from ponto.times import utc_ms
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

DAY = 86400.0
T0 = 1_800_000_000.0  # 2027-01-15, a fixed "now"
ADMIN = "admin-secret-token"


class Clock:
    """Moved by hand, and by `step` on every reading."""

    def __init__(self, now: float = T0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        now, self.now = self.now, self.now + self.step
        return now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def log(store: MemoryStore, clock: Clock) -> AuditLog:
    return AuditLog(store, replica="cp-1", clock=clock, retention_days=30, max_entries=5)


async def record(log: AuditLog, clock: Clock, n: int, action: str = "DrainRegion") -> None:
    for i in range(n):
        await log.record(actor="a", action=action, target=f"region/r{i}", source="ipv4:x")
        clock.now += 1


# ---------------------------------------------------------------- the log


async def test_entries_read_newest_first_with_every_field(log: AuditLog, clock: Clock) -> None:
    await log.record(
        actor="admin-token",
        action="DrainRegion",
        target="region/eu",
        detail={"drained": "true"},
        source="ipv4:127.0.0.1:5555",
    )
    clock.now += 1
    await log.record(
        actor="anonymous",
        action="PutTenant",
        target="tenant/acme",
        source="http:10.0.0.1",
        result="INVALID_ARGUMENT",
        message="bad",
    )
    newest, oldest = await log.read()
    assert (newest.action, newest.result, newest.message) == (
        "PutTenant",
        "INVALID_ARGUMENT",
        "bad",
    )
    assert newest.time == T0 + 1 and newest.detail == {}
    assert oldest.time == T0 and oldest.replica == "cp-1"
    assert (oldest.actor, oldest.target, oldest.source) == (
        "admin-token",
        "region/eu",
        "ipv4:127.0.0.1:5555",
    )
    assert oldest.result == "ok" and oldest.detail == {"drained": "true"}


async def test_keys_sort_by_time_across_digit_counts(log: AuditLog, clock: Clock) -> None:
    clock.now = 9.5  # fewer digits than T0: the key is zero-padded
    await record(log, clock, 1, "Early")
    clock.now = T0
    await record(log, clock, 1, "Late")
    assert [e.action for e in await log.read()] == ["Late", "Early"]


async def test_limit_and_since(log: AuditLog, clock: Clock) -> None:
    await record(log, clock, 10)
    assert [e.target for e in await log.read(limit=3)] == ["region/r9", "region/r8", "region/r7"]
    assert [e.target for e in await log.read(since=T0 + 8)] == ["region/r9", "region/r8"]
    assert len(await log.read(limit=0)) == 1  # at least one
    assert len(await log.read(limit=10**6)) == 10


async def test_filters_read_every_page(
    log: AuditLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "PAGE", 3)
    for i in range(10):
        action = "RevokeKey" if i % 4 == 0 else "DrainRegion"
        await log.record(actor=f"u{i % 2}", action=action, target=f"key/{i}", source="s")
        clock.now += 1
    revokes = await log.read(action="RevokeKey")
    assert [e.target for e in revokes] == ["key/8", "key/4", "key/0"]
    assert [e.target for e in await log.read(action="RevokeKey", limit=2)] == ["key/8", "key/4"]
    assert [e.target for e in await log.read(actor="u1", since=T0 + 5)] == [
        "key/9",
        "key/7",
        "key/5",
    ]
    both = await log.read(action="RevokeKey", actor="u0", since=T0 + 1)
    assert [e.target for e in both] == ["key/8", "key/4"]


async def test_long_values_are_cut_unknown_fields_ignored_undecodable_entries_skipped(
    log: AuditLog, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    many = {f"k{i:02d}": "v" * 1000 for i in range(40)}
    await log.record(actor="a" * 999, action="A", target="t", detail=many, source="s")
    await store.put(audit._time_key(1.0) + "-bad", b"not json")
    later = {"time": 2.0, "actor": "b", "action": "B", "target": "t", "source": "s", "new": 1}
    await store.put(audit._time_key(2.0) + "-new", orjson.dumps(later))
    entry, newer_version = await log.read()
    assert (newer_version.actor, newer_version.result) == ("b", "ok")
    # Cut to MAX_FIELD and MAX_DETAIL_KEYS, then by half again to fit MAX_ENTRY_BYTES.
    assert len(entry.actor) == audit.MAX_FIELD // 2 and entry.actor.endswith("…")
    assert list(entry.detail) == [f"k{i:02d}" for i in range(audit.MAX_DETAIL_KEYS // 2)]
    assert all(len(v) == audit.MAX_FIELD // 2 for v in entry.detail.values())
    stored = (await store.list(PREFIX)).items
    assert max(len(kv.value) for kv in stored) <= audit.MAX_ENTRY_BYTES
    assert "ignoring undecodable audit entry" in caplog.text


async def test_a_store_failure_logs_the_entry_once_and_does_not_raise(
    log: AuditLog, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.available = False
    with caplog.at_level(logging.INFO, logger="ponto.audit"):
        await log.record(actor="admin-token", action="DrainRegion", target="region/eu", source="s")
    (line,) = [r for r in caplog.records if r.name == "controlplane.audit"]
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert line.getMessage().startswith("audit entry not stored (")
    assert line.getMessage().endswith(
        "the control plane's log holds it (ponto.audit): "
        "DrainRegion region/eu at 2027-01-15T08:00:00.000Z"
    )
    # The entry whole, once: the line every entry has.
    (whole,) = [r for r in caplog.records if r.name == "ponto.audit"]
    assert orjson.loads(whole.getMessage())["target"] == "region/eu"
    store.available = True
    assert await log.read() == []


async def test_trim_by_age_and_by_count(log: AuditLog, store: MemoryStore, clock: Clock) -> None:
    await record(log, clock, 3, "Old")  # T0 .. T0+2
    clock.now = T0 + 20 * DAY
    await record(log, clock, 2, "Mid")
    assert await log.trim() == 0  # 5 entries, none older than 30 days
    clock.now = T0 + 30 * DAY + 1.5  # Old r0 and r1 are now past the retention
    assert await log.trim() == 2
    assert [e.action for e in await log.read()] == ["Mid", "Mid", "Old"]
    await record(log, clock, 4, "New")  # 7 entries, the bound is 5
    assert await log.trim() == 2
    assert [e.action for e in await log.read()] == ["New"] * 4 + ["Mid"]
    assert len((await store.list(PREFIX)).items) == 5


class CountsThenWaits:
    """A store whose first count answers, then waits for `go` before returning."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.counted, self.go = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def count(self, *args: str) -> int:
        n: int = await self._inner.count(*args)
        self.counted.set()
        await self.go.wait()
        return n


async def test_concurrent_trims_keep_the_count(store: MemoryStore, clock: Clock) -> None:
    # Two leaders during a handover: the old one counts, the new one trims, then the
    # old one goes on. It must not delete the excess it counted a second time.
    slow = CountsThenWaits(store)
    old = AuditLog(cast(StateStore, slow), replica="a", clock=clock, max_entries=3)
    new = AuditLog(store, replica="b", clock=clock, max_entries=3)
    await record(new, clock, 10)
    late = asyncio.create_task(old.trim())
    await slow.counted.wait()
    assert await new.trim() == 7
    slow.go.set()
    assert await late == 0
    assert [e.target for e in await new.read()] == ["region/r9", "region/r8", "region/r7"]


async def test_entries_of_one_microsecond_are_trimmed_together(
    store: MemoryStore, clock: Clock
) -> None:
    log = AuditLog(store, replica="r", clock=clock, max_entries=2)
    await record(log, clock, 1, "Old")
    clock.now = T0 + 5
    await log.record(actor="a", action="Same", target="x", source="s")
    await log.record(actor="a", action="Same", target="y", source="s")
    await log.record(actor="a", action="Same", target="z", source="s")
    assert await log.trim() == 1
    assert [e.action for e in await log.read()] == ["Same"] * 3


@pytest.mark.parametrize(
    "worst",
    ["\x01" * 10_000, "a" * 10_000],  # six bytes of JSON per character, and one
)
def test_an_entry_fits_its_byte_bound_and_a_full_page_a_grpc_message(worst: str) -> None:
    entry = audit.AuditEntry(
        time=T0,
        actor=worst,
        action=worst,
        target=worst,
        source=worst,
        result=worst,
        message=worst,
        detail={f"{i:02d}{worst}": worst for i in range(40)},
        replica=worst,
    )
    value = audit._bounded(entry)
    assert len(value) <= audit.MAX_ENTRY_BYTES
    fitted = audit._decode(value)
    assert fitted.actor.startswith(worst[0]) and fitted.detail
    page = apb.ListAuditResponse(entries=[audit_entry_pb(fitted)] * audit.MAX_LIMIT)
    assert page.ByteSize() <= 3_100_000 < 4 * 1024 * 1024


# ---------------------------------------------------------------- who


@pytest.mark.parametrize(
    ("context", "token_required", "actor"),
    [
        ({}, True, "admin-token"),
        ({}, False, "anonymous"),
        (
            {
                "x509_subject_alternative_name": [b"spiffe://ponto/role/admin"],
                "x509_common_name": [b"ponto-admin"],
            },
            True,
            "ponto-admin",
        ),
        (
            {
                "peer_uri": [b"spiffe://ponto/role/admin", b"spiffe://corp/user/alice"],
                "x509_common_name": [b"alice-laptop"],
            },
            True,
            "spiffe://corp/user/alice",
        ),
        (
            {"x509_subject_alternative_name": [b"spiffe://ponto/role/admin"]},
            False,
            "spiffe://ponto/role/admin",
        ),
    ],
    ids=["token", "open", "ponto-cert", "own-spiffe-id", "role-uri-only"],
)
def test_actor(context: dict[str, list[bytes]], token_required: bool, actor: str) -> None:
    assert actor_of(context, token_required=token_required) == actor


# ---------------------------------------------------------------- the Admin calls


@contextlib.asynccontextmanager
async def admin_server(
    store: MemoryStore, clock: Clock, *, admin_token: str = ADMIN
) -> AsyncIterator[Authorized]:
    """The Admin service behind the guard, as controlplane.app wires them, and a
    client stub that presents the admin token."""
    server = grpc.aio.server(interceptors=[TokenGuard(bootstrap_token="", admin_token=admin_token)])
    service = AdminService(
        Catalog(store, clock=clock),
        Publisher("cp-1"),
        AuditLog(store, replica="cp-1", clock=clock),
        token_required=bool(admin_token),
        clock=clock,
    )
    admin_pb2_grpc.add_AdminServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Authorized(admin_pb2_grpc.AdminStub(channel), admin_token, f"127.0.0.1:{port}")
    finally:
        await channel.close()
        await server.stop(None)


class Authorized:
    """An aio Admin stub whose calls carry the admin token and a timeout;
    `address`: the server's, for pontoctl."""

    def __init__(self, stub: admin_pb2_grpc.AdminStub, token: str, address: str) -> None:
        self.address = address
        self._stub = stub
        self._metadata = [("authorization", f"Bearer {token}")] if token else []

    def __getattr__(self, name: str) -> Callable[[Any], Any]:
        method = getattr(self._stub, name)
        return lambda request: method(request, metadata=self._metadata, timeout=5)


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_mutating_calls_are_recorded_ok_or_refused_reads_are_not(
    store: MemoryStore, clock: Clock
) -> None:
    clock.step = 0.001  # an entry per reading, in the order of the calls
    async with admin_server(store, clock) as stub:
        region = apb.RegionSpec(name="eu-west", latitude=53.3, longitude=-6.3)
        await stub.PutRegion(apb.PutRegionRequest(region=region))
        await stub.DrainRegion(apb.DrainRequest(name="eu-west", drained=True))
        await stub.DrainRegion(apb.DrainRequest(name="eu-west", drained=False))
        # Trial 27: an undrain of what is not drained is recorded as the
        # nothing it did, not as a second undrain.
        await stub.DrainRegion(apb.DrainRequest(name="eu-west", drained=False))
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        refused = stub.UpdateTenant(
            apb.UpdateTenantRequest(name="acme", cache=pb.CachePolicy(mode="bogus"))
        )
        assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", description="ci"))
        await stub.RevokeKey(apb.KeyRequest(id=created.key.id))
        missing = stub.DrainRegion(apb.DrainRequest(name="nowhere", drained=True))
        assert await code_of(missing) == grpc.StatusCode.NOT_FOUND
        doc = orjson.dumps({"tenants": [{"name": "beta"}]}).decode()
        await stub.Apply(apb.ApplyRequest(document=doc, dry_run=True))
        await stub.Apply(apb.ApplyRequest(document=doc))
        await stub.ListRegions(apb.ListRequest())
        await stub.ListKeys(apb.ListKeysRequest())

        entries = list(reversed((await stub.ListAudit(apb.ListAuditRequest())).entries))
    got = [(e.action, e.target, e.result) for e in entries]
    assert got == [
        ("PutRegion", "region/eu-west", "ok"),
        ("DrainRegion", "region/eu-west", "ok"),
        ("UndrainRegion", "region/eu-west", "ok"),
        ("UndrainRegion", "region/eu-west", "ok"),
        ("PutTenant", "tenant/acme", "ok"),
        ("UpdateTenant", "tenant/acme", "INVALID_ARGUMENT"),
        ("CreateKey", f"key/{created.key.id}", "ok"),
        ("RevokeKey", f"key/{created.key.id}", "ok"),
        ("DrainRegion", "region/nowhere", "NOT_FOUND"),
        ("Apply", "topology", "ok"),
    ]
    for e in entries:
        assert e.actor == "admin-token" and e.source.startswith("ipv4:127.0.0.1:")
        assert T0 <= e.time < T0 + 1 and e.replica == "cp-1"
        text = str(e)
        assert created.secret not in text and ADMIN not in text
    by_action = {(e.action, e.target): e for e in entries}
    assert by_action["DrainRegion", "region/eu-west"].detail == {
        "drained": "true",
        "changes": "drained false -> true",
    }
    assert [e.detail["changes"] for e in entries if e.action == "UndrainRegion"] == [
        "drained true -> false",
        "nothing",
    ]
    assert by_action["PutRegion", "region/eu-west"].detail["latitude"] == "53.3"
    refusal = by_action["UpdateTenant", "tenant/acme"]
    assert refusal.detail == {"cache": '{"mode": "bogus"}'} and "bogus" in refusal.message
    assert by_action["CreateKey", f"key/{created.key.id}"].detail["description"] == "ci"
    assert by_action["Apply", "topology"].detail == {"prune": "false", "created": "tenant/beta"}


async def test_every_entry_is_a_line_of_the_log_as_get_audit_says_it(
    store: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 73: the trail lives in etcd alone, and a restore from a snapshot
    took back the revocations and suspensions made since with their entries.
    Each entry is also one INFO line of `ponto.audit`, with the fields of
    `get audit -o json`; never a key's secret or the admin token."""
    clock.step = 0.001
    with caplog.at_level(logging.INFO, logger="ponto.audit"):
        async with admin_server(store, clock) as stub:
            await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
            created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", description="ci"))
            await stub.SetKeySuspended(
                apb.SetKeySuspendedRequest(id=created.key.id, suspended=True, reason="leaked")
            )
            await stub.RevokeKey(apb.KeyRequest(id=created.key.id))
            refused = stub.RevokeKey(apb.KeyRequest(id="nope"))
            assert await code_of(refused) == grpc.StatusCode.NOT_FOUND
            entries = list(reversed((await stub.ListAudit(apb.ListAuditRequest())).entries))
    lines = [r for r in caplog.records if r.name == "ponto.audit"]
    assert [r.levelno for r in lines] == [logging.INFO] * len(entries) == [logging.INFO] * 5
    for line, entry in zip(lines, entries, strict=True):
        assert orjson.loads(line.getMessage()) == {
            "time": utc_ms(entry.time),
            "actor": entry.actor,
            "action": entry.action,
            "target": entry.target,
            "source": entry.source,
            "result": entry.result,
            "message": entry.message,
            "detail": dict(entry.detail),
            "replica": entry.replica,
        }
        assert "\n" not in line.getMessage()
        assert created.secret not in line.getMessage() and ADMIN not in line.getMessage()
    assert [orjson.loads(r.getMessage())["action"] for r in lines] == [
        "PutTenant",
        "CreateKey",
        "SuspendKey",
        "RevokeKey",
        "RevokeKey",
    ]
    assert orjson.loads(lines[2].getMessage())["detail"]["reason"] == "leaked"


KEPT_AT_ANY_LEVEL = """
import logging, sys
import controlplane.__main__ as entry

def run(coro):
    coro.close()
    logging.getLogger("ponto.audit").info("an entry")
    logging.getLogger("controlplane.app").info("not shown")
    return 0

entry.uvloop.run = run
sys.exit(entry.main(["--log-level", "WARNING"]))
"""


def test_ponto_control_writes_the_audit_lines_whatever_its_log_level() -> None:
    """They may be all that is left of an admin action after an etcd restore."""
    run = subprocess.run(
        [sys.executable, "-c", KEPT_AT_ANY_LEVEL],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert " INFO ponto.audit: an entry" in run.stderr
    assert "not shown" not in run.stderr


async def test_a_tenant_update_and_new_key_limits_record_the_values_they_replaced(
    store: MemoryStore, clock: Clock
) -> None:
    """Trial 25: only the values sent were recorded, so the trail could not
    say what a `tenant set` or `limit set` replaced; an Apply's entry could."""
    clock.step = 0.001
    async with admin_server(store, clock) as stub:
        tenant = pb.Tenant(name="acme", limits=pb.Limits(rpm=600, tpm=100_000))
        await stub.PutTenant(apb.PutTenantRequest(tenant=tenant))
        await stub.UpdateTenant(
            apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=900, concurrency=5))
        )
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", cache=pb.CachePolicy()))
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", limits=pb.Limits(rpm=5)))
        await stub.SetKeyLimits(
            apb.SetKeyLimitsRequest(id=created.key.id, limits=pb.Limits(rpm=9, tpm=50))
        )
        updates = (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
        limits = (await stub.ListAudit(apb.ListAuditRequest(action="SetKeyLimits"))).entries
    assert [e.detail["changes"] for e in reversed(updates)] == [
        "limits.rpm 600 -> 900; limits.concurrency unset -> 5; limits.tpm 100000 -> removed",
        "nothing",
    ]
    assert updates[-1].detail["limits"] == '{"concurrency": 5, "rpm": 900}'
    [changed] = limits
    assert changed.detail["changes"] == "limits.rpm 5 -> 9; limits.tpm unset -> 50"


async def test_an_updates_changes_leave_out_what_validation_alone_rewrites(
    store: MemoryStore, clock: Clock
) -> None:
    """A record stored as an older version wrote it (aliases unsorted): the
    comparison is of normal forms (apply's, as for an Apply), so the entry
    names only what the call changed (review 43 asked)."""
    stored = Tenant(
        "acme", prompt=PromptPolicy(aliases=(("zeta", "m"), ("alpha", "m"))), limits=Limits(rpm=5)
    )
    await store.put(TENANTS + "acme", encode(stored))
    async with admin_server(store, clock) as stub:
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=6)))
        [entry] = (await stub.ListAudit(apb.ListAuditRequest(action="UpdateTenant"))).entries
    assert entry.detail["changes"] == "limits.rpm 5 -> 6"


async def test_an_origin_put_over_another_records_what_it_replaced(
    store: MemoryStore, clock: Clock
) -> None:
    """As an UpdateTenant's entry does (`field old -> new`): a PutOrigin that
    replaced an origin said only the values sent, not which of them changed.
    A created origin has no changes; the drain flag, which a put keeps, is
    none; a URL stored with a password before one was refused is redacted;
    with every field of the spec set, the changes are still kept."""
    clock.step = 0.001
    old = Origin(
        "gpu-1", "http://ops:hunter2@gpu1:8000/v1", "eu", ("llama", "qwen"), weight=100,
        capacity=8, credential_env="GPU_KEY", continuation=False, probe_path="/health",
        model_names=(("qwen", "qwen2.5"),), drained=True,
    )  # fmt: skip
    await store.put(ORIGINS + "gpu-1", encode(old))
    full = apb.OriginSpec(
        name="gpu-1", base_url="http://gpu1:8000/v1", region="eu", models=["llama", "qwen"],
        weight=50, capacity=8, credential_env="GPU_KEY", credential_file="", continuation="off",
        probe_path="/health", probe="on", model_names={"qwen": "qwen2.5"},
        max_tokens_field="max_completion_tokens",
    )  # fmt: skip
    async with admin_server(store, clock) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu")))
        await stub.PutOrigin(apb.PutOriginRequest(origin=full, allow_update=True))
        await stub.PutOrigin(apb.PutOriginRequest(origin=full, allow_update=True))
        new = apb.OriginSpec(name="gpu-2", base_url="http://gpu2:8000/v1", region="eu")
        new.models.append("llama")
        await stub.PutOrigin(apb.PutOriginRequest(origin=new))
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="PutOrigin"))).entries
    replaced, again, created = [dict(e.detail) for e in reversed(entries)]
    assert replaced["changes"] == (
        'url "http://***@gpu1:8000/v1" -> "http://gpu1:8000/v1"; weight 100 -> 50; '
        'max_tokens_field unset -> "max_completion_tokens"'
    )
    assert replaced["max_tokens_field"] == "max_completion_tokens"  # every field kept too
    assert again["changes"] == "nothing"
    assert "changes" not in created


async def test_a_region_or_tenant_put_over_another_records_what_it_replaced(
    store: MemoryStore, clock: Clock
) -> None:
    """As PutOrigin's entry does: a PutRegion or PutTenant with allow_update
    that replaced a record says which values changed (`nothing` when none
    did), and one that created it says no changes."""
    clock.step = 0.001
    async with admin_server(store, clock) as stub:
        region = apb.RegionSpec(name="eu", latitude=53.3, longitude=-6.3)
        await stub.PutRegion(apb.PutRegionRequest(region=region))
        region.latitude, region.rtt_ms["us"] = 50.1, 80
        await stub.PutRegion(apb.PutRegionRequest(region=region, allow_update=True))
        await stub.PutRegion(apb.PutRegionRequest(region=region, allow_update=True))
        tenant = pb.Tenant(name="acme")
        await stub.PutTenant(apb.PutTenantRequest(tenant=tenant))
        tenant.limits.rpm = 600
        await stub.PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=True))
        await stub.PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=True))
        regions = (await stub.ListAudit(apb.ListAuditRequest(action="PutRegion"))).entries
        tenants = (await stub.ListAudit(apb.ListAuditRequest(action="PutTenant"))).entries
    created, replaced, again = [dict(e.detail) for e in reversed(regions)]
    assert "changes" not in created
    assert replaced["changes"] == 'lat 53.3 -> 50.1; rtt_ms unset -> {"us":80.0}'
    assert again["changes"] == "nothing"
    created, replaced, again = [dict(e.detail) for e in reversed(tenants)]
    assert "changes" not in created
    assert replaced["changes"] == 'limits unset -> {"rpm":600}'
    assert again["changes"] == "nothing"


async def test_no_url_in_an_entry_keeps_a_credential(store: MemoryStore, clock: Clock) -> None:
    """Review 291: a tenant's JWKS URL with a password or a query token was
    kept whole in the trail, and so in every replica's log (ponto.audit),
    refused calls too; only an origin's base URL was redacted."""
    clock.step = 0.001
    url = "https://bob:hunter2@idp.example/jwks?token=SECRET"
    async with admin_server(store, clock) as stub:
        tenant = pb.Tenant(name="acme")
        tenant.jwt.issuer, tenant.jwt.jwks_url = "https://idp.example", url
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.PutTenant(apb.PutTenantRequest(tenant=tenant))
        update = apb.UpdateTenantRequest(name="acme")
        update.jwt.issuer, update.jwt.jwks_url = "https://idp.example", url
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.UpdateTenant(update)
        entries = (await stub.ListAudit(apb.ListAuditRequest())).entries
    assert [e.action for e in entries] == ["UpdateTenant", "PutTenant"]
    for entry in entries:
        kept = json.dumps(dict(entry.detail)) + entry.message
        assert "https://idp.example" in kept
        assert "hunter2" not in kept and "SECRET" not in kept, kept


class _Context:
    """The servicer context an audited call reads: who and from where."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"


async def test_what_a_call_noted_outlives_the_cut_of_a_large_entry(log: AuditLog) -> None:
    """Review 287: an entry over its bound keeps its first detail keys
    (audit._bounded), and `changes`, which a call notes as it ends, came
    last: a PutTenant of a tenant with every block set lost what it changed.
    What a call noted now comes first, and wins over a request's own key."""

    class Servicer:
        audit, token_required = log, False

        @auditing.audited(lambda req, _: ("tenant/t", {f"k{i:02}": "v" for i in range(40)}))
        async def Put(self, request: object, context: object) -> str:
            auditing.note(changes="k00 v -> w", k01="noted")
            return "done"

    assert await Servicer().Put(object(), _Context()) == "done"
    (entry,) = await log.read()
    assert entry.detail["changes"] == "k00 v -> w"
    assert entry.detail["k01"] == "noted"


async def test_the_source_of_an_ipv6_caller_reads_with_brackets(log: AuditLog) -> None:
    """Trial 78: `get audit` showed grpc's escaped peer, ipv6:%5B::1%5D:47424."""

    class V6Context(_Context):
        def peer(self) -> str:
            return "ipv6:%5B2001:db8::7%5D:47424"

    class Servicer:
        audit, token_required = log, False

        @auditing.audited(lambda req, _: ("tenant/t", {}))
        async def Put(self, request: object, context: object) -> str:
            return "done"

    await Servicer().Put(object(), V6Context())
    (entry,) = await log.read()
    assert entry.source == "ipv6:[2001:db8::7]:47424"


async def test_list_audit_filters_and_its_own_refusals(store: MemoryStore, clock: Clock) -> None:
    async with admin_server(store, clock) as stub:
        for name in ("a", "b"):
            await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name=name)))
            clock.now += 60
        await stub.DeleteTenant(apb.DeleteRequest(name="a"))
        filtered = await stub.ListAudit(apb.ListAuditRequest(action="PutTenant", limit=1))
        assert [e.target for e in filtered.entries] == ["tenant/b"]
        recent = await stub.ListAudit(apb.ListAuditRequest(since=T0 + 60))
        assert [e.action for e in recent.entries] == ["DeleteTenant", "PutTenant"]
        for since in (-1, math.nan, math.inf):
            bad = stub.ListAudit(apb.ListAuditRequest(since=since))
            assert await code_of(bad) == grpc.StatusCode.INVALID_ARGUMENT, since
        store.available = False
        down = stub.ListAudit(apb.ListAuditRequest())
        assert await code_of(down) == grpc.StatusCode.UNAVAILABLE


async def test_limits_of_a_revoked_or_unknown_key_are_refused_recorded_and_printed(
    store: MemoryStore, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    clock.step = 0.001  # an entry per reading, in the order of the calls
    async with admin_server(store, clock, admin_token="") as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", limits=pb.Limits(rpm=5)))
        key_id = created.key.id
        await stub.RevokeKey(apb.KeyRequest(id=key_id))
        revoked = stub.SetKeyLimits(apb.SetKeyLimitsRequest(id=key_id, limits=pb.Limits(rpm=9)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await revoked
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == f"key {key_id!r} is revoked; its limits cannot change"
        unknown = stub.SetKeyLimits(apb.SetKeyLimitsRequest(id="abcdefghij"))
        assert await code_of(unknown) == grpc.StatusCode.NOT_FOUND
        (key,) = (await stub.ListKeys(apb.ListKeysRequest(include_revoked=True))).keys
        assert key.limits == pb.Limits(rpm=5)  # nothing was written
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="SetKeyLimits"))).entries
        assert [(e.target, e.result) for e in reversed(entries)] == [
            (f"key/{key_id}", "FAILED_PRECONDITION"),
            ("key/abcdefghij", "NOT_FOUND"),
        ]
        # pontoctl prints the refusal on one line and exits 1 (its calls
        # block: run in a thread, while this loop serves them).
        for target, line in (
            (key_id, f"error: key {key_id!r} is revoked; its limits cannot change"
                     " [FAILED_PRECONDITION]"),
            ("abcdefghij", "error: key 'abcdefghij' not found [NOT_FOUND]"),
        ):  # fmt: skip
            argv = ["--control-plane", stub.address, "limit", "set", "--key", target, "--rpm", "9"]
            assert await asyncio.to_thread(pontoctl, argv) == 1
            out = capsys.readouterr()
            assert (out.out, out.err) == ("", line + "\n")


async def test_an_origin_url_with_credentials_is_refused_and_not_recorded(
    store: MemoryStore, clock: Clock
) -> None:
    async with admin_server(store, clock) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu")))
        for url in ("https://user:s3cret@llm.example/v1", "https://user:s3cret@llm:99999/v1"):
            spec = apb.OriginSpec(name="o", base_url=url, region="eu", models=["m"])
            refused = stub.PutOrigin(apb.PutOriginRequest(origin=spec))
            assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="PutOrigin"))).entries
    assert len(entries) == 2
    for entry in entries:
        assert "s3cret" not in str(entry) and "user:" not in entry.detail["base_url"]
        assert entry.detail["base_url"].startswith("https://***@llm")
        assert "credential_env or credential_file" in entry.message


async def test_without_an_admin_token_the_actor_is_anonymous(
    store: MemoryStore, clock: Clock
) -> None:
    async with admin_server(store, clock, admin_token="") as stub:
        await stub.PurgeCache(apb.PurgeCacheRequest())
        await stub.PurgeCache(apb.PurgeCacheRequest(model="llama-3"))
        entries = (await stub.ListAudit(apb.ListAuditRequest())).entries
    assert {(e.actor, e.action) for e in entries} == {("anonymous", "PurgeCache")}
    # Trial 22: both were `cache/*` in `get audit`'s table.
    assert {(e.target, e.detail["model"]) for e in entries} == {
        ("cache/*/*", "*"),
        ("cache/*/llama-3", "llama-3"),
    }


async def test_an_origin_url_with_a_query_or_fragment_is_refused_and_not_recorded(
    store: MemoryStore, clock: Clock
) -> None:
    """Trial 23: `?token=...` was kept whole in the audit trail and echoed by
    the refusal, where user:password@ was masked."""
    async with admin_server(store, clock) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu")))
        for url in (
            "http://llm.example/v1?token=pw-SECRET3",
            "http://llm.example/v1#pw-SECRET3",
            "http://u:p@llm.example/v1?token=pw-SECRET3",  # review 41: userinfo and a query
            # Trial 78: an IPv6 host's bracket ended the URL the trail redacts.
            "http://[fd00::1]:8000/v1?token=pw-SECRET3",
            "http://u:p@[fd00::1]/v1#pw-SECRET3",
            # Review 323: an unclosed one (refused as invalid) kept its query.
            "http://[fd00::1/v1?token=pw-SECRET3",
        ):
            spec = apb.OriginSpec(name="o", base_url=url, region="eu", models=["m"])
            refused = stub.PutOrigin(apb.PutOriginRequest(origin=spec))
            assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
            assert "SECRET3" not in (await refused.details())
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="PutOrigin"))).entries
    assert {e.detail["base_url"] for e in entries} == {
        "http://llm.example/v1?***",
        "http://llm.example/v1#***",
        "http://***@llm.example/v1?***",
        "http://[fd00::1]:8000/v1?***",
        "http://***@[fd00::1]/v1#***",
        "http://[fd00::1/v1?***",
    }
    assert all("SECRET3" not in str(e) for e in entries)


async def test_an_unclosed_ipv6_bracket_is_refused_as_invalid_not_an_internal_error(
    store: MemoryStore, clock: Clock
) -> None:
    """Trial 78: urlsplit's ValueError ("Invalid IPv6 URL") went up as
    INTERNAL, with a traceback in the control plane's log."""
    async with admin_server(store, clock) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu")))
        spec = apb.OriginSpec(name="o", base_url="http://[fd00::1/v1", region="eu", models=["m"])
        refused = stub.PutOrigin(apb.PutOriginRequest(origin=spec))
        assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        assert (await refused.details()) == (
            "base URL 'http://[fd00::1/v1' is invalid: Invalid IPv6 URL; "
            "expected http(s)://host[:port]/path"
        )
        tenant = pb.Tenant(name="acme")
        tenant.jwt.issuer, tenant.jwt.jwks_url = "https://idp.example", "https://[fd00::1/jwks"
        refused = stub.PutTenant(apb.PutTenantRequest(tenant=tenant))
        assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        assert "JWKS URL 'https://[fd00::1/jwks' is invalid" in await refused.details()


async def test_the_table_says_which_limit_a_limit_set_changed(
    store: MemoryStore, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial: `pontoctl get audit` showed a `limit set` as UpdateTenant, ok,
    and nothing of which limit went from what to what (only -o yaml had it)."""
    clock.step = 0.001
    async with admin_server(store, clock, admin_token="") as stub:
        tenant = pb.Tenant(name="acme", limits=pb.Limits(rpm=600))
        await stub.PutTenant(apb.PutTenantRequest(tenant=tenant))
        cli = ["--control-plane", stub.address]
        for argv in (
            ["limit", "set", "--tenant", "acme", "--rpm", "900", "--concurrency", "5"],
            ["get", "audit"],
        ):
            assert await asyncio.to_thread(pontoctl, [*cli, *argv]) == 0
    header, newest, *_ = capsys.readouterr().out.strip().splitlines()[-3:]
    row = cells(header, newest)
    assert (row["ACTION"], row["TARGET"], row["RESULT"]) == ("UpdateTenant", "tenant/acme", "ok")
    assert row["CHANGES"] == "limits.rpm 600 -> 900; limits.concurrency unset -> 5"


def cells(header: str, row: str) -> dict[str, str]:
    """A row of a pontoctl table by its header's columns (cells may hold spaces)."""
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    ends = [*starts[1:], None]
    return {n: row[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)}


def test_table_rows_show_iso_utc_times_and_refusals() -> None:
    resp = apb.ListAuditResponse(
        entries=[
            apb.AuditEntry(
                time=T0,
                actor="admin-token",
                action="Apply",
                target="topology",
                source="ipv4:127.0.0.1:5",
                result="INVALID_ARGUMENT",
                message="line one\nline two",
            )
        ]
    )
    header, (row,) = _rows_audit(resp)
    # CHANGES before RESULT, whose refusals are long (review: after them,
    # every row's CHANGES began past the screen's edge).
    assert header == ["TIME", "ACTOR", "ACTION", "TARGET", "SOURCE", "CHANGES", "RESULT"]
    assert row == [
        "2027-01-15T08:00:00Z",
        "admin-token",
        "Apply",
        "topology",
        "ipv4:127.0.0.1:5",
        "",
        "INVALID_ARGUMENT: line one line two",
    ]
    # A long one is cut, marked; -o yaml has it whole.
    changes = "; ".join(f"limits.rpm {n} -> {n + 1}" for n in range(20))
    resp.entries[0].detail["changes"] = changes
    _, (row,) = _rows_audit(resp)
    assert len(row[5]) == AUDIT_CHANGES_CHARS and row[5] == changes[:99] + "…"


# ---------------------------------------------------------------- the replica


async def test_the_leader_trims_the_trail_to_its_bound(store: MemoryStore) -> None:
    writer = AuditLog(store, replica="elsewhere")
    for i in range(5):
        await writer.record(actor="a", action="DrainRegion", target=f"region/r{i}", source="s")
    settings = parse(["--listen", "127.0.0.1:0", "--id", "r1", "--audit-max-entries", "2"])
    plane = ControlPlane(settings, store)
    await plane.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while len((await store.list(PREFIX)).items) > 2:
            assert asyncio.get_running_loop().time() < deadline, "the trail was never trimmed"
            await asyncio.sleep(0.02)
    finally:
        await plane.stop(grace=0)
    assert [e.target for e in await writer.read()] == ["region/r4", "region/r3"]


@pytest.mark.parametrize(
    ("flag", "value"), [("--audit-retention-days", "0"), ("--audit-max-entries", "0")]
)
def test_bounds_must_be_positive(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse([flag, value])
    assert flag in capsys.readouterr().err


async def test_every_mutating_call_is_recorded_and_no_read(
    store: MemoryStore, clock: Clock
) -> None:
    """Each Admin method called with an empty request (most are refused):
    a call that can change something leaves exactly one entry, a read none.
    A method added later is covered here without a change."""
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    reads = ("List", "Get", "Export")
    clock.step = 0.001
    async with admin_server(store, clock) as stub:
        for method in service.methods:
            request = apb.__dict__[method.input_type.name]()
            await code_of(getattr(stub, method.name)(request))
        entries = (await stub.ListAudit(apb.ListAuditRequest(limit=1000))).entries
    recorded = [e.action for e in reversed(entries)]
    writes = [m.name for m in service.methods if not m.name.startswith(reads)]
    # An empty DrainRequest has drained=false: an undrain, recorded as one;
    # an empty SetKeySuspendedRequest likewise a resumption.
    as_recorded = {"SetKeySuspended": "ResumeKey"}
    assert recorded == [as_recorded.get(w, w.replace("Drain", "Undrain", 1)) for w in writes]
    assert {"PutRegion", "DrainOrigin", "SetKeyLimits", "PurgeCache", "Apply"} <= set(writes)


def test_detail_numbers_are_json_numbers_at_every_width() -> None:
    """rpm and tpm are 64-bit, which the proto3 JSON mapping writes as strings;
    the audit writes them as numbers, as concurrency (32-bit) and every other."""
    limits = pb.Limits(rpm=120, tpm=50000, concurrency=5)
    keyed = auditing.set_key_limits(apb.SetKeyLimitsRequest(id="k", limits=limits), None)
    assert keyed is not None and keyed[1] == {
        "limits": '{"concurrency": 5, "rpm": 120, "tpm": 50000}'
    }
    tenant = auditing.put_tenant(
        apb.PutTenantRequest(tenant=pb.Tenant(name="a", limits=limits)), None
    )
    assert tenant is not None
    put = tenant[1]
    assert orjson.loads(put["limits"]) == {"concurrency": 5, "rpm": 120, "tpm": 50000}


async def test_apply_records_what_each_updated_object_changes_within_the_bound(
    store: MemoryStore, clock: Clock
) -> None:
    def doc(tenants: list[dict[str, Any]]) -> str:
        return orjson.dumps({"tenants": tenants}).decode()

    clock.step = 0.001
    many = [{"name": f"t{i:02d}", "limits": {"rpm": 10}} for i in range(20)]
    async with admin_server(store, clock) as stub:
        limited = {"name": "globex", "limits": {"rpm": 120, "tpm": 50000}}
        await stub.Apply(apb.ApplyRequest(document=doc([limited])))
        await stub.Apply(apb.ApplyRequest(document=doc([{"name": "globex"}])))
        await stub.Apply(apb.ApplyRequest(document=doc(many)))
        await stub.Apply(apb.ApplyRequest(document=doc([{"name": t["name"]} for t in many])))
        grown, _, dropped, _ = (await stub.ListAudit(apb.ListAuditRequest())).entries[:4]
    assert dict(dropped.detail) == {
        "prune": "false",
        "updated": "tenant/globex",
        "tenant/globex": 'limits {"rpm":120,"tpm":50000} -> removed',
    }
    # 20 updated objects: the summary, a count of those left out, then the rest.
    assert len(grown.detail) == audit.MAX_DETAIL_KEYS
    shown = [k for k in grown.detail if k.startswith("tenant/")]
    assert grown.detail["more"] == f"{20 - len(shown)} more objects' changes not shown"
    assert grown.detail["tenant/t00"] == 'limits {"rpm":10} -> removed'


def test_an_apply_entry_s_more_counts_exactly_what_the_trail_left_out() -> None:
    """Long changes of many objects: the entry still fits MAX_ENTRY_BYTES
    without the trail dropping keys, so `more` is exact (review 15: it was
    counted before the trail halved the keys, and said 7 where 15 were left out)."""
    long = '"' + "a" * 150 + '"'
    changes = [
        apb.Change(
            kind="tenant",
            name=f"t{i:02d}",
            action="updated",
            fields=["prompt"],
            changes=[apb.FieldChange(path="prompt.system_prompt", before=long, after=long[::-1])],
        )
        for i in range(20)
    ]
    description = auditing.apply(apb.ApplyRequest(), apb.ApplyResponse(changes=changes))
    assert description is not None
    entry = audit.AuditEntry(
        time=1.0,
        actor="a" * 300,
        action="Apply",
        target="topology",
        source="s" * 300,
        replica="r" * 300,
        detail=description[1],
    )
    kept = orjson.loads(audit._bounded(entry))["detail"]
    shown = [k for k in kept if k.startswith("tenant/")]
    assert "more" in kept, kept
    said = int(kept["more"].split()[0])
    assert said == 20 - len(shown), f"{kept['more']!r}, but {len(shown)} of 20 shown"


def refusals_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The refusal lines (api.guard.RefusalLog) caplog holds, the caller's
    port left out."""
    return [
        re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", r.getMessage())
        for r in caplog.records
        if r.name == "controlplane.api.guard" and r.getMessage().startswith("refused ")
    ]


async def test_a_refused_call_is_logged_once_and_a_repeat_within_the_minute_counted(
    store: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A read, or a write not recorded (a dry run), refused by the core left
    no trace anywhere (a forged page token, a bad document): each is a
    WARNING line naming the method, status, message and caller, at most once
    a minute per caller, method, status and message, as the guard logs its
    refusals. A refused write recorded in the trail is its entry's line alone."""
    forged = apb.ListKeysRequest(page_token="forged")
    bad_dry_run = apb.ApplyRequest(document="{", dry_run=True)
    with caplog.at_level(logging.INFO):
        async with admin_server(store, clock) as stub:
            for _ in range(3):  # a script in a loop
                assert await code_of(stub.ListKeys(forged)) == grpc.StatusCode.INVALID_ARGUMENT
            assert await code_of(stub.Apply(bad_dry_run)) == grpc.StatusCode.INVALID_ARGUMENT
            missing = stub.DrainRegion(apb.DrainRequest(name="nowhere", drained=True))
            assert await code_of(missing) == grpc.StatusCode.NOT_FOUND
            clock.now += 60
            assert await code_of(stub.ListKeys(forged)) == grpc.StatusCode.INVALID_ARGUMENT
    lines = refusals_logged(caplog)
    assert len(lines) == 3, lines
    listkeys = "refused /ponto.v1.Admin/ListKeys from ipv4:127.0.0.1:PORT: INVALID_ARGUMENT ("
    assert lines[0].startswith(listkeys) and "page_token" in lines[0]
    assert lines[1].startswith(
        "refused /ponto.v1.Admin/Apply from ipv4:127.0.0.1:PORT: INVALID_ARGUMENT ("
    )
    assert lines[2].startswith(listkeys) and lines[2].endswith(" (2 more not logged)")
    audited = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "ponto.audit"]
    assert [(e["action"], e["result"]) for e in audited] == [("DrainRegion", "NOT_FOUND")]
    refused = [r for r in caplog.records if r.name == "controlplane.api.guard"]
    assert [r.levelno for r in refused] == [logging.WARNING] * 3
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_every_refused_admin_call_is_logged_once(
    store: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each Admin method called with an empty request (most are refused): a
    refused call is one line of the log, its audit entry's or a refusal
    line. A method added later is covered here without a change."""
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    refused = 0
    with caplog.at_level(logging.INFO):
        async with admin_server(store, clock) as stub:
            for method in service.methods:
                caplog.clear()
                request = apb.__dict__[method.input_type.name]()
                code = await code_of(getattr(stub, method.name)(request))
                if code == grpc.StatusCode.OK:
                    continue
                refused += 1
                lines = [r.getMessage() for r in caplog.records if r.name == "ponto.audit"]
                lines += refusals_logged(caplog)
                assert len(lines) == 1, (method.name, lines)
                assert code.name in lines[0], (method.name, lines)
                assert not [r for r in caplog.records if r.exc_info], method.name
    assert refused >= 10
