"""RegionLink against a real redis-server that answers with errors: a full
Redis (noeviction) is up and keeps serving reads; a setup mistake (a wrong
password, an unknown DB, an ACL refusal) is an ERROR naming the fix, retried
until Redis is fixed live. Clocks are injected: no test sleeps."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis as RedisClient
from redis.exceptions import OutOfMemoryError

from dataplane.cache.regional import MISTAKE_ERROR_EVERY_S, REFUSED_WARNING_EVERY_S, RegionLink
from dataplane.metrics import Metrics
from ponto.devenv import Redis

NOEVICTION = "maxmemory reached with noeviction: set maxmemory-policy allkeys-lru"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def linked(url: str, clock: Clock, **kw: object) -> AsyncIterator[tuple[RegionLink, Metrics]]:
    metrics = Metrics()
    link = RegionLink(url, metrics, clock=clock, watch_tick_s=None, **kw)  # type: ignore[arg-type]
    await link.start()
    try:
        yield link, metrics
    finally:
        await link.close()


@contextlib.asynccontextmanager
async def admin(server: Redis, password: str | None = None) -> AsyncIterator[RedisClient]:
    client = RedisClient.from_url(server.url, password=password)
    try:
        yield client
    finally:
        await client.aclose()


async def fill(client: RedisClient) -> None:
    """Write until Redis refuses (maxmemory under noeviction)."""
    for i in range(1000):
        try:
            await client.set(f"filler:{i}", b"x" * 100_000)
        except OutOfMemoryError:
            return
    raise AssertionError("Redis never filled up")


def policy(link: RegionLink) -> str | None:
    """As read now (a function: mypy keeps a property's narrowing)."""
    return link.policy


def up(link: RegionLink) -> bool:
    return link.available


def lines(caplog: pytest.LogCaptureFixture, level: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == level and r.name == "dataplane.cache.regional"
    ]


async def test_a_full_redis_refuses_writes_but_shared_reads_go_on(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    async with admin(own_redis) as r:
        await r.set("ponto:shared", b"answer")
        await r.config_set("maxmemory", 1_500_000)
        await r.config_set("maxmemory-policy", "noeviction")
        await fill(r)
    async with linked(own_redis.url, clock) as (link, metrics):
        assert link.policy == "noeviction"
        for _ in range(50):
            assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
            assert await link.call("get", lambda c: c.get("ponto:shared")) == b"answer"
            clock.now += 0.1
        assert link.available
        assert sample(metrics, "ponto_cache_region_up") == 1
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="set", result="refused") == 50
        assert sample(metrics, calls, op="get", result="ok") == 50
        assert sample(metrics, calls, op="get", result="skipped") == 0
        clock.now += REFUSED_WARNING_EVERY_S
        assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
    warnings = lines(caplog, "WARNING")
    # One at start on the policy, then one per interval on the refusals.
    assert len(warnings) == 3, warnings
    assert "maxmemory-policy is noeviction" in warnings[0]
    assert all(NOEVICTION in w for w in warnings[1:])
    assert "49 more not logged" in warnings[2]
    assert not [m for m in lines(caplog, "INFO") if "answers again" in m]


async def test_the_policy_is_read_again_when_redis_answers_again(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "sekrit")
    async with linked(own_redis.url, clock) as (link, _):
        assert link.policy is None  # not read: Redis would not serve the proxy
        async with admin(own_redis, "sekrit") as r:
            await r.config_set("maxmemory-policy", "noeviction")
            await r.config_set("requirepass", "")
        clock.now += 1
        assert await link.call("ping", lambda c: c.ping()) is True
        assert link._config_task is not None
        await link._config_task
        assert policy(link) == "noeviction"
    assert len([w for w in lines(caplog, "WARNING") if "noeviction" in w]) == 1


async def test_a_policy_that_cannot_be_read_says_nothing(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A managed Redis that refuses CONFIG: a DEBUG line only."""
    caplog.set_level(logging.DEBUG, logger="dataplane.cache.regional")
    async with admin(own_redis) as r:
        await r.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "proxy", "on", ">pw", "~*", "+@all", "-config"
        )
        await r.config_set("maxmemory-policy", "noeviction")
    url = own_redis.url.replace("redis://", "redis://proxy:pw@")
    async with linked(url, Clock()) as (link, metrics):
        assert link.available
        assert link.policy is None
        assert sample(metrics, "ponto_cache_region_up") == 1
    assert not lines(caplog, "WARNING")
    assert not lines(caplog, "ERROR")
    assert [m for m in lines(caplog, "DEBUG") if "no maxmemory-policy read" in m]


async def test_a_wrong_password_is_an_error_that_names_it_until_fixed_live(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "sekrit")
    async with linked(own_redis.url, clock, password="wrong") as (link, metrics):
        assert not link.available
        assert sample(metrics, "ponto_cache_region_up") == 0
        # Probes go on (every 0.25 s, doubling up to 5 s); the ERROR is once a while.
        for _ in range(int(1.5 * MISTAKE_ERROR_EVERY_S / 5)):
            clock.now += 5
            assert await link.call("get", lambda c: c.get("k")) is None
        errors = lines(caplog, "ERROR")
        assert len(errors) == 2, errors  # at start, and once MISTAKE_ERROR_EVERY_S passed
        assert all("wrong or missing password" in e for e in errors)
        assert all("--redis-password-file" in e for e in errors)
        assert "wrong" not in errors[0].replace("wrong or missing", "")  # no password shown
        assert not lines(caplog, "WARNING")  # not "unreachable", not "degraded"
        async with admin(own_redis, "sekrit") as r:
            await r.config_set("requirepass", "wrong")  # the operator fixes Redis
        clock.now += 5
        assert await link.call("set", lambda c: c.set("k", b"v")) is True
        assert up(link)
        assert sample(metrics, "ponto_cache_region_up") == 1
    assert [m for m in lines(caplog, "INFO") if "answers again" in m]


async def test_a_missing_password_is_a_mistake_too(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "sekrit")
    async with linked(own_redis.url, Clock()) as (link, _):
        assert not link.available
    [error] = lines(caplog, "ERROR")
    assert "misconfigured: wrong or missing password" in error
    assert not lines(caplog, "WARNING")


async def test_an_unknown_db_is_a_mistake(
    clean_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    url = clean_redis.url.rsplit("/", 1)[0] + "/99"
    async with linked(url, Clock()) as (link, metrics):
        assert not link.available
        assert sample(metrics, "ponto_cache_region_up") == 0
    [error] = lines(caplog, "ERROR")
    assert "unknown DB" in error
    assert "use a DB index the server has" in error
    assert not lines(caplog, "WARNING")


async def test_an_acl_refusal_is_a_mistake(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with admin(own_redis) as r:
        await r.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "proxy", "on", ">pw", "~*", "+get"
        )
    url = own_redis.url.replace("redis://", "redis://proxy:pw@")
    async with linked(url, Clock()) as (link, _):
        assert not link.available
    [error] = lines(caplog, "ERROR")
    assert "permission denied" in error
    assert "ACL SETUSER" in error
    assert not lines(caplog, "WARNING")


async def test_the_password_file_s_password_is_sent(own_redis: Redis) -> None:
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "with space #")
    async with linked(own_redis.url, Clock(), password="with space #") as (link, _):
        assert link.available
        assert await link.call("set", lambda c: c.set("k", b"v")) is True
