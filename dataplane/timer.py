"""A deadline that moves on often and rarely passes, kept on one reusable timer.

A connection's deadlines (a request head's, a body's, an origin's next byte's)
are set and cleared once or twice per request and almost never pass. Under
uvloop, starting and cancelling a timer costs about 3 us; a request that did
that for each of its deadlines paid more for the timers than for most of its
own steps. `LazyTimer` keeps one timer per owner instead: arming moves the
deadline, and a timer that fires before the deadline now running waits again
for it; one due after it is replaced. A busy connection's timer wakes up about
once per deadline period, whatever its request rate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

__all__ = ["TIMER_GRAIN", "LazyTimer"]

# uvloop's clock and timers count whole milliseconds: a timer may fire up to
# one early by loop.time(), which is then taken as on time.
TIMER_GRAIN: Final = 0.001


class LazyTimer:
    """At most one deadline at a time: `late` runs once at `delay` seconds after
    `arm`, unless `disarm` or another `arm` came first.

    Used from its loop's thread only. `close` cancels the timer for good (the
    owner is done: a pending timer would keep it alive until it fired).
    """

    __slots__ = ("_due", "_late", "_loop", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: float | None = None  # loop time the deadline passes
        self._late: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        """A deadline is running."""
        return self._due is not None

    def arm(self, delay: float, late: Callable[[], None]) -> None:
        due = self._loop.time() + delay
        self._due, self._late = due, late
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(due, self._tick)

    def disarm(self) -> None:
        self._due = self._late = None  # the timer, if any, finds nothing due

    def close(self) -> None:
        self.disarm()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _tick(self) -> None:
        self._timer = None
        due, late = self._due, self._late
        if due is None or late is None:
            return
        if self._loop.time() < due - TIMER_GRAIN:
            self._timer = self._loop.call_at(due, self._tick)
            return
        self.disarm()
        late()
