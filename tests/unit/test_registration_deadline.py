"""A registration lives as long as its route stream: one whose proxy never
opens the stream (it died between Register and RouteStream) is removed after
the registry's stream grace, so it is not counted in the fleet's size (every
proxy's share of a global limit) until its replica goes."""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane import registry as registry_module
from controlplane.api.routing import RoutingService
from controlplane.catalog import PROXIES, Catalog
from controlplane.distribute import Publisher
from controlplane.errors import Superseded, Unavailable
from controlplane.model import ProxyRecord, decode_proxy, encode
from controlplane.registry import ProxyRegistry
from controlplane.store import KeyValue, Listing, StoreUnavailable
from controlplane.store.memory import MemoryStore
from ponto.pki import add_client, make_bundle
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_control_metrics import Stream, table


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class RefusingStream(Stream):
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(code, details)


async def fleet(catalog: Catalog) -> list[str]:
    return sorted(await catalog.proxy_names())


async def test_a_registration_without_a_route_stream_goes_after_the_grace() -> None:
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    live = await registry.register("p-live", "eu", "127.0.0.1:1", "1")
    dead = await registry.register("p-dead", "eu", "127.0.0.1:2", "1")
    assert registry.streaming(live.session_id)
    await registry.flush(100.0)  # the first flush to see p-dead starts its grace
    await registry.flush(109.9)
    assert await fleet(catalog) == ["p-dead", "p-live"]
    await registry.flush(110.0)
    assert await fleet(catalog) == ["p-live"]
    assert set(registry.sessions) == {live.session_id}
    # Its stream, opened after all, is refused: the proxy registers again.
    assert not registry.streaming(dead.session_id)
    # The live one's registration outlasts any grace.
    await registry.flush(10_000.0)
    assert await fleet(catalog) == ["p-live"]


async def test_a_registration_made_again_is_timed_on_its_own() -> None:
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    first = await registry.register("p1", "eu", "127.0.0.1:1", "1")
    await registry.flush(100.0)
    # The proxy restarted and registered again before its first stream.
    second = await registry.register("p1", "eu", "127.0.0.1:1", "1")
    assert not registry.streaming(first.session_id)
    await registry.flush(105.0)
    assert registry.streaming(second.session_id)
    await registry.flush(200.0)
    assert await fleet(catalog) == ["p1"]
    assert set(registry.sessions) == {second.session_id}


