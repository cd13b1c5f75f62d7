"""reply.LeaderStream under the relay, without HTTP: a flight leader's client
gone mid-stream ends the relay unless followers are there, who then get the
origin's stream to its end; once followed, a slow client neither paces the
relay nor holds more than the flight's bound, past which it is cut."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from dataplane.cache.coalesce import Coalescer, Follower, Leader
from dataplane.http.errors import stream_broken_event
from dataplane.http.reply import LeaderStream
from dataplane.streaming.relay import RelayEnd, relay

T = TypeVar("T")

CHUNKS = [b"data: %d\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


class Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class Client:
    """Takes `takes` writes, then is gone (aiohttp's ConnectionResetError)."""

    def __init__(self, takes: int) -> None:
        self.takes = takes
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if len(self.written) == self.takes:
            raise ConnectionResetError("Cannot write to closing transport")
        self.written.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(b"<eof>")


class Stalled:
    """A client that takes nothing until the test lets it (`take`): each
    write waits for it, as aiohttp's does for a full socket."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.taking = asyncio.Event()

    def take(self) -> None:
        self.taking.set()

    async def write(self, data: bytes) -> None:
        await self.taking.wait()
        self.written.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(b"<eof>")


def at_once(coro: Coroutine[Any, Any, T]) -> T:
    """What `coro` returns, which it must without waiting for anything (one
    step: no await of it suspends); AssertionError if it would wait."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("it waited")


def flight(followers: int, max_buffer_bytes: int = 4 << 20) -> tuple[Leader, list[Follower]]:
    co = Coalescer(max_buffer_bytes=max_buffer_bytes)
    leader = co.join("k")
    assert isinstance(leader, Leader)
    joined = [co.join("k") for _ in range(followers)]
    assert all(isinstance(f, Follower) for f in joined)
    return leader, [f for f in joined if isinstance(f, Follower)]


def stream_of(leader: Leader, client: Client | Stalled, stops: list[str]) -> LeaderStream:
    lead = LeaderStream(leader, lambda: stops.append("stop"))
    lead.out = client  # type: ignore[assignment]  # a stand-in for aiohttp's
    return lead


async def test_a_client_gone_with_a_follower_there_leaves_the_relay_going() -> None:
    leader, [follower] = flight(1)
    client, stops = Client(takes=2), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    await lead.drained()  # followed: the relay only queued its writes
    assert (end.complete, end.client_gone, lead.gone) == (True, False, True)
    assert client.written == CHUNKS[:2]  # nothing after it was found gone
    leader.finish(None)
    assert [c async for c in follower] == CHUNKS  # every chunk, the end included
    assert stops == []


async def test_a_client_gone_at_the_streams_end_had_the_whole_answer() -> None:
    # It closed once it had [DONE] (the openai SDK does), before the end could be written.
    for followers in (0, 1):
        leader, _ = flight(followers)
        client, stops = Client(takes=len(CHUNKS)), list[str]()
        lead = stream_of(leader, client, stops)
        end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
        await lead.drained()
        assert (end.complete, end.client_gone, lead.gone) == (True, False, False)
        assert (lead.delivered, lead.failed) == (True, False)
        assert client.written == CHUNKS


async def test_a_client_gone_with_nobody_following_ends_the_relay() -> None:
    leader, _ = flight(0)
    client, stops = Client(takes=2), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    assert (end.complete, end.client_gone) == (False, True)
    assert stops == []


async def test_the_last_follower_leaving_after_the_client_stops_the_relay() -> None:
    leader, [follower] = flight(1)
    client, stops = Client(takes=0), list[str]()
    lead = stream_of(leader, client, stops)
    await lead.write(CHUNKS[0])  # found gone: dropped, for the follower
    await lead.drained()
    assert (lead.gone, stops) == (True, [])
    follower.leave()
    assert stops == ["stop"]


async def test_the_last_follower_leaving_after_the_stream_ended_stops_nothing() -> None:
    # The whole answer is relayed; its storing (which may wait for the
    # region's Redis) must not be cancelled by the last follower leaving then.
    leader, [follower] = flight(1)
    client, stops = Client(takes=0), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    await lead.drained()
    assert (end.complete, lead.gone, lead.ended) == (True, True, True)
    follower.leave()
    assert stops == []


async def test_once_followed_the_relay_never_waits_for_a_client_that_takes_nothing() -> None:
    # A trial: a leader's client that did not read held its fast follower for
    # the whole --send-timeout; the relay now waits only for the origin.
    leader, [follower] = flight(1)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    end: RelayEnd = at_once(relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader))
    assert (end.complete, lead.ended, lead.gone) == (True, True, False)
    leader.finish(None)
    assert [c async for c in follower] == CHUNKS  # [DONE] with the client still stalled
    assert client.written == []
    client.take()
    await lead.drained()
    assert client.written == [*CHUNKS, b"<eof>"]  # all of it, in order, then the end
    assert (lead.delivered, lead.queued_bytes, stops) == (True, 0, [])


async def test_with_nobody_following_a_slow_client_paces_the_relay() -> None:
    leader, _ = flight(0)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    write = lead.write(CHUNKS[0])
    try:
        at_once(write)
        raise AssertionError("a write of a lone leader did not wait for its client")
    except AssertionError as exc:
        assert str(exc) == "it waited"


