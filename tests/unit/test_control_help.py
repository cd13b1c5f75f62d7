"""`ponto-control --help` gives every flag's default (a user trial: none for
--probe-interval-ms, --probe-timeout-ms, --rise or --fall), as ponto-proxy's
help does."""

from __future__ import annotations

import pytest

from controlplane import settings


def test_every_flag_with_a_default_says_it() -> None:
    p = settings.parser()
    silent = [
        action.option_strings[0]
        for action in p._actions
        if action.option_strings
        and action.default not in (None, "", False, "==SUPPRESS==")
        and "default" not in (action.help or "")
    ]
    assert silent == []


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
