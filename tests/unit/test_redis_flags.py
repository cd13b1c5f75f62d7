"""The regional cache's flags: --redis-password-file (the password out of
`ps`), and the defaults every cache flag's --help states."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from dataplane.cache.regional import RegionLink
from dataplane.cache.regionurl import RegionURLError, _readers, check_url, redact, url_password
from dataplane.metrics import Metrics
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


def test_a_password_option_in_the_url_and_a_file_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """redis-py reads `?password=` too, and it would override the file's."""
    secret = tmp_path / "pw"
    secret.write_text("pw")
    argv = ["--region", "r", "--redis", "redis://h:6379/0?password=urlpw"]
    line = error_of(capsys, [*argv, f"--redis-password-file={secret}"])
    assert "give one of them" in line and "urlpw" not in line


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        (
            "rediss://u:s3cret@h:6379/0?socket_timeout=1&Password=s3cret",
            "rediss://***@h:6379/0?socket_timeout=1&Password=***",
        ),
        ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_a_url_s_password_is_never_shown(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert url_password(url) == ("s3cret" if "s3cret" in url else None)


def test_a_bad_url_s_error_does_not_show_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(capsys, ["--region", "r", "--redis", "http://h:1/0?password=s3cret"])
    assert "s3cret" not in line and "password=***" in line


async def test_the_link_logs_its_url_without_the_password_option(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ponto.devenv import free_port  # noqa: PLC0415

    link = RegionLink(
        f"redis://127.0.0.1:{free_port()}/0?password=s3cret", Metrics(), watch_tick_s=None
    )
    await link.start()
    await link.close()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "unreachable at start" in warning
    assert "s3cret" not in warning and "password=***" in warning


def test_a_byte_order_mark_is_not_part_of_the_password(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_bytes("\ufeffs3cret\r\n".encode())
    secret.chmod(0o600)
    assert parse([*BASE, f"--redis-password-file={secret}"]).redis_password == "s3cret"


@pytest.mark.parametrize(
    ("mode", "who"), [(0o640, "group"), (0o604, "others"), (0o644, "group and others")]
)
def test_a_file_others_may_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, who: str
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(mode)
    assert parse([*BASE, f"--redis-password-file={secret}"]).redis_password == "s3cret"
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"may be read by {who} (mode {mode:o}): chmod 600 it" in warning
    assert "s3cret" not in warning


def test_a_file_only_its_owner_reads_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    parse([*BASE, f"--redis-password-file={secret}"])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_file_another_user_owns_may_be_read_by_its_group() -> None:
    """A Kubernetes Secret mounted 0440 for the pod's fsGroup (the chart's):
    the group is how the proxy reads it, not a leak."""
    assert _readers(0o100440, owned=False) == ""
    assert _readers(0o100444, owned=False) == "others"
    assert _readers(0o100440, owned=True) == "group"


# Passwords that were not percent-encoded: base64 holds `/`, and a `?` or `#`
# cut the URL before its `@` (review finding 1: the parser's text quoted
# "Zm9vYmFy", and redact showed the rest of "s3cr?et" whole).
UNENCODED = [
    ("redis://:Zm9vYmFy/YmF6cXV4@redis:6379/0", ("Zm9vYmFy", "YmF6cXV4")),
    ("redis://:s3cr?et@redis:6379/0", ("s3cr", "et@")),
    ("redis://:ab#cd@redis:6379/0", ("ab#", "cd@")),
]


@pytest.mark.parametrize(("url", "parts"), UNENCODED)
def test_a_password_that_was_not_percent_encoded_is_never_shown(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    url: str,
    parts: tuple[str, ...],
) -> None:
    with pytest.raises(RegionURLError) as raised:
        check_url(url)
    line = error_of(capsys, ["--region", "r", "--redis", url])
    for shown in (str(raised.value), line, redact(url), *(r.getMessage() for r in caplog.records)):
        assert not any(part in shown for part in parts), shown
    assert "'redis://…'" in line and "percent-encoded" in line
    assert "--redis-password-file" in line


def test_a_percent_encoded_password_is_taken_and_redacted() -> None:
    url = "redis://:Zm9vYmFy%2FYmF6cXV4@redis:6379/0"
    assert check_url(url) == url
    assert redact(url) == "redis://***@redis:6379/0"
    assert url_password(url) == "Zm9vYmFy%2FYmF6cXV4"  # redis-py unquotes it


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("?socket_timout=1", "unknown query option socket_timout"),
        ("?Password=s3cret", "unknown query option Password"),
        ("?db=abc", "Invalid value for 'db'"),
    ],
)
def test_a_query_option_redis_py_does_not_take_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], query: str, named: str
) -> None:
    """redis-py raises them at every connect (a TypeError), which the link
    took for an outage (review finding 4): refused at start, named."""
    line = error_of(capsys, ["--region", "r", "--redis", f"redis://h:6379/0{query}"])
    assert named in line and "s3cret" not in line


def test_redis_py_s_own_options_are_taken() -> None:
    for url in (
        "redis://h:6379/0?client_name=p&protocol=3",
        "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=false",
        "unix:///run/redis.sock?db=1&password=s3cret",
        "redis://h/0/",  # redis-py reads it as /0
    ):
        assert check_url(url) == url


@pytest.mark.parametrize(
    "option",
    ["decode_responses=true", "max_connections=2", "health_check_interval=5", "socket_timeout=1"],
)
def test_an_option_the_proxy_sets_itself_is_refused(option: str) -> None:
    """Review of 7042a7c: redis-py lets the URL's options win over the
    proxy's own (its deadlines, its pool), and decode_responses would have
    the cache's bytes read as str."""
    with pytest.raises(RegionURLError, match="set by the proxy itself"):
        check_url(f"redis://h:6379/0?{option}")


def test_what_follows_a_password_option_is_never_shown() -> None:
    """Review of 7042a7c: a password holding an `&` that was not
    percent-encoded (?password=Abc&Xyz9) was named in part in the start
    error ("unknown query option Xyz9") and in redact (password=***&Xyz9=)."""
    url = "redis://h:6379/0?client_name=p&password=Abc&Xyz9"
    with pytest.raises(RegionURLError) as refused:
        check_url(url)
    assert "Xyz9" not in str(refused.value) and "%26" in str(refused.value)
    assert redact(url) == "redis://h:6379/0?client_name=p&password=***&…"


async def test_an_option_redis_py_cannot_connect_with_is_an_error_not_an_outage(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past check_url (here bypassed), the link names the option in its
    setup mistake's ERROR instead of calling Redis unreachable."""
    from dataplane.cache import regional  # noqa: PLC0415
    from ponto.devenv import free_port  # noqa: PLC0415

    monkeypatch.setattr(regional, "check_url", lambda url: url)
    link = RegionLink(
        f"redis://127.0.0.1:{free_port()}/0?socket_timout=1", Metrics(), watch_tick_s=None
    )
    await link.start()
    await link.close()
    assert not link.available
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "misconfigured" in error and "socket_timout" in error
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
