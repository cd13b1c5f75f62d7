"""ponto.listening: "::" takes IPv4 clients too, on every server's socket (trial 78)."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from dataplane import supervisor
from ponto.listening import bound_socket, is_ipv6_wildcard, tcp_site


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")


@pytest.fixture
def closing() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


@pytest.mark.parametrize(
    ("host", "wildcard"),
    [("::", True), ("0:0:0:0:0:0:0:0", True), ("::1", False), ("0.0.0.0", False), ("", False)],
)
def test_the_ipv6_wildcard_in_any_spelling(host: str, wildcard: bool) -> None:
    assert is_ipv6_wildcard(host) is wildcard
    assert is_ipv6_wildcard("localhost") is False


def _v6only(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)


@needs_ipv6
def test_the_wildcard_takes_an_ipv4_client_and_an_address_only_itself(
    closing: list[socket.socket],
) -> None:
    anywhere = bound_socket("::", 0)
    closing.append(anywhere)
    anywhere.listen()
    port = anywhere.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with socket.create_connection(("::1", port), timeout=2):
        pass
    assert _v6only(anywhere) == 0
    one = bound_socket("::1", 0)
    closing.append(one)
    assert _v6only(one) == 1


@needs_ipv6
def test_a_group_of_workers_on_the_wildcard_takes_ipv4_too(closing: list[socket.socket]) -> None:
    # --workers N: the supervisor holds the port, each worker listens on its own.
    holder = supervisor.reserve_port("::", 0)
    closing.append(holder)
    port = holder.getsockname()[1]
    worker = supervisor.reuseport_socket("::", port)
    closing.append(worker)
    worker.listen()
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@needs_ipv6
async def test_an_aiohttp_server_on_the_wildcard_answers_an_ipv4_client() -> None:
    # As a single proxy, its --metrics-listen, the control plane's status page
    # and the origin simulator listen: aiohttp's TCPSite alone made "::" IPv6 only.
    async def peer(request: web.Request) -> web.Response:
        return web.Response(text=request.remote or "")

    app = web.Application()
    app.router.add_get("/", peer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = tcp_site(runner, "::", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:
            for url in (f"http://127.0.0.1:{port}/", f"http://[::1]:{port}/"):
                async with session.get(url) as answer:
                    assert answer.status == 200
                    seen = await answer.text()
            assert seen == "::1"
    finally:
        await runner.cleanup()


async def test_another_host_is_aiohttps_own_site() -> None:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    try:
        assert isinstance(tcp_site(runner, "127.0.0.1", 0), web.TCPSite)
    finally:
        await runner.cleanup()


def _ipv6_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host as a kernel booted with ipv6.disable=1 makes it: no IPv6 socket."""
    real = socket.socket

    def make(family: int = socket.AF_INET, *args: object, **kwargs: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        return real(family, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", make)


@pytest.mark.parametrize("no_ipv6", ["kernel", "python"])
def test_the_wildcard_is_ipv4s_where_the_host_has_no_ipv6(
    no_ipv6: str, monkeypatch: pytest.MonkeyPatch, closing: list[socket.socket]
) -> None:
    # Review 323: gRPC and etcd listen on 0.0.0.0 for [::] there; the HTTP
    # servers of the same pod refused to start (EAFNOSUPPORT).
    if no_ipv6 == "kernel":
        _ipv6_unsupported(monkeypatch)
    else:
        monkeypatch.setattr(socket, "has_ipv6", False)
    anywhere = bound_socket("::", 0)
    closing.append(anywhere)
    assert anywhere.family == socket.AF_INET
    assert anywhere.getsockname()[0] == "0.0.0.0"
    anywhere.listen()
    with socket.create_connection(("127.0.0.1", anywhere.getsockname()[1]), timeout=2):
        pass


def test_an_ipv6_address_on_a_host_without_ipv6_is_still_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ipv6_unsupported(monkeypatch)
    with pytest.raises(OSError) as refused:
        bound_socket("::1", 0)
    assert refused.value.errno == errno.EAFNOSUPPORT
