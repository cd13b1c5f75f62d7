"""The supervisor of `ponto-proxy --workers N` (dataplane.workers says what the group does).

`ponto-proxy` checks its whole command line first, as a single proxy does, so
that a bad value stops the start once and says so in one line. For a group it
then replaces itself (exec: the same pid, which a container's init and signals
see) with `python -m dataplane.supervisor GROUP ARGV...`: GROUP is the JSON of
`Group`, the few settings the supervisor uses, and ARGV the proxy's command
line, which every worker is started with. The supervisor serves no traffic and
imports the standard library alone (a test holds it to that): it holds some
15 MB of memory where the proxy that checked the flags held about 58 (aiohttp,
gRPC and the rest, which only the workers use).

Here too: the names of a group's files (the private sockets and ready files of
its run directory), the port's reservation (SO_REUSEPORT), and ListenError,
which workers raise as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dataplane.stopsignals import STOP_SIGNALS, stop_signals_held, take_stop_signals
from ponto.logs import setup_logging
from ponto.writefile import write_atomic

if TYPE_CHECKING:
    from dataplane.settings import Settings

log = logging.getLogger("dataplane.workers")

# After SIGTERM a worker drains for --drain-seconds, then aiohttp gives in-flight
# requests up to 60 s, and its clean-up (the control-plane link, the saved
# state, the logs) follows; a worker still running 15 s after that is killed.
SHUTDOWN_GRACE_S = 75.0


@dataclass(frozen=True, slots=True)
class Group:
    """What the supervisor uses of the proxy's settings."""

    workers: int
    listen_host: str
    listen_port: int
    metrics_listen: tuple[str, int] | None
    name: str
    ready_file: str | None
    drain_seconds: float
    log_level: str

    @classmethod
    def of(cls, settings: Settings) -> Group:
        return cls(
            workers=settings.workers,
            listen_host=settings.listen_host,
            listen_port=settings.listen_port,
            metrics_listen=settings.metrics_listen,
            name=settings.name,
            ready_file=str(settings.ready_file) if settings.ready_file else None,
            drain_seconds=settings.drain_seconds,
            log_level=settings.log_level,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Group:
        fields = json.loads(text)
        metrics = fields.pop("metrics_listen")
        return cls(**fields, metrics_listen=tuple(metrics) if metrics else None)


def become_supervisor(group: Group, argv: Sequence[str]) -> NoReturn:
    """Replace this process (checked settings in hand) with the supervisor of
    `group`, whose workers run the proxy with `argv`."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Held until the supervisor's run() has its handlers (the mask survives exec).
    with stop_signals_held():
        os.execv(  # noqa: S606 - this interpreter, a fixed module, the checked argv
            sys.executable,
            [sys.executable, "-m", "dataplane.supervisor", group.to_json(), *argv],
        )
    raise AssertionError("unreachable: execv returns only by raising")


def socket_path(run_dir: Path, index: int) -> Path:
    """The private unix socket of worker `index`."""
    return run_dir / f"w{index}.sock"


def metrics_socket_path(run_dir: Path, index: int) -> Path:
    """The private unix socket of worker `index`'s metrics app (--metrics-listen)."""
    return run_dir / f"w{index}.metrics.sock"


def ready_path(run_dir: Path, index: int) -> Path:
    """The ready file worker `index` writes once it listens on the shared port."""
    return run_dir / f"w{index}.addr"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT, not yet listening.

    Each worker listens on its own; the kernel hands connections only to
    listening sockets. `host` must resolve to one address: the first is used.
    """
    return _bound(host, port, reuse_port=True)


class ListenError(Exception):
    """An address the proxy cannot listen on; the message names it and says why."""

    @classmethod
    def of(cls, host: str, port: int, exc: OSError) -> ListenError:
        # The event loop's own message repeats the address: the errno's text
        # alone. A name that does not resolve (socket.gaierror) has a negative
        # errno of getaddrinfo's, which os.strerror does not know.
        why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
        return cls(f"cannot listen on {hostport(host, port)}: {why}")


def reserve_port(host: str, port: int) -> socket.socket:
    """The supervisor's hold on host:port (port 0: a free port, chosen once).

    Refused with EADDRINUSE, as a single proxy's bind is, when something already
    listens there: SO_REUSEPORT alone would let a second group started on the
    same port by the same user share it silently. The socket returned never
    listens, so it takes no connections; it keeps the port while workers restart.
    Raises ListenError when the address cannot be bound.
    """
    try:
        with _bound(host, port, reuse_port=False) as probe:
            port = probe.getsockname()[1]
        return reuseport_socket(host, port)
    except OSError as exc:
        raise ListenError.of(host, port, exc) from exc


def _bound(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As asyncio does: restarting is not refused for connections in TIME_WAIT,
        # and an IPv6 address means IPv6 only.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a worker that dies unexpectedly is restarted.

    The n-th failure in a row waits first_delay * 2**(n-1), at most max_delay; a
    worker that ran stable_after seconds starts the count again. After
    max_failures failures in a row the supervisor gives up: a worker that cannot
    stay up needs a person (or the container's restart policy), not a loop.
    """

    first_delay: float = 0.5
    max_delay: float = 30.0
    stable_after: float = 60.0
    max_failures: int = 5

    def delay(self, failures: int) -> float | None:
        """Seconds before restarting after `failures` failures in a row, or None."""
        if failures >= self.max_failures:
            return None
        return min(self.max_delay, self.first_delay * 2.0 ** (failures - 1))


def worker_argv(
    argv: Sequence[str],
    group: Group,
    index: int,
    port: int,
    run_dir: Path,
    lifeline: int,
    metrics_port: int | None = None,
) -> list[str]:
    """The command line of worker `index`: the group's own flags, then the ones
    that make it a worker (argparse keeps the last of a repeated flag)."""
    metrics = []
    if group.metrics_listen is not None and metrics_port is not None:
        metrics = ["--metrics-listen", hostport(group.metrics_listen[0], metrics_port)]
    return [
        sys.executable,
        "-m",
        "dataplane",
        *argv,
        "--workers",
        str(group.workers),
        "--listen",
        hostport(group.listen_host, port),
        "--ready-file",
        str(ready_path(run_dir, index)),
        "--worker-index",
        str(index),
        "--run-dir",
        str(run_dir),
        "--lifeline-fd",
        str(lifeline),
        *metrics,
    ]


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with {code}"


class Supervisor:
    """Runs the workers of one `ponto-proxy --workers N` until told to stop.

    Lives in the parent process on a plain asyncio loop that serves no traffic;
    run() is called once.
    """

    def __init__(
        self, group: Group, argv: Sequence[str], policy: RestartPolicy | None = None
    ) -> None:
        self.group = group
        self.argv = list(argv)
        self.policy = policy or RestartPolicy()
        self.stopping = asyncio.Event()
        self.unclean = False
        self._starting = asyncio.Lock()

    async def run(self) -> int:
        """0 when stopped by a signal and every worker exited cleanly, else 1."""
        s = self.group
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stopping.set)
        take_stop_signals()
        holder = reserve_port(s.listen_host, s.listen_port)
        # Held like the main port, so a worker restarted on port 0 gets the same one.
        try:
            metrics_holder = reserve_port(*s.metrics_listen) if s.metrics_listen else None
        except ListenError:
            holder.close()
            raise
        run_dir = Path(tempfile.mkdtemp(prefix="ponto-proxy-"))
        lifeline, keep_alive = os.pipe()
        try:
            port = holder.getsockname()[1]
            metrics_port = metrics_holder.getsockname()[1] if metrics_holder else None
            keepers = [
                asyncio.create_task(
                    self._keep(i, port, run_dir, lifeline, metrics_port), name=f"worker-{i}"
                )
                for i in range(s.workers)
            ]
            announce = asyncio.create_task(self._announce(port, run_dir))
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([stop, *keepers], return_when=asyncio.FIRST_COMPLETED)
            gave_up = not stop.done()
            self.stopping.set()
            await asyncio.gather(*keepers)
            announce.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await announce
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            holder.close()
            if metrics_holder is not None:
                metrics_holder.close()
            os.close(lifeline)
            os.close(keep_alive)
            shutil.rmtree(run_dir, ignore_errors=True)
        log.info("all %d workers have exited", s.workers)
        return 1 if gave_up or self.unclean else 0

    async def _announce(self, port: int, run_dir: Path) -> None:
        """Write --ready-file once every worker listens."""
        s = self.group
        # Polled: the ready files are how a proxy says it listens (tests and the
        # demo read them too), and this runs only until the group is up.
        while not all(ready_path(run_dir, i).exists() for i in range(s.workers)):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        address = f"{s.listen_host}:{port}"
        log.info("%d workers of proxy %s listening on http://%s", s.workers, s.name, address)
        if s.ready_file:
            write_atomic(Path(s.ready_file), address.encode())

    async def _keep(
        self, index: int, port: int, run_dir: Path, lifeline: int, metrics_port: int | None
    ) -> None:
        """Run worker `index` until stopping, restarting it when it dies; returns
        early only when the restart policy gives up."""
        argv = worker_argv(self.argv, self.group, index, port, run_dir, lifeline, metrics_port)
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            # The worker takes them once it can stop cleanly (dataplane.run).
            # One start at a time: the mask is this thread's, and two starts
            # interleaved at their awaits would restore each other's.
            async with self._starting:
                with stop_signals_held():
                    proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(lifeline,))
            started = loop.time()
            exited = asyncio.create_task(proc.wait())
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([exited, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not exited.done():
                await self._stop(index, proc, exited)
                return
            code = exited.result()
            failures = 1 if loop.time() - started >= self.policy.stable_after else failures + 1
            delay = self.policy.delay(failures)
            if delay is None:
                log.error(
                    "worker %d %s (%d failures in a row); giving up, stopping the others",
                    index,
                    describe_exit(code),
                    failures,
                )
                self.unclean = True
                return
            log.warning(
                "worker %d (pid %d) %s; restarting it in %.1f s",
                index,
                proc.pid,
                describe_exit(code),
                delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if self.stopping.is_set():
                return

    async def _stop(
        self, index: int, proc: asyncio.subprocess.Process, exited: asyncio.Task[int]
    ) -> None:
        """SIGTERM (the worker drains), then SIGKILL if it outlives the grace."""
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(
                asyncio.shield(exited), self.group.drain_seconds + SHUTDOWN_GRACE_S
            )
        except TimeoutError:
            log.error("worker %d did not stop in time; killing it", index)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            code = await exited
        if code != 0:
            log.warning("worker %d %s while stopping", index, describe_exit(code))
            self.unclean = True


def supervise(group: Group, argv: Sequence[str]) -> int:
    """Run `group.workers` workers of the proxy started with `argv`; the exit code."""
    return asyncio.run(Supervisor(group, argv).run())


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dataplane.supervisor GROUP ARGV...` (see the module)."""
    group_json, *args = sys.argv[1:] if argv is None else argv
    group = Group.from_json(group_json)
    setup_logging(group.log_level)
    try:
        return supervise(group, args)
    except ListenError as exc:
        sys.stderr.write(f"ponto-proxy: error: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
