"""controlplane.loadsync: the leader's scrape rounds and every replica's LoadHub,
over MemoryStore with scripted metrics pages and an injected clock. The same
with a real etcd, origin and stream is tests/integration/test_load_push.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import orjson
import pytest

from controlplane.catalog import LEADER_KEY
from controlplane.compile import compile_table
from controlplane.distribute import Publisher
from controlplane.health import ProbeSettings
from controlplane.load import UNKNOWN, Figures, encode_loads
from controlplane.loadsync import (
    LOAD_KEY,
    UNREAD_LOG_QUIET,
    LoadHub,
    LoadScraper,
    Unread,
    stale_after,
    targets,
)
from controlplane.metrics import ControlMetrics
from controlplane.model import Origin, OriginHealth, Region, State
from controlplane.settings import parse
from controlplane.store import Conflict, Fence
from controlplane.store.memory import MemoryStore
from ponto.v1 import routing_pb2 as pb
from tests.latestores import NotServingYet

WAIT = 5.0
MODELS = ("m",)
SETTINGS = ProbeSettings(load_interval=0.001, load_refresh=2.0)


def page(running: float, waiting: float = 0.0, kv: float = 0.5) -> str:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    )


def table(unhealthy: tuple[str, ...] = ("c",)) -> pb.RouteTable:
    """Origins a..e: a and b scrapeable, c unhealthy, d drained, e in a drained region."""
    return compile_table(
        State(
            7,
            regions=(Region("east", 40.0, -74.0), Region("west", 37.0, -122.0, drained=True)),
            origins=(
                Origin("a", "http://a.test:8000/v1", "east", MODELS),
                Origin("b", "http://b.test:8000/v1", "east", MODELS),
                Origin("c", "http://c.test:8000/v1", "east", MODELS),
                Origin("d", "http://d.test:8000/v1", "east", MODELS, drained=True),
                Origin("e", "http://e.test:8000/v1", "west", MODELS),
            ),
            health={
                o: OriginHealth(o, healthy=False, detail="probe answered 503") for o in unhealthy
            },
        )
    )


class Pages:
    """A scripted fetch: url -> page text, None for a failed scrape."""

    def __init__(self) -> None:
        self.by_origin: dict[str, str | None] = {}
        self.asked: list[str] = []

    async def __call__(self, url: str) -> str | Unread:
        self.asked.append(url)
        page = self.by_origin.get(url.split("//")[1].split(".", maxsplit=1)[0])
        return Unread("HTTP 500") if page is None else page


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class Leader:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.publisher = Publisher("cp-a")
        self.publisher.publish(table())
        self.clock = Clock()
        self.pages = Pages()
        self.fence: Fence | None = None
        self.scraper = LoadScraper(
            self.store, self.publisher, SETTINGS, fence=lambda: self.fence, clock=self.clock
        )

    async def lead(self) -> None:
        revision = await self.store.put(LEADER_KEY, b"cp-a")
        self.fence = Fence(LEADER_KEY, revision)

    async def written(self) -> tuple[dict[str, Any], int]:
        kv = await self.store.get(LOAD_KEY)
        assert kv is not None
        body: dict[str, Any] = orjson.loads(kv.value)
        return body, kv.mod_revision


def test_targets_are_healthy_undrained_origins_at_their_root() -> None:
    assert targets(table()) == [("a", "http://a.test:8000"), ("b", "http://b.test:8000")]


async def test_round_writes_the_scraped_origins_and_the_scrape_time() -> None:
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {"a": page(3, 1, kv=0.25), "b": page(0), "c": page(9)}
    await leader.scraper.round(leader.pages)
    assert sorted(leader.pages.asked) == [
        "http://a.test:8000/metrics",
        "http://b.test:8000/metrics",
    ]
    body, _ = await leader.written()
    assert body == {
        "scraped_at": leader.clock.now,
        "origins": {"a": [3.0, 1.0, 0.25, UNKNOWN], "b": [0.0, 0.0, 0.5, UNKNOWN]},
    }


async def test_the_live_loads_of_servers_other_than_vllm_are_pushed_too() -> None:
    """Trial 66: a llama.cpp origin's 3 processing and 5 deferred read as no
    load at all; so would SGLang's and TGI's."""
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {
        "a": "llamacpp:requests_processing 3\nllamacpp:requests_deferred 5\n",
        "b": 'sglang:num_running_reqs{model_name="m"} 2.0\n'
        'sglang:num_queue_reqs{model_name="m"} 1.0\n'
        'sglang:token_usage{model_name="m"} 0.3\n',
    }
    await leader.scraper.round(leader.pages)
    body, _ = await leader.written()
    assert body["origins"] == {"a": [3.0, 5.0, UNKNOWN, UNKNOWN], "b": [2.0, 1.0, 0.3, UNKNOWN]}


async def test_failed_scrapes_and_pages_without_gauges_are_left_out() -> None:
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {"a": None, "b": "process_open_fds 12\n"}
    await leader.scraper.round(leader.pages)
    body, _ = await leader.written()
    assert body["origins"] == {}
    leader.pages.by_origin = {"a": page(2), "b": None}
    await leader.scraper.round(leader.pages)
    body, _ = await leader.written()
    assert list(body["origins"]) == ["a"]


async def test_each_origins_figures_age_from_its_last_good_page_and_only_while_read() -> None:
    """An origin whose metrics page stops answering is routed by the proxies'
    own counts alone; its age says so (ponto_control_origin_load_age_seconds,
    the PontoOriginLoadsStale alert). Origins not read (unhealthy, drained)
    and those not read yet this term have none."""
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {"a": page(1), "b": "process_open_fds 12\n"}
    await leader.scraper.round(leader.pages)
    assert leader.scraper.ages() == {"a": 0.0}
    leader.clock.now += 90
    leader.pages.by_origin = {"a": None, "b": page(2)}
    await leader.scraper.round(leader.pages)
    leader.clock.now += 5
    assert leader.scraper.ages() == {"a": 95.0, "b": 5.0}
    # "a" turns unhealthy: no longer read, so no age (PontoOriginDown's).
    state = table(unhealthy=("a", "c"))
    leader.publisher.publish(state)
    await leader.scraper.round(leader.pages)
    assert set(leader.scraper.ages()) == {"b"}
    metrics = ControlMetrics()
    leading = [True]
    metrics.bind(
        table=lambda: state,
        acked_versions=tuple,
        is_leader=lambda: leading[0],
        load_ages=leader.scraper.ages,
    )
    labels = {"origin": "b", "region": "east"}
    read = metrics.registry.get_sample_value
    assert read("ponto_control_origin_load_age_seconds", labels) == 0.0
    leading[0] = False  # a replica that lost the lead says nothing of loads
    assert read("ponto_control_origin_load_age_seconds", labels) is None


async def test_unchanged_figures_are_written_again_only_after_the_refresh_period() -> None:
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {"a": page(3, kv=0.401), "b": page(1)}
    await leader.scraper.round(leader.pages)
    _, first = await leader.written()

    # Same rounded figures, 1.9 s on: nothing written.
    leader.clock.now += 1.9
    leader.pages.by_origin["a"] = page(3, kv=0.403)
    await leader.scraper.round(leader.pages)
    body, again = await leader.written()
    assert again == first and leader.scraper.writes == 1
    assert body["scraped_at"] == leader.clock.now - 1.9

    # At the refresh period the same figures are written with a new time.
    leader.clock.now += 0.1
    await leader.scraper.round(leader.pages)
    body, refreshed = await leader.written()
    assert refreshed > first
    assert body["scraped_at"] == leader.clock.now

    # A change is written at once.
    leader.clock.now += 0.5
    leader.pages.by_origin["b"] = page(2)
    await leader.scraper.round(leader.pages)
    body, changed = await leader.written()
    assert changed > refreshed
    assert body["origins"]["b"][0] == 2.0
    assert leader.scraper.rounds == 4 and leader.scraper.writes == 3


async def test_prefix_hit_rate_is_computed_between_rounds() -> None:
    leader = Leader()
    await leader.lead()

    def counters(hits: int, queries: int) -> str:
        return (
            page(1)
            + f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
            + f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries}\n'
        )

    leader.pages.by_origin = {"a": counters(100, 400)}
    await leader.scraper.round(leader.pages)
    body, _ = await leader.written()
    assert body["origins"]["a"][3] == UNKNOWN  # no previous scrape
    leader.pages.by_origin = {"a": None}  # a failed round keeps the previous sample
    await leader.scraper.round(leader.pages)
    leader.pages.by_origin = {"a": counters(400, 800)}
    await leader.scraper.round(leader.pages)
    body, _ = await leader.written()
    assert body["origins"]["a"][3] == 0.75


async def test_round_without_a_table_does_nothing() -> None:
    leader = Leader()
    leader.scraper = LoadScraper(leader.store, Publisher("cp-a"), SETTINGS, clock=leader.clock)
    await leader.scraper.round(leader.pages)
    assert leader.pages.asked == []
    assert await leader.store.get(LOAD_KEY) is None


async def test_a_replica_that_lost_leadership_cannot_write() -> None:
    leader = Leader()
    await leader.lead()
    leader.pages.by_origin = {"a": page(1)}
    await leader.scraper.round(leader.pages)
    _, before = await leader.written()
    await leader.store.delete(LEADER_KEY)
    await leader.store.put(LEADER_KEY, b"cp-b")
    leader.pages.by_origin = {"a": page(2)}
    with pytest.raises(Conflict):
        await leader.scraper.round(leader.pages)
    _, after = await leader.written()
    assert after == before


async def test_run_without_a_metrics_path_scrapes_nothing() -> None:
    store = MemoryStore()
    publisher = Publisher("cp-a")
    publisher.publish(table())
    scraper = LoadScraper(store, publisher, ProbeSettings(metrics_path=""))
    await asyncio.wait_for(scraper.run(), WAIT)
    assert scraper.rounds == 0


async def test_a_scrape_that_stops_working_is_logged_once_per_transition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One WARNING (with the reason) when an origin read this term stops
    being read, one INFO when it is read again; none per failing round, none
    for an origin never read, and a flapping origin's next failure only after
    UNREAD_LOG_QUIET (its recovery then unlogged too)."""
    leader = Leader()
    await leader.lead()

    def lines() -> list[tuple[int, str]]:
        got = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        return got

    with caplog.at_level(logging.INFO, logger="controlplane.loadsync"):
        leader.pages.by_origin = {"a": page(1), "b": None}  # b never read: no line
        await leader.scraper.round(leader.pages)
        assert lines() == []
        leader.pages.by_origin = {"a": None, "b": None}
        for _ in range(3):  # failing for longer than the quiet period: one line
            await leader.scraper.round(leader.pages)
            leader.clock.now += UNREAD_LOG_QUIET
        assert lines() == [
            (
                logging.WARNING,
                "origin load metrics no longer read, routing by the proxies' own counts: "
                "a (HTTP 500)",
            )
        ]
        leader.pages.by_origin = {"a": page(1), "b": None}
        await leader.scraper.round(leader.pages)
        await leader.scraper.round(leader.pages)
        assert lines() == [(logging.INFO, "origin load metrics read again: a")]
        gauges_gone: dict[str, str | None] = {"a": "process_open_fds 3\n"}
        read_again: dict[str, str | None] = {"a": page(1)}
        leader.pages.by_origin = gauges_gone
        await leader.scraper.round(leader.pages)
        leader.pages.by_origin = {"a": page(1)}
        await leader.scraper.round(leader.pages)
        assert lines() == [
            (
                logging.WARNING,
                "origin load metrics no longer read, routing by the proxies' own counts: "
                "a (no request gauges on the page)",
            ),
            (logging.INFO, "origin load metrics read again: a"),
        ]
        # Flapping within the quiet period: neither line.
        leader.clock.now += UNREAD_LOG_QUIET - 1
        for pages in (gauges_gone, read_again, gauges_gone, read_again):
            leader.pages.by_origin = pages
            await leader.scraper.round(leader.pages)
        assert lines() == []
        leader.clock.now += 1
        leader.pages.by_origin = gauges_gone
        await leader.scraper.round(leader.pages)
        assert [level for level, _ in lines()] == [logging.WARNING]


