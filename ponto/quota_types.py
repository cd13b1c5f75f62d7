"""Values of global rate limiting that both planes exchange.

The control-plane leader turns the demand that proxies report into shares
(`controlplane.quota.compute_shares`); each proxy's `RateLimiter` enforces its
shares. The wire encoding belongs to the proto contract; these are the
in-process values on either side of it, so that neither plane imports the other.
See docs/rate-limits.md for the scheme and its accuracy bound.

A limit scope is a string: `t/<tenant>` or `k/<key_id>`.
"""

from __future__ import annotations

from dataclasses import dataclass


def tenant_scope(tenant: str) -> str:
    return f"t/{tenant}"


def key_scope(key_id: str) -> str:
    return f"k/{key_id}"


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    """A scope's global limits; 0 means unlimited in that dimension."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens (prompt + completion) per minute
    concurrency: int = 0  # requests in flight at once

    def __post_init__(self) -> None:
        if self.rpm < 0 or self.tpm < 0 or self.concurrency < 0:
            raise ValueError(f"limits must not be negative: {self}")

    @property
    def unlimited(self) -> bool:
        return not (self.rpm or self.tpm or self.concurrency)


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
