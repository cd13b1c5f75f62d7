"""Per-second rates from cumulative counters that proxies report.

Pure: the caller passes each sample's time (when the counters were valid, as
the replica that heard them recorded it), so nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import pairwise
from typing import Generic, TypeVar

Counts = tuple[int, ...]
Rates = tuple[float, ...]
Sample = TypeVar("Sample")
Result = TypeVar("Result")


class WindowMeter(Generic[Sample, Result]):
    """Rates of each key's samples over a sliding window of them.

    A rate is what the counters grew by from the oldest sample still in the
    window to the newest (`_per_second`), over the time between them, so a
    report that came late or twice does not make a spike. A counter smaller than the previous
    sample means the proxy restarted, and a gap longer than the window since
    the previous sample means the caller could not sample meanwhile (the
    status page samples every few seconds, viewed or not; etcd was away):
    either way the history is dropped and the rate is unknown until the next
    sample, never negative nor an average over the gap. A key's first sample
    is where its rates start: unknown until the next, unless the caller knows
    when its counters were all 0 (`start`: a new proxy's registration) within
    the window before it. A sample may be a guess (`guessed`: counters the
    caller takes to have still held at a time it did not hear them, such as
    a quiet proxy's): a sample heard at or before a guess's time supersedes
    it, where a guess would have had it ignored as not newer. Callers key
    by one connection of a proxy (name and session), so a restarted proxy
    starts afresh even once its new counters pass the old ones. Used from one
    event loop.
    """

    def __init__(self, window: float = 10.0) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self._window = window
        self._samples: dict[str, deque[tuple[float, Sample]]] = {}
        # Key -> the time of its newest sample that was heard, not guessed:
        # the samples after it are guesses.
        self._heard: dict[str, float] = {}

    def observe(
        self,
        key: str,
        at: float,
        counts: Sample,
        start: float | None = None,
        *,
        guessed: bool = False,
    ) -> Result | None:
        """Add a sample (ignored if not newer than the last) and return the
        rates per second over the window, or None while they are unknown.
        `start`: when the key's counters were all 0, which a first sample
        within the window after it is measured from (trial 22: a proxy's
        first report held a whole burst, which its rates never showed).
        `guessed`: the counters were not heard at `at` but taken to hold
        then; a sample heard (not guessed) at `at`, newer than the last one
        heard, first drops the guesses at or after it, as what was heard
        then says what held, so a report written later than its caller
        guessed is measured from the samples before it rather than ignored:
        from the one kept at the window's start as of the last guess, not
        the guess just before it (no spike)."""
        samples = self._samples.setdefault(key, deque())
        if not guessed and at > self._heard.get(key, float("-inf")):
            while samples and samples[-1][0] >= at:  # guesses: after the last heard
                samples.pop()
        if not samples and start is not None and 0 < at - start <= self._window:
            samples.append((start, self._zero(counts)))
        if samples:
            last_at, last = samples[-1]
            if self._went_down(last, counts) or at - last_at > self._window:
                samples.clear()
            elif at <= last_at:
                return self._rates(samples)
        samples.append((at, counts))
        if not guessed:
            self._heard[key] = at
        # Keep one sample at or before the window's start, so the window is
        # covered whole once it has been observed that long.
        while len(samples) > 2 and samples[1][0] <= at - self._window:
            samples.popleft()
        return self._rates(samples)

    def _rates(self, samples: deque[tuple[float, Sample]]) -> Result | None:
        if len(samples) < 2:
            return None
        return self._per_second(samples, samples[-1][0] - samples[0][0])

    def _went_down(self, last: Sample, counts: Sample) -> bool:
        raise NotImplementedError

    def _zero(self, counts: Sample) -> Sample:
        """Counters of `counts`' shape, all 0."""
        raise NotImplementedError

    def _per_second(self, samples: deque[tuple[float, Sample]], seconds: float) -> Result:
        """The rates over the window's `samples` (two or more), `seconds` long."""
        raise NotImplementedError

    def retain(self, keys: set[str]) -> None:
        """Forget every key not in `keys` (proxies that left)."""
        for key in self._samples.keys() - keys:
            del self._samples[key]
            self._heard.pop(key, None)


def _fell(before: Counts, now: Counts) -> bool:
    """Whether some counter went down (or the counters changed shape)."""
    return len(before) != len(now) or any(n < p for n, p in zip(now, before, strict=True))


class RateMeter(WindowMeter[Counts, Rates]):
    """Rates of each key's tuple of counters (see WindowMeter)."""

    def _went_down(self, last: Counts, counts: Counts) -> bool:
        return _fell(last, counts)

    def _zero(self, counts: Counts) -> Counts:
        return (0,) * len(counts)

    def _per_second(self, samples: deque[tuple[float, Counts]], seconds: float) -> Rates:
        first, last = samples[0][1], samples[-1][1]
        return tuple((b - a) / seconds for a, b in zip(first, last, strict=True))


class NamedRateMeter(WindowMeter[Mapping[str, Counts], dict[str, Rates]]):
    """Rates of each key's counters by name, such as a tenant's in a proxy's
    report, which leaves out names with nothing to count and forgets the
    names counted longest ago (dataplane.metrics.MAX_LIMITED_TENANTS). Each
    name is measured on its own, step by step over the window's samples: in
    a step where it was missing before, or its counters fell (forgotten,
    then counted again from 0), it counts from 0; in one where it is missing
    after, nothing. A restart is a new session, so a new key (see
    WindowMeter). Rates are given for the names of the newest sample.
    """

    def _went_down(self, last: Mapping[str, Counts], counts: Mapping[str, Counts]) -> bool:
        return False  # per name, in _per_second

    def _zero(self, counts: Mapping[str, Counts]) -> Mapping[str, Counts]:
        return {}  # a name missing before counts from 0

    def _per_second(
        self, samples: deque[tuple[float, Mapping[str, Counts]]], seconds: float
    ) -> dict[str, Rates]:
        grown: dict[str, list[int]] = {}
        for (_, before), (_, after) in pairwise(samples):
            for name, now in after.items():
                was = before.get(name)
                if was is None or _fell(was, now):
                    was = (0,) * len(now)
                total = grown.setdefault(name, [0] * len(now))
                for i, (a, b) in enumerate(zip(was, now, strict=True)):
                    total[i] += b - a
        return {name: tuple(n / seconds for n in grown[name]) for name in samples[-1][1]}
