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
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dataplane.stopsignals import (
    HELD_SIGNALS,
    LEAVE_SIGNAL,
    RELOAD_SIGNAL,
    STOP_SIGNALS,
    signals_held,
    take_signals,
)
from ponto.cliargs import cannot_listen, hostport
from ponto.listening import bound_socket
from ponto.logs import setup_logging
from ponto.writefile import write_atomic

if TYPE_CHECKING:
    from dataplane.settings import Settings

log = logging.getLogger("dataplane.workers")

# After SIGTERM a worker drains for --drain-seconds, then aiohttp gives in-flight
# requests up to 60 s, and its clean-up (the control-plane link, the saved
# state, the logs) follows; a worker still running 15 s after that is killed.
SHUTDOWN_GRACE_S = 75.0
# A worker's start takes about a second (its imports); one that does not listen
# within this, on a reload, is stopped and the old one kept.
REPLACE_TIMEOUT_S = 60.0
# A worker leaving the group to its successor (a reload) keeps its connections
# LEAVE_DRAIN_S at least (or --drain-seconds), each closed after its next
# answer, so that a kept-alive client opens its next one to a worker that
# listens; then it closes those left idle, and finishes the requests it holds
# (long streams: a reload should cut none) for up to LEAVE_TIMEOUT_S. A SIGTERM
# meanwhile (the group stopping) cuts that to --drain-seconds.
LEAVE_DRAIN_S = 5.0
LEAVE_TIMEOUT_S = 600.0
# A worker whose event loop is stuck (a bug, a blocking call) answers nothing,
# and the kernel still hands it its part of the port's connections; the
# kubelet's /healthz lands on whichever worker the kernel picks, so it seldom
# sees one of N stuck. Its supervisor asks each worker's private socket:
# Watchdog.misses answers missed in a row, each waited for Watchdog.wait, and
# the worker is killed and started again as one that died is.
WATCH_MISSES = 3


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
    # --worker-hang-timeout (0: no watchdog).
    hang_timeout: float = 15.0

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
            hang_timeout=settings.worker_hang_timeout,
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
    with signals_held():
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


def own_socket_path(name: Path, pid: int) -> Path:
    """The name process `pid` keeps for its socket `name` (dataplane.workers)."""
    return name.with_name(f"{name.name}.{pid}")


def linking_path(own: Path) -> Path:
    """The link a process makes of its own name `own` as it takes the
    worker's name over (dataplane.workers.publish_sockets)."""
    return own.with_name(f"{own.name}.new")


def forget_sockets(run_dir: Path, index: int, pid: int) -> None:
    """Remove the names process `pid` of worker `index` kept for its sockets."""
    for name in (socket_path(run_dir, index), metrics_socket_path(run_dir, index)):
        own = own_socket_path(name, pid)
        for path in (own, linking_path(own)):
            path.unlink(missing_ok=True)


def ready_path(run_dir: Path, index: int, start: int = 0) -> Path:
    """The ready file worker `index` writes once it listens on the shared port:
    one per process the slot starts (`start` counts them), so that a
    successor's cannot be taken for its predecessor's."""
    return run_dir / f"w{index}-{start}.addr"


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
        return cls(cannot_listen(hostport(host, port), exc))


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
    # As every server of Ponto binds (ponto.listening): "::" takes IPv4 too.
    return bound_socket(host, port, reuse_port=reuse_port)


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
    start: int = 0,
) -> list[str]:
    """The command line of worker `index`'s `start`-th process: the group's own
    flags, then the ones that make it a worker (argparse keeps the last of a
    repeated flag)."""
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
        str(ready_path(run_dir, index, start)),
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


@dataclass(frozen=True, slots=True)
class Watchdog:
    """How the supervisor tells a stuck worker (see WATCH_MISSES): every
    `every` seconds it asks the worker's private socket for /healthz and waits
    `wait` seconds for the answer's status line; `misses` waits in a row that
    run out kill it. A socket that refuses or is not there is no miss: the
    worker is starting, stopping, or gone, which its exit tells."""

    every: float
    wait: float
    misses: int = WATCH_MISSES

    @classmethod
    def of(cls, hang_timeout: float) -> Watchdog | None:
        """Killed after about `hang_timeout` s of silence (None: no watchdog):
        `misses` rounds of a pause and a wait (review 201: each a third of it
        took twice as long)."""
        if not hang_timeout:
            return None
        step = hang_timeout / (2 * WATCH_MISSES)
        return cls(every=step, wait=step)


