"""dataplane.routes: homing clients, per-home region order, spill, RTT order and limits."""

from __future__ import annotations

import random

import pytest

from controlplane.compile import compile_table
from controlplane.model import Origin, OriginHealth, State
from controlplane.model import Region as ModelRegion
from dataplane.routes import HOME_CACHE, Routes, Target, build_routes
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

US = ("us-east", 39.0, -77.0)  # Virginia
EU = ("eu-west", 53.0, -6.0)  # Dublin
AP = ("ap-southeast", 1.35, 103.8)  # Singapore
MODEL = "llama-3"
CAPACITY = 100

NEW_YORK = (40.71, -74.01)
LONDON = (51.51, -0.13)
JAKARTA = (-6.2, 106.85)
SYDNEY = (-33.87, 151.21)  # homed in Singapore; Virginia is nearer it than Dublin


def region(
    spec: tuple[str, float, float],
    *,
    spill_threshold: float = 0.0,
    rtt_ms: dict[str, float] | None = None,
    drained: bool = False,
) -> pb.Region:
    name, lat, lon = spec
    return pb.Region(
        name=name,
        latitude=lat,
        longitude=lon,
        spill_threshold=spill_threshold,
        rtt_ms=rtt_ms or {},
        drained=drained,
    )


def origin(name: str, region_name: str, *, weight: int = 100) -> pb.Origin:
    return pb.Origin(
        name=name,
        base_url=f"http://{name}.example/v1",
        region=region_name,
        models=[MODEL],
        weight=weight,
        healthy=True,
        capacity=CAPACITY,
    )


def make_table(
    regions: list[pb.Region] | None = None, origins: list[pb.Origin] | None = None
) -> pb.RouteTable:
    if regions is None:
        regions = [region(US), region(EU), region(AP)]
    if origins is None:
        origins = [
            origin("o-us", "us-east"),
            origin("o-eu", "eu-west"),
            origin("o-ap", "ap-southeast"),
        ]
    table = pb.RouteTable(version=3, regions=regions, origins=origins)
    table.etag = content_etag(table)
    return table


def spilled(table: pb.RouteTable, proxy_region: str, loads: dict[str, float]) -> Routes:
    """build_routes, then spilled by the origins' loads pushed (`loads`:
    origin -> running and waiting requests, of CAPACITY each)."""
    return build_routes(table, proxy_region).spilled(loads.get)


def regions_of(targets: list[Target]) -> list[str]:
    return [t.region for t in targets]


def names(targets: list[Target]) -> list[str]:
    return [t.name for t in targets]


# ---------------------------------------------------------------- home_of


@pytest.mark.parametrize(
    ("point", "home"),
    [
        (NEW_YORK, "us-east"),
        (LONDON, "eu-west"),
        (JAKARTA, "ap-southeast"),
        ((-33.87, 151.21), "ap-southeast"),  # Sydney
        ((-23.55, -46.63), "us-east"),  # São Paulo
        ((52.52, 13.40), "eu-west"),  # Berlin
        ((39.0, -77.0), "us-east"),  # exactly on a region
    ],
)
def test_home_of_picks_nearest_region(point: tuple[float, float], home: str) -> None:
    routes = build_routes(make_table(), "eu-west")
    assert routes.home_of(*point) == home


def test_home_of_is_independent_of_proxy_region() -> None:
    for proxy in ("us-east", "eu-west", "ap-southeast", "nowhere"):
        routes = build_routes(make_table(), proxy)
        assert routes.home_of(*JAKARTA) == "ap-southeast"
        assert routes.home_of(*NEW_YORK) == "us-east"


def test_home_of_is_cached() -> None:
    routes = build_routes(make_table(), "eu-west")
    first = routes.home_of(*JAKARTA)
    second = routes.home_of(*JAKARTA)
    assert first == "ap-southeast"
    assert second is first
    assert routes._homes == {JAKARTA: "ap-southeast"}


