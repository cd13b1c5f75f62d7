"""A stream's head, committed while its origin thinks (--stream-hold-seconds).

The forwarder holds a stream until its origin's first event so that a failing
origin can still be replaced (dataplane.upstream.forwarder). A reasoning model
may think a minute before that event, and every intermediary between client
and proxy with a read timeout (nginx's proxy_read_timeout, 60 s by default;
Envoy's route timeout, 15 s; a cloud load balancer's idle timeout) answers its
own 504 meanwhile. Past the hold, the client is sent the stream's head
(`200 text/event-stream`) and SSE comments, which every SSE client skips,
until the first event: failover goes on behind them, since no event has been
sent, and a failure before any event becomes the stream's in-band error event
(dataplane.http.reply.held_failed), as a cut stream's is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from dataplane.timer import LazyTimer, not_before_a_grain

# What keeps an idle connection alive: an SSE comment (a line that begins
# with a colon), which clients and the OpenAI SDKs skip.
KEEP_ALIVE = b": keep-alive\n\n"
# Between two keep-alives: under every common intermediary's read timeout
# (Envoy's 15 s route timeout, nginx's 60 s, an ALB's 60 s idle timeout).
KEEP_ALIVE_EVERY_S = 5.0


class Holds:
    """The holds of one loop's streams, all `hold_s` long, on one LazyTimer:
    a head made with them (`HeldHead`'s `holds`) is a dict entry, set and
    popped, where its own timer, armed and cancelled, cost some 3,000
    instructions more a stream (callgrind; uvloop's call_later and cancel),
    nearly every one answered within its hold. Heads are kept in the order
    they are made, which is their deadlines' order (one hold for all); the
    timer, armed for the first, is left to find the queue as it is then
    (nothing, mostly), and fires about once a hold under steady load. Used
    from its loop's thread only; its timer is on `loop` when given (a test's
    clock), else on the loop running at the first hold."""

    __slots__ = ("_armed", "_loop", "_queue", "_timer", "hold_s")

    def __init__(self, hold_s: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.hold_s = hold_s
        self._queue: dict[HeldHead, float] = {}  # each head's deadline, in order
        self._loop = loop
        # Made with the loop: `add` makes both when none was given.
        self._timer = None if loop is None else LazyTimer(loop)
        self._armed = False  # the timer will sweep the queue

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, head: HeldHead) -> None:
        """`head` commits `hold_s` from now, unless `remove` comes first."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._timer = LazyTimer(loop)
        due = self._queue[head] = loop.time() + self.hold_s
        if not self._armed:
            assert self._timer is not None
            self._armed = True
            self._timer.arm_at(due, self._sweep)

    def remove(self, head: HeldHead) -> None:
        self._queue.pop(head, None)

    def _sweep(self) -> None:
        """Commit the heads whose hold has passed (the first ones), then wait
        for the next."""
        assert self._loop is not None and self._timer is not None
        now = self._loop.time()
        queue = self._queue
        while queue:
            head, due = next(iter(queue.items()))
            if due > now:
                self._timer.arm_at(not_before_a_grain(due, now), self._sweep)
                return
            del queue[head]
            head.commit()
        self._armed = False


class HeldHead:
    """Commits a stream's head `hold_s` seconds after it is made, unless
    `stop` (or `abandon`) comes first, then writes KEEP_ALIVE every
    `every_s` seconds. Made by the request's handler before it awaits its
    origin's answer; the head and the comments are written by a task of this
    object's, on the handler's loop, and never while the handler writes: the
    handler writes only once `stop` has returned.

    A request that gets its answer within the hold costs one timer, armed and
    cancelled (with `holds`, an entry of theirs); nothing else. `make` makes
    the head's response (status 200 and the stream's headers), `prepare`
    sends it. `sent`: a head sent already (a coalesced follower's, whose
    flight failed before an event: its own call then goes on behind it),
    whose comments go on, the first `every_s` after this is made. With
    `holds` (whose `hold_s` it is), the hold is theirs, not a timer of its
    own."""

    __slots__ = ("_every_s", "_holds", "_make", "_prepare", "_task", "_timer", "out")

    def __init__(
        self,
        hold_s: float,
        make: Callable[[], web.StreamResponse],
        prepare: Callable[[web.StreamResponse], Awaitable[None]],
        every_s: float = KEEP_ALIVE_EVERY_S,
        sent: web.StreamResponse | None = None,
        holds: Holds | None = None,
    ) -> None:
        self._make = make
        self._prepare = prepare
        self._every_s = every_s
        self._task: asyncio.Task[None] | None = None
        self.out: web.StreamResponse | None = sent  # once the head is sent
        self._timer: asyncio.TimerHandle | None = None
        if sent is None and holds is not None and holds.hold_s == hold_s:
            self._holds: Holds | None = holds
            holds.add(self)
        else:
            self._holds = None
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(hold_s if sent is None else every_s, self.commit)

    def commit(self) -> None:
        """The hold has passed: the head (and comments) go out from now."""
        self._task = asyncio.get_running_loop().create_task(self._beat())

    def _unhold(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        elif self._holds is not None:
            self._holds.remove(self)

    async def _beat(self) -> None:
        # Known before it is sent: a stop during `prepare` may find the
        # head begun, and the rest of the stream must follow it.
        out = self.out
        if out is None:
            out = self.out = self._make()
            await self._prepare(out)
        while True:
            # At once too: a head alone may wait in the connection's buffer.
            await out.write(KEEP_ALIVE)
            await asyncio.sleep(self._every_s)

    async def stop(self) -> web.StreamResponse | None:
        """No more comments: the response whose head was sent (the caller
        writes the rest of the stream to it), or None when it was not.
        A write that found the client gone leaves the response for the
        caller's next write to find so."""
        self._unhold()
        task = self._task
        if task is not None:
            task.cancel()
            # Not `await task`: a cancellation of the caller's own must not be
            # taken for the task's.
            await asyncio.wait((task,))
            exc = None if task.cancelled() else task.exception()
            if exc is not None and not isinstance(exc, ConnectionError):
                raise exc  # a bug of the head's: a client gone is found by the next write
        out = self.out  # `sent`, when no comment was due yet
        return out if out is not None and out.prepared else None

    def abandon(self) -> None:
        """The request ends otherwise (its client left, a bug): nothing more
        is written, at once."""
        self._unhold()
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # a write that found the client gone: its leaving is told otherwise
