"""Per-second rates from cumulative counters that proxies report.

Pure: the caller passes each sample's time (when the counters were valid, as
the replica that heard them recorded it), so nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque

Counts = tuple[int, ...]


class RateMeter:
    """Rates of each key's counters over a sliding window of its samples.

    A rate is the difference between the newest sample and the oldest one
    still in the window, over the time between them, so a report that came
    late or twice does not make a spike. A counter smaller than the previous
    sample means the proxy restarted, and a gap longer than the window since
    the previous sample means nobody looked meanwhile (the caller samples on
    demand): either way the history is dropped and the rate is unknown until
    the next sample, never negative nor an average over the gap. Callers key
    by one connection of a proxy (name and session), so a restarted proxy
    starts afresh even once its new counters pass the old ones. Used from one
    event loop.
    """

    def __init__(self, window: float = 10.0) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self._window = window
        self._samples: dict[str, deque[tuple[float, Counts]]] = {}

    def observe(self, key: str, at: float, counts: Counts) -> tuple[float, ...] | None:
        """Add a sample (ignored if not newer than the last) and return the
        rates per second over the window, or None while they are unknown."""
        samples = self._samples.setdefault(key, deque())
        if samples:
            last_at, last = samples[-1]
            if (
                len(last) != len(counts)
                or any(n < p for n, p in zip(counts, last, strict=True))
                or at - last_at > self._window
            ):
                samples.clear()
            elif at <= last_at:
                return self._rates(samples)
        samples.append((at, counts))
        # Keep one sample at or before the window's start, so the window is
        # covered whole once it has been observed that long.
        while len(samples) > 2 and samples[1][0] <= at - self._window:
            samples.popleft()
        return self._rates(samples)

    @staticmethod
    def _rates(samples: deque[tuple[float, Counts]]) -> tuple[float, ...] | None:
        if len(samples) < 2:
            return None
        (t0, first), (t1, last) = samples[0], samples[-1]
        return tuple((b - a) / (t1 - t0) for a, b in zip(first, last, strict=True))

    def retain(self, keys: set[str]) -> None:
        """Forget every key not in `keys` (proxies that left)."""
        for key in self._samples.keys() - keys:
            del self._samples[key]
