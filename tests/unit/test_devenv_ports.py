"""free_port: ports that no outgoing connection takes while nothing listens."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ponto import devenv
from ponto import fleet as fleet_module
from ponto.devenv import _ephemeral_low, free_port
from ponto.fleet import Fleet, _own_port
from tests.conftest import part_share


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_listened_on() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports)
    assert len(ports) > 1, "ports are drawn at random, not one fixed port"
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_someone_listens_on_is_not_given() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(200))


def test_a_reserved_port_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo reserves its --port-base block while etcd and Redis pick theirs."""
    monkeypatch.setattr(devenv, "_reserved", set())
    low = _ephemeral_low()
    kept = set(range(20000, low - 2000))  # all but the range's last 2,000
    devenv.reserve_ports([*kept, 0])
    picks = {free_port() for _ in range(50)}
    assert not picks & kept
    assert 0 not in devenv._reserved


def test_a_port_given_is_not_given_again_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two picks before either is listened on (etcd's client and peer ports)
    must differ: 500 random ones of some 12,000 would meet at least once
    almost surely."""
    monkeypatch.setattr(devenv, "_given", {})
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert len(devenv._given) == 500


def test_the_ports_given_are_kept_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devenv, "_given", {})
    monkeypatch.setattr(devenv, "_GIVEN_KEPT", 3)
    ports = [free_port() for _ in range(5)]
    assert list(devenv._given) == ports[-3:]


@pytest.mark.parametrize(
    ("listen", "kept"),
    [("127.0.0.1:8080", True), ("[::1]:0", True), ("127.0.0.1:0", False), ("127.0.0.2:0", False)],
)
def test_a_fleet_member_on_port_0_gets_a_port_below_the_ephemeral_range(
    listen: str, kept: bool
) -> None:
    """Restarted on its address, it finds it free (review 276)."""
    got = _own_port(listen)
    if kept:
        assert got == listen
    else:
        host, _, port = got.rpartition(":")
        assert host == listen.rpartition(":")[0] and 20000 <= int(port) < _ephemeral_low()


@pytest.mark.parametrize(
    ("given", "share"),
    [
        ("21000-21009", (21000, 21010)),
        ("10000-20005", (20000, 20006)),  # clamped to the range
        ("31000-99999", (31000, None)),  # up to the ephemeral range
        ("", None),
    ],
)
def test_a_process_trees_share_narrows_the_range(
    monkeypatch: pytest.MonkeyPatch, given: str, share: tuple[int, int | None] | None
) -> None:
    """`make test`'s two halves each pick from their own share (tests/conftest.py)."""
    monkeypatch.setenv(devenv.FREE_PORTS_ENV, given)
    low = _ephemeral_low()
    expected = (20000, low) if share is None else (share[0], share[1] or low)
    assert devenv.port_range() == expected
    monkeypatch.setattr(devenv, "_given", {})
    picks = {free_port() for _ in range(min(20, expected[1] - expected[0]))}
    assert all(expected[0] <= p < expected[1] for p in picks)


@pytest.mark.parametrize("given", ["25000-24000", "5000-6000", "42000-42999", "21000", "a-b"])
def test_a_share_that_holds_no_port_of_the_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Empty, disjoint (42000-42999 is past the ephemeral start) or not
    FIRST-LAST: said, not ignored for the whole range."""
    monkeypatch.setenv(devenv.FREE_PORTS_ENV, given)
    monkeypatch.setattr(devenv, "_ephemeral_low", lambda: 32768)
    with pytest.raises(
        devenv.DevEnvError, match="expected FIRST-LAST holding ports of 20000-32767"
    ):
        devenv.port_range()


def test_the_halves_of_make_test_share_the_range_without_meeting() -> None:
    e2e, rest = part_share("e2e", 20000, 32768), part_share("rest", 20000, 32768)
    assert e2e == (20000, 26383) and rest == (26384, 32767)
    assert part_share("e2e", 20000, 20002) == (20000, 20000)
    assert part_share("rest", 20000, 20002) == (20001, 20001)


def test_the_demo_s_origins_and_proxy_metrics_ports_lie_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As README and `ponto-demo --help` say (trial 100 found them saying the
    kernel picked the origins' ports): a member started as the demo starts it,
    on port 0, listens on a free_port, and so does a proxy's metrics port."""
    argvs: dict[str, list[str]] = {}

    def spawn(name: str, argv: list[str], *args: object, **kwargs: object) -> None:
        argvs[name] = argv

    monkeypatch.setattr(fleet_module, "spawn", spawn)
    fleet = Fleet(tmp_path)
    fleet.start_origin("origin-us-east", "us-east")
    fleet.start_proxy("proxy-us-east", "us-east", control_planes=["127.0.0.1:7070"])
    ports = [
        int(
            argvs["origin-us-east"][argvs["origin-us-east"].index("--listen") + 1].rpartition(":")[
                2
            ]
        ),
        int(
            argvs["proxy-us-east"][argvs["proxy-us-east"].index("--metrics-listen") + 1].rpartition(
                ":"
            )[2]
        ),
    ]
    assert all(20000 <= port < _ephemeral_low() for port in ports), ports
