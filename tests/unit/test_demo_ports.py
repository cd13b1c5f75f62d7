"""ponto-demo --port-base: where the demo's proxies, control plane and status
page listen (trial 33: the demo took fixed ports with no way to move them)."""

from __future__ import annotations

import signal
import socket

import pytest

from ponto import demo, devenv
from ponto.demo import fixed_ports, main, port_free
from ponto.devenv import _ephemeral_low, free_port


def free_block(size: int = 6) -> int:
    """The first of `size` consecutive ports free a moment ago, all below the
    kernel's ephemeral range (free_port's reasons)."""
    for _ in range(100):
        base = free_port()
        if base + size <= _ephemeral_low() and all(port_free(p) for p in range(base, base + size)):
            return base
    raise AssertionError("no block of free ports")


def test_the_demo_reserves_its_block_before_it_starts_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI: etcd or Redis, started first on free ports, took the block's second
    port before the eu-west proxy could listen on it."""
    monkeypatch.setattr(devenv, "_reserved", set())
    seen: list[set[int]] = []

    def start_demo_fleet(*args: object, **kwargs: object) -> None:
        seen.append(set(devenv._reserved))
        raise devenv.DevEnvError("stopped here")

    monkeypatch.setattr(demo, "start_demo_fleet", start_demo_fleet)
    monkeypatch.setattr(demo, "redis_available", lambda: False)
    base = free_block()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(devenv.DevEnvError, match="stopped here"):
            main(["--port-base", str(base), "--workdir", "/nonexistent-ponto-demo"])
    finally:  # main() takes them over
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert seen == [set(range(base, base + 6))]


def test_a_port_base_gives_five_ports_in_a_row() -> None:
    base = free_block()
    assert fixed_ports(base) == ((base, base + 1, base + 2), base + 3, base + 4)


def test_a_taken_port_of_the_block_is_named() -> None:
    base = free_block()
    with socket.socket() as held:
        # As the demo's servers bind (and port_free checks): a port free_block
        # found free may still hold an earlier test's connection in TIME_WAIT,
        # which a bind without it is refused (CI: EADDRINUSE here). A listener
        # so bound still makes the port taken to the check.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", base + 3))
        held.listen()
        said = fixed_ports(base)
    assert said == f"--port-base {base}: port {base + 3} taken (6 from it are used)"


def test_a_port_whose_connections_wait_out_time_wait_is_free() -> None:
    """Trial 43: a demo started again right after one stopped with clients
    connected was refused its --port-base ("port 24300 taken") with nothing
    listening: the check bound without SO_REUSEADDR, which every server of
    the demo sets, so the closed connections' TIME_WAIT counted as taken."""
    base = free_block(1)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", base))
        listener.listen()
        with socket.create_connection(("127.0.0.1", base)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
            client.recv(1)
        assert not port_free(base)  # still listening: taken
    assert port_free(base)
    with socket.socket() as plain, pytest.raises(OSError):  # as the check bound before
        plain.bind(("127.0.0.1", base))


@pytest.mark.parametrize("base", [80, 65531, -1])
def test_a_port_base_out_of_range_is_refused(base: int) -> None:
    assert fixed_ports(base) == f"--port-base must be from 1024 to 65530, not {base}"


def test_the_demo_refuses_a_bad_port_base_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--port-base", "80"])
    assert stopped.value.code == 2
    assert "--port-base must be from 1024 to 65530, not 80" in capsys.readouterr().err
