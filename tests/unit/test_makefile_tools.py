"""The Makefile's tool targets (promtool, chromium, wrk, nginx): a missing tool is
installed with apt as root or under CI=true, and elsewhere named in one line
while make goes on, so `make unit` and `make check` reach pytest without root.

Runs the real make on the real Makefile with a PATH of fakes: `id` says which
user runs it, `apt-get` records its arguments and answers as told (an install
that fails, an update that succeeds).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helm.test_chart import ROOT

MAKE = shutil.which("make")
WAIT = "-o DPkg::Lock::Timeout=300"
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")


def run(
    tmp_path: Path,
    target: str,
    *,
    uid: int,
    ci: bool,
    apt_ok: bool = True,
    sbin: Path | None = None,
) -> tuple[int, str]:
    """`make TARGET` where no tool is installed; returns its exit code and output,
    with "apt-get ARGS" lines for each apt call. nginx is also looked for in `sbin`
    (default: a directory that does not exist, not this machine's /usr/sbin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "apt-calls"
    fakes = {
        "id": f"#!/bin/bash\necho {uid}\n",
        # apt_ok False: every install fails (an update succeeds).
        "apt-get": (
            f'#!/bin/bash\necho "apt-get $*" >> {calls}\n'
            f'[ "$1" = update ] || exit {0 if apt_ok else 100}\n'
        ),
    }
    for name, script in fakes.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)} | ({"CI": "true"} if ci else {})
    assert MAKE is not None
    out = subprocess.run(
        [
            MAKE,
            "--no-print-directory",
            "-C",
            str(ROOT),
            target,
            f"NGINX_SBIN={sbin or tmp_path / 'no-sbin'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    apt = calls.read_text() if calls.exists() else ""
    return out.returncode, out.stdout + out.stderr + apt


@pytest.mark.parametrize(
    ("target", "package"),
    [
        ("promtool", "prometheus"),
        ("chromium", "chromium-driver"),
        ("wrk", "wrk"),
        ("nginx", "nginx-light"),
    ],
)
def test_without_root_a_missing_tool_is_one_line_and_make_goes_on(
    tmp_path: Path, target: str, package: str
) -> None:
    code, output = run(tmp_path, target, uid=1000, ci=False)
    assert code == 0, output
    (line,) = output.splitlines()
    assert line.startswith(f"{target} not found: ") and "sudo apt-get install" in line
    assert package in line and "apt-get install -y" not in output


def test_as_root_a_missing_tool_is_installed(tmp_path: Path) -> None:
    code, output = run(tmp_path, "promtool", uid=0, ci=False)
    assert code == 0, output
    assert f"apt-get install -y {WAIT} --no-install-recommends prometheus" in output


def test_under_ci_a_tool_that_cannot_be_installed_stops_make(tmp_path: Path) -> None:
    code, output = run(tmp_path, "chromium", uid=1000, ci=True, apt_ok=False)
    assert code != 0
    assert f"apt-get install -y {WAIT} chromium chromium-driver" in output
    assert "apt-get update" in output


def test_each_install_waits_for_the_dpkg_lock_another_apt_holds(tmp_path: Path) -> None:
    """Trial 52: `make demo` as root stopped with "Error 100" while another apt
    held the dpkg lock; the second install, after an update, waits as well."""
    code, output = run(tmp_path, "redis-server", uid=0, ci=False, apt_ok=False)
    assert code != 0
    installs = [line for line in output.splitlines() if line.startswith("apt-get install")]
    assert len(installs) == 2 and all(WAIT in line for line in installs), output


def test_a_tool_present_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "wrk").write_text("#!/bin/bash\n")
    (tmp_path / "bin" / "wrk").chmod(0o755)
    code, output = run(tmp_path, "wrk", uid=0, ci=True)
    assert (code, output) == (0, "")


def test_nginx_in_sbin_is_present_though_path_lacks_it(tmp_path: Path) -> None:
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "nginx").write_text("#!/bin/bash\n")
    (sbin / "nginx").chmod(0o755)
    code, output = run(tmp_path, "nginx", uid=1000, ci=False, sbin=sbin)
    assert (code, output) == (0, "")
