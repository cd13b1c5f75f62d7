"""HeldHead (dataplane.http.hold): the head and keep-alives of a stream
sent while its origin thinks, and how they stop."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from aiohttp import web

from dataplane.http.hold import KEEP_ALIVE, HeldHead, Holds
from tests.unit.test_timer import FakeLoop


class Head(web.StreamResponse):
    """A response that records its writes; one write of `stuck` never ends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()
        self.writes: list[bytes] = []
        self.stuck = asyncio.Event()  # never set

    @property
    def prepared(self) -> bool:
        return self.sent.is_set()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await self.stuck.wait()


async def sent_head(head: Head) -> HeldHead:
    async def prepare(out: web.StreamResponse) -> None:
        head.sent.set()

    held = HeldHead(0, lambda: head, prepare)
    async with asyncio.timeout(5):  # a bound on a broken test
        await head.sent.wait()
        while not head.writes:
            await asyncio.sleep(0)
    return held


async def test_stop_returns_the_sent_head_after_its_keep_alive() -> None:
    head = Head()
    held = await sent_head(head)
    assert await held.stop() is head
    assert head.writes == [KEEP_ALIVE]


async def test_a_head_not_sent_is_none_and_no_timer_is_left() -> None:
    made: list[int] = []

    async def prepare(out: web.StreamResponse) -> None:
        made.append(1)

    held = HeldHead(3600, Head, prepare)
    assert await held.stop() is None and made == []


async def test_a_caller_cancelled_while_it_stops_the_head_stays_cancelled() -> None:
    """The handler's cancellation (its client left) during `stop` is its own,
    not the head task's, and must not be swallowed with it."""
    head = Head()
    held = await sent_head(head)
    stopping = asyncio.create_task(held.stop())
    await asyncio.sleep(0)  # it waits for the head's task
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping


async def test_a_head_sent_already_goes_on_with_its_comments_and_is_not_sent_again() -> None:
    """Review 314: a coalesced follower whose flight failed before an event
    had its head and then nothing while its own call thought: an
    intermediary's read timeout cut it."""
    head = Head()
    head.sent.set()  # an earlier hold's
    made: list[int] = []

    def make() -> web.StreamResponse:
        made.append(1)
        return Head()

    async def prepare(out: web.StreamResponse) -> None:
        made.append(2)

    # Stopped before its first comment: the head is still the one sent.
    assert await HeldHead(3600, make, prepare, every_s=3600, sent=head).stop() is head
    held = HeldHead(3600, make, prepare, every_s=0, sent=head)
    async with asyncio.timeout(5):  # a bound on a broken test
        while not head.writes:
            await asyncio.sleep(0)
    assert await held.stop() is head
    assert head.writes == [KEEP_ALIVE] and made == []


async def test_heads_on_shared_holds_commit_in_turn_and_a_stopped_one_never() -> None:
    holds = Holds(0)
    first, second = Head(), Head()
    made: list[Head] = []

    async def prepare(out: web.StreamResponse) -> None:
        assert isinstance(out, Head)
        made.append(out)
        out.sent.set()

    stopped = HeldHead(0, lambda: first, prepare, holds=holds)
    held = HeldHead(0, lambda: second, prepare, holds=holds)
    assert len(holds) == 2
    assert await stopped.stop() is None and len(holds) == 1
    async with asyncio.timeout(5):  # a bound on a broken test
        await second.sent.wait()
    assert made == [second] and len(holds) == 0
    held.abandon()
    # The timer found the queue empty after: a head held later gets it again.
    third = Head()
    later = HeldHead(0, lambda: third, prepare, holds=holds)
    async with asyncio.timeout(5):
        await third.sent.wait()
    assert made == [second, third]
    later.abandon()


async def test_a_head_stopped_within_its_shared_hold_leaves_nothing_held() -> None:
    holds = Holds(3600)
    made: list[int] = []

    async def prepare(out: web.StreamResponse) -> None:
        made.append(1)

    held = HeldHead(3600, Head, prepare, holds=holds)
    assert len(holds) == 1
    assert await held.stop() is None
    assert len(holds) == 0 and made == []
    # A hold of another length (a follower's head sent already) keeps its own timer.
    other = HeldHead(60, Head, prepare, holds=holds)
    assert len(holds) == 0
    other.abandon()


class Committed:
    """A held head as Holds sees it: what it commits, at which loop time."""

    def __init__(self, loop: FakeLoop, log: list[tuple[str, float]], name: str) -> None:
        self._loop, self._log, self.name = loop, log, name

    def commit(self) -> None:
        self._log.append((self.name, self._loop.now))


def test_each_shared_hold_ends_at_its_own_deadline_after_the_first_leaves() -> None:
    """On a clock the test drives: the timer armed for the first head finds it
    gone and waits for the next one's deadline (neither committing it then,
    early, nor a hold later); an empty queue arms the timer again."""
    loop = FakeLoop()  # now 100.0
    holds = Holds(1.0, cast(asyncio.AbstractEventLoop, loop))
    log: list[tuple[str, float]] = []

    def head(name: str) -> HeldHead:
        made = cast(HeldHead, Committed(loop, log, name))
        holds.add(made)
        return made

    first = head("first")  # due 101.0
    loop.now = 100.5
    head("second")  # due 101.5
    holds.remove(first)
    [timer] = loop.pending()
    loop.fire(timer)  # 101.0: the first is gone, the second not due
    assert log == [] and len(holds) == 1
    [timer] = loop.pending()
    assert timer.when() == 101.5
    loop.fire(timer)
    assert log == [("second", 101.5)] and len(holds) == 0 and loop.pending() == []
    loop.now = 102.0
    head("third")
    [timer] = loop.pending()
    loop.fire(timer)
    assert log == [("second", 101.5), ("third", 103.0)]
