"""Hedged requests: when a second copy of a request is sent, and how often.

A hedge is the same request sent to the next candidate while the first attempt
has not committed after a delay; the first of the two to commit answers and
the other is cancelled (`dataplane.upstream.forwarder`). This module holds the
pure parts: the setting, the per-origin time-to-commit window that an "auto"
delay reads, and the budget that bounds how many extra calls hedging adds.
Single event loop; no locks; time from an injected clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

from dataplane.upstream.outlier import RetryBudget

AUTO: Final = "auto"

HedgeSetting = float | Literal["auto"]
"""A fixed delay in seconds (0 hedges at once), or AUTO: the first candidate's
recent p95 time to commit, and no hedge while too few samples are known."""

# A hedge is a whole extra LLM call (prefill at least): it may add at most 10 %
# of the hedge-enabled request rate. The floor lets a quiet proxy still hedge
# (a proxy at 2 requests/s would otherwise wait 5 s between hedges), and the cap
# bounds the burst after a quiet spell. RetryBudget is reused because the scheme
# is the same (a token bucket fed per request and per second); a hedge budget is
# a separate instance so hedges never spend the retries' tokens.
HEDGE_RATIO = 0.1
HEDGE_FLOOR_PER_S = 1.0
HEDGE_CAP = 10.0


def hedge_budget(clock: Callable[[], float] = time.monotonic) -> RetryBudget:
    """The default hedge budget: 10 % of hedge-enabled requests, plus 1 a second."""
    return RetryBudget(ratio=HEDGE_RATIO, floor_per_s=HEDGE_FLOOR_PER_S, cap=HEDGE_CAP, clock=clock)


def check_setting(value: object) -> HedgeSetting:
    """`value` as `Forwarder.forward` takes it; ValueError unless it is "auto"
    or a finite number of seconds >= 0. For whoever compiles a tenant's policy."""
    if value == AUTO:
        return AUTO
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"a hedge delay is 'auto' or seconds >= 0, not {value!r}")
    return float(value)


class CommitTimes:
    """Per origin and kind (stream or not): the seconds from send to commit of
    its last `window` attempts that committed with a status under 400, and
    their p95.

    Streams and whole bodies are kept apart: a stream commits at its first
    chunk (time to first token), a whole body only when generation is done, so
    one p95 over both would fit neither. The p95 is computed when read and kept
    for `cache_s`: a read costs a dict lookup on the hot path, a sort of at
    most `window` floats once a second per origin. Below `min_samples` it is
    None: too few samples to say what slow is.
    """

    def __init__(
        self,
        *,
        window: int = 128,
        min_samples: int = 20,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window
        self._min = min_samples
        self._cache_s = cache_s
        self._clock = clock
        self._samples: dict[tuple[str, bool], deque[float]] = {}
        self._p95: dict[tuple[str, bool], tuple[float, float | None]] = {}

    def observe(self, origin: str, stream: bool, seconds: float) -> None:
        key = (origin, stream)
        try:  # a subscript: nearly always there (metrics.Counter.add's reason)
            samples = self._samples[key]
        except KeyError:
            samples = self._samples[key] = deque(maxlen=self._window)
        samples.append(seconds)

    def p95(self, origin: str, stream: bool) -> float | None:
        key = (origin, stream)
        now = self._clock()
        cached = self._p95.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        value = None
        samples = self._samples.get(key)
        if samples is not None and len(samples) >= self._min:
            ordered = sorted(samples)
            value = ordered[math.ceil(0.95 * len(ordered)) - 1]  # nearest rank
        self._p95[key] = (now + self._cache_s, value)
        return value