async def one_proxy() -> tuple[Catalog, ProxyRegistry, RoutingService, str]:
    """A replica's registry and Routing service, with proxy p1 registered
    (its session id) and seen by a flush at 0 s."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    record = await registry.register("p1", "eu", "127.0.0.1:1", "1")
    await registry.flush(0.0)
    return catalog, registry, RoutingService(registry, Publisher("cp")), record.session_id


async def test_the_route_stream_of_a_removed_registration_is_refused() -> None:
    catalog, registry, routing, late = await one_proxy()
    await registry.flush(10.0)
    stream = RefusingStream()
    await stream.requests.put(pb.RouteRequest(session_id=late))
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(routing.route_stream(stream.incoming(), stream), 10)  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "call Register first" in str(refused.value)
    assert await fleet(catalog) == []


async def test_a_stream_opened_in_time_keeps_its_registration_until_it_ends() -> None:
    catalog, registry, routing, session_id = await one_proxy()
    stream = Stream()
    task = asyncio.create_task(routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
    await stream.requests.put(pb.RouteRequest(session_id=session_id))
    for _ in range(100):
        if routing.streams:
            break
        await asyncio.sleep(0.01)
    assert routing.streams == 1
    await registry.flush(60.0)
    assert await fleet(catalog) == ["p1"]
    await stream.requests.put(None)  # the proxy closes its stream
    await asyncio.wait_for(task, 10)
    assert await fleet(catalog) == []


class EndingStream(Stream):
    """A stream whose ending status the servicer sets is kept."""

    code: grpc.StatusCode | None = None
    details = ""

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


async def test_a_stream_whose_name_registered_again_ends_aborted() -> None:
    """A group's reload starts a worker's successor beside it, under its name:
    the old stream ends ABORTED, which tells the proxy on it that another
    process has the name (the link then waits before taking it back), where a
    stream the proxy closed itself ends OK."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    publisher = Publisher("cp")
    routing = RoutingService(registry, publisher)
    first = await registry.register("p1-w0", "eu", "127.0.0.1:1", "1")
    stream = EndingStream()
    task = asyncio.create_task(routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
    await stream.requests.put(pb.RouteRequest(session_id=first.session_id))
    publisher.publish(table(1))
    await stream.next_table()
    second = await registry.register("p1-w0", "eu", "127.0.0.1:1", "1")
    # Nothing else is pushed: the registration alone ends the old stream.
    await asyncio.wait_for(task, 10)
    assert stream.code == grpc.StatusCode.ABORTED
    assert stream.details == "proxy p1-w0 registered again on another stream"
    # The successor's registration stays.
    assert await fleet(catalog) == ["p1-w0"]
    assert set(registry.sessions) == {second.session_id}

    own = EndingStream()
    task = asyncio.create_task(routing.route_stream(own.incoming(), own))  # type: ignore[arg-type]
    await own.requests.put(pb.RouteRequest(session_id=second.session_id))
    await own.next_table()
    await own.requests.put(None)  # the proxy closes its stream
    await asyncio.wait_for(task, 10)
    assert own.code is None


async def open_stream(
    routing: RoutingService, session_id: str
) -> tuple[EndingStream, asyncio.Task[None]]:
    stream = EndingStream()
    task = asyncio.create_task(routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
    await stream.requests.put(pb.RouteRequest(session_id=session_id))
    await stream.next_table()
    return stream, task


async def test_a_name_registered_again_on_another_replica_ends_the_stream_here() -> None:
    """Review 33's note: a worker's stream on a replica other than the one its
    successor registered on stayed open (and in that replica's ACK summary)
    until the worker left. The replica's watch of the registrations ends it
    ABORTED, and its end removes nothing."""
    catalog = Catalog(MemoryStore())
    here = ProxyRegistry(catalog, "cp-a", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp-b", stream_grace=10.0)
    publisher = Publisher("cp-a")
    publisher.publish(table(1))
    routing = RoutingService(here, publisher)
    watching = asyncio.create_task(here.watch())
    try:
        old = await here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)
        other = await here.register("g-w1", "eu", "127.0.0.1:2", "1", started_at=100.0)
        stream, task = await open_stream(routing, old.session_id)
        kept, kept_task = await open_stream(routing, other.session_id)
        new = await there.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
        await asyncio.wait_for(task, 10)
        assert stream.code == grpc.StatusCode.ABORTED
        assert stream.details == "proxy g-w0 registered again on another stream"
        assert set(here.sessions) == {other.session_id}
        assert here.acks() == {"g-w1": (0, "")}
        current = await catalog.get_proxy("g-w0")
        assert current is not None and current.session_id == new.session_id
        # Another name's stream, here, goes on.
        assert not kept_task.done()
        await kept.requests.put(None)
        await asyncio.wait_for(kept_task, 10)
        assert kept.code is None
    finally:
        watching.cancel()


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.lists = 0

    async def list(self, prefix: str) -> Listing:
        self.lists += 1
        return await super().list(prefix)


async def test_changes_of_the_registrations_are_read_once_a_while() -> None:
    """A fleet's rolling reload is a change of the registrations per proxy:
    a replica reads them all once for the changes of `every` seconds, not
    once per change."""
    store = CountingStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp-a", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp-b", stream_grace=10.0)
    mine = await here.register("g-w0", "eu", "127.0.0.1:1", "1")
    watching = asyncio.create_task(here.watch(every=3600.0))
    try:
        while store.lists == 0:  # a change once the watch follows them
            await there.register("p1", "eu", "127.0.0.1:2", "1")
            await asyncio.sleep(0.01)
        for i in range(2, 50):
            await there.register(f"p{i}", "eu", "127.0.0.1:2", "1")
        await there.register("g-w0", "eu", "127.0.0.1:1", "1")
        for _ in range(20):
            await asyncio.sleep(0)
        assert store.lists == 1
        assert mine.session_id in here.sessions  # until the next read
    finally:
        watching.cancel()


class MissedStore(MemoryStore):
    """A store whose watch of the registrations sees no change (as one
    re-created after etcd restarted misses the changes made meanwhile), and
    whose first `failing` listings fail; it reports `changes` changes at once,
    then none."""

    def __init__(self, failing: int = 0, changes: int = 0) -> None:
        super().__init__()
        self.failing = failing
        self.changes = changes
        self.lists = 0

    async def list(self, prefix: str) -> Listing:
        self.lists += 1
        if self.failing:
            self.failing -= 1
            raise StoreUnavailable("etcd is away")
        return await super().list(prefix)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        for _ in range(self.changes):
            yield self._revision
        await asyncio.Event().wait()


async def test_a_change_the_watch_missed_is_read_all_the_same() -> None:
    """Review 35: a session superseded by a change the watch missed stayed
    until the next change of the registrations, which may never come. The
    registrations are read every `rescan` seconds with no change seen."""
    catalog = Catalog(MissedStore())
    here = ProxyRegistry(catalog, "cp-a", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp-b", stream_grace=10.0)
    old = await here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)
    kept = await here.register("g-w1", "eu", "127.0.0.1:2", "1", started_at=100.0)
    watching = asyncio.create_task(here.watch(every=0.0, rescan=0.01))
    try:
        await there.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
        await asyncio.wait_for(here.ended(old.session_id).wait(), 10)
        assert set(here.sessions) == {kept.session_id}
    finally:
        watching.cancel()


async def test_a_read_of_the_registrations_that_failed_is_made_again() -> None:
    """Review 35: a read after a change that failed (etcd away) was made again
    only at the next change. It is made again `every` seconds later, until
    one succeeds."""
    store = MissedStore(changes=1)
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp-a", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp-b", stream_grace=10.0)
    old = await here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)
    await there.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    store.failing = 3
    # One change seen, and no rescan in the test's time: only the retries read.
    watching = asyncio.create_task(here.watch(every=0.0, rescan=3600.0))
    try:
        await asyncio.wait_for(here.ended(old.session_id).wait(), 10)
        assert store.lists == 4  # three failed, one read
        assert here.sessions == {}
    finally:
        watching.cancel()


