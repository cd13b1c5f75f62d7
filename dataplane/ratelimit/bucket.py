"""A token bucket with continuous refill and time passed in.

Refill is continuous, like OpenAI's limits: a bucket of capacity C refilling
at C/60 per second is "C per minute" and is full again at most one minute
after it was emptied. The bucket never reads a clock: every call takes `now`
(seconds on one monotonic clock), so that tests and simulations drive time.
A `now` earlier than the last one is treated as no time passing.

Single-threaded: one event loop owns a bucket; nothing here awaits or locks.
"""

from __future__ import annotations

import math

INF = math.inf
# Levels, rates and times are floats, compared here with float literals (0.0,
# not 0): CPython 3.11 specialises a compare of two floats and takes its
# generic path for a float and an int, some 400 instructions more a compare
# on the hot path (every limited scope of every request). limiter.py too.


class TokenBucket:
    """`level` tokens out of `capacity`, refilled at `rate` per second.

    The level may be negative: debt taken by `take` (a correction after the
    fact, or a request larger than the whole bucket) is repaid by refill
    before anything else is admitted. Refill never raises the level above
    `capacity`, so the bucket can hand out at most `capacity + rate * T` in
    any window of T seconds.
    """

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, capacity: float, rate: float, now: float, *, level: float | None = None):
        if capacity < 0 or rate < 0:
            raise ValueError("capacity and rate must not be negative")
        self.capacity = capacity
        self.rate = rate
        self.level = capacity if level is None else min(level, capacity)
        self.stamp = now

    @classmethod
    def per_minute(cls, limit: float, now: float, *, level: float | None = None) -> TokenBucket:
        return cls(limit, limit / 60.0, now, level=level)

    def refill(self, now: float) -> float:
        """Bring the level up to `now` and return it."""
        elapsed = now - self.stamp
        if elapsed > 0.0:
            self.stamp = now
            level = self.level + elapsed * self.rate
            cap = self.capacity
            self.level = level if level < cap else cap
        return self.level

    def admits(self, amount: float, now: float) -> bool:
        """Whether `amount` may be taken now.

        An amount larger than the whole bucket is admitted once the bucket is
        full, and leaves it in debt: otherwise a request that fits the global
        limit but not this proxy's share of it could never pass here. The
        long-run rate is unchanged; the burst grows by `amount - capacity`.
        An empty bucket (capacity 0: no share) admits nothing.
        """
        cap = self.capacity
        if cap <= 0.0:
            return False
        # refill's steps, written out: on the hot path (every limited scope of
        # every request) the call cost more than they do.
        level = self.level
        elapsed = now - self.stamp
        if elapsed > 0.0:
            self.stamp = now
            level += elapsed * self.rate
            self.level = level = level if level < cap else cap
        return level >= amount or level >= cap

    def take(self, amount: float, now: float) -> None:
        """Take unconditionally; the level may go negative."""
        # refill's steps, written out (every answer's settling: Admission.release).
        level = self.level
        elapsed = now - self.stamp
        if elapsed > 0.0:
            self.stamp = now
            level += elapsed * self.rate
            cap = self.capacity
            level = level if level < cap else cap
        self.level = level - amount

    def give(self, amount: float, now: float) -> None:
        """Return tokens (a charge that turned out too high), never above capacity."""
        # refill's steps, written out (as take's).
        level = self.level
        cap = self.capacity
        elapsed = now - self.stamp
        if elapsed > 0.0:
            self.stamp = now
            level += elapsed * self.rate
            level = level if level < cap else cap
        level += amount
        self.level = level if level < cap else cap

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `admits(amount)` holds (0 if it does; inf without refill)."""
        if self.capacity <= 0 or self.rate <= 0:
            return 0.0 if self.admits(amount, now) else INF
        level = self.refill(now)
        need = min(amount, self.capacity) - level
        return need / self.rate if need > 0 else 0.0

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again (inf without refill)."""
        missing = self.capacity - (self.level if now <= self.stamp else self.refill(now))
        if missing <= 0.0:
            return 0.0
        return missing / self.rate if self.rate > 0.0 else INF

    def resize(self, capacity: float, rate: float, now: float) -> None:
        """Change capacity and rate from `now` on.

        Time until `now` is refilled at the old rate. A smaller capacity clamps
        the level at once; a larger one adds no tokens, they refill at the new
        rate. This is what keeps a fleet whose shares move between proxies
        from handing out more than one bucket would (docs/rate-limits.md).
        """
        if capacity < 0 or rate < 0:
            raise ValueError("capacity and rate must not be negative")
        self.refill(now)
        self.capacity = capacity
        self.rate = rate
        self.level = min(self.level, capacity)
