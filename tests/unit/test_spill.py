"""Spilling between regions by the origins' loads pushed apart from tables.

The control plane's table says which origins count (capacity, health,
drains, whether their load figures are read) and each region's threshold;
the loads come as OriginLoads, about twice a second (dataplane.placement.
load). The rules are those the table's Region.load followed when the
control plane compiled it (ponto.routetable.region_load); each test of that
computation here is one that compile_table's load had, run through
compile_table, build_routes and Routes.spilled instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from controlplane.compile import DEFAULT_SPILL_THRESHOLD, compile_table
from controlplane.model import Origin, OriginHealth, Region, State
from dataplane.placement.load import LoadBoard
from dataplane.routes import ORDERS_KEPT, Routes, build_routes
from dataplane.sync.holder import TableHolder
from ponto.routetable import counts_for_spill, is_hot, region_load
from ponto.v1 import routing_pb2 as pb

EU = Region("eu-west", 53.0, -6.0)
US = Region("us-east", 39.0, -77.0)
MODEL = "llama-3"


def origin(name: str, region: str = "eu-west", capacity: int = 10) -> Origin:
    return Origin(name, f"http://{name}.example/v1", region, (MODEL,), capacity=capacity)


def load_of(state: State, loads: Mapping[str, float], region: str = "eu-west") -> float | None:
    """The load the proxies reckon for `region` from the table compiled of
    `state` and the pushed `loads` (origin -> running and waiting)."""
    table = compile_table(state)
    return region_load(
        (o.capacity, loads.get(o.name))
        for o in table.origins
        if o.region == region and counts_for_spill(o)
    )


def hot(state: State, loads: Mapping[str, float]) -> frozenset[str]:
    return build_routes(compile_table(state), "eu-west").spilled(loads.get).hot


# ---------------------------------------------------------------- the rules


def test_region_load_is_requests_over_capacity() -> None:
    state = State(3, (EU, US), (origin("a"), origin("b", "us-east")))
    assert load_of(state, {"a": 9}) == pytest.approx(0.9)
    assert hot(state, {"a": 9}) == {"eu-west"}
    assert hot(state, {"a": 7.9}) == frozenset()
    assert DEFAULT_SPILL_THRESHOLD == 0.8
    assert compile_table(state).regions[0].spill_threshold == pytest.approx(0.8)


def test_region_load_sums_over_origins() -> None:
    state = State(3, (EU, US), (origin("a"), origin("b", capacity=30), origin("c", "us-east")))
    loads = {"a": 9, "b": 3, "c": 2}
    assert load_of(state, loads) == pytest.approx(12 / 40)
    assert load_of(state, loads, "us-east") == pytest.approx(0.2)


def test_a_replica_counts_for_its_capacity_at_most() -> None:
    """Trial 33: one replica of four with a queue (16 in flight, capacity 4)
    made the region's load 1.0 while three replicas were idle, and every
    session spilled abroad, losing its KV cache."""
    state = State(3, (EU, US), tuple(origin(n, capacity=4) for n in "abcd"))
    idle = {"a": 0, "b": 0, "c": 0}
    assert load_of(state, {**idle, "d": 16}) == pytest.approx(0.25)
    assert hot(state, {**idle, "d": 16}) == frozenset()
    # Every replica past its capacity: the region is full.
    full = dict.fromkeys("abcd", 16.0)
    assert load_of(state, full) == pytest.approx(1.0)
    assert hot(state, full) == {"eu-west"}


def test_an_origin_whose_load_is_not_read_counts_for_neither() -> None:
    """Trial 66: a replica whose metrics page gave no load figures counted as
    idle, holding its region back from spilling however busy it was. Its
    table says so (inflight_unknown), or the loads pushed lack it (a scrape
    that failed, figures expired): its peers' load stands for the region's."""
    state = State(
        3,
        (EU, US),
        (origin("a", capacity=4), origin("b", capacity=4)),
        {
            "a": OriginHealth("a", True, server_kind="vllm"),
            "b": OriginHealth("b", True, server_kind="unknown", inflight_unknown=True),
        },
    )
    assert load_of(state, {"a": 4, "b": 0}) == pytest.approx(1.0)  # a's 4 of its 4
    assert hot(state, {"a": 4, "b": 0}) == {"eu-west"}
    measured = State(3, (EU, US), (origin("a", capacity=4), origin("b", capacity=4)))
    assert load_of(measured, {"a": 4}) == pytest.approx(1.0)  # b not in the push
    assert load_of(measured, {"a": 4, "b": 0}) == pytest.approx(0.5)
    assert load_of(measured, {}) is None  # nothing pushed: nothing says full
    assert hot(measured, {}) == frozenset()


def test_a_drained_replica_is_not_the_regions_capacity() -> None:
    state = State(3, (EU, US), (replace(origin("a"), drained=True), origin("b")))
    # b's 9 of its 10: a's requests are ending, and it takes no new ones.
    assert load_of(state, {"a": 1, "b": 9}) == pytest.approx(0.9)


def test_unhealthy_origins_are_excluded_from_load() -> None:
    state = State(
        3,
        (EU, US),
        (origin("a"), origin("b")),
        {"a": OriginHealth("a", healthy=False, detail="probe answered 503")},
    )
    assert load_of(state, {"a": 9, "b": 2}) == pytest.approx(0.2)  # neither a's load nor capacity


def test_no_capacity_means_no_load() -> None:
    state = State(3, (EU, US), (origin("a", capacity=0),))
    assert load_of(state, {"a": 50}) is None
    assert hot(state, {"a": 50}) == frozenset()


def test_all_unhealthy_means_no_load() -> None:
    state = State(3, (EU, US), (origin("a"),), {"a": OriginHealth("a", False, detail="down")})
    assert load_of(state, {"a": 9}) is None


def test_an_explicit_spill_threshold_is_the_regions() -> None:
    custom = Region("eu-west", 53.0, -6.0, spill_threshold=0.5)
    state = State(3, (custom, US), (origin("a"),))
    assert compile_table(state).regions[0].spill_threshold == pytest.approx(0.5)
    assert hot(state, {"a": 5}) == {"eu-west"}
    assert hot(state, {"a": 4.9}) == frozenset()


def test_a_load_equal_to_the_threshold_spills_and_a_zero_threshold_never_does() -> None:
    assert is_hot(0.8, 0.8) and not is_hot(0.79, 0.8)
    assert not is_hot(5.0, 0.0)  # a table's threshold 0: never
    assert not is_hot(None, 0.8)


# ---------------------------------------------------------------- the proxy


def two_regions(version: int = 3) -> pb.RouteTable:
    """eu-west and us-east, one origin each of capacity 10."""
    return compile_table(State(version, (EU, US), (origin("o-eu"), origin("o-us", "us-east"))))


def pushed(generation: int, **loads: float) -> pb.OriginLoads:
    return pb.OriginLoads(
        generation=generation,
        loads=[pb.OriginLoad(origin=o.replace("_", "-"), running=n) for o, n in loads.items()],
    )


def proxy() -> tuple[TableHolder, LoadBoard, list[int]]:
    """A proxy's table holder spilling by its LoadBoard, as dataplane.http.
    server wires them; and the versions its on_apply hooks saw."""
    board = LoadBoard(clock=lambda: 0.0)
    holder = TableHolder("eu-west", None, scraped=board.scraped_load)
    board.on_change.append(holder.loads_changed)
    applied: list[int] = []
    holder.on_apply.append(lambda routes, _policy: applied.append(routes.version))
    return holder, board, applied


def regions(routes: Routes | None, home: str = "eu-west") -> list[str]:
    assert routes is not None
    return [t.region for t in routes.candidates(MODEL, home)]


def test_a_pushed_load_past_the_threshold_spills_and_one_under_it_takes_it_back() -> None:
    holder, board, applied = proxy()
    holder.apply(two_regions(), "control-plane")
    first = holder.routes
    assert regions(first) == ["eu-west", "us-east"]
    board.apply(pushed(1, o_eu=8))  # 8 of 10: past 0.8
    spilled = holder.routes
    assert spilled is not None and spilled.hot == {"eu-west"}
    assert regions(spilled) == ["us-east", "eu-west"]
    assert regions(spilled, "us-east") == ["us-east", "eu-west"]
    board.apply(pushed(2, o_eu=7))
    assert holder.routes is not None and holder.routes.hot == frozenset()
    assert regions(holder.routes) == ["eu-west", "us-east"]
    # The same table throughout: nothing rebuilt, no hook run again.
    assert applied == [3] and holder.routes.version == 3
    assert holder.routes.stored_on is first.stored_on  # type: ignore[union-attr]


def test_expired_loads_take_the_spill_back() -> None:
    holder, board, _ = proxy()
    holder.apply(two_regions(), "control-plane")
    board.apply(pushed(1, o_eu=10))
    assert regions(holder.routes) == ["us-east", "eu-west"]
    board.expire()  # no push for STALE_AFTER_S: no leader scraping
    assert regions(holder.routes) == ["eu-west", "us-east"]


def test_loads_that_keep_the_hot_regions_keep_the_routes() -> None:
    """The request path reads one prebuilt structure: a push that makes the
    same regions hot swaps nothing, and each set's orders are made once."""
    holder, board, _ = proxy()
    holder.apply(two_regions(), "control-plane")
    calm = holder.routes
    board.apply(pushed(1, o_eu=1))
    assert holder.routes is calm
    board.apply(pushed(2, o_eu=9))
    hot_routes = holder.routes
    board.apply(pushed(3, o_eu=10))
    assert holder.routes is hot_routes
    board.apply(pushed(4, o_eu=0))
    assert holder.routes is not None and calm is not None
    assert holder.routes.order is calm.order  # made once per set of hot regions
    board.apply(pushed(5, o_eu=9))
    assert hot_routes is not None and holder.routes.order is hot_routes.order


def test_a_new_table_spills_by_the_loads_held() -> None:
    holder, board, _ = proxy()
    board.apply(pushed(1, o_us=9))
    holder.apply(two_regions(), "control-plane")
    assert regions(holder.routes, "us-east") == ["eu-west", "us-east"]
    holder.apply(two_regions(4), "control-plane")  # same content, newer version
    assert holder.routes is not None and holder.routes.version == 4
    assert regions(holder.routes, "us-east") == ["eu-west", "us-east"]


def test_the_orders_kept_are_bounded() -> None:
    routes = build_routes(two_regions(), "eu-west")
    plan = routes._regions
    assert plan is not None
    for n in range(ORDERS_KEPT + 5):
        plan.order(frozenset({f"r{n}"}))
    assert len(plan.orders) <= ORDERS_KEPT
