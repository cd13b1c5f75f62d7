"""Where the tests' GeoIP databases (written by ponto.geodb) place addresses.

`DOC_RANGES` places the documentation ranges (RFC 5737, RFC 3849) on four
continents so that tests never use anybody's real address.
"""

from __future__ import annotations

DOC_RANGES: dict[str, tuple[float, float, str, str]] = {
    "192.0.2.0/24": (39.04, -77.49, "US", "Ashburn"),  # TEST-NET-1
    "198.51.100.0/24": (53.35, -6.26, "IE", "Dublin"),  # TEST-NET-2
    "203.0.113.0/24": (1.29, 103.85, "SG", "Singapore"),  # TEST-NET-3
    "2001:db8::/32": (50.11, 8.68, "DE", "Frankfurt"),  # IPv6 documentation
}
