"""Every pontoctl command's arguments say what they are in --help."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from controlplane.cli import _parser


def arguments(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pontoctl",)
) -> Iterator[tuple[str, argparse.Action]]:
    """(command, argument) of every command under parser, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from arguments(sub, (*path, name))
        elif action.dest != "help":
            yield " ".join(path), action


def test_every_argument_has_a_help_text() -> None:
    missing = [
        f"{command} {'/'.join(action.option_strings) or action.dest}"
        for command, action in arguments(_parser())
        if not action.help
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cache", "purge"], "without --tenant, of every tenant"),
        (["drain"], "warns of models left with no origin"),
        (["undrain"], "gets new requests again"),
    ],
)
def test_purge_and_drain_explain_their_scope(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as done:
        _parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    assert says in " ".join(capsys.readouterr().out.split())