async def test_a_failure_held_back_or_left_unscraped_is_still_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review 398: a page that fails again within the quiet period and keeps
    failing is logged once the period is over (the last line said "read
    again"); an origin warned of, then unhealthy, then read again gets its
    INFO; an origin removed from the table is forgotten."""
    leader = Leader()
    await leader.lead()
    scraper = leader.scraper

    def levels() -> list[int]:
        got = [r.levelno for r in caplog.records]
        caplog.clear()
        return got

    with caplog.at_level(logging.INFO, logger="controlplane.loadsync"):
        read: dict[str, str | None] = {"a": page(1)}
        failing: dict[str, str | None] = {"a": None}
        for pages in (read, failing, read, failing):
            leader.pages.by_origin = pages
            await scraper.round(leader.pages)
        assert levels() == [logging.WARNING, logging.INFO]  # the second failure held back
        leader.clock.now += UNREAD_LOG_QUIET
        await scraper.round(leader.pages)
        assert levels() == [logging.WARNING]
        leader.publisher.publish(table(unhealthy=("a", "c")))
        await scraper.round(leader.pages)
        leader.publisher.publish(table())
        leader.pages.by_origin = read
        await scraper.round(leader.pages)
        assert levels() == [logging.INFO]
        leader.publisher.publish(compile_table(State(8)))  # every origin removed
        await scraper.round(leader.pages)
    assert (scraper._unread, scraper._logged_at, scraper._read_at) == ({}, {}, {})


# ---------------------------------------------------------------- LoadHub


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    task = asyncio.create_task(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def loads_of(payload: bytes) -> pb.OriginLoads:
    update = pb.RouteUpdate.FromString(payload)
    assert not update.HasField("table") and not update.HasField("quota")
    assert update.HasField("loads")
    return update.loads


async def test_hub_pushes_existing_and_new_loads_once_per_change() -> None:
    store = MemoryStore()
    first = await store.put(LOAD_KEY, encode_loads({"a": Figures(3, 1, 0.5, UNKNOWN)}, 100.0))
    hub = LoadHub(store)
    async with running(hub.watch()):
        generation, payload = await asyncio.wait_for(hub.next_after(0), WAIT)
        assert generation == first
        loads = loads_of(payload)
        assert loads.generation == first and loads.scraped_at == 100.0
        assert [(o.origin, o.running, o.waiting) for o in loads.loads] == [("a", 3.0, 1.0)]

        waiting = asyncio.ensure_future(hub.next_after(generation))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()  # nothing new

        second = await store.put(LOAD_KEY, encode_loads({"a": Figures(4, 0, 0.5, 0.2)}, 100.5))
        generation, payload = await asyncio.wait_for(waiting, WAIT)
        assert generation == second
        assert loads_of(payload).loads[0].prefix_hit_rate == pytest.approx(0.2)
        # Every stream gets the very same bytes.
        assert (await hub.next_after(first))[1] is payload


async def test_hub_ignores_undecodable_loads(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    good = await store.put(LOAD_KEY, encode_loads({}, 1.0))
    hub = LoadHub(store)
    with caplog.at_level(logging.ERROR, logger="controlplane.loadsync"):
        async with running(hub.watch()):
            await asyncio.wait_for(hub.next_after(0), WAIT)
            await store.put(LOAD_KEY, b'{"origins": {}}')
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while "undecodable" not in caplog.text:
                assert loop.time() < deadline
                await asyncio.sleep(0.002)
    assert hub.generation == good


async def test_a_stream_that_was_busy_gets_only_the_newest() -> None:
    store = MemoryStore()
    hub = LoadHub(store)
    async with running(hub.watch()):
        first = await store.put(LOAD_KEY, encode_loads({"a": Figures(1, 0, UNKNOWN, UNKNOWN)}, 1.0))
        assert (await asyncio.wait_for(hub.next_after(0), WAIT))[0] == first
        for n in range(2, 6):
            last = await store.put(
                LOAD_KEY, encode_loads({"a": Figures(n, 0, UNKNOWN, UNKNOWN)}, float(n))
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while hub.generation != last:
            assert loop.time() < deadline
            await asyncio.sleep(0.002)
        generation, payload = await hub.next_after(first)
    assert generation == last
    assert loads_of(payload).loads[0].running == 5.0


# ---------------------------------------------------------------- settings


def test_load_flags() -> None:
    defaults = parse([]).probe
    assert (defaults.load_interval, defaults.load_refresh) == (0.5, 2.0)
    probe = parse(["--load-interval-ms", "100", "--load-refresh-ms", "1000"]).probe
    assert (probe.load_interval, probe.load_refresh) == (0.1, 1.0)
    for argv in (["--load-interval-ms", "10"], ["--load-refresh-ms", "100"]):
        with pytest.raises(SystemExit):
            parse(argv)


async def test_loads_written_while_the_first_read_failed_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first read failed (etcd not serving yet) and the leader wrote the
    loads before the watch was made: read again, not watched "from now"
    (which missed them until the next write)."""
    monkeypatch.setattr("controlplane.store.base.UNREAD_RETRY_S", 0.001)
    store = NotServingYet()
    hub = LoadHub(store)
    async with running(hub.watch()):
        await asyncio.wait_for(store.failed.wait(), WAIT)
        written = await store.put(
            LOAD_KEY, encode_loads({"a": Figures(1, 0, UNKNOWN, UNKNOWN)}, 1.0)
        )
        store.serving.set()  # a watch made now would start after the write
        generation, _ = await asyncio.wait_for(hub.next_after(0), WAIT)
    assert generation == written


async def test_hub_gives_no_fresh_loads_once_no_leader_writes_them() -> None:
    """pontoctl and the status page show no figures rather than figures
    frozen since the leader stopped scraping."""
    settings = ProbeSettings(timeout=1.0, load_interval=0.5, load_refresh=2.0)
    assert stale_after(settings) == 4.5  # 3.5 and a second of clocks' slack
    clock = Clock()
    store = MemoryStore()
    hub = LoadHub(store, max_age=stale_after(settings), clock=clock)
    assert hub.fresh() is None
    await store.put(LOAD_KEY, encode_loads({"a": Figures(3, 1, 0.5, UNKNOWN)}, clock.now))
    async with running(hub.watch()):
        await asyncio.wait_for(hub.next_after(0), WAIT)
    clock.now += 4.5
    fresh = hub.fresh()
    assert fresh is not None and fresh.loads[0].running == 3.0
    clock.now += 0.01
    assert hub.fresh() is None
    assert hub.loads is not None  # streams still get them: proxies judge the age