async def answers(path: Path, wait: float) -> bool | None:
    """Whether the process listening on unix socket `path` sends the status
    line of a GET /healthz within `wait` seconds: False when it does not, or
    when its backlog is full; None when nothing listens there (the name
    absent, the connection refused or reset: a worker starting or stopping),
    which is no sign of a worker stuck."""
    # Connected by hand: a full backlog refuses a unix connection at once
    # (EAGAIN), which asyncio's connect waits out and then reports as a lost
    # connection, like a stopping worker's (reviews 201, 205).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(str(path))
    except BlockingIOError:
        sock.close()
        return False  # not accepted for as long as its backlog took to fill
    except OSError:
        sock.close()
        return None
    writer = None
    try:
        async with asyncio.timeout(wait):
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n")
            await writer.drain()
            status = await reader.readline()
    except TimeoutError:
        return False
    except OSError:
        return None  # reset: it stops (or the supervisor is short of descriptors)
    finally:
        if writer is not None:
            writer.close()
        else:
            sock.close()
    if not status:
        return None  # closed without a word: stopping, not stuck
    return status.startswith(b"HTTP/1.1 ")


class Supervisor:
    """Runs the workers of one `ponto-proxy --workers N` until told to stop.

    Lives in the parent process on a plain asyncio loop that serves no traffic;
    run() is called once. SIGTERM and SIGINT stop the group; SIGHUP restarts
    its workers one at a time (reload()).
    """

    def __init__(
        self,
        group: Group,
        argv: Sequence[str],
        policy: RestartPolicy | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.group = group
        self.argv = list(argv)
        self.policy = policy or RestartPolicy()
        self.watchdog = watchdog or Watchdog.of(group.hang_timeout)
        self.stopping = asyncio.Event()
        self.unclean = False
        self._starting = asyncio.Lock()
        self._reload_wanted = asyncio.Event()
        self._slots: list[_Slot] = []
        # Processes a reload retired (finishing their requests) or gave up on,
        # each with the task that waits for its exit and the event that cuts
        # that wait to a stop's (hurry).
        self._leaving: dict[
            asyncio.Task[None], tuple[asyncio.subprocess.Process, asyncio.Event]
        ] = {}

    async def run(self) -> int:
        """0 when stopped by a signal and every worker exited cleanly, else 1."""
        s = self.group
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(RELOAD_SIGNAL, self._reload_wanted.set)
        loop.add_signal_handler(
            LEAVE_SIGNAL, log.warning, "SIGUSR2 ignored: it is how the supervisor retires a worker"
        )
        take_signals()
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
            self._slots = [
                _Slot(
                    i,
                    functools.partial(
                        worker_argv, self.argv, s, i, port, run_dir, lifeline, metrics_port
                    ),
                    run_dir,
                    lifeline,
                )
                for i in range(s.workers)
            ]
            keepers = [
                asyncio.create_task(self._keep(slot), name=f"worker-{slot.index}")
                for slot in self._slots
            ]
            announce = asyncio.create_task(self._announce(port))
            reloads = asyncio.create_task(self._reloads())
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([stop, *keepers], return_when=asyncio.FIRST_COMPLETED)
            gave_up = not stop.done()
            self.stopping.set()
            # Those still finishing their requests after a reload stop too,
            # within a stop's budget rather than a reload's.
            self._hurry()
            await asyncio.gather(*keepers)
            for task in (announce, reloads):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.gather(*self._leaving)
        finally:
            for sig in HELD_SIGNALS:
                loop.remove_signal_handler(sig)
            holder.close()
            if metrics_holder is not None:
                metrics_holder.close()
            os.close(lifeline)
            os.close(keep_alive)
            shutil.rmtree(run_dir, ignore_errors=True)
        log.info("all %d workers have exited", s.workers)
        return 1 if gave_up or self.unclean else 0

    async def _announce(self, port: int) -> None:
        """Write --ready-file once every worker listens."""
        s = self.group
        await asyncio.gather(*(slot.up.wait() for slot in self._slots))
        address = hostport(s.listen_host, port)
        log.info("%d workers of proxy %s listening on http://%s", s.workers, s.name, address)
        if s.ready_file:
            write_atomic(Path(s.ready_file), address.encode())

    async def _reloads(self) -> None:
        """A reload per SIGHUP; one that comes during a reload makes one more
        after it (a file may have changed again since its workers started)."""
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            await self.reload()

    async def reload(self) -> bool:
        """Restart the workers one at a time, each new one listening before the
        old one leaves: the group reads its files again (certificates, the
        GeoIP database, the code) and keeps listening meanwhile (connections
        still in a leaving worker's accept queue are reset, unless the kernel
        migrates them: net.ipv4.tcp_migrate_req). A worker
        that cannot start ends the reload, and the workers not yet replaced keep
        running as they were. Whether every worker was replaced."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        log.info("SIGHUP: restarting the %d workers one at a time", len(self._slots))
        # So that the group holds at most twice its processes (and memory).
        if hurried := self._hurry():
            log.info(
                "%d workers an earlier reload retired still finish requests: they stop "
                "as a stopping proxy does, in --drain-seconds and up to 60 s more for "
                "requests still running",
                hurried,
            )
        for slot in self._slots:
            done = loop.create_future()
            slot.replace.put_nowait(done)
            if not await done:
                if not self.stopping.is_set():
                    log.error(
                        "reload stopped at worker %d: the workers not yet replaced keep "
                        "running as they were",
                        slot.index,
                    )
                return False
        log.info("reload done: %d workers in %.1f s", len(self._slots), loop.time() - began)
        return True

    async def _start(self, slot: _Slot) -> _Process | None:
        """Start a process for worker `slot`; None if the group is stopping."""
        # The worker takes them once it can stop cleanly (dataplane.run).
        # One start at a time: the mask is this thread's, and two starts
        # interleaved at their awaits would restore each other's.
        async with self._starting:
            if self.stopping.is_set():
                return None
            slot.starts += 1
            ready = ready_path(slot.run_dir, slot.index, slot.starts)
            with signals_held():
                proc = await asyncio.create_subprocess_exec(
                    *slot.argv(start=slot.starts), pass_fds=(slot.lifeline,)
                )
        exited = asyncio.create_task(proc.wait())
        # A worker that ended without removing its own sockets' names (a
        # crash, a kill) would leave them for every scrape to try.
        exited.add_done_callback(lambda _: forget_sockets(slot.run_dir, slot.index, proc.pid))
        return _Process(
            proc,
            exited,
            asyncio.create_task(_listens(ready, slot.up)),
            asyncio.get_running_loop().time(),
        )

    async def _keep(self, slot: _Slot) -> None:
        """Run worker `slot` until stopping, restarting it when it dies and
        replacing it when a reload asks; returns early only when the restart
        policy gives up."""
        index = slot.index
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                current = await self._start(slot)
            except OSError as exc:
                # No process (EAGAIN under a container's pids limit, the
                # interpreter gone with an upgraded virtualenv): a failure as
                # a death is, retried on the same policy (review 36: the
                # keeper died, and with it the group, with a traceback).
                failures += 1
                if not await self._restart_after(
                    slot, failures, f"worker {index}'s process could not start ({exc})"
                ):
                    return
                continue
            if current is None:
                return
            stop = asyncio.create_task(self.stopping.wait())
            watch = self._watch(slot, current)
            while True:
                replace = asyncio.create_task(slot.replace.get())
                await asyncio.wait(
                    [current.exited, stop, replace], return_when=asyncio.FIRST_COMPLETED
                )
                if not replace.done():
                    replace.cancel()
                    break
                replaced = await self._replace(slot, current, replace.result())
                if replaced is not current:
                    watch.cancel()  # the old one leaves: its stop has its own budget
                    current, watch = replaced, self._watch(slot, replaced)
            watch.cancel()
            stop.cancel()
            current.listening.cancel()
            if not current.exited.done():
                await self._stop(index, current.proc, current.exited)
                return
            code = current.exited.result()
            lasted = loop.time() - current.started
            failures = 1 if lasted >= self.policy.stable_after else failures + 1
            what = f"worker {index} (pid {current.proc.pid}) {describe_exit(code)}"
            if not await self._restart_after(slot, failures, what):
                return

    def _watch(self, slot: _Slot, process: _Process) -> asyncio.Task[None]:
        """Kill `process` if it listens and then stops answering (Watchdog);
        cancelled when it stops being worker `slot` (a reload replaced it, it
        exited, or the group stops)."""
        return asyncio.create_task(self._watching(slot, process), name=f"watch-{slot.index}")

    async def _watching(self, slot: _Slot, process: _Process) -> None:
        watchdog = self.watchdog
        if watchdog is None:
            return
        await asyncio.wait([process.listening])
        if process.listening.cancelled():
            return
        pid = process.proc.pid
        own = own_socket_path(socket_path(slot.run_dir, slot.index), pid)
        missed = 0
        while True:
            await asyncio.sleep(watchdog.every)
            answered = await answers(own, watchdog.wait)
            # None: nothing listens (it starts or stops: its exit tells), which
            # ends a run of misses as an answer does: they count in a row.
            missed = missed + 1 if answered is False else 0
            if missed < watchdog.misses:
                continue
            log.error(
                "worker %d (pid %d) has answered nothing on its private socket for %g s "
                "(%d requests for /healthz in a row): its event loop is stuck, and its "
                "connections with it; killing it (--worker-hang-timeout)",
                slot.index,
                pid,
                watchdog.misses * (watchdog.every + watchdog.wait),
                missed,
            )
            with contextlib.suppress(ProcessLookupError):
                process.proc.kill()
            return

    async def _restart_after(self, slot: _Slot, failures: int, what: str) -> bool:
        """Log `what` befell worker `slot`, the `failures`-th failure in a
        row, and wait the restart policy's delay: whether to start it again
        (False once the policy gives up, which stops the group unclean, or
        when the group stops meanwhile)."""
        delay = self.policy.delay(failures)
        if delay is None:
            log.error("%s (%d failures in a row); giving up, stopping the others", what, failures)
            self.unclean = True
            return False
        log.warning("%s; restarting it in %.1f s", what, delay)
        # A reload asked for meanwhile: the next start reads the files anew.
        while not slot.replace.empty():
            slot.replace.get_nowait().set_result(True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay)
        return not self.stopping.is_set()

    async def _replace(self, slot: _Slot, old: _Process, done: asyncio.Future[bool]) -> _Process:
        """Start worker `slot` anew beside `old`; once the new one listens, tell
        the old one to leave (it finishes its requests in the background). The
        process that is worker `slot` now; `done` says whether it is a new one
        (or none was running: the keeper's restart reads the files anew)."""
        index = slot.index
        # One still starting is replaced once it listens: only then is the
        # port served by its successor when it goes.
        if not await self._listens(old, old.exited):
            done.set_result(old.exited.done() and not self.stopping.is_set())
            return old
        try:
            new = await self._start(slot)
        except OSError as exc:
            # No process (EAGAIN or ENOMEM under a container's limits, the
            # interpreter gone with an upgraded virtualenv): the reload ends,
            # the group goes on as it was (review 35: the keeper died, and
            # with it the group).
            log.error("worker %d's new process could not start: %s; the reload ends", index, exc)
            done.set_result(False)
            return old
        if new is None:
            done.set_result(False)
            return old
        if await self._listens(new, new.exited):
            if old.exited.done():
                log.warning(
                    "worker %d (pid %d) %s during the reload; pid %d takes its place",
                    index,
                    old.proc.pid,
                    describe_exit(old.exited.result()),
                    new.proc.pid,
                )
            else:
                log.info(
                    "worker %d: pid %d took over from pid %d", index, new.proc.pid, old.proc.pid
                )
                self._retire(index, old, LEAVE_SIGNAL)
            done.set_result(True)
            return new
        still = "" if old.exited.done() else f"; pid {old.proc.pid} goes on serving"
        if new.exited.done():
            log.error(
                "worker %d's new process %s before it listened%s",
                index,
                describe_exit(new.exited.result()),
                still,
            )
        elif not self.stopping.is_set():
            log.error(
                "worker %d's new process did not listen within %.0f s; stopping it%s",
                index,
                REPLACE_TIMEOUT_S,
                still,
            )
        # Its ready file will never come: the poll stops here (it polled for
        # the supervisor's lifetime after a successor that exited).
        new.listening.cancel()
        if not new.exited.done():
            self._retire(index, new, signal.SIGTERM)
        done.set_result(False)
        return old

    async def _listens(self, process: _Process, exited: asyncio.Task[int]) -> bool:
        """Whether `process` listens, waiting up to REPLACE_TIMEOUT_S for it to
        say so; False at once if it exits or the group stops meanwhile."""
        if not process.listening.done():
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait(
                [process.listening, exited, stop],
                timeout=REPLACE_TIMEOUT_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop.cancel()
        listening = process.listening.done() and not process.listening.cancelled()
        return listening and not exited.done() and not self.stopping.is_set()

    def _retire(self, index: int, process: _Process, how: signal.Signals) -> None:
        """Stop `process` in the background (run() waits for it at the end)."""
        hurry = asyncio.Event()
        if how != LEAVE_SIGNAL:
            hurry.set()  # it has a stop's budget already
        task = asyncio.create_task(self._stop(index, process.proc, process.exited, how, hurry))
        self._leaving[task] = (process.proc, hurry)
        task.add_done_callback(self._leaving.pop)
        if self.stopping.is_set():  # past run()'s own _hurry
            self._hurry()

    def _hurry(self) -> int:
        """SIGTERM to each process a reload retired that still runs: it stops
        within --drain-seconds then. How many were told."""
        told = 0
        for proc, hurry in self._leaving.values():
            if hurry.is_set():
                continue
            hurry.set()
            told += 1
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        return told

    async def _stop(
        self,
        index: int,
        proc: asyncio.subprocess.Process,
        exited: asyncio.Task[int],
        how: signal.Signals = signal.SIGTERM,
        hurry: asyncio.Event | None = None,
    ) -> None:
        """SIGTERM (the worker drains) or LEAVE_SIGNAL (it leaves the port to a
        new one, and may finish its requests for longer), then SIGKILL if it
        outlives the grace. A leaving worker has a stop's budget from the
        moment `hurry` is set (_hurry sends it SIGTERM then)."""
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(how)
        stop_budget = self.group.drain_seconds + SHUTDOWN_GRACE_S
        try:
            if hurry is None or hurry.is_set():
                code = await asyncio.wait_for(asyncio.shield(exited), stop_budget)
            else:
                stops = asyncio.ensure_future(hurry.wait())
                try:
                    await asyncio.wait(
                        (exited, stops),
                        timeout=LEAVE_TIMEOUT_S + SHUTDOWN_GRACE_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    stops.cancel()
                if not (exited.done() or hurry.is_set()):
                    raise TimeoutError
                code = await asyncio.wait_for(asyncio.shield(exited), stop_budget)
        except TimeoutError:
            log.error("worker %d (pid %d) did not stop in time; killing it", index, proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            code = await exited
        if code != 0:
            log.warning(
                "worker %d (pid %d) %s while stopping", index, proc.pid, describe_exit(code)
            )
            self.unclean = True


@dataclass(eq=False)
class _Slot:
    """Worker `index` of the group: the command line of its `start`-th process,
    how many it started, whether one has listened, and the reloads asking its
    keeper to replace it (each answered True once the new process listens, or
    when none runs to replace)."""

    index: int
    argv: Callable[..., list[str]]
    run_dir: Path
    lifeline: int
    starts: int = 0
    up: asyncio.Event = field(default_factory=asyncio.Event)
    replace: asyncio.Queue[asyncio.Future[bool]] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True, slots=True)
class _Process:
    """One process of a worker: its exit, the wait for its ready file, and
    when it started (the loop's clock)."""

    proc: asyncio.subprocess.Process
    exited: asyncio.Task[int]
    listening: asyncio.Task[None]
    started: float


async def _listens(ready: Path, up: asyncio.Event) -> None:
    """Return once the process writing `ready` listens (and set `up`)."""
    # Polled: the ready file is how a proxy says it listens (tests and the demo
    # read them too). A stat in the group's own run directory does not block.
    while not ready.exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)
    ready.unlink()  # noqa: ASYNC240 - as above
    up.set()


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
