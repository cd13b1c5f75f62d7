"""Fast membership tests for a fixed set of IP networks.

`ipaddress`'s own ``addr in network`` costs a few hundred nanoseconds per
network, so testing an address against a list grows with the list. Here the
networks are grouped by prefix length and each group is a frozenset of network
numbers (the address shifted right past its host bits): a membership test is
one shift and one set lookup per *distinct prefix length*, however many
networks there are (a CDN's published ranges use half a dozen lengths).
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, collapse_addresses

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# One row per distinct prefix length: (host bits to shift away, network numbers).
_Table = tuple[tuple[int, frozenset[int]], ...]


def _index(networks: Iterable[IPNetwork], bits: int) -> _Table:
    groups: dict[int, set[int]] = {}
    for net in networks:
        shift = bits - net.prefixlen
        groups.setdefault(shift, set()).add(int(net.network_address) >> shift)
    # Shortest prefixes (largest shifts) first: they tend to cover the most
    # addresses, so a hit is found on the first row more often.
    return tuple((shift, frozenset(keys)) for shift, keys in sorted(groups.items(), reverse=True))


class NetworkSet:
    """An immutable set of IPv4 and IPv6 networks supporting ``address in set``.

    Overlapping and adjacent networks are collapsed. An IPv4 address is never a
    member of an IPv6 network and vice versa (callers normalise IPv4-mapped
    IPv6 addresses first).
    """

    __slots__ = ("_v4", "_v6", "networks")

    def __init__(self, networks: Iterable[IPNetwork]) -> None:
        v4: list[IPv4Network] = []
        v6: list[IPv6Network] = []
        for net in networks:
            if isinstance(net, IPv4Network):
                v4.append(net)
            else:
                v6.append(net)
        v4 = list(collapse_addresses(v4))
        v6 = list(collapse_addresses(v6))
        self.networks: tuple[IPNetwork, ...] = (*v4, *v6)
        """The collapsed networks, IPv4 first, each family in address order."""
        self._v4 = _index(v4, 32)
        self._v6 = _index(v6, 128)

    def __contains__(self, ip: IPAddress) -> bool:
        n = int(ip)
        for shift, keys in self._v4 if isinstance(ip, IPv4Address) else self._v6:
            if n >> shift in keys:
                return True
        return False

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __len__(self) -> int:
        return len(self.networks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}([{', '.join(repr(str(n)) for n in self.networks)}])"