class HeldListStore(MemoryStore):
    """A store whose listings are read at once and answered once `release`
    is set, as a slow etcd's may be."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.release.set()
        self.listed = asyncio.Event()

    async def list(self, prefix: str) -> Listing:
        listing = await super().list(prefix)
        self.listed.set()
        await self.release.wait()
        return listing


async def test_a_listing_from_before_a_registration_supersedes_nothing() -> None:
    """The watch's read of the registrations may predate a registration made
    here meanwhile: the other replica's record it shows is older than this
    session's and leaves it be, where one written after it ends it."""
    store = HeldListStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp-a", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp-b", stream_grace=10.0)
    await here.register("p1", "eu", "127.0.0.1:1", "1")
    elsewhere = await there.register("p1", "eu", "127.0.0.1:1", "1")
    store.release.clear()
    store.listed.clear()
    read = asyncio.create_task(here.drop_superseded())
    await store.listed.wait()  # the listing names cp-b's session
    back = await here.register("p1", "eu", "127.0.0.1:1", "1")  # the proxy came back here
    store.release.set()
    await read
    assert set(here.sessions) == {back.session_id}
    assert here.ended(back.session_id).is_set() is False
    # cp-b's session is older than the key's write now: it goes at its next read.
    await there.drop_superseded()
    assert there.sessions == {}
    assert there.ended(elsewhere.session_id).is_set()


