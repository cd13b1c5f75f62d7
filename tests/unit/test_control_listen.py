"""A replica refuses an address it cannot listen on, in one line and exit
status 1, rather than sharing a port another replica serves (gRPC binds
with SO_REUSEPORT unless told not to)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.app import ControlPlane, ListenError, serve
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore
from ponto.pki import make_bundle


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


@pytest.mark.parametrize("flag", ["--listen", "--health-listen", "--http-listen"])
@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("192.0.2.1:0", "Cannot assign requested address"),  # not this host's
        # Without DNS, "Temporary failure in name resolution" (review 38).
        ("nosuch.invalid:7000", "(Name or service not known|Temporary failure)"),
    ],
)
async def test_an_address_it_cannot_listen_on_says_why(flag: str, listen: str, why: str) -> None:
    """Review 37: every refusal said "in use or not this host's", beside a
    line of gRPC's own; the address is tried first, and the system's reason
    given, in one line. --http-listen's said aiohttp's "[Errno 99] error
    while attempting to bind on address ('192.0.2.1', 0): cannot assign
    requested address", and "[Errno -2]" for a name."""
    argv = ["--id", "cp-1", "--listen", "127.0.0.1:0", flag, listen]
    plane = ControlPlane(parse(argv), MemoryStore())
    with pytest.raises(ListenError, match=f"^cannot listen on {listen}: {why}[^:]*$"):
        await plane.start()
    await plane.stop(grace=0)


@pytest.mark.parametrize("flag", ["--listen", "--health-listen", "--http-listen"])
@pytest.mark.parametrize(
    "listen", ["127.0.0.1:70000", "127.0.0.1:x", "127.0.0.1:\u00b2", "127.0.0.1", "::1:7000"]
)
def test_an_address_that_is_no_host_and_port_is_refused_with_its_flag(
    flag: str, listen: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--http-listen 127.0.0.1:70000 served the status page on port 4464 (gRPC
    had done the same with --listen, review 38); "\u00b2" passes str.isdigit()
    and failed int() later."""
    with pytest.raises(SystemExit) as exit_:
        parse(["--id", "cp-1", flag, listen])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith(f"ponto-control: error: argument {flag}: expected HOST:PORT")
    assert said.endswith(f"got {listen!r}")


async def test_an_address_set_in_code_is_read_as_the_flags_are() -> None:
    """Settings made without the parser (tests, embedders) are checked at start."""
    plane = ControlPlane(replace(parse(["--id", "cp-1"]), listen="127.0.0.1:70000"), MemoryStore())
    refusal = r"^cannot listen on 127\.0\.0\.1:70000: expected HOST:PORT"
    with pytest.raises(ListenError, match=refusal):
        await plane.start()
    await plane.stop(grace=0)


async def test_an_address_without_its_host_is_every_interface() -> None:
    """`--listen :7070` was refused as "in use or not this host's" (gRPC takes
    no empty host) and `--http-listen :8080` as "not HOST:PORT", where the
    proxy's `--listen :8080` is every interface."""
    plane = ControlPlane(
        parse(["--id", "cp-1", "--listen", ":0", "--health-listen", ":0", "--http-listen", ":0"]),
        MemoryStore(),
    )
    await plane.start()
    try:
        assert plane.settings.listen == "0.0.0.0:0"
        for port in (plane.port, plane.health_port, plane.http_port):
            assert port
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
    finally:
        await plane.stop(grace=0)


@pytest.mark.parametrize(
    ("tls", "listen", "warned"),
    [(False, "0.0.0.0:0", 1), (True, "0.0.0.0:0", 0), (False, "127.0.0.1:0", 0)],
)
async def test_tokens_without_tls_are_warned_of_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tls: bool, listen: str, warned: int
) -> None:
    """Trial 23: a control plane given tokens and no certificate said only
    "(plaintext; ...)" at INFO, while the tokens crossed the wire in the
    clear; on loopback they cross no network (review 41)."""
    token = tmp_path / "bootstrap.token"
    token.write_text("a-token-of-its-own\n")
    argv = ["--id", "cp-1", "--listen", listen, "--bootstrap-token-file", str(token)]
    if tls:
        bundle = make_bundle(tmp_path / "pki")
        argv += ["--tls-cert", bundle.path("server.crt"), "--tls-key", bundle.path("server.key")]
    plane = ControlPlane(parse(argv), MemoryStore())
    caplog.set_level(logging.WARNING, "controlplane.app")
    await plane.start()
    await plane.stop(grace=0)
    said = [r.getMessage() for r in caplog.records if "in the clear" in r.getMessage()]
    assert len(said) == warned
