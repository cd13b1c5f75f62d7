"""Strictly first-come, first-served slots for the simulator's queues."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

__all__ = ["FifoSlots"]


class FifoSlots:
    """A counting semaphore that grants its slots in arrival order.

    A released slot is handed straight to the oldest waiter, so a newcomer can
    never take it first; :class:`asyncio.Semaphore` gives no such promise on
    every Python version we support, and a vLLM-like queue must be FIFO. A
    waiter cancelled while queued leaves the queue; one cancelled just after it
    was granted a slot passes the slot on.

    Bound to the event loop it is first used on; not thread-safe.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Return how many callers are queued in :meth:`acquire`."""
        return len(self._waiters)

    async def acquire(self) -> None:
        """Wait for a slot, behind every earlier caller still waiting."""
        if self._free and not self._waiters:
            self._free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(granted)
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest waiter if there is one, else to the pool."""
        while self._waiters:
            granted = self._waiters.popleft()
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold a slot for the duration of the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
