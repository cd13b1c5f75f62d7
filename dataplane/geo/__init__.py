"""Client location: who is really calling (`client_ip`) and where they are (`GeoLocator`).

Self-contained: nothing here imports the rest of the proxy, so the request path
can use it without pulling in configuration or state.
"""

from dataplane.geo.clientip import IPAddress, TrustedProxies, client_ip, parse_node
from dataplane.geo.locate import (
    GeoLocator,
    Location,
    MmdbLocator,
    Schema,
    database_problem,
    is_locatable,
    open_locator,
)

__all__ = [
    "GeoLocator",
    "IPAddress",
    "Location",
    "MmdbLocator",
    "Schema",
    "TrustedProxies",
    "client_ip",
    "database_problem",
    "is_locatable",
    "open_locator",
    "parse_node",
]
