"""The demo's supervisor with fake processes and a hand-moved clock."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, cast

import pytest

from ponto import devenv
from ponto.supervise import Backoff, Supervisor, describe_exit

_pids = itertools.count(100)


class FakeProcess:
    def __init__(self) -> None:
        self.pid = next(_pids)
        self.status: int | None = None
        self.sent: int | None = None

    def returncode(self) -> int | None:
        return self.status

    def sent_signal(self) -> int | None:
        return self.sent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Launcher:
    """Starts FakeProcesses; `fail` makes the next starts raise."""

    def __init__(self) -> None:
        self.started: list[FakeProcess] = []
        self.fail = 0

    def __call__(self) -> FakeProcess:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("port 9000 in use\nlog tail line")
        self.started.append(FakeProcess())
        return self.started[-1]

    @property
    def current(self) -> FakeProcess:
        return self.started[-1]


def setup() -> tuple[Supervisor, Clock, Launcher, list[str]]:
    clock, launcher, lines = Clock(), Launcher(), list[str]()
    supervisor = Supervisor(clock, lines.append)
    supervisor.watch("origin-us-east", launcher(), launcher)
    return supervisor, clock, launcher, lines


def test_a_live_child_is_left_alone() -> None:
    supervisor, clock, launcher, lines = setup()
    for _ in range(5):
        clock.now += 60
        supervisor.poll()
    assert len(launcher.started) == 1
    assert lines == []


def test_a_death_is_reported_and_the_child_restarted_after_the_first_delay() -> None:
    supervisor, clock, launcher, lines = setup()
    first = launcher.current
    first.status = -signal.SIGKILL
    supervisor.poll()
    assert lines == [f"origin-us-east (pid {first.pid}) killed by SIGKILL; restarting it in 0.5 s"]
    clock.now += 0.4
    supervisor.poll()
    assert len(launcher.started) == 1, "restarted before its delay"
    clock.now += 0.1
    supervisor.poll()
    assert len(launcher.started) == 2
    assert lines[-1] == f"origin-us-east is back (pid {launcher.current.pid})"
    # The new process is the one watched from now on.
    launcher.current.status = 1
    supervisor.poll()
    assert lines[-1].startswith(f"origin-us-east (pid {launcher.current.pid}) exited with code 1")


def delays_of_a_crash_loop(supervisor: Supervisor, clock: Clock, launcher: Launcher) -> list[float]:
    """Kill the child as soon as it is back, 8 times; the delays the supervisor waited."""
    delays = []
    for _ in range(8):
        launcher.current.status = 1
        supervisor.poll()
        died_at, before = clock.now, len(launcher.started)
        while len(launcher.started) == before:
            clock.now += 0.25
            supervisor.poll()
        delays.append(clock.now - died_at)
    return delays


def test_a_crash_loop_backs_off_doubling_up_to_ten_seconds() -> None:
    supervisor, clock, launcher, _ = setup()
    assert delays_of_a_crash_loop(supervisor, clock, launcher) == [
        0.5, 1, 2, 4, 8, 10, 10, 10
    ]  # fmt: skip


def test_the_backoff_resets_once_the_child_stayed_up() -> None:
    supervisor, clock, launcher, lines = setup()
    delays_of_a_crash_loop(supervisor, clock, launcher)
    clock.now += 29
    launcher.current.status = 1
    supervisor.poll()
    assert lines[-1].endswith("restarting it in 10 s"), "29 s up is not yet stable"
    clock.now += 10
    supervisor.poll()
    clock.now += 30
    launcher.current.status = 1
    supervisor.poll()
    assert lines[-1].endswith("restarting it in 0.5 s")


def test_a_failed_start_is_reported_and_retried_with_the_next_delay() -> None:
    supervisor, clock, launcher, lines = setup()
    launcher.current.status = -signal.SIGTERM
    launcher.fail = 2
    supervisor.poll()
    clock.now += 0.5
    supervisor.poll()
    assert lines[-1] == (
        "origin-us-east did not start again (RuntimeError: port 9000 in use); next try in 1 s"
    )
    clock.now += 0.9
    supervisor.poll()
    assert len(launcher.started) == 1
    clock.now += 0.1
    supervisor.poll()
    assert lines[-1].endswith("next try in 2 s")
    clock.now += 2
    supervisor.poll()
    assert len(launcher.started) == 2
    assert lines[-1] == f"origin-us-east is back (pid {launcher.current.pid})"


def test_children_are_independent() -> None:
    clock, lines = Clock(), list[str]()
    supervisor = Supervisor(clock, lines.append, Backoff(first=1, limit=4, stable_after=5))
    a, b = Launcher(), Launcher()
    supervisor.watch("a", a(), a)
    supervisor.watch("b", b(), b)
    a.current.status = 1
    supervisor.poll()
    clock.now += 1
    supervisor.poll()
    assert len(a.started) == 2 and len(b.started) == 1
    assert [line.split()[0] for line in lines] == ["a", "a"]
    b.current.status = 1
    supervisor.poll()
    assert lines[-1].startswith("b ") and lines[-1].endswith("restarting it in 1 s")


@pytest.mark.parametrize(
    ("status", "sent", "words"),
    [
        # The demo's children exit 0 only on a SIGTERM or SIGINT they handled.
        (0, None, "stopped by SIGTERM or SIGINT, not from the demo (exit code 0)"),
        (3, None, "exited with code 3"),
        (-9, None, "killed by SIGKILL"),
        (-15, None, "killed by SIGTERM"),
        (-200, None, "killed by signal 200"),
        (0, signal.SIGTERM, "stopped by the demo (SIGTERM)"),
        (-15, signal.SIGTERM, "stopped by the demo (SIGTERM)"),
        (-9, signal.SIGKILL, "stopped by the demo (SIGKILL)"),
        (1, signal.SIGTERM, "stopped by the demo (SIGTERM); exited with code 1"),
    ],
)
def test_exit_statuses_in_words(status: int, sent: int | None, words: str) -> None:
    assert describe_exit(status, sent) == words


HANDLES_SIGTERM = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "pathlib.Path(sys.argv[1]).write_text('ready')\n"
    "time.sleep(60)\n"
)


def test_a_child_stopped_by_a_signal_it_handled_is_not_said_to_have_exited(
    tmp_path: Path,
) -> None:
    # Trial: a user's `kill PID` of an origin (which exits 0 on SIGTERM, as
    # every child of the demo) read "exited with code 0".
    ready = tmp_path / "ready"
    argv = [sys.executable, "-c", HANDLES_SIGTERM, str(ready)]
    child = devenv.spawn("origin-us-east", argv, tmp_path, ready_file=ready)
    lines: list[str] = []
    supervisor = Supervisor(Clock(), lines.append)
    supervisor.watch("origin-us-east", child, lambda: child)
    try:
        os.kill(child.pid, signal.SIGTERM)  # as the user does, not through the demo
        child.proc.wait(10)
        supervisor.poll()
    finally:
        child.stop()
    assert child.returncode() == 0
    assert lines == [
        f"origin-us-east (pid {child.pid}) stopped by SIGTERM or SIGINT, "
        "not from the demo (exit code 0); restarting it in 0.5 s"
    ]
    # One the demo stops says so.
    ready.unlink()
    again = devenv.spawn("origin-us-east", argv, tmp_path, ready_file=ready)
    assert again.stop() == 0
    assert again.sent_signal() == signal.SIGTERM
    assert describe_exit(0, again.sent_signal()) == "stopped by the demo (SIGTERM)"


def test_children_stop_stops_a_child_whose_handle_was_lost(tmp_path: Path) -> None:
    children = devenv.Children()
    with (tmp_path / "log").open("ab") as log:
        proc = children.start(["sleep", "30"], log, {})
    del proc  # as when a signal lands before the handle reaches the fleet
    [child] = children.running()
    children.stop()
    assert child.poll() is not None
    assert not children.running()


def test_a_guarded_signal_handler_waits_until_the_child_is_registered(tmp_path: Path) -> None:
    children = devenv.Children()
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(len(children.running()))  # what a stop would find
        raise KeyboardInterrupt

    guarded = children.guard(handler)
    real_popen = subprocess.Popen

    def popen_then_signal(*args: Any, **kw: Any) -> Any:
        proc = real_popen(*args, **kw)
        guarded(signal.SIGTERM, None)  # lands before the handle is registered
        assert seen == []  # deferred
        return proc

    with (tmp_path / "log").open("ab") as log, pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", popen_then_signal)
        with pytest.raises(KeyboardInterrupt):
            children.start(["sleep", "30"], log, {})
    assert seen == [1]
    children.stop()
    assert not children.running()


def test_children_are_started_from_several_threads_at_once() -> None:
    """While one start looks over the children (which have exited?), another
    thread's start registers its own: both are kept, and neither fails
    (bench/affinity.py: 'Set changed size during iteration')."""
    children = devenv.Children()
    outcomes: list[object] = []
    threads: list[threading.Thread] = []

    class Child:
        def __init__(self, *args: object, **kw: object) -> None:
            pass

        def poll(self) -> int | None:
            if not threads:
                threads.append(threading.Thread(target=lambda: outcomes.append(start())))
                threads[0].start()
                threads[0].join(0.5)  # ends here unless it must wait for this start
            return None

    def start() -> object:
        try:
            return children.start([], cast(IO[bytes], None), {})
        except RuntimeError as exc:
            return exc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", Child)
        first = start()
        second = start()  # looks over `first` while another thread starts one
        threads[0].join(10)
    assert isinstance(first, Child) and isinstance(second, Child), second
    assert [type(o) for o in outcomes] == [Child], outcomes
    assert set(children.running()) == {first, second, *outcomes}


def test_a_child_started_while_the_others_stop_is_still_known_after() -> None:
    """`stop` forgets only what it stopped: a child another thread started
    while it waited for the others is still running, and the next stop ends it."""
    children = devenv.Children()
    late: list[object] = []

    class Child:
        def __init__(self, *args: object, **kw: object) -> None:
            self.done: int | None = None

        def poll(self) -> int | None:
            return self.done

        def terminate(self) -> None:
            self.done = -15

        def wait(self, timeout: float | None = None) -> int | None:
            if not late:  # another thread's start, landing in this wait
                late.append(children.start([], cast(IO[bytes], None), {}))
            return self.done

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", Child)
        first = children.start([], cast(IO[bytes], None), {})
        children.stop()
        assert children.running() == late, (first, late)
        children.stop()
    assert children.running() == []
    assert [cast(Child, c).done for c in (first, *late)] == [-15, -15]


def test_a_signal_deferred_by_another_threads_start_is_handled_in_the_main_thread() -> None:
    """A start in a worker thread defers a guarded handler as the main
    thread's does; once it ends, the handler runs in the main thread, where
    Python runs signal handlers (the demo's raises KeyboardInterrupt: raised
    in a worker it would stop nothing)."""
    children = devenv.Children()
    ran_in: list[str] = []
    inside, go = threading.Event(), threading.Event()

    class Child:
        def __init__(self, *args: object, **kw: object) -> None:
            inside.set()
            go.wait(10)

        def poll(self) -> int | None:
            return None

    def handler(signum: int, frame: object) -> None:
        ran_in.append(threading.current_thread().name)

    worker = threading.Thread(
        target=lambda: children.start([], cast(IO[bytes], None), {}), name="worker"
    )
    old = signal.signal(signal.SIGUSR1, children.guard(handler))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(subprocess, "Popen", Child)
            worker.start()
            assert inside.wait(10)
            signal.raise_signal(signal.SIGUSR1)  # the worker's child is half started
            assert ran_in == []  # deferred
            go.set()
            worker.join(10)
        for _ in range(100):  # the main thread runs it at its next check
            if ran_in:
                break
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert ran_in == [threading.main_thread().name]


def test_a_signal_deferred_by_a_start_that_fails_is_handled_then() -> None:
    """A signal that lands while Popen fails is handled as the start ends,
    not kept for whichever start comes next."""
    children = devenv.Children()
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    guarded = children.guard(handler)

    def popen_fails(*args: Any, **kw: Any) -> Any:
        guarded(signal.SIGTERM, None)
        raise OSError("no such program")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", popen_fails)
        with pytest.raises(KeyboardInterrupt):
            children.start([], cast(IO[bytes], None), {})
    assert seen == [signal.SIGTERM]
