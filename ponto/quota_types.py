"""Values of global rate limiting that both planes exchange.

The control-plane leader turns the demand that proxies report into shares
(`controlplane.quota.compute_shares`); each proxy's `RateLimiter` enforces its
shares. The wire encoding belongs to the proto contract; these are the
in-process values on either side of it, so that neither plane imports the other.
See docs/rate-limits.md for the scheme and its accuracy bound.

A limit scope is a string: `t/<tenant>` or `k/<key_id>`.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass
from typing import Protocol


def tenant_scope(tenant: str) -> str:
    return f"t/{tenant}"


def key_scope(key_id: str) -> str:
    return f"k/{key_id}"


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    """A scope's global limits; 0 means unlimited in that dimension.

    The budgets (tokens per UTC day, per UTC calendar month) are counts the
    leader keeps for the whole fleet (controlplane.budget), not buckets: each
    proxy refuses once what is left, as the leader last counted it, less what
    it spent since, runs out (docs/rate-limits.md, "Day and month budgets")."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens (prompt + completion) per minute
    concurrency: int = 0  # requests in flight at once
    tokens_per_day: int = 0  # tokens in a UTC day
    tokens_per_month: int = 0  # tokens in a UTC calendar month

    def __post_init__(self) -> None:
        dims = (self.rpm, self.tpm, self.concurrency, self.tokens_per_day, self.tokens_per_month)
        if min(dims) < 0:
            raise ValueError(f"limits must not be negative: {self}")

    @property
    def unlimited(self) -> bool:
        return not (
            self.rpm or self.tpm or self.concurrency or self.tokens_per_day or self.tokens_per_month
        )

    @property
    def rated(self) -> bool:
        """Whether a rate or concurrency limit applies: those need a share."""
        return bool(self.rpm or self.tpm or self.concurrency)

    @property
    def budgeted(self) -> bool:
        return bool(self.tokens_per_day or self.tokens_per_month)


