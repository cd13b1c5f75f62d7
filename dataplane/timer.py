"""A deadline that moves on often and rarely passes, kept on one reusable timer.

A connection's deadlines (a request head's, a body's, an origin's next byte's)
are set and cleared once or twice per request and almost never pass. Under
uvloop, starting and cancelling a timer costs about 3 us; a request that did
that for each of its deadlines paid more for the timers than for most of its
own steps. `LazyTimer` keeps one timer per owner instead: arming moves the
deadline, and a timer that fires before the deadline now running waits again
for it; one due after it is replaced. A busy connection's timer wakes up about
once per deadline period, whatever its request rate.

`Deadlines` does the same for the deadlines of many tasks (a proxy's origin
calls, all bounded by the same request deadline): `asyncio.timeout` starts
and cancels a timer per call and looks the running loop up twice (each a
getpid system call on Python 3.11), about 6 to 14 us per call under load.

`IdleTimeout` is one task's `asyncio.timeout(delay)` around each of many
waits (a stream relay's reads, one per chunk), on one LazyTimer: a stream of
N chunks starts and cancels one timer instead of N.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Final

__all__ = [
    "TIMER_GRAIN",
    "Bound",
    "Deadlines",
    "IdleTimeout",
    "LazyTimer",
    "cut_by_bound",
    "not_before_a_grain",
]

# uvloop's clock and timers count whole milliseconds: a timer may fire up to
# one early by loop.time(), which is then taken as on time.
TIMER_GRAIN: Final = 0.001


class LazyTimer:
    """At most one deadline at a time: `late` runs once at `delay` seconds after
    `arm`, unless `disarm` or another `arm` came first.

    Used from its loop's thread only. `close` cancels the timer for good (the
    owner is done: a pending timer would keep it alive until it fired).
    """

    __slots__ = ("_at", "_late", "_loop", "_timer", "due")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Loop time the deadline passes; None: none runs. Read by owners that
        # ask every request (`armed` is a Python call on 3.11, some 640
        # instructions against the attribute's 85); set by these methods only.
        self.due: float | None = None
        self._late: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # the timer's when(), while there is one

    @property
    def armed(self) -> bool:
        """A deadline is running."""
        return self.due is not None

    def arm(self, delay: float, late: Callable[[], None]) -> None:
        # arm_at's steps, not a call of it: connections arm a deadline or two
        # a request (callgrind on a loop of arm and disarm: 2,600
        # instructions a pair with the call, 2,200 without).
        due = self._loop.time() + delay
        self.due, self._late = due, late
        timer = self._timer
        if timer is None or self._at > due:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(due, self._tick)
            self._at = due

    def arm_at(self, due: float, late: Callable[[], None]) -> None:
        """`late` runs at loop time `due` (as `arm`, for a deadline already absolute)."""
        self.due, self._late = due, late
        timer = self._timer
        if timer is None or self._at > due:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(due, self._tick)
            self._at = due

    def disarm(self) -> None:
        self.due = self._late = None  # the timer, if any, finds nothing due

    def close(self) -> None:
        self.disarm()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _tick(self) -> None:
        self._timer = None
        due, late = self.due, self._late
        if due is None or late is None:
            return
        if self._loop.time() < due - TIMER_GRAIN:
            self._timer = self._loop.call_at(due, self._tick)
            self._at = due
            return
        self.disarm()
        late()


def not_before_a_grain(due: float, now: float) -> float:
    """When to look again at a deadline `due` not passed at `now`: at `due`,
    but not within a grain of `now`. uvloop's clock counts whole milliseconds:
    a timer for less than one ahead fires at once with the clock unchanged,
    and the deadline would be looked at again and again until it ticks."""
    return max(due, now + TIMER_GRAIN)


def cut_by_bound(
    task: asyncio.Task[object], cancelling: int, exc_type: type[BaseException] | None
) -> bool:
    """At the end of a block whose bound cancelled `task`: take that cancel
    back, and whether the block was left by it (and no other cancellation,
    counted from `cancelling` at the block's start), so that it raises the
    bound's own error instead (TimeoutError here; dataplane.upstream.stalls'
    Stalled)."""
    return task.uncancel() <= cancelling and exc_type is asyncio.CancelledError


def _exit_timeout(
    task: asyncio.Task[object],
    expired: bool,
    cancelling: int,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
) -> None:
    """The end of a block bounded as by `asyncio.timeout`: a block left by
    the bound's cancellation (`expired`) raises TimeoutError instead."""
    if expired and cut_by_bound(task, cancelling, exc_type):
        raise TimeoutError from exc


