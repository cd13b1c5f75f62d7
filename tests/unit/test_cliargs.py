"""Every number a command line takes is finite: a NaN passed every range check
made of it (all its comparisons are false) and failed requests later."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from controlplane import settings as control_settings
from dataplane import settings as proxy_settings
from ponto.cliargs import finite_float, hostport, listen_address, path


@pytest.mark.parametrize(("text", "value"), [("1.5", 1.5), ("-2", -2.0), ("1e3", 1000.0)])
def test_a_finite_number_is_read_as_float_reads_it(text: str, value: float) -> None:
    assert finite_float(text) == value


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400"])
def test_nan_and_the_infinities_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number"):
        finite_float(text)


def test_what_is_no_number_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid number: 'x'"):
        finite_float("x")


def _parser(parse: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The argument parser that `parse` builds."""
    built: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(self)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            parse([])
    [parser] = built
    return parser


def _number_flags(parse: Callable[[list[str]], object]) -> list[str]:
    """The flags of the parser `parse` builds that take a number with a
    fraction; fails if one takes Python's plain float."""
    parser = _parser(parse)
    assert not [a.option_strings for a in parser._actions if a.type is float]
    return [a.option_strings[0] for a in parser._actions if a.type is finite_float]


@pytest.mark.parametrize("parse", [proxy_settings.parse, control_settings.parse])
def test_no_path_flag_takes_an_empty_path(parse: Callable[[list[str]], object]) -> None:
    """Path("") is the current directory: `--state-dir "$UNSET"` wrote the
    proxy's files there (trial 14)."""
    actions = _parser(parse)._actions
    assert not [a.option_strings for a in actions if a.type is Path]
    assert [a for a in actions if a.type is path]
    with pytest.raises(argparse.ArgumentTypeError, match="must not be empty"):
        path("")
    assert path("state") == Path("state")


PROXY_FLAGS = _number_flags(proxy_settings.parse)
CONTROL_FLAGS = _number_flags(control_settings.parse)


def test_the_proxys_timeouts_and_rates_are_among_them() -> None:
    wanted = {"--header-timeout", "--deadline", "--cache-ttl", "--drain-seconds"}
    assert wanted | {"--worker-hang-timeout"} <= set(PROXY_FLAGS)
    assert len(PROXY_FLAGS) == 18  # --stream-hold-seconds the last added


@pytest.mark.parametrize("flag", PROXY_FLAGS)
@pytest.mark.parametrize("text", ["nan", "inf"])
def test_every_number_flag_of_the_proxy_refuses_nan_and_inf_at_start(
    flag: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        proxy_settings.parse(["--region=r", f"{flag}={text}"])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == f"ponto-proxy: error: argument {flag}: must be a finite number, not '{text}'"


@pytest.mark.parametrize("flag", CONTROL_FLAGS)
def test_every_number_flag_of_the_control_plane_refuses_nan(flag: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        control_settings.parse([f"{flag}=nan"])
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("localhost:0", ("localhost", 0)),
        (":8080", ("0.0.0.0", 8080)),
        ("[::1]:65535", ("::1", 65535)),
        ("[::]:7070", ("::", 7070)),
    ],
)
def test_a_listen_address_is_host_and_port(text: str, address: tuple[str, int]) -> None:
    assert listen_address(text) == address
    assert listen_address(hostport(*address)) == address


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:+80",
     "127.0.0.1: 80", "127.0.0.1:\u00b2", "127.0.0.1:\u0668\u0660", "::1:80", "", ":",
     "[]:80", "[[::1]]:80", "[127.0.0.1:80", "a]:80"],
)  # fmt: skip
def test_what_is_no_listen_address_is_refused(text: str) -> None:
    """ "\u00b2" and "\u0668\u0660" pass str.isdigit(); int() failed on the one
    (a traceback from ponto-proxy --listen) and read the other as 80."""
    with pytest.raises(
        argparse.ArgumentTypeError, match=f"^expected .*, got {re.escape(repr(text))}$"
    ):
        listen_address(text)


def test_ponto_proxy_says_which_listen_flag_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--listen", "--metrics-listen"):
        with pytest.raises(SystemExit) as exit_:
            proxy_settings.parse(["--region=r", flag, "127.0.0.1:\u00b2"])
        assert exit_.value.code == 2
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert said == (
            f"ponto-proxy: error: {flag}: expected HOST:PORT with a port 0-65535, "
            "got '127.0.0.1:\u00b2'"
        )


def _listen_flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {
        a.option_strings[0]: a.type
        for a in parser._actions
        if a.option_strings[0].endswith("listen")
    }


def test_every_listen_flag_is_read_by_the_one_parser() -> None:
    """Six parsers of HOST:PORT had six rules (the control plane's let 70000 through)."""
    from ponto.originsim.__main__ import _parser as origin_parser  # noqa: PLC0415

    assert _listen_flags(_parser(control_settings.parse)) == {
        "--listen": listen_address,
        "--health-listen": listen_address,
        "--http-listen": listen_address,
    }
    assert _listen_flags(origin_parser()) == {"--listen": listen_address}


@pytest.mark.parametrize(
    ("parse", "argv", "says"),
    [
        (proxy_settings.parse, ["--region", "r", "--bogus"], "unrecognized arguments: --bogus"),
        (proxy_settings.parse, ["--region", "r", "--forward-headers", "connection"], "connection"),
        (
            proxy_settings.parse,
            ["--region", "r", "--listen", "x"],
            "--listen: expected HOST:PORT",
        ),
        (control_settings.parse, ["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_server_refused_at_start_says_why_in_one_line(
    parse: Callable[[list[str]], object],
    argv: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bad flag stops ponto-proxy and ponto-control with one line, not
    argparse's usage block (34 lines for the proxy) above the reason."""
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    assert stop.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(("ponto-proxy: error: ", "ponto-control: error: ")), line
    assert says in line, line
