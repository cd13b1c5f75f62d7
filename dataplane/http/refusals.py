"""The log of refused requests: each refusal once, at INFO, never a traceback,
and never more lines than the log can bear.

A refusal is the client's fault (a bad body, a wrong key, a broken HTTP
message, a connection held open too long): the operator wants to see that it
happened and why, not a stack. A flood of them (a fuzzer, a broken client in a
loop) must not flood the log, so lines are rate-limited by a token bucket:
past `per_second` (with bursts of `burst`), refusals are counted but not
written, and the next line written says how many were skipped.

Pure but for the logger it writes to; the clock is injected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

__all__ = ["RefusalLog", "refusals"]

PER_SECOND: Final = 20.0
BURST: Final = 50.0


class RefusalLog:
    """Writes one INFO line per refusal, at most `per_second` lines a second."""

    __slots__ = ("_allowance", "_burst", "_clock", "_last", "_log", "_rate", "skipped")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        per_second: float = PER_SECOND,
        burst: float = BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._rate = per_second
        self._burst = burst
        self._clock = clock
        self._allowance = burst
        self._last = clock()
        self.skipped = 0  # refusals not written since the last line

    def reset(self) -> None:
        """Back to a full burst, as at start (for tests that share the process's log)."""
        self._allowance = self._burst
        self._last = self._clock()
        self.skipped = 0

    def refused(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        request_id: str = "-",
        remote: str | None = None,
        what: str = "-",
    ) -> bool:
        """Record one refusal; True if a line was written.

        `what` names the request (``POST /v1/chat/completions``); `message` is
        the reason as the client was told it, cut to 200 characters so a huge
        bad value cannot make a huge line.
        """
        now = self._clock()
        self._allowance = min(self._burst, self._allowance + (now - self._last) * self._rate)
        self._last = now
        if self._allowance < 1.0:
            self.skipped += 1
            return False
        self._allowance -= 1.0
        skipped, self.skipped = self.skipped, 0
        self._log.info(
            "refused %s %s from %s: %s %s: %s%s",
            request_id,
            what,
            remote or "-",
            status,
            code or "-",
            message[:200],
            f" ({skipped} more refusals not logged)" if skipped else "",
        )
        return True


refusals = RefusalLog(logging.getLogger("ponto.refusals"))
"""The process's refusal log; the HTTP boundary and the protocol layer share it."""
