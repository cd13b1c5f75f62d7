"""`--workers N`: settings, the metrics merge, the group's /metrics and /readyz.

The group views run in-process: each "worker" is an app with the real group
middleware, on a TCP port (the shared port) and on its private unix socket, as
`ponto-proxy` serves them. Real processes are in tests/e2e/test_workers.py.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, cast
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from dataplane import supervisor, workers
from dataplane.http.boundary import error_boundary
from dataplane.http.dispatch import FixedRoutes
from dataplane.http.endpoints import metrics
from dataplane.http.errors import ApiError
from dataplane.http.requestid import RequestIds
from dataplane.http.state import DRAINING, METRICS, REQUEST_IDS, Draining
from dataplane.metrics import Metrics
from dataplane.settings import WorkerSlot, as_worker, available_cores, parse, quota_cores
from dataplane.stopsignals import HELD_SIGNALS, LEAVE_SIGNAL
from dataplane.streaming.usage import Usage
from dataplane.supervisor import Group
from tests.unit.test_scrape import PROMETHEUS

BASE = ["--control-plane", "127.0.0.1:7000", "--region", "us-east", "--name", "p"]


# ---------------------------------------------------------------- settings


def test_workers_default_to_the_usable_cores_and_refuse_less_than_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse(BASE).workers == available_cores()
    assert parse([*BASE, "--workers", "3"]).workers == 3
    assert parse([*BASE, "--workers", "1"]).worker is None
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as exc:
            parse([*BASE, "--workers", bad])
        assert exc.value.code == 2
        assert "--workers must be at least 1" in capsys.readouterr().err


def test_the_default_keeps_to_a_containers_cpu_quota(tmp_path: Path) -> None:
    """`docker run --cpus 2` on a many-core host would start a worker a host
    core, each wanting a core and its memory, where the chart gives 2 (trial
    90, from the code: the sandbox has cgroup v1 and no container to run)."""
    assert [quota_cores(t) for t in ("200000 100000\n", "150000 100000", "50000 100000",
                                     "max 100000\n", "", "1 0", "-1 100000", "x y")] == [
        2, 1, 1, None, None, None, None, None]  # fmt: skip
    cpu_max, cores = tmp_path / "cpu.max", len(os.sched_getaffinity(0))
    assert available_cores(cpu_max) == cores  # no file: the cores alone
    cpu_max.write_text("max 100000\n")
    assert available_cores(cpu_max) == cores
    cpu_max.write_text("100000 100000\n")
    assert available_cores(cpu_max) == 1
    cpu_max.write_text(f"{100000 * 10_000} 100000\n")  # more than the host has
    assert available_cores(cpu_max) == cores


def test_more_workers_than_four_a_core_are_refused_before_any_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial 90: `--workers 100000` started interpreters until the host stalled."""
    monkeypatch.setattr("dataplane.settings.available_cores", lambda: 2)
    assert parse([*BASE, "--workers", "8"]).workers == 8
    for bad in ("9", "100000", str(10**20)):
        with pytest.raises(SystemExit) as exc:
            parse([*BASE, "--workers", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--workers {bad} is more than 4 per core this process may use (2: at most 8)" in err
    # A worker whose cores were narrowed since its supervisor checked still starts.
    hidden = ["--worker-index", "8", "--run-dir", "/tmp", "--lifeline-fd", "3"]
    assert parse([*BASE, "--workers", "9", *hidden]).workers == 9


def test_worker_flags_are_hidden_and_all_or_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse([*BASE, "--help"])
    shown = capsys.readouterr().out
    assert "--workers" in shown
    assert "--worker-index" not in shown and "--lifeline-fd" not in shown
    for partial in (["--worker-index", "0"], ["--workers", "2", "--worker-index", "2",
                    "--run-dir", "/tmp", "--lifeline-fd", "3"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse([*BASE, *partial])
        assert "set by ponto-proxy itself" in capsys.readouterr().err


def test_a_worker_is_its_own_proxy_with_its_own_state_and_part_of_the_cache(
    tmp_path: Path,
) -> None:
    group = parse([*BASE, "--workers", "4", "--state-dir", str(tmp_path), "--cache-max-mb", "256"])
    w2 = as_worker(group, WorkerSlot(2, tmp_path / "run", 7))
    assert (w2.name, w2.state_dir, w2.cache_max_bytes) == ("p-w2", tmp_path / "w2", 64 << 20)
    assert w2.worker == WorkerSlot(2, tmp_path / "run", 7)
    assert as_worker(parse([*BASE, "--workers", "2"]), WorkerSlot(0, tmp_path, 7)).state_dir is None


def test_a_workers_command_line_parses_to_its_settings(tmp_path: Path) -> None:
    argv = [*BASE, "--listen", "127.0.0.1:0", "--workers", "2", "--state-dir", str(tmp_path),
            "--ready-file", str(tmp_path / "group.addr")]  # fmt: skip
    group = parse(argv)
    line = supervisor.worker_argv(argv, Group.of(group), 1, 40123, tmp_path / "run", 9)
    assert line[1:3] == ["-m", "dataplane"]
    w1 = parse(line[3:])
    assert (w1.name, w1.workers, w1.listen_port) == ("p-w1", 2, 40123)
    assert w1.state_dir == tmp_path / "w1"
    assert w1.ready_file == supervisor.ready_path(tmp_path / "run", 1)
    assert w1.worker == WorkerSlot(1, tmp_path / "run", 9)
    assert w1.advertise == "127.0.0.1:40123"


def test_a_workers_command_line_carries_the_groups_metrics_port(tmp_path: Path) -> None:
    argv = [*BASE, "--listen", "127.0.0.1:0", "--workers", "2", "--metrics-listen", "[::1]:0"]
    group = parse(argv)
    assert group.metrics_listen == ("::1", 0)
    line = supervisor.worker_argv(
        argv, Group.of(group), 1, 40123, tmp_path / "run", 9, metrics_port=40124
    )
    w1 = parse(line[3:])
    assert w1.metrics_listen == ("::1", 40124)
    assert w1.metrics_key_labels
    assert supervisor.metrics_socket_path(tmp_path, 1) != supervisor.socket_path(tmp_path, 1)


def test_metrics_flags(capsys: pytest.CaptureFixture[str]) -> None:
    public = parse(BASE)
    assert public.metrics_listen is None
    assert not public.metrics_key_labels  # /metrics on the public port: no key ids
    private = parse([*BASE, "--metrics-listen", "0.0.0.0:9090"])
    assert private.metrics_listen == ("0.0.0.0", 9090)
    assert private.metrics_key_labels
    assert parse([*BASE, "--metrics-key-labels", "on"]).metrics_key_labels
    off = parse([*BASE, "--metrics-listen", "127.0.0.1:9090", "--metrics-key-labels", "off"])
    assert not off.metrics_key_labels
    for bad in (
        ["--metrics-listen", "9090"],
        ["--metrics-listen", "127.0.0.1:9090", "--listen", "127.0.0.1:9090"],
        ["--metrics-key-labels", "maybe"],
    ):
        with pytest.raises(SystemExit):
            parse([*BASE, *bad])
    assert "--metrics-listen" in capsys.readouterr().err


def test_restarts_back_off_then_give_up() -> None:
    policy = supervisor.RestartPolicy(first_delay=0.5, max_delay=3.0, max_failures=5)
    # The 5th death in a row is the last: no restart after it.
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, None]


def test_exits_are_described_by_code_or_signal() -> None:
    assert supervisor.describe_exit(1) == "exited with 1"
    assert supervisor.describe_exit(-9) == "was killed by SIGKILL"


def test_the_port_is_held_once_and_shared() -> None:
    holder = supervisor.reserve_port("127.0.0.1", 0)
    port = holder.getsockname()[1]
    listeners = [supervisor.reuseport_socket("127.0.0.1", port) for _ in range(2)]
    try:
        for s in listeners:
            s.listen()
        # Only listening sockets take connections: the holder never does.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        # A second group on the same port is refused, as a second proxy is.
        with pytest.raises(supervisor.ListenError) as exc:
            supervisor.reserve_port("127.0.0.1", port)
        assert str(exc.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
        assert isinstance(exc.value.__cause__, OSError)
        assert exc.value.__cause__.errno == errno.EADDRINUSE
    finally:
        for s in (holder, *listeners):
            s.close()


def test_a_host_name_that_does_not_resolve_is_said_in_words() -> None:
    # getaddrinfo's errors have negative errnos ("Unknown error -2" to os.strerror).
    with pytest.raises(supervisor.ListenError) as exc:
        supervisor.reserve_port("nosuch.invalid", 0)
    assert str(exc.value).startswith("cannot listen on nosuch.invalid:0: ")
    assert "Unknown error" not in str(exc.value), str(exc.value)


def test_more_workers_than_cores_is_warned_of() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "dataplane", *BASE, "--workers", "2",
             "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"],
            capture_output=True, text=True, timeout=60, check=False,
            preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        )  # fmt: skip
    assert out.returncode == 1, out.stderr  # the port, taken: it stopped there
    assert "--workers 2 is more than the cores this process may use (1)" in out.stderr


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_port_in_use_is_one_line_and_exit_1(count: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "dataplane", *BASE, "--workers", count,
             "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"ponto-proxy: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- the supervisor

# Stand-ins for workers: one that says it listens and waits for SIGTERM, and one
# that dies at once.
WAITS = """
import signal, sys
from pathlib import Path
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
Path(sys.argv[-1]).write_text("listening")
signal.sigwait({signal.SIGTERM})
"""
DIES = "raise SystemExit(3)"
# One that notes its start, that it listens, and the signal that ends it (as
# NOTES/w{index}-{pid}.start, .listens and .end). While NOTES/fail-next exists it
# dies at once; while NOTES/slow exists it takes 0.5 s to listen; while
# NOTES/die-at-successor exists, worker 0's first process dies (5) once its
# successor started.
NOTES = """
import os, signal, sys, time
from pathlib import Path
ends = {signal.SIGTERM, signal.SIGUSR2}
signal.pthread_sigmask(signal.SIG_BLOCK, ends)
index, notes, ready = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
me = notes / f"w{index}-{os.getpid()}"
me.with_suffix(".start").touch()
first = len(list(notes.glob(f"w{index}-*.start"))) == 1
if (notes / "fail-next").exists():
    raise SystemExit(3)
if (notes / "slow").exists():
    time.sleep(0.5)
ready.write_text("listening")
me.with_suffix(".listens").touch()
while (got := signal.sigtimedwait(ends, 0.01)) is None:
    dies = index == "0" and first and (notes / "die-at-successor").exists()
    if dies and len(list(notes.glob("w0-*.start"))) > 1:
        raise SystemExit(5)
# Written aside, then renamed: a test polling for .end never reads it empty.
me.with_suffix(".ending").write_text(signal.Signals(got.si_signo).name)
me.with_suffix(".ending").rename(me.with_suffix(".end"))
"""


# One that serves /healthz on its private socket (the name of its own the
# supervisor asks), noting its start as NOTES/w{index}-{pid}.start; while
# NOTES/hang-{pid} exists it answers nothing (its loop stuck).
ANSWERS = """
import os, signal, socket, sys
from pathlib import Path
ends = {signal.SIGTERM, signal.SIGUSR2}
signal.pthread_sigmask(signal.SIG_BLOCK, ends)
index, notes, ready = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
pid = os.getpid()
(notes / f"w{index}-{pid}.start").touch()
server = socket.socket(socket.AF_UNIX)
server.bind(str(ready.parent / f"w{index}.sock.{pid}"))
server.listen(64)
server.settimeout(0.01)
ready.write_text("listening")
while signal.sigtimedwait(ends, 0) is None:
    if (notes / f"hang-{pid}").exists():
        signal.sigtimedwait(ends, 0.01)
        continue
    try:
        conn, _ = server.accept()
    except TimeoutError:
        continue
    try:  # the supervisor may have stopped waiting (a loaded machine)
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n")
    except OSError:
        pass
    conn.close()
"""


def fake_workers(monkeypatch: pytest.MonkeyPatch, code: str, notes: Path | None = None) -> None:
    def argv(
        _argv: object,
        _s: object,
        index: int,
        _p: int,
        run_dir: Path,
        _l: int,
        _m: object,
        start: int = 0,
    ) -> list[str]:
        ready = str(supervisor.ready_path(run_dir, index, start))
        return [sys.executable, "-c", code, str(index), str(notes), ready]

    monkeypatch.setattr(supervisor, "worker_argv", argv)


async def started_group(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    code: str,
    workers: int,
    notes: Path | None = None,
) -> tuple[supervisor.Supervisor, asyncio.Task[int], Path]:
    """A supervisor of `workers` fake workers running `code`, once the group
    listens; its run() and the group's ready file."""
    fake_workers(monkeypatch, code, notes)
    ready = tmp_path / "group.addr"
    settings = parse(
        [*BASE, "--workers", str(workers), "--listen", "127.0.0.1:0", "--ready-file", str(ready)]
    )
    group = supervisor.Supervisor(Group.of(settings), [])
    run = asyncio.create_task(group.run())
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert not run.done() and time.monotonic() < deadline
        await asyncio.sleep(0.02)
    return group, run, ready


async def test_the_supervisor_announces_the_group_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group, run, ready = await started_group(monkeypatch, tmp_path, WAITS, 3)
    host, _, port = ready.read_text().rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    # The signals, held while each worker started, are taken again once
    # all three have (their starts interleave, and must not restore each
    # other's hold).
    assert not HELD_SIGNALS & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    group.stopping.set()  # what SIGTERM does
    # Every worker got SIGTERM and exited 0.
    assert await asyncio.wait_for(run, 30) == 0


async def test_a_worker_that_keeps_dying_makes_the_supervisor_give_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_workers(monkeypatch, DIES)
    settings = parse([*BASE, "--workers", "2", "--listen", "127.0.0.1:0"])
    policy = supervisor.RestartPolicy(first_delay=0.01, max_failures=2)
    assert (
        await asyncio.wait_for(supervisor.Supervisor(Group.of(settings), [], policy).run(), 30) == 1
    )
    assert "restarting it in 0.0 s" in caplog.text
    assert "exited with 3 (2 failures in a row); giving up" in caplog.text


# Asks often, and waits long enough that a loaded machine's answer is no miss.
QUICK = supervisor.Watchdog(every=0.05, wait=1.0, misses=3)


async def test_a_worker_that_answers_nothing_is_killed_and_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 53: a worker whose event loop is stuck kept its part of the
    port's connections, and the kubelet's /healthz, answered by whichever
    worker the kernel picks, seldom saw it: the pod stayed unready (its
    /readyz asks every sibling) for as long as the probe kept missing it."""
    notes = tmp_path / "notes"
    notes.mkdir()
    fake_workers(monkeypatch, ANSWERS, notes)
    ready = tmp_path / "group.addr"
    settings = parse(
        [*BASE, "--workers", "2", "--listen", "127.0.0.1:0", "--ready-file", str(ready)]
    )
    policy = supervisor.RestartPolicy(first_delay=0.01)
    group = supervisor.Supervisor(Group.of(settings), [], policy, QUICK)
    run = asyncio.create_task(group.run())

    async def until(what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert not run.done() and time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    def starts(index: int) -> list[str]:
        return sorted(p.stem for p in notes.glob(f"w{index}-*.start"))

    await until("the group listens", ready.exists)
    await asyncio.sleep(0.5)  # answering: many rounds of the watchdog, no kill
    assert (len(starts(0)), len(starts(1))) == (1, 1)
    stuck = int(starts(0)[0].split("-")[1])
    (notes / f"hang-{stuck}").touch()
    await until("worker 0 started again", lambda: len(starts(0)) == 2)
    assert len(starts(1)) == 1, "the worker that answered was left alone"
    assert f"worker 0 (pid {stuck}) has answered nothing on its private socket" in caplog.text
    assert "killing it (--worker-hang-timeout)" in caplog.text
    assert f"worker 0 (pid {stuck}) was killed by SIGKILL" in caplog.text
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0


async def test_a_worker_without_its_socket_is_not_taken_for_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listening at its socket's name (a worker starting, stopping,
    or one that never made it) is no hang: its exit says what it does."""
    group = supervisor.Supervisor(
        Group.of(parse([*BASE, "--workers", "2", "--listen", "127.0.0.1:0"])), [], None, QUICK
    )
    fake_workers(monkeypatch, WAITS)
    run = asyncio.create_task(group.run())
    await asyncio.sleep(1.0)
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert "killing it" not in caplog.text


async def test_a_socket_whose_backlog_is_full_is_no_answer(tmp_path: Path) -> None:
    """Review 201: a unix socket's full backlog refuses a connection at once
    (EAGAIN); such a worker, stuck long enough for its queue to fill, was
    taken for one not listening, and never killed."""
    path = tmp_path / "w0.sock.1"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    queued: list[socket.socket] = []
    full = False
    try:
        while not full and len(queued) < 256:  # past any backlog the kernel rounds 1 up to
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            try:
                client.connect(str(path))
            except BlockingIOError:
                client.close()
                full = True
            else:
                queued.append(client)
        assert full
        assert await supervisor.answers(path, 5.0) is False  # at once, not after the wait
    finally:
        for client in queued:
            client.close()
        server.close()
    assert await supervisor.answers(path, 0.2) is None  # nothing listens now
    assert await supervisor.answers(tmp_path / "absent", 0.2) is None


def test_the_watchdog_follows_the_hang_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    assert supervisor.Watchdog.of(15.0) == supervisor.Watchdog(every=2.5, wait=2.5, misses=3)
    assert supervisor.Watchdog.of(0.0) is None
    assert Group.of(parse([*BASE, "--workers", "2"])).hang_timeout == 15.0
    settings = parse([*BASE, "--workers", "2", "--worker-hang-timeout", "0"])
    assert Group.of(settings).hang_timeout == 0.0
    with pytest.raises(SystemExit):
        parse([*BASE, "--worker-hang-timeout", "2"])
    assert "--worker-hang-timeout must be 0 (never) or at least 5 s" in capsys.readouterr().err


def noted(notes: Path, suffix: str) -> dict[str, str]:
    """Worker notes by "w{index}-{pid}": the starts, or the signals that ended them."""
    return {p.stem: p.read_text() for p in notes.glob(f"*{suffix}")}


async def notes_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[supervisor.Supervisor, asyncio.Task[int], Path]:
    """A group of two NOTES workers, once it listens; with their notes' directory."""
    notes = tmp_path / "notes"
    notes.mkdir()
    group, run, _ = await started_group(monkeypatch, tmp_path, NOTES, 2, notes)
    return group, run, notes


async def test_a_reload_replaces_each_worker_once_its_successor_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dataplane.workers")
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    first = set(noted(notes, ".start"))
    assert {name.split("-")[0] for name in first} == {"w0", "w1"}
    assert await asyncio.wait_for(group.reload(), 30)
    # Each first worker was told to leave (not to drain, as a stop does), and
    # only after its successor had started.
    deadline = time.monotonic() + 30
    while set(noted(notes, ".end")) != first:
        assert time.monotonic() < deadline, noted(notes, ".end")
        await asyncio.sleep(0.02)
    assert set(noted(notes, ".end").values()) == {"SIGUSR2"}
    second = set(noted(notes, ".start")) - first
    assert {name.split("-")[0] for name in second} == {"w0", "w1"}
    assert "reload done: 2 workers" in caplog.text
    # The successors are the group now: a stop ends them, and cleanly.
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert {noted(notes, ".end")[name] for name in second} == {"SIGTERM"}


async def test_a_successor_that_cannot_start_leaves_the_group_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload after a bad edit (a certificate that does not load, say) stops
    at the first worker whose successor dies: every worker goes on serving."""
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    first = set(noted(notes, ".start"))
    (notes / "fail-next").touch()
    assert not await asyncio.wait_for(group.reload(), 30)
    assert len(noted(notes, ".start")) == 3, "worker 1 was not tried"
    assert noted(notes, ".end") == {}, "no first worker was stopped"
    assert "worker 0's new process exited with 3 before it listened" in caplog.text
    assert "reload stopped at worker 0" in caplog.text
    (notes / "fail-next").unlink()
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert set(noted(notes, ".end")) == first


class SpawnRefusals:
    """asyncio.create_subprocess_exec refusing its next `left` spawns with
    EAGAIN (a pids limit), as the supervisor's spawn sees it; then spawning."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, left: float) -> None:
        self.left = left
        self.refused = 0
        real = asyncio.create_subprocess_exec

        async def spawn(*args: Any, **kwargs: Any) -> Any:
            if self.left > 0:
                self.left -= 1
                self.refused += 1
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return await real(*args, **kwargs)

        monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)


async def test_a_successor_that_cannot_be_spawned_leaves_the_group_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 35: a spawn that failed (EAGAIN under a pids limit, the
    interpreter gone) killed the slot's keeper, which stopped the group, and
    run() raised; and a successor that exited left its ready-file poll
    running for the supervisor's lifetime."""
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    first = set(noted(notes, ".start"))
    (notes / "fail-next").touch()
    assert not await asyncio.wait_for(group.reload(), 30)  # a successor that exits
    (notes / "fail-next").unlink()

    def polls() -> int:
        return sum(
            1
            for t in asyncio.all_tasks()
            if not t.done() and getattr(t.get_coro(), "__name__", "") == "_listens"
        )

    assert polls() == 0
    refusals = SpawnRefusals(monkeypatch, left=math.inf)
    assert not await asyncio.wait_for(group.reload(), 30)
    assert "worker 0's new process could not start" in caplog.text
    assert not run.done() and not group.stopping.is_set()
    assert noted(notes, ".end") == {}, "no worker was stopped"
    refusals.left = 0
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert set(noted(notes, ".end")) == first


async def test_a_worker_that_cannot_be_spawned_again_is_retried_on_the_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 36: a worker that died and whose restart could not be spawned
    (EAGAIN under a pids limit) killed its keeper, which stopped the group,
    and run() raised. The spawn is retried on the restart policy."""
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    group.policy = supervisor.RestartPolicy(first_delay=0.01)
    first = set(noted(notes, ".start"))
    refusals = SpawnRefusals(monkeypatch, left=1)
    (w0,) = (name for name in first if name.startswith("w0-"))
    os.kill(int(w0.split("-")[1]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not any(n.startswith("w0-") for n in set(noted(notes, ".start")) - first):
        assert not run.done() and time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert refusals.refused == 1
    assert "worker 0's process could not start ([Errno 11]" in caplog.text
    assert "restarting it in 0.0 s" in caplog.text
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0


async def test_a_reload_while_the_group_starts_replaces_each_worker_once_it_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 32: a successor's ready file could be taken for its
    predecessor's, which was then told to leave before anything else listened."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "slow").touch()
    fake_workers(monkeypatch, NOTES, notes)
    settings = parse([*BASE, "--workers", "2", "--listen", "127.0.0.1:0"])
    group = supervisor.Supervisor(Group.of(settings), [])
    run = asyncio.create_task(group.run())
    while not group._slots:
        await asyncio.sleep(0)
    assert await asyncio.wait_for(group.reload(), 30)  # a SIGHUP as the group starts
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    starts, listens, ends = (
        {p.stem: p.stat().st_mtime_ns for p in notes.glob(f"*.{what}")}
        for what in ("start", "listens", "end")
    )
    assert len(starts) == 4 and set(listens) == set(ends) == set(starts)
    for index in ("w0", "w1"):
        first, second = sorted((n for n in starts if n.startswith(index)), key=lambda n: starts[n])
        # The successor started after its predecessor listened, and listened
        # before its predecessor was told to leave.
        assert listens[first] <= starts[second] <= listens[second] <= ends[first]
        assert noted(notes, ".end")[first] == "SIGUSR2"
        assert noted(notes, ".end")[second] == "SIGTERM"


async def test_a_worker_that_dies_during_its_reload_is_a_death_not_a_failed_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 32: it was logged as killed "while stopping" (nothing had
    stopped it), and made the group's clean stop exit 1."""
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    (notes / "die-at-successor").touch()
    (notes / "slow").touch()  # it dies while its successor starts
    assert await asyncio.wait_for(group.reload(), 30)
    assert "during the reload; pid" in caplog.text and "takes its place" in caplog.text
    assert "while stopping" not in caplog.text
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0


async def test_a_stop_during_a_reload_stops_old_and_new_at_once_and_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    group, run, notes = await notes_group(monkeypatch, tmp_path)
    (notes / "slow").touch()  # the successor is still starting when the stop comes
    reload = asyncio.create_task(group.reload())
    while len(noted(notes, ".start")) < 3:
        await asyncio.sleep(0.01)
    group.stopping.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert not await reload
    assert "reload stopped" not in caplog.text  # a stop is not a failed reload
    assert set(noted(notes, ".end").values()) == {"SIGTERM"}
    assert len(noted(notes, ".end")) == 3


class StuckProcess:
    """A worker process that outlives every signal but SIGKILL."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.killed = asyncio.Event()

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.killed.set()

    async def exit_code(self) -> int:
        await self.killed.wait()
        return -signal.SIGKILL


@pytest.mark.parametrize("then", ["stop", "reload"])
async def test_a_leaving_worker_has_a_stops_budget_once_the_group_stops_or_reloads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    """Review 33: a worker a reload retired kept its leave's budget (600 s
    and the grace) when the group stopped, though SIGTERM cut its wait to
    --drain-seconds: a stuck one held the group's stop for over 11 minutes.
    And each SIGHUP retired more workers while earlier ones still finished
    their streams, past the documented twice the group's processes."""
    caplog.set_level(logging.INFO, "dataplane.workers")
    monkeypatch.setattr(supervisor, "SHUTDOWN_GRACE_S", 0.05)
    group = supervisor.Supervisor(Group.of(parse([*BASE, "--listen", "127.0.0.1:0"])), [])
    proc = StuckProcess()
    exited = asyncio.create_task(proc.exit_code())
    listening = asyncio.create_task(asyncio.sleep(0))
    group._retire(
        0,
        supervisor._Process(cast(asyncio.subprocess.Process, proc), exited, listening, 0.0),
        LEAVE_SIGNAL,
    )
    await asyncio.sleep(0.2)
    assert not proc.killed.is_set()  # leaving: it may finish its requests for long
    if then == "stop":
        group.stopping.set()
        group._hurry()  # as run() does then
    else:
        assert await group.reload()  # a group of no workers: the hurry alone
        assert "1 workers an earlier reload retired still finish requests" in caplog.text
    # --drain-seconds is 0: the grace alone is left.
    await asyncio.wait_for(asyncio.gather(*group._leaving), 10)
    assert proc.signals == [LEAVE_SIGNAL, signal.SIGTERM] and proc.killed.is_set()
    assert "did not stop in time; killing it" in caplog.text
    await listening


async def test_a_group_stopped_before_it_started_its_workers_starts_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    fake_workers(monkeypatch, NOTES, notes)
    settings = parse([*BASE, "--workers", "3", "--listen", "127.0.0.1:0"])
    group = supervisor.Supervisor(Group.of(settings), [])
    group.stopping.set()  # a SIGTERM that waited for the handlers
    assert await asyncio.wait_for(group.run(), 30) == 0
    assert noted(notes, ".start") == {}


# ---------------------------------------------------------------- the merge


def test_a_label_goes_first_whatever_the_line_holds() -> None:
    w = workers.with_label
    assert w("up 1.0", "worker", "0") == 'up{worker="0"} 1.0'
    assert w("up{} 1", "worker", "0") == 'up{worker="0"} 1'
    assert w('a_total{k="x"} 2', "worker", "1") == 'a_total{worker="1",k="x"} 2'
    assert w('a{k="} {x"} 2 1700000000', "worker", "1") == 'a{worker="1",k="} {x"} 2 1700000000'


def exposition(metrics: Metrics) -> bytes:
    from prometheus_client import generate_latest  # noqa: PLC0415

    return generate_latest(metrics.registry)


def test_merge_keeps_each_family_together_with_every_workers_series() -> None:
    parts: list[tuple[int, bytes | None]] = []
    for index, count in ((0, 3), (1, 5)):
        m = Metrics()
        m.requests.labels("chat.completions", "200").inc(count)
        m.duration.labels("chat.completions").observe(0.01 * count)
        m.operation("chat", "m", "", "r1", "miss", 0.1 * count, 0.01, Usage(count, 1))
        m.table_version.set(40 + index)
        m.table_nacks.read = float(index).__float__
        parts.append((index, exposition(m)))
    parts.append((2, None))
    merged = workers.merge_expositions(parts).decode()

    families = {f.name: f for f in text_string_to_metric_families(merged)}
    requests = families["ponto_requests"]
    totals = {(s.labels["worker"], s.value) for s in requests.samples if s.name.endswith("_total")}
    assert totals == {("0", 3.0), ("1", 5.0)}
    version = families["ponto_route_table_version"]
    assert sorted((s.labels["worker"], s.value) for s in version.samples) == [
        ("0", 40.0),
        ("1", 41.0),
    ]
    counts = [s for s in families["ponto_request_duration_seconds"].samples if "_count" in s.name]
    assert sorted(s.labels["worker"] for s in counts) == ["0", "1"]
    up = {s.labels["worker"]: s.value for s in families["ponto_worker_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    # Each worker is a process: its process_* series are its own, by worker.
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "python_info"):
        assert sorted(s.labels["worker"] for s in families[name].samples) == ["0", "1"], name
    # One HELP and TYPE per family: the text format forbids a family in two groups.
    helps = [line for line in merged.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps))
    # Counters stay counters (NACKs too, read at scrape time), with no _created.
    assert "_created" not in merged
    for family in families.values():
        if any(s.name.endswith("_total") for s in family.samples):
            assert family.type == "counter", family.name
    nacks = families["ponto_route_table_nacks"]
    assert sorted((s.labels["worker"], s.value) for s in nacks.samples) == [
        ("0", 0.0),
        ("1", 1.0),
    ]
    genai = families["gen_ai_client_operation_duration_seconds"]
    assert genai.type == "histogram"
    assert sorted(s.labels["worker"] for s in genai.samples if s.name.endswith("_count")) == [
        "0",
        "1",
    ]
    promtool_accepts(merged)


def test_merge_keeps_a_family_only_some_workers_have() -> None:
    a = b"# HELP x_total X\n# TYPE x_total counter\nx_total 1.0\n"
    b = b"# HELP y Y\n# TYPE y gauge\ny 2.0\n" + a.replace(b"1.0", b"4.0")
    merged = workers.merge_expositions([(0, a), (1, b)]).decode()
    lines = merged.splitlines()
    assert lines[:4] == ["# HELP x_total X", "# TYPE x_total counter", 'x_total{worker="0"} 1.0',
                         'x_total{worker="1"} 4.0']  # fmt: skip
    assert 'y{worker="1"} 2.0' in lines
    promtool_accepts(merged)


def test_a_workers_other_process_is_merged_as_series_of_its_own() -> None:
    """Trial 50: what a reload's old process finished after its successor
    took the worker's name over (a long stream) was in no scrape. Its
    samples are merged too, with a `pid` label: series of their own."""
    new = b"# HELP x_total X\n# TYPE x_total counter\nx_total 1.0\n"
    old = new.replace(b"1.0", b"7.0")
    merged = workers.merge_expositions([(0, new)], [(0, 4242, old)]).decode()
    lines = merged.splitlines()
    assert 'x_total{worker="0"} 1.0' in lines
    assert 'x_total{worker="0",pid="4242"} 7.0' in lines
    assert 'ponto_worker_up{worker="0"} 1.0' in lines and "4242" not in lines[-1]
    promtool_accepts(merged)


def test_other_processes_are_found_by_the_names_they_keep(tmp_path: Path) -> None:
    """publish_sockets keeps each process's own name for its socket beside
    the worker's, which the holder's process links: one of another inode is
    another process's (a plain file stands for a socket here)."""
    for pid in (11, 12, 13):
        (tmp_path / f"w0.sock.{pid}").write_bytes(b"")
    os.link(tmp_path / "w0.sock.12", tmp_path / "w0.sock")  # 12 holds worker 0's name
    (tmp_path / "w1.sock.21").write_bytes(b"")  # worker 1: starting, no name yet
    (tmp_path / "w0.sock.13.new").write_bytes(b"")  # a link being made: not a process
    found = workers.other_processes(tmp_path, 2, supervisor.socket_path)
    assert found == [
        (0, 11, tmp_path / "w0.sock.11"),
        (0, 13, tmp_path / "w0.sock.13"),
        (1, 21, tmp_path / "w1.sock.21"),
    ]


def test_a_process_knows_whether_it_holds_its_workers_name(tmp_path: Path) -> None:
    """Review (helper-192): a process that no longer held its worker's name
    (its successor took it over) merged its own series as the worker's and
    again under its pid, and left its successor's out."""
    name = supervisor.socket_path(tmp_path, 0)
    assert workers._holds(name, 11)  # nobody has published yet
    for pid in (11, 12):
        supervisor.own_socket_path(name, pid).write_bytes(b"")
    os.link(supervisor.own_socket_path(name, 12), name)
    assert workers._holds(name, 12) and not workers._holds(name, 11)


def test_the_supervisor_forgets_the_socket_names_of_a_worker_that_ended(tmp_path: Path) -> None:
    """Review (helper-192): a crashed or killed worker left the names of its
    sockets, which every scrape then tried."""
    kept = [supervisor.own_socket_path(supervisor.socket_path(tmp_path, 0), 8)]
    gone = [
        supervisor.own_socket_path(supervisor.socket_path(tmp_path, 0), 7),
        supervisor.own_socket_path(supervisor.metrics_socket_path(tmp_path, 0), 7),
        tmp_path / "w0.sock.7.new",
    ]
    for path in kept + gone:
        path.write_bytes(b"")
    supervisor.forget_sockets(tmp_path, 0, 7)
    assert [p.exists() for p in kept + gone] == [True, False, False, False]


def promtool_accepts(text: str) -> None:
    """`promtool check metrics` where it is installed (Debian's prometheus package)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # the prometheus_client parser above has read it already
    out = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- group views


@dataclass
class Worker:
    index: int
    metrics: Metrics
    port: int
    ready: bool = True
    stuck: bool = False


def worker_app(w: Worker, run_dir: Path, count: int) -> web.Application:
    """What the group middleware needs of build_app: named routes, the app's own
    middleware, metrics; readiness switched by the test."""

    async def readyz(request: web.Request) -> web.Response:
        if w.stuck:
            await asyncio.sleep(5)
        if not w.ready:
            raise ApiError(503, "no route table yet", type="server_error", code="no_route_table")
        return web.json_response({"status": "ready"})

    draining, ids = Draining(), RequestIds()
    app = web.Application(middlewares=[error_boundary(w.metrics, draining, ids)])
    app.middlewares.append(workers.group_views(WorkerSlot(w.index, run_dir, -1), count))
    app[METRICS] = w.metrics
    app[DRAINING] = draining
    app[REQUEST_IDS] = ids
    app.router.add_get("/readyz", readyz, name="readyz")
    app.router.add_get("/metrics", metrics, name="metrics")
    return app


@asynccontextmanager
async def group(
    tmp_path: Path, count: int, running: tuple[int, ...]
) -> AsyncIterator[dict[int, Worker]]:
    """Workers `running` of a group of `count`, each on TCP and its private socket."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started: dict[int, Worker] = {}
    runners = []
    try:
        for index in running:
            w = Worker(index, Metrics(), 0)
            runner = web.AppRunner(worker_app(w, run_dir, count))
            await runner.setup()
            runners.append(runner)
            await web.UnixSite(runner, str(supervisor.socket_path(run_dir, index))).start()
            tcp = web.TCPSite(runner, "127.0.0.1", 0)
            await tcp.start()
            assert tcp._server is not None
            w.port = tcp._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            started[index] = w
        yield started
    finally:
        for runner in runners:
            await runner.cleanup()


async def get(w: Worker, path: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{w.port}{path}") as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def get_private(run_dir: Path, index: int, path: str) -> bytes:
    connector = aiohttp.UnixConnector(path=str(supervisor.socket_path(run_dir, index)))
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.get(f"http://worker{path}") as r,
    ):
        return await r.read()


def requests_by_worker(text: bytes) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == "ponto_requests_total" and s.labels.get("endpoint") == "work":
                out[s.labels["worker"]] = s.value
    return out


async def test_metrics_from_any_worker_show_every_worker(tmp_path: Path) -> None:
    async with group(tmp_path, 3, running=(0, 1)) as ws:
        for index, count in ((0, 2), (1, 7)):
            m = ws[index].metrics
            m.requests.labels("work", "200").inc(count)
        for index in (0, 1):
            status, headers, body = await get(ws[index], "/metrics")
            assert status == 200
            assert headers["x-ponto-worker"] == str(index)
            assert headers["content-type"].startswith("text/plain")
            assert requests_by_worker(body) == {"0": 2.0, "1": 7.0}
            assert 'ponto_worker_up{worker="2"} 0.0' in body.decode()
            promtool_accepts(body.decode())
        # A sibling asking over the private socket gets this worker's own series.
        own = await get_private(tmp_path / "run", 1, "/metrics")
        assert b'worker="' not in own and b'ponto_requests_total{code="200",endpoint="work"}' in own


async def test_a_group_scrape_is_gzip_when_prometheus_asks(tmp_path: Path) -> None:
    """The group's view is compressed as a worker's own is (Prometheus sends
    `Accept-Encoding: gzip`), its siblings' parts read as text."""
    async with group(tmp_path, 2, running=(0, 1)) as ws:
        for index, count in ((0, 2), (1, 7)):
            ws[index].metrics.requests.labels("work", "200").inc(count)
        async with (
            aiohttp.ClientSession(auto_decompress=False) as s,
            s.get(f"http://127.0.0.1:{ws[1].port}/metrics", headers=PROMETHEUS) as r,
        ):
            assert r.status == 200
            assert (r.headers["Content-Encoding"], r.headers["x-ponto-worker"]) == ("gzip", "1")
            text = gzip.decompress(await r.read())
    assert requests_by_worker(text) == {"0": 2.0, "1": 7.0}
    assert b'ponto_worker_up{worker="0"} 1.0' in text


async def test_a_worker_without_a_table_makes_the_group_unready(tmp_path: Path) -> None:
    async with group(tmp_path, 3, running=(0, 1)) as ws:
        # Worker 2 is not listening: it gets no connections, so it does not count.
        assert (await get(ws[0], "/readyz"))[0] == 200
        ws[1].ready = False
        status, headers, body = await get(ws[0], "/readyz")
        assert (status, headers["x-ponto-worker"]) == (503, "0")
        assert b"worker_not_ready" in body and b"worker 1" in body and b"no_route_table" in body
        status, headers, body = await get(ws[1], "/readyz")
        assert (status, headers["x-ponto-worker"]) == (503, "1")
        assert b'"no_route_table"' in body
        ws[1].ready = True
        assert (await get(ws[1], "/readyz"))[0] == 200


async def test_a_stuck_sibling_is_unready_and_left_out_of_scrapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "SIBLING_TIMEOUT_S", 0.2)
    async with group(tmp_path, 2, running=(0, 1)) as ws:
        ws[1].stuck = True
        status, _, body = await get(ws[0], "/readyz")
        assert status == 503 and b"no answer within 0.2 s" in body
        # Metrics of worker 1 answer fine: only its /readyz handler is slow here.
        assert b'ponto_worker_up{worker="1"} 1.0' in (await get(ws[0], "/metrics"))[2]


