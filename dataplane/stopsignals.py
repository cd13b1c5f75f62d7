"""The signals that stop a proxy or a group, held until their handlers are in.

SIGTERM and SIGINT are held (blocked) from `ponto-proxy`'s first line
(dataplane.__main__), through a group's exec of its supervisor, and in every
worker from its fork, until the process has its handlers in place: one that
comes earlier (a Ctrl-C or a rollout in the first second) then waits for
them, instead of killing the process mid-import with a traceback (SIGINT) or
an unclean exit (SIGTERM). The mask is inherited through fork and exec.

This module imports `signal` alone: it runs before everything else.
"""

from __future__ import annotations

import signal
from types import TracebackType

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class stop_signals_held:
    """Hold STOP_SIGNALS in this thread for the block (and in processes
    started in it), then take the mask as it was before."""

    def __enter__(self) -> None:
        self._before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._before)


def take_stop_signals() -> None:
    """Let STOP_SIGNALS in, once their handlers are installed: one that came
    while they were held is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
