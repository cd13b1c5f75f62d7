"""dataplane.routes: table validation, region ordering, filtering and weighted choice."""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane.routes import Routes, TableError, Target, build_routes, great_circle_km, validate
from dataplane.sync.holder import TableHolder
from dataplane.upstream.responseids import IdKeys
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

US = ("us-east", 39.0, -77.0)
EU = ("eu-west", 53.0, -6.0)
AP = ("ap-south", 19.0, 73.0)


def region(spec: tuple[str, float, float], drained: bool = False) -> pb.Region:
    name, lat, lon = spec
    return pb.Region(name=name, latitude=lat, longitude=lon, drained=drained)


def origin(
    name: str,
    region_name: str,
    models: tuple[str, ...] = ("llama-3",),
    *,
    weight: int = 100,
    drained: bool = False,
    healthy: bool = True,
    url: str = "",
) -> pb.Origin:
    return pb.Origin(
        name=name,
        base_url=url or f"http://{name}.example/v1",
        region=region_name,
        models=models,
        weight=weight,
        drained=drained,
        healthy=healthy,
    )


def stamp(table: pb.RouteTable) -> pb.RouteTable:
    table.etag = content_etag(table)
    return table


def make_table(
    regions: list[pb.Region] | None = None,
    origins: list[pb.Origin] | None = None,
    version: int = 7,
) -> pb.RouteTable:
    if regions is None:
        regions = [region(US), region(EU), region(AP)]
    if origins is None:
        origins = [origin("o-us", "us-east"), origin("o-eu", "eu-west"), origin("o-ap", "ap-south")]
    return stamp(pb.RouteTable(version=version, regions=regions, origins=origins))


def names(targets: list[Target]) -> list[str]:
    return [t.name for t in targets]


# ---------------------------------------------------------------- validation


def test_valid_table_builds() -> None:
    routes = build_routes(make_table(), "us-east")
    assert routes.version == 7
    assert routes.etag == make_table().etag
    assert routes.region == "us-east"
    assert routes.models == ("llama-3",)


def broken(mutate: Callable[[pb.RouteTable], None], restamp: bool = True) -> pb.RouteTable:
    table = make_table()
    mutate(table)
    return stamp(table) if restamp else table


def _set_version_zero(t: pb.RouteTable) -> None:
    t.version = 0


def _dup_region(t: pb.RouteTable) -> None:
    t.regions.append(region(US))


def _empty_region_name(t: pb.RouteTable) -> None:
    t.regions.append(pb.Region(name="", latitude=1, longitude=1))


def _dup_origin(t: pb.RouteTable) -> None:
    t.origins.append(origin("o-us", "eu-west"))


def _empty_origin_name(t: pb.RouteTable) -> None:
    t.origins.append(origin("", "eu-west", url="http://x.example/v1"))


def _unknown_region(t: pb.RouteTable) -> None:
    t.origins.append(origin("o-mars", "mars"))


def _bad_scheme(t: pb.RouteTable) -> None:
    t.origins[0].base_url = "ftp://o-us.example/v1"


def _no_host(t: pb.RouteTable) -> None:
    t.origins[0].base_url = "http:///v1"


def _no_models(t: pb.RouteTable) -> None:
    del t.origins[0].models[:]


def _weight_zero(t: pb.RouteTable) -> None:
    t.origins[0].weight = 0


def _lat_high(t: pb.RouteTable) -> None:
    t.regions[0].latitude = 90.5


def _lat_low(t: pb.RouteTable) -> None:
    t.regions[0].latitude = -91


def _lon_out(t: pb.RouteTable) -> None:
    t.regions[0].longitude = 181


def _lat_nan(t: pb.RouteTable) -> None:
    t.regions[0].latitude = math.nan


