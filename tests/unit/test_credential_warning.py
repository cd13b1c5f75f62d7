"""A proxy that cannot have an origin's credential says so in its ACKs and
reports, which `pontoctl get proxies`, every Admin write's warnings and the
status page show (trial 52: `origin add --credential-env` of a variable the
proxies lack left the origin healthy and every request failing over, with a
WARNING per request in the proxy's log as the only trace)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.routes import build_routes
from dataplane.sync.holder import TableHolder
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_jwt_unavailable import link_of, loading_table

VARIABLE = "PONTO_TEST_ORIGIN_KEY"


def with_credential(t: pb.RouteTable, **credential: str) -> pb.RouteTable:
    t.origins[0].MergeFrom(pb.Origin(**credential))  # type: ignore[arg-type]
    t.etag = content_etag(t)
    return t


def test_a_missing_credential_is_warned_of_until_it_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    t = with_credential(loading_table(tmp_path), credential_env=VARIABLE)
    link = link_of(TableHolder("eu-west", None))
    ack = link._handle("s-1", pb.RouteUpdate(table=t, nonce="n3"))
    assert list(ack.warnings) == [
        f"origin 'o-eu': credential variable '{VARIABLE}' is not set: its requests go to "
        "other origins, and get a 502 when none is left; set it where this proxy runs "
        "(the value never leaves it)"
    ]
    # Set later (a Secret mounted, the proxy's environment fixed): the next
    # report says there is nothing left to warn of.
    monkeypatch.setenv(VARIABLE, "sk-test")
    report = link.report("s-1")
    assert report.warnings_current and list(report.warnings) == []


def test_an_unreadable_credential_file_is_warned_of(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-key"
    t = with_credential(loading_table(tmp_path), credential_file=str(missing))
    (problem,) = build_routes(t, "eu-west").credential_problems()
    assert problem.startswith(f"origin 'o-eu': cannot read credential file '{missing}'")


def test_origins_no_request_may_reach_are_not_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drained origin's credential is not asked for: none of its requests
    would need it until it is undrained (and its ACK says so then)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    t = with_credential(loading_table(tmp_path), credential_env=VARIABLE)
    t.origins[0].drained = True
    t.etag = content_etag(t)
    assert build_routes(t, "eu-west").credential_problems() == []


def test_origins_lacking_one_credential_are_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 199: twenty origins naming one unset variable made twenty
    warnings, and the control plane keeps sixteen of a proxy's."""
    monkeypatch.delenv(VARIABLE, raising=False)
    t = loading_table(tmp_path)
    template = pb.Origin()
    template.CopyFrom(t.origins[0])
    del t.origins[:]
    for i in range(7):
        o = t.origins.add()
        o.CopyFrom(template)
        o.name, o.credential_env = f"o{i}", VARIABLE
    t.etag = content_etag(t)
    (problem,) = build_routes(t, "eu-west").credential_problems()
    assert problem.startswith(
        f"origins 'o0', 'o1', 'o2', 'o3', 'o4' and 2 more: credential variable '{VARIABLE}' "
        "is not set: their requests go to other origins"
    )
