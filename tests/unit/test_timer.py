"""LazyTimer and Deadlines (dataplane/timer.py) on a loop whose clock and timers
the test drives; Deadlines' cancellation contract on a real loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import pytest

from dataplane.timer import TIMER_GRAIN, Deadlines, IdleTimeout, LazyTimer


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


# ---------------------------------------------------------------- Deadlines


class FakeTask:
    """What a Bound uses of a task: cancel, cancelling, uncancel."""

    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> bool:
        self.cancels += 1
        return True

    def cancelling(self) -> int:
        return self.cancels

    def uncancel(self) -> int:
        self.cancels -= 1
        return self.cancels


def deadlines_on(loop: FakeLoop) -> Deadlines:
    return Deadlines(cast(asyncio.AbstractEventLoop, loop))


def task() -> asyncio.Task[object]:
    return cast("asyncio.Task[object]", FakeTask())


def cancels(t: asyncio.Task[object]) -> int:
    return cast(FakeTask, t).cancels


def test_deadlines_set_in_order_share_one_timer_and_pass_in_order(loop: FakeLoop) -> None:
    deadlines = deadlines_on(loop)
    tasks = [task() for _ in range(3)]
    bounds = [deadlines.bound(t, 110.0 + i) for i, t in enumerate(tasks)]
    assert len(loop.started) == 1  # one timer, for the first
    bounds[0].__exit__(None, None, None)  # the first call answered in time
    assert len(deadlines) == 2
    [t] = loop.pending()
    loop.fire(t)  # at 110: nothing is due yet; it waits for the next, at 111
    assert [cancels(t) for t in tasks] == [0, 0, 0]
    [t] = loop.pending()
    assert t.when() == 111.0
    loop.fire(t)
    assert [cancels(t) for t in tasks] == [0, 1, 0]
    [t] = loop.pending()
    loop.fire(t)
    assert [cancels(t) for t in tasks] == [0, 1, 1]
    assert loop.pending() == []
    assert len(deadlines) == 0


def test_a_deadline_earlier_than_one_kept_gets_its_own_timer(loop: FakeLoop) -> None:
    deadlines = deadlines_on(loop)
    late, early = task(), task()
    deadlines.bound(late, 130.0)
    deadlines.bound(early, 105.0)  # a call that waited for another one first
    shared, own = loop.started
    assert (shared.when(), own.when()) == (130.0, 105.0)
    loop.fire(own)
    assert (cancels(late), cancels(early)) == (0, 1)
    assert not shared.cancelled


def test_an_own_timer_is_cancelled_when_its_call_ends_in_time(loop: FakeLoop) -> None:
    deadlines = deadlines_on(loop)
    deadlines.bound(task(), 130.0)
    bound = deadlines.bound(task(), 105.0)
    bound.__exit__(None, None, None)
    _, own = loop.started
    assert own.cancelled


def test_when_every_call_has_ended_the_timer_finds_nothing(loop: FakeLoop) -> None:
    deadlines = deadlines_on(loop)
    t = task()
    with deadlines.bound(t, 110.0):
        pass
    [timer] = loop.pending()
    loop.fire(timer)
    assert cancels(t) == 0
    assert loop.pending() == []
    assert len(deadlines) == 0


def test_a_deadline_is_never_passed_early(loop: FakeLoop) -> None:
    # LazyTimer takes a timer up to a grain early as on time; a call's deadline
    # must still not be cancelled before it (the traced path reads the clock).
    deadlines = deadlines_on(loop)
    t = task()
    deadlines.bound(t, 110.0005)
    [timer] = loop.pending()
    loop.now = 110.0  # uvloop's milliseconds: the timer fires in the 110th
    timer.cancelled = True
    timer.callback()
    assert cancels(t) == 0
    [again] = loop.pending()
    assert again.when() == 110.0 + TIMER_GRAIN  # not within a grain of now (see IdleTimeout)
    loop.fire(again)
    assert cancels(t) == 1


async def test_a_call_past_its_deadline_ends_in_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    current = asyncio.current_task()
    assert current is not None
    with pytest.raises(TimeoutError), deadlines.bound(current, loop.time() + 0.01):
        await asyncio.sleep(5.0)
    assert current.cancelling() == 0  # the deadline's cancel was taken back
    assert len(deadlines) == 0


async def test_a_call_cancelled_from_elsewhere_stays_cancelled() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    started = asyncio.Event()

    async def call() -> None:
        current = asyncio.current_task()
        assert current is not None
        with deadlines.bound(current, loop.time() + 60.0):
            started.set()
            await asyncio.sleep(5.0)

    running = asyncio.ensure_future(call())
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert len(deadlines) == 0


# ---------------------------------------------------------------- IdleTimeout


def idle_on(loop: FakeLoop, delay: float = 10.0) -> tuple[IdleTimeout, FakeTask]:
    task = FakeTask()
    idle = IdleTimeout(
        delay,
        task=cast("asyncio.Task[object]", task),
        loop=cast("asyncio.AbstractEventLoop", loop),
    )
    return idle, task


def test_many_waits_start_one_timer(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    for _ in range(100):  # a stream's chunks, each read in a block
        with idle:
            loop.now += 0.5
    assert len(loop.started) == 1
    assert task.cancels == 0
    idle.close()
    assert loop.pending() == []


def test_a_wait_past_the_delay_cancels_the_task_once(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    with pytest.raises(TimeoutError), idle:
        loop.fire(loop.pending()[0])  # at 110.0: 10 s without a chunk
        assert task.cancels == 1
        raise asyncio.CancelledError  # what the cancelled await raises
    assert task.cancelling() == 0  # the timeout's cancel was taken back


def test_the_timer_of_an_earlier_wait_waits_again_for_the_running_one(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    with idle:  # deadline 110.0
        loop.now = 105.0
    with idle:  # deadline 115.0, on the timer started for 110.0
        timer = loop.pending()[0]
        loop.fire(timer)
        assert task.cancels == 0
        (again,) = loop.pending()
        assert again.when() == 115.0
    idle.close()


def test_a_wait_is_never_cut_before_its_deadline(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    with pytest.raises(TimeoutError), idle:  # deadline 110.0
        timer = loop.pending()[0]
        loop.now = 110.0 - TIMER_GRAIN / 2  # LazyTimer takes this as on time
        timer.cancelled = True
        timer.callback()
        assert task.cancels == 0
        (again,) = loop.pending()
        # Not at 110.0, half a grain on: uvloop would run it at once, with its
        # clock still short of the deadline, over and over until it ticked.
        assert again.when() == loop.now + TIMER_GRAIN
        loop.fire(again)
        assert task.cancels == 1
        raise asyncio.CancelledError  # what the cancelled await raises
    assert task.cancelling() == 0


def test_a_timer_that_fires_between_waits_finds_nothing(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    with idle:
        pass
    loop.now = 200.0
    loop.fire(loop.pending()[0])
    assert task.cancels == 0


def test_a_cap_cuts_a_wait_running_longer_than_it_at_once(loop: FakeLoop) -> None:
    idle, task = idle_on(loop, delay=60.0)
    with pytest.raises(TimeoutError), idle:  # deadline 160.0
        loop.now = 107.0
        idle.cap(5.0)  # the wait started at 100.0: 5 s are past
        assert idle.capped and idle.delay == 5.0
        due = min(t.when() for t in loop.pending())
        assert due == 105.0  # in the past: the loop runs it at its next turn
        loop.fire(next(t for t in loop.pending() if t.when() == due))
        assert task.cancels == 1
        raise asyncio.CancelledError
    assert task.cancelling() == 0


def test_a_cap_bounds_the_running_wait_from_its_start_and_the_next_ones(loop: FakeLoop) -> None:
    idle, task = idle_on(loop, delay=60.0)
    with idle:  # deadline 160.0
        loop.now = 102.0
        idle.cap(5.0)  # now due at 105.0
        loop.now = 104.0
    with pytest.raises(TimeoutError), idle:  # due at 109.0, not 164.0
        first = min(loop.pending(), key=lambda t: t.when())
        loop.fire(first)  # the timer for 105.0 waits again
        assert task.cancels == 0
        (again,) = loop.pending()
        assert again.when() == 109.0
        loop.fire(again)
        assert task.cancels == 1
        raise asyncio.CancelledError
    idle.close()


def test_a_cap_over_the_delay_changes_nothing_and_lifting_it_restores_the_delay(
    loop: FakeLoop,
) -> None:
    idle, task = idle_on(loop, delay=10.0)
    idle.cap(30.0)
    assert not idle.capped and idle.delay == 10.0
    with idle:  # deadline 110.0
        idle.cap(2.0)  # due at 102.0
        loop.now = 101.0
        idle.cap(None)  # due at 110.0 again: the timer for 102.0 waits again
        loop.fire(min(loop.pending(), key=lambda t: t.when()))
        assert task.cancels == 0
        assert [t.when() for t in loop.pending()] == [110.0]
    assert not idle.capped and idle.delay == 10.0
    idle.cap(2.0)  # between waits: the next one is bounded by it
    with idle:
        assert [t.when() for t in loop.pending()] == [loop.now + 2.0]
    idle.close()


def cut_at(loop: FakeLoop, task: FakeTask) -> float:
    """Run the timers until the task is cancelled; when that was."""
    while not task.cancels:
        loop.fire(min(loop.pending(), key=lambda t: t.when()))
    return loop.now


def test_after_progress_waits_without_it_are_bounded_together(loop: FakeLoop) -> None:
    # A stream's event, then reads of comments only, 4 s apart each: the
    # bound counts from the first read after the event (trial 65: comments
    # every second held a stalled stream 11 minutes).
    idle, task = idle_on(loop)
    with idle:  # before any progress: each wait from its own start
        loop.now = 105.0
    with idle:
        loop.now = 109.0
    idle.progress()  # the read brought an event
    with idle:  # from 109.0: due at 119.0
        loop.now = 113.0
    said = [idle.without_progress]  # of the first wait since the event: no
    with idle:
        loop.now = 117.0
    with pytest.raises(TimeoutError), idle:  # entered at 117.0, due at 119.0 all the same
        assert cut_at(loop, task) == 119.0
        raise asyncio.CancelledError
    said.append(idle.without_progress)  # of one after comments: yes
    assert said == [False, True]
    idle.close()


def test_progress_starts_the_bound_over(loop: FakeLoop) -> None:
    idle, task = idle_on(loop)
    idle.progress()
    with idle:  # due at 110.0
        loop.now = 108.0
    idle.progress()
    with idle:
        loop.now = 115.0
    with pytest.raises(TimeoutError), idle:
        assert cut_at(loop, task) == 118.0
        raise asyncio.CancelledError
    idle.close()


async def test_on_a_real_loop_a_stalled_wait_ends_in_timeout_error() -> None:
    idle = IdleTimeout(0.01)
    current = asyncio.current_task()
    assert current is not None
    with pytest.raises(TimeoutError), idle:
        await asyncio.sleep(5.0)
    assert current.cancelling() == 0
    with idle:  # reusable after a timeout
        await asyncio.sleep(0)
    idle.close()


async def test_an_idle_wait_cancelled_from_elsewhere_stays_cancelled() -> None:
    started = asyncio.Event()

    async def wait() -> None:
        idle = IdleTimeout(60.0)
        try:
            with idle:
                started.set()
                await asyncio.sleep(5.0)
        finally:
            idle.close()

    running = asyncio.ensure_future(wait())
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
