"""Every pontoctl command's arguments say what they are in --help."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from controlplane.cli import _parser, run
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


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


def test_origin_weight_help_refusal_and_request_agree() -> None:
    """Trial: help said 1..1000, the refusal of 5000 said 0..1000, and `--weight
    0` was saved as 100 (0 is the Admin API's "not given"; proxies refuse an
    origin of weight 0, and a drain is how an origin gets no new requests)."""
    [weight] = [
        a for c, a in arguments(_parser()) if c == "pontoctl origin add" and a.dest == "weight"
    ]
    assert weight.help is not None and "1..1000" in weight.help and "drain" in weight.help
    assert callable(weight.type)
    for bad in ("0", "1001"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{bad} is not in 1..1000"):
            weight.type(bad)
    sent: list[apb.PutOriginRequest] = []

    class Stub:
        def PutOrigin(self, req: apb.PutOriginRequest) -> pb.Origin:
            sent.append(req)
            return pb.Origin(name=req.origin.name, weight=req.origin.weight or 100)

    origin = ["origin", "add", "o", "--url", "http://h/v1", "--region", "r", "--models", "m"]
    assert run(_parser().parse_args([*origin, "--weight", "1"]), Stub()).endswith("weight 1)")
    run(_parser().parse_args(origin), Stub())
    assert [r.origin.weight for r in sent] == [1, 0]  # not given: the control plane's default
