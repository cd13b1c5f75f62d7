"""RegionLink against a real redis-server: deadlines, the breaker, catching up."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis as RedisClient

from dataplane.cache.regional import RegionLink
from dataplane.cache.regionurl import RegionURLError, check_url
from dataplane.metrics import Metrics
from dataplane.settings import parse
from ponto.devenv import Redis, free_port, start_redis


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


@contextlib.asynccontextmanager
async def linked(url: str, **kw: object) -> AsyncIterator[tuple[RegionLink, Metrics]]:
    metrics = Metrics()
    kw.setdefault("watch_tick_s", None)  # these tests count every call
    link = RegionLink(url, metrics, **kw)  # type: ignore[arg-type]
    await link.start()
    try:
        yield link, metrics
    finally:
        await link.close()


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP server on loopback that accepts and never answers (a hung Redis)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


async def test_calls_go_through_while_redis_answers(clean_redis: Redis) -> None:
    async with linked(clean_redis.url) as (link, metrics):
        assert await link.call("set", lambda r: r.set("ponto:t:a", b"1")) is True
        assert await link.call("get", lambda r: r.get("ponto:t:a")) == b"1"
        assert link.available
        assert sample(metrics, "ponto_cache_region_up") == 1
        assert sample(metrics, "ponto_cache_region_requests_total", op="get", result="ok") == 1


async def test_a_reply_that_does_not_parse_is_none_and_counted(clean_redis: Redis) -> None:
    async def bad(r: object) -> int:
        raise ValueError("not a number")

    async with linked(clean_redis.url) as (link, metrics):
        assert await link.call("get", bad) is None
        assert sample(metrics, "ponto_cache_region_errors_total", op="get") == 1


async def test_unreachable_at_start_is_degraded_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with linked(f"redis://127.0.0.1:{free_port()}/0") as (link, metrics):
        assert not link.available
        assert sample(metrics, "ponto_cache_region_up") == 0
        # Skipped while the breaker is open: no wait, no new error.
        assert await link.call("get", lambda r: r.get("k")) is None
        assert sample(metrics, "ponto_cache_region_requests_total", op="get", result="skipped") == 1
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "unreachable at start" in warnings[0].getMessage()


async def test_a_silent_server_costs_one_deadline_then_is_skipped() -> None:
    with silent_server() as port:
        async with linked(f"redis://127.0.0.1:{port}/0", deadline_s=0.05) as (link, metrics):
            assert not link.available  # start()'s ping timed out
            assert (
                sample(metrics, "ponto_cache_region_requests_total", op="ping", result="timeout")
                == 1
            )
            assert await link.call("get", lambda r: r.get("k")) is None
            assert (
                sample(metrics, "ponto_cache_region_requests_total", op="get", result="skipped")
                == 1
            )


async def test_catches_up_when_redis_comes_back(own_redis: Redis, redis_workdir: Path) -> None:
    port = own_redis.port
    async with linked(own_redis.url) as (link, metrics):
        assert await link.call("set", lambda r: r.set("k", b"v")) is True
        own_redis.kill()
        assert await link.call("get", lambda r: r.get("k")) is None
        assert sample(metrics, "ponto_cache_region_up") == 0
        again = start_redis(redis_workdir, port=port)
        try:
            # The next probe (after the 0.25 s backoff) closes the breaker.
            async with asyncio.timeout(10):
                while await link.call("set", lambda r: r.set("k", b"w")) is None:
                    await asyncio.sleep(0.05)
            assert link.available
            assert await link.call("get", lambda r: r.get("k")) == b"w"
            assert sample(metrics, "ponto_cache_region_up") == 1
        finally:
            again.stop()


async def test_without_traffic_the_link_still_sees_redis_go_and_come_back(
    own_redis: Redis, redis_workdir: Path
) -> None:
    port = own_redis.port
    async with linked(own_redis.url, watch_tick_s=0.02, idle_ping_s=0.05) as (link, metrics):
        assert sample(metrics, "ponto_cache_region_up") == 1
        own_redis.kill()
        async with asyncio.timeout(10):
            while sample(metrics, "ponto_cache_region_up") == 1:
                await asyncio.sleep(0.02)
        assert sample(metrics, "ponto_cache_region_up") == 0
        again = start_redis(redis_workdir, port=port)
        try:
            async with asyncio.timeout(15):
                while sample(metrics, "ponto_cache_region_up") == 0:
                    await asyncio.sleep(0.02)
            assert link.available
            assert sample(metrics, "ponto_cache_region_requests_total", op="ping", result="ok") >= 2
        finally:
            again.stop()


@pytest.mark.parametrize(
    "url",
    [
        "http://h:1/0",
        "localhost:6379",
        "redis://",
        "",
        "redis://h:port/0",
        "redis://h:1/db",
        "unix://",
    ],
)
def test_bad_urls_are_one_line_errors(url: str) -> None:
    with pytest.raises(RegionURLError) as info:
        check_url(url)
    assert "\n" not in str(info.value)


def test_good_urls_pass() -> None:
    for url in (
        "redis://127.0.0.1:6379/0",
        "rediss://user:pw@cache.internal:6380/2",
        "redis://valkey",
        "unix:///run/redis.sock",
    ):
        assert check_url(url) == url
        RedisClient.from_url(url)  # redis-py reads it too


def test_a_proxy_without_redis_does_not_import_redis_py() -> None:
    script = (
        "import sys\n"
        "from dataplane.http.server import build_app\n"
        "from dataplane.settings import parse\n"
        "build_app(parse(['--region=r']))\n"
        "assert 'redis' not in sys.modules\n"
        "build_app(parse(['--region=r', '--redis=redis://127.0.0.1:1/0']))\n"
        "assert 'redis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def test_a_proxy_with_a_regional_cache_loads_no_numpy_before_semantic_caching(
    tmp_path: Path,
) -> None:
    """Its semantic feed is built and started with the app, but numpy (some
    12 MB per worker) comes only with the semantic index, once a tenant turns
    semantic caching on (the chart deploys Redis by default)."""
    script = (
        "import asyncio, sys\n"
        "from aiohttp.test_utils import TestServer\n"
        "from dataplane.http.server import build_app\n"
        "from dataplane.settings import parse\n"
        "async def main():\n"
        "    app = build_app(parse(['--region=r', '--control-plane=127.0.0.1:9',\n"
        f"        '--state-dir={tmp_path}', '--redis=redis://127.0.0.1:1/0']))\n"
        "    server = TestServer(app)\n"
        "    await server.start_server()\n"
        "    await asyncio.sleep(0.2)\n"
        "    await server.close()\n"
        "asyncio.run(main())\n"
        "print('numpy' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stdout.strip() == "False", run.stderr


def test_the_redis_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--region=r"]).redis_url == ""
    assert parse(["--region=r"]).redis_deadline_s == 0.05
    assert parse(["--region=r", "--redis-deadline-ms=20"]).redis_deadline_s == 0.02
    assert parse(["--region=r", "--redis=redis://10.0.0.7:6379/1"]).redis_url == (
        "redis://10.0.0.7:6379/1"
    )
    with pytest.raises(SystemExit) as exit_:
        parse(["--region=r", "--redis=http://10.0.0.7:6379"])
    assert exit_.value.code == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "--redis 'http://10.0.0.7:6379': expected redis://HOST:PORT/DB" in error
