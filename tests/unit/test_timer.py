"""LazyTimer (dataplane/timer.py) on a loop whose clock and timers the test drives."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import pytest

from dataplane.timer import TIMER_GRAIN, LazyTimer


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self._when = when
        self.callback = callback
        self.cancelled = False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """time() and call_at(), and nothing runs until the test says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.started: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(when, callback)
        self.started.append(timer)
        return timer

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.started if not t.cancelled]

    def fire(self, timer: FakeTimer) -> None:
        """Run `timer` at its time, as the loop would (a cancelled one never runs)."""
        assert not timer.cancelled
        self.now = max(self.now, timer.when())
        timer.cancelled = True  # done: no longer pending
        timer.callback()


@pytest.fixture
def loop() -> FakeLoop:
    return FakeLoop()


def make(loop: FakeLoop) -> tuple[LazyTimer, list[float]]:
    fired: list[float] = []
    timer = LazyTimer(cast(asyncio.AbstractEventLoop, loop))
    return timer, fired


def test_a_deadline_that_passes_runs_its_callback_once(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    timer.arm(10.0, lambda: fired.append(loop.now))
    [t] = loop.pending()
    assert t.when() == 110.0
    loop.fire(t)
    assert fired == [110.0]
    assert not timer.armed
    assert loop.pending() == []


def test_arming_again_later_moves_the_deadline_on_the_same_timer(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    for step in range(5):  # five requests on one connection, 1 s apart
        loop.now = 100.0 + step
        timer.arm(10.0, lambda: fired.append(loop.now))
        timer.disarm()  # each request's head arrived in time
    timer.arm(10.0, lambda: fired.append(loop.now))  # the sixth is under way
    assert len(loop.started) == 1  # one timer started in all
    [t] = loop.pending()
    loop.fire(t)  # at 110: early for the deadline now running (104 + 10)
    assert fired == []
    [again] = loop.pending()
    assert again.when() == 114.0
    loop.fire(again)
    assert fired == [114.0]


def test_a_disarmed_deadline_never_runs_and_its_timer_ends(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    timer.arm(10.0, lambda: fired.append(loop.now))
    timer.disarm()
    assert not timer.armed
    [t] = loop.pending()
    loop.fire(t)
    assert fired == []
    assert loop.pending() == []  # nothing re-armed for a deadline that is gone


def test_a_shorter_deadline_replaces_a_timer_due_after_it(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    timer.arm(30.0, lambda: fired.append(-1.0))  # a body's deadline
    timer.arm(10.0, lambda: fired.append(loop.now))  # then a head's, shorter
    first, second = loop.started
    assert first.cancelled
    assert second.when() == 110.0
    loop.fire(second)
    assert fired == [110.0]  # the later arm's callback, at its own time


def test_a_timer_a_grain_early_is_on_time(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    timer.arm(10.0, lambda: fired.append(loop.now))
    [t] = loop.pending()
    loop.now = 110.0 - TIMER_GRAIN / 2  # uvloop's millisecond rounding
    t.cancelled = True
    t.callback()
    assert fired == [110.0 - TIMER_GRAIN / 2]
    assert loop.pending() == []


def test_close_cancels_the_timer(loop: FakeLoop) -> None:
    timer, fired = make(loop)
    timer.arm(10.0, lambda: fired.append(loop.now))
    timer.close()
    assert loop.pending() == []
    assert not timer.armed
    assert fired == []


async def test_on_a_real_loop_the_deadline_passes() -> None:
    loop = asyncio.get_running_loop()
    passed = loop.create_future()
    timer = LazyTimer(loop)
    timer.arm(0.01, lambda: passed.set_result(loop.time()))
    armed_at = loop.time()
    async with asyncio.timeout(5.0):
        at = await passed
    assert at >= armed_at + 0.01 - TIMER_GRAIN
