"""The proxy's side of global rate limits: shares in, demand out.

Glue between the control-plane link (sync.py) and the RateLimiter. Until the
leader's first shares arrive, every limited scope gets 1/fleet_size of its
limits (the fleet size comes with registration); a scope the leader has not
rebalanced yet gets the shares message's default fraction. See
docs/rate-limits.md for the accuracy this gives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from dataplane.ratelimit.limiter import RateLimiter
from ponto.quota_types import ScopeLimits, Share
from ponto.v1 import routing_pb2 as pb


class QuotaState:
    """Owned by the app; called on its event loop only."""

    def __init__(self, limiter: RateLimiter, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = limiter
        self._clock = clock
        self._limits: Mapping[str, ScopeLimits] = {}
        self._explicit: dict[str, Share] = {}
        self.default_fraction = 1.0
        self._heard_from_leader = False

    def on_limits(self, limits: Mapping[str, ScopeLimits]) -> None:
        self._limits = limits
        self._limiter.configure(limits, self._clock())
        self._apply()

    def on_fleet_size(self, size: int) -> None:
        if not self._heard_from_leader and size > 0:
            self.default_fraction = 1.0 / size
            self._apply()

    def on_quota(self, quota: pb.QuotaShares) -> None:
        self._heard_from_leader = True
        if quota.default_fraction > 0:
            self.default_fraction = min(1.0, quota.default_fraction)
        self._explicit = {
            s.scope: Share(min(1.0, max(0.0, s.fraction)), s.concurrency) for s in quota.shares
        }
        self._apply()

    def _default(self, limits: ScopeLimits) -> Share:
        # Whole slots only; at least one where a limit exists, so a proxy that
        # has not been rebalanced yet can still serve (over-admits by at most
        # one slot per proxy until the first rebalance).
        slots = math.floor(limits.concurrency * self.default_fraction)
        return Share(self.default_fraction, max(1, slots) if limits.concurrency else 0)

    def _apply(self) -> None:
        shares = {
            scope: self._explicit.get(scope) or self._default(lim)
            for scope, lim in self._limits.items()
        }
        self._limiter.apply_shares(shares, self._clock())

    def demand(self) -> list[pb.ScopeDemand]:
        return [
            pb.ScopeDemand(
                scope=scope,
                requests_per_s=d.requests_per_s,
                tokens_per_s=d.tokens_per_s,
                concurrency=d.concurrency_peak,
            )
            for scope, d in self._limiter.demand(self._clock()).items()
        ]
