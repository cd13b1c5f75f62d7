"""A proxy whose control plane session ends takes another replica at random,
not the next one in its list: a lost replica's proxies spread over the
others, and rolling restarts do not gather the fleet on one replica."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.v1 import routing_pb2 as pb


class Done(Exception):
    pass


async def run(addresses: list[str], seed: int, count: int) -> list[str]:
    tried: list[str] = []

    async def no_wait(_: float) -> None:
        if len(tried) >= count:
            raise Done

    link = ControlPlaneClient(
        TableHolder("eu-west", None),
        addresses,
        pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:9", version="t"),
        sleep=no_wait,
        rng=random.Random(seed),
    )

    async def session(address: str) -> bool:
        tried.append(address)
        return True

    link._session = session  # type: ignore[method-assign]
    with pytest.raises(Done):
        await link.run()
    return tried


async def test_failover_never_retries_the_replica_that_failed_and_spreads_over_the_others() -> None:
    replicas = ["cp1:7000", "cp2:7000", "cp3:7000"]
    tried = await run(replicas, seed=7, count=300)
    assert all(a != b for a, b in itertools.pairwise(tried))
    # From each replica, both others are taken, about as often.
    after = {a: Counter(b for x, b in itertools.pairwise(tried) if x == a) for a in replicas}
    for a, nexts in after.items():
        assert set(nexts) == set(replicas) - {a}
        low, high = min(nexts.values()), max(nexts.values())
        assert low >= 0.3 * (low + high), (a, nexts)


async def test_a_fleet_that_loses_a_replica_spreads_its_proxies() -> None:
    """100 proxies that started on cp1 (the one that goes) land on cp2 and
    cp3 both, not all on the next in the list."""
    replicas = ["cp1:7000", "cp2:7000", "cp3:7000"]
    landed: Counter[str] = Counter()
    for seed in range(100):
        tried = await run(replicas, seed=seed, count=2)
        if tried[0] == "cp1:7000":
            landed[tried[1]] += 1
    assert set(landed) == {"cp2:7000", "cp3:7000"}
    assert min(landed.values()) >= 0.3 * sum(landed.values())


async def test_a_single_replica_is_tried_again() -> None:
    assert await run(["cp1:7000"], seed=1, count=3) == ["cp1:7000"] * 3
