"""Composition root of the proxy: its parts, the routes, and their lifetimes.

`build_app` only builds and wires: it reads no file and starts nothing, so it
can run anywhere (a test, a worker before its loop). `Proxy.lifetime` is the
start and stop step: it loads the saved route table and rate-limit shares,
opens the GeoIP database and the upstream connection pool, and runs the
control-plane link and the cache sweeper until the app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from aiohttp import web

from dataplane.auth.authenticator import read_remote_jwks
from dataplane.auth.remote import KeySets
from dataplane.cache.regionstore import RegionalStore
from dataplane.cache.step import EdgeCache, SemanticLayer
from dataplane.cache.store import ExactStore
from dataplane.geo import TrustedProxies, open_locator
from dataplane.geo.home import ClientLocator
from dataplane.http import endpoints, stored
from dataplane.http.accesslog import AccessLog, Sampler
from dataplane.http.boundary import (
    CLIENT_CLOSED,
    CLIENT_GONE,
    cancel_reason,
    error_boundary,
    expect_continue,
    record_unparsed,
    returned_status,
    stream_open,
)
from dataplane.http.cors import API_PREFIX, preflight_handler
from dataplane.http.dispatch import with_direct
from dataplane.http.errors import ApiError
from dataplane.http.pipeline import ENDPOINTS, Endpoint, Exchange, Pipeline
from dataplane.http.requestid import RequestIds
from dataplane.http.state import (
    ACCESS_LOG,
    CLIENT,
    DRAINING,
    EXCHANGE,
    HOLDER,
    METRICS,
    PIPELINE,
    QUOTA,
    REQUEST_ID,
    REQUEST_IDS,
    SLOW_LOOK,
    UNPARSED,
    Draining,
)
from dataplane.metrics import Metrics
from dataplane.offload import OffLoop
from dataplane.placement.load import LoadBoard
from dataplane.placement.picker import Picker
from dataplane.placement.speed import SlowWatch
from dataplane.ratelimit.limiter import RateLimiter
from dataplane.settings import Settings
from dataplane.streaming.splice import TranscriptBudget
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient, traffic_of
from dataplane.sync.quota import QuotaState, other_layouts
from dataplane.upstream.forwarder import Forwarder
from dataplane.upstream.jwks import HttpFetch
from dataplane.upstream.outlier import OutlierDetector
from dataplane.upstream.stalls import Stalls
from dataplane.upstream.wire import USER_AGENT
from ponto.features import FEATURES
from ponto.proxynames import layout_siblings
from ponto.v1 import routing_pb2 as pb
from ponto.version import software_version

if TYPE_CHECKING:
    from dataplane.cache.regional import RegionLink
    from dataplane.cache.semantic import SemanticIndex
    from dataplane.cache.semfeed import Purges, RegionLinkLike, SemanticFeed
    from dataplane.telemetry.tracing import RequestTracer

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# How often expired cache entries are dropped, so memory follows the TTLs.
SWEEP_INTERVAL_S = 30.0
# How often the budgets' counts are saved for a restart (QuotaState.save_counts):
# a process killed loses at most what it spent in this long. And how often the
# proxy looks for origins that became slow or recovered, to log each change
# once (Proxy.tell_slow_origins): the picker reads speeds per request and logs
# nothing.
COUNTS_SAVE_S = 1.0

# The share of --cache-max-mb the semantic index may hold; the exact store has the
# rest and whatever the index does not use (docs/semantic-cache.md, "Memory").
SEMANTIC_SHARE = 0.5


def may_see_ipv6_clients(settings: Settings) -> bool:
    """Whether an IPv6 client can reach this proxy: it listens on an IPv6
    address or a host name (which may have one), or believes forwarding
    headers (--trusted-proxies), which name IPv6 clients whatever the hop's
    own family. Only a proxy on an IPv4 address that trusts no hop sees
    none, and is not warned that an IPv4-only --geoip-db cannot place them
    (review 323: ip-location-db's -ipv4 file is the right one for it)."""
    if settings.trusted_proxies:
        return True
    try:
        return ipaddress.ip_address(settings.listen_host).version == 6
    except ValueError:
        return True


class Proxy:
    """The proxy's parts, built and wired; `lifetime` starts and stops them."""

    def __init__(self, settings: Settings, tracer: RequestTracer | None = None) -> None:
        self.settings = settings
        self.tracer = tracer
        # Built by `lifetime` (it needs the upstream pool); also app[PIPELINE].
        self.pipeline: Pipeline | None = None
        self.metrics = m = Metrics(key_labels=settings.metrics_key_labels)
        # No answer is recorded past what this worker's store could keep
        # (--cache-max-entry-kb over its share of --cache-max-mb): the store
        # would refuse it after the recording, unseen (review 40).
        defaults = settings.cache
        if 0 < settings.cache_max_bytes < defaults.max_entry_bytes:
            defaults = replace(defaults, max_entry_bytes=settings.cache_max_bytes)
        # The JWKS URLs of tenants' issuers, fetched while a table names them.
        jwks_fetch = HttpFetch(settings.upstream.origin_ssl, USER_AGENT)
        self.key_sets = key_sets = KeySets(
            jwks_fetch, read_remote_jwks, on_close=jwks_fetch.close, state_dir=settings.state_dir
        )
        self.loads = LoadBoard()
        self.holder = holder = TableHolder(
            settings.region,
            settings.state_dir,
            defaults,
            key_sets=key_sets,
            scraped=self.loads.scraped_load,
        )
        # Spilling between regions follows the loads pushed, not tables.
        self.loads.on_change.append(holder.loads_changed)
        holder.on_apply.append(
            lambda routes, policy: key_sets.track(policy.authenticator.jwks_urls)
        )
        # Its budget counts are this process's (RateLimiter.epoch).
        self.limiter = RateLimiter(demand_tau_s=settings.demand_tau, epoch=time.time())
        # A --workers changed since the last start left counts under other
        # names, which no process of those names comes to report.
        place = settings.worker.index if settings.worker else None
        others = (
            other_layouts(settings.state_dir, place, settings.workers) if settings.state_dir else []
        )
        self.quota = quota = QuotaState(
            self.limiter,
            settings.state_dir,
            proxy=settings.name,
            others=others,
            siblings=layout_siblings(settings.name, place, settings.workers),
        )
        self.draining = Draining()
        self.local_store = local = ExactStore(max_bytes=settings.cache_max_bytes, clock=time.time)
        # Built with the semantic index (the model loads when a tenant first asks
        # for semantic caching); the local store keeps to one bound with it.
        self.semantic_index: SemanticIndex | None = None
        local.reserved = lambda: index.nbytes if (index := self.semantic_index) else 0
        self.store: ExactStore | RegionalStore = local
        # The region's Redis behind the local LRU; each worker of a --workers
        # group has its own link, so they share entries through Redis too.
        self.region_link: RegionLink | None = None
        # The region's semantic feed, when the proxy has a regional cache.
        self._semantic_feed: SemanticFeed | None = None
        if settings.redis_url:
            # Imported here: redis-py costs memory a proxy without it keeps.
            from dataplane.cache.regional import RegionLink  # noqa: PLC0415
            from dataplane.cache.regionside import RedisSide  # noqa: PLC0415

            self.region_link = RegionLink(
                settings.redis_url,
                m,
                deadline_s=settings.redis_deadline_s,
                password=settings.redis_password or None,
            )
            side = RedisSide(self.region_link)
            self.store = RegionalStore(local, side, name=settings.name, clock=time.time)
            self.semantic_feed = build_semantic_feed(
                settings, self.region_link, settings.redis_url, table_purges(holder)
            )
        store = self.store
        # The thread of large inputs' pure steps (dataplane.offload): the
        # parse of a body, its cache key.
        self.off_loop = OffLoop()
        self.cache = cache = EdgeCache(
            store,
            m,
            off_loop=self.off_loop,
            semantic_factory=self._semantic_index,
            forward_headers=settings.upstream.forward_headers,
            region_wait_s=settings.upstream.deadline,
        )
        m.endpoints_proxied(ENDPOINTS)
        holder.on_apply.append(lambda routes, policy: m.origins_named(routes.origins))
        holder.on_apply.append(
            lambda routes, policy: m.forget_callers(policy.tenants, policy.authenticator.key_ids)
        )
        holder.on_apply.append(lambda routes, policy: quota.on_limits(policy.limits))
        holder.on_apply.append(lambda routes, policy: cache.on_policy(policy))
        self.stalls = stalls = Stalls(settings.unhealthy_stream_idle_timeout)
        # Passive health, the forwarder's; what it ejected goes in reports.
        self.outliers = outliers = OutlierDetector()
        holder.on_apply.append(lambda routes, policy: outliers.table_marks_down(routes.down))
        holder.on_apply.append(stalls.on_apply)
        self.locator = ClientLocator(None, TrustedProxies(settings.trusted_proxies))
        self.access_log = None
        if settings.access_log:
            sampler = Sampler(settings.access_log_sample, probes=settings.access_log_probes)
            access = self.access_log = AccessLog(settings.region, self.locator.trusted, sampler)
            m.access_log_dropped.read = lambda: float(access.dropped)
        info = pb.ProxyInfo(
            name=settings.name,
            region=settings.region,
            address=settings.advertise,
            # This process's start, near enough: of two processes of one name
            # (a worker and its successor in a reload), the later one keeps it.
            started_at=time.time(),
            features=FEATURES,
        )
        self.client = client = ControlPlaneClient(
            holder,
            settings.control_plane,
            info,
            credentials=settings.credentials,
            on_quota=quota.on_quota,
            on_lost=quota.on_link_lost,
            on_loads=self.loads.apply,
            demand=quota.demand,
            traffic=lambda: traffic_of(
                m.requests, m.genai_duration, m.limited, m.not_cached, m.refused, m.excused
            ),
            ejected=outliers.ejected_report,
            report_interval=settings.report_interval,
            in_group=settings.worker is not None,
        )
        m.in_flight.is_stream = stream_open
        if tracer is not None:
            m.bind_tracing(tracer.exports.failed_batches, tracer.exports.dropped_spans)
        m.bind_auth(lambda: holder.policy.authenticator.problems if holder.policy else {})
        m.bind_jwks(key_sets)
        m.bind_cache(lambda: store.stats, local.reserved)
        self.transcripts = transcripts = TranscriptBudget(settings.max_transcripts_bytes)
        m.bind_transcripts(lambda: transcripts.held, transcripts.dropped)
        m.bind_semantic(lambda: cache.semantic)
        m.bind_fleet(lambda: dict(holder.refused), lambda: holder.fleet_id, lambda: holder.refusing)
        # On the board's clock, looked up at each read: tests replace it.
        self.slow_watch = SlowWatch(lambda: self.loads.speeds.clock())  # noqa: PLW0108 - replaced
        m.bind_speeds(self.slow_origins, lambda: holder.routes.origins if holder.routes else ())
        m.bind(
            version=lambda: float(holder.routes.version) if holder.routes else 0.0,
            connected=lambda: 1.0 if client.connected else 0.0,
            last_heard=lambda: holder.received_at,
            nacks=lambda: float(client.nacks),
            loads_age=self.loads.age,
        )

    @property
    def semantic_feed(self) -> SemanticFeed | None:
        """The region's semantic feed, when the proxy has a regional cache."""
        return self._semantic_feed

    @semantic_feed.setter
    def semantic_feed(self, feed: SemanticFeed | None) -> None:
        # Its series come with it: none without --redis (trial 50).
        if feed is not None and self._semantic_feed is None:
            self.metrics.bind_semantic_feed(lambda: self._semantic_feed)
        self._semantic_feed = feed

    async def stopping(self, app: web.Application) -> None:
        """The app's on_shutdown step. aiohttp's runner calls it once it has
        stopped listening, before it waits for the handlers still running and
        cancels those its shutdown timeout outlasts: with the app marked as
        draining, each of those is recorded as `cancelled` (the proxy stopped
        it), not as a client that left. Without --drain-seconds this is where
        the mark is set; with it, the entry point set it at SIGTERM."""
        self.draining.active = True

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """The start step, then (after the yield) the stop step."""
        settings = self.settings
        release = software_version()  # package metadata and the build's commit: once
        self.client.set_version(release)
        self.metrics.set_info(settings.name, settings.region, release)
        self.quota.load_saved()
        if self.holder.load_saved():
            # INFO: every start with a state directory does this (a group's
            # reload, once per worker); the link warns if no control plane answers.
            log.info("serving the saved route table until the control plane answers")
        self.locator.locator = open_locator(settings.geoip_db)
        locator, slot = self.locator.locator, settings.worker
        if (
            locator is not None
            and locator.ipv4_only
            and (slot is None or slot.index == 0)
            and may_see_ipv6_clients(settings)
        ):
            # Trial 78: on an IPv6 or dual-stack network such a file homed
            # every IPv6 client in this proxy's region without a word. Once
            # for a group: its workers read the same file.
            log.warning(
                "--geoip-db %s holds IPv4 addresses only: IPv6 clients are not located and "
                "are served from this proxy's region (%s) first; give a database that holds "
                "IPv6 addresses too (MaxMind's GeoLite2 City and DB-IP's City Lite do)",
                settings.geoip_db,
                settings.region,
            )
        if self.access_log is not None:
            self.access_log.start()
        if self.region_link is not None:
            await self.region_link.start()
        forwarder = Forwarder(
            self.metrics,
            settings.upstream,
            loads=self.loads,
            stalls=self.stalls,
            outliers=self.outliers,
        )
        # Built here, not in __init__: it needs the upstream pool.
        app[PIPELINE] = self.pipeline = Pipeline(
            self.holder,
            self.limiter,
            self.cache,
            self.locator,
            forwarder,
            self.metrics,
            Picker(self.loads),
            max_body_bytes=settings.max_body_bytes,
            session_header=settings.session_header,
            stream_idle_timeout=settings.stream_idle_timeout,
            stream_hold_s=settings.stream_hold_seconds,
            stalls=self.stalls,
            tracer=self.tracer,
            origin_stream_usage=settings.origin_stream_usage,
            draining=self.draining,
            transcripts=self.transcripts,
            off_loop=self.off_loop,
        )
        tasks = [
            asyncio.create_task(self.client.run(), name="control-plane-link"),
            asyncio.create_task(self._sweep(), name="cache-sweeper"),
            asyncio.create_task(self._each_second(), name="budget-counts-slow-origins"),
        ]
        if self.semantic_feed is not None:
            self.semantic_feed.start()
        try:
            yield
        finally:
            # Before the upstream pool closes: they hold origins' connections.
            await app[PIPELINE].close()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.semantic_feed is not None:
                await self.semantic_feed.close()
            await forwarder.close()
            await self.key_sets.close()
            if isinstance(self.store, RegionalStore):
                await self.store.close()
            if self.region_link is not None:
                await self.region_link.close()
            self.cache.close()  # the semantic index's embedding thread
            self.off_loop.close()
            self.locator.close()
            await self.holder.flush()
            self.quota.save_counts()  # the last requests' too: the pipeline is closed
            await self.quota.flush()
            self.quota.close()
            if self.access_log is not None:
                self.access_log.close()

    async def _each_second(self) -> None:
        # One timer for both: each wake-up costs an idle proxy instructions,
        # and the look for slow origins (once a second) needs no cadence of
        # its own. The look first: it cannot fail on a disk.
        while True:
            await asyncio.sleep(COUNTS_SAVE_S)
            self.tell_slow_origins()
            self.quota.save_counts()

    def slow_origins(self) -> dict[str, float]:
        """The origins of the served table this proxy judges slow now, each
        with its factor (SpeedBoard.judged); none before a table."""
        routes = self.holder.routes
        if routes is None:
            return {}
        return self.loads.speeds.judged(g for groups in routes.groups.values() for g in groups)

    def tell_slow_origins(self) -> None:
        """Log each origin that became slow since the last look, and each
        that recovered: once a change, at INFO (placement handles it; an
        operator may hedge its tenants, docs/streams.md). Once a second
        (COUNTS_SAVE_S, `_each_second`), and at once by tests (app[SLOW_LOOK])."""
        if not self.slow_watch.due(self.holder.routes, self.loads.speeds.mark()):
            return
        became, recovered = self.slow_watch.changes(self.slow_origins())
        for origin, factor in became.items():
            log.info(
                "origin %s judged slow: %.0fx its group's typical time (to a stream's first "
                "event, or per token); placement moves requests off it",
                origin,
                factor,
            )
        for origin in recovered:
            log.info("origin %s no longer judged slow", origin)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.store.sweep()

    def _semantic_index(self) -> SemanticLayer:
        """The MiniLM embedder (int8 ONNX, from the installed package) and its index,
        bounded by its share of the cache's memory and joined to the region's feed.

        Runs in an executor thread (EdgeCache loads it off the loop). Imported
        here: numpy, onnxruntime and the model cost memory only in proxies whose
        tenants use semantic caching.
        """
        from dataplane.cache.embed import MiniLmOnnxEmbedder  # noqa: PLC0415
        from dataplane.cache.semantic import SemanticIndex  # noqa: PLC0415

        index = SemanticIndex(
            MiniLmOnnxEmbedder(), max_bytes=int(self.settings.cache_max_bytes * SEMANTIC_SHARE)
        )
        index.on_grow = self.local_store.fit
        if self.semantic_feed is not None:
            self.semantic_feed.attach(index)
        self.semantic_index = index
        return index


def build_app(settings: Settings, tracer: RequestTracer | None = None) -> web.Application:
    """The proxy app. Builds and wires only; see the module docstring. With
    `tracer`, every proxied request is traced (dataplane.telemetry)."""
    proxy = Proxy(settings, tracer)
    ids = RequestIds()
    app = web.Application(
        middlewares=[error_boundary(proxy.metrics, proxy.draining, ids, proxy.access_log)],
        client_max_size=settings.max_body_bytes,
    )
    app[METRICS] = proxy.metrics
    app[HOLDER] = proxy.holder
    app[QUOTA] = proxy.quota
    app[DRAINING] = proxy.draining
    app[CLIENT] = proxy.client
    app[REQUEST_IDS] = ids
    if proxy.access_log is not None:
        app[ACCESS_LOG] = proxy.access_log

    def unparsed(request: web.BaseRequest, request_id: str, status: int, error: str) -> None:
        record_unparsed(app, request, request_id, status, error)

    app[UNPARSED] = unparsed
    app[SLOW_LOOK] = proxy.tell_slow_origins
    app.on_shutdown.append(proxy.stopping)
    app.cleanup_ctx.append(proxy.lifetime)
    r = app.router
    for endpoint in ENDPOINTS.values():
        r.add_post(
            "/v1/" + endpoint.upstream_path.lstrip("/"),
            proxied(endpoint, proxy),
            name=endpoint.name,
            expect_handler=expect_continue,
        )
    # A stored response's routes, each to the origin that stored it.
    stored.add_routes(r, lambda: proxy.pipeline)
    r.add_get("/v1/models", endpoints.list_models, name="models")
    r.add_get("/v1/models/{model:.+}", endpoints.retrieve_model, name="models.retrieve")
    if settings.cors is not None:
        # Browsers' preflights of the API's paths (each for the methods its
        # routes take), and its answers marked readable by the pages of the
        # origins listed (dataplane/http/cors.py).
        app.on_response_prepare.append(settings.cors.on_prepare)
        # A path may have a resource per method (GET and DELETE of a stored
        # response are two, so that each route keeps its own name, the
        # metrics' endpoint label): its preflight names the methods of all.
        by_path: dict[str, list[web.Resource]] = {}
        for resource in list(r.resources()):
            if isinstance(resource, web.Resource) and resource.canonical.startswith(API_PREFIX):
                by_path.setdefault(resource.canonical, []).append(resource)
        for resources in by_path.values():
            methods = ", ".join(
                sorted({route.method for res in resources for route in res} - {"HEAD"})
            )
            resources[0].add_route("OPTIONS", preflight_handler(settings.cors, methods))
    r.add_get("/healthz", endpoints.healthz, name="healthz")
    r.add_get("/health", endpoints.healthz, name="health")
    r.add_get("/readyz", endpoints.readyz, name="readyz")
    if settings.metrics_listen is None:
        r.add_get("/metrics", endpoints.metrics, name="metrics")
    return app


def build_metrics_app(app: web.Application) -> web.Application:
    """GET /metrics of the proxy `app`, alone, for `--metrics-listen`, and its
    liveness with its state (/healthz, /health: the public port's status,
    with the details the public port does not give).

    The same registry and error boundary; served by its own runner, so the
    public port does not answer /metrics at all. Its listener has no client
    connection cap (a plain AppRunner): a liveness probe here is answered
    while streams hold every connection the public port allows (trial 74:
    there it got the cap's 503 for up to 31 s, and a kubelet would have
    restarted a full but healthy proxy).
    """
    # No access log: its lines are the public port's.
    boundary = error_boundary(app[METRICS], app[DRAINING], app[REQUEST_IDS])
    metrics_app = web.Application(middlewares=[boundary])
    metrics_app[METRICS] = app[METRICS]
    metrics_app[DRAINING] = app[DRAINING]
    metrics_app[REQUEST_IDS] = app[REQUEST_IDS]
    metrics_app[HOLDER] = app[HOLDER]
    metrics_app[CLIENT] = app[CLIENT]
    metrics_app[QUOTA] = app[QUOTA]
    metrics_app.router.add_get("/metrics", endpoints.metrics, name="metrics")
    metrics_app.router.add_get("/healthz", endpoints.health_details, name="healthz")
    metrics_app.router.add_get("/health", endpoints.health_details, name="health")
    return metrics_app


def proxied(endpoint: Endpoint, proxy: Proxy) -> Handler:
    """The route handler of one proxied endpoint: `proxy`'s pipeline, on a new
    Exchange. The app serves only once its start step built the pipeline."""

    async def handle(request: web.Request) -> web.StreamResponse:
        pipeline = proxy.pipeline
        assert pipeline is not None
        if pipeline.holder.routes is None:
            # A proxy (or a worker of a group) that just started: its first
            # table is a round trip to the control plane away. A request that
            # beats it waits for it rather than failing; begin() refuses after.
            await pipeline.holder.wait_first()
        tracer = pipeline.tracer
        unsampled = None
        if tracer is not None:
            unsampled = tracer.unsampled_root(request.headers)
            if unsampled is None:
                return await traced(pipeline, tracer, request, endpoint)
        ex = pipeline.begin(request, endpoint)
        ex.traceparent = unsampled
        request[EXCHANGE] = ex
        return await pipeline.handle(request, ex)

    def direct(request: web.Request) -> Awaitable[web.StreamResponse]:
        # handle's usual case (a table, no tracer), whose frame each wait of the
        # request would pass through (some 900 instructions a wait): the
        # pipeline's coroutine, for FixedRoutes to await.
        pipeline = proxy.pipeline
        if pipeline is None or pipeline.holder.routes is None or pipeline.tracer is not None:
            return handle(request)
        ex = pipeline.begin(request, endpoint)
        request._state[EXCHANGE] = ex  # its dict: request[...] is a Python call
        return pipeline.handle(request, ex)

    handle.__name__ = f"handle_{endpoint.name.replace('.', '_')}"
    return with_direct(handle, direct)


async def traced(
    pipeline: Pipeline, tracer: RequestTracer, request: web.Request, endpoint: Endpoint
) -> web.StreamResponse:
    """The pipeline on a new Exchange, inside the request's span; the span ends
    with the status the client gets (a refusal's too, which the error boundary
    answers after this returns)."""
    trace = tracer.begin(
        endpoint.name, request.method, request.path, request.headers, request[REQUEST_ID]
    )
    ex = None
    status, error = 500, None
    try:
        ex = pipeline.begin(request, endpoint)
        ex.trace = trace
        request[EXCHANGE] = ex
        response = await pipeline.handle(request, ex)
        status = returned_status(ex, response)
        return response
    except ApiError as exc:
        status, error = _answered(ex, exc.status), exc.code or str(exc.status)
        raise
    except asyncio.CancelledError:
        status, error = CLIENT_CLOSED, cancel_reason(request)
        raise
    except ConnectionResetError:
        status, error = CLIENT_CLOSED, CLIENT_GONE
        raise
    except BaseException as exc:
        status, error = _answered(ex, status), type(exc).__qualname__
        raise
    finally:
        trace.finish(ex, status, error)


def _answered(ex: Exchange | None, status: int) -> int:
    """The status the client got: its answer's once one began (a failure
    after it is no answer of its own, boundary._after_answer), else `status`."""
    return ex.answer.status if ex is not None and ex.answer is not None else status


# ---------------------------------------------------------------- region feed


def build_semantic_feed(
    settings: Settings, link: RegionLinkLike, redis_url: str, purges: Callable[[], Purges]
) -> SemanticFeed:
    """The region's semantic feed of this proxy worker (dataplane.cache.semfeed).

    Call it where the proxy builds its RegionLink, only when it has a regional
    cache, and keep it as `Proxy.semantic_feed` (before `lifetime` runs): the
    proxy attaches it to the semantic index once that is built and starts and
    closes it with the app. `purges` gives the route table's cache purges.
    The stream keeps about as many entries as this worker's index can hold.
    """
    from dataplane.cache.semfeed import SemanticFeed, build_tail_client  # noqa: PLC0415
    from dataplane.cache.semsizes import (  # noqa: PLC0415
        DEFAULT_MAX_ENTRIES,
        ENTRY_BYTES,
        MINILM_DIM,
        MINILM_ID,
    )

    most = int(settings.cache_max_bytes * SEMANTIC_SHARE) // (4 * MINILM_DIM + ENTRY_BYTES)
    return SemanticFeed(
        link,
        build_tail_client(redis_url, settings.redis_password or None),
        region=settings.region,
        proxy=settings.name,
        embedder=MINILM_ID,
        maxlen=max(1, min(DEFAULT_MAX_ENTRIES, most)),
        purges=purges,
    )


def table_purges(holder: TableHolder) -> Callable[[], Purges]:
    """The purges of the route table a proxy serves (none before its first)."""
    return lambda: holder.policy.purges if holder.policy is not None else ()
