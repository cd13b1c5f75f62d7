"""Coalescing identical concurrent cache misses into one origin call (singleflight).

The first request to miss on a key becomes the flight's `Leader`: it calls the
origin, publishes every chunk of bytes it relays to its own client, and finally
the outcome. Requests that miss on the same key while the flight is in the air
become `Follower`s: a streaming follower iterates the same chunks from the
beginning (a late joiner first gets the ones already buffered, then the live
ones); a non-streaming follower awaits `result()`.

Outcomes, as the leader reports them with `finish(entry, error)`:

- `error` set (origin failure, cut stream, leader cancelled): iteration and
  `result()` raise `FlightFailed`; `delivered` says how many bytes that follower
  had already been given. With nothing delivered the caller makes its own origin
  call; otherwise it ends its stream as a relay cut ends one. When the leader
  was cancelled (`Follower.leader_left`: its client left before the answer
  started), the followers with nothing hand off rather than each calling: the
  first to `join` again leads a new flight and the others follow it
  (dataplane.cache.step.EdgeCache.own_call), so one client giving up does not
  turn a burst of identical requests into as many origin calls.
- no error: iteration ends normally (the follower has every chunk);
  `result()` returns `entry`, or raises `FlightFailed` when the leader had no
  entry to give (a non-streamed answer that is not cacheable, a stream too large
  to record), so that a follower with nothing yet makes its own call.

Followers that are still there: a follower is the flight's from `join` until
it leaves (`Follower.leave`, its `with` block's end), whatever it got.
`Leader.followed` says whether any is there; `Leader.when_deserted` asks to be
told when the last one leaves before the outcome. A leader whose own client
has gone goes on for the followers there are, and stops once they have left
(dataplane.http.pipeline.Pipeline.lead).

Memory: a flight buffers its chunks so late joiners can start from the first.
Past `max_buffer_bytes` it stops taking joiners (they start a new flight of
their own), drops the chunks every follower already has, and fails any follower
that lags further behind than the bound: the leader never waits for followers.

The relay (dataplane.streaming.relay) hands the leader every chunk it passes
to the leader's client. Once followed, the leader's client does not pace the
relay either: its writes are queued, up to the same bound, past which it is
cut as a lagging follower is (dataplane.http.reply.LeaderStream).

Everything runs on one event loop; nothing here is thread-safe. The leader never
blocks; followers wait on an asyncio.Event that is set and replaced at each
change (no polling).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from dataplane.cache.entry import CachedResponse


class FlightFailed(Exception):
    """The flight a follower joined cannot answer it (see the module docstring)."""

    def __init__(self, reason: str, *, delivered: int) -> None:
        super().__init__(reason)
        self.reason = reason
        # Bytes this follower had yielded before the failure.
        self.delivered = delivered


class LeaderGone(Exception):
    """The leader left its `with` block without reporting an outcome."""


@dataclass(frozen=True, slots=True)
class CoalescerStats:
    flights: int = 0  # leaders registered
    followers: int = 0  # requests that joined a flight instead of calling the origin
    overflows: int = 0  # flights that outgrew the buffer and stopped taking joiners
    lagged: int = 0  # followers failed for falling too far behind
    in_flight: int = 0


class _Flight:
    __slots__ = (
        "base",
        "buffered",
        "changed",
        "chunks",
        "done",
        "entry",
        "failure",
        "followers",
        "joinable",
        "key",
        "lagged",
        "leader_left",
        "on_deserted",
        "on_joined",
        "positions",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.chunks: list[bytes] = []
        # Index (since the first chunk) of chunks[0]; > 0 once trimmed.
        self.base = 0
        self.buffered = 0
        self.joinable = True
        self.done = False
        self.entry: CachedResponse | None = None
        # What followers are told of a failure (`_describe`), and whether it
        # was the leader's cancellation: not the exception, whose traceback
        # holds the leader's frames (its request and body, and through its
        # cache plan this flight: a cycle only a full collection frees).
        self.failure: str | None = None
        self.leader_left = False
        # Made by the first follower that waits: most flights have none.
        self.changed: asyncio.Event | None = None
        # Follower id -> index of the next chunk it will take. Only followers
        # that may still iterate are here; they hold back trimming.
        self.positions: dict[int, int] = {}
        self.lagged: set[int] = set()
        # Followers that joined and have not left yet (iterating or not).
        self.followers = 0
        self.on_deserted: Callable[[], None] | None = None
        self.on_joined: Callable[[], None] | None = None

    def wake(self) -> None:
        # Waiters hold the old event; the next to wait makes a fresh one.
        changed, self.changed = self.changed, None
        if changed is not None:
            changed.set()

    async def wait(self) -> None:
        """Return at the flight's next change (a chunk, or its outcome)."""
        changed = self.changed
        if changed is None:
            changed = self.changed = asyncio.Event()
        await changed.wait()


