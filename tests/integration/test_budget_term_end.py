"""A leader that stops writes the budget counts it had not written yet.

One control plane replica (the leader) over the session etcd. A ledger that
moved less than 1 % of its budget is written ten rounds on (LEDGER_ROUNDS):
a leader stopped meanwhile took those counts with it, and what a proxy that
stopped too had counted was gone (a rolling upgrade of both). The replica's
stop ends the term: the Rebalancer writes them, fenced by the term, before
the election revokes the lease and the store closes (ControlPlane._lead)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
import pytest

from controlplane.app import ControlPlane
from controlplane.budget import LEDGER_PREFIX, decode_ledger
from controlplane.model import Limits, Tenant
from controlplane.quotasync import DEMAND_PREFIX
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from ponto.quota_types import utc_day
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration

WAIT = 10.0  # generous: a shared 2-core machine
SCOPE = "t/acme"


async def until(check: Callable[[], Awaitable[object]], expected: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while await check() != expected:
        if loop.time() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        await asyncio.sleep(0.02)


async def test_a_leader_that_stops_writes_the_counts_it_had_not_written(
    etcd_endpoint: EtcdEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rounds enough that the ledger is written only at once and as the term ends.
    monkeypatch.setattr("controlplane.quotasync.LEDGER_ROUNDS", 1_000_000)
    argv = ["--etcd", etcd_endpoint.url, "--listen", "127.0.0.1:0", "--id", "cp-1"]
    settings = parse([*argv, "--quota-interval-ms", "50", "--leader-ttl", "2"])
    store = EtcdStore(settings.etcd)
    await store.connect()
    plane = ControlPlane(settings, store)
    reader = EtcdStore(settings.etcd)
    await reader.connect()
    try:
        await plane.start()
        await plane.catalog.put_tenant(
            Tenant("acme", limits=Limits(tokens_per_day=1_000_000)), allow_update=False
        )

        async def report(tokens: int) -> None:
            """A replica's report of p1, as QuotaHub.publish_demand writes it."""
            row = [0, 5.0, 0, 0, 0, 1.0, utc_day(time.time()), tokens, tokens]
            body = {"proxies": {"p1": {SCOPE: row}}, "heard": {"p1": time.time()}}
            await reader.put(DEMAND_PREFIX + "cp-2", orjson.dumps(body))

        async def written() -> tuple[float, float] | None:
            kv = await reader.get(LEDGER_PREFIX + SCOPE)
            return None if kv is None else decode_ledger(kv.value).used()

        async def counted() -> tuple[float, float] | None:
            ledger = plane.rebalancer._ledgers.get(SCOPE)
            return None if ledger is None else ledger.used()

        await report(100)
        await until(written, (100, 100), "a new ledger written at once")
        await report(150)  # 0.005 % of the budget more: not due
        await until(counted, (150, 150), "150 counted")
        assert await written() == (100, 100)
        await reader.delete(DEMAND_PREFIX + "cp-2")  # p1 and its replica gone
        await plane.stop(grace=0)
        assert await written() == (150, 150)
    finally:
        await reader.close()
