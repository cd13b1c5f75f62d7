"""Origin loads from a real origin's metrics to a real proxy link, through etcd.

One control plane replica (the leader) over the session etcd scrapes an
in-process origin simulator (ponto.originsim, which exports vLLM's running and
waiting gauges) every 0.1 s; a ControlPlaneClient, the proxy's own link,
receives the pushes into a LoadBoard, which its TableHolder spills by. Timing
is only bounded generously, never asserted as performance; the age of the
figures at the proxy is measured and printed (run with -s to see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp.test_utils import TestServer

from controlplane.app import ControlPlane
from controlplane.catalog import ROOT
from controlplane.model import Origin, Region
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from dataplane.placement.load import LoadBoard
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.originsim import SIM_STATE, SimConfig, build_app
from ponto.v1 import routing_pb2 as pb
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration

INTERVAL_MS = 100
WAIT = 10.0  # generous: a shared 2-core machine, etcd and gRPC on loopback
MODEL = "sim-small"


@dataclass
class Received:
    """What the proxy's link handed on, with the wall time it arrived."""

    loads: list[tuple[pb.OriginLoads, float]] = field(default_factory=list)
    tables: list[int] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def on_loads(self, loads: pb.OriginLoads) -> None:
        self.loads.append((loads, time.time()))
        self.arrived.set()

    def latest(self, origin: str) -> pb.OriginLoad | None:
        if not self.loads:
            return None
        return next((o for o in self.loads[-1][0].loads if o.origin == origin), None)

    async def until(self, check: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while not check():
            remaining = deadline - loop.time()
            if remaining <= 0:
                pytest.fail(f"not within {WAIT}s: {what}")
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.1)):
                    await self.arrived.wait()


@dataclass
class Setup:
    plane: ControlPlane
    origin: TestServer
    holder: TableHolder
    link: ControlPlaneClient
    got: Received

    def set_origin(self, running: float, waiting: float) -> None:
        metrics = self.origin.app[SIM_STATE].metrics
        metrics.running.labels(model_name=MODEL).set(running)
        metrics.waiting.labels(model_name=MODEL).set(waiting)

    def figures(self) -> tuple[float, float] | None:
        load = self.got.latest("gpu-1")
        return None if load is None else (load.running, load.waiting)

    async def until_figures(self, running: float, waiting: float) -> None:
        """Wait until the proxy's latest push shows these figures for the origin."""
        await self.got.until(
            lambda: self.figures() == (running, waiting), f"running {running}, waiting {waiting}"
        )


