"""`python -m ponto.pki`: help, and no silent replacement of a CA or tokens in use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ponto.pki import bundle_files, main


def test_help_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as done:
            main([flag])
        assert done.value.code == 0
        assert "--force" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_writes_every_file_into_a_new_directory(tmp_path: Path) -> None:
    assert main([str(tmp_path / "pki")]) == 0
    assert sorted(os.listdir(tmp_path / "pki")) == sorted(bundle_files())


def test_refuses_to_replace_an_existing_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "pki"
    assert main([str(directory)]) == 0
    before = {name: (directory / name).read_bytes() for name in bundle_files()}
    capsys.readouterr()
    assert main([str(directory)]) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert {name: (directory / name).read_bytes() for name in bundle_files()} == before


def test_refuses_when_only_one_file_is_there(tmp_path: Path) -> None:
    (tmp_path / "bootstrap.token").write_text("in use\n")
    assert main([str(tmp_path)]) == 2
    assert (tmp_path / "bootstrap.token").read_text() == "in use\n"
    assert not (tmp_path / "ca.crt").exists()


def test_force_replaces_them(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    old_ca = (tmp_path / "ca.crt").read_bytes()
    assert main(["--force", str(tmp_path)]) == 0
    assert (tmp_path / "ca.crt").read_bytes() != old_ca


def test_an_existing_directory_with_other_files_is_fine(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
