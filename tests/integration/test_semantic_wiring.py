"""The composition root joins the semantic index to the exact store's bound and to the
region's feed: server.Proxy with build_semantic_feed, the real MiniLM model (its
load costs a second or two) and a real redis-server for the feed's connections."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TypeVar

from dataplane.cache.regional import RegionLink
from dataplane.cache.semantic import SemanticIndex
from dataplane.cache.semfeed import build_tail_client
from dataplane.http.server import SEMANTIC_SHARE, Proxy, build_semantic_feed, table_purges
from dataplane.settings import parse as parse_proxy
from ponto.devenv import Redis as RedisServer

T = TypeVar("T")


async def test_the_semantic_index_joins_the_store_bound_and_the_feed(
    tmp_path: Path, clean_redis: RedisServer
) -> None:
    settings = parse_proxy(
        [
            "--region=wiring",
            "--name=proxy-w",
            "--control-plane=127.0.0.1:9",
            f"--state-dir={tmp_path}",
            "--cache-max-mb=8",
        ]
    )
    proxy = Proxy(settings)
    link = RegionLink(clean_redis.url, proxy.metrics, watch_tick_s=None)
    feed = build_semantic_feed(settings, link, clean_redis.url, table_purges(proxy.holder))
    proxy.semantic_feed = feed
    assert feed.stream == "ponto:sem:wiring"
    feed.start()
    try:
        proxy.cache._load_semantic()  # as the first table with a semantic tenant does
        for _ in range(600):
            if proxy.cache.semantic is not None:
                break
            await asyncio.sleep(0.05)
        index = proxy.cache.semantic
        assert isinstance(index, SemanticIndex)
        assert proxy.semantic_index is index
        assert index.on_insert == feed.publish
        assert index.on_grow == proxy.local_store.fit
        await index.insert("t", "m", "", "how do I reset my password", "key-1")
        await index.flush()
        # the store yields to the index's bytes; the metric counts both
        assert proxy.local_store.reserved() == index.nbytes > 0
        scrape = proxy.metrics.registry.get_sample_value
        assert scrape("ponto_cache_bytes") == index.nbytes
        assert scrape("ponto_semantic_bytes") == index.nbytes
        for _ in range(100):  # the sender publishes in the background
            if feed.stats.published:
                break
            await asyncio.sleep(0.05)
        assert scrape("ponto_semantic_feed_published_total") == 1
        assert scrape("ponto_semantic_feed_internal_errors_total") == 0
        assert await link.client.xlen(feed.stream) == 1
        # the index keeps to its share of --cache-max-mb
        assert index._max_bytes == int(8 * 2**20 * SEMANTIC_SHARE)
    finally:
        await feed.close()
        await link.close()
        proxy.cache.close()
        if proxy.semantic_index is not None:
            proxy.semantic_index.close()
    assert build_tail_client(clean_redis.url).connection_pool.max_connections == 1