async def test_a_client_behind_by_more_than_the_flights_bound_is_cut() -> None:
    bound = 1000  # the error event's few hundred bytes fit
    leader, [follower] = flight(1, max_buffer_bytes=bound)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    events = [b"data: %d%s\n\n" % (i, b"x" * 90) for i in range(20)]
    at_once(lead.write(events[0]))
    await asyncio.sleep(0)  # the writer takes it to the client, which takes nothing
    for data in events[1:]:
        at_once(lead.write(data))  # never waits
        assert lead.queued_bytes <= bound
    # Past the bound: what was queued dropped, its error event queued instead,
    # and nothing more of the flight's; the flight goes on.
    assert (lead.lagged, lead.gone) == (True, True)
    assert not lead.let_go.done()
    at_once(lead.write(b"data: more\n\n"))  # dropped: the follower has it
    client.take()
    await asyncio.wait((lead.let_go,))
    await lead.drained()
    # What it took before the cut (the first write, under way), its ending
    # (the lagging follower's), its stream's end.
    assert client.written == [events[0], stream_broken_event(), b"<eof>"]
    assert (lead.delivered, lead.failed, stops) == (True, False, [])
    follower.leave()  # the last follower leaving stops the relay, the client being cut
    assert stops == ["stop"]


async def test_a_client_caught_up_after_its_followers_left_paces_the_relay_again() -> None:
    leader, [follower] = flight(1)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    at_once(lead.write(CHUNKS[0]))
    follower.leave()
    write = asyncio.ensure_future(lead.write(CHUNKS[1]))
    await asyncio.sleep(0)
    assert not write.done()  # waits for what is queued to be written
    client.take()
    await write
    assert client.written == CHUNKS[:2]


async def test_a_follower_joining_while_the_relay_waits_for_its_client_ends_that_wait() -> None:
    co = Coalescer()
    leader = co.join("k")
    assert isinstance(leader, Leader)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    lead.release = client.take  # the edge's: the write's wait ends, its bytes kept
    relaying = asyncio.ensure_future(relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader))
    await asyncio.sleep(0)
    assert not relaying.done()  # alone: the relay waits for its client
    follower = co.join("k")
    assert isinstance(follower, Follower)
    async with asyncio.timeout(10):  # else it waits for the client for ever
        end = await relaying  # the rest queued: nothing more waited for
    assert end.complete
    leader.finish(None)
    assert [c async for c in follower] == CHUNKS


async def test_a_follower_joining_while_the_relay_waits_for_the_queue_ends_that_wait() -> None:
    # Review r4: its followers gone, the relay waited for the queue to be
    # written; a follower joining then was held by the leader's client (for
    # the whole --send-timeout, one that takes nothing). The join ends it.
    co = Coalescer()
    leader = co.join("k")
    assert isinstance(leader, Leader)
    first = co.join("k")
    assert isinstance(first, Follower)
    client, stops = Stalled(), list[str]()
    lead = stream_of(leader, client, stops)
    at_once(lead.write(CHUNKS[0]))  # followed: queued, the writer waits for the client
    first.leave()
    write = asyncio.ensure_future(lead.write(CHUNKS[1]))
    await asyncio.sleep(0)
    assert not write.done()  # unfollowed: waits for the queue
    second = co.join("k")
    assert isinstance(second, Follower)
    async with asyncio.timeout(10):  # else it waits for the client for ever
        await write
    at_once(lead.write(CHUNKS[2]))  # followed again: queued
    assert client.written == []
    client.take()
    await lead.drained()
    assert client.written == CHUNKS[:3]
    second.leave()


class Tasks:
    """Counts the tasks the loop makes (a task factory) while in use."""

    def __init__(self) -> None:
        self.made = 0

    def __enter__(self) -> Tasks:
        loop = asyncio.get_running_loop()

        def factory(
            loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
        ) -> asyncio.Task[Any]:
            self.made += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.get_running_loop().set_task_factory(None)


class Fast:
    """Takes every write at once, noting which task wrote it."""

    def __init__(self) -> None:
        self.by: list[asyncio.Task[Any] | None] = []

    async def write(self, data: bytes) -> None:
        self.by.append(asyncio.current_task())

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(data)


async def test_a_followed_stream_has_one_writer_for_all_its_writes() -> None:
    # Review r4: a task per write (or burst) cost 3.3 us a chunk; one writer,
    # parked between writes, takes them all.
    leader, [follower] = flight(1)
    client = Fast()
    lead = LeaderStream(leader, lambda: None)
    lead.out = client  # type: ignore[assignment]
    with Tasks() as tasks:
        for data in CHUNKS:
            at_once(lead.write(data))
            await asyncio.sleep(0)  # as the relay's read of the origin yields
        await lead.write_eof()
        await lead.drained()
    assert tasks.made == 1
    assert len(client.by) == len(CHUNKS) + 1
    assert len(set(client.by)) == 1 and client.by[0] is not asyncio.current_task()
    follower.leave()


async def test_once_unfollowed_and_written_the_relay_writes_its_client_itself() -> None:
    # Review r4: once its followers had left, each write went through a new
    # writer task and an asyncio.wait (13.9 us a chunk) to the stream's end.
    leader, [follower] = flight(1)
    client = Fast()
    lead = LeaderStream(leader, lambda: None)
    lead.out = client  # type: ignore[assignment]
    at_once(lead.write(CHUNKS[0]))  # queued, for the writer
    await lead.drained()
    follower.leave()
    relay_task = asyncio.current_task()
    with Tasks() as tasks:
        for data in CHUNKS[1:]:
            await lead.write(data)
            await asyncio.sleep(0)
        await lead.write_eof()
    assert tasks.made == 0
    assert client.by[0] is not relay_task  # the writer's
    assert client.by[1:] == [relay_task] * len(CHUNKS)  # the relay's own, its end too
    assert lead.delivered
    lead.close()