class SlowStore(MemoryStore):
    """A store whose writes wait for `release`, as etcd's may."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        revision = await super().put(key, value, **kwargs)
        await self.release.wait()  # written, the answer not back yet
        return revision


async def test_a_register_call_cut_during_its_write_goes_after_the_grace() -> None:
    """Trial 14: a Register cancelled while its record was being written left
    the key under the replica's lease for as long as the replica lived,
    counted in every proxy's fleet size, since the session was recorded for
    the sweep only after the write."""
    store = SlowStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    await registry.lease()
    call = asyncio.create_task(registry.register("p-cut", "eu", "127.0.0.1:1", "1"))
    while not await fleet(catalog):
        await asyncio.sleep(0)
    call.cancel()  # the proxy went away: gRPC cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await call
    store.release.set()
    assert await fleet(catalog) == ["p-cut"]
    await registry.flush(0.0)
    await registry.flush(10.0)
    assert await fleet(catalog) == []
    assert registry.sessions == {}


class FlakyStore(MemoryStore):
    """A store whose writes fail while `down`, and whose reads wait for
    `reads` while it is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.reads = asyncio.Event()
        self.reads.set()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if self.down:
            raise StoreUnavailable("etcd is away")
        return await super().put(key, value, **kwargs)

    async def get(self, key: str) -> KeyValue | None:
        await self.reads.wait()
        return await super().get(key)


async def test_a_register_that_failed_supersedes_nothing() -> None:
    """Review 31: a failed Register dropped the streaming session of its name,
    whose key then outlived its stream."""
    store = FlakyStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    first = await registry.register("p1", "eu", "127.0.0.1:1", "1")
    assert registry.streaming(first.session_id)
    store.down = True
    with pytest.raises(Unavailable):
        await registry.register("p1", "eu", "127.0.0.1:1", "1")
    store.down = False
    assert set(registry.sessions) == {first.session_id}
    await registry.unregister(first.session_id)  # its stream ends
    await registry.flush(0.0)
    await registry.flush(10.0)
    assert await fleet(catalog) == []


async def test_a_failed_register_neither_rewrites_nor_removes_another_replicas_record() -> None:
    """Review 31: the record of a Register that failed here was rewritten on a
    new lease over the one another replica then made, and the sweep removed it."""
    store = FlakyStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp2", stream_grace=10.0)
    await here.lease()
    store.down = True
    with pytest.raises(Unavailable):
        await here.register("p1", "eu", "127.0.0.1:1", "1")
    store.down = False
    moved = await there.register("p1", "eu", "127.0.0.1:1", "1")
    assert there.streaming(moved.session_id)
    await here._rewrite()  # the lease lost and granted again
    await here.flush(0.0)
    await here.flush(10.0)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.name, proxy.session_id) == ("p1", moved.session_id)


async def test_a_stream_opened_while_the_sweep_runs_keeps_its_registration() -> None:
    """Review 31: the sweep listed the late sessions, then removed each in
    turn, awaiting the store: one whose stream opened meanwhile went too."""
    store = FlakyStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    a = await registry.register("p-a", "eu", "127.0.0.1:1", "1")
    b = await registry.register("p-b", "eu", "127.0.0.1:2", "1")
    await registry.flush(0.0)
    store.reads.clear()  # the first removal waits on the store
    sweep = asyncio.create_task(registry.flush(10.0))
    while a.session_id in registry._unstreamed:  # until the sweep is at p-a
        await asyncio.sleep(0)
    assert registry.streaming(b.session_id)  # p-b's stream opens now
    store.reads.set()
    await sweep
    assert set(registry.sessions) == {b.session_id}
    assert await fleet(catalog) == ["p-b"]


