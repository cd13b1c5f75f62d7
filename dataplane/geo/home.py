"""Where a request comes from: client address -> located point -> home region.

Requests whose client cannot be located (no database, private or unknown
address) are homed in the proxy's own region. A located client's point goes
with its home: the regions after an unusable home are ordered from it.
"""

from __future__ import annotations

from collections.abc import Mapping

from dataplane.geo.clientip import TrustedProxies, client_ip
from dataplane.geo.locate import GeoLocator
from dataplane.routes import Point, Routes


class ClientLocator:
    """Owns the GeoIP reader and the trusted-proxy list for one proxy."""

    def __init__(self, locator: GeoLocator | None, trusted: TrustedProxies) -> None:
        self.locator = locator
        self.trusted = trusted

    def home(self, routes: Routes, peer: str | None, headers: Mapping[str, str]) -> str:
        """The client's home region (`place` without the point)."""
        return self.place(routes, peer, headers)[0]

    def place(
        self, routes: Routes, peer: str | None, headers: Mapping[str, str]
    ) -> tuple[str, Point | None]:
        """The client's home region, and its point when GeoIP placed it (None:
        homed in the proxy's region). `Routes.groups_for` takes both: the
        point orders the other regions when the home cannot serve."""
        if self.locator is None:
            return routes.region, None
        ip = client_ip(peer, headers, self.trusted)
        if ip is None:
            return routes.region, None
        where = self.locator.locate(ip)
        if where is None:
            return routes.region, None
        point = (where.latitude, where.longitude)
        return routes.home_of(*point), point

    def close(self) -> None:
        close = getattr(self.locator, "close", None)
        if close is not None:
            close()
