"""A write whose answer never came is said to be of unknown outcome, not refused.

SRE trial: with an etcd member stalled, `pontoctl undrain region us-east` exited
1 with `etcd txn failed: timed out [UNAVAILABLE]`, the audit trail said
UNAVAILABLE, and the region was undrained when the member ran again. Such a
write is DEADLINE_EXCEEDED with "the change may have been made" and the `get`
to run first; pontoctl sends it once; its audit entry is OUTCOME_UNKNOWN. A
write refused before it was sent, and a read, stay UNAVAILABLE.

EtcdStore's side (which failure is which, and how a call moves between
members) is checked here on fake members; tests/integration/test_etcd_stall.py
stalls a real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from controlplane.catalog import ACKS, REGIONS, Catalog
from controlplane.cli import _refused
from controlplane.cli import main as pontoctl
from controlplane.errors import OutcomeUnknown as CatalogOutcomeUnknown
from controlplane.errors import Unavailable
from controlplane.model import Region, encode
from controlplane.registry import ProxyRegistry
from controlplane.store import Fence, OutcomeUnknown, StoreUnavailable, Write
from controlplane.store.etcd import ATTEMPT_SHARE, EtcdStore
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import ClientOptions
from ponto.v1 import admin_pb2 as apb
from tests.unit.test_audit import Clock, admin_server, code_of
from tests.unit.test_cli_errors import Refusal

LOST = "etcd txn got no answer: DEADLINE_EXCEEDED (Deadline Exceeded)"


class Unconfirmed(MemoryStore):
    """Applies each write, then (while `lose`) loses its answer, as a stalled
    etcd member does that applies a request when it runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = False
        self.writes = 0

    def _lost(self) -> None:
        self.writes += 1
        if self.lose:
            raise OutcomeUnknown(LOST)

    async def put(self, key: str, value: bytes, **kw: Any) -> int:
        revision = await super().put(key, value, **kw)
        self._lost()
        return revision

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        existed = await super().delete(key, if_mod_revision=if_mod_revision)
        self._lost()
        return existed

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        revision = await super().commit(writes, checks)
        self._lost()
        return revision


async def test_an_undrain_not_confirmed_is_said_to_be_unknown_sent_once_and_audited(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    store = Unconfirmed()
    await store.put(REGIONS + "us-east", encode(Region("us-east", 0.0, 0.0, drained=True)))
    async with admin_server(store, Clock(), admin_token="") as stub:
        store.lose, store.writes = True, 0
        argv = ["--control-plane", stub.address, "undrain", "region", "us-east"]
        # pontoctl's calls block: in a thread, while this loop serves them.
        assert await asyncio.to_thread(pontoctl, argv) == 1
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err == (
            f"error: state store did not confirm the change ({LOST}): the change may have "
            "been made; check with `pontoctl get regions` before running it again "
            "[DEADLINE_EXCEEDED]\n"
        )
        # The undrain was sent once (the audit entry is another write).
        assert store.writes == 2
        store.lose = False
        entries = (await stub.ListAudit(apb.ListAuditRequest(action="UndrainRegion"))).entries
    [entry] = entries
    assert (entry.target, entry.result) == ("region/us-east", "OUTCOME_UNKNOWN")
    # Logged once, in one line (the audit entry's own write, lost too, is the
    # audit log's to say).
    [logged] = [r for r in caplog.records if r.name == "controlplane.catalog"]
    assert "may have been made" in logged.getMessage()
    assert logged.levelname == "WARNING" and logged.exc_info is None
    assert "may have been made" in entry.message


async def test_a_write_not_sent_and_a_read_stay_unavailable() -> None:
    store = Unconfirmed()
    await store.put(REGIONS + "us-east", encode(Region("us-east", 0.0, 0.0, drained=True)))
    async with admin_server(store, Clock(), admin_token="") as stub:
        store.available = False  # MemoryStore's outage: refused before anything is written
        drain = stub.DrainRegion(apb.DrainRequest(name="us-east", drained=False))
        assert await code_of(drain) == grpc.StatusCode.UNAVAILABLE
        assert await code_of(stub.ListRegions(apb.ListRequest())) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("check", "said"),
    [
        ("pontoctl get regions", ": the change may have been made; check with `pontoctl get "
         "regions` before running it again"),
        ("", ": the change may have been made; running it again does no harm"),  # a purge
        (None, ""),  # a read
    ],
)  # fmt: skip
def test_a_change_the_control_plane_did_not_answer_may_have_been_made(
    capsys: pytest.CaptureFixture[str], check: str | None, said: str
) -> None:
    timed_out = Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert _refused(timed_out, "cp:7000", ClientOptions(), check=check) == 1
    assert capsys.readouterr().err == (
        f"error: control plane at cp:7000 did not answer within 10 s{said} [DEADLINE_EXCEEDED]\n"
    )


# ------------------------------------------------------------ EtcdStore, on fakes


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Member:
    """A member's KV: `hung` never answers (until the attempt's timeout),
    `refused` fails at once as gRPC does with no connection."""

    def __init__(self) -> None:
        self.hung = False
        self.refused = False
        self.calls = 0
        self.timeouts: list[float] = []

    async def _answer(self, timeout: float) -> Any:
        self.calls += 1
        self.timeouts.append(timeout)
        if self.refused:
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                "failed to connect to all addresses; last error: UNAVAILABLE: "
                "ipv4:127.0.0.1:1: Connection refused",
            )
        if self.hung:
            await asyncio.sleep(timeout)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        header = type("Header", (), {"revision": 7})()
        return type("Resp", (), {"kvs": [], "header": header})()

    async def get(self, key: str, *, timeout: float, **_: Any) -> Any:
        return await self._answer(timeout)

    async def put(self, key: str, value: bytes, *, timeout: float, **_: Any) -> Any:
        return await self._answer(timeout)