async def test_an_older_process_cannot_take_the_name_of_a_later_one() -> None:
    """Review 32: a group's worker that registered again just after its
    successor (its stream ended for another reason meanwhile) took the name
    back, and its leave then removed the registration for 30 s."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    successor = await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    with pytest.raises(Superseded, match="registered by a process started after this one"):
        await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)
    assert set(registry.sessions) == {successor.session_id}
    current = await catalog.get_proxy("g-w0")
    assert current is not None and current.session_id == successor.session_id
    # The same process again (a reconnect) may, and so may a later one.
    again = await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    later = await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=300.0)
    assert again.session_id not in registry.sessions
    # Once the later one is gone, the name is free again, for anyone.
    await registry.unregister(later.session_id)
    await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)


HOUR = 3600.0


@pytest.mark.parametrize(
    ("started_at", "sent_at", "refusal"),
    [
        (math.nan, 0.0, "start time nan is not a past time"),
        (math.inf, 0.0, "start time inf is not a past time"),
        (-1.0, 0.0, "start time -1.0 is not a past time"),
        (HOUR, 0.0, "is not a past time"),  # after the control plane's clock
        (HOUR, HOUR - 400.0, "is not a past time"),  # after the proxy's own
        (-HOUR, math.nan, "send time nan is not a time"),
        (-HOUR, -1.0, "send time -1.0 is not a time"),
    ],
)
async def test_a_start_time_that_is_no_past_time_is_refused(
    started_at: float, sent_at: float, refusal: str
) -> None:
    """A start in the future would hold the name against every later process.
    Times in HOUR are from now (so -HOUR is an hour ago)."""
    registry = ProxyRegistry(Catalog(MemoryStore()), "cp", stream_grace=10.0)
    routing = RoutingService(registry, Publisher("cp"))
    now = time.time()
    info = pb.ProxyInfo(
        name="p1",
        region="eu",
        address="127.0.0.1:1",
        started_at=now + started_at if abs(started_at) == HOUR else started_at,
        sent_at=now + sent_at if sent_at > 0 else sent_at,
    )
    with pytest.raises(Refused, match=refusal) as refused:
        await routing.register(pb.RegisterRequest(proxy=info), RefusingStream())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert registry.sessions == {}


async def test_a_proxy_whose_clock_runs_ahead_registers() -> None:
    """Review 33: a proxy's clock over five minutes ahead of the control
    plane's made every start of it "no past time". Its start is judged by its
    own clock as it sent the request."""
    registry = ProxyRegistry(Catalog(MemoryStore()), "cp", stream_grace=10.0)
    routing = RoutingService(registry, Publisher("cp"))
    ahead = time.time() + HOUR
    info = pb.ProxyInfo(
        name="p1", region="eu", address="127.0.0.1:1", started_at=ahead - 60.0, sent_at=ahead
    )
    before = time.time()
    reply = await routing.register(pb.RegisterRequest(proxy=info), RefusingStream())
    record = registry.sessions[reply.session_id]
    assert record.started_at == ahead - 60.0
    # Its counters' start by this replica's clock: 60 s before it registered,
    # the hour ahead aside (review 40: the status page's first rates).
    assert before - 60.0 <= record.counting_from <= record.connected_at - 60.0


async def test_a_start_after_the_send_by_the_proxys_clock_gives_no_counting_start() -> None:
    """Review 41: a proxy clock stepped back between its start and its
    Register made a negative age, a counters' start in the future, and the
    status page's first rates many times over."""
    registry = ProxyRegistry(Catalog(MemoryStore()), "cp", stream_grace=10.0)
    routing = RoutingService(registry, Publisher("cp"))
    now = time.time()
    info = pb.ProxyInfo(
        name="p1", region="eu", address="127.0.0.1:1", started_at=now + 2.0, sent_at=now
    )
    reply = await routing.register(pb.RegisterRequest(proxy=info), RefusingStream())
    assert registry.sessions[reply.session_id].counting_from == 0.0


