"""Keep local processes running: report each death, start it again after a backoff.

`ponto-demo` watches its etcd, control plane, origins and proxies with this, so a
user can kill any of them (an origin, to watch failover) and the demo stays up.
The supervisor only decides: it reads the clock it is given, starts processes
through the launchers it is given and reports through the callable it is given,
so the tests drive it with fakes and no sleeping.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Process(Protocol):
    """A started child, as the supervisor sees it."""

    @property
    def pid(self) -> int: ...

    def returncode(self) -> int | None:
        """None while it runs; once it has ended, its exit status (-N: killed by signal N)."""
        ...

    def sent_signal(self) -> int | None:
        """The signal its owner sent it to stop it, if any (None: not stopped by us)."""
        ...


Launcher = Callable[[], Process]
"""Start the child again, as it was (address, arguments, state); return once it
serves, or raise if it cannot. It may block: the supervisor's owner waits."""


@dataclass(frozen=True)
class Backoff:
    """Delays between a death and the next start: `first`, doubling up to `limit`.

    A child that stayed up `stable_after` seconds before dying starts again after
    `first`: the doubling only slows a crash loop, not an occasional kill.
    """

    first: float = 0.5
    limit: float = 10.0
    stable_after: float = 30.0

    def after(self, delay: float) -> float:
        return min(delay * 2, self.limit)


def describe_exit(status: int, sent: int | None = None) -> str:
    """`exited with code 3`, `killed by SIGKILL`: an exit status in a user's
    words, and whether the demo itself sent the signal (`sent`).

    The demo's children serve until a SIGTERM or SIGINT, on which ponto's
    own and redis-server shut down and exit 0 (etcd dies by the signal
    again, which the status says): a code 0 the demo did not cause is one
    of those signals from someone else (trial: a user's
    `kill PID` read "exited with code 0", as if the child had ended by
    itself). Which of the two is not known: the exit status does not say."""
    if sent is not None:
        by = f"stopped by the demo ({_signal_name(sent)})"
        if status in (0, -sent):
            return by
        return f"{by}; {describe_exit(status)}"
    if status < 0:
        return f"killed by {_signal_name(-status)}"
    if status == 0:
        return "stopped by SIGTERM or SIGINT, not from the demo (exit code 0)"
    return f"exited with code {status}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _first_line(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0].rstrip(":")


@dataclass
class _Child:
    name: str
    launch: Launcher
    process: Process | None  # None between a death and the next successful start
    pid: int  # the last one started, for the reports
    started_at: float
    delay: float
    restart_at: float = 0.0


class Supervisor:
    """Watches named children; `poll()` restarts the dead ones when their delay is over.

    One owner calls `poll()` in a loop (not thread-safe). Stopping the children
    is the owner's job: the supervisor never signals a process.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        report: Callable[[str], None],
        backoff: Backoff = Backoff(),
    ) -> None:
        self._clock = clock
        self._report = report
        self._backoff = backoff
        self._children: dict[str, _Child] = {}

    def watch(self, name: str, process: Process, launch: Launcher) -> None:
        """Watch `process` (already started), to be started again with `launch`."""
        self._children[name] = _Child(
            name, launch, process, process.pid, self._clock(), self._backoff.first
        )

    def poll(self) -> None:
        """Report the children that died since the last call; start the ones now due."""
        for child in self._children.values():
            if child.process is not None:
                self._check(child)
            elif self._clock() >= child.restart_at:
                self._restart(child)

    def _check(self, child: _Child) -> None:
        assert child.process is not None
        status = child.process.returncode()
        if status is None:
            return
        now = self._clock()
        if now - child.started_at >= self._backoff.stable_after:
            child.delay = self._backoff.first
        sent = child.process.sent_signal()
        child.process = None
        child.restart_at = now + child.delay
        self._report(
            f"{child.name} (pid {child.pid}) {describe_exit(status, sent)}; "
            f"restarting it in {child.delay:g} s"
        )
        child.delay = self._backoff.after(child.delay)

    def _restart(self, child: _Child) -> None:
        try:
            process = child.launch()
        # Whatever went wrong is the child's failure to start (a port still
        # taken, an exit before it was ready): report it and try again later
        # rather than end the supervisor and every other child with it.
        except Exception as exc:
            child.restart_at = self._clock() + child.delay
            self._report(
                f"{child.name} did not start again ({type(exc).__name__}: {_first_line(exc)}); "
                f"next try in {child.delay:g} s"
            )
            child.delay = self._backoff.after(child.delay)
            return
        child.process = process
        child.pid = process.pid
        child.started_at = self._clock()
        self._report(f"{child.name} is back (pid {process.pid})")
