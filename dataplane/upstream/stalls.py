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

The same holds before an origin answers at all (trial 49: a whole answer
waited for the read timeout, 300 s, on an origin the probes had marked
unhealthy within 4 s; a stream's first chunk, the first-chunk timeout): a
call not yet answered (`CallWatch`: the forwarder's, until its status and,
for a stream, its first chunk) is cut `--unhealthy-stream-idle-timeout`
after the table marks its origin unhealthy, and the next origin is tried,
as after any attempt that failed before the client had a byte.

Not for an origin that panic routing uses (`Routes.panic`: a model none of
whose origins is healthy): the probes are then more likely wrong than every
origin, and there is no healthy one to continue on.

Used from the loop's thread only. Per stream and per origin call: one
registration and one set removal; per chunk: nothing (the cap lives in the
stream's IdleTimeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Final, Protocol

from dataplane.routes import Routes
from dataplane.timer import IdleTimeout, cut_by_bound

__all__ = [
    "DEFAULT_UNHEALTHY_IDLE_S",
    "NO_WATCH",
    "CallWatch",
    "NoWatch",
    "Stalled",
    "Stalls",
    "StreamWatch",
]

DEFAULT_UNHEALTHY_IDLE_S: Final = 5.0


class _Watch(Protocol):
    origin: str

    def cap(self, delay: float | None) -> None: ...


class Stalled(Exception):
    """A call `CallWatch` cut: its origin, marked unhealthy, had not answered."""


class CallWatch:
    """One origin call until it has answered, as `with watch:` around it in
    `task`, the task that makes it: cut (the block raises Stalled) `after_s`
    seconds after the table marks its origin unhealthy (after its start when
    it is already), but not before it has run twice as long as the origin's
    calls of its kind usually take to answer (Stalls.usual), so that probes
    slow on a loaded origin do not cut the long answers it is still giving
    (helper-191). A cancellation from elsewhere goes on as CancelledError."""

    __slots__ = (
        "_cancelling", "_expired", "_handle", "_stalls", "_started", "_stream", "_task", "origin",
    )  # fmt: skip

    def __init__(
        self, stalls: Stalls, origin: str, task: asyncio.Task[object], stream: bool = False
    ) -> None:
        self._stalls = stalls
        self.origin = origin
        self._task = task
        self._stream = stream
        self._started = 0.0  # loop time
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._expired = False

    def __enter__(self) -> CallWatch:
        self._started = self._task.get_loop().time()
        self._cancelling = self._task.cancelling()
        stalls = self._stalls
        # Stalls.add's and Stalls.forget's steps, not calls of them: every
        # origin call is watched (a Python call, some 400 instructions each).
        stalls._streams.setdefault(self.origin, set()).add(self)
        # Stalls.bound, without its calls for the usual healthy origin: a
        # new watch has no cap to lift.
        if self.origin in stalls.unhealthy:
            self.cap(stalls.after_s)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        watches = self._stalls._streams  # Stalls.forget's steps: see __enter__
        calls = watches.get(self.origin)
        if calls is not None:
            calls.discard(self)
            if not calls:
                del watches[self.origin]
        if self._handle is not None:
            self.cap(None)
        if self._expired and cut_by_bound(self._task, self._cancelling, exc_type):
            raise Stalled(
                f"no answer within {self._stalls.after_s:g} s of the route table marking "
                "it unhealthy (--unhealthy-stream-idle-timeout)"
            ) from exc

    def cap(self, delay: float | None) -> None:
        """Cut the call `delay` seconds from now, or at twice its usual time
        to answer if that is later (None: not at all)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()
        if delay is not None and not self._expired:
            loop = self._task.get_loop()
            usual = self._stalls.usual(self.origin, self._stream) or 0.0
            when = max(loop.time() + delay, self._started + 2 * usual)
            self._handle = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._handle = None
        self._expired = True
        self._task.cancel()


class NoWatch:
    """A CallWatch that watches nothing (the watch is off)."""

    __slots__ = ()

    def __enter__(self) -> NoWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NO_WATCH: Final = NoWatch()


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
    turns the whole thing off (`watch` gives None; the forwarder then makes no
    CallWatch, its NO_WATCH in place)."""

    def __init__(self, after_s: float | None = DEFAULT_UNHEALTHY_IDLE_S) -> None:
        self.after_s = after_s
        self.unhealthy: frozenset[str] = frozenset()
        self._streams: dict[str, set[_Watch]] = {}
        # Seconds an origin's calls (streams: to their first chunk) usually
        # take to answer, or None; the forwarder's (its CommitTimes.p95).
        self.usual: Callable[[str, bool], float | None] = lambda origin, stream: None

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
        """Streams read from `origin` now, and calls to it not yet answered."""
        return len(self._streams.get(origin, ()))

    # For the watches (CallWatch takes these steps itself: see its __enter__).

    def add(self, watch: _Watch) -> None:
        self._streams.setdefault(watch.origin, set()).add(watch)

    def forget(self, watch: _Watch) -> None:
        streams = self._streams.get(watch.origin)
        if streams is not None:
            streams.discard(watch)
            if not streams:
                del self._streams[watch.origin]

    def bound(self, watch: _Watch) -> None:
        watch.cap(self.after_s if watch.origin in self.unhealthy else None)
