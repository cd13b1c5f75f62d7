"""Streams stalled on an origin the route table marks unhealthy end sooner.

A stream waits `--stream-idle-timeout` (60 s by default) for each chunk
before it counts as cut and is continued on another origin: long enough for
the slowest first token an origin may take. An origin that hangs (a wedged
GPU, a process stopped) leaves its streams waiting that long, though the
control plane's probes mark it unhealthy within seconds (trial 27). Once the
table marks a stream's origin unhealthy, each wait for a chunk of that
stream is bounded by `--unhealthy-stream-idle-timeout` (5 s by default)
instead, counted from the last chunk; the wait under way too. A stream that
still flows is left alone, whatever the probes say; one cut so is continued
on another origin as any stalled stream is (docs/streams.md).

Not for an origin that panic routing uses (`Routes.panic`: a model none of
whose origins is healthy): the probes are then more likely wrong than every
origin, and there is no healthy one to continue on.

Used from the loop's thread only. Per stream: one registration and one set
removal; per chunk: nothing (the cap lives in the stream's IdleTimeout).
"""

from __future__ import annotations

from typing import Final

from dataplane.routes import Routes
from dataplane.timer import IdleTimeout

__all__ = ["DEFAULT_UNHEALTHY_IDLE_S", "Stalls", "StreamWatch"]

DEFAULT_UNHEALTHY_IDLE_S: Final = 5.0


class StreamWatch:
    """One stream's registration: the origin it reads now and its idle bound."""

    __slots__ = ("_idle", "_stalls", "origin")

    def __init__(self, stalls: Stalls, origin: str) -> None:
        self._stalls = stalls
        self._idle: IdleTimeout | None = None
        self.origin = origin

    def attach(self, idle: IdleTimeout) -> None:
        """The stream's idle bound, made by its relay: capped now if its
        origin is unhealthy already."""
        self._idle = idle
        self._stalls.bound(self)

    def move(self, origin: str) -> None:
        """The stream goes on from `origin` (a continuation; "" for none):
        the bound follows that origin's health."""
        self._stalls.forget(self)
        self.origin = origin
        if origin:
            self._stalls.add(self)
        self._stalls.bound(self)

    def close(self) -> None:
        """The stream has ended."""
        self._stalls.forget(self)
        self._idle = None

    def cap(self, delay: float | None) -> None:
        if self._idle is not None:
            self._idle.cap(delay)


class Stalls:
    """The streams in flight by origin, and the origins the table marks unhealthy.

    `after_s` is the bound of a wait on an unhealthy origin's stream; None
    turns the whole thing off (`watch` gives None)."""

    def __init__(self, after_s: float | None = DEFAULT_UNHEALTHY_IDLE_S) -> None:
        self.after_s = after_s
        self.unhealthy: frozenset[str] = frozenset()
        self._streams: dict[str, set[StreamWatch]] = {}

    def watch(self, origin: str) -> StreamWatch | None:
        """Register a stream read from `origin`; close() the watch when it ends."""
        if self.after_s is None:
            return None
        watch = StreamWatch(self, origin)
        self.add(watch)
        return watch

    def on_apply(self, routes: Routes, policy: object) -> None:
        """A table was installed (a TableHolder hook): cap the streams of the
        origins it newly marks unhealthy, lift the cap of those it heals."""
        unhealthy = routes.unhealthy
        for name in unhealthy ^ self.unhealthy:
            delay = self.after_s if name in unhealthy else None
            for watch in self._streams.get(name, ()):
                watch.cap(delay)
        self.unhealthy = unhealthy

    def streams(self, origin: str) -> int:
        """Streams read from `origin` now."""
        return len(self._streams.get(origin, ()))

    # For StreamWatch.

    def add(self, watch: StreamWatch) -> None:
        self._streams.setdefault(watch.origin, set()).add(watch)

    def forget(self, watch: StreamWatch) -> None:
        streams = self._streams.get(watch.origin)
        if streams is not None:
            streams.discard(watch)
            if not streams:
                del self._streams[watch.origin]

    def bound(self, watch: StreamWatch) -> None:
        watch.cap(self.after_s if watch.origin in self.unhealthy else None)
