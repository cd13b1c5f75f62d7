"""`make test` runs pytest as two halves side by side (tests/conftest.py's
--part, the Makefile's pytest-parts): no test may run in both or in neither,
and the halves' exit codes decide as one run's would, but that a half which
selects nothing (exit code 5) fails nothing unless the other did too.

The split runs the real pytest on a few of this suite's files; the exit codes
run the real make on the real Makefile with a fake pytest that answers as told.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

from ponto import devenv
from tests import conftest
from tests.helm.test_chart import ROOT

MAKE = shutil.which("make")
E2E_FILE = "tests/e2e/test_fleet_identity.py"
UNIT_FILE = "tests/unit/test_version.py"


def collected(*args: str) -> set[str]:
    """The node ids `pytest --collect-only` selects with ARGS."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "-o",
            "addopts=",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return {line for line in done.stdout.splitlines() if "::" in line}


class Options:
    def __init__(self, part: str | None) -> None:
        self.part = part

    def getoption(self, name: str) -> str | None:
        assert name == "part"
        return self.part


def ignored(path: Path, part: str | None) -> bool:
    return conftest.pytest_ignore_collect(path, cast(pytest.Config, Options(part))) is True


TESTS = ROOT / "tests"


@pytest.mark.parametrize(
    "path",
    [
        ROOT,
        ROOT / "bench",
        TESTS,
        TESTS / "conftest.py",
        TESTS / "e2e",
        TESTS / "e2e" / "test_x.py",
        TESTS / "e2e" / "deeper" / "test_y.py",
        TESTS / "e2ealike.py",  # not in tests/e2e, whatever its name
        TESTS / "unit",
        TESTS / "unit" / "test_z.py",
        TESTS / "integration" / "test_w.py",
    ],
)
def test_each_path_is_walked_by_the_halves_that_need_it(path: Path) -> None:
    in_e2e = path == TESTS / "e2e" or TESTS / "e2e" in path.parents
    leads_to_e2e = path in (TESTS / "e2e").parents
    assert not ignored(path, None)
    assert ignored(path, "e2e") == (not in_e2e and not leads_to_e2e)
    assert ignored(path, "rest") == in_e2e
    # A test file is in exactly one half.
    if path.suffix == ".py" and path.name != "conftest.py":
        assert ignored(path, "e2e") != ignored(path, "rest")


class Item:
    def __init__(self, path: Path) -> None:
        self.path = path


class Hook:
    def __init__(self) -> None:
        self.deselected: list[Item] = []

    def pytest_deselected(self, *, items: list[Item]) -> None:
        self.deselected += items


@pytest.mark.parametrize("part", ["e2e", "rest"])
def test_named_tests_of_the_other_half_are_deselected(part: str) -> None:
    named = [
        Item(TESTS / "e2e" / "test_a.py"),
        Item(TESTS / "unit" / "test_b.py"),
        Item(TESTS / "e2e" / "test_a.py"),
        Item(TESTS / "e2ealike.py"),
    ]
    options = Options(part)
    options.hook = Hook()  # type: ignore[attr-defined]
    items = list(named)
    conftest.pytest_collection_modifyitems(
        cast(pytest.Config, options), cast(list[pytest.Item], items)
    )
    ours = [named[0], named[2]] if part == "e2e" else [named[1], named[3]]
    assert items == ours
    assert options.hook.deselected == [i for i in named if i not in ours]  # type: ignore[attr-defined]


def test_pytest_runs_the_hooks() -> None:
    """The real pytest, given a file of each half, keeps only the e2e one's."""
    e2e = collected("--part=e2e", UNIT_FILE, E2E_FILE)
    assert e2e and all(t.startswith(E2E_FILE + "::") for t in e2e)


FAKE_PYTEST = """#!/bin/sh
# Answers as told: $E2E_RC for --part=e2e, $REST_RC for --part=rest.
case " $* " in
  *" --part=e2e "*) part=e2e; rc=$E2E_RC ;;
  *" --part=rest "*) part=rest; rc=$REST_RC ;;
  *) echo "no part given: $*"; exit 3 ;;
esac
echo "$part half ran: $*"
# Whether Ctrl-C reaches it: SIGINT's bit (2) in the mask of signals ignored.
case $(grep '^SigIgn:' /proc/$$/status) in
  *[2367abef]) echo "$part half's SIGINT: ignored" ;;
  *) echo "$part half's SIGINT: taken" ;;
esac
exit "$rc"
"""


