"""The control plane's HTTP port (--http-listen): the status page and its API.

- ``GET /`` the page (controlplane/static/, no external resources), ``GET
  /api/status`` the JSON it polls: regions with their origins and request
  rates, proxies with the table version they ACKed and their problems (a
  refused table, what they cannot use of theirs; `fleet_warnings`, what
  every Admin write warns of), replicas, tenants whose requests rate
  limits refused or held for a slot lately, and the suspended tenants and
  keys (`suspended`: a key's reason, since when, whether it expired too).
- ``POST /api/regions/{name}/drain`` and ``/undrain`` (and the same under
  ``/api/origins/``) write through the Catalog, as the Admin API's
  DrainRegion and DrainOrigin do, so the builder publishes a new table, and
  answer ``{"name", "drained", "warnings"}``: the warnings those calls send
  (model.drain_warnings), which the page shows.

Writes are on unless ``--http-writes off``, which is the default under
mutual TLS: this port cannot check the admin certificate the Admin API then
asks for, and the token crosses plain HTTP in the clear. They need the Admin
API's token as ``Authorization: Bearer TOKEN``; with no admin token
configured they are open, as the Admin API is.

A browser may send a form, or a POST without a body, to any site without
asking it first (no CORS preflight), and a page from elsewhere can reach
this port through DNS rebinding. So every write, token or not, must carry
``X-Ponto-Request: 1`` (a header a form cannot set, and a script from another
origin may not without a preflight this port never grants); one whose
``Sec-Fetch-Site`` is neither ``same-origin`` nor ``none``, or whose
``Origin`` names another host than ``Host``, is refused; and open writes (no
token) are refused unless ``Host`` is an IP address or ``localhost``, the
only names DNS rebinding cannot point elsewhere. With a token, rebinding
gains nothing: the page keeps the token in its origin's sessionStorage.

Every refusal is an OpenAI-style JSON error logged through the shared
refusal log (once, INFO, rate-limited), those of aiohttp's parser included
(the port runs on the proxy's edge, `StatusWeb.runner`); every answer
carries `x-request-id`, a 405 `Allow`. Proxies and their traffic are read
from etcd, regions and origins taken from the table the replica compiled
from it, so the page of any replica shows the whole fleet.

While etcd does not answer, `/api/status` still answers 200 with what the
replica holds in memory: regions, origins, their health, load and drains,
and the suspensions, all of its latest table (trial 73: the page went dark,
a 503, though those were known). `state_store` says the store is
unavailable (`available` false, its `error`, `since` when, by this
replica's clock, its reads began to fail); what only etcd holds is null,
unknown rather than empty: `proxies`, `replicas`, `leader`, `tenants` (the
proxies' reports) and each region's proxies and rates. Not a 503: the
answer is the page's, which has something to show; nothing probes it (the
chart's probes are gRPC health, whose `ponto.store` service says whether
etcd answers), and a client that wants the store's state reads
`state_store.available`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
from aiohttp import hdrs, web
from yarl import URL

from controlplane.api.admin import drain_warned
from controlplane.api.auditing import drain_changes, outcome_of
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.ejections import describe as describe_ejection
from controlplane.ejections import fleet_ejections
from controlplane.errors import (
    AlreadyExists,
    ControlPlaneError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutcomeUnknown,
    Unavailable,
)
from controlplane.fleetstate import table_state
from controlplane.fleetwarnings import fleet_warnings, origin_warnings, proxy_warnings
from controlplane.load import continuation_warning
from controlplane.model import DrainKind, Origin, ProxyRecord, Region
from controlplane.rates import NamedRateMeter, RateMeter, WindowMeter
from controlplane.registry import TRAFFIC_EVERY
from controlplane.suspensions import Suspensions, status_rows
from dataplane.http.edge import EdgeLimits, EdgeRunner
from dataplane.http.refusals import refusals
from dataplane.http.requestid import RequestIds
from dataplane.http.state import SERVER_NAME
from ponto.grpcconn import accepted_tokens, token_among
from ponto.logs import Throttled
from ponto.peers import client_of
from ponto.routetable import counts_for_spill, region_load
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
# A proxy not heard from for STALE_REPORTS of its replica's report writes
# (every TRAFFIC_EVERY seconds by default, --traffic-interval-ms, when they
# change) counts as sending nothing; that is also the rates' window: a few
# reports. The replica samples the proxies' reports for the rates, viewed or
# not (StatusWeb.sample_forever), twice per write, so that every report a
# replica writes is read before the next replaces it.
STALE_REPORTS = 3
# How long the page lists a proxy whose registration went (Departures).
DEPARTED_KEEP_S = 900.0
# The header every write must carry (see the module docstring).
REQUEST_HEADER = "X-Ponto-Request"
# /api/status is built at most this often; more viewers read the same answer.
STATUS_TTL = 0.5
# A failure of the store (an answer 503) is logged at most once per this many
# seconds for each method, route and message; the next line says how many
# were not (each viewer's poll of the page had logged one).
UNAVAILABLE_LOG_EVERY_S = 30.0
# Kinds of such lines tracked at once (a route's name is in its path).
MAX_UNAVAILABLE_LINES = 64
# The port's own limits: an admin page has a few viewers and scripts.
LIMITS = EdgeLimits(
    header_timeout=10.0,
    body_timeout=10.0,
    keepalive_timeout=15.0,
    max_connections=256,
    max_connections_per_client=64,
)
REQUEST_ID = web.RequestKey("request_id", str)
Sample = TypeVar("Sample")
Result = TypeVar("Result")

_ERRORS: dict[type[ControlPlaneError], tuple[int, str, str]] = {
    InvalidArgument: (400, "invalid_request_error", "invalid_argument"),
    NotFound: (404, "invalid_request_error", "not_found"),
    AlreadyExists: (409, "invalid_request_error", "already_exists"),
    FailedPrecondition: (409, "invalid_request_error", "failed_precondition"),
    Unavailable: (503, "server_error", "unavailable"),
    # The change may have been made: not a 503, which says it was not.
    OutcomeUnknown: (504, "server_error", "outcome_unknown"),
}
_HTTP_CODES = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
}
# A refusal's gRPC status name, so that the page's writes are counted in
# ponto_control_admin_calls_total under the same codes as the Admin API's.
_GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "FAILED_PRECONDITION",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


class Exposition(Protocol):
    """The replica's Prometheus metrics (controlplane.metrics.ControlMetrics)."""

    def render(self) -> tuple[bytes, str]: ...

    def admin_call(self, method: str, code: str) -> None: ...


