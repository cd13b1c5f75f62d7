"""Round-trip times between five cloud regions, from a published table.

Source: Microsoft Learn, "Azure network round-trip latency statistics"
(https://learn.microsoft.com/azure/networking/azure-network-latency), the
version dated 2024-04-10: monthly P50 round-trip times between Azure regions
over the 30 days ending 2024-04-09, measured by Azure's own probes between
its regions every minute. Microsoft says the table is refreshed every 6 to 9
months, so later versions of the page differ by a few milliseconds.

Each of our region labels stands for one Azure region (the `AZURE` map). The
page is directional (a source row, a destination column); the two directions
differ by at most 3 ms here, and a round trip crosses both, so `rtt_ms` uses
their mean.

Two figures are not from the table and are stated as assumptions:

* ACCESS_RTT_MS: a user to the nearest cloud edge in their own metro (last
  mile plus metro network). Both scenarios pay it: a user calling a distant
  origin crosses the same access network first.
* INTRA_REGION_RTT_MS: a proxy to an origin in the same region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

SOURCE: Final = (
    'Microsoft Learn, "Azure network round-trip latency statistics" '
    "(https://learn.microsoft.com/azure/networking/azure-network-latency), "
    "monthly P50 round-trip times for the 30 days ending 2024-04-09 (page dated 2024-04-10)"
)
SOURCE_DATE: Final = "2024-04-09"

# Assumptions, not measurements (see the module docstring and docs/benchmarks/geo-world.md).
ACCESS_RTT_MS: Final = 15.0
INTRA_REGION_RTT_MS: Final = 1.0


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    azure: str  # the Azure region whose figures stand for it
    city: str
    latitude: float
    longitude: float


# Approximate metro coordinates of the Azure regions named.
REGIONS: Final = (
    Region("us-east", "East US", "Virginia", 37.37, -79.82),
    Region("eu-west", "North Europe", "Dublin", 53.35, -6.26),
    Region("ap-southeast", "Southeast Asia", "Singapore", 1.28, 103.83),
    Region("sa-east", "Brazil South", "Sao Paulo", -23.55, -46.63),
    Region("ap-northeast", "Japan East", "Tokyo", 35.68, 139.77),
)
REGION_NAMES: Final = tuple(r.name for r in REGIONS)
AZURE: Final = {r.name: r.azure for r in REGIONS}

# P50 RTT in ms, (source, destination) as the page lists them: the source row in
# the tab of the destination region (East US; UK / North Europe; Asia;
# Canada / Brazil; Japan).
P50_RTT_MS: Final[dict[tuple[str, str], float]] = {
    # to East US
    ("eu-west", "us-east"): 70,
    ("ap-southeast", "us-east"): 227,
    ("sa-east", "us-east"): 118,
    ("ap-northeast", "us-east"): 158,
    # to North Europe
    ("us-east", "eu-west"): 68,
    ("ap-southeast", "eu-west"): 165,
    ("sa-east", "eu-west"): 171,
    ("ap-northeast", "eu-west"): 232,
    # to Southeast Asia
    ("us-east", "ap-southeast"): 223,
    ("eu-west", "ap-southeast"): 166,
    ("sa-east", "ap-southeast"): 340,
    ("ap-northeast", "ap-southeast"): 71,
    # to Brazil South
    ("us-east", "sa-east"): 117,
    ("eu-west", "sa-east"): 171,
    ("ap-southeast", "sa-east"): 343,
    ("ap-northeast", "sa-east"): 280,
    # to Japan East
    ("us-east", "ap-northeast"): 157,
    ("eu-west", "ap-northeast"): 234,
    ("ap-southeast", "ap-northeast"): 72,
    ("sa-east", "ap-northeast"): 281,
}


def rtt_ms(a: str, b: str) -> float:
    """Round trip between two regions' data centres; INTRA_REGION_RTT_MS within one."""
    if a == b:
        if a not in AZURE:
            raise KeyError(a)
        return INTRA_REGION_RTT_MS
    return (P50_RTT_MS[a, b] + P50_RTT_MS[b, a]) / 2


def user_rtt_ms(user_region: str, server_region: str) -> float:
    """Round trip from a user in one region to a server in another (or the same) region.

    The access network to the nearest edge, then the backbone between regions.
    A server in the user's own region costs the access network only.
    """
    backbone = 0.0 if user_region == server_region else rtt_ms(user_region, server_region)
    return ACCESS_RTT_MS + backbone


def matrix() -> dict[str, dict[str, float]]:
    """Symmetric RTT matrix in ms as JSON-ready data."""
    return {a: {b: rtt_ms(a, b) for b in REGION_NAMES} for a in REGION_NAMES}