def test_home_cache_is_bounded() -> None:
    routes = build_routes(make_table(), "eu-west")
    for i in range(HOME_CACHE + 10):
        routes.home_of(-60 + i * 1e-4, 100.0)
    assert len(routes._homes) <= HOME_CACHE
    assert routes.home_of(*LONDON) == "eu-west"
    assert routes.home_of(*LONDON) == "eu-west"


def test_cache_is_per_table() -> None:
    near = build_routes(make_table(), "eu-west")
    assert near.home_of(*JAKARTA) == "ap-southeast"
    # A table without ap-southeast: the cached answer of another table must not leak.
    other = build_routes(
        make_table(
            regions=[region(US), region(EU)],
            origins=[origin("o-us", "us-east"), origin("o-eu", "eu-west")],
        ),
        "eu-west",
    )
    assert other.home_of(*JAKARTA) == "eu-west"
    assert near.home_of(*JAKARTA) == "ap-southeast"


def test_home_of_without_regions_is_the_proxy_region() -> None:
    table = pb.RouteTable(version=1)
    table.etag = content_etag(table)
    routes = build_routes(table, "eu-west")
    assert routes.home_of(*JAKARTA) == "eu-west"
    assert routes.candidates(MODEL, routes.home_of(*JAKARTA)) == []


# ---------------------------------------------------------------- order per home


@pytest.mark.parametrize(
    ("home", "expected"),
    [
        ("us-east", ["us-east", "eu-west", "ap-southeast"]),
        ("eu-west", ["eu-west", "us-east", "ap-southeast"]),
        ("ap-southeast", ["ap-southeast", "eu-west", "us-east"]),
    ],
)
def test_candidates_ordered_from_the_clients_home(home: str, expected: list[str]) -> None:
    routes = build_routes(make_table(), "eu-west")  # the proxy is in eu-west
    assert regions_of(routes.candidates(MODEL, home)) == expected


def test_client_near_ap_gets_ap_first_from_an_eu_proxy() -> None:
    routes = build_routes(make_table(), "eu-west")
    home = routes.home_of(*JAKARTA)
    assert names(routes.candidates(MODEL, home)) == ["o-ap", "o-eu", "o-us"]
    # Unlocated clients (no home) are homed at the proxy's own region.
    assert names(routes.candidates(MODEL)) == ["o-eu", "o-us", "o-ap"]


def test_unknown_home_falls_back_to_proxy_region() -> None:
    routes = build_routes(make_table(), "eu-west")
    assert names(routes.candidates(MODEL, "mars")) == ["o-eu", "o-us", "o-ap"]


def test_home_without_origins_for_model_still_orders_others() -> None:
    table = make_table(origins=[origin("o-us", "us-east"), origin("o-eu", "eu-west")])
    routes = build_routes(table, "us-east")
    assert names(routes.candidates(MODEL, "ap-southeast")) == ["o-eu", "o-us"]


# ---------------------------------------------------------------- from the client's point


def test_a_drained_home_sends_a_located_client_to_its_own_nearest_region() -> None:
    """Trial 49: a client in Sydney, its home ap-southeast drained, went to
    eu-west (17,223 km from Sydney, but nearer Singapore) and not us-east
    (15,681 km)."""
    routes = build_routes(
        make_table(regions=[region(US), region(EU), region(AP, drained=True)]), "eu-west"
    )
    home = routes.home_of(*SYDNEY)
    assert home == "ap-southeast"
    assert regions_of(routes.candidates(MODEL, home, point=SYDNEY)) == ["us-east", "eu-west"]
    # Without its point (not located), the home's own order stands.
    assert regions_of(routes.candidates(MODEL, home)) == ["eu-west", "us-east"]


def test_a_home_without_the_model_sends_the_client_to_its_nearest_that_has_it() -> None:
    table = make_table(origins=[origin("o-us", "us-east"), origin("o-eu", "eu-west")])
    routes = build_routes(table, "eu-west")
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "us-east",
        "eu-west",
    ]


