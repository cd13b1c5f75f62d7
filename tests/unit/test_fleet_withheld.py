"""Review 293: a proxy that holds no table (a new pod, a scale-up, a rolled pod
whose state was an emptyDir) is sent none while the fleet is in question, as
it would take the new fleet's table: serve callers with no key, refuse the
fleet's tables once the old id is adopted, and advise adopting its own. It
gets its table once the question is settled; a fresh install, a scale-up,
and a whole fleet restarted without its state get theirs at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from controlplane.api.routing import RoutingService
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.fleetid import (
    ANOTHER_FLEET_NACK,
    REPLACED_GRACE_S,
    WOULD_OPEN_NACK,
    FleetWatch,
)
from controlplane.model import ProxyRecord
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore
from controlplane.web import StatusWeb
from dataplane.sync.holder import refusal
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_control_metrics import Stream, table

OLD = "aaaaaaaaaaaaaaaa"
NEW = "bbbbbbbbbbbbbbbb"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet_table(version: int, fleet: str) -> pb.RouteTable:
    t = table(version)
    t.fleet_id = fleet
    return t


class ProxyStream(Stream):
    def __init__(self, session_id: str) -> None:
        super().__init__()
        self.session_id = session_id


class Replica:
    """One replica's routing service over an in-memory store, and the
    streams of the proxies it serves."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.watch = FleetWatch(clock or Clock())
        self.publisher = Publisher("cp")
        self.catalog = Catalog(MemoryStore())
        self.registry = ProxyRegistry(self.catalog, "cp")
        self.routing = RoutingService(self.registry, self.publisher, fleet=self.watch)
        self.tasks: list[asyncio.Task[None]] = []

    async def connect(self, name: str, holds: int = 0, fleet: str = "") -> ProxyStream:
        record = await self.registry.register(name, "eu", "127.0.0.1:9", "test")
        stream = ProxyStream(record.session_id)
        self.tasks.append(
            asyncio.create_task(self.routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
        )
        await stream.requests.put(
            pb.RouteRequest(session_id=record.session_id, version_info=holds, fleet_id=fleet)
        )
        return stream

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = Replica()
    yield r
    await r.close()


async def answer(stream: ProxyStream, update: pb.RouteUpdate, fleet: str, error: str = "") -> None:
    await stream.requests.put(
        pb.RouteRequest(
            session_id=stream.session_id,
            version_info=update.table.version,
            response_nonce=update.nonce,
            error_detail=error,
            fleet_id=fleet,
        )
    )


async def withheld(replica: Replica, name: str, stream: ProxyStream) -> bool:
    """The stream of proxy `name` waits for the question to be settled, and
    no table went out on it."""
    await until(lambda: name in replica.watch.waiting)
    pushed = [stream.pushed.get_nowait() for _ in range(stream.pushed.qsize())]
    return not any(update.HasField("table") for update in pushed)


async def until(condition: Callable[[], object]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_fresh_install_and_a_scale_up_get_their_tables_at_once(
    replica: Replica,
) -> None:
    replica.publisher.publish(fleet_table(5, OLD))
    replica.watch.made(OLD, "")
    replica.watch.published(OLD)
    first = await replica.connect("p1")
    assert (await first.next_table()).table.fleet_id == OLD
    added = await replica.connect("p2")  # a scale-up: holds none, nothing in question
    assert (await added.next_table()).table.fleet_id == OLD


async def test_a_proxy_without_a_table_gets_none_while_proxies_refuse_until_adopted(
    replica: Replica,
) -> None:
    replica.publisher.publish(fleet_table(900, NEW))
    replica.watch.published(NEW)
    old = await replica.connect("p-old", holds=5, fleet=OLD)
    pushed = await old.next_table()
    await answer(old, pushed, OLD, error="another fleet's table (fleet ...)")
    await until(lambda: replica.watch.refusing)

    fresh = await replica.connect("p-new")
    assert await withheld(replica, "p-new", fresh)
    problem = replica.watch.problem()
    assert "1 proxies that hold no table (started since) are sent none" in problem
    assert f"pontoctl fleet adopt {OLD}`" in problem

    # Adopted: the tables are of the old fleet's id again, which both take.
    replica.publisher.publish(fleet_table(901, OLD))
    replica.watch.published(OLD)
    adopted = await old.next_table()
    await answer(old, adopted, OLD)
    got = await fresh.next_table()
    assert (got.table.version, got.table.fleet_id) == (901, OLD)
    assert replica.watch.waiting == set() and replica.watch.problem() == ""


async def test_a_proxy_without_a_table_waits_while_its_replica_replaced_the_id() -> None:
    """Before the proxies that hold the old fleet's tables are back to
    refuse: for REPLACED_GRACE_S, after which, none refusing (every proxy lost
    its state too), the tables flow."""
    clock = Clock()
    replica = Replica(clock)
    try:
        replica.publisher.publish(fleet_table(900, NEW))
        replica.watch.published(OLD)
        replica.watch.made(NEW, OLD)
        replica.watch.published(NEW)
        assert replica.watch.in_question()
        fresh = await replica.connect("p-new")
        assert await withheld(replica, "p-new", fresh)
        clock.now += REPLACED_GRACE_S
        assert not replica.watch.in_question()
        # The waiter's timer runs on the loop's clock, not the injected one:
        # woken here as its timer would wake it.
        replica.watch._changed()
        assert (await fresh.next_table()).table.fleet_id == NEW
    finally:
        await replica.close()


async def test_a_whole_fleet_restarted_without_its_state_gets_tables(replica: Replica) -> None:
    replica.publisher.publish(fleet_table(5, OLD))
    replica.watch.published(OLD)
    streams = [await replica.connect(f"p{i}") for i in range(3)]
    for stream in streams:
        assert (await stream.next_table()).table.fleet_id == OLD


async def test_refusals_ending_with_their_streams_settle_the_question(replica: Replica) -> None:
    replica.publisher.publish(fleet_table(900, NEW))
    replica.watch.published(NEW)
    old = await replica.connect("p-old", holds=5, fleet=OLD)
    await answer(old, await old.next_table(), OLD, error="another fleet's table")
    await until(lambda: replica.watch.refusing)
    fresh = await replica.connect("p-new")
    assert await withheld(replica, "p-new", fresh)
    await old.requests.put(None)  # the refusing proxy left (scaled down)
    assert (await fresh.next_table()).table.fleet_id == NEW


async def test_refusals_on_another_replica_keep_a_proxy_without_a_table_waiting(
    replica: Replica,
) -> None:
    """A replica none of whose own proxies refuse reads the others' in the
    proxies' registrations (the status page's sampling)."""
    replica.publisher.publish(fleet_table(900, NEW))
    replica.watch.published(NEW)
    web = StatusWeb(replica.catalog, replica.publisher, "cp", proxies_seen=replica.watch.seen)
    lease = await replica.catalog.store.grant_lease(10)
    other = ProxyRecord("p-old", "eu", "p-old:8080", "1.0", "s-old", "cp-2", 900.0)
    await replica.catalog.register_proxy(other, lease)
    nack = f"{ANOTHER_FLEET_NACK} (fleet {NEW}; this proxy serves fleet {OLD}): ..."
    await replica.catalog.put_acks("cp-2", {"p-old": (5, nack)}, lease, version=901)
    await web.sample(1_000.0)
    assert replica.watch.in_question() and not replica.watch.refusing

    fresh = await replica.connect("p-new")
    assert await withheld(replica, "p-new", fresh)
    assert "1 proxies (of other replicas) refuse route tables" in replica.watch.problem()
    # Adopted there: it takes cp-2's table, and its registration says so.
    await replica.catalog.put_acks("cp-2", {"p-old": (901, "")}, lease, version=901)
    await web.sample(1_010.0)
    assert (await fresh.next_table()).table.fleet_id == NEW


def test_the_refusals_a_registration_keeps_are_the_ones_the_watch_reads() -> None:
    refused = refusal(OLD, True, fleet_table(900, NEW))
    assert refused is not None and str(refused).startswith(ANOTHER_FLEET_NACK)
    opening = fleet_table(901, OLD)
    opening.auth_required = False
    refused = refusal(OLD, True, opening)
    assert refused is not None and str(refused).startswith(WOULD_OPEN_NACK)


async def test_a_proxy_without_a_table_gets_no_table_that_the_others_refuse_as_opening(
    replica: Replica,
) -> None:
    """Adopted before the keys were made again: the table requires none, the
    proxies refuse it as opening them, and one that holds no table would
    serve anyone with it."""
    open_table = fleet_table(901, OLD)
    open_table.auth_required = False
    replica.publisher.publish(open_table)
    replica.watch.published(OLD)
    old = await replica.connect("p-old", holds=5, fleet=OLD)
    await answer(old, await old.next_table(), OLD, error=f"{WOULD_OPEN_NACK} (no API key ...)")
    await until(lambda: replica.watch.opening)
    fresh = await replica.connect("p-new")
    assert await withheld(replica, "p-new", fresh)
    assert "1 proxies refuse its route tables as opening them" in replica.watch.problem()
    closed = fleet_table(902, OLD)
    closed.auth_required = True  # a key made again
    replica.publisher.publish(closed)
    await answer(old, await old.next_table(), OLD)
    got = await fresh.next_table()
    assert (got.table.version, got.table.auth_required) == (902, True)


async def test_a_stray_proxy_of_another_fleet_keeps_no_new_proxy_waiting(
    replica: Replica,
) -> None:
    """A proxy of another fleet pointed at this control plane refuses its
    tables for as long as it stays; the proxies that take them outnumber it."""
    replica.publisher.publish(fleet_table(5, OLD))
    replica.watch.published(OLD)
    for name in ("p1", "p2"):
        stream = await replica.connect(name, holds=5, fleet=OLD)
        await answer(stream, await stream.next_table(), OLD)
    stray = await replica.connect("p-stray", holds=7, fleet=NEW)
    await answer(stray, await stray.next_table(), NEW, error="another fleet's table")
    await until(lambda: replica.watch.refusing and len(replica.watch.taking) == 2)
    assert not replica.watch.in_question()
    assert "they serve fleet bbbbbbbbbbbbbbbb" in replica.watch.problem()  # still told
    added = await replica.connect("p3")
    assert (await added.next_table()).table.fleet_id == OLD


def test_a_stray_alone_on_a_replica_is_outnumbered_by_the_takers_elsewhere() -> None:
    """Review 295: the replica's own streams decided alone, so one stray
    proxy of another fleet on a replica no taking proxy used (one just added
    or restarted) kept every new proxy there waiting, though five took the
    tables through the other replicas. Once the stored registrations are
    read, the fleet-wide counts decide."""
    watch = FleetWatch(Clock())
    watch.published(OLD)
    watch.answered("p-stray", NEW, refused=True)
    assert watch.in_question()  # nothing read of the others yet
    takers = [
        ProxyRecord(f"p{n}", "eu", f"p{n}:8080", "1.0", f"s-{n}", "cp-2", 900.0, acked_version=5)
        for n in range(5)
    ]
    stray = ProxyRecord(
        "p-stray", "eu", "p-stray:8080", "1.0", "s-stray", "cp", 900.0, acked_version=3,
        last_error=f"{ANOTHER_FLEET_NACK} (fleet {OLD}; this proxy serves fleet {NEW}): ...",
    )  # fmt: skip
    watch.seen([*takers, stray])
    assert not watch.in_question()
    watch.seen([stray])  # the takers gone: the stray prevails again
    assert watch.in_question()