@pytest.fixture
async def setup(etcd_endpoint: EtcdEndpoint) -> AsyncIterator[Setup]:
    origin = TestServer(build_app(SimConfig(name="gpu-1")), host="127.0.0.1")
    await origin.start_server()
    settings = parse(
        [
            "--etcd",
            etcd_endpoint.url,
            "--listen",
            "127.0.0.1:0",
            "--id",
            "cp-1",
            "--load-interval-ms",
            str(INTERVAL_MS),
            "--probe-interval-ms",
            "200",
        ]
    )
    store = EtcdStore(settings.etcd)
    await store.connect()
    plane = ControlPlane(settings, store)
    await plane.start()
    await plane.catalog.put_region(Region("east", 40.7, -74.0), allow_update=False)
    await plane.catalog.put_region(Region("west", 37.8, -122.4), allow_update=False)
    await plane.catalog.put_origin(
        # Capacity 4: every request moves its load by a quarter of it, which
        # wrote its health, and so made a table, before load left tables.
        Origin("gpu-1", str(origin.make_url("/v1")), "east", (MODEL,), capacity=4),
        allow_update=False,
    )
    await plane.catalog.put_origin(
        # Where east spills to: not probed, so healthy, and never called.
        Origin("gpu-2", "http://127.0.0.1:9/v1", "west", (MODEL,), probe=False),
        allow_update=False,
    )
    got = Received()
    board = LoadBoard()
    holder = TableHolder("east", None, scraped=board.scraped_load)
    board.on_change.append(holder.loads_changed)
    holder.on_apply.append(lambda routes, _policy: got.tables.append(routes.version))

    def on_loads(loads: pb.OriginLoads) -> None:
        board.apply(loads)
        got.on_loads(loads)

    link = ControlPlaneClient(
        holder,
        [f"127.0.0.1:{plane.port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        on_loads=on_loads,
    )
    task = asyncio.create_task(link.run())
    try:
        yield Setup(plane, origin, holder, link, got)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await plane.stop(grace=0)
        await origin.close()


async def test_the_proxy_receives_the_origins_gauges_and_their_changes(setup: Setup) -> None:
    setup.set_origin(running=3, waiting=2)
    await setup.until_figures(3, 2)
    first, _ = setup.got.loads[-1]
    assert first.generation == setup.link.loads_generation > 0
    assert first.scraped_at > 0
    load = setup.got.latest("gpu-1")
    assert load is not None
    # The simulator exports KV usage (0: it runs without a KV cache here) and
    # prefix-cache counters that no request moved between scrapes.
    assert load.kv_cache_usage == 0.0 and load.prefix_hit_rate == -1.0

    loop = asyncio.get_running_loop()
    changed = loop.time()
    setup.set_origin(running=7, waiting=0)
    await setup.until_figures(7, 0)
    took = loop.time() - changed
    ms = took * 1000
    print(f"\nchange reached the proxy after {ms:.0f} ms ({ms / INTERVAL_MS:.1f} intervals)")
    assert setup.got.loads[-1][0].generation > first.generation


async def test_load_pushes_spill_the_proxy_and_leave_the_route_table_alone(
    setup: Setup,
) -> None:
    """Load never rebuilds a table (trial of the churn: one every 5 to 6 s
    under traffic, for nothing an operator or a probe changed): the proxy
    spills east to west when the pushed load crosses east's threshold (0.8
    of its capacity 4), and takes it back when the load falls, on the same
    table version."""
    # The prober writes the origin's health once, and never again for load.
    # Past the builder's longest debounce (0.5 s) after that write, and with
    # the proxy holding the latest table, tables are settled.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while await setup.plane.store.get(ROOT + "state/health/gpu-1") is None:
        assert loop.time() < deadline, "health written"
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    while (
        setup.holder.routes is None
        or setup.plane.publisher.latest is None
        or setup.holder.routes.version != setup.plane.publisher.latest.version
    ):
        assert loop.time() < deadline, "the proxy holds the latest table"
        await asyncio.sleep(0.05)
    version = setup.holder.routes.version
    tables = len(setup.got.tables)

    def regions() -> list[str]:
        routes = setup.holder.routes
        assert routes is not None
        return [t.region for t in routes.candidates(MODEL, "east")]

    assert regions() == ["east", "west"]
    pushes = len(setup.got.loads)
    for n in range(1, 6):
        setup.set_origin(running=n, waiting=n % 2)
        await setup.until_figures(n, n % 2)
    assert len(setup.got.loads) >= pushes + 5
    assert regions() == ["west", "east"]  # 5 and 1 waiting, of 4: spilled
    setup.set_origin(running=1, waiting=0)
    await setup.until_figures(1, 0)
    assert regions() == ["east", "west"]
    assert setup.holder.routes.version == version
    assert len(setup.got.tables) == tables
    latest = setup.plane.publisher.latest
    assert latest is not None and latest.version == version


async def test_age_of_loads_at_the_proxy(setup: Setup) -> None:
    """Every round sees new figures (the origin's gauge moves faster than the
    scrapes), so every round is written and pushed; the age of each push at
    arrival is (arrival - scraped_at), both wall clocks of this host."""

    async def move() -> None:
        n = 0
        while True:
            n += 1
            setup.set_origin(running=n, waiting=0)
            await asyncio.sleep(INTERVAL_MS / 1000 / 4)

    mover = asyncio.create_task(move())
    try:
        await setup.got.until(lambda: len(setup.got.loads) >= 1, "first push")
        start = len(setup.got.loads)
        await setup.got.until(lambda: len(setup.got.loads) >= start + 20, "20 pushes")
    finally:
        mover.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await mover
    ages = [arrived - loads.scraped_at for loads, arrived in setup.got.loads[start : start + 20]]
    gaps = [
        b.scraped_at - a.scraped_at
        for (a, _), (b, _) in zip(
            setup.got.loads[start : start + 19],
            setup.got.loads[start + 1 : start + 20],
            strict=True,
        )
    ]
    print(
        f"\nage at the proxy over {len(ages)} pushes (interval {INTERVAL_MS} ms): "
        f"median {statistics.median(ages) * 1000:.1f} ms, max {max(ages) * 1000:.1f} ms; "
        f"scrape-to-scrape median {statistics.median(gaps) * 1000:.1f} ms"
    )
    assert all(age > -0.01 for age in ages)  # one clock: never from the future
    assert max(ages) < WAIT