async def test_a_process_that_does_not_say_its_start_supersedes_and_is_superseded_by_none() -> None:
    """Review 33: a start time of 0 (a proxy that does not say it) counted as
    the oldest, so such a proxy could not take its name from one that says
    it. 0 is unknown: registered as before started_at existed, last one wins."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    await registry.register("p1", "eu", "127.0.0.1:1", "1", started_at=200.0)
    unknown = await registry.register("p1", "eu", "127.0.0.1:1", "1")
    current = await catalog.get_proxy("p1")
    assert current is not None and current.session_id == unknown.session_id
    later = await registry.register("p1", "eu", "127.0.0.1:1", "1", started_at=100.0)
    current = await catalog.get_proxy("p1")
    assert current is not None and current.session_id == later.session_id


class HeldPutStore(MemoryStore):
    """A store whose next put waits for `release` once `hold` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if self.hold:
            self.hold = False
            self.held.set()
            await self.release.wait()
        return await super().put(key, value, **kwargs)


async def test_of_two_registrations_at_once_the_older_process_does_not_overwrite() -> None:
    """Review 33: the start-time check read the name's registration, then
    wrote: an older process's Register on one replica that read before a
    later process's on another wrote its own over it."""
    store = HeldPutStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp2", stream_grace=10.0)
    await here.lease()
    await there.lease()
    store.hold = True
    older = asyncio.create_task(here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0))
    await store.held.wait()  # it has read: no registration yet
    newer = await there.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    store.release.set()
    with pytest.raises(Superseded):
        await older
    current = await catalog.get_proxy("g-w0")
    assert current is not None and current.session_id == newer.session_id
    assert here.sessions == {}


def two_replicas() -> tuple[Catalog, ProxyRegistry, ProxyRegistry]:
    catalog = Catalog(MemoryStore())
    return (
        catalog,
        ProxyRegistry(catalog, "cp", stream_grace=10.0),
        ProxyRegistry(catalog, "cp2", stream_grace=10.0),
    )


async def lose_lease(catalog: Catalog, registry: ProxyRegistry) -> None:
    """As etcd away longer than the lease's TTL: the lease and its keys are gone."""
    await catalog.store.revoke_lease(await registry.lease())
    registry._lease = 0


async def test_a_key_of_an_earlier_process_is_taken_back_at_once() -> None:
    """Review 38: a session left alone for a key of an earlier process (its
    own rewrite to take the name back) kept it only after a lease loss: with
    the lease alive (etcd restored from a snapshot), the name stayed with the
    dead worker. The read that sees the key takes the name back."""
    catalog, here, there = two_replicas()
    successor = await here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    assert here.streaming(successor.session_id)
    # The worker's registration, as a restored snapshot holds it.
    worker = await there.register("g-x", "eu", "127.0.0.1:1", "1", started_at=100.0)
    old = replace(worker, name="g-w0")
    await catalog.store.put(PROXIES + "g-w0", encode(old), lease=await there.lease())
    assert await here.drop_superseded()
    current = await catalog.get_proxy("g-w0")
    assert current is not None and current.session_id == successor.session_id
    assert set(here.sessions) == {successor.session_id}
    assert await here.drop_superseded()  # its own write: nothing more happens
    assert set(here.sessions) == {successor.session_id}


async def test_a_lost_lease_puts_back_only_what_registered_nowhere_else_meanwhile() -> None:
    """Review 33: after its lease was lost a replica wrote every session it
    held again, over a registration its proxy (or a successor of its name)
    had made on another replica meanwhile."""
    catalog, here, there = two_replicas()
    moved = await here.register("p-moved", "eu", "127.0.0.1:1", "1", started_at=100.0)
    stayed = await here.register("p-stayed", "eu", "127.0.0.1:2", "1", started_at=100.0)
    assert here.streaming(moved.session_id) and here.streaming(stayed.session_id)
    await lose_lease(catalog, here)  # the lease is lost...
    elsewhere = await there.register("p-moved", "eu", "127.0.0.1:1", "1", started_at=100.0)
    await here._rewrite()  # ...and granted again
    records = {p.name: p.session_id for p in await catalog.list_proxies()}
    assert records == {"p-moved": elsewhere.session_id, "p-stayed": stayed.session_id}
    assert set(here.sessions) == {stayed.session_id}


