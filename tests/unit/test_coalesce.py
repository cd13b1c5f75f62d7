"""Coalescing: one origin call for identical concurrent misses; followers never hang."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dataplane.cache.coalesce import (
    Coalescer,
    FlightFailed,
    Follower,
    Leader,
)
from dataplane.cache.entry import CachedResponse, ResponseKind, StreamRecorder
from dataplane.streaming.sse import SseParser

CHUNKS = [f"data: {{'n': {i}}}\n\n".encode() for i in range(10)]
ENTRY = CachedResponse(kind=ResponseKind.CHAT, created_at=0, model="m", chunks=(b"{}",))


class Origin:
    """A fake origin call that streams CHUNKS with a pause between them."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def stream(self, leader: Leader) -> list[bytes]:
        self.calls += 1
        self.started.set()
        sent = []
        for c in CHUNKS:
            await self.release.wait()
            await asyncio.sleep(0.001)
            leader.chunk(c)
            sent.append(c)
        return sent


async def streaming_request(co: Coalescer, origin: Origin, key: str = "k") -> list[bytes]:
    flight = co.join(key)
    if isinstance(flight, Leader):
        with flight:
            sent = await origin.stream(flight)
            flight.finish(ENTRY)
            return sent
    with flight:
        return [c async for c in flight]


async def test_twenty_concurrent_misses_make_one_origin_call() -> None:
    co = Coalescer()
    origin = Origin()
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(streaming_request(co, origin) for _ in range(20)))
    assert origin.calls == 1
    assert all(r == CHUNKS for r in results)
    stats = co.stats
    assert (stats.flights, stats.followers, stats.in_flight) == (1, 19, 0)


async def test_non_streaming_followers_get_the_entry() -> None:
    co = Coalescer()
    leader = co.join("k")
    followers = [co.join("k") for _ in range(5)]
    assert isinstance(leader, Leader)
    assert all(isinstance(f, Follower) for f in followers)
    waiting = [asyncio.create_task(f.result()) for f in followers if isinstance(f, Follower)]
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in waiting)
    leader.chunk(b"data: x\n\n")
    leader.finish(ENTRY)
    async with asyncio.timeout(5):
        assert await asyncio.gather(*waiting) == [ENTRY] * 5


async def test_a_late_joiner_gets_the_buffered_chunks_then_the_live_ones() -> None:
    co = Coalescer()
    origin = Origin()
    origin.release.clear()
    lead = asyncio.create_task(streaming_request(co, origin))
    await origin.started.wait()
    origin.release.set()
    while len(co._flights["k"].chunks) < 4:
        await asyncio.sleep(0.001)
    late = co.join("k")
    assert isinstance(late, Follower)
    async with asyncio.timeout(5):
        got = [c async for c in late]
        assert got == CHUNKS == await lead
    # The flight has landed: the next miss starts a flight of its own.
    assert isinstance(co.join("k"), Leader)


async def test_a_cancelled_leader_fails_its_followers_instead_of_hanging() -> None:
    co = Coalescer()
    origin = Origin()
    origin.release.clear()
    lead = asyncio.create_task(streaming_request(co, origin))
    await origin.started.wait()
    waiting = asyncio.create_task(streaming_request(co, origin))
    non_streaming = co.join("k")
    assert isinstance(non_streaming, Follower)
    result = asyncio.create_task(non_streaming.result())
    await asyncio.sleep(0.01)
    lead.cancel()  # the leader's client went away
    async with asyncio.timeout(5):
        with pytest.raises(FlightFailed) as failed:
            await waiting
        assert failed.value.delivered == 0
        assert "cancelled" in failed.value.reason
        with pytest.raises(FlightFailed):
            await result
        with pytest.raises(asyncio.CancelledError):
            await lead
    assert origin.calls == 1
    assert co.stats.in_flight == 0


