"""A replica refuses an address it cannot listen on, in one line and exit
status 1, rather than sharing a port another replica serves (gRPC binds
with SO_REUSEPORT unless told not to)."""

from __future__ import annotations

import logging
import socket

import pytest

from controlplane.app import ControlPlane, serve
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore


@pytest.mark.parametrize("flag", ["--listen", "--health-listen", "--http-listen"])
async def test_a_second_replica_on_a_taken_port_is_refused(flag: str) -> None:
    """Trial 17: `ponto-control --listen` on a port another replica served
    started, logged `serving on` that port, and took some of its calls."""
    listen = ["--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0"]
    first = ControlPlane(
        parse(["--id", "cp-1", *listen, "--http-listen", "127.0.0.1:0"]), MemoryStore()
    )
    await first.start()
    try:
        taken = {
            "--listen": first.port,
            "--health-listen": first.health_port,
            "--http-listen": first.http_port,
        }[flag]
        argv = ["--id", "cp-2", "--listen", "127.0.0.1:0", flag, f"127.0.0.1:{taken}"]
        second = ControlPlane(parse(argv), MemoryStore())
        with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{taken}: ") as refused:
            await second.start()
        assert type(refused.value).__name__ == "ListenError"
        await second.stop(grace=0)
    finally:
        await first.stop(grace=0)


async def test_serve_says_so_in_one_line_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        async def in_memory(settings: object) -> ControlPlane:
            return ControlPlane(
                parse(["--id", "cp-1", "--listen", f"127.0.0.1:{port}"]), MemoryStore()
            )

        monkeypatch.setattr("controlplane.app.over_etcd", in_memory)
        caplog.set_level(logging.ERROR)
        assert await serve(parse(["--listen", f"127.0.0.1:{port}"])) == 1
    errors = [
        r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "controlplane.app"
    ]
    assert [r.getMessage() for r in errors] == [
        f"cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert errors[0].exc_info is None


@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("192.0.2.1:0", "Cannot assign requested address"),  # not this host's
        # Without DNS, "Temporary failure in name resolution" (review 38).
        ("nosuch.invalid:7000", "(Name or service not known|Temporary failure)"),
        ("127.0.0.1:70000", "expected HOST:PORT, a port 0-65535"),
        ("127.0.0.1:x", "expected HOST:PORT, a port 0-65535"),
    ],
)
async def test_an_address_it_cannot_listen_on_says_why(listen: str, why: str) -> None:
    """Review 37: every refusal said "in use or not this host's", beside a
    line of gRPC's own; the address is tried first, and the system's reason
    given."""
    plane = ControlPlane(parse(["--id", "cp-1", "--listen", listen]), MemoryStore())
    with pytest.raises(Exception, match=f"^cannot listen on {listen}: .*{why}"):
        await plane.start()
    await plane.stop(grace=0)