class LimitsLike(Protocol):
    """A scope's global limits: the route table's Limits message
    (ponto.v1.routing_pb2.Limits), ScopeLimits, the control plane's model."""

    @property
    def rpm(self) -> int: ...
    @property
    def tpm(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def tokens_per_day(self) -> int: ...
    @property
    def tokens_per_month(self) -> int: ...


def scope_limits(m: LimitsLike) -> ScopeLimits:
    """A table's Limits as a scope's."""
    return ScopeLimits(m.rpm, m.tpm, m.concurrency, m.tokens_per_day, m.tokens_per_month)


def utc_day(wall: float) -> int:
    """The UTC date of `wall` (Unix seconds) as YYYYMMDD: a budget's day; its
    month is the number // 100."""
    t = time.gmtime(wall)
    return t.tm_year * 10000 + t.tm_mon * 100 + t.tm_mday


def seconds_to_day_end(wall: float) -> float:
    """Seconds from `wall` to the next UTC midnight."""
    return 86400.0 - wall % 86400.0


def seconds_to_month_end(wall: float) -> float:
    """Seconds from `wall` to the first of the next UTC month, 00:00."""
    t = time.gmtime(wall)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return max(0.0, _timegm(year, month) - wall)


def _timegm(year: int, month: int) -> float:
    return float(calendar.timegm((year, month, 1, 0, 0, 0, 0, 0, 0)))


@dataclass(frozen=True, slots=True)
class Spent:
    """What one proxy process charged one budgeted scope, in tokens, in the UTC
    day `day` (YYYYMMDD) and in that day's month: estimates at admission,
    corrected by each answer's count. `epoch` tells the process (its start,
    Unix seconds, or the process of the proxy before it, whose saved counts
    it went on from): counts start at 0 with each process and never go back
    within one day (month) of it. `proxy`: the process's proxy name where it
    is not the one holding the counts (a row another --workers layout's
    process left, which this one carries: SpentCount.proxy); "" is its own."""

    epoch: float
    day: int
    day_tokens: float
    month_tokens: float
    proxy: str = ""


@dataclass(frozen=True, slots=True)
class Budget:
    """What the leader counted of a budgeted scope at its last round, for one
    proxy: the fleet's tokens left of the day and the month (`day`; inf where
    no budget), this proxy's `share` of them (by the demand the proxies
    reported, as rate shares go), and what it counted of this proxy
    process's own spending (`epoch`, its Spent), so that the proxy takes off
    only what it spent since. The shares of a round sum to at most 1, so the
    fleet spends at most what was left, but for the answers' counts past
    their estimates and the shares moving between rounds."""

    epoch: float
    day: int
    day_left: float
    month_left: float
    spent_day: float = 0.0
    spent_month: float = 0.0
    share: float = 1.0
    # The budgets the round counted under (0: none): a budget changed since
    # (raised, lowered) moves what is left by as much, before the next round.
    day_limit: int = 0
    month_limit: int = 0

    def reckon(
        self, limits: ScopeLimits, epoch: float, day: int, day_used: float, month_used: float
    ) -> Reckoning:
        """What is left for a proxy process `epoch` on `day`, whose counters
        are day_used and month_used, of the fleet's budgets and of its share
        of them: what the leader counted, less what this process spent since
        it counted (all it spent, for a process it did not count: one started
        since, or that had spent nothing then). Where the process's day
        (month) is not the budget's, one of them turned over since the round:
        the whole budget less what the process spent."""
        same = epoch == self.epoch
        since_day = day_used - (self.spent_day if same and day == self.day else 0.0)
        day_left = _moved(self.day_left, limits.tokens_per_day, self.day_limit)
        month_left = _moved(self.month_left, limits.tokens_per_month, self.month_limit)
        if not limits.tokens_per_day:
            day_fleet = day_mine = math.inf
        elif day != self.day:
            day_fleet = limits.tokens_per_day - day_used
            day_mine = self.share * limits.tokens_per_day - day_used
        else:
            day_fleet = day_left - since_day
            day_mine = self.share * day_left - since_day
        if not limits.tokens_per_month:
            month_fleet = month_mine = math.inf
        elif day // 100 != self.day // 100:
            month_fleet = limits.tokens_per_month - month_used
            month_mine = self.share * limits.tokens_per_month - month_used
        else:
            since = month_used - (self.spent_month if same else 0.0)
            month_fleet = month_left - since
            month_mine = self.share * month_left - since
        return Reckoning(day_fleet, month_fleet, day_mine, month_mine, since_day <= 0)


def _moved(left: float, limit: int, counted_under: int) -> float:
    """What is left of a budget counted under `counted_under`, now `limit`."""
    if not counted_under or limit == counted_under:
        return left
    return max(0.0, left + limit - counted_under)


@dataclass(frozen=True, slots=True)
class Reckoning:
    """Tokens left of a scope's budgets as a proxy reckons them (Budget.reckon):
    the fleet's (a request past them waits for the period's end) and this
    proxy's share of them (a request past that waits for the leader to move
    share to where the demand is). `fresh`: this process has spent nothing
    since the leader counted, so it may take one request past its share that
    the fleet's budget holds (when what is left is less than a request per
    share, no share would ever hold one)."""

    day_fleet: float
    month_fleet: float
    day_mine: float
    month_mine: float
    fresh: bool = False


@dataclass(frozen=True, slots=True)
class Demand:
    """What one proxy saw of one scope over its last report interval.

    Rates are EWMAs of attempts, refused ones included: refusals are demand
    that the proxy's share could not serve, which is what the leader needs to
    see. `concurrency_peak` counts the requests that would have been in flight
    had none been refused; `in_flight` is the count at the time of the report.
    `debt_tokens`: what the proxy's token bucket owes at the time of the
    report (answers charged past their estimates), 0 when it owes nothing.
    """

    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    concurrency_peak: int = 0
    in_flight: int = 0
    debt_tokens: float = 0.0
    spent: Spent | None = None  # a budgeted scope's counts, this month
    # Counts of other processes or days of the proxy (ScopeDemand.closed):
    # its final ones of a day (month) that turned, a reload's old worker's.
    closed: tuple[Spent, ...] = ()


@dataclass(frozen=True, slots=True)
class Share:
    """One proxy's part of one scope's global limits.

    `fraction` applies to both the request and the token limit; `concurrency`
    is a whole number of slots. Across the proxies of a fleet the fractions of a
    scope sum to at most 1 and the slots to at most the concurrency limit.

    `spare`: at the leader's round that made this share, the fleet's peaks
    (refused and waiting requests counted) left slots of the concurrency limit
    idle, or the allocation owed this proxy more slots than it holds yet
    (controlplane.quota.compute_shares). A proxy whose own slots are all busy
    then waits for its next share instead of refusing: the leader moves slots
    to where the refusals are (see RateLimiter.may_wait).

    `fleet_debt_s`: the fleet owes the scope's tokens (answers settled past
    their estimates), which the whole limit repays in this many seconds; the
    leader has moved the share to the proxies that owe, so a token refusal
    anywhere tells its client to wait at least this long. 0: it owes little.
    """

    fraction: float
    concurrency: int = 0
    spare: bool = False
    fleet_debt_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0 or self.concurrency < 0 or not self.fleet_debt_s >= 0:
            raise ValueError(f"invalid share: {self}")


NO_SHARE = Share(0.0, 0)


def default_share(limits: ScopeLimits, fraction: float) -> Share:
    """The share a proxy applies to a scope the leader has not rebalanced yet.

    Both planes use this one rule: the leader counts it as given when it
    computes the next shares, so the sum stays within the limits.
    """
    if fraction <= 0:
        return NO_SHARE
    return Share(min(1.0, fraction), int(limits.concurrency * fraction))