@pytest.mark.parametrize(
    ("worker_first", "read_between"),
    [(True, False), (False, False), (True, True)],
    ids=["worker-first", "successor-first", "worker-first-then-a-read"],
)
async def test_after_an_outage_the_later_process_keeps_its_name(
    worker_first: bool, read_between: bool
) -> None:
    """Review 35: after an etcd outage that lost both replicas' leases, the
    replica that wrote its sessions back first kept the name, though its
    session was the worker's a reload had replaced on the other replica:
    the successor's was dropped and its stream ended. The later process
    keeps the name whatever the order, and the worker's session goes."""
    catalog, here, there = two_replicas()
    worker = await there.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=100.0)
    successor = await here.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    assert there.streaming(worker.session_id) and here.streaming(successor.session_id)
    for registry in (here, there):  # etcd was away longer than the leases' TTL
        await lose_lease(catalog, registry)
    for registry in (there, here) if worker_first else (here, there):
        if read_between and registry is here:
            # Review 37: the successor's replica reads the registrations (its
            # watch, within 0.5 s) before its own rewrite (its keepalive).
            assert await here.drop_superseded()
            assert set(here.sessions) == {successor.session_id}
        await registry._rewrite()
    current = await catalog.get_proxy("g-w0")
    assert current is not None and current.session_id == successor.session_id
    assert set(here.sessions) == {successor.session_id}
    assert await there.drop_superseded()  # its watch saw the write
    assert there.sessions == {}
    assert there.ended(worker.session_id).is_set()


async def test_a_read_of_the_registrations_decodes_only_this_replicas_superseded_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 36: every read decoded every registration of the fleet (80 ms
    for 10,000, on the event loop, twice a second during a rolling reload).
    Only a key of a name this replica holds, written after its session, is
    decoded."""
    _, here, there = two_replicas()
    mine = await here.register("p-0", "eu", "127.0.0.1:1", "1", started_at=100.0)
    kept = await here.register("p-1", "eu", "127.0.0.1:1", "1", started_at=100.0)
    for i in range(2, 200):
        await there.register(f"p-{i}", "eu", "127.0.0.1:1", "1")
    decoded: list[str] = []
    real = decode_proxy

    def counting(raw: bytes) -> ProxyRecord:
        record = real(raw)
        decoded.append(record.name)
        return record

    monkeypatch.setattr(registry_module, "decode_proxy", counting)
    assert await here.drop_superseded()
    assert decoded == []
    await there.register("p-0", "eu", "127.0.0.1:1", "1", started_at=200.0)
    assert await here.drop_superseded()
    assert decoded == ["p-0"]
    assert set(here.sessions) == {kept.session_id}
    assert here.ended(mine.session_id).is_set()


async def test_a_stream_that_ends_while_its_registration_is_put_back_leaves_none() -> None:
    """Review 36: a session whose stream ended while the lost lease's rewrite
    put its registration back (its removal found no key yet) was written
    again, and stayed listed, counted in every proxy's share of a global
    limit, for as long as the replica lived."""
    store = HeldPutStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    gone = await here.register("p1", "eu", "127.0.0.1:1", "1", started_at=100.0)
    assert here.streaming(gone.session_id)
    await lose_lease(catalog, here)
    store.hold = True
    rewrite = asyncio.create_task(here._rewrite())
    await store.held.wait()  # it read no key: its put comes next
    await here.unregister(gone.session_id)  # the proxy's stream ends
    store.release.set()
    await rewrite
    assert await catalog.proxy_keys() == {}
    assert here._written == {}


async def test_a_lease_that_cannot_be_kept_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Trial 18: a replica logged "lease keepalive failed" every 3.3 s for
    as long as etcd was away. Once at WARNING, then at DEBUG until it works
    again, which is said at INFO."""
    caplog.set_level(logging.DEBUG, "controlplane.registry")
    store = MemoryStore(clock=lambda: 0.0)  # the lease outlives the outage
    registry = ProxyRegistry(Catalog(store), "cp", lease_ttl=1)
    await registry.lease()
    keeping = asyncio.create_task(registry.keepalive())

    def tries() -> int:
        return sum("lease keepalive failed" in r.getMessage() for r in caplog.records)

    try:
        async with asyncio.timeout(10):
            store.available = False
            while tries() < 3:
                await asyncio.sleep(0.05)
            store.available = True
            while "lease keepalive works again" not in caplog.text:
                await asyncio.sleep(0.05)
    finally:
        keeping.cancel()
    levels = [r.levelname for r in caplog.records if "lease keepalive" in r.getMessage()]
    assert levels[0] == "WARNING" and set(levels[1:-1]) == {"DEBUG"} and levels[-1] == "INFO"