class Auditor(Protocol):
    """Where admin actions are recorded (controlplane.audit.AuditLog)."""

    async def record(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        detail: dict[str, str] | None = None,
        source: str,
        result: str = "ok",
        message: str = "",
    ) -> None: ...


class Refused(Exception):
    """A request this port answers with an error; the message may reach the client."""

    def __init__(self, status: int, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        # A 429's Retry-After, in whole seconds.
        self.retry_after: int | None = None


def error_body(status: int, kind: str, code: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=_HEADERS
    )


class StatusWeb:
    """Handlers of the HTTP port. One event loop; owns nothing it must close."""

    def __init__(
        self,
        catalog: Catalog,
        publisher: Publisher,
        replica_id: str,
        *,
        admin_token: str | Sequence[str] = "",
        writes_off: str = "",
        audit: Auditor | None = None,
        metrics: Exposition | None = None,
        loads: Callable[[], pb.OriginLoads | None] = lambda: None,
        last_loads: Callable[[], pb.OriginLoads | None] = lambda: None,
        suspensions: Callable[[], Suspensions | None] = lambda: None,
        fleet_problem: Callable[[], str] = str,
        proxies_seen: Callable[[list[ProxyRecord]], None] = lambda proxies: None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        traffic_every: float = TRAFFIC_EVERY,
    ) -> None:
        """`traffic_every`: how often the replicas write their proxies'
        reports (ProxyRegistry's, --traffic-interval-ms). `suspensions`:
        what is suspended in the state of this replica's latest table
        (TableBuilder.suspensions), read from memory as the table is.
        `last_loads`: the leader's latest scrape whatever its age
        (LoadHub.loads), shown while the store is away. `fleet_problem`:
        what this replica knows of a fleet id lost
        (FleetWatch.problem), shown first among the fleet warnings.
        `proxies_seen`: told of every proxy registration each sample reads
        (FleetWatch.seen)."""
        self._catalog = catalog
        self._traffic_every = traffic_every
        self._stale_after = STALE_REPORTS * traffic_every
        self._publisher = publisher
        self._replica_id = replica_id
        # Every admin token accepted (a rotation's old and new); none: writes
        # need no token.
        self._tokens = accepted_tokens(admin_token)
        # Why writes are off (shown on the page), "" when they are on.
        self._writes_off = writes_off
        self._audit = audit
        self._metrics = metrics
        self._loads = loads  # the leader's latest load scrape, while fresh (LoadHub.fresh)
        self._last_loads = last_loads
        self._suspensions = suspensions
        self._fleet_problem = fleet_problem
        self._proxies_seen = proxies_seen
        self._clock = clock
        # Times of wrong admin tokens: a step of the wall clock must not
        # stretch or end their window.
        self._monotonic = monotonic
        self._token_misses = TokenMisses()
        self._sleep = sleep  # sample_forever's, between samples
        self._meter = RateMeter(window=self._stale_after)
        # Per proxy connection, its tenants' limit refusals and slot waits.
        self._limits = NamedRateMeter(window=self._stale_after)
        # Per proxy connection, what it sent each region (by name: a region
        # added to the table or a proxy's first request to one is no restart).
        self._served = NamedRateMeter(window=self._stale_after)
        self._departures = Departures()
        self._ids = RequestIds()
        self._unavailable: OrderedDict[tuple[str, str, str], Throttled] = OrderedDict()
        self._cached: tuple[float, bytes] = (float("-inf"), b"")
        # Since when (Unix time) the status's reads of etcd fail; None while
        # they work. Logged when they start failing, throttled while they do.
        self._store_away_since: float | None = None
        self._store_away_line = Throttled(
            log, every_s=UNAVAILABLE_LOG_EVERY_S, clock=self._monotonic
        )
        self._building: asyncio.Task[bytes] | None = None

    @property
    def writes(self) -> str:
        """How the page may change anything: "off", "token" or "open"."""
        if self._writes_off:
            return "off"
        return "token" if self._tokens else "open"

    def runner(self) -> web.AppRunner:
        """A runner of app() on the proxy's edge (dataplane.http.edge) with
        LIMITS: deadlines for a head and a body, a connection cap, and parser
        refusals (a header line over 8 KB, too many headers, bad framing)
        answered as JSON 431 or 400 with x-request-id and logged once."""
        return EdgeRunner(self.app(), LIMITS, access_log=None)

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._request_id, self._errors], client_max_size=64 * 1024
        )
        app.router.add_get("/", self._index)
        app.router.add_static("/static/", STATIC, follow_symlinks=False)
        app.router.add_get("/api/status", self._status)
        if self._metrics is not None:
            app.router.add_get("/metrics", self._metrics_page)
        for kind in ("regions", "origins"):
            for verb in ("drain", "undrain"):
                handler = functools.partial(self._drain, kind=kind, drained=verb == "drain")
                app.router.add_post(f"/api/{kind}/{{name}}/{verb}", handler)
        return app

    async def _metrics_page(self, request: web.Request) -> web.Response:
        assert self._metrics is not None
        body, content_type = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    @web.middleware
    async def _request_id(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every answer carries x-request-id: the client's own when plain, as
        the proxy's do (dataplane.http.requestid); and names the product as
        theirs do, not the Python and aiohttp versions aiohttp's prepare would
        write (it sets a Server only where none is). Here, not in an
        on_response_prepare hook: any such hook takes every answer off the
        edge's one-write path (dataplane.http.edge)."""
        request[REQUEST_ID] = request_id = self._ids.of(request.headers.get("x-request-id"))
        response = await handler(request)
        response.headers["x-request-id"] = request_id
        response.headers[hdrs.SERVER] = SERVER_NAME
        return response

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        allow = None
        try:
            return await handler(request)
        except Refused as exc:
            refused = exc
        except ControlPlaneError as exc:
            status, kind, code = _ERRORS.get(type(exc), (500, "server_error", "internal_error"))
            if status >= 500:
                self._say_failed(request, str(exc))
                return error_body(status, kind, code, str(exc))
            refused = Refused(status, kind, code, str(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind, code = _HTTP_CODES.get(exc.status, ("invalid_request_error", "bad_request"))
            refused = Refused(exc.status, kind, code, exc.reason)
            allow = exc.headers.get("Allow")
        except Exception:
            # A bug, not the client's fault: the traceback is for us, not for it.
            log.exception("%s %s failed", request.method, request.path[:100])
            return error_body(500, "server_error", "internal_error", "internal error")
        refusals.refused(
            refused.status,
            refused.code,
            str(refused),
            request_id=request[REQUEST_ID],
            remote=request.remote,
            what=f"{request.method} {request.path[:100]}",
        )
        response = error_body(refused.status, refused.kind, refused.code, str(refused))
        if allow is not None:  # a 405 names the methods the path takes
            response.headers["Allow"] = allow
        if refused.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="ponto-admin"'
        if refused.retry_after is not None:
            response.headers["Retry-After"] = str(refused.retry_after)
        return response

    def _say_failed(self, request: web.Request, message: str) -> None:
        """Log a failure of the control plane's own (the store away) at
        WARNING, throttled per method, route and message."""
        route = request.match_info.route.resource
        path = route.canonical if route is not None else request.path[:100]
        key = (request.method, path, message)
        line = self._unavailable.pop(key, None) or Throttled(
            log, every_s=UNAVAILABLE_LOG_EVERY_S, clock=self._monotonic
        )
        self._unavailable[key] = line
        while len(self._unavailable) > MAX_UNAVAILABLE_LINES:
            self._unavailable.popitem(last=False)
        line.log(logging.WARNING, "%s %s: %s", request.method, request.path[:100], message)

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers=_HEADERS)

    async def _status(self, request: web.Request) -> web.Response:
        body = await self.status_body()
        return web.Response(body=body, content_type="application/json", headers=_HEADERS)

    async def status_body(self) -> bytes:
        """/api/status as JSON: the answer built less than STATUS_TTL ago, or
        the build in flight, which every request arriving meanwhile shares."""
        built, body = self._cached
        if 0 <= self._clock() - built < STATUS_TTL:
            return body
        if self._building is None:
            self._building = asyncio.create_task(self._build())
            self._building.add_done_callback(self._built)
        # Shielded: a viewer who goes away does not cancel the others' build.
        return await asyncio.shield(self._building)

    async def _build(self) -> bytes:
        now = self._clock()
        body = orjson.dumps(await self.status(now))
        self._cached = (now, body)
        return body

    def _built(self, task: asyncio.Task[bytes]) -> None:
        self._building = None
        if not task.cancelled():
            task.exception()  # its waiters got it; retrieved so nothing warns

    async def status(self, now: float) -> dict[str, Any]:
        """What the page shows at `now` (Unix time): regions, origins, health
        and drains from the latest table this replica compiled (none before its
        first), proxies and replicas read from etcd, and the tenants whose
        requests the proxies' rate limits refused or held for a slot over the
        rates' window (`_tenant_row`), and what is suspended in the state that
        table was compiled from (controlplane.suspensions). Reading the
        proxies is a sample of their reports too (`sample`). With etcd not
        answering, what it alone holds is None (see the module docstring)."""
        try:
            proxies = sorted(await self._catalog.list_proxies(), key=lambda p: p.name)
            replicas, leader = await self._catalog.list_replicas()
        except Unavailable as exc:
            return self._without_store(now, str(exc))
        if self._store_away_since is not None:
            log.info("status page: the state store answers again")
            self._store_away_since = None
        replica_ids = {str(r.get("id", "")) for r in replicas}
        by_id = {str(r.get("id", "")): r for r in replicas}
        silences = self._catalog.replica_beats.silences()
        latest = self._publisher.latest
        latest_age = self._monotonic() - latest.published_at if latest else 0.0
        table = latest.table if latest else pb.RouteTable()
        latest_version = latest.version if latest else 0
        scraped = self._loads()
        loads = {load.origin: load for load in scraped.loads} if scraped else {}
        rates = self._measure(proxies, [r.name for r in table.regions], now)
        region_proxies: dict[str, int] = {}
        for p in proxies:
            region_proxies[p.region] = region_proxies.get(p.region, 0) + 1
        origins: dict[str, list[pb.Origin]] = {}
        for o in table.origins:
            origins.setdefault(o.region, []).append(o)
        tenant_limits = {t.name: t.limits for t in table.tenants}
        ejected = {
            origin: describe_ejection(e, now) for origin, e in fleet_ejections(proxies, now).items()
        }
        return {
            "replica": self._replica_id,
            "leader": leader,
            "replicas": sorted(replica_ids),
            "latest_version": latest_version,
            # The fleet id of this replica's tables (RouteTable.fleet_id).
            "fleet_id": table.fleet_id,
            "writes": self.writes,
            "writes_off": self._writes_off,
            "now": now,
            # What the rates average over (three report writes).
            "rates_window_s": self._stale_after,
            "regions": [
                _region_row(
                    r,
                    origins.get(r.name, []),
                    loads,
                    rates.arrived.get(r.name),
                    rates.served.get(r.name),
                    region_proxies.get(r.name, 0),
                    ejected,
                )
                for r in table.regions
            ],
            "proxies": [
                _proxy_row(
                    p,
                    latest_version,
                    now,
                    self._stale_after,
                    *table_state(p, by_id, latest, latest_age, silences),
                )
                for p in proxies
            ],
            # Proxies this replica saw listed that no longer are, whose replica
            # is gone too (trial 49: a region whose proxy's replica stopped
            # read "no proxy in this region" while it served).
            "departed": departed_rows(self._departures.gone(), replica_ids, now),
            # What every Admin write warns of while it lasts (fleetwarnings).
            "fleet_warnings": [
                *filter(None, [self._fleet_problem()]),
                *fleet_warnings(proxies),
                *origin_warnings(
                    (o.name, o.server_kind) for o in table.origins if not o.no_continuation
                ),
            ],
            "tenants": [
                _tenant_row(name, tenant, tenant_limits.get(name))
                for name, tenant in sorted(rates.tenants.items())
                if any(rate != 0.0 for rate in tenant)  # unknown (None) included
            ],
            # Whose callers the proxies refuse (403): during an incident, a
            # tenant's traffic that vanished may be an operator's doing.
            "suspended": status_rows(self._suspensions(), now),
            "state_store": {"available": True, "error": "", "since": None},
        }

    def _without_store(self, now: float, error: str) -> dict[str, Any]:
        """The status at `now` while etcd does not answer (`error`): what the
        latest table holds, and None for what only etcd does. The rates'
        meters are left as they are (fed nothing, they would forget every
        proxy's counters and measure from scratch once etcd is back)."""
        if self._store_away_since is None:
            self._store_away_since = now
        self._store_away_line.log(
            logging.WARNING,
            "status page: %s; showing the latest table's regions, origins and "
            "suspensions, proxies and replicas unknown",
            error,
        )
        latest = self._publisher.latest
        table = latest.table if latest else pb.RouteTable()
        # The last reading before the outage, however old (the leader cannot
        # write newer ones meanwhile), as the page's banner says.
        scraped = self._last_loads()
        loads = {load.origin: load for load in scraped.loads} if scraped else {}
        origins: dict[str, list[pb.Origin]] = {}
        for o in table.origins:
            origins.setdefault(o.region, []).append(o)
        regions = []
        for r in table.regions:
            row = _region_row(r, origins.get(r.name, []), loads, None, None, 0)
            row["proxies"] = None  # unknown, not none
            regions.append(row)
        return {
            "replica": self._replica_id,
            "leader": None,
            "replicas": None,
            "latest_version": latest.version if latest else 0,
            "writes": self.writes,
            "writes_off": self._writes_off,
            "now": now,
            "rates_window_s": self._stale_after,
            "regions": regions,
            "proxies": None,
            "departed": [],
            # The proxies' own warnings are in their registrations: unknown.
            "fleet_warnings": list(
                origin_warnings(
                    (o.name, o.server_kind) for o in table.origins if not o.no_continuation
                )
            ),
            "tenants": None,
            "suspended": status_rows(self._suspensions(), now),
            "state_store": {"available": False, "error": error, "since": self._store_away_since},
        }

    async def sample(self, now: float) -> None:
        """Read the proxies' reports from etcd and feed them to the rates'
        meters as of `now` (Unix time), as a page view does. May raise
        ControlPlaneError (etcd unavailable)."""
        latest = self._publisher.latest
        names = [r.name for r in latest.table.regions] if latest else []
        proxies = await self._catalog.list_proxies()
        self._proxies_seen(proxies)
        self._measure(proxies, names, now)

    async def sample_forever(self) -> None:
        """`sample` twice per report write until cancelled, whether or not
        anyone views the page: a meter measures from the samples it has, so
        one fed only by page views would measure from the first view (a burst
        before it, or before the window since the last view, counted nowhere).
        Fed so, its window holds every report of the last STALE_REPORTS
        writes whenever the page is opened. A failed read is logged when
        reads start failing and when they work again."""
        every = self._traffic_every / 2
        failing = False
        while True:
            await self._sleep(every)
            now = self._clock()
            try:
                await self.sample(now)
            except ControlPlaneError as exc:
                if not failing:
                    log.warning("status page rates: cannot read the proxies' reports: %s", exc)
                failing = True
                # Since when etcd is away, as these reads run whether or not
                # anyone views the page (review 291: a page build's first
                # failure was the time, and one after the next outage kept it).
                if self._store_away_since is None:
                    self._store_away_since = now
                continue
            except Exception:  # a bug here must not stop the rates for good
                if not failing:
                    log.exception("status page rates: sampling failed")
                failing = True
                continue
            self._store_away_since = None
            if failing:
                log.info("status page rates: reading the proxies' reports again")
            failing = False

    def _measure(self, proxies: list[ProxyRecord], regions: list[str], now: float) -> _Rates:
        """Feed each proxy's last report to the meters as of `now`, and sum
        their rates by region (`regions`: the table's) and tenant; meters of
        proxy connections no longer listed are forgotten."""
        self._departures.see(proxies, now)
        self._meter.retain({_connection(p) for p in proxies})
        self._limits.retain({_connection(p) for p in proxies})
        self._served.retain({_connection(p) for p in proxies})
        # Every region of the table served 0 until a proxy says otherwise
        # (with no proxy at all, nothing was served: not unknown).
        out = _Rates(served={name: [0.0, 0.0] for name in regions})
        for p in proxies:
            counts = (p.requests, p.server_errors, p.client_errors)
            rates = self._rates(self._meter, _connection(p), p, counts, now, (0.0,) * 3)
            arrived = out.arrived.setdefault(p.region, [0.0, 0.0, 0.0])
            _add(arrived, _unknown_counts(counts) if rates is None else rates)
            # By region name: one a proxy starts sending to counts from 0.
            served = {region: (n, errors) for region, n, errors in p.served}
            by_region = self._rates(self._served, _connection(p), p, served, now, {})
            for name, sent in (_unknown(served) if by_region is None else by_region).items():
                if name in out.served:  # a region still in the table
                    _add(out.served[name], sent)
            limited = {tenant: (n, waits) for tenant, n, waits in p.limited}
            by_tenant = self._rates(self._limits, _connection(p), p, limited, now, {})
            for tenant, held in (_unknown(limited) if by_tenant is None else by_tenant).items():
                _add(out.tenants.setdefault(tenant, [0.0, 0.0]), held)
        return out

    def _rates(
        self,
        meter: WindowMeter[Sample, Result],
        key: str,
        p: ProxyRecord,
        counts: Sample,
        now: float,
        quiet: Result,
    ) -> Result | None:
        """Rates of a proxy's `counts` as of its last report, kept under `key`
        in `meter`; `quiet` (no rates) when it has not been heard for a while."""
        if not p.heard_at:
            return None
        if now - p.heard_at > self._stale_after:
            # Its replica writes a change within traffic_every of hearing it,
            # so these counts still held twice that ago (a margin for a late
            # write): the sample a burst after a quiet spell is measured from,
            # as the burst may come in a single write. A guess: a write later
            # than the margin still counts, its report superseding the guesses
            # made after it was heard (WindowMeter), and measured over 2 *
            # traffic_every at least (the window's start as of the last guess,
            # made at most traffic_every after it was heard, if it is fresh).
            meter.observe(key, now - 2 * self._traffic_every, counts, guessed=True)
            return quiet
        return meter.observe(key, p.heard_at, counts, start=_counting_from(p))

    async def _drain(self, request: web.Request, *, kind: str, drained: bool) -> web.Response:
        """A drain or undrain, counted as the Admin API call that does the
        same (DrainRegion or DrainOrigin, an undrain too), so one series
        covers both ways in; audited as Drain<Kind> or Undrain<Kind>."""
        kind_name = "Region" if kind == "regions" else "Origin"
        method = "Drain" + kind_name
        action = ("Drain" if drained else "Undrain") + kind_name
        code = "OK"
        try:
            return await self._change_drain(request, kind=kind, drained=drained, action=action)
        except Refused as exc:
            code = _GRPC_CODES.get(exc.status, "UNKNOWN")
            raise
        except ControlPlaneError as exc:
            code = exc.status.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            if self._metrics is not None:
                self._metrics.admin_call(method, code)

    async def _change_drain(
        self, request: web.Request, *, kind: str, drained: bool, action: str
    ) -> web.Response:
        actor = self._authorize(request)
        name = request.match_info["name"]
        one: DrainKind = "region" if kind == "regions" else "origin"
        target = f"{one}/{name}"
        change: Callable[[str, bool], Awaitable[tuple[Region | Origin, bool]]] = (
            self._catalog.drain_region if kind == "regions" else self._catalog.drain_origin
        )
        result, message = "ok", ""
        detail = {"drained": "true" if drained else "false"}
        try:
            value, changed = await change(name, drained)
            detail["changes"] = drain_changes(drained, changed)
        except BaseException as exc:
            result, message = outcome_of(exc)
            raise
        finally:
            # The trail of admin actions, when the plane has one: refused
            # changes too, as the Admin API records them.
            if self._audit is not None:
                await self._audit.record(
                    actor=actor,
                    action=action,
                    target=target,
                    detail=detail,
                    source=f"http:{request.remote}",
                    result=result,
                    message=message,
                )
        log.info(
            "%s %s from the status page (%s, %s)",
            "drained" if drained else "undrained",
            target,
            actor,
            request.remote,
        )
        # What `pontoctl drain` would print as warnings (a model left with no
        # undrained origin, an origin its drained region keeps idle, a region
        # all of whose origins are drained; none for a drain button on a stale
        # page, which changed nothing).
        warnings = await drain_warned(self._catalog, one, value.name, drained, changed)
        answer = {
            "name": value.name,
            "drained": value.drained,
            "changed": changed,
            "warnings": list(warnings),
        }
        return web.Response(
            body=orjson.dumps(answer), content_type="application/json", headers=_HEADERS
        )

    def _authorize(self, request: web.Request) -> str:
        """The actor making a write, or Refused."""
        if self._writes_off:
            raise Refused(403, "permission_error", "writes_off", self._writes_off)
        _check_same_origin(request)
        if not self._tokens:
            if not _rebind_proof(request.host):
                raise Refused(
                    403,
                    "permission_error",
                    "host_not_allowed",
                    "with no admin token, changes are taken only at an IP address or "
                    "localhost (DNS rebinding cannot point those elsewhere)",
                )
            return "anonymous"
        sent = request.headers.getall("Authorization", [])
        if len(sent) > 1:
            # Which one counts would be each reader's guess (a proxy in front
            # may read another), as at the edge (trial 23).
            raise Refused(
                400,
                "invalid_request_error",
                "multiple_authorization_headers",
                f"send one Authorization header: this request has {len(sent)}",
            )
        scheme, _, given = (sent[0] if sent else "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Refused(
                401,
                "authentication_error",
                "missing_admin_token",
                "this needs the admin token: Authorization: Bearer TOKEN",
            )
        if not token_among(given.strip(), self._tokens):
            # Only wrong tokens are held off: the right one always passes, so
            # that a guesser behind the same address (a port-forward, an
            # ingress) cannot lock operators out (review 205).
            address, now = request.remote or "", self._monotonic()
            wait = self._token_misses.wait(address, now)
            if wait:
                refused = Refused(
                    429,
                    "rate_limit_error",
                    "too_many_wrong_tokens",
                    f"{TOKEN_MISSES} wrong admin tokens from this address within "
                    f"{TOKEN_MISS_WINDOW_S:g} s: try again in {math.ceil(wait)} s",
                )
                refused.retry_after = math.ceil(wait)
                raise refused
            self._token_misses.missed(address, now)
            # 401, as the Admin API's UNAUTHENTICATED: the token is not this
            # plane's (trial 48: a 403 said it was known and not allowed).
            raise Refused(
                401,
                "authentication_error",
                "invalid_admin_token",
                "the admin token given is not this control plane's admin token",
            )
        return "admin-token"


# Wrong admin tokens one address may send in a window before its writes are
# refused for the rest of it (429): guessing a token of the length `pontoctl`
# makes is hopeless anyway, but nothing stopped a script from trying (trial 48).
TOKEN_MISSES = 10
TOKEN_MISS_WINDOW_S = 60.0
# Addresses remembered at most: the oldest is forgotten first.
TOKEN_MISS_ADDRESSES = 1024


class TokenMisses:
    """Wrong admin tokens per client over the last TOKEN_MISS_WINDOW_S (times
    from the caller's clock). A client is a peer's address as client_of
    reads it: an IPv6 one by its /64, from any address of which one host may
    send (a guesser rotating through its /64 had a throttle per address and
    pushed the others' out of TOKEN_MISS_ADDRESSES; review 323)."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}

    def missed(self, address: str, now: float) -> None:
        address = client_of(address)
        times = self._recent(address, now)
        times.append(now)
        self._times.pop(address, None)
        self._times[address] = times  # last: the most recent address
        while len(self._times) > TOKEN_MISS_ADDRESSES:
            del self._times[next(iter(self._times))]

    def wait(self, address: str, now: float) -> float:
        """Seconds until `address` may send a token again (0: now)."""
        times = self._recent(client_of(address), now)
        if len(times) < TOKEN_MISSES:
            return 0.0
        return max(0.0, times[-TOKEN_MISSES] + TOKEN_MISS_WINDOW_S - now)

    def _recent(self, address: str, now: float) -> list[float]:
        times = [t for t in self._times.get(address, ()) if now - t < TOKEN_MISS_WINDOW_S]
        if times:
            self._times[address] = times
        else:
            self._times.pop(address, None)
        return times


def _check_same_origin(request: web.Request) -> None:
    """Refuse a write a browser sent on behalf of another site (module docstring)."""
    cross = Refused(
        403,
        "permission_error",
        "cross_site_request",
        "changes are taken only from this page or a script, not from another site",
    )
    if request.headers.get(REQUEST_HEADER) != "1":
        raise Refused(
            403,
            "permission_error",
            "missing_request_header",
            f"changes need the header {REQUEST_HEADER}: 1",
        )
    if request.headers.get("Sec-Fetch-Site", "none") not in ("same-origin", "none"):
        raise cross
    origin = request.headers.get("Origin")
    if origin is not None:
        try:
            authority = URL(origin).raw_authority
        except ValueError:
            raise cross from None
        if authority.lower() != request.host.lower():
            raise cross


def _rebind_proof(host: str) -> bool:
    """Whether a Host header ("name[:port]", "[v6]:port") names an IP address or localhost."""
    if host.startswith("["):
        name, bracket, _ = host[1:].partition("]")
        if not bracket:
            return False
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    if name.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _connection(p: ProxyRecord) -> str:
    """A proxy's rate key: one connection, so a restart under the same name
    starts its rates afresh."""
    return f"{p.name}/{p.session_id}"


def _origin_row(o: pb.Origin, load: pb.OriginLoad | None, ejected: str = "") -> dict[str, Any]:
    # The leader's scrape's requests (tables carry no load); None when it has
    # none of the origin: a 0 there looked measured (trial 66: a llama.cpp
    # origin with 8 in flight read "0 / 4 (0%)").
    inflight = load.running + load.waiting if load else None
    warning = "" if o.no_continuation else continuation_warning(o.name, o.server_kind)
    return {
        "name": o.name,
        "healthy": o.healthy,
        # False: probing is off for it (healthy then says only that no probe
        # judges it; the proxies' passive health, `ejected`, does).
        "probed": not o.not_probed,
        "detail": o.health_detail,
        # What the proxies' passive health says when it ejected the origin
        # ("": none did), which probes of /health miss (trial 49).
        "ejected": ejected,
        "drained": o.drained,
        "inflight": inflight,
        "capacity": o.capacity,
        "load": inflight / o.capacity if o.capacity and inflight is not None else None,
        "models": list(o.models),
        # Public model name -> the origin's own name for it, for those sent
        # under another name ({}: every model under its public name).
        "model_names": dict(o.model_names),
        # The server its metrics page shows (controlplane.load.KINDS); None
        # until a page was read.
        "server": o.server_kind or None,
        # From the server's load figures, when it exposes them; None otherwise.
        "running": load.running if load else None,
        "waiting": load.waiting if load else None,
        "kv_cache_usage": load.kv_cache_usage if load and load.kv_cache_usage >= 0 else None,
        # Prefix-cache hits over lookups since the scrape before (tokens).
        "prefix_hit_rate": load.prefix_hit_rate if load and load.prefix_hit_rate >= 0 else None,
        # Continuation on, on a server that cannot continue ("": none).
        "continuation_warning": warning,
    }


def _region_row(
    r: pb.Region,
    origins: list[pb.Origin],
    loads: dict[str, pb.OriginLoad],
    rates: list[float | None] | None,
    served: list[float | None] | None,
    proxies: int,
    ejected: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A region as the page shows it: `requests_per_s` and its errors are of
    the requests its own proxies answered (where clients arrived; None with
    no proxy there), `served_per_s` and `served_errors_per_s` of the proxied
    requests its origins served for any proxy (the proxy's own region for
    cache answers; none for requests the proxy refused itself, which count
    only where they arrived: dataplane.http.boundary.refused_here); each
    None while unknown (`_Rates`).
    `ejected`: origin -> what the proxies' passive health says of it."""
    ejected = ejected or {}
    rows = [_origin_row(o, loads.get(o.name), ejected.get(o.name, "")) for o in origins]
    return {
        "name": r.name,
        "latitude": r.latitude,
        "longitude": r.longitude,
        "drained": r.drained,
        # As the proxies reckon it for spilling, from the same loads.
        "load": region_load(
            (o.capacity, row["inflight"])
            for o, row in zip(origins, rows, strict=True)
            if counts_for_spill(o)
        ),
        "origins": rows,
        "proxies": proxies,
        "requests_per_s": rates[0] if rates else None,
        "server_errors_per_s": rates[1] if rates else None,
        "client_errors_per_s": rates[2] if rates else None,
        "served_per_s": served[0] if served else None,
        "served_errors_per_s": served[1] if served else None,
    }


@dataclass
class _Rates:
    """The fleet's rates as of one sample, summed over its proxies: by region
    the requests that arrived there (requests, 5xx, 4xx per second) and that
    it served (requests, errors); by tenant those refused by a rate limit and
    held for a slot. Each None where a proxy counted some whose rate is
    unknown (`_unknown_counts`): a sum without them would pass for the
    region's or tenant's whole rate."""

    arrived: dict[str, list[float | None]] = field(default_factory=dict)
    served: dict[str, list[float | None]] = field(default_factory=dict)
    tenants: dict[str, list[float | None]] = field(default_factory=dict)


def _add(total: list[float | None], rates: Sequence[float | None]) -> None:
    """Add one proxy's rates to a sum over proxies, unknown (None) where either is."""
    for i, rate in enumerate(rates):
        was = total[i]
        total[i] = None if was is None or rate is None else was + rate


def _unknown_counts(counts: Sequence[int]) -> tuple[float | None, ...]:
    """The rates of a proxy's counts while they are unknown (the first report
    this replica read of its connection, or its first since a restart: when
    they grew is not known): unknown where it counted some, 0 where it
    counted none since it started (a proxy never heard from counted none)."""
    return tuple(None if n else 0.0 for n in counts)


def _unknown(named: dict[str, tuple[int, int]]) -> dict[str, tuple[float | None, ...]]:
    """`_unknown_counts` of each name of a proxy's report: a tenant (one it
    refused but never held for a slot: refusals unknown, slot waits 0) or a
    region it sent requests to."""
    return {name: _unknown_counts(counts) for name, counts in named.items()}


def _tenant_row(name: str, rates: list[float | None], limits: pb.Limits | None) -> dict[str, Any]:
    """A tenant some limit held back, summed over the proxies: requests per
    second refused by a rate limit (a 429, or a 400 for an estimate above
    its tokens per minute; after a slot wait too) and held for a concurrency
    slot (however the wait ended: admitted, refused, or abandoned by its
    client), by the tenant's limits or its keys'; None while unknown (a
    proxy just connected, or this replica just started, and counted some).
    `limits`: the tenant's own, as the table has them (0: none)."""
    return {
        "name": name,
        "refused_per_s": rates[0],
        "slot_waits_per_s": rates[1],
        "rpm": limits.rpm if limits else 0,
        "tpm": limits.tpm if limits else 0,
        "concurrency": limits.concurrency if limits else 0,
        "tokens_per_day": limits.tokens_per_day if limits else 0,
        "tokens_per_month": limits.tokens_per_month if limits else 0,
    }


def departed_rows(
    gone: list[tuple[ProxyRecord, float]], live_replicas: set[str], now: float
) -> list[dict[str, Any]]:
    """The departed proxies (Departures.gone) the page lists: those whose
    replica is gone too, which may still serve from their last table. One
    whose replica lives ended its own stream: it stopped (a rollout replaces
    every pod: helper-191), or it reconnects elsewhere and is listed again."""
    return [
        {
            "name": p.name,
            "region": p.region,
            "address": p.address,
            "replica": p.control_plane_id,
            "left_s": max(0.0, now - left),
        }
        for p, left in gone
        if p.control_plane_id not in live_replicas
    ]


class Departures:
    """The proxies whose registration went since this replica last read them:
    stopped, or cut off from the control plane (their replica stopped, or a
    partition), in which case they may still serve clients from their last
    table. Kept DEPARTED_KEEP_S, or until the name registers again (a reload's
    successor keeps the name: no departure). What this replica saw only: one
    started since knows of none."""

    def __init__(self, keep_s: float = DEPARTED_KEEP_S) -> None:
        self._keep_s = keep_s
        self._listed: dict[str, ProxyRecord] = {}
        self._gone: dict[str, tuple[ProxyRecord, float]] = {}

    def see(self, proxies: list[ProxyRecord], now: float) -> None:
        """The proxies listed at `now` (Unix time)."""
        listed = {p.name: p for p in proxies}
        for name, p in self._listed.items():
            if name not in listed and name not in self._gone:
                self._gone[name] = (p, now)
        self._gone = {
            name: (p, left)
            for name, (p, left) in self._gone.items()
            if name not in listed and now - left < self._keep_s
        }
        self._listed = listed

    def gone(self) -> list[tuple[ProxyRecord, float]]:
        """Each departed proxy's last record and when it was first missed, by name."""
        return [self._gone[name] for name in sorted(self._gone)]


def _proxy_row(
    p: ProxyRecord,
    latest: int,
    now: float,
    quiet_after: float,
    unknown: str = "",
    stale: bool = False,
) -> dict[str, Any]:
    """A proxy's row; `unknown`: why its table state is not known, when it
    is not latest whatever it ACKed; `stale`: its route stream may be gone,
    its replica silent (both fleetstate.table_state's).
    `quiet` says it reported no change for `quiet_after` seconds: an idle
    proxy, connected all the same, as only changes are written."""
    heard = p.heard_at or p.connected_at
    # Versions are each replica's own etcd revision: a proxy is compared with
    # the table of the replica it is connected to, this one's until known.
    current = p.replica_version or latest
    return {
        "name": p.name,
        "region": p.region,
        "address": p.address,
        "version": p.version,
        "replica": p.control_plane_id,
        "acked_version": p.acked_version,
        "current_version": current,
        "latest": bool(current) and p.acked_version >= current and not unknown,
        "unknown": unknown,
        "last_error": p.last_error,
        # What it reported it cannot use of the table it serves (a tenant's JWT
        # config, say), beside a refusal of the last one (last_error).
        "warnings": list(proxy_warnings(p)),
        "age_s": max(0.0, now - heard),
        "quiet": now - heard > quiet_after,
        "stale": stale,
        "requests": p.requests,
    }


def _counting_from(p: ProxyRecord) -> float | None:
    """When, by its replica's clock, proxy `p`'s counters were 0: its start,
    as its registration said it (trial 22: a burst in a proxy's first
    seconds, all in its first report, showed no rate); None when not known.
    Not its own start time: that is the proxy's clock, and one a little
    ahead would make the rates of its first report many times over."""
    return p.counting_from or None
