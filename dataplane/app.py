"""Composition root of the proxy: the aiohttp app and the lifetimes of its parts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

import aiohttp
from aiohttp import web

from dataplane.cache.store import ExactStore
from dataplane.edgecache import EdgeCache, SemanticLayer
from dataplane.geo import TrustedProxies, open_locator
from dataplane.geo.home import ClientLocator
from dataplane.handlers import (
    errors_and_metrics,
    healthz,
    list_models,
    make_proxy_handler,
    metrics,
    readyz,
)
from dataplane.metrics import Metrics
from dataplane.quota import QuotaState
from dataplane.ratelimit.limiter import RateLimiter
from dataplane.settings import Settings
from dataplane.state import (
    CACHE,
    CLIENT,
    DRAINING,
    FORWARDER,
    HOLDER,
    LIMITER,
    LOCATOR,
    METRICS,
    QUOTA,
    SETTINGS,
    Draining,
)
from dataplane.sync import ControlPlaneClient, TableHolder
from dataplane.upstream import Forwarder
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)


def software_version() -> str:
    try:
        return version("ponto")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "dev"


def build_app(settings: Settings) -> web.Application:
    """The proxy app; its upstream session and control plane link live with it."""
    app = web.Application(
        middlewares=[errors_and_metrics],
        client_max_size=settings.max_body_bytes,
        handler_args={"max_field_size": 16384},
    )
    app[SETTINGS] = settings
    app[METRICS] = m = Metrics()
    holder = TableHolder(settings.region, settings.state_dir, settings.cache)
    app[LIMITER] = limiter = RateLimiter()
    quota = QuotaState(limiter, settings.state_dir)
    app[QUOTA] = quota
    app[DRAINING] = Draining()
    holder.on_apply.append(lambda routes, policy: quota.on_limits(policy.limits))
    store = ExactStore(max_bytes=settings.cache_max_bytes, clock=time.time)
    app[CACHE] = cache = EdgeCache(
        store,
        m,
        semantic_factory=_semantic_index,
        forward_headers=settings.upstream.forward_headers,
    )
    m.bind_cache(lambda: store.stats)
    m.bind_semantic(lambda: cache.semantic)
    holder.on_apply.append(lambda routes, policy: cache.on_policy(policy))
    if holder.load_saved():
        log.warning("serving the saved route table until the control plane answers")
    app[HOLDER] = holder
    info = pb.ProxyInfo(
        name=settings.name,
        region=settings.region,
        address=settings.advertise,
        version=software_version(),
    )
    app[CLIENT] = client = ControlPlaneClient(
        holder,
        settings.control_plane,
        info,
        credentials=settings.credentials,
        on_quota=quota.on_quota,
        demand=quota.demand,
        report_interval=settings.report_interval,
    )
    m.bind(
        version=lambda: float(holder.routes.version) if holder.routes else 0.0,
        connected=lambda: 1.0 if client.connected else 0.0,
        last_heard=lambda: holder.received_at or holder.applied_at,
        nacks=lambda: float(client.nacks),
    )
    app[LOCATOR] = ClientLocator(
        open_locator(settings.geoip_db), TrustedProxies(settings.trusted_proxies)
    )
    app.on_cleanup.append(_close_locator)
    app.cleanup_ctx.append(_upstream)
    app.cleanup_ctx.append(_cache_sweeper)
    app.cleanup_ctx.append(_control_plane)
    r = app.router
    r.add_post(
        "/v1/chat/completions", make_proxy_handler("chat.completions"), name="chat.completions"
    )
    r.add_post("/v1/completions", make_proxy_handler("completions"), name="completions")
    r.add_post("/v1/embeddings", make_proxy_handler("embeddings"), name="embeddings")
    r.add_get("/v1/models", list_models, name="models")
    r.add_get("/healthz", healthz, name="healthz")
    r.add_get("/readyz", readyz, name="readyz")
    r.add_get("/metrics", metrics, name="metrics")
    return app


def _semantic_index() -> SemanticLayer:
    """The MiniLM embedder (int8 ONNX, from the installed package) and its index.

    Imported here: numpy, onnxruntime and the model cost memory only in proxies
    whose tenants use semantic caching.
    """
    from dataplane.cache.embed import MiniLmOnnxEmbedder  # noqa: PLC0415
    from dataplane.cache.semantic import SemanticIndex  # noqa: PLC0415

    return SemanticIndex(MiniLmOnnxEmbedder())


async def _close_locator(app: web.Application) -> None:
    app[LOCATOR].close()


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    # Per origin at most 1024 connections: past that, bursts wait for a free
    # keep-alive connection instead of opening (and tearing down) new ones.
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=1024, ttl_dns_cache=60, keepalive_timeout=30
    )
    session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
    app[FORWARDER] = Forwarder(session, app[METRICS], app[SETTINGS].upstream)
    yield
    await session.close()


async def _cache_sweeper(app: web.Application) -> AsyncIterator[None]:
    """Drop expired entries now and then, so memory follows the TTLs; at the end,
    stop the semantic index's embedding thread."""

    async def sweep() -> None:
        while True:
            await asyncio.sleep(30)
            app[CACHE].store.sweep()

    task = asyncio.create_task(sweep(), name="cache-sweeper")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    app[CACHE].close()


async def _control_plane(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[CLIENT].run(), name="control-plane-link")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
