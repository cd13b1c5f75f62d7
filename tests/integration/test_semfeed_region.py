"""The semantic region feed on a real redis-server: two proxies (an index and a feed
each) share their semantic entries; a new proxy replays the stream; a Redis that is
killed and restarted is caught up with; malformed, foreign and purged messages are
skipped.

The index runs on the hashing fake embedder (tests/unit/test_embed.py holds it to
the embedder contract); each proxy has its own RegionLink.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from redis.asyncio import Redis

from dataplane.cache.embed import HashingEmbedder
from dataplane.cache.entities import Entities, extract
from dataplane.cache.regional import RegionLink
from dataplane.cache.semantic import Inserted, SemanticIndex
from dataplane.cache.semfeed import SemanticFeed, build_tail_client, encode, stream_name
from dataplane.metrics import Metrics
from ponto.devenv import Redis as RedisServer
from ponto.devenv import start_redis

T = TypeVar("T")

Q = "how do i reset my password for the mobile app"
Q_NEAR = "how do I reset my password for the mobile app please"
THRESHOLD = 0.8
EMBEDDER = "hashing-256"


class Proxy:
    """One proxy's semantic half: its index and its feed."""

    def __init__(
        self,
        url: str,
        region: str,
        name: str,
        purges: list[tuple[int, str, str]],
        index: SemanticIndex | None = None,
    ) -> None:
        self.name = name
        self.url = url
        # The proxy's own link, watching Redis so it sees it come back unprompted.
        self.link = RegionLink(url, Metrics(), watch_tick_s=0.02, idle_ping_s=0.2)
        self.index = index if index is not None else SemanticIndex(HashingEmbedder())
        self.feed = SemanticFeed(
            self.link,
            build_tail_client(url),
            region=region,
            proxy=name,
            embedder=EMBEDDER,
            maxlen=1000,
            purges=lambda: purges,
            backoff_min=0.05,
            backoff_max=0.2,
        )
        self.feed.attach(self.index)

    async def start(self) -> Proxy:
        await self.link.start()
        self.feed.start()
        return self

    async def close(self) -> None:
        await self.feed.close()
        await self.link.close()
        self.index.close()


