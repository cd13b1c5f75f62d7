"""Passive health at the proxy: outlier detection per origin, and a retry budget.

An origin that fails `consecutive` times in a row (connect error, 5xx,
timeout) is ejected for base * 2**(ejections-1) seconds, capped; a success
resets its failure count, and an ejection that ends without new failures
lowers the multiplier again. An origin that answers 429 is busy, not failing:
it is tried last for as long as its Retry-After says (capped), and neither
counts towards an ejection nor is reported as ejected (ejecting a busy origin
would push its load onto the others). Ejected and busy origins are not
removed from candidate lists but moved to the end, so a request still finds
one if all are (one attempt then, not one to each: Forwarder.forward). What
it ejected is reported to the control plane (`ejected`), whose probes read
only /health.
Both classes are single-threaded (one event loop) and read time from an
injected clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dataplane.routes import Target

# An origin is reported ejected while it is, and for this long after its last
# failure, until it answers (or its probes pass again: table_marks_down): one
# whose ejection ended but that no request tried since (a failover region's
# origin) is not reported for ever.
EJECTED_SHOWN_S = 60.0
# The characters of a failure a report keeps.
FAILURE_CHARS = 200


@dataclass
class _State:
    failures: int = 0
    ejections: int = 0
    until: float = 0.0  # ejected until
    busy_until: float = 0.0
    # Ejections since the origin last answered, the first's time, and the
    # last failure and its time: what the control plane is told.
    streak: int = 0
    streak_since: float = 0.0
    last_failure: str = ""
    failed_at: float = 0.0
    # When the route table last stopped marking it unhealthy: the leader's
    # probes found it answering again (`table_marks_down`).
    back_at: float = -math.inf


@dataclass(frozen=True, slots=True)
class Ejected:
    """An origin ejected since it last answered (RouteRequest.ejected)."""

    origin: str
    for_s: float  # since its first ejection after its last answer
    ejections: int
    last_failure: str
    ejected_s: float  # left of the current ejection; 0 once it ended
    failed_s: float  # since its last failure


def _passed_over(state: _State | None, now: float) -> bool:
    """Whether an origin in `state` goes after the others at `now`: ejected,
    or busy (a 429 asked for time)."""
    return state is not None and (state.until > now or state.busy_until > now)


class OutlierDetector:
    def __init__(
        self,
        *,
        consecutive: int = 3,
        base: float = 1.0,
        cap: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consecutive = consecutive
        self._base = base
        self._cap = cap
        self.clock = clock  # replaceable: tests move time on
        self._states: dict[str, _State] = {}
        self.ejections_total = 0
        self._down: frozenset[str] = frozenset()

    def success(self, origin: str) -> None:
        state = self._states.get(origin)
        if state is not None:
            state.failures = 0
            state.streak = 0
            if state.until <= self.clock():
                state.ejections = max(0, state.ejections - 1)

    def failure(self, origin: str, why: str = "") -> bool:
        """Record a failure (`why`: as the proxy logs it); return True if it
        ejected the origin."""
        state = self._states.setdefault(origin, _State())
        state.failures += 1
        now = self.clock()
        state.failed_at = now
        if why:
            state.last_failure = why[:FAILURE_CHARS]
        if state.failures >= self._consecutive and state.until <= now:
            if not state.streak:
                state.streak_since = now
            state.streak += 1
            state.ejections += 1
            state.failures = 0
            state.until = now + min(self._cap, self._base * 2 ** (state.ejections - 1))
            self.ejections_total += 1
            return True
        return False

    def busy(self, origin: str, seconds: float) -> None:
        """Record a 429 asking for `seconds` (capped) before the next request."""
        state = self._states.setdefault(origin, _State())
        state.busy_until = max(state.busy_until, self.clock() + min(self._cap, seconds))

    def ejected_now(self) -> int:
        """How many origins are ejected at this moment."""
        if not self._states:
            return 0
        now = self.clock()
        return sum(1 for state in self._states.values() if state.until > now)

    def table_marks_down(self, down: frozenset[str]) -> None:
        """The origins the route table now marks unhealthy (each table the
        proxy takes). One the last table marked so and this one does not
        answered the leader's probes again: once its ejection is over, and
        while no request fails it again, it is not reported as ejected, as
        if it had answered this proxy. An SRE game-day found every origin
        back and serving after a total outage, and each still reported
        "ejection over, not answered since" for a minute by the proxies that
        had tried them all during it and had no request for them since."""
        back = self._down - down
        self._down = down
        if back:
            now = self.clock()
            for origin in back:
                state = self._states.get(origin)
                if state is not None:
                    state.back_at = now

    def ejected_report(self) -> list[Ejected]:
        """The origins ejected since they last answered, each while it is
        ejected, and EJECTED_SHOWN_S after its last failure unless the
        table said since that its probes pass again (`table_marks_down`),
        by name."""
        now = self.clock()
        return [
            Ejected(
                origin,
                now - state.streak_since,
                state.streak,
                state.last_failure,
                max(0.0, state.until - now),
                now - state.failed_at,
            )
            for origin, state in sorted(self._states.items())
            if state.streak
            and (
                state.until > now
                or (now - state.failed_at < EJECTED_SHOWN_S and state.back_at < state.failed_at)
            )
        ]

    def all_ejected(self, candidates: Sequence[Target]) -> bool:
        """Whether every one of `candidates` (at least one) is ejected now.
        Asked of every request: with no origin ejected (the usual), no
        clock is read."""
        states = self._states
        if not states:
            return False
        now = self.clock()
        for target in candidates:
            state = states.get(target.name)
            if state is None or state.until <= now:
                return False
        return bool(candidates)

    def back_in(self, origins: Iterable[str]) -> float:
        """Seconds until the soonest of `origins` is no longer ejected: 0
        when one of them is not ejected now."""
        now = self.clock()
        soonest = math.inf
        for origin in origins:
            state = self._states.get(origin)
            left = 0.0 if state is None else state.until - now
            if left <= 0.0:
                return 0.0
            soonest = min(soonest, left)
        return 0.0 if math.isinf(soonest) else soonest

    def passed_over(self, origin: str) -> bool:
        """Whether `order` moves the origin last now: ejected, or busy (a 429)."""
        return _passed_over(self._states.get(origin), self.clock())

    def ejected(self, origin: str) -> bool:
        state = self._states.get(origin)
        return state is not None and state.until > self.clock()

    def order(self, candidates: Sequence[Target]) -> Sequence[Target]:
        """Candidates with ejected and busy origins moved last, order otherwise kept."""
        if not self._states:
            return candidates
        now = self.clock()
        live: list[Target] = []
        out: list[Target] = []
        states = self._states
        for target in candidates:
            (out if _passed_over(states.get(target.name), now) else live).append(target)
        return live + out


class RetryBudget:
    """Retries may add at most `ratio` of the request rate, plus `floor` per second.

    Finagle's scheme: each request deposits `ratio` tokens, each retry takes
    one; a floor lets a quiet proxy still retry. Stops retry storms from
    multiplying load on origins that are already failing. Hedges are bounded
    by another instance of it (`dataplane.upstream.hedge.hedge_budget`).
    """

    def __init__(
        self,
        *,
        ratio: float = 0.2,
        floor_per_s: float = 10.0,
        cap: float = 100.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ratio = ratio
        self._floor = floor_per_s
        self._cap = cap
        self._clock = clock
        self._tokens = cap
        self._last = clock()
        self.refused = 0

    def deposit(self) -> None:
        self._refill()
        self._tokens = min(self._cap, self._tokens + self._ratio)

    def try_retry(self) -> bool:
        self._refill()
        if self._tokens >= 1.0 - 1e-9:  # ten deposits of 0.1 make 0.999…
            self._tokens -= 1.0
            return True
        self.refused += 1
        return False

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._cap, self._tokens + (now - self._last) * self._floor)
        self._last = now
