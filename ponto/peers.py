"""Who a peer's address is: the one client an address, or a range of them,
stands for, for the bounds kept per client (the proxy's connection cap, the
status page's wrong-token throttle).

Standard library only.
"""

from __future__ import annotations

import socket
from typing import Final

__all__ = ["client_of"]

# The first 96 bits of an IPv6 address that carries an IPv4 one in its last
# 32: IPv4-mapped (a dual-stack socket's IPv4 peer), and NAT64's well-known
# prefix (RFC 6052: an IPv4 client through a NAT46/SIIT gateway, RFC 7755).
_CARRIES_IPV4: Final = (bytes(10) + b"\xff\xff", b"\x00\x64\xff\x9b" + bytes(8))
# NAT64's local-use prefix, 64:ff9b:1::/48 (RFC 8215): its length, /48 to
# /96, is the operator's, so where the IPv4 address lies is not known.
_NAT64_LOCAL_USE: Final = b"\x00\x64\xff\x9b\x00\x01"
_HOST_BITS_ZERO: Final = bytes(8)


def client_of(address: str) -> str:
    """Who a peer's address is, for the bounds kept per client (the proxy's
    --max-connections-per-client, the status page's wrong admin tokens): an
    IPv4 address itself; an IPv6 address that carries an IPv4 one (one
    IPv4-mapped, as a dual-stack socket gives it, or of NAT64's well-known
    prefix 64:ff9b::/96) that IPv4 address; one of NAT64's local-use prefix
    (64:ff9b:1::/48) itself; any other IPv6 address its /64
    ("2001:db8:1:2::/64"); anything else (not an address) itself.

    An IPv6 host is given a whole /64 (SLAAC, privacy addresses: RFC 8981) and
    may send from any address in it, so counted per address one host had a
    cap per address it cared to make up: trial 78 saw 40 connections from 40
    addresses of one /64 past a cap of 4. A /64 is what one IPv4 address is,
    a home's or a phone's, or a node's pods in a cluster (behind a balancer,
    set the proxy's cap to --max-connections anyway: docs/security.md). A translated
    IPv4 client is one address of its gateway's prefix: by /64 every IPv4
    client of the gateway would be one client (review 323).

    Run for each accepted connection: an IPv4 address is not parsed, an IPv6
    one by inet_pton (ipaddress took 13 to 20 times as long; review 323).
    """
    if ":" not in address:
        return address
    try:
        packed = socket.inet_pton(socket.AF_INET6, address.partition("%")[0])
    except (OSError, ValueError):
        return address
    if packed[:12] in _CARRIES_IPV4:
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    if packed[:6] == _NAT64_LOCAL_USE:
        return socket.inet_ntop(socket.AF_INET6, packed)
    return socket.inet_ntop(socket.AF_INET6, packed[:8] + _HOST_BITS_ZERO) + "/64"
