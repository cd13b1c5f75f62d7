"""A token bucket of log lines, for lines a flood could repeat without end.

A line per event is right until the events come by the thousand: a fuzzer's
refusals, an origin that refuses the proxy's credential at full load. Past
`per_second` lines a second (with bursts of `burst`), lines are counted, not
written, and the next line written says how many were left out.

Pure but for the injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from dataplane.ratelimit.bucket import TokenBucket

__all__ = ["BURST", "PER_SECOND", "LineBudget"]

PER_SECOND: Final = 20.0
BURST: Final = 50.0


class LineBudget:
    """`take()` before each line: None when it is not to be written (it is
    counted), else how many were left out since the last one written.
    `burst` is at least one line."""

    __slots__ = ("_bucket", "_burst", "_clock", "_rate", "skipped")

    def __init__(
        self,
        *,
        per_second: float = PER_SECOND,
        burst: float = BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1.0:
            raise ValueError(f"burst must be at least one line, not {burst}")
        self._rate = per_second
        self._burst = burst
        self._clock = clock
        self._bucket = TokenBucket(burst, per_second, clock())
        self.skipped = 0  # lines not written since the last one written

    def reset(self) -> None:
        """Back to a full burst, as at start."""
        self._bucket = TokenBucket(self._burst, self._rate, self._clock())
        self.skipped = 0

    def take(self) -> int | None:
        now = self._clock()
        bucket = self._bucket
        if not bucket.admits(1.0, now):
            self.skipped += 1
            return None
        bucket.take(1.0, now)
        skipped, self.skipped = self.skipped, 0
        return skipped
