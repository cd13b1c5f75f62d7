"""`make demo-check` (`ponto-demo --check`) as a user runs it: the README's
promise that it passes on a fresh machine. Trial 22 found it failing every
time (the status page showed no rate for a burst in the proxies' first
seconds), and nothing ran it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_every_check_of_the_demo_passes(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "ponto.demo", "--check", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "[FAIL]" not in said and ", 0 failed" in said, said
    assert "status page shows the traffic" in said
    assert f"logs kept in {workdir}" in done.stderr  # the user gave it: kept
