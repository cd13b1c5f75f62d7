"""Which address a request really came from, given the proxies we trust.

Behind a load balancer or CDN the socket peer is the balancer, and the client
is named in ``X-Forwarded-For`` (de facto) or ``Forwarded`` (RFC 7239). Both
headers are lists that every hop *appends* to, so only the right-hand end is
written by machines we control: anything to the left of the first hop we do not
trust may be forged by the client. `client_ip` therefore walks the list from the
right, skipping our own proxies, and stops at the first address that is not
one of them.

Pure functions over strings; the only state is `TrustedProxies`, built once at
start-up, and a bounded parse cache (client and proxy addresses repeat).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network
from typing import cast

from dataplane.geo._nets import IPAddress, IPNetwork, NetworkSet

__all__ = ["IPAddress", "TrustedProxies", "client_ip", "parse_node"]

_V4_MAPPED = IPv6Network("::ffff:0:0/96")


def _normalise_network(net: IPNetwork) -> IPNetwork:
    """Rewrite an IPv4-mapped IPv6 network as the IPv4 network it denotes.

    Peers are normalised to IPv4 (``::ffff:10.0.0.1`` -> ``10.0.0.1``), so a
    mapped CIDR would otherwise never match anything.
    """
    if isinstance(net, IPv6Network) and net.prefixlen >= 96 and net.subnet_of(_V4_MAPPED):
        return IPv4Network((int(net.network_address) & 0xFFFFFFFF, net.prefixlen - 96))
    return net


class TrustedProxies:
    """The networks whose ``X-Forwarded-For``/``Forwarded`` entries we believe.

    Built from CIDR strings (``"10.0.0.0/8"``, ``"2001:db8::/32"``; a bare address
    means a single host). Raises `ValueError` naming the offending entry for
    anything that is not a CIDR, including one with host bits set
    (``10.0.0.1/8``): in a trust list a typo should stop start-up, not be
    silently rounded. Raises `TypeError` if given a single string instead of a
    list of them (iterating it would trust nothing useful, one character at a
    time).

    An empty list is valid and means "trust no proxy": `client_ip` then returns
    the socket peer without reading any header.
    """

    __slots__ = ("_set",)

    def __init__(self, cidrs: Iterable[str]) -> None:
        if isinstance(cidrs, str | bytes):
            raise TypeError("TrustedProxies takes a list of CIDR strings, not one string")
        networks: list[IPNetwork] = []
        # Typed as strings, but this reads operator config: check, don't trust.
        for raw in cast("Iterable[object]", cidrs):
            if not isinstance(raw, str):
                raise TypeError(f"trusted proxy CIDR must be a string, got {raw!r}")
            try:
                net = ip_network(raw.strip())
            except ValueError as err:
                raise ValueError(f"invalid trusted proxy CIDR {raw!r}: {err}") from None
            networks.append(_normalise_network(net))
        self._set = NetworkSet(networks)

    @property
    def networks(self) -> tuple[IPNetwork, ...]:
        """The trusted networks, collapsed (overlaps and neighbours merged)."""
        return self._set.networks

    def __contains__(self, ip: IPAddress) -> bool:
        return ip in self._set

    def __bool__(self) -> bool:
        return bool(self._set)

    def __len__(self) -> int:
        return len(self._set)

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self._set.networks]!r})"


# RFC 7239 node-port: a decimal port or an obfuscated one ("_" then token chars).
_PORT = re.compile(r"[0-9]{1,5}|_[A-Za-z0-9._-]+")


def _valid_port(port: str) -> bool:
    return _PORT.fullmatch(port) is not None and (port[0] == "_" or int(port) <= 65535)


# The longest valid node is a bracketed IPv6 address with an embedded IPv4
# tail, a zone id and a port (~60 chars). Longer strings are garbage by
# definition, and refusing them before the cache keeps attackers from filling
# it with kilobyte keys.
_MAX_NODE_LEN = 100


@functools.lru_cache(maxsize=4096)
def _parse_node_cached(text: str) -> IPAddress | None:
    text = text.strip(" \t")
    if not text:
        return None
    host, port = text, ""
    try:
        if text[0] == "[":
            # "[v6]" or "[v6]:port": brackets are only ever used around IPv6.
            end = text.find("]")
            if end < 0:
                return None
            host, rest = text[1:end], text[end + 1 :]
            if rest:
                if rest[0] != ":":
                    return None
                port = rest[1:]
                if not _valid_port(port):
                    return None
            ip: IPAddress = IPv6Address(host)
        elif text.count(":") == 1:
            # "v4:port". Not RFC 7239-quoted, but some balancers (Azure, IIS)
            # put ports into X-Forwarded-For this way.
            host, port = text.split(":")
            if not _valid_port(port):
                return None
            ip = IPv4Address(host)
        elif ":" in text:
            ip = IPv6Address(text)
        else:
            ip = IPv4Address(text)
    except ValueError:
        return None
    if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_node(text: str) -> IPAddress | None:
    """Parse one hop of a forwarding header, or a socket peer, into an address.

    Accepts ``1.2.3.4``, ``1.2.3.4:80``, ``2001:db8::1``, ``[2001:db8::1]`` and
    ``[2001:db8::1]:4711`` (decimal or RFC 7239 obfuscated ``_port``), with
    surrounding spaces or tabs. IPv4-mapped IPv6 addresses come back as IPv4.
    Returns None for anything else: empty strings, ``unknown``, obfuscated
    identifiers (``_hidden``), host names, octal-looking octets, garbage.
    """
    if len(text) > _MAX_NODE_LEN:
        return None
    return _parse_node_cached(text)


def _forwarded_element_node(element: str) -> IPAddress | None:
    """The address in the ``for=`` parameter of one RFC 7239 forwarded-element.

    None when the element has no ``for``, has it twice (forbidden by the RFC),
    or its value is not an address (``unknown``, ``_obfuscated``, garbage).
    Quoted values are unquoted; the quoted form is mandatory for IPv6 but
    unquoted brackets are tolerated, as only trusted hops' entries are used.
    """
    node: str | None = None
    for pair in element.split(";"):
        name, sep, value = pair.partition("=")
        if not sep:
            if pair.strip(" \t"):
                return None  # a pair without "=" is malformed
            continue  # empty pairs ("for=x;;proto=y") are allowed by the grammar
        if name.strip(" \t").lower() != "for":
            continue
        if node is not None:
            return None
        value = value.strip(" \t")
        if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
            value = value[1:-1]
        node = value
    if node is None:
        return None
    return parse_node(node)


def _header_lines(headers: Mapping[str, str], name: str) -> Sequence[str]:
    """Every value of header `name`, in arrival order.

    A multidict (aiohttp's ``CIMultiDictProxy``) is asked for all lines via
    ``getall``, since a hop may add its own header line rather than append to
    the existing one. A plain mapping holds one value per key; its lookup is
    case-sensitive, so the conventional and the all-lowercase spelling (as
    ASGI servers use) are both tried.
    """
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return cast("Sequence[str]", getall(name, ()))
    value = headers.get(name)
    if value is None:
        value = headers.get(name.lower())
    return () if value is None else (value,)


def _split_entries(lines: Sequence[str]) -> list[str]:
    if len(lines) == 1:
        return lines[0].split(",")
    entries: list[str] = []
    for line in lines:
        entries.extend(line.split(","))
    return entries


def client_ip(
    peer: str | None,
    headers: Mapping[str, str],
    trusted: TrustedProxies,
) -> IPAddress | None:
    """The address of the client that sent a request.

    `peer` is the socket's remote address (aiohttp's ``request.remote``); it
    is returned, IPv4-mapped IPv6 normalised to IPv4, unless it lies in
    `trusted`. Only then are the forwarding headers read:

    * ``X-Forwarded-For``, all lines joined in order, split on commas, or the
      ``for=`` parameters of RFC 7239 ``Forwarded``. If both headers are
      present each is walked; one that names no one past the peer counts as
      absent; when they name the same client it is returned,
      when they disagree neither is believed and the peer is returned (a
      balancer that writes one header passes the client's forged copy of
      the other through).
    * The entries are walked right to left. Entries from trusted proxies are
      skipped; the first untrusted address is the client and is returned.
    * An entry that is not an address (garbage, empty, ``unknown``,
      ``_obfuscated``) ends the walk, and the nearest address already
      vouched for is returned: the last trusted hop, or the peer itself.
      Nothing to the left of such an entry can be attributed to anyone.
    * If every entry is trusted, the leftmost one is returned.

    With no trusted proxies configured the headers are never looked at.
    Returns None only when `peer` is None or not an IP address (a Unix socket
    path), since then nobody vouches for the headers either.
    """
    if peer is None:
        return None
    addr = parse_node(peer)
    if addr is None or not trusted or addr not in trusted:
        return addr

    xff = _header_lines(headers, "X-Forwarded-For")
    fwd = _header_lines(headers, "Forwarded")
    if not xff:
        return _walk(addr, fwd, _forwarded_element_node, trusted) if fwd else addr
    by_xff = _walk(addr, xff, parse_node, trusted)
    if not fwd:
        return by_xff
    # Both headers: a trusted proxy may write only one of them and pass the
    # client's own copy of the other through untouched, and we cannot tell
    # which. If they name different clients one of them is forged; believe
    # neither and fall back to the peer, which nobody can forge.
    by_fwd = _walk(addr, fwd, _forwarded_element_node, trusted)
    # One that vouches for nobody past the peer (no `for=`, `for=unknown`,
    # `_hidden`) is as absent, not a disagreement (review 314: such a
    # Forwarded sent every client behind it to the balancer's region). The
    # header a trusted proxy writes names the client it saw, so a client
    # cannot empty it.
    if by_fwd == addr:
        return by_xff
    if by_xff == addr:
        return by_fwd
    return by_xff if by_xff == by_fwd else addr


def _walk(
    peer: IPAddress,
    lines: Sequence[str],
    parse: Callable[[str], IPAddress | None],
    trusted: TrustedProxies,
) -> IPAddress:
    """The client named by one forwarding header, walked right to left (see `client_ip`)."""
    nearest = peer
    for entry in reversed(_split_entries(lines)):
        hop = parse(entry)
        if hop is None:
            return nearest
        if hop not in trusted:
            return hop
        nearest = hop
    return nearest
