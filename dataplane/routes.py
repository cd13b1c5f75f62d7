"""Pure: a pushed RouteTable -> the proxy's runtime routing object.

Validation happens here, once per table: a table that fails it is NACKed and
the previous Routes keeps serving. Everything that does not depend on the
request (drain and health filtering, region order by distance from this
proxy's region) is precomputed, so per request only a weighted shuffle among
equally near origins remains.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

EARTH_RADIUS_KM = 6371.0


class TableError(ValueError):
    """The table cannot be used; the message is sent back in the NACK."""


@dataclass(frozen=True, slots=True)
class Target:
    """One origin as the proxy calls it."""

    name: str
    region: str
    base_url: str
    weight: int


@dataclass(frozen=True, slots=True)
class Routes:
    """Immutable routing state built from one table; shared by all requests.

    groups[model] lists candidate origin groups, nearest region first; origins
    within a group are equally near and split traffic by weight.
    """

    version: int
    etag: str
    region: str
    models: tuple[str, ...]
    groups: dict[str, tuple[tuple[Target, ...], ...]]

    def candidates(self, model: str, rand: Callable[[], float] = random.random) -> list[Target]:
        """Origins to try for model, in order; empty if the model is unknown here.

        Within each group the order is a weighted random permutation
        (Efraimidis-Spirakis): each origin leads with probability weight/sum.
        """
        out: list[Target] = []
        for group in self.groups.get(model, ()):
            if len(group) == 1:
                out.append(group[0])
            else:
                keyed = sorted(group, key=lambda t: rand() ** (1.0 / t.weight), reverse=True)
                out.extend(keyed)
        return out


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


def validate(table: pb.RouteTable) -> None:
    """Raise TableError unless the table is internally consistent."""
    if table.version <= 0:
        raise TableError("table has no version")
    if table.etag != content_etag(table):
        raise TableError("table etag does not match its content")
    regions: set[str] = set()
    for r in table.regions:
        if not r.name or r.name in regions:
            raise TableError(f"region name {r.name!r} is empty or repeated")
        if not (-90 <= r.latitude <= 90 and -180 <= r.longitude <= 180):
            raise TableError(f"region {r.name!r} has coordinates out of range")
        regions.add(r.name)
    origins: set[str] = set()
    for o in table.origins:
        if not o.name or o.name in origins:
            raise TableError(f"origin name {o.name!r} is empty or repeated")
        origins.add(o.name)
        if o.region not in regions:
            raise TableError(f"origin {o.name!r} is in unknown region {o.region!r}")
        url = urlsplit(o.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise TableError(f"origin {o.name!r} has an invalid base URL {o.base_url!r}")
        if not o.models:
            raise TableError(f"origin {o.name!r} serves no model")
        if o.weight < 1:
            raise TableError(f"origin {o.name!r} has weight {o.weight}")


def build_routes(table: pb.RouteTable, proxy_region: str) -> Routes:
    """Validate table and precompute per-model candidate groups for proxy_region.

    Regions are ordered by great-circle distance from the proxy's region (its
    own region first); when the proxy's region is not in the table, by name.
    Drained regions, drained origins and unhealthy origins are left out.
    """
    validate(table)
    coords = {r.name: (r.latitude, r.longitude) for r in table.regions}
    drained_regions = {r.name for r in table.regions if r.drained}
    home = coords.get(proxy_region)

    def distance(region: str) -> tuple[float, str]:
        if region == proxy_region:
            return (-1.0, region)
        if home is None:
            return (0.0, region)
        return (great_circle_km(*home, *coords[region]), region)

    by_model: dict[str, dict[str, list[Target]]] = {}
    all_models: set[str] = set()
    for o in table.origins:
        all_models.update(o.models)
        if o.drained or not o.healthy or o.region in drained_regions:
            continue
        target = Target(o.name, o.region, o.base_url.rstrip("/"), o.weight)
        for model in o.models:
            by_model.setdefault(model, {}).setdefault(o.region, []).append(target)
    groups = {
        model: tuple(tuple(per_region[region]) for region in sorted(per_region, key=distance))
        for model, per_region in by_model.items()
    }
    for model in all_models:
        groups.setdefault(model, ())
    return Routes(
        version=table.version,
        etag=table.etag,
        region=proxy_region,
        models=tuple(sorted(all_models)),
        groups=groups,
    )