def _short_id_key(t: pb.RouteTable) -> None:
    t.response_id_keys.extend([b"k" * 32, b"k" * 15])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_version_zero, "version"),
        (_dup_region, "region name"),
        (_empty_region_name, "region name"),
        (_dup_origin, "origin name"),
        (_empty_origin_name, "origin name"),
        (_unknown_region, "unknown region"),
        (_bad_scheme, "base URL"),
        (_no_host, "base URL"),
        (_no_models, "no model"),
        (_weight_zero, "weight"),
        (_lat_high, "out of range"),
        (_lat_low, "out of range"),
        (_lon_out, "out of range"),
        (_lat_nan, "out of range"),
        (_short_id_key, "response id key"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_invalid_tables_refused(mutate: Callable[[pb.RouteTable], None], message: str) -> None:
    table = broken(mutate)
    assert table.etag == content_etag(table)  # only the rule under test is broken
    with pytest.raises(TableError, match=message):
        validate(table)
    with pytest.raises(TableError, match=message):
        build_routes(table, "us-east")


def test_wrong_etag_refused() -> None:
    table = make_table()
    table.origins[0].weight = 5  # changed after stamping
    with pytest.raises(TableError, match="etag"):
        build_routes(table, "us-east")


def test_missing_etag_refused() -> None:
    table = make_table()
    table.etag = ""
    with pytest.raises(TableError, match="etag"):
        build_routes(table, "us-east")


def test_version_change_keeps_etag_valid() -> None:
    table = make_table()
    table.version = 99  # the etag covers content, not version
    assert build_routes(table, "us-east").version == 99


def test_empty_table_with_version_is_valid() -> None:
    routes = build_routes(stamp(pb.RouteTable(version=1)), "us-east")
    assert routes.models == ()
    assert routes.groups == {}
    assert routes.candidates("llama-3") == []


# ---------------------------------------------------------------- ordering


def region_order(routes: Routes, model: str = "llama-3") -> list[str]:
    return [group[0].region for group in routes.groups[model]]


@pytest.mark.parametrize(
    ("home", "expected"),
    [
        ("eu-west", ["eu-west", "us-east", "ap-south"]),
        ("ap-south", ["ap-south", "eu-west", "us-east"]),
        ("us-east", ["us-east", "eu-west", "ap-south"]),
    ],
)
def test_own_region_first_then_by_distance(home: str, expected: list[str]) -> None:
    routes = build_routes(make_table(), home)
    assert region_order(routes) == expected
    assert [t.region for t in routes.candidates("llama-3")] == expected


def test_region_order_independent_of_table_order() -> None:
    table = make_table(
        regions=[region(AP), region(US), region(EU)],
        origins=[origin("o-ap", "ap-south"), origin("o-eu", "eu-west"), origin("o-us", "us-east")],
    )
    assert region_order(build_routes(table, "eu-west")) == ["eu-west", "us-east", "ap-south"]


def test_regions_are_ranked_once_per_home_not_once_per_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every proxy builds the whole table at every change: with 120 models a
    distance worked out per model cost about a second a table (trial 83).
    Each home ranks each region once, and every model shares that order."""
    import dataplane.routes as routes_module  # noqa: PLC0415 - the name patched

    calls = Counter[tuple[float, float]]()

    def counted(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
        calls[(lat1, lat2)] += 1
        return great_circle_km(lat1, lon1, lat2, lon2)

    monkeypatch.setattr(routes_module, "great_circle_km", counted)
    models = tuple(f"m{i}" for i in range(40))
    table = make_table(
        origins=[origin(f"o-{r}", r, models) for r in ("us-east", "eu-west", "ap-south")]
    )
    routes = build_routes(table, "eu-west")
    assert calls and max(calls.values()) == 1  # 3 homes x 2 other regions, once each
    assert {tuple(region_order(routes, m)) for m in models} == {("eu-west", "us-east", "ap-south")}


def _old_region_order(
    table: pb.RouteTable, home_name: str, present: set[str], hot_regions: frozenset[str]
) -> list[str]:
    """The order build_routes gave a model's regions before its ranks were
    shared across models: each model sorted by (hot, cost from home, name),
    worked out for that model."""
    regions = {r.name: r for r in table.regions}
    use_rtt = bool(regions) and all(r.rtt_ms for r in table.regions)
    home = regions.get(home_name)

    def key(name: str) -> tuple[bool, float, str]:
        r = regions[name]
        hot = name in hot_regions
        if home is None:
            return (hot, 0.0, name)
        if name == home.name:
            return (hot, -1.0, name)
        if use_rtt:
            return (hot, home.rtt_ms.get(name, math.inf), name)
        return (hot, great_circle_km(home.latitude, home.longitude, r.latitude, r.longitude), name)

    return sorted(present, key=key)


@st.composite
def topologies(draw: st.DrawFn) -> tuple[pb.RouteTable, str, frozenset[str]]:
    """A table of random regions (coordinates or a whole or partial RTT
    matrix, some drained) and origins serving random models, a proxy region
    in it or not, and the regions hot."""
    count = draw(st.integers(1, 7))
    names_ = [f"r{i}" for i in range(count)]
    coordinate = st.floats(-89.0, 89.0, allow_nan=False)
    rtt = draw(st.sampled_from(["none", "all", "some"]))
    regions = []
    for name in names_:
        r = pb.Region(
            name=name,
            latitude=draw(coordinate),
            longitude=draw(st.floats(-179.0, 179.0, allow_nan=False)),
            drained=draw(st.booleans()) and draw(st.booleans()),
        )
        if rtt == "all" or (rtt == "some" and draw(st.booleans())):
            for other in names_:
                if other != name and draw(st.integers(0, 4)):
                    r.rtt_ms[other] = draw(st.sampled_from([5.0, 40.0, 40.0, 150.0]))
            if not r.rtt_ms:
                r.rtt_ms[name] = 0.0  # every region has a matrix: use_rtt holds
        regions.append(r)
    models = ("a", "b", "c", "d")
    origins = [
        origin(
            f"o{i}",
            draw(st.sampled_from(names_)),
            tuple(draw(st.sets(st.sampled_from(models), min_size=1))),
            drained=draw(st.integers(0, 5)) == 0,
            healthy=draw(st.integers(0, 4)) != 0,
        )
        for i in range(draw(st.integers(1, 10)))
    ]
    proxy = draw(st.sampled_from([*names_, "elsewhere"]))
    hot = frozenset(draw(st.sets(st.sampled_from(names_))))
    return make_table(regions=regions, origins=origins), proxy, hot


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies())
def test_shared_ranks_order_every_model_as_ranking_it_alone_did(
    topology: tuple[pb.RouteTable, str, frozenset[str]],
) -> None:
    """Ranking each region once per home (trial 83's speed-up) leaves every
    home's order of every model's regions what sorting them per model gave,
    for any set of hot regions (the orders Routes.spilled serves)."""
    table, proxy, hot = topology
    routes = build_routes(table, proxy)
    assert routes._regions is not None
    order = routes._regions.order(hot)
    homes = [r.name for r in table.regions] + ([] if proxy in routes.known else [proxy])
    assert set(order) == set(homes)
    for home in homes:
        for model, groups in order[home].items():
            got = [group[0].region for group in groups]
            assert len(set(got)) == len(got)
            assert got == _old_region_order(table, home, set(got), hot), (home, model)


def test_unknown_proxy_region_orders_by_name() -> None:
    routes = build_routes(make_table(), "sa-east")
    assert region_order(routes) == ["ap-south", "eu-west", "us-east"]


def test_own_region_first_even_if_another_is_closer() -> None:
    # Two regions at the same coordinates: the proxy's own one still leads.
    twin = ("eu-twin", 53.0, -6.0)
    table = make_table(
        regions=[region(twin), region(EU)],
        origins=[origin("a", "eu-twin"), origin("b", "eu-west")],
    )
    assert region_order(build_routes(table, "eu-west")) == ["eu-west", "eu-twin"]
    assert region_order(build_routes(table, "eu-twin")) == ["eu-twin", "eu-west"]


def test_great_circle_london_new_york() -> None:
    km = great_circle_km(51.5074, -0.1278, 40.7128, -74.0060)
    assert abs(km - 5570) <= 50


def test_great_circle_properties() -> None:
    assert great_circle_km(10, 20, 10, 20) == 0
    assert great_circle_km(*US[1:], *EU[1:]) == pytest.approx(great_circle_km(*EU[1:], *US[1:]))
    # Antipodes: half the circumference.
    assert great_circle_km(0, 0, 0, 180) == pytest.approx(math.pi * 6371.0, rel=1e-9)
    assert great_circle_km(90, 0, -90, 0) == pytest.approx(math.pi * 6371.0, rel=1e-9)
    # Across the antimeridian is short.
    assert great_circle_km(0, 179.5, 0, -179.5) < 120


# ---------------------------------------------------------------- filtering


def test_drained_region_excluded() -> None:
    table = make_table(regions=[region(US), region(EU, drained=True), region(AP)])
    routes = build_routes(table, "eu-west")
    assert region_order(routes) == ["us-east", "ap-south"]
    assert "o-eu" not in names(routes.candidates("llama-3"))


def test_drained_origin_excluded() -> None:
    table = make_table(
        origins=[
            origin("o-us", "us-east"),
            origin("o-us-2", "us-east", drained=True),
            origin("o-eu", "eu-west"),
        ]
    )
    routes = build_routes(table, "us-east")
    assert names(routes.candidates("llama-3")) == ["o-us", "o-eu"]


def test_unhealthy_origin_excluded() -> None:
    table = make_table(
        origins=[origin("o-us", "us-east", healthy=False), origin("o-eu", "eu-west")]
    )
    routes = build_routes(table, "us-east")
    assert names(routes.candidates("llama-3")) == ["o-eu"]


def test_unknown_model() -> None:
    routes = build_routes(make_table(), "us-east")
    assert routes.candidates("gpt-9") == []
    assert "gpt-9" not in routes.groups
    assert "gpt-9" not in routes.models


def test_model_with_only_drained_origins_is_known_but_empty() -> None:
    table = make_table(
        origins=[
            origin("o-us", "us-east"),
            origin("o-qwen", "eu-west", ("qwen",), drained=True),
            origin("o-qwen-2", "ap-south", ("qwen",), healthy=False, drained=True),
        ]
    )
    routes = build_routes(table, "us-east")
    assert "qwen" in routes.groups
    assert routes.groups["qwen"] == ()
    assert "qwen" in routes.models
    assert routes.candidates("qwen") == []
    assert routes.panic == frozenset()


def test_model_with_no_healthy_origin_panics_to_its_unhealthy_ones() -> None:
    table = make_table(
        regions=[region(US), region(EU), region(AP, drained=True)],
        origins=[
            origin("o-us", "us-east"),
            origin("o-qwen-eu", "eu-west", ("qwen",), healthy=False),
            origin("o-qwen-us", "us-east", ("qwen",), healthy=False),
            origin("o-qwen-drained", "us-east", ("qwen",), healthy=False, drained=True),
            origin("o-qwen-ap", "ap-south", ("qwen",), healthy=False),
        ],
    )
    routes = build_routes(table, "us-east")
    # Nearest first as usual; drained origins and drained regions still left out.
    assert names(routes.candidates("qwen")) == ["o-qwen-us", "o-qwen-eu"]
    assert routes.panic == frozenset({"qwen"})
    assert names(routes.candidates("llama-3")) == ["o-us"]


def test_panic_is_logged_when_it_begins_and_ends_not_with_every_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    holder = TableHolder("us-east", None)
    sick = [origin("o-us", "us-east"), origin("o-qwen", "eu-west", ("qwen",), healthy=False)]
    tables = [
        make_table(origins=[origin("o-us", "us-east"), origin("o-qwen", "eu-west", ("qwen",))]),
        make_table(origins=sick, version=8),
        make_table(origins=[*sick, origin("o-new", "us-east", ("mistral",))], version=9),
        make_table(origins=[*sick[:1], origin("o-qwen", "eu-west", ("qwen",))], version=10),
    ]
    lines = []
    for table in tables:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dataplane.sync.holder"):
            holder.apply(table, "control-plane")
        lines.append([r.getMessage() for r in caplog.records if "qwen" in r.getMessage()])
    assert lines[0] == []
    assert lines[1] == [
        "no healthy origin for qwen: routing to the unhealthy ones that are not drained"
    ]
    assert lines[2] == []  # another change: still in panic, not said again
    assert lines[3] == ["healthy origins again for qwen"]


def test_one_healthy_origin_anywhere_means_no_panic() -> None:
    table = make_table(
        origins=[
            origin("o-us", "us-east", healthy=False),
            origin("o-eu", "eu-west"),
        ]
    )
    routes = build_routes(table, "us-east")
    assert names(routes.candidates("llama-3")) == ["o-eu"]
    assert routes.panic == frozenset()


def test_model_in_drained_region_only_is_known_but_empty() -> None:
    table = make_table(
        regions=[region(US), region(EU, drained=True)],
        origins=[origin("o-us", "us-east"), origin("o-eu", "eu-west", ("qwen",))],
    )
    routes = build_routes(table, "us-east")
    assert routes.groups["qwen"] == ()


def test_models_per_origin() -> None:
    table = make_table(
        origins=[
            origin("o-us", "us-east", ("llama-3", "qwen")),
            origin("o-eu", "eu-west", ("llama-3",)),
        ]
    )
    routes = build_routes(table, "eu-west")
    assert routes.models == ("llama-3", "qwen")
    assert names(routes.candidates("llama-3")) == ["o-eu", "o-us"]
    assert names(routes.candidates("qwen")) == ["o-us"]


def test_trailing_slash_stripped_from_target_url() -> None:
    table = make_table(origins=[origin("o-us", "us-east", url="http://o.example/v1/")])
    (target,) = build_routes(table, "us-east").candidates("llama-3")
    assert target.base_url == "http://o.example/v1"
    assert target.weight == 100


def test_origin_listing_a_model_twice_is_a_candidate_once() -> None:
    """validate() accepts repeated models; the origin must not be tried twice."""
    table = make_table(origins=[origin("o-us", "us-east", ("llama-3", "llama-3"))])
    try:
        routes = build_routes(table, "us-east")
    except TableError:
        return  # refusing the table is an acceptable answer too
    assert names(routes.candidates("llama-3")) == ["o-us"]


# ---------------------------------------------------------------- weights


def test_weighted_lead_share() -> None:
    table = make_table(
        origins=[
            origin("heavy", "us-east", weight=300),
            origin("light", "us-east", weight=100),
            origin("far", "eu-west", weight=1000),
        ]
    )
    routes = build_routes(table, "us-east")
    rng = random.Random(20240601)
    leads: Counter[str] = Counter()
    draws = 4000
    for _ in range(draws):
        order = routes.candidates("llama-3", rand=rng.random)
        assert sorted(t.name for t in order[:2]) == ["heavy", "light"]
        assert order[2].name == "far"  # a farther region never jumps ahead
        leads[order[0].name] += 1
    share = leads["heavy"] / draws
    assert 0.70 <= share <= 0.80, share


def test_equal_weights_split_evenly() -> None:
    table = make_table(origins=[origin("a", "us-east", weight=5), origin("b", "us-east", weight=5)])
    routes = build_routes(table, "us-east")
    rng = random.Random(7)
    share = (
        sum(routes.candidates("llama-3", rand=rng.random)[0].name == "a" for _ in range(4000))
        / 4000
    )
    assert 0.45 <= share <= 0.55, share


# ---------------------------------------------------------------- property

REGION_NAMES = ("r-a", "r-b", "r-c", "r-d")
MODELS = ("m1", "m2", "m3")


@st.composite
def tables(draw: st.DrawFn) -> pb.RouteTable:
    region_names = draw(st.lists(st.sampled_from(REGION_NAMES), min_size=1, unique=True))
    regions = [
        pb.Region(
            name=name,
            latitude=draw(st.floats(-90, 90)),
            longitude=draw(st.floats(-180, 180)),
            drained=draw(st.booleans()),
        )
        for name in region_names
    ]
    count = draw(st.integers(0, 8))
    origins = [
        origin(
            f"o{i}",
            draw(st.sampled_from(region_names)),
            tuple(draw(st.lists(st.sampled_from(MODELS), min_size=1, unique=True))),
            weight=draw(st.integers(1, 1000)),
            drained=draw(st.booleans()),
            healthy=draw(st.booleans()),
        )
        for i in range(count)
    ]
    return stamp(
        pb.RouteTable(version=draw(st.integers(1, 2**40)), regions=regions, origins=origins)
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    table=tables(),
    home=st.sampled_from((*REGION_NAMES, "elsewhere")),
    seed=st.integers(0, 2**32 - 1),
)
def test_candidates_contain_each_eligible_origin_once(
    table: pb.RouteTable, home: str, seed: int
) -> None:
    routes = build_routes(table, home)
    drained_regions = {r.name for r in table.regions if r.drained}
    rng = random.Random(seed)
    for model in (*MODELS, "unknown"):
        usable = [
            o
            for o in table.origins
            if model in o.models and not o.drained and o.region not in drained_regions
        ]
        # Healthy ones; all usable ones when none is (panic routing).
        eligible = sorted(o.name for o in usable if o.healthy) or sorted(o.name for o in usable)
        assert (model in routes.panic) == (bool(usable) and not any(o.healthy for o in usable))
        targets = routes.candidates(model, rand=rng.random)
        got = names(targets)
        assert sorted(got) == eligible
        assert len(got) == len(set(got))
        # Each region forms one contiguous block; the proxy's own region leads.
        seq = [t.region for t in targets]
        blocks = [r for i, r in enumerate(seq) if i == 0 or r != seq[i - 1]]
        assert len(blocks) == len(set(blocks))
        if home in blocks:
            assert blocks[0] == home
        served = any(model in o.models for o in table.origins)
        assert (model in routes.groups) == served


def test_the_response_id_keys_come_with_the_table() -> None:
    assert build_routes(make_table(), "us-east").id_keys is None  # an older control plane's
    table = make_table()
    table.response_id_keys.extend([b"n" * 32, b"o" * 32])
    table.etag = content_etag(table)
    keys = build_routes(table, "us-east").id_keys
    assert keys is not None
    made = keys.encode("resp_1", "0" * 16, "acme")
    assert IdKeys([b"n" * 32]).verified(made, "acme") is not None  # the first signs
    assert keys.verified(IdKeys([b"o" * 32]).encode("resp_1", "0" * 16, "acme"), "acme")
