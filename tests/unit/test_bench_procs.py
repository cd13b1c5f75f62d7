"""bench/procs.py: pinning still works after the caller has pinned itself to one CPU
(bench.compare does so first, and placed every server on its own CPU by mistake)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.procs import CPUS_AT_START, PINNED_CPUS, affinity, cpus_available, pin_tree

pytestmark = pytest.mark.skipif(
    not PINNED_CPUS <= CPUS_AT_START, reason="needs CPUs 0 and 1 to pin to"
)


def test_a_narrowed_caller_still_places_children_on_other_cpus() -> None:
    first, second = sorted(PINNED_CPUS)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {second})
    try:
        assert cpus_available()
        with affinity({first}):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert os.sched_getaffinity(child.pid) == {first}
            pin_tree(child.pid, {first, second})
            assert os.sched_getaffinity(child.pid) == {first, second}
        finally:
            child.kill()
            child.wait()
        assert os.sched_getaffinity(0) == {second}
    finally:
        os.sched_setaffinity(0, before)
