"""`ponto-control --help` gives every flag's default (a user trial: none for
--probe-interval-ms, --probe-timeout-ms, --rise or --fall), as ponto-proxy's
help does."""

from __future__ import annotations

import argparse

import pytest

from controlplane import settings
from controlplane.store.etcd import CALL_TIMEOUT_S

# Defaults said in words, not by value: the value differs from host to host.
SAID_IN_WORDS = {"--id": "default: this host's name and the process id"}


def test_every_flag_with_a_default_says_it() -> None:
    """Each flag's help, as --help prints it, names its default's value (the
    word "default" alone had passed a help that named none, or another).
    Hidden flags (tests' settings) have no help to name it in."""
    p = settings.parser()
    formatter = p._get_formatter()
    wrong = {}
    for action in p._actions:
        if not action.option_strings or action.default in (None, "", False, "==SUPPRESS=="):
            continue
        if action.help == argparse.SUPPRESS:
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


def test_the_etcd_call_timeout_is_three_seconds_unless_a_test_sets_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Hidden: e2e tests shorten it so as not to wait 3 s for each call to an
    # etcd that is away.
    assert settings.parse([]).etcd_timeout == CALL_TIMEOUT_S == 3.0
    assert settings.parse(["--etcd-timeout-ms", "1000"]).etcd_timeout == 1.0
    with pytest.raises(SystemExit):
        settings.parse(["--help"])
    shown = capsys.readouterr().out
    assert "--traffic-interval-ms" in shown and "--etcd-timeout-ms" not in shown
    with pytest.raises(SystemExit) as exit_:
        settings.parse(["--etcd-timeout-ms", "50"])
    assert exit_.value.code == 2
    assert "--etcd-timeout-ms must be at least 100" in capsys.readouterr().err
