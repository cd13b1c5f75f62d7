"""The pure steps of a large request or answer, off the event loop.

A proxy serves every request on one event loop, so a step whose work grows
with one request's size (the parse of its body and the walks that check it,
its cache key, the parse of a large answer) holds everyone else's answers,
stream events and health checks for as long as it takes: a 5.4 MB body of
10,000 tools held them 0.6 s (bench/loop_stalls.py). Such steps of an input
past OFF_LOOP_ABOVE bytes run here instead, on one thread of their own; a
smaller one keeps its plain call on the loop, which costs nothing more.

The thread still shares the GIL with the loop: a Python step there yields it
to the loop at least every switch interval (5 ms), but one C call holds it to
its end (orjson's parse of a large body: tens of milliseconds), so such a
call is the most a step here can hold the loop for. One thread, so that big
inputs at once queue for it rather than each take the GIL from the loop in
turn.

A step handed here must be pure: it reads its arguments, changes nothing the
loop may read, and gives its result back (or raises). When the awaiting task
is cancelled (its client left) the step still runs to its end, and its
result is dropped: nothing it made is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar, TypeVarTuple

__all__ = ["OFF_LOOP_ABOVE", "OffLoop"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# Bytes of a body or an answer past which its size-proportional steps run
# off the loop. The costliest bytes measured (small arrays and objects: a
# body of tools) take about 0.12 ms a KB in all the request's steps, so a
# body of this size holds the loop some 15 ms at most; the hop to the thread
# and back (some 0.1 ms) is then small beside the work.
OFF_LOOP_ABOVE: Final = 128 << 10


class OffLoop:
    """Runs pure steps on one thread of its own, one at a time. Made by the
    app's composition root, shared by its steps, closed at its clean-up;
    its thread is started at the first step handed to it."""

    def __init__(self) -> None:
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="ponto-offloop")

    async def run(self, step: Callable[[*Ts], T], *args: *Ts) -> T:
        """`step(*args)`'s result (or its exception), computed on the thread."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, step, *args)

    def close(self) -> None:
        """Stop taking steps; those queued are dropped, a running one ends."""
        self._threads.shutdown(wait=False, cancel_futures=True)