@pytest.mark.skipif(MAKE is None, reason="no make")
@pytest.mark.parametrize(
    ("e2e_rc", "rest_rc", "passes"),
    [
        (0, 0, True),
        (5, 0, True),  # PYTEST_ARGS named tests of the rest only
        (0, 5, True),
        (5, 5, False),  # nothing ran: CI must fail
        (1, 0, False),
        (0, 1, False),
        (2, 5, False),
    ],
)
def test_the_halves_exit_codes_decide_as_one_run(
    tmp_path: Path, e2e_rc: int, rest_rc: int, passes: bool
) -> None:
    returncode, said = make_parts(tmp_path, e2e_rc, rest_rc)
    assert (returncode == 0) == passes, said
    # Both halves ran with the arguments given; the e2e half's output is printed after.
    assert "rest half ran: --ignore=tests/helm --part=rest -k x" in said
    tail = said.split(f"--- tests/e2e, run beside the rest (exit code {e2e_rc})")[1]
    assert "e2e half ran: --ignore=tests/helm --part=e2e -k x" in tail


@pytest.mark.skipif(MAKE is None, reason="no make")
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc")
def test_ctrl_c_reaches_the_half_in_the_background(tmp_path: Path) -> None:
    """A shell starts its background jobs with SIGINT ignored: Ctrl-C, sent to
    make's process group, would stop the rest only, and make would wait on the
    e2e half for minutes. It takes SIGINT as the half in the foreground does
    (both ignore it only where this test's make was started ignoring it)."""
    returncode, said = make_parts(tmp_path, 0, 0)
    assert returncode == 0, said
    rest = re.findall(r"rest half's SIGINT: (\w+)", said)
    assert rest and re.findall(r"e2e half's SIGINT: (\w+)", said) == rest, said


def make_parts(tmp_path: Path, e2e_rc: int, rest_rc: int) -> tuple[int, str]:
    """The real make's pytest-parts with FAKE_PYTEST: its exit code and output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "pytest"
    fake.write_text(FAKE_PYTEST)
    fake.chmod(0o755)
    out = tmp_path / "e2e.out"
    assert MAKE is not None
    done = subprocess.run(
        [
            MAKE,
            "--no-print-directory",
            "pytest-parts",
            f"BIN={bin_dir}",
            f"E2E_OUT={out}",
            "PYTEST_ARGS=-k x",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "E2E_RC": str(e2e_rc), "REST_RC": str(rest_rc)},
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("part", ["e2e", "rest"])
def test_each_half_takes_its_own_share_of_ports(monkeypatch: pytest.MonkeyPatch, part: str) -> None:
    # Set, so that monkeypatch restores it after pytest_configure's change
    # (an empty value narrows nothing).
    monkeypatch.setenv(devenv.FREE_PORTS_ENV, "")
    low, high = devenv.port_range()
    conftest.pytest_configure(cast(pytest.Config, Options(part)))
    first, last = conftest.part_share(part, low, high)
    assert os.environ[devenv.FREE_PORTS_ENV] == f"{first}-{last}"
    assert devenv.port_range() == (first, last + 1)


def test_without_a_part_the_ports_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devenv.FREE_PORTS_ENV, "")
    conftest.pytest_configure(cast(pytest.Config, Options(None)))
    assert os.environ[devenv.FREE_PORTS_ENV] == ""


def test_the_last_failed_list_keeps_what_the_other_half_saved() -> None:
    """Run side by side, each half writes pytest's whole last-failed list as
    it ends: the other half's entries are taken from what is saved now."""
    current = {
        "tests/e2e/test_a.py::t": True,  # ours, still failing
        "tests/unit/test_b.py::old": True,  # the other half's, when we started
    }
    saved = {
        "tests/e2e/test_a.py::gone": True,  # ours as it was: ours decides
        "tests/unit/test_b.py::new": True,  # the other half failed it meanwhile
    }
    conftest.take_others_as_saved(current, saved, lambda n: n.startswith("tests/e2e/"))
    assert current == {"tests/e2e/test_a.py::t": True, "tests/unit/test_b.py::new": True}
