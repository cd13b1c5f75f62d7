"""RegionLink against a real redis-server that answers with errors: a full
Redis (noeviction) is up and keeps serving reads; a setup mistake (a wrong
password, an unknown DB, an ACL refusal) is an ERROR naming the fix, retried
until Redis is fixed live. Clocks are injected: no test sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis as RedisClient
from redis.exceptions import OutOfMemoryError

from dataplane.cache.regional import (
    MISTAKE_ERROR_EVERY_S,
    REFUSED_WARNING_EVERY_S,
    WRITE_BACKOFF_S,
    RegionLink,
)
from dataplane.cache.regionside import RedisSide
from dataplane.metrics import Metrics
from ponto.devenv import Redis, free_port

NOEVICTION = "maxmemory reached with noeviction: set maxmemory-policy allkeys-lru"
SKIPPED = "ponto_cache_region_writes_skipped_total"


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
    # A deadline no busy test machine misses: these tests are about replies,
    # and a timeout would open the breaker.
    kw.setdefault("deadline_s", 1.0)
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


def writable(link: RegionLink) -> bool:
    return link.writable


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
        # One write refused; the next 49 (within WRITE_BACKOFF_S) not sent.
        assert sample(metrics, calls, op="set", result="refused") == 1
        assert sample(metrics, calls, op="set", result="skipped") == 49
        assert sample(metrics, SKIPPED, op="set", reason="full") == 49
        assert sample(metrics, calls, op="get", result="ok") == 50
        assert sample(metrics, calls, op="get", result="skipped") == 0
        clock.now += REFUSED_WARNING_EVERY_S
        assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
        assert sample(metrics, calls, op="set", result="refused") == 2
    warnings = lines(caplog, "WARNING")
    # One at start on the policy, then one per interval on the refusals.
    assert len(warnings) == 3, warnings
    assert "maxmemory-policy is noeviction" in warnings[0]
    assert all(NOEVICTION in w for w in warnings[1:])
    assert all("held back" in w for w in warnings[1:])
    assert not [m for m in lines(caplog, "INFO") if "answers again" in m]


async def test_refused_writes_back_off_and_one_tries_again(own_redis: Redis) -> None:
    """Full, then not: writes (lock, set, the semantic feed's) are held back
    for WRITE_BACKOFF_S after a refusal, then one goes through; reads go on."""
    clock = Clock()
    async with admin(own_redis) as r:
        await r.config_set("maxmemory", 1_500_000)
        await r.config_set("maxmemory-policy", "noeviction")
        await fill(r)
    async with linked(own_redis.url, clock) as (link, metrics):
        assert await link.call("lock", lambda c: c.set("ponto:lock:a", "t", nx=True)) is None
        assert not writable(link)
        assert link.hold_write("sem_publish")  # the feed queues nothing
        assert await link.call("set", lambda c: c.set("ponto:k", b"v")) is None
        assert await link.call("get", lambda c: c.get("ponto:k")) is None  # sent: a miss
        assert sample(metrics, SKIPPED, op="sem_publish", reason="full") == 1
        assert sample(metrics, SKIPPED, op="set", reason="full") == 1
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="get", result="ok") == 1
        clock.now += WRITE_BACKOFF_S
        assert writable(link)  # one may try
        assert await link.call("set", lambda c: c.set("ponto:k", b"v")) is None  # still full
        assert sample(metrics, calls, op="set", result="refused") == 1
        assert not writable(link)
        async with admin(own_redis) as r:
            await r.config_set("maxmemory", 64_000_000)  # the operator makes room
        clock.now += WRITE_BACKOFF_S
        assert await link.call("set", lambda c: c.set("ponto:k", b"v")) is True
        assert writable(link)
        assert await link.call("lock", lambda c: c.set("ponto:lock:b", "t", nx=True)) is True
        assert sample(metrics, calls, op="set", result="ok") == 1


async def test_a_read_only_replica_holds_writes_back_too(own_redis: Redis) -> None:
    clock = Clock()
    async with linked(own_redis.url, clock) as (link, metrics):
        async with admin(own_redis) as r:
            await r.set("ponto:shared", b"answer")
            await r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]
        try:
            assert await link.call("set", lambda c: c.set("ponto:k", b"v")) is None
            assert await link.call("set", lambda c: c.set("ponto:k", b"v")) is None
            assert await link.call("get", lambda c: c.get("ponto:shared")) == b"answer"
            assert sample(metrics, SKIPPED, op="set", reason="read-only") == 1
            assert link.available
        finally:
            async with admin(own_redis) as r:
                await r.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]


async def test_the_advice_follows_a_policy_switched_at_runtime(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Read as allkeys-lru at start, switched to noeviction later: the first
    refusal reads the policy again, and its advice is noeviction's."""
    clock = Clock()
    async with linked(own_redis.url, clock) as (link, _):
        assert link.policy == "allkeys-lru"
        async with admin(own_redis) as r:
            await r.config_set("maxmemory", 1_500_000)
            await r.config_set("maxmemory-policy", "noeviction")
            await fill(r)
        assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
        assert link._refusal_task is not None
        await link._refusal_task  # read in the background, then said
        assert policy(link) == "noeviction"
    [refused] = [w for w in lines(caplog, "WARNING") if "refused set" in w]
    assert NOEVICTION in refused


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


def answers_again(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in lines(caplog, "INFO") if "answers again" in m]


async def ping(link: RegionLink) -> bool | None:
    """The watcher's idle ping (no watcher runs in these tests)."""
    return await link.call("ping", link._ping)


@pytest.mark.parametrize(
    ("grants", "op", "refused"),
    [
        # Every command but scripts: the lock's release and refresh are EVALs.
        (("~*", "+@all", "-@scripting"), "unlock", lambda c: c.eval("return 1", 1, "ponto:lock:k")),
        # Every command on the entries' keys, none on the locks'.
        (("~ponto:x:*", "+@all"), "lock", lambda c: c.set("ponto:lock:k", "t", nx=True)),
    ],
    ids=["no-scripting", "no-lock-keys"],
)
async def test_an_acl_that_refuses_one_command_does_not_flap_the_breaker(
    own_redis: Redis,
    caplog: pytest.LogCaptureFixture,
    grants: tuple[str, ...],
    op: str,
    refused: Callable[[Any], Awaitable[Any]],
) -> None:
    """The PING (the probe) is allowed, one command is not: that command is
    refused (one WARNING naming it and the ACL fix), the breaker stays
    closed, region hits go on. It was an ERROR and a flap per cycle."""
    caplog.set_level(logging.INFO)
    async with admin(own_redis) as r:
        await r.execute_command("ACL", "SETUSER", "proxy", "on", ">pw", *grants)  # type: ignore[no-untyped-call]
        await r.set("ponto:x:shared", b"answer")
    clock = Clock()
    url = own_redis.url.replace("redis://", "redis://proxy:pw@")
    async with linked(url, clock) as (link, metrics):
        for _ in range(20):
            assert await link.call(op, refused) is None
            assert up(link)
            assert await link.call("get", lambda c: c.get("ponto:x:shared")) == b"answer"
            assert await ping(link) is True
            clock.now += 5
        assert sample(metrics, "ponto_cache_region_requests_total", op=op, result="refused") == 20
        assert sample(metrics, "ponto_cache_region_requests_total", op="get", result="ok") == 20
        assert sample(metrics, "ponto_cache_region_up") == 1
    assert not lines(caplog, "ERROR")
    assert not answers_again(caplog)
    warnings = lines(caplog, "WARNING")
    assert len(warnings) == 2, warnings  # one per REFUSED_WARNING_EVERY_S (100 s passed)
    assert all(f"refused {op}" in w and "ACL SETUSER" in w for w in warnings)


async def test_a_password_rotated_live_refuses_new_connections_only(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis's password changed while the proxy's pooled connections stay
    logged in: the calls that open a new connection are refused (a WARNING),
    the pooled ones serve, the breaker stays closed. (The PING that probes,
    sent once nothing answered for IDLE_PING_S, would open it: see the next test.)"""
    caplog.set_level(logging.INFO)
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "old")
    clock = Clock()
    async with linked(own_redis.url, clock, password="old") as (link, metrics):
        async with admin(own_redis, "old") as r:
            await r.config_set("requirepass", "new")
        for _ in range(5):
            # More at once than the pool holds: some need a new connection.
            got = await asyncio.gather(*(link.call("get", lambda c: c.get("k")) for _ in range(40)))
            assert got.count(None) > 0
            assert up(link)
            clock.now += 1  # traffic answered: the watcher does not ping
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="get", result="refused") > 0
        assert sample(metrics, calls, op="get", result="ok") > 0
    assert not lines(caplog, "ERROR")
    assert not answers_again(caplog)
    [warning] = lines(caplog, "WARNING")
    assert "refused get" in warning and "password" in warning


async def test_a_password_refused_on_every_connection_opens_the_breaker_at_the_ping(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """No connection left logged in (Redis restarted with a new password):
    calls are refused until the ping (the watcher's, once nothing answered
    for IDLE_PING_S) is refused too, which opens the breaker."""
    clock = Clock()
    async with linked(own_redis.url, clock) as (link, metrics):
        async with admin(own_redis) as r:
            await r.config_set("requirepass", "new")
            await r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # type: ignore[no-untyped-call]
        assert await link.call("get", lambda c: c.get("k")) is None
        assert up(link)
        assert await ping(link) is None
        assert not up(link)
        assert sample(metrics, "ponto_cache_region_up") == 0
    [error] = lines(caplog, "ERROR")
    assert "wrong or missing password" in error


async def test_a_replica_without_its_primary_is_an_outage(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """MASTERDOWN (replica-serve-stale-data no) refuses every command: the
    breaker opens and ponto_cache_region_up says 0; the PING that probes is
    refused too, until the replica serves again."""
    clock = Clock()
    async with linked(own_redis.url, clock) as (link, metrics):
        async with admin(own_redis) as r:
            await r.config_set("replica-serve-stale-data", "no")
            await r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]
        try:
            assert await link.call("get", lambda c: c.get("k")) is None
            assert not up(link)
            assert sample(metrics, "ponto_cache_region_up") == 0
            clock.now += 1
            assert await link.call("get", lambda c: c.get("k")) is None  # probed: refused
            assert not up(link)
            async with admin(own_redis) as r:
                await r.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
            clock.now += 1
            assert await link.call("get", lambda c: c.get("k")) is None  # a miss, answered
            assert up(link)
        finally:
            async with admin(own_redis) as r:
                await r.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
    [warning] = lines(caplog, "WARNING")
    assert "degraded" in warning and "MASTERDOWN" in warning.upper()
    assert "reads go on" not in warning


async def test_a_replica_without_its_primary_at_start_says_why(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with admin(own_redis) as r:
        await r.config_set("replica-serve-stale-data", "no")
        await r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]
    try:
        async with linked(own_redis.url, Clock()) as (link, _):
            assert not up(link)
    finally:
        async with admin(own_redis) as r:
            await r.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
    [warning] = lines(caplog, "WARNING")
    assert "not serving at start (ping MasterDownError: Link with MASTER is down" in warning


async def test_a_mistake_that_comes_back_is_not_said_again_within_its_interval(
    own_redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The throttle of a mistake's ERROR survives the breaker closing: a
    Redis that flaps between serving and refusing the proxy's password is one
    ERROR per MISTAKE_ERROR_EVERY_S, not one per flap."""
    clock = Clock()
    async with admin(own_redis) as r:
        await r.config_set("requirepass", "sekrit")
    async with linked(own_redis.url, clock, password="pw") as (link, _):
        for _ in range(5):
            async with admin(own_redis, "sekrit") as r:
                await r.config_set("requirepass", "pw")
            clock.now += 5
            assert await ping(link) is True
            assert up(link)
            async with admin(own_redis, "pw") as r:
                await r.config_set("requirepass", "sekrit")
                await r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # type: ignore[no-untyped-call]
            clock.now += 5
            assert await ping(link) is None
            assert not up(link)
    assert len(lines(caplog, "ERROR")) == 1


async def full_link_setup(server: Redis) -> None:
    async with admin(server) as r:
        await r.config_set("maxmemory", 1_500_000)
        await r.config_set("maxmemory-policy", "noeviction")
        await fill(r)


async def test_lock_refreshes_and_purge_claims_are_not_held_back(own_redis: Redis) -> None:
    """A PEXPIRE takes no memory, and a purge's claim leads to UNLINKs that
    free it: held back with the writes (review finding 2), a refresh said
    the lock was lost (its followers on other proxies called the origin
    too) and a purge freed nothing."""
    clock = Clock()
    async with admin(own_redis) as r:
        await r.set("ponto:lock:flight", "me", px=60_000)
    await full_link_setup(own_redis)
    async with linked(own_redis.url, clock) as (link, metrics):
        side = RedisSide(link)
        assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
        assert not writable(link)
        assert await side.refresh("ponto:lock:flight", "me", 60_000) is True
        await side.set_nx("ponto:purging:*:*", "me", 60_000, op="purge_claim")
        assert await side.set_nx("ponto:lock:other", "me", 5_000) is None  # a lock: held
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="lock_refresh", result="ok") == 1
        assert sample(metrics, calls, op="purge_claim", result="skipped") == 0
        assert sample(metrics, SKIPPED, op="lock", reason="full") == 1


async def test_simultaneous_full_refusals_read_the_policy_once(own_redis: Redis) -> None:
    """Every write in flight when Redis fills up is refused at once; each
    read the policy (CONFIG GET) before the refused state was set, and a
    lock claim waited for it (review finding 3)."""
    clock = Clock()
    await full_link_setup(own_redis)
    async with linked(own_redis.url, clock) as (link, metrics):

        async def config_gets() -> int:
            async with admin(own_redis) as r:
                stats = await r.info("commandstats")
            return int(stats.get("cmdstat_config|get", {}).get("calls", 0))

        before = await config_gets()

        def write(i: int) -> Callable[[RedisClient], Awaitable[Any]]:
            return lambda c: c.set(f"ponto:k{i}", b"v" * 10_000)

        got = await asyncio.gather(*(link.call("set", write(i)) for i in range(20)))
        assert got == [None] * 20
        task = getattr(link, "_refusal_task", None)
        if task is not None:
            await task
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="set", result="refused") == 20
        assert await config_gets() - before == 1


async def test_the_semantic_feed_s_op_counts_entries_whether_sent_or_held(
    own_redis: Redis,
) -> None:
    """A held entry counted one, a sent batch one whatever its size (review
    finding 5): op sem_publish counts entries in every outcome."""
    clock = Clock()
    async with linked(own_redis.url, clock) as (link, metrics):
        xadd = lambda c: c.xadd("ponto:sem:test", {"f": "v"})  # noqa: E731
        assert await link.call("sem_publish", xadd, n=3) is not None
        await full_link_setup(own_redis)
        assert await link.call("set", lambda c: c.set("ponto:k", b"v" * 10_000)) is None
        assert link.hold_write("sem_publish", 2)
        assert await link.call("sem_publish", xadd, n=4) is None
        calls = "ponto_cache_region_requests_total"
        assert sample(metrics, calls, op="sem_publish", result="ok") == 3
        assert sample(metrics, calls, op="sem_publish", result="skipped") == 6
        assert sample(metrics, SKIPPED, op="sem_publish", reason="full") == 6
