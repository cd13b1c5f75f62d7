"""`ponto-control --help` gives every flag's default (a user trial: none for
--probe-interval-ms, --probe-timeout-ms, --rise or --fall), as ponto-proxy's
help does."""

from __future__ import annotations

import pytest

from controlplane import settings

# Defaults said in words, not by value: the value differs from host to host.
SAID_IN_WORDS = {"--id": "default: this host's name and the process id"}


def test_every_flag_with_a_default_says_it() -> None:
    """Each flag's help, as --help prints it, names its default's value (the
    word "default" alone had passed a help that named none, or another)."""
    p = settings.parser()
    formatter = p._get_formatter()
    wrong = {}
    for action in p._actions:
        if not action.option_strings or action.default in (None, "", False, "==SUPPRESS=="):
            continue
        flag = action.option_strings[0]
        said = formatter._expand_help(action)
        if SAID_IN_WORDS.get(flag, f"default: {action.default})") not in said:
            wrong[flag] = said
    assert wrong == {}


def test_the_probe_flags_show_their_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings.parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in (
        "origin probe period in ms (default: 1000)",
        "origin probe timeout in ms (default: 1000)",
        "successes before an origin is healthy (default: 2)",
        "failures before an origin is unhealthy (default: 2)",
        "(default: INFO)",
    ):
        assert said in text