async def test_a_failure_mid_stream_tells_followers_how_much_they_had() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    leader.chunk(b"abc")
    leader.chunk(b"de")
    leader.finish(None, ConnectionResetError("origin cut"))
    got = []
    with pytest.raises(FlightFailed) as failed:
        async for c in follower:
            got.append(c)
    assert got == [b"abc", b"de"]
    assert failed.value.delivered == 5
    assert "ConnectionResetError" in failed.value.reason


async def test_a_complete_answer_that_was_not_kept() -> None:
    co = Coalescer()
    leader = co.join("k")
    streaming, plain = co.join("k"), co.join("k")
    assert isinstance(leader, Leader)
    assert isinstance(streaming, Follower) and isinstance(plain, Follower)
    leader.chunk(b"all of it")
    leader.finish(None)  # complete, but e.g. too large to keep
    # A streaming follower has every chunk and ends normally...
    assert [c async for c in streaming] == [b"all of it"]
    # ...a non-streaming one has nothing to answer with and makes its own call.
    with pytest.raises(FlightFailed) as failed:
        await plain.result()
    assert failed.value.delivered == 0


async def test_a_streaming_follower_of_a_non_streaming_leader_uses_the_entry() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    leader.finish(ENTRY)
    assert [c async for c in follower] == []
    assert follower.delivered == 0
    assert await follower.result() is ENTRY


async def test_leaving_the_block_without_an_outcome_fails_the_flight() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    with leader:
        pass
    assert leader.finished
    with pytest.raises(FlightFailed, match="LeaderGone"):
        await follower.result()
    with pytest.raises(RuntimeError):
        leader.chunk(b"late")
    leader.finish(ENTRY)  # ignored: the outcome is already known
    with pytest.raises(FlightFailed, match="LeaderGone"):  # the first outcome still
        await follower.result()


async def test_an_exception_in_the_leader_fails_the_flight() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    with pytest.raises(ValueError), leader:
        raise ValueError("bug")
    with pytest.raises(FlightFailed, match="ValueError: bug"):
        await follower.result()


async def test_past_the_buffer_bound_new_joiners_start_their_own_flight() -> None:
    co = Coalescer(max_buffer_bytes=100)
    leader = co.join("k")
    keeping_up = co.join("k")
    assert isinstance(leader, Leader) and isinstance(keeping_up, Follower)
    got: list[bytes] = []
    for i in range(10):
        leader.chunk(bytes([i]) * 30)
        got.append(await keeping_up.__anext__())
    # The flight stopped taking joiners and holds no more than the bound.
    assert co.stats.overflows == 1
    assert co._flights.get("k") is None
    assert leader._flight.buffered <= 100
    other = co.join("k")
    assert isinstance(other, Leader)
    other.finish(None)
    leader.finish(ENTRY)
    assert got == [bytes([i]) * 30 for i in range(10)]
    with pytest.raises(StopAsyncIteration):
        await keeping_up.__anext__()


async def test_a_follower_that_lags_past_the_bound_is_failed() -> None:
    co = Coalescer(max_buffer_bytes=100)
    leader = co.join("k")
    fast, slow = co.join("k"), co.join("k")
    assert isinstance(leader, Leader)
    assert isinstance(fast, Follower) and isinstance(slow, Follower)
    first = b"x" * 30
    leader.chunk(first)
    assert await slow.__anext__() == first
    assert await fast.__anext__() == first
    for _ in range(5):
        leader.chunk(b"y" * 30)
        await fast.__anext__()
    assert co.stats.lagged == 1
    with pytest.raises(FlightFailed) as failed:
        await slow.__anext__()
    assert failed.value.delivered == 30
    leader.finish(ENTRY)
    assert [c async for c in fast] == []


