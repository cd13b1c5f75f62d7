"""What build of Ponto a process runs, as proxies and control-plane replicas
report it: `ProxyInfo.version` and `ControlPlaneInfo.version` (`pontoctl get
proxies` and `get controlplanes`, column VERSION), the proxies' and replicas'
`*_build_info` metrics.

The package's version alone did not tell builds apart (trial 69: both sides of
a rolling upgrade 400 commits apart said 0.1.0, so an operator could not see
which processes were upgraded). The commit the build was made from is added
as a PEP 440 local label, `0.1.0+3f2a9c1d04b7`:

- from `ponto/_build.txt`, which the image build writes (the Dockerfile's
  BUILD_COMMIT argument: `--build-arg BUILD_COMMIT=$(git rev-parse HEAD)`);
- else from the git checkout the package runs from (an editable install, a
  laptop's `make demo`), read once per process with `git rev-parse`;
- else the version alone (an install from a wheel built without it).
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
from pathlib import Path

from ponto.release import installed_version

__all__ = ["add_version_flag", "software_version"]

_PACKAGE = Path(__file__).resolve().parent
BUILD_FILE = _PACKAGE / "_build.txt"
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
# Enough hex to name a commit among hundreds of thousands.
SHOWN = 12


@functools.cache
def software_version() -> str:
    """`VERSION+COMMIT`, or `VERSION` when no commit is known; "dev" for a
    source tree that is not installed. Cached: a git call at most once per
    process, at start (registration, metrics), never per request."""
    # Not importlib.metadata.version: ponto.release says why.
    base = installed_version("ponto") or "dev"  # "dev": a source tree never installed
    commit = build_commit()
    return f"{base}+{commit[:SHOWN]}" if commit else base


def build_commit(build_file: Path = BUILD_FILE, tree: Path = _PACKAGE.parent) -> str:
    """The commit this build was made from (lowercase hex), or ""."""
    try:
        written = build_file.read_text().strip().lower()
    except OSError:
        written = ""
    if _COMMIT.fullmatch(written):
        return written
    if not (tree / ".git").exists():
        return ""
    try:
        done = subprocess.run(  # noqa: S603 - a fixed command, no shell
            ["git", "-C", str(tree), "rev-parse", "HEAD"],  # noqa: S607 - git from PATH
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    found = done.stdout.strip().lower()
    return found if done.returncode == 0 and _COMMIT.fullmatch(found) else ""


class _VersionAction(argparse.Action):
    """`--version`: says `PROG VERSION` and exits 0, reading the build only
    when asked (argparse's own version action takes the string when the
    parser is built: a `git rev-parse` for every pontoctl command)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        # On stdout, as argparse's own version action writes it.
        print(f"{parser.prog} {software_version()}")  # noqa: T201
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Give `parser` a `--version` that says this build (software_version),
    as `pontoctl get proxies` and `get controlplanes` show the fleet's
    (trial 70: the upgrade docs ask for a pontoctl of the control plane's
    build)."""
    parser.add_argument(
        "--version", action=_VersionAction, nargs=0, default=argparse.SUPPRESS,
        help="say this build's version (0.1.0+COMMIT) and exit",
    )  # fmt: skip