def test_a_hot_home_spills_to_the_clients_nearest_and_stays_last() -> None:
    table = make_table(regions=[region(US), region(EU), region(AP, spill_threshold=0.8)])
    routes = spilled(table, "eu-west", {"o-ap": 90})
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "us-east",
        "eu-west",
        "ap-southeast",
    ]


def test_regions_over_their_threshold_stay_after_the_others_from_the_point() -> None:
    table = make_table(
        regions=[region(US, spill_threshold=0.8), region(EU), region(AP, drained=True)]
    )
    routes = spilled(table, "eu-west", {"o-us": 90})
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "eu-west",
        "us-east",
    ]


def test_the_point_orders_by_distance_even_with_an_rtt_matrix() -> None:
    """The matrix times regions from regions; a client whose home cannot
    serve is at neither, and goes by distance from its own point."""
    table = make_table(
        regions=[
            region(US, rtt_ms={"eu-west": 75.0, "ap-southeast": 215.0}),
            region(EU, rtt_ms={"us-east": 75.0, "ap-southeast": 160.0}),
            region(AP, rtt_ms={"us-east": 215.0, "eu-west": 160.0}, drained=True),
        ]
    )
    routes = build_routes(table, "eu-west")
    assert regions_of(routes.candidates(MODEL, "ap-southeast")) == ["eu-west", "us-east"]
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "us-east",
        "eu-west",
    ]


def test_a_usable_home_keeps_the_precomputed_order_itself() -> None:
    """The common path does no work for the point: the very tuple built with
    the table is returned, and nothing is cached."""
    routes = build_routes(make_table(), "eu-west")
    precomputed = routes.order["ap-southeast"][MODEL]
    assert routes.groups_for(MODEL, "ap-southeast", SYDNEY) is precomputed
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "ap-southeast",
        "eu-west",
        "us-east",
    ]
    assert routes._near == {}


def test_the_order_from_a_point_is_cached_and_bounded() -> None:
    routes = build_routes(
        make_table(regions=[region(US), region(EU), region(AP, drained=True)]), "eu-west"
    )
    first = routes.groups_for(MODEL, "ap-southeast", SYDNEY)
    assert routes.groups_for(MODEL, "ap-southeast", SYDNEY) is first
    for i in range(HOME_CACHE + 10):
        routes.groups_for(MODEL, "ap-southeast", (-30.0 - i * 1e-4, 150.0))
    assert len(routes._near) <= HOME_CACHE
    assert regions_of(routes.candidates(MODEL, "ap-southeast", point=SYDNEY)) == [
        "us-east",
        "eu-west",
    ]


# ---------------------------------------------------------------- spill


def test_hot_region_goes_after_all_others_but_stays() -> None:
    table = make_table(regions=[region(US, spill_threshold=0.8), region(EU), region(AP)])
    routes = spilled(table, "eu-west", {"o-us": 90})
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "eu-west",
        "ap-southeast",
        "us-east",
    ]
    assert regions_of(routes.candidates(MODEL, "eu-west")) == [
        "eu-west",
        "ap-southeast",
        "us-east",
    ]
    assert regions_of(routes.candidates(MODEL, "ap-southeast")) == [
        "ap-southeast",
        "eu-west",
        "us-east",
    ]


def test_load_equal_to_threshold_spills() -> None:
    table = make_table(regions=[region(US, spill_threshold=0.8), region(EU), region(AP)])
    routes = spilled(table, "us-east", {"o-us": 80})
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "eu-west",
        "ap-southeast",
        "us-east",
    ]


def test_load_below_threshold_does_not_spill() -> None:
    table = make_table(regions=[region(US, spill_threshold=0.8), region(EU), region(AP)])
    routes = spilled(table, "us-east", {"o-us": 79})
    assert regions_of(routes.candidates(MODEL, "us-east"))[0] == "us-east"


def test_zero_threshold_never_spills() -> None:
    table = make_table(regions=[region(US), region(EU), region(AP)])
    routes = spilled(table, "us-east", {"o-us": 500})
    assert regions_of(routes.candidates(MODEL, "us-east"))[0] == "us-east"


