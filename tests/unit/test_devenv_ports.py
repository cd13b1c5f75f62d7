"""free_port: ports that no outgoing connection takes while nothing listens."""

from __future__ import annotations

import socket

from ponto.devenv import _ephemeral_low, free_port


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