Region = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def region(redis_server: RedisServer) -> AsyncIterator[Region]:
    """Makes proxies of one fresh region (its own stream) on the session Redis."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    made: list[Proxy] = []

    async def make(
        proxy: str,
        purges: list[tuple[int, str, str]] | None = None,
        index: SemanticIndex | None = None,
    ) -> Proxy:
        p = Proxy(redis_server.url, name, proxy, purges or [], index)
        made.append(p)
        return await p.start()

    yield make
    for p in made:
        await p.close()
    client = Redis.from_url(redis_server.url)
    await client.delete(stream_name(name))
    await client.aclose()


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


async def test_an_insert_on_one_proxy_is_a_hit_candidate_on_the_other(region: Region) -> None:
    a, b = await region("proxy-a"), await region("proxy-b")
    await a.index.insert("t1", "m", "ctx", Q, "key-1")
    await eventually(lambda: b.feed.stats.applied == 1, "b adds a's entry")
    hit = await b.index.lookup("t1", "m", "ctx", Q_NEAR, THRESHOLD)
    assert hit is not None
    assert hit.key == "key-1"
    assert await b.index.lookup("t2", "m", "ctx", Q_NEAR, THRESHOLD) is None
    # a reads its own message back and skips it; b's entry is not published again
    await eventually(lambda: a.feed.stats.own == 1, "a skips its own message")
    await eventually(lambda: a.feed.stats.published == 1, "a counts its XADD")
    assert b.feed.stats.published == 0
    assert len(a.index) == 1


async def test_a_new_proxy_replays_the_stream_and_starts_warm(region: Region) -> None:
    a = await region("proxy-a")
    texts = [Q, "what is the weather like in lisbon tomorrow", "how to change my plan"]
    for i, text in enumerate(texts):
        await a.index.insert("t1", "m", "", text, f"key-{i}")
    await eventually(lambda: a.feed.stats.published == 3, "a publishes")
    c = await region("proxy-c")
    await eventually(lambda: len(c.index) == 3, "c replays three entries")
    hit = await c.index.lookup("t1", "m", "", Q_NEAR, THRESHOLD)
    assert hit is not None
    assert hit.key == "key-0"


async def test_malformed_foreign_and_purged_messages_are_skipped(region: Region) -> None:
    b = await region("proxy-b", purges=[(10, "t-purged", "")])
    stream = b.feed.stream
    vec = HashingEmbedder().embed([Q])[0]

    def message(
        key: str, tenant: str = "t1", embedder: str = EMBEDDER, rev: int = 0
    ) -> dict[bytes, bytes]:
        ins = Inserted(tenant, "m", "", key, vec, extract(Q))
        return encode(ins, proxy="proxy-x", embedder=embedder, purge_rev=rev)

    nan = vec.copy()
    nan[3] = np.nan
    raw = Redis.from_url(b.url)
    try:
        for fields in (
            {**message("bad-vector"), b"v": b"\x00" * 10},
            {**message("bad-json"), b"e": b"{"},
            {b"k": b"only-a-key"},
            {**message("nan-vector"), b"v": nan.tobytes()},
            message("other-embedder", embedder="another-model"),
            message("purged", tenant="t-purged", rev=9),
            message("after-purge", tenant="t-purged", rev=10),
            message("good"),
        ):
            await raw.xadd(stream, fields)  # type: ignore[arg-type]
    finally:
        await raw.aclose()
    await eventually(
        lambda: b.feed.last_id != b"0-0" and b.feed.stats.applied == 2, "the good ones"
    )
    stats = b.feed.stats
    assert (stats.malformed, stats.foreign, stats.purged, stats.refused) == (3, 1, 1, 1)
    hit = await b.index.lookup("t1", "m", "", Q_NEAR, THRESHOLD)
    assert hit is not None
    assert hit.key == "good"
    assert await b.index.lookup("t-purged", "m", "", Q_NEAR, THRESHOLD) is not None


async def test_a_proxy_restarted_under_its_name_replays_what_it_published(
    region: Region,
) -> None:
    before = await region("proxy-a")
    texts = [Q, "what is the weather like in lisbon tomorrow"]
    for i, text in enumerate(texts):
        await before.index.insert("t1", "m", "", text, f"key-{i}")
    await eventually(lambda: before.feed.stats.own == 2, "the first run reads its own")
    await before.close()
    after = await region("proxy-a")
    assert after.feed.publisher != before.feed.publisher
    assert after.feed.publisher.startswith("proxy-a.")
    await eventually(lambda: after.feed.stats.applied == 2, "the restart replays them")
    assert after.feed.stats.own == 0
    hit = await after.index.lookup("t1", "m", "", Q_NEAR, THRESHOLD)
    assert hit is not None
    assert hit.key == "key-0"
    # and still skips what it publishes itself
    await after.index.insert("t1", "m", "", "how to change my plan", "key-2")
    await eventually(lambda: after.feed.stats.own == 1, "the restart skips its own")
    assert len(after.index) == 3


class FailsOnce(SemanticIndex):
    """A real index whose first insert_vector raises, as a bug behind it would."""

    def __init__(self) -> None:
        super().__init__(HashingEmbedder())
        self.failed = False

    def insert_vector(
        self,
        tenant: str,
        model: str,
        context_hash: str,
        key: str,
        vector: np.ndarray[Any, np.dtype[np.float32]],
        entities: Entities,
    ) -> bool:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug behind insert_vector")
        return super().insert_vector(tenant, model, context_hash, key, vector, entities)


async def test_a_bug_behind_the_index_is_logged_once_counted_and_the_tail_goes_on(
    region: Region, caplog: pytest.LogCaptureFixture
) -> None:
    a = await region("proxy-a")
    b = await region("proxy-b", index=FailsOnce())
    texts = [Q, "what is the weather like in lisbon tomorrow", "how to change my plan"]
    with caplog.at_level(logging.ERROR, logger="dataplane.cache.semfeed"):
        for i, text in enumerate(texts):
            await a.index.insert("t1", "m", "", text, f"key-{i}")
        await eventually(lambda: b.feed.stats.applied == 2, "b applies what follows the bug")
        await b.index.insert("t1", "m", "", "a question of b's own", "key-b")
        await eventually(lambda: a.feed.stats.applied == 1, "b still publishes")
        await eventually(lambda: b.feed.stats.own == 1, "b reads its own message")
    assert b.feed.stats.internal_errors == 1
    assert b.feed.last_id == a.feed.last_id  # b's own message, read and skipped
    # the message it failed on (a's first) is lost; the ones after it are not
    assert await b.index.lookup("t1", "m", "", Q_NEAR, THRESHOLD) is None
    hit = await b.index.lookup("t1", "m", "", texts[2], 0.99)
    assert hit is not None
    assert hit.key == "key-2"
    (record,) = [r for r in caplog.records if r.name == "dataplane.cache.semfeed"]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError
    await b.feed.close()  # returns normally
    assert b.feed.stats.internal_errors == 1


async def test_the_tail_survives_redis_being_killed_and_catches_up_after(
    own_redis: RedisServer, redis_workdir: Path
) -> None:
    server = own_redis
    a = await Proxy(server.url, "restart", "proxy-a", []).start()
    b = await Proxy(server.url, "restart", "proxy-b", []).start()
    try:
        await a.index.insert("t1", "m", "", Q, "before")
        await eventually(lambda: b.feed.stats.applied == 1, "b gets the first entry")
        server.kill()
        await eventually(lambda: b.feed.stats.errors > 0, "b notices Redis is gone")
        # published while Redis is down: dropped and counted, the insert is fine
        await a.index.insert("t1", "m", "", "how to change my plan", "while-down")
        await eventually(lambda: a.feed.stats.dropped == 1, "a drops the message")
        assert len(a.index) == 2
        server = start_redis(redis_workdir, port=server.port)
        await eventually(lambda: a.link.available, "a's link sees Redis back")
        await a.index.insert("t1", "m", "", "what is the weather in lisbon", "after")
        await eventually(lambda: b.feed.stats.applied == 2, "b catches up", timeout=20)
        hit = await b.index.lookup("t1", "m", "", "what is the weather in lisbon", 0.99)
        assert hit is not None
        assert hit.key == "after"
    finally:
        await a.close()
        await b.close()
        server.stop()