def test_several_hot_regions_keep_their_distance_order_at_the_end() -> None:
    table = make_table(
        regions=[
            region(US, spill_threshold=0.8),
            region(EU, spill_threshold=0.9),
            region(AP),
        ]
    )
    routes = spilled(table, "eu-west", {"o-us": 100, "o-eu": 95})
    assert regions_of(routes.candidates(MODEL, "eu-west")) == [
        "ap-southeast",
        "eu-west",
        "us-east",
    ]
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "ap-southeast",
        "us-east",
        "eu-west",
    ]


def test_all_hot_is_plain_distance_order() -> None:
    table = make_table(regions=[region(spec, spill_threshold=0.8) for spec in (US, EU, AP)])
    routes = spilled(table, "eu-west", {"o-us": 90, "o-eu": 90, "o-ap": 90})
    assert regions_of(routes.candidates(MODEL, "ap-southeast")) == [
        "ap-southeast",
        "eu-west",
        "us-east",
    ]


def test_a_compiled_table_spills_by_the_loads_pushed_apart_from_it() -> None:
    """What the control plane compiles (compile_table: capacity, health,
    threshold) and the loads it pushes apart from tables drive the order;
    the table is the same whatever the load (no table per move of load)."""
    regions = tuple(ModelRegion(n, lat, lon) for n, lat, lon in (US, EU, AP))
    origins = tuple(
        Origin(f"o-{n}", f"http://o-{n}.example/v1", n, (MODEL,), capacity=10)
        for n, _, _ in (US, EU, AP)
    )
    busy = {"o-us-east": OriginHealth("o-us-east", healthy=True, inflight=9)}
    table = compile_table(State(5, regions, origins, busy))
    calm = {"o-us-east": OriginHealth("o-us-east", healthy=True, inflight=7)}
    assert compile_table(State(5, regions, origins, calm)) == table
    routes = build_routes(table, "us-east")
    assert regions_of(routes.spilled({"o-us-east": 9.0}.get).candidates(MODEL, "us-east")) == [
        "eu-west",
        "ap-southeast",
        "us-east",
    ]
    assert regions_of(routes.spilled({"o-us-east": 7.0}.get).candidates(MODEL, "us-east"))[0] == (
        "us-east"
    )


# ---------------------------------------------------------------- RTT


def rtt_table(us: dict[str, float], eu: dict[str, float], ap: dict[str, float]) -> pb.RouteTable:
    return make_table(regions=[region(US, rtt_ms=us), region(EU, rtt_ms=eu), region(AP, rtt_ms=ap)])


CONTRARY_RTT = {
    # From us-east, ap-southeast is (unrealistically) nearer than eu-west.
    "us": {"ap-southeast": 50.0, "eu-west": 300.0},
    "eu": {"us-east": 80.0, "ap-southeast": 160.0},
    "ap": {"us-east": 50.0, "eu-west": 400.0},
}


def test_rtt_order_wins_over_geography() -> None:
    routes = build_routes(
        rtt_table(CONTRARY_RTT["us"], CONTRARY_RTT["eu"], CONTRARY_RTT["ap"]), "eu-west"
    )
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "us-east",
        "ap-southeast",
        "eu-west",
    ]
    assert regions_of(routes.candidates(MODEL, "ap-southeast")) == [
        "ap-southeast",
        "us-east",
        "eu-west",
    ]
    assert regions_of(routes.candidates(MODEL, "eu-west")) == [
        "eu-west",
        "us-east",
        "ap-southeast",
    ]


def test_geography_wins_if_one_region_lacks_rtt() -> None:
    routes = build_routes(rtt_table(CONTRARY_RTT["us"], CONTRARY_RTT["eu"], {}), "eu-west")
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "us-east",
        "eu-west",
        "ap-southeast",
    ]
    assert regions_of(routes.candidates(MODEL, "ap-southeast")) == [
        "ap-southeast",
        "eu-west",
        "us-east",
    ]