def fake_store(n: int = 3, timeout: float = 0.6) -> tuple[EtcdStore, list[Member]]:
    store = EtcdStore([f"127.0.0.1:{2379 + i}" for i in range(n)], timeout=timeout)
    fakes = [Member() for _ in range(n)]
    for member, fake in zip(store._members, fakes, strict=True):
        member.client.kv = fake  # type: ignore[assignment]
    store._pin = 0
    return store, fakes


async def test_a_read_leaves_a_hung_member_after_its_share_of_the_timeout() -> None:
    store, (hung, second, third) = fake_store()
    hung.hung = True
    assert await store.get("/k") is None
    assert hung.timeouts == [pytest.approx(0.6 * ATTEMPT_SHARE, abs=0.05)]
    assert second.calls == 1
    # Calls stay on the member that answered: the hung one is not tried again.
    for _ in range(5):
        assert await store.get("/k") is None
    assert (hung.calls, second.calls, third.calls) == (1, 6, 0)


async def test_a_write_sent_to_a_hung_member_is_not_sent_again() -> None:
    store, (hung, second, _) = fake_store()
    hung.hung = True
    with pytest.raises(OutcomeUnknown, match="etcd put got no answer"):
        await store.put("/k", b"v")
    assert hung.calls == 1 and hung.timeouts == [pytest.approx(0.6, abs=0.05)]  # the whole timeout
    assert second.calls == 0
    await store.put("/k", b"v")  # the next goes to the member that has not failed
    assert second.calls == 1


async def test_a_write_not_sent_is_sent_to_the_next_member() -> None:
    store, (refused, second, _) = fake_store()
    refused.refused = True
    await store.put("/k", b"v")
    assert (refused.calls, second.calls) == (1, 1)


async def test_with_every_member_away_a_call_is_unavailable_within_its_timeout() -> None:
    store, fakes = fake_store()
    for fake in fakes:
        fake.refused = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(StoreUnavailable) as refused:
        await store.put("/k", b"v")
    assert not isinstance(refused.value, OutcomeUnknown)  # it reached no member
    assert loop.time() - started < 0.6 + 0.5  # generous: the call's timeout
    assert all(f.calls >= 1 for f in fakes)


def test_replicas_start_at_members_of_their_own() -> None:
    """Not all at the first member: each replica's store starts at a random one."""
    endpoints = [f"127.0.0.1:{2379 + i}" for i in range(3)]
    assert len({EtcdStore(endpoints).pinned for _ in range(30)}) > 1


async def test_a_read_on_one_member_or_the_last_gets_what_is_left_of_the_timeout() -> None:
    """Review: a read was cut to a third of its timeout on every try, so one
    that needed half of it (a large listing on a loaded etcd, a leader being
    elected) could never succeed, with one member (one name) least of all."""
    store, (only,) = fake_store(n=1)
    await store.get("/k")
    assert only.timeouts == [pytest.approx(0.6, abs=0.05)]
    store, (first, second, third) = fake_store()
    first.hung = second.hung = True
    await store.get("/k")
    assert first.timeouts == [pytest.approx(0.2, abs=0.05)]
    assert second.timeouts == [pytest.approx(0.2, abs=0.05)]
    assert third.timeouts == [pytest.approx(0.2, abs=0.08)]  # the rest: about a third


async def test_a_write_not_confirmed_does_not_end_the_ack_flush() -> None:
    """Review: OutcomeUnknown was no Unavailable, so the ACK flush (and a
    probe round, a stream's key removal) let it out and its task ended for
    good: the replica wrote no ACK summary again."""
    store = Unconfirmed()
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=5)
    await registry.announce("127.0.0.1:7000")
    record = await registry.register("eu-1", "eu-west", "127.0.0.1:1", "1")
    registry.streaming(record.session_id)
    store.lose = True
    await registry.flush(0.0)  # not confirmed: written (Unconfirmed applies it), due again
    store.lose = False
    await store.delete(ACKS + "cp1")  # as if it had not been applied
    await registry.flush(1.0)
    summary = await store.get(ACKS + "cp1")
    assert summary is not None and b"eu-1" in summary.value
    assert issubclass(CatalogOutcomeUnknown, Unavailable)


async def test_a_background_write_not_confirmed_is_said_so_once_not_as_a_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trial 101: through an etcd outage, each round's ACK summary not confirmed
    logged "a change may have been made" (twelve in 36 s), no operator having
    made one. It names the write and that the next round makes it again, once
    a minute; an operator's change is still told as one."""
    store, now = Unconfirmed(), [0.0]
    catalog = Catalog(store, monotonic=lambda: now[0])
    store.lose = True
    for _ in range(3):
        with pytest.raises(CatalogOutcomeUnknown):
            await catalog.put_acks("cp-bg", {}, lease=0)
    now[0] = 61.0
    with pytest.raises(CatalogOutcomeUnknown):
        await catalog.put_acks("cp-bg", {}, lease=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "controlplane.catalog"]
    assert len(lines) == 2, lines
    assert "a write of the ACK summary" in lines[0] and "next round" in lines[0]
    assert "(2 more not logged)" in lines[1]
    assert not any("may have been made" in line for line in lines)
    caplog.clear()
    with pytest.raises(CatalogOutcomeUnknown):
        await catalog.put_region(Region("bg-region", 0.0, 0.0), allow_update=True)
    [change] = [r.getMessage() for r in caplog.records if r.name == "controlplane.catalog"]
    assert "may have been made" in change
