"""The circuit breaker of the regional cache link: when to try Redis at all.

A pure state machine: it reads the injected clock and does no I/O.

    closed --failure--> open (retry after `base_s`)
    open   --retry time reached--> one probe admitted; other calls still skip
    probe  --success--> closed (the delay back to `base_s`)
    probe  --failure--> open, the delay doubled up to `cap_s`

Only the first failure of calls admitted while closed opens it: calls that were
already in flight when it opened report late, and their outcomes change nothing
(a late success proves less than a probe, and a late failure must not double the
delay). A probe that ends with no verdict (its task cancelled) frees the probe
slot, so the next call probes at once.

One per `RegionLink`; used from one event loop, not thread-safe.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class Admit(enum.Enum):
    """How a call was let through: while closed, or as the one probe."""

    CLOSED = "closed"
    PROBE = "probe"


class Breaker:
    def __init__(
        self, *, clock: Callable[[], float], base_s: float = 0.25, cap_s: float = 5.0
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, not {base_s} and {cap_s}")
        self._clock = clock
        self._base = base_s
        self._cap = cap_s
        self._delay = base_s
        self._closed = True
        self._retry_at = 0.0
        self._probing = False

    @property
    def closed(self) -> bool:
        """True while calls go through (healthy); False while open or probing."""
        return self._closed

    @property
    def delay_s(self) -> float:
        """The wait before the next probe once (or while) open."""
        return self._delay

    def allow(self) -> Admit | None:
        """Whether a call may go to Redis now, and how; None: skip it."""
        if self._closed:
            return Admit.CLOSED
        if self._probing or self._clock() < self._retry_at:
            return None
        self._probing = True
        return Admit.PROBE

    def success(self, admit: Admit) -> bool:
        """Report a call that worked; True when this closed the breaker."""
        if admit is Admit.PROBE and self._probing:
            self._probing = False
            self._closed = True
            self._delay = self._base
            return True
        return False

    def failure(self, admit: Admit) -> bool:
        """Report a call that failed; True when this opened the breaker (from closed)."""
        if admit is Admit.CLOSED and self._closed:
            self._closed = False
            self._delay = self._base
            self._retry_at = self._clock() + self._delay
            return True
        if admit is Admit.PROBE and self._probing:
            self._probing = False
            self._delay = min(self._delay * 2, self._cap)
            self._retry_at = self._clock() + self._delay
        return False

    def abandon(self, admit: Admit) -> None:
        """A call ended with no verdict (cancelled): free the probe slot."""
        if admit is Admit.PROBE:
            self._probing = False
