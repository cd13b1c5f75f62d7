"""Processes of a benchmark: their trees, CPU time, memory and CPU placement (Linux /proc).

Every function here reads or pins processes by pid and tolerates a process
that has gone meanwhile (it then counts as nothing). Nothing here is
thread-safe in the sense of `affinity`: it changes the calling thread's mask.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

_CLK_TCK = os.sysconf("SC_CLK_TCK")
# The CPUs this process could use when this module was imported. Not the current
# mask: a benchmark narrows its own (bench.compare pins itself to the load CPU) and
# must still place the server under test on another CPU.
CPUS_AT_START = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())


# The CPUs the benches place on: the server under test on the first, the load on
# the second (bench.compare's SERVER_CPU and LOAD_CPU).
PINNED_CPUS = frozenset({0, 1})


def cpus_available() -> bool:
    """Whether CPUs 0 and 1 (PINNED_CPUS) are both among CPUS_AT_START, the CPUs
    this process started with: true as well after the caller has pinned itself
    to one of them; false in a container limited to other CPUs, where pinning
    to 0 or 1 would fail."""
    return hasattr(os, "sched_setaffinity") and PINNED_CPUS <= CPUS_AT_START


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """Pin this thread to `cpus` for the block; processes started inside inherit it."""
    if cpus is None or not cpus_available():
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def pin_tree(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid and its descendants (threads made later inherit it)."""
    if not cpus_available():
        return
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), cpus)


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_cpu(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each pid with its descendants' (each process counted once per pid)."""
    return {pid: sum(cpu_seconds(p) for p in set(process_tree(pid))) for pid in pids}


def status_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in kB (VmHWM, VmRSS); 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_mb(pid: int, key: str) -> float:
    """A status field summed over pid's tree, in MB (one decimal)."""
    return round(sum(status_kb(p, key) for p in process_tree(pid)) / 1024, 1)


def largest_mb(pid: int, key: str) -> float:
    """The largest value of a status field among pid's tree, in MB: one worker's figure
    when the server forks workers (for one process it equals tree_mb)."""
    return round(max((status_kb(p, key) for p in process_tree(pid)), default=0) / 1024, 1)