def test_region_missing_from_an_rtt_row_goes_last() -> None:
    routes = build_routes(
        rtt_table({"eu-west": 300.0}, CONTRARY_RTT["eu"], CONTRARY_RTT["ap"]), "eu-west"
    )
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "us-east",
        "eu-west",
        "ap-southeast",
    ]


def test_spill_applies_on_top_of_rtt() -> None:
    table = make_table(
        regions=[
            region(US, rtt_ms=CONTRARY_RTT["us"]),
            region(EU, rtt_ms=CONTRARY_RTT["eu"]),
            region(AP, rtt_ms=CONTRARY_RTT["ap"], spill_threshold=0.8),
        ]
    )
    routes = spilled(table, "eu-west", {"o-ap": 90})
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "us-east",
        "eu-west",
        "ap-southeast",
    ]


# ---------------------------------------------------------------- limit


def test_limit_stops_after_the_group_that_reaches_it() -> None:
    routes = build_routes(make_table(), "eu-west")
    assert names(routes.candidates(MODEL, "us-east", limit=1)) == ["o-us"]
    assert names(routes.candidates(MODEL, "us-east", limit=2)) == ["o-us", "o-eu"]
    assert names(routes.candidates(MODEL, "us-east", limit=3)) == ["o-us", "o-eu", "o-ap"]
    assert names(routes.candidates(MODEL, "us-east", limit=10)) == ["o-us", "o-eu", "o-ap"]
    assert names(routes.candidates(MODEL, "us-east", limit=0)) == ["o-us", "o-eu", "o-ap"]


def test_limit_keeps_the_whole_group() -> None:
    table = make_table(
        origins=[
            origin("o-us-1", "us-east"),
            origin("o-us-2", "us-east"),
            origin("o-eu", "eu-west"),
        ]
    )
    routes = build_routes(table, "us-east")
    rng = random.Random(11)
    got = routes.candidates(MODEL, "us-east", limit=1, rand=rng.random)
    assert sorted(names(got)) == ["o-us-1", "o-us-2"]
    got = routes.candidates(MODEL, "us-east", limit=3, rand=rng.random)
    assert sorted(names(got[:2])) == ["o-us-1", "o-us-2"]
    assert names(got[2:]) == ["o-eu"]


def test_limit_with_unknown_model_is_empty() -> None:
    routes = build_routes(make_table(), "eu-west")
    assert routes.candidates("gpt-9", "us-east", limit=1) == []


# ---------------------------------------------------------------- proxy outside the table


def test_proxy_region_not_in_table_orders_by_name() -> None:
    routes = build_routes(make_table(), "sa-east")
    assert isinstance(routes, Routes)
    assert regions_of(routes.candidates(MODEL)) == ["ap-southeast", "eu-west", "us-east"]
    assert regions_of(routes.candidates(MODEL, limit=1)) == ["ap-southeast"]
    # Located clients still get their own home's order.
    home = routes.home_of(*NEW_YORK)
    assert regions_of(routes.candidates(MODEL, home)) == ["us-east", "eu-west", "ap-southeast"]
    assert routes.candidates("gpt-9") == []


def test_proxy_region_not_in_table_still_spills() -> None:
    table = make_table(regions=[region(US), region(EU), region(AP, spill_threshold=0.8)])
    routes = spilled(table, "sa-east", {"o-ap": 90})
    assert regions_of(routes.candidates(MODEL)) == ["eu-west", "us-east", "ap-southeast"]


def test_proxy_region_not_in_rtt_table() -> None:
    routes = build_routes(
        rtt_table(CONTRARY_RTT["us"], CONTRARY_RTT["eu"], CONTRARY_RTT["ap"]), "sa-east"
    )
    assert regions_of(routes.candidates(MODEL)) == ["ap-southeast", "eu-west", "us-east"]
    assert regions_of(routes.candidates(MODEL, "us-east")) == [
        "us-east",
        "ap-southeast",
        "eu-west",
    ]
