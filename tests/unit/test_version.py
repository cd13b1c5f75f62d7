"""Each process reports its build, not only the package's version (trial 69:
both sides of a rolling upgrade 400 commits apart said 0.1.0): the commit
from the image's build file, else from the git checkout it runs from."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from controlplane import settings as control_settings
from controlplane.cli import _parser, _rows_proxies, _rows_replicas
from dataplane import settings as proxy_settings
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from ponto.version import build_commit, software_version

COMMIT = "3f2a9c1d04b7e8a1c2d3e4f5a6b7c8d9e0f1a2b3"


def test_the_image_builds_file_names_the_commit(tmp_path: Path) -> None:
    written = tmp_path / "_build.txt"
    written.write_text(COMMIT.upper() + "\n")
    assert build_commit(written, tmp_path) == COMMIT


@pytest.mark.parametrize("text", ["", "not a commit", "12345", "g" * 40])
def test_a_build_file_without_a_commit_is_not_believed(tmp_path: Path, text: str) -> None:
    written = tmp_path / "_build.txt"
    written.write_text(text)
    assert build_commit(written, tmp_path) == ""  # and tmp_path is no checkout


def test_a_checkout_names_its_head(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "x")
    assert build_commit(tmp_path / "absent.txt", tmp_path) == git("rev-parse", "HEAD")


def test_this_processes_version_is_the_package_and_the_checkouts_commit() -> None:
    base, _, commit = software_version().partition("+")
    head = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert base
    # From a git checkout (CI's clone), its commit; else (an sdist, a git that
    # does not trust the tree) the version alone.
    assert commit == (head.stdout.strip()[:12] if head.returncode == 0 else "")


def test_get_proxies_and_get_controlplanes_show_each_version() -> None:
    proxies = apb.ListProxiesResponse(
        proxies=[
            apb.ProxyStatus(info=pb.ProxyInfo(name="p1", version="0.1.0+3f2a9c1d04b7")),
            apb.ProxyStatus(info=pb.ProxyInfo(name="p2")),  # older than the field's use
        ]
    )
    header, rows = _rows_proxies(proxies)
    column = header.index("VERSION")
    assert [r[column] for r in rows] == ["0.1.0+3f2a9c1d04b7", "?"]
    replicas = apb.ListControlPlanesResponse(
        replicas=[
            apb.ControlPlaneInfo(id="cp-1", version="0.1.0+3f2a9c1d04b7"),
            apb.ControlPlaneInfo(id="cp-2"),
        ]
    )
    header, rows = _rows_replicas(replicas)
    column = header.index("VERSION")
    assert [r[column] for r in rows] == ["0.1.0+3f2a9c1d04b7", "?"]


def _pontoctl(argv: list[str]) -> object:
    return _parser().parse_args(argv)


def _control(argv: list[str]) -> object:
    return control_settings.parser().parse_args(argv)


@pytest.mark.parametrize(
    ("name", "parse"),
    [("pontoctl", _pontoctl), ("ponto-control", _control), ("ponto-proxy", proxy_settings.parse)],
)
def test_each_command_says_its_build(
    name: str, parse: Callable[[list[str]], object], capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial 70: the upgrade docs ask for a pontoctl of the control plane's
    build, and `--version` was an error."""
    with pytest.raises(SystemExit) as done:
        parse(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"{name} {software_version()}\n"


def test_a_command_without_version_does_not_read_the_build() -> None:
    """The build is read (a `git rev-parse` in a checkout) only when asked:
    not for every pontoctl command."""
    software_version.cache_clear()
    _pontoctl(["get", "proxies"])
    _control([])
    assert software_version.cache_info().currsize == 0
