"""Made-up host names that only the system resolver knows, for one subprocess.

A process started through `PrivateHosts.argv` runs in its own mount namespace
(`unshare -m`, which needs root or user namespaces) with a private file bind-
mounted over /etc/hosts. Names under `.test` (RFC 2606) resolve there and
nowhere else, so a test that reaches etcd through them proves that host names
work, not that `localhost` does. The file can be rewritten while the process
runs (in place: the bind mount pins the inode), as a name that moves.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

NAME_A = "etcd-a.ponto.test"
NAME_B = "etcd-b.ponto.test"


def unshare_problem() -> str:
    """Why private hosts files cannot be used here, or "" if they can."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -m failed: {exc}"
    if probe.returncode:
        return f"unshare -m cannot bind-mount (needs root): {probe.stderr.decode().strip()}"
    return ""


class PrivateHosts:
    """A hosts file and the argv prefix that runs a command with it as /etc/hosts."""

    def __init__(self, path: Path, names: Mapping[str, str]) -> None:
        self.path = path
        self.write(names)

    def write(self, names: Mapping[str, str]) -> None:
        """Map name -> IPv4 address (and localhost); visible at once to running processes."""
        lines = ["127.0.0.1 localhost", *(f"{ip} {name}" for name, ip in names.items())]
        with self.path.open("r+" if self.path.exists() else "w") as f:
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    def argv(self, command: Sequence[str]) -> list[str]:
        script = f'mount --bind {shlex.quote(str(self.path))} /etc/hosts && exec "$@"'
        return ["unshare", "-m", "sh", "-c", script, "sh", *command]
