"""Where a request comes from: client address -> located point -> home region.

Requests whose client cannot be located (no database, private or unknown
address) are homed in the proxy's own region.
"""

from __future__ import annotations

from collections.abc import Mapping

from dataplane.geo.clientip import TrustedProxies, client_ip
from dataplane.geo.locate import GeoLocator
from dataplane.routes import Routes


class ClientLocator:
    """Owns the GeoIP reader and the trusted-proxy list for one proxy."""

    def __init__(self, locator: GeoLocator | None, trusted: TrustedProxies) -> None:
        self.locator = locator
        self.trusted = trusted

    def home(self, routes: Routes, peer: str | None, headers: Mapping[str, str]) -> str:
        if self.locator is None:
            return routes.region
        ip = client_ip(peer, headers, self.trusted)
        if ip is None:
            return routes.region
        where = self.locator.locate(ip)
        if where is None:
            return routes.region
        return routes.home_of(where.latitude, where.longitude)

    def close(self) -> None:
        close = getattr(self.locator, "close", None)
        if close is not None:
            close()
