"""The signals a proxy or a group acts on, held until their handlers are in.

- SIGTERM and SIGINT stop a proxy or a group (STOP_SIGNALS).
- SIGHUP (RELOAD_SIGNAL) makes a group's supervisor restart its workers one
  at a time, each new one listening before the old one leaves, so that they
  read their files again (certificates, the GeoIP database, the code) while
  the port keeps listening (dataplane.supervisor). A single proxy and a worker
  log it and go on.
- SIGUSR2 (LEAVE_SIGNAL) is how the supervisor retires a worker whose
  replacement listens: it stops listening, finishes the requests it holds and
  exits, without the drain a proxy leaving its load balancer needs.

They are held (blocked) from `ponto-proxy`'s first line (dataplane.__main__),
through a group's exec of its supervisor, and in every worker from its fork,
until the process has its handlers in place: one that comes earlier (a Ctrl-C
or a rollout in the first second) then waits for them, instead of killing the
process mid-import with a traceback (SIGINT) or an unclean exit (SIGTERM, and
SIGHUP and SIGUSR2, whose default action is to end the process). The mask is
inherited through fork and exec.

This module imports `signal` alone: it runs before everything else.
"""

from __future__ import annotations

import signal
from types import TracebackType

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
RELOAD_SIGNAL = signal.SIGHUP
LEAVE_SIGNAL = signal.SIGUSR2
HELD_SIGNALS = STOP_SIGNALS | {RELOAD_SIGNAL, LEAVE_SIGNAL}


class signals_held:
    """Hold HELD_SIGNALS in this thread for the block (and in processes
    started in it), then take the mask as it was before."""

    def __enter__(self) -> None:
        self._before = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._before)


def take_signals() -> None:
    """Let HELD_SIGNALS in, once the process has a handler for each: one that
    came while they were held is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