async def test_closed_followers_do_not_hold_the_buffer() -> None:
    co = Coalescer(max_buffer_bytes=100)
    leader = co.join("k")
    gone = co.join("k")
    assert isinstance(leader, Leader) and isinstance(gone, Follower)
    with gone:
        pass
    for _ in range(10):
        leader.chunk(b"z" * 30)
    assert co.stats.lagged == 0
    assert leader._flight.buffered <= 100
    with pytest.raises(RuntimeError):
        await gone.__anext__()
    leader.finish(ENTRY)


async def test_different_keys_fly_apart() -> None:
    co = Coalescer()
    origin = Origin()
    async with asyncio.timeout(5):
        await asyncio.gather(
            streaming_request(co, origin, "a"),
            streaming_request(co, origin, "b"),
            streaming_request(co, origin, "a"),
        )
    assert origin.calls == 2


def test_coalescer_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Coalescer(max_buffer_bytes=0)


async def test_a_relayed_stream_is_recorded_and_published() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    recorder = StreamRecorder()
    parser = SseParser()
    raw = (
        b'data: {"object":"chat.completion.chunk","id":"1","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    for piece in (raw[:20], raw[20:]):  # as the relay hands them on
        for ev in parser.feed(piece):
            recorder.event(ev)
        leader.chunk(piece)
    entry = recorder.finish(now=0, open_event=parser.close())
    assert entry is not None
    leader.finish(entry)
    assert b"".join([c async for c in follower]) == raw
    assert await follower.result() is entry


async def test_a_leader_knows_whether_followers_are_there() -> None:
    co = Coalescer()
    leader = co.join("k")
    assert isinstance(leader, Leader)
    seen = [leader.followed]
    streaming, waiting = co.join("k"), co.join("k")
    assert isinstance(streaming, Follower) and isinstance(waiting, Follower)
    seen.append(leader.followed)
    result = asyncio.create_task(waiting.result())  # no longer iterates, still there
    await asyncio.sleep(0)
    streaming.leave()
    streaming.leave()  # once only
    seen.append(leader.followed)
    result.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await result
    with waiting:  # its request's end
        pass
    seen.append(leader.followed)
    assert seen == [False, True, True, False]


def test_the_last_follower_leaving_tells_the_leader_once() -> None:
    co = Coalescer()
    leader = co.join("k")
    first, second = co.join("k"), co.join("k")
    assert isinstance(leader, Leader)
    assert isinstance(first, Follower) and isinstance(second, Follower)
    told: list[str] = []
    leader.when_deserted(lambda: told.append("deserted"))
    first.leave()
    assert told == []
    second.leave()
    second.leave()
    assert told == ["deserted"]
    # Nobody there: told at once.
    leader.when_deserted(lambda: told.append("at once"))
    assert told == ["deserted", "at once"]


def test_followers_leaving_after_the_outcome_tell_nobody() -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    told: list[str] = []
    leader.when_deserted(lambda: told.append("deserted"))
    leader.finish(ENTRY)
    follower.leave()
    leader.when_deserted(lambda: told.append("after"))
    assert told == []


@pytest.mark.parametrize(
    ("error", "left"),
    [(asyncio.CancelledError(), True), (RuntimeError("origin 502"), False), (None, False)],
    ids=["cancelled", "failed", "answered"],
)
def test_followers_know_whether_their_leader_left(error: BaseException | None, left: bool) -> None:
    co = Coalescer()
    leader = co.join("k")
    follower = co.join("k")
    assert isinstance(leader, Leader) and isinstance(follower, Follower)
    assert not follower.leader_left  # nothing is known before the outcome
    leader.finish(ENTRY if error is None else None, error)
    assert follower.leader_left is left
    # The key is free again: the first to join once more leads a new flight.
    assert isinstance(co.join("k"), Leader)


def test_the_leader_is_told_of_each_follower_that_joins() -> None:
    co = Coalescer()
    leader = co.join("k")
    assert isinstance(leader, Leader)
    joined: list[bool] = []
    leader.when_joined(lambda: joined.append(leader.followed))
    co.join("k")
    co.join("k")
    assert joined == [True, True]  # after each had joined
