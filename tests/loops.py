"""The event loops tests run on (conftest's pytest_asyncio_loop_factories): a
new one per test, as pytest-asyncio makes, that finishes a gRPC completion
arriving after it closed instead of raising in whichever loop runs then.

Why: grpc.aio has one completion queue per process, polled by a thread of its
own, and hands each completion to the loop its call was made on: inline when
that loop is the one running, else through `call_soon_threadsafe`. A call
cancelled as a test ended (a proxy's control-plane link stopping mid-Register)
can complete after pytest-asyncio closed that test's loop; grpc then calls the
closed loop's `call_soon_threadsafe` from the loop of the next test that uses
gRPC, which raised "Event loop is closed", logged by asyncio as an ERROR of
that unrelated test ("Exception in callback PollerCompletionQueue._handle_events").
The product runs one loop per process for its whole life and never meets this.

What is finished: grpc's `_handle_callback_wrapper`, run at once, as grpc runs
it for the loop that is running. It completes the operation's future, which
the closing loop's runner cancelled with the task awaiting it (so it does
nothing), and releases grpc's reference to the operation. Any other callback
for a closed loop still raises. A future still awaited (an operation left
running by code the runner did not cancel) cannot complete on a closed loop:
that raises a RuntimeError naming the test whose loop it was, logged by asyncio
as the ERROR of the test running then.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
from collections.abc import Callable
from contextvars import Context
from typing import Any, TypeVarTuple

import uvloop

log = logging.getLogger(__name__)

_Ts = TypeVarTuple("_Ts")

# The callback grpc's poller gives call_soon_threadsafe for another loop's
# completion (grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi); the
# extension has no type stubs. A grpcio without it (a private name) leaves
# the loops as asyncio's: test_late_grpc_completions then fails, saying so.
GRPC_COMPLETION: Any = getattr(
    importlib.import_module("grpc._cython.cygrpc"), "_handle_callback_wrapper", None
)


def current_test() -> str:
    """The test (and phase) pytest is running, as PYTEST_CURRENT_TEST names it."""
    return os.environ.get("PYTEST_CURRENT_TEST", "no test")


class LateCompletions:
    """Late gRPC completions of one loop: counts them and finishes each.

    Owned by its loop; called on the thread of the loop that is running (the
    one whose gRPC reader took the completion), never concurrently.
    """

    def __init__(self) -> None:
        self.test = current_test()  # whose loop this is, for the messages
        self.finished = 0

    def take(self, closed: bool, callback: Callable[..., object], args: tuple[Any, ...]) -> bool:
        """Whether the callback was a late gRPC completion, now finished."""
        if not closed or GRPC_COMPLETION is None or callback is not GRPC_COMPLETION:
            return False
        # The operation's future, which grpc's wrapper holds (args[0]); gc
        # reads it, the extension has no attribute for it.
        if any(isinstance(r, asyncio.Future) and not r.done() for r in gc.get_referents(args[0])):
            raise RuntimeError(
                f"gRPC completed an operation of the loop of {self.test} after that loop "
                "closed, and its future was still awaited: a call was left running"
            )
        callback(*args)
        log.debug(
            "a gRPC completion for the closed loop of %s, finished during %s",
            self.test,
            current_test(),
        )
        self.finished += 1
        return True


def _finished_handle(
    callback: Callable[..., object], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop
) -> asyncio.Handle:
    # call_soon_threadsafe returns a handle; this one has nothing left to run.
    handle = asyncio.Handle(callback, args, loop)
    handle.cancel()
    return handle


class SelectorLoop(asyncio.SelectorEventLoop):
    """asyncio's loop, as asyncio.new_event_loop makes it, taking late gRPC completions."""

    def __init__(self) -> None:
        super().__init__()
        self.late = LateCompletions()

    def call_soon_threadsafe(
        self,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.Handle:
        if self.late.take(self.is_closed(), callback, args):
            return _finished_handle(callback, args, self)
        return super().call_soon_threadsafe(callback, *args, context=context)


class UvLoop(uvloop.Loop):
    """uvloop's loop (the proxy's) taking late gRPC completions."""

    def __init__(self) -> None:
        super().__init__()
        self.late = LateCompletions()

    def call_soon_threadsafe(
        self,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.Handle:
        if self.late.take(self.is_closed(), callback, args):
            return _finished_handle(callback, args, self)
        return super().call_soon_threadsafe(callback, *args, context=context)
