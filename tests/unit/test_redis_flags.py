"""The regional cache's flags: --redis-password-file (the password out of
`ps`), and the defaults every cache flag's --help states."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from dataplane.settings import parse

BASE = ["--region", "r", "--redis", "redis://10.0.0.7:6379/0"]


def error_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if "error" in line]
    return line


def test_the_password_file_is_read_at_start_less_its_line_break(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret with space #1\n")
    settings = parse([*BASE, f"--redis-password-file={secret}"])
    assert settings.redis_password == "s3cret with space #1"
    assert "s3cret" not in repr(settings)
    secret.write_text("crlf\r\n")
    assert parse([*BASE, f"--redis-password-file={secret}"]).redis_password == "crlf"
    assert parse(BASE).redis_password == ""


def test_a_user_in_the_url_goes_with_the_files_password(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw")
    argv = ["--region", "r", "--redis", "redis://proxy@h:6379/0", f"--redis-password-file={secret}"]
    assert parse(argv).redis_password == "pw"


def test_an_unreadable_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = error_of(capsys, [*BASE, f"--redis-password-file={tmp_path / 'nope'}"])
    assert "--redis-password-file" in line and "cannot read it" in line


@pytest.mark.parametrize("content", ["", "\n", "\r\n\n"])
def test_an_empty_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str
) -> None:
    secret = tmp_path / "pw"
    secret.write_text(content)
    assert "is empty" in error_of(capsys, [*BASE, f"--redis-password-file={secret}"])


def test_a_file_of_several_lines_is_refused_without_its_content(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("one\ntwo\n")
    line = error_of(capsys, [*BASE, f"--redis-password-file={secret}"])
    assert "more than one line" in line and "one\n" not in line and "two" not in line


def test_a_password_in_the_url_and_a_file_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw")
    url = "redis://:urlpw@h:6379/0"
    argv = ["--region", "r", "--redis", url, f"--redis-password-file={secret}"]
    line = error_of(capsys, argv)
    assert "give one of them" in line and "urlpw" not in line


def test_a_password_file_needs_redis(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw")
    assert "needs --redis" in error_of(capsys, ["--region", "r", f"--redis-password-file={secret}"])


@pytest.mark.parametrize(
    ("flag", "default"),
    [
        ("--cache-ttl", "default: 3600"),
        ("--semantic-threshold", "default: 0.9"),
        ("--cache-max-mb", "Default: 256"),
        ("--cache-max-entry-kb", "Default: 1024"),
        ("--redis", "Default: none"),
        ("--redis-deadline-ms", "default 50"),
        ("--redis-password-file", "Default: none"),
    ],
)
def test_every_cache_flag_says_its_default(flag: str, default: str) -> None:
    parser = _parser(parse)
    [action] = [a for a in parser._actions if flag in a.option_strings]
    text = " ".join(parser._get_formatter()._expand_help(action).split())
    assert default in text, text


def _parser(build: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The argument parser that `build` makes (as tests/unit/test_cliargs.py)."""
    built: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(self)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            build([])
    [parser] = built
    return parser