class Coalescer:
    """Flights by cache key. One per proxy process, owned by the app.

    `join` must be called right after an exact-cache miss, with no await in
    between, and the leader must store its entry before calling `finish`: then a
    request either finds the entry, or finds the flight, or starts one.
    """

    def __init__(self, *, max_buffer_bytes: int = 4 << 20) -> None:
        if max_buffer_bytes <= 0:
            raise ValueError(f"max_buffer_bytes must be positive, not {max_buffer_bytes}")
        self.max_buffer_bytes = max_buffer_bytes
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count()
        self._flights_started = self._followers = self._overflows = self._lagged = 0

    def join(self, key: str) -> Leader | Follower:
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = _Flight(key)
            self._flights_started += 1
            return Leader(self, flight)
        self._followers += 1
        flight.followers += 1
        follower = Follower(flight, next(self._ids))
        if flight.on_joined is not None:
            flight.on_joined()
        return follower

    @property
    def stats(self) -> CoalescerStats:
        return CoalescerStats(
            flights=self._flights_started,
            followers=self._followers,
            overflows=self._overflows,
            lagged=self._lagged,
            in_flight=len(self._flights),
        )

    def _release(self, flight: _Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    def _publish(self, flight: _Flight, data: bytes) -> None:
        flight.chunks.append(data)
        flight.buffered += len(data)
        if flight.buffered > self.max_buffer_bytes:
            if flight.joinable:
                flight.joinable = False
                self._overflows += 1
                self._release(flight)
            self._trim(flight)
        flight.wake()

    def _trim(self, flight: _Flight) -> None:
        """Drop chunks every follower has; fail the slowest while still over."""
        while True:
            keep_from = min(flight.positions.values(), default=flight.base + len(flight.chunks))
            drop = keep_from - flight.base
            if drop > 0:
                flight.buffered -= sum(len(c) for c in flight.chunks[:drop])
                del flight.chunks[:drop]
                flight.base = keep_from
            if flight.buffered <= self.max_buffer_bytes or not flight.positions:
                return
            slowest = min(flight.positions, key=flight.positions.__getitem__)
            del flight.positions[slowest]
            flight.lagged.add(slowest)
            self._lagged += 1


class Leader:
    """The request that calls the origin for a flight. Owned by that request's task.

    Whatever happens, `finish` must be called, so followers never wait for an
    outcome that will not come: the pipeline does it through
    `CachePlan.abandon`; as a context manager, leaving the block without
    `finish` (an exception, a cancellation) reports a failure.
    """

    def __init__(self, coalescer: Coalescer, flight: _Flight) -> None:
        self._coalescer = coalescer
        self._flight = flight

    @property
    def key(self) -> str:
        return self._flight.key

    @property
    def finished(self) -> bool:
        return self._flight.done

    @property
    def followed(self) -> bool:
        """Whether a follower is there (joined, and has not left)."""
        return self._flight.followers > 0

    @property
    def max_buffer_bytes(self) -> int:
        """The flight's bound, which its leader's own client is held to once
        followed (dataplane.http.reply.LeaderStream), as its followers are."""
        return self._coalescer.max_buffer_bytes

    def when_deserted(self, callback: Callable[[], None]) -> None:
        """Call `callback` (once, synchronously, from the leaving follower's
        `leave`) when the last follower leaves before the outcome; at once
        when none is there now. Replaces an earlier callback."""
        flight = self._flight
        if flight.done:
            return
        if flight.followers == 0:
            flight.on_deserted = None
            callback()
            return
        flight.on_deserted = callback

    def when_joined(self, callback: Callable[[], None]) -> None:
        """Call `callback` (synchronously, from `Coalescer.join`) each time a
        follower joins, after it has. Replaces an earlier callback."""
        self._flight.on_joined = callback

    def chunk(self, data: bytes) -> None:
        """Publish bytes exactly as relayed to the leader's own client. Never blocks."""
        if self._flight.done:
            raise RuntimeError("chunk() after finish()")
        if data:
            self._coalescer._publish(self._flight, data)

    def finish(self, entry: CachedResponse | None, error: BaseException | None = None) -> None:
        """Report the outcome; see the module docstring. Later calls are ignored."""
        flight = self._flight
        if flight.done:
            return
        flight.done = True
        flight.entry = entry if error is None else None
        if error is not None:
            flight.failure = _describe(error)
            flight.leader_left = isinstance(error, asyncio.CancelledError)
        # Nobody joins a flight that ended: its leader's callbacks (its
        # LeaderStream's, which holds the leader, a cycle, and its client's
        # answer and so its request) are let go of.
        flight.on_deserted = flight.on_joined = None
        self._coalescer._release(flight)
        flight.wake()

    def __enter__(self) -> Leader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._flight.done:
            self.finish(None, exc or LeaderGone("the leader ended without an outcome"))


class Follower:
    """A request waiting on another's origin call. Owned by that request's task.

    Either iterate it (`async for chunk in follower`, streaming requests) and
    then, if nothing came (the leader did not stream), await `result()`; or only
    await `result()` (non-streaming requests). Use it as a context manager, or
    call `leave()`, so a follower whose client has gone stops holding chunks in
    the buffer and stops counting as one the origin call goes on for.
    """

    def __init__(self, flight: _Flight, ident: int) -> None:
        self._flight = flight
        self._id = ident
        self._next = 0
        self.delivered = 0
        self._left = False
        flight.positions[ident] = 0

    def __aiter__(self) -> Follower:
        return self

    async def __anext__(self) -> bytes:
        flight = self._flight
        while True:
            if self._id in flight.lagged:
                self.close()
                raise FlightFailed("fell too far behind the leader", delivered=self.delivered)
            if self._id not in flight.positions and not flight.done:
                raise RuntimeError("iterating a follower after close() or result()")
            at = self._next - flight.base
            if at < 0:
                raise FlightFailed("its chunks were already dropped", delivered=self.delivered)
            if at < len(flight.chunks):
                data = flight.chunks[at]
                self._next += 1
                flight.positions[self._id] = self._next
                self.delivered += len(data)
                return data
            if flight.done:
                self.close()
                if flight.failure is not None:
                    raise FlightFailed(flight.failure, delivered=self.delivered)
                raise StopAsyncIteration
            await flight.wait()

    async def result(self) -> CachedResponse:
        """The leader's entry once it has finished; raises FlightFailed when there
        is none. Ends this follower's interest in chunks."""
        flight = self._flight
        self.close()
        while not flight.done:
            await flight.wait()
        if flight.entry is None:
            reason = flight.failure or "the answer was not kept"
            raise FlightFailed(reason, delivered=self.delivered)
        return flight.entry

    @property
    def leader_left(self) -> bool:
        """Whether the flight failed because its leading request was cancelled
        (its client left, or the proxy is stopping) rather than because its
        origin call failed: its followers then hand off (the first to `join`
        again leads a new flight, the rest follow that one)."""
        flight = self._flight
        return flight.done and flight.leader_left

    def close(self) -> None:
        """Take no more chunks (this follower still waits for the outcome)."""
        self._flight.positions.pop(self._id, None)
        self._flight.lagged.discard(self._id)

    def leave(self) -> None:
        """Done with the flight (answered or not). Idempotent. The last
        follower to leave before the outcome tells the leader (`when_deserted`)."""
        self.close()
        if self._left:
            return
        self._left = True
        flight = self._flight
        flight.followers -= 1
        if flight.followers == 0 and not flight.done and flight.on_deserted is not None:
            callback, flight.on_deserted = flight.on_deserted, None
            callback()

    def __enter__(self) -> Follower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leave()


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "the leading request was cancelled"
    return f"the leading request failed: {type(error).__name__}: {error}"
