"""dataplane.cache.regionfaults: what an error reply says about Redis, as
redis-py's parser hands it over (the reply's code turned into a class, or left
in the text), and RegionLink's breaker on a Redis Cluster node."""

from __future__ import annotations

import pytest
from redis import exceptions as rex
from redis._parsers.base import BaseParser

from dataplane.cache.regional import RegionLink
from dataplane.cache.regionfaults import (
    MISTAKE_ACL,
    MISTAKE_AUTH,
    MISTAKE_CLUSTER,
    PROBE_OP,
    Mistake,
    Refusal,
    fault_of,
    is_outage,
)
from dataplane.metrics import Metrics


def reply(text: str) -> rex.ResponseError:
    """An error reply as redis-py parses one."""
    exc = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    assert isinstance(exc, rex.ResponseError)
    return exc


@pytest.mark.parametrize(
    "text",
    [
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "CLUSTERDOWN Hash slot not served",
        "TRYAGAIN Multiple keys request during rehashing of slot",
    ],
)
def test_replies_that_refuse_every_command_are_outages(text: str) -> None:
    exc = reply(text)
    assert is_outage(exc)
    assert fault_of(exc, "get") is None  # an outage: the breaker opens
    assert fault_of(exc, PROBE_OP) is None


@pytest.mark.parametrize(
    "text",
    ["MOVED 3999 127.0.0.1:6381", "ASK 3999 127.0.0.1:6381", "CROSSSLOT Keys in request"],
)
def test_a_cluster_s_replies_are_a_setup_mistake(text: str) -> None:
    exc = reply(text)
    assert fault_of(exc, "get") is MISTAKE_CLUSTER
    assert "Redis Cluster is not supported" in MISTAKE_CLUSTER.what
    assert "standalone Redis (or a proxy" in MISTAKE_CLUSTER.fix


def test_an_acl_refusal_is_a_mistake_on_the_probe_only() -> None:
    exc = reply("NOPERM User proxy has no permissions to run the 'eval' command")
    assert fault_of(exc, PROBE_OP) is MISTAKE_ACL
    refusal = fault_of(exc, "unlock")
    assert isinstance(refusal, Refusal)
    assert refusal.kind == "acl" and not refusal.serving
    assert "ACL SETUSER" in refusal.advice


def test_a_password_refusal_is_a_mistake_on_the_probe_only() -> None:
    exc = rex.AuthenticationError("invalid username-password pair or user is disabled.")
    assert fault_of(exc, PROBE_OP) is MISTAKE_AUTH
    refusal = fault_of(exc, "set")
    assert isinstance(refusal, Refusal) and refusal.kind == "auth"


def test_full_and_read_only_are_refusals() -> None:
    full = fault_of(reply("OOM command not allowed when used memory > 'maxmemory'."), "set")
    assert isinstance(full, Refusal) and full.kind == "full" and full.serving
    ro = fault_of(reply("READONLY You can't write against a read only replica."), "set")
    assert isinstance(ro, Refusal) and ro.kind == "read-only"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class ClusterNode:
    """A Redis Cluster node, as far as the link asks: PING answers, a key
    another node holds is MOVED, INFO says cluster_enabled."""

    def __init__(self) -> None:
        self.cluster = True
        self.pings = 0

    async def ping(self) -> bool:
        self.pings += 1
        return True

    async def info(self, section: str) -> dict[str, int]:
        assert section == "cluster"
        return {"cluster_enabled": int(self.cluster)}

    async def get(self, key: str) -> bytes | None:
        if self.cluster:
            raise reply("MOVED 3999 127.0.0.1:6381")
        return None

    async def aclose(self) -> None:
        pass


async def test_a_cluster_node_keeps_the_breaker_open_though_it_answers_ping() -> None:
    clock = Clock()
    link = RegionLink("redis://127.0.0.1:1/0", Metrics(), clock=clock, watch_tick_s=None)
    node = ClusterNode()
    link._client = node  # type: ignore[assignment]
    try:
        assert await link.call("get", lambda c: c.get("k")) is None
        assert not link.available
        assert isinstance(link._mistake, Mistake) and link._mistake is MISTAKE_CLUSTER
        for _ in range(5):
            clock.now += 10
            assert await link.call("get", lambda c: c.get("k")) is None
            assert not link.available  # the probe's INFO says cluster: still open
        node.cluster = False  # a standalone Redis on that address now
        clock.now += 10
        assert await link.call("get", lambda c: c.get("k")) is None  # a miss, answered
        assert link.available
    finally:
        await link.close()


def test_skipped_writes_are_exported_from_0_for_the_alert() -> None:
    """PontoRegionCacheRefusingWrites reads increase(), which misses a
    series' first count: each operation and reason is there from the start
    (trial 67)."""
    metrics = Metrics()
    RegionLink("redis://127.0.0.1:1/0", metrics, watch_tick_s=None)
    get = metrics.registry.get_sample_value
    for op in ("set", "lock", "sem_publish"):
        for reason in ("full", "read-only"):
            labels = {"op": op, "reason": reason}
            assert get("ponto_cache_region_writes_skipped_total", labels) == 0, labels
