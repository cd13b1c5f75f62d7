"""The demo's users in three places: their database, their regions, their curl lines."""

from __future__ import annotations

import shlex
from ipaddress import ip_address
from pathlib import Path

from dataplane.geo.locate import open_locator
from dataplane.routes import great_circle_km
from ponto.demo import GEO_BODY, geo_calls
from ponto.fleet import DEMO_REGIONS, DEMO_USERS, write_demo_geoip


def test_each_user_is_nearest_a_different_demo_region() -> None:
    for user in DEMO_USERS:
        nearest = min(
            DEMO_REGIONS,
            key=lambda r: great_circle_km(user.latitude, user.longitude, r.latitude, r.longitude),
        )
        assert nearest.name == user.region, user
    assert len({u.region for u in DEMO_USERS}) == len(DEMO_USERS) == 3


def test_the_database_places_each_user_in_their_city(tmp_path: Path) -> None:
    locator = open_locator(write_demo_geoip(tmp_path / "demo.mmdb"))
    assert locator is not None
    with locator:
        for user in DEMO_USERS:
            where = locator.locate(ip_address(user.address))
            assert where is not None, user
            assert (where.city, where.country) == (user.city, user.country)
            assert (where.latitude, where.longitude) == (user.latitude, user.longitude)


def test_each_curl_line_is_one_call_as_its_user() -> None:
    for call in geo_calls("http://127.0.0.1:8080/v1"):
        curl, pipe = call.curl().split(" | ")
        args = shlex.split(curl)
        assert args[0] == "curl" and args[-1] == "http://127.0.0.1:8080/v1/chat/completions"
        headers = [args[i + 1] for i, a in enumerate(args) if a == "-H"]
        assert f"X-Forwarded-For: {call.user.address}" in headers
        assert "cache-control: no-cache" in headers
        assert args[args.index("-d") + 1] == GEO_BODY
        assert shlex.split(pipe) == ["grep", "-iE", "^x-ponto-region|^HTTP/[0-9.]+ [^2]"]