async def test_every_other_route_passes_through(tmp_path: Path) -> None:
    """Only the two named routes are the group's: a proxied request is one worker's."""

    async def work(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.middlewares.append(workers.group_views(WorkerSlot(0, tmp_path, -1), 2))
    app.router.add_get("/work", work, name="work")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/work") as r:
            assert (r.status, await r.text()) == (200, "ok")
            assert "x-ponto-worker" not in r.headers
    finally:
        await runner.cleanup()


async def test_a_proxied_request_on_the_edge_passes_no_frame_of_the_groups_views(
    tmp_path: Path,
) -> None:
    """On the edge's dispatch (FixedRoutes) the group's views wrap /metrics and
    /readyz alone: any other request would only be passed on, through a frame
    of their own (some 900 instructions each wait), in a group only."""
    frames: dict[str, list[str]] = {}

    async def ok(request: web.Request) -> web.Response:
        frame: FrameType | None = sys._getframe()
        seen = []
        while frame is not None:
            seen.append(frame.f_code.co_filename)
            frame = frame.f_back
        frames[request.match_info.route.name or ""] = seen
        return web.Response(text="ok")

    async def fallback(request: web.BaseRequest) -> web.StreamResponse:
        raise AssertionError(f"{request.path}: not a fixed route")

    app = web.Application()
    app.middlewares.append(workers.group_views(WorkerSlot(0, tmp_path, -1), 2))
    for path, name in (("/v1/chat/completions", "chat"), ("/readyz", workers.READY_ROUTE)):
        app.router.add_get(path, ok, name=name)
    app.freeze()
    fixed = FixedRoutes(app, fallback)
    for path in ("/v1/chat/completions", "/readyz"):
        transport = mock.Mock(get_extra_info=lambda *_: None)  # over TCP, not a sibling's
        response = await fixed(make_mocked_request("GET", path, app=app, transport=transport))
        assert response.status == 200
    assert workers.__file__ in frames[workers.READY_ROUTE]  # sibling 1 asked, none there
    assert workers.__file__ not in frames["chat"]


def test_the_supervisor_imports_the_standard_library_alone() -> None:
    """What `ponto-proxy --workers N` becomes once its flags are checked
    (tests/e2e/test_workers.py looks at a running one)."""
    script = (
        "import sys, dataplane.supervisor\n"
        "print(sorted(m for m in ('aiohttp', 'grpc', 'uvloop', 'multidict', 'yarl', 'numpy',"
        " 'google.protobuf', 'dataplane.settings') if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stdout.strip() == "[]"


def test_a_group_spec_survives_its_trip_through_the_command_line(tmp_path: Path) -> None:
    settings = parse(
        [*BASE, "--workers", "3", "--listen", "[::1]:0", "--metrics-listen", "127.0.0.1:9",
         "--ready-file", str(tmp_path / "ready"), "--drain-seconds", "2.5"]
    )  # fmt: skip
    group = Group.of(settings)
    assert Group.from_json(group.to_json()) == group
    assert (group.workers, group.listen_host, group.metrics_listen) == (3, "::1", ("127.0.0.1", 9))
    assert (group.ready_file, group.drain_seconds) == (str(tmp_path / "ready"), 2.5)