async def test_a_register_under_a_lease_that_expired_is_unavailable_and_renews_it() -> None:
    """Trial 22: after a replica stalled past its lease (SIGSTOP for 30 s),
    proxies' Register calls got INTERNAL, with a traceback logged, and 15 s
    later a warning of streams never opened. It is UNAVAILABLE (the proxy
    tries again), nothing of it is left, and the keepalive renews the lease
    at once rather than at its next beat."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0, lease_ttl=60)
    held = await registry.register("p-held", "eu", "127.0.0.1:1", "1")
    stale = await registry.lease()
    await catalog.store.revoke_lease(stale)  # the stall: the lease lapsed
    with pytest.raises(Unavailable, match="lease in etcd expired"):
        await registry.register("p-new", "eu", "127.0.0.1:2", "1")
    assert set(registry._unstreamed) == {held.session_id}  # p-new left nothing
    keeping = asyncio.create_task(registry.keepalive())  # its beat: 20 s
    try:
        async with asyncio.timeout(5):
            while registry._lease in (0, stale):
                await asyncio.sleep(0.01)
    finally:
        keeping.cancel()
    assert [p.name for p in await catalog.list_proxies()] == ["p-held"]  # rewritten
    again = await registry.register("p-new", "eu", "127.0.0.1:2", "1")
    assert again.name == "p-new"


async def test_a_route_stream_ends_when_its_proxys_certificate_expires(tmp_path: Path) -> None:
    """Trial 23: a connection outlived the certificate it was made with: a
    proxy whose certificate had expired kept its stream, and new tables,
    until the control plane restarted. A stream without one runs on."""
    bundle = make_bundle(tmp_path / "pki")
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(days=1), now + datetime.timedelta(seconds=2))
    add_client(bundle, "short", role="proxy", valid=valid)
    pem = Path(bundle.path("short.crt")).read_bytes()

    class CertifiedStream(EndingStream):
        def auth_context(self) -> dict[str, list[bytes]]:
            return {"x509_pem_cert": [pem]}

    registry = ProxyRegistry(Catalog(MemoryStore()), "cp", stream_grace=10.0)
    publisher = Publisher("cp")
    publisher.publish(table(1))
    routing = RoutingService(registry, publisher)
    short = await registry.register("p-short", "eu", "127.0.0.1:1", "1")
    plain = await registry.register("p-plain", "eu", "127.0.0.1:2", "1")
    stream = CertifiedStream()
    task = asyncio.create_task(routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
    await stream.requests.put(pb.RouteRequest(session_id=short.session_id))
    other, other_task = await open_stream(routing, plain.session_id)
    await asyncio.wait_for(task, 10)
    assert stream.code == grpc.StatusCode.UNAUTHENTICATED
    assert stream.details.startswith("the proxy's client certificate expired at ")
    assert not other_task.done()
    await other.requests.put(None)
    await asyncio.wait_for(other_task, 10)