class Bound:
    """One task's deadline, as `asyncio.timeout_at`'s context manager: at the
    deadline the task is cancelled, and that cancellation leaves the block as
    TimeoutError; a cancellation from elsewhere goes on as CancelledError."""

    __slots__ = ("_cancelling", "_expired", "_owner", "_task", "_timer", "when")

    def __init__(self, owner: Deadlines, task: asyncio.Task[object], when: float) -> None:
        self._owner = owner
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None  # its own, when out of order
        self.when = when

    def expire(self) -> None:
        if not self._expired:
            self._expired = True
            self._task.cancel()

    def __enter__(self) -> Bound:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Off its owner's deadlines here, not in a call of the owner's (every
        # origin call's block ends here; a Python call, some 400 instructions).
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None
        else:
            owner = self._owner
            queue = owner._queue
            if queue.pop(self, 0) is None and not queue:
                owner._last = float("-inf")
                owner._timer.disarm()
        if self._expired:  # rarely: no call otherwise
            _exit_timeout(self._task, True, self._cancelling, exc_type, exc)


class Deadlines:
    """Deadlines of many tasks on one LazyTimer. One per loop's user.

    Deadlines are kept in the order they were set. Those set in time order
    (the usual case: every call gets the same time from its start) share the
    timer, armed for the first; set, cleared and passed in order, they cost a
    dict entry each. One set earlier than a deadline already kept gets a
    timer of its own. Used from the loop's thread only.
    """

    __slots__ = ("_last", "_queue", "_timer", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop  # read by its owner on every call: an attribute, not a property
        self._queue: dict[Bound, None] = {}  # in order of `when`
        self._last = float("-inf")  # the latest `when` in the queue
        self._timer = LazyTimer(loop)

    def __len__(self) -> int:
        return len(self._queue)

    def bound(self, task: asyncio.Task[object], when: float) -> Bound:
        """`task` cancelled at loop time `when` unless the Bound has exited."""
        bound = Bound(self, task, when)
        if when < self._last:
            bound._timer = self.loop.call_at(when, bound.expire)
            return bound
        if not self._queue:
            self._timer.arm_at(when, self._sweep)
        self._queue[bound] = None
        self._last = when
        return bound

    def _sweep(self) -> None:
        """Expire the deadlines past (the first ones), then wait for the next."""
        # Not a grain early, as LazyTimer may call: a call is cancelled at its
        # deadline, never before (the traced path tells a timeout by the clock).
        now = self.loop.time()
        queue = self._queue
        while queue:
            bound = next(iter(queue))
            if bound.when > now:
                self._timer.arm_at(not_before_a_grain(bound.when, now), self._sweep)
                return
            del queue[bound]
            bound.expire()
        self._last = float("-inf")


class IdleTimeout:
    """`with idle:` is `async with asyncio.timeout(delay):` for the task that
    made it, around one wait of many: the task is cancelled once a block has
    run for `delay` seconds (at the deadline, never before), and that
    cancellation leaves the block as TimeoutError; a cancellation from
    elsewhere goes on as CancelledError. Blocks do not nest.

    Every block moves the deadline of one LazyTimer on, so the timer is
    started once and fires about once per `delay` of a long wait. `close()`
    (when the waits are done) cancels it. `cap()` shortens the waits for a
    while (a stream whose origin the route table marks unhealthy).

    Once `progress()` is called (a stream's event came), the blocks after it
    are bounded together, from the start of the first of them, until the
    next `progress()`: what ends a block without progress (an origin's SSE
    comments) does not start the bound over.
    """

    __slots__ = (
        "_base",
        "_cancelling",
        "_delay",
        "_due",
        "_entered",
        "_expired",
        "_late_call",
        "_loop",
        "_progress",
        "_since",
        "_task",
        "_timer",
    )

    def __init__(
        self,
        delay: float,
        task: asyncio.Task[object] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`task` defaults to the current one, `loop` to the task's."""
        task = task or asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleTimeout is made inside the task it bounds")
        self._task = task
        self._loop = loop or task.get_loop()
        self._base = delay  # as made
        self._delay = delay  # as bounded now: the base, or a cap under it
        self._timer = LazyTimer(self._loop)
        self._due = 0.0  # loop time the running block's deadline passes
        self._cancelling = 0
        self._expired = False
        self._entered = 0.0  # loop time the running (or last) block started
        # The start of the first block since the last progress (None: no
        # progress yet, each block from its own start), and whether progress
        # came since that block.
        self._since: float | None = None
        self._progress = False
        self._late_call = self._late  # one bound method, not one per block

    # Entered and left around every read of a stream (one per event of a
    # generating origin): LazyTimer's arm_at and disarm inline, the handle's
    # `when()` not asked, and the exit's check of a cut made only when there
    # was one (callgrind on a relay's loop: 6,800 instructions a read with
    # the timeout, some 3,900 without these calls).
    def __enter__(self) -> IdleTimeout:
        self._cancelling = self._task.cancelling()
        self._expired = False
        now = self._entered = self._loop.time()
        if self._progress:
            self._since, self._progress = now, False
        since = self._since
        due = self._due = (now if since is None else since) + self._delay
        timer = self._timer
        timer.due, timer._late = due, self._late_call
        if timer._timer is None or timer._at > due:
            timer.arm_at(due, self._late_call)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        timer = self._timer
        timer.due = timer._late = None  # disarmed: see LazyTimer.disarm
        if self._expired:
            _exit_timeout(self._task, True, self._cancelling, exc_type, exc)

    @property
    def delay(self) -> float:
        """The bound of a wait now: the delay it was made with, or a cap under it."""
        return self._delay

    @property
    def capped(self) -> bool:
        """A cap shortens the waits now."""
        return self._delay < self._base

    def cap(self, delay: float | None) -> None:
        """Bound each wait to `delay` seconds where that is shorter than the
        delay it was made with (None: lift the cap). The wait under way, if
        any, is bounded from its start: one that has run that long already
        is cut at once (at the loop's next turn)."""
        before = self._delay
        self._delay = self._base if delay is None else min(self._base, delay)
        if self._timer.armed and self._delay != before:
            # A later deadline leaves the timer due first, which waits again (_late).
            self._due += self._delay - before
            self._timer.arm_at(self._due, self._late)

    def progress(self) -> None:
        """Progress came (called between blocks): the next block, and those
        after it until the next progress, are bounded from that block's start."""
        self._progress = True

    @property
    def without_progress(self) -> bool:
        """The last block began after others that came without progress
        since the last (it was bounded from an earlier block's start)."""
        since = self._since
        return since is not None and since < self._entered

    def close(self) -> None:
        """The waits are done: no block follows. Its timer is cancelled,
        and it lets go of its own bound method, a cycle through itself that
        held its task, and so the task's result (a flight's stream, which
        holds its request while its end is not written), until a full
        collection."""
        self._timer.close()
        self._late_call = _no_block

    def _late(self) -> None:
        # LazyTimer takes a timer one grain early as on time; a wait is cut at
        # its deadline, never before.
        now = self._loop.time()
        if now < self._due:
            self._timer.arm_at(not_before_a_grain(self._due, now), self._late)
            return
        self._expired = True
        self._task.cancel()


def _no_block() -> None:
    """A closed IdleTimeout's `_late_call`: no block is under way."""
