"""What listening on HOST:PORT means, alike for every server: the proxy's
ports (one process or a group's workers), the control plane's status page,
the origin simulator.

The IPv6 wildcard, ``::`` (``--listen [::]:8080``, the Helm chart's
``listenAddress: "::"``), takes IPv4 connections too, which arrive as
IPv4-mapped addresses (``::ffff:10.0.0.5``, read as ``10.0.0.5`` wherever a
client's address is used). gRPC (the control plane's API) and etcd listen
so on ``[::]``; asyncio sets ``IPV6_V6ONLY`` on every IPv6 socket, which
left the aiohttp servers of a dual-stack pod deaf to its IPv4 address (its
kubelet probes, an IPv4 Service's traffic) while the docs promised both.
Any other IPv6 address is that address alone.

Standard library only: the proxy's supervisor (dataplane.supervisor)
imports this module and nothing beyond the standard library.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["bound_socket", "is_ipv6_wildcard", "tcp_site"]

# asyncio's and aiohttp's default.
DEFAULT_BACKLOG = 128


def is_ipv6_wildcard(host: str) -> bool:
    """Whether `host` is the IPv6 unspecified address (``::``, in any spelling)."""
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::")
    except ValueError:
        return False


def bound_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking TCP socket bound to host:port, not yet listening.

    `host` must resolve to one address: the first is used. ``SO_REUSEADDR``
    is set, as asyncio does (a restart is not refused for connections in
    TIME_WAIT), and ``SO_REUSEPORT`` when `reuse_port`. An IPv6 socket is
    IPv6 only, unless `host` is the IPv6 wildcard, which takes IPv4 too (the
    module's docstring says why); where this host has no IPv6 at all (a
    kernel booted with ipv6.disable=1, a Python built without it) the
    wildcard is IPv4's, 0.0.0.0, as gRPC and etcd take ``[::]`` there.
    Raises OSError when the address cannot be resolved or bound.
    """
    if not is_ipv6_wildcard(host):
        return _bound(host, port, reuse_port=reuse_port, v6only=True)
    if socket.has_ipv6:
        try:
            return _bound(host, port, reuse_port=reuse_port, v6only=False)
        except OSError as exc:
            if exc.errno != errno.EAFNOSUPPORT:
                raise
    return _bound("0.0.0.0", port, reuse_port=reuse_port, v6only=True)


def _bound(host: str, port: int, *, reuse_port: bool, v6only: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def tcp_site(
    runner: web.BaseRunner, host: str, port: int, *, backlog: int = DEFAULT_BACKLOG
) -> web.BaseSite:
    """The aiohttp site to listen on host:port with: aiohttp's own TCPSite (a
    host name is listened on at each of its addresses), except on the IPv6
    wildcard, which gets a socket of `bound_socket`'s, IPv4 too. Binding
    happens here for the wildcard and at the site's start otherwise: both
    raise OSError, so callers make and start it under one ``try``."""
    # Here, not at the top: the supervisor imports this module for
    # bound_socket and must not load aiohttp.
    from aiohttp import web  # noqa: PLC0415

    if is_ipv6_wildcard(host):
        return web.SockSite(runner, bound_socket(host, port), backlog=backlog)
    return web.TCPSite(runner, host, port, backlog=backlog)
