"""The Routing service: proxy registration and the route table stream.

RouteStream is registered through a generic handler whose response serializer
is the identity, so the bytes serialised once per push by the Publisher (and
once per change of origin loads by the LoadHub) go to every stream as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from controlplane.api.errors import grpc_errors
from controlplane.distribute import Publisher, Snapshot
from controlplane.errors import InvalidArgument
from controlplane.fleetid import WOULD_OPEN_NACK, FleetWatch
from controlplane.loadsync import LoadHub
from controlplane.metrics import ControlMetrics
from controlplane.model import NAME_RE, check_name
from controlplane.quotasync import QuotaHub
from controlplane.registry import ProxyRegistry
from controlplane.store import StoreError
from ponto import linkadvice, tlsfiles
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)
SERVICE = "ponto.v1.Routing"
MAX_FIELD = 256
# A proxy's feature names kept (ponto/features.py lists a few).
MAX_FEATURES = 64
# How far after the clock it is judged by (check_start) a proxy's start may be.
MAX_CLOCK_SKEW_S = 300.0
# A proxy reports at most this many scopes a time; the rest is ignored.
MAX_SCOPES = 10_000
# And at most this many served regions (a fleet has a few), so a faulty proxy
# cannot grow the etcd value without bound.
MAX_REGIONS = 256
# And at most this many tenants held back by limits (a proxy sends at most
# dataplane.metrics.MAX_LIMITED_TENANTS).
MAX_TENANTS = 256
# And at most this many warnings with an ACK or report, each cut to MAX_WARNING
# characters (a proxy sends one per tenant it cannot verify JWTs of).
MAX_WARNINGS = 16
MAX_WARNING = 512
# And at most this many ejected origins, each's last failure cut to
# MAX_FAILURE characters (a proxy sends at most 64, each at most 200).
MAX_EJECTED = 64
MAX_FAILURE = 256
# The longest ejection a report may state (a proxy's are at most 30 s; a
# streak is not bounded but by the process's age: a year).
MAX_EJECTION_S = 3600.0
MAX_STREAK_S = 366 * 86400.0
# Table pushes of one stream awaiting an answer, kept for push latency; a
# proxy answers each push, so more than a few means it stopped answering.
MAX_UNANSWERED = 16


def _identity(payload: bytes) -> bytes:
    return payload


def check_start(info: pb.ProxyInfo, now: float) -> None:
    """Refuse (InvalidArgument) a start time that is no past time: after the
    proxy's own clock as it sent the request, or, if it does not say it
    (sent_at 0), after `now`, by more than MAX_CLOCK_SKEW_S. A start in the
    future would hold the name against every later process of it; a proxy
    whose clock runs ahead of the control plane's is judged by its own."""
    started, sent = info.started_at, info.sent_at
    if not (math.isfinite(sent) and sent >= 0.0):
        raise InvalidArgument(f"proxy send time {sent!r} is not a time")
    if not 0.0 <= started <= (sent or now) + MAX_CLOCK_SKEW_S:
        raise InvalidArgument(f"proxy start time {started!r} is not a past time")


def peer_certificate_expiry(context: Any) -> float | None:
    """When the peer's client certificate (mutual TLS) stops being valid, as
    Unix time; None without one, or one that does not parse."""
    auth_context = getattr(context, "auth_context", None)
    if auth_context is None:
        return None
    pems = auth_context().get("x509_pem_cert") or ()
    if not pems:
        return None
    try:
        [leaf, *_] = tlsfiles.certificates(pems[0], "the peer's", "client certificate")
    except (tlsfiles.TlsFileError, ValueError):
        return None
    return leaf.not_valid_after.timestamp()


class RoutingService:
    def __init__(
        self,
        registry: ProxyRegistry,
        publisher: Publisher,
        quotas: QuotaHub | None = None,
        loads: LoadHub | None = None,
        *,
        write_timeout: float = 30.0,
        metrics: ControlMetrics | None = None,
        ahead: Callable[[int], Awaitable[bool]] | None = None,
        fleet: FleetWatch | None = None,
    ) -> None:
        """`ahead(n)` is told of a revision a proxy holds above this
        replica's latest table: it makes what the store hands out from then
        on higher (RebasedStore.ensure_above; etcd went back), and says
        whether it had to. `fleet` is told of each answer's fleet id (a
        proxy refusing the tables as another fleet's)."""
        self._registry = registry
        self.fleet = fleet if fleet is not None else FleetWatch()
        self._ahead = ahead
        # The highest revision told to `ahead`: told once, not by every proxy.
        self._told_ahead = 0
        # Tables up to this version were numbered before `ahead` raised the
        # base, below what proxies hold: not pushed.
        self._renumbered_upto = 0
        self._publisher = publisher
        self._metrics = metrics if metrics is not None else ControlMetrics()
        self._quotas = quotas
        self._loads = loads
        self._write_timeout = write_timeout
        self.streams = 0
        self.slow_closed = 0
        # Set by close(): streams end, and new ones end at once.
        self._closing = asyncio.Event()
        # The tasks running route_stream, until each has unregistered its proxy.
        self._handlers: set[asyncio.Task[Any]] = set()

    async def close(self, grace: float) -> None:
        """End every route stream (UNAVAILABLE, so proxies move to another
        replica) and return once their handlers have finished, unregistering
        their proxies; a handler still running after `grace` s is cancelled
        and awaited. Called once the replica is stopping; streams opened
        afterwards end at once.

        The replica must not return from its shutdown before then: gRPC leaves
        a stream's handler running after the server stopped, and the handler
        task asyncio.run cancels last is logged by gRPC as an ERROR with
        CancelledError tracebacks.
        """
        self._closing.set()
        if not self._handlers:
            return
        _, late = await asyncio.wait(set(self._handlers), timeout=grace)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self.register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.RegisterResponse.SerializeToString,
                ),
                "RouteStream": grpc.stream_stream_rpc_method_handler(
                    self.route_stream,
                    request_deserializer=pb.RouteRequest.FromString,
                    response_serializer=_identity,
                ),
                "Deregister": grpc.unary_unary_rpc_method_handler(
                    self.deregister,
                    request_deserializer=pb.DeregisterRequest.FromString,
                    response_serializer=pb.DeregisterResponse.SerializeToString,
                ),
            },
        )

    @grpc_errors
    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        info = request.proxy
        check_name("proxy", info.name)
        if not NAME_RE.match(info.region):
            raise InvalidArgument(f"proxy region {info.region!r} is invalid")
        if len(info.address) > MAX_FIELD or len(info.version) > MAX_FIELD:
            raise InvalidArgument("proxy address or version is too long")
        check_start(info, time.time())
        record = await self._registry.register(
            info.name,
            info.region,
            info.address,
            info.version,
            started_at=info.started_at,
            # Names only: a few, each short (none longer than a field).
            features=[f for f in info.features[:MAX_FEATURES] if len(f) <= MAX_FIELD],
            host=peer_host(context.peer()),
            # Both by the proxy's clock: its age, whatever its skew (a clock
            # stepped back between the two makes none).
            age_s=info.sent_at - info.started_at
            if info.sent_at and info.started_at and info.sent_at >= info.started_at
            else None,
        )
        log.info("proxy %s (%s) registered, session %s", info.name, info.region, record.session_id)
        return pb.RegisterResponse(
            session_id=record.session_id,
            control_plane_id=self._registry.replica_id,
            fleet_size=await self._registry.fleet_size(),
            takes_named_counts=True,  # QuotaHub.report
        )

    @grpc_errors
    async def deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeregisterResponse:
        """A stopping proxy's registration goes (ProxyRegistry.deregister).
        Authenticated as Register is (api.guard: the Routing service's token
        and certificate role); the session id, which only its proxy was told,
        or its process's start names what is removed, never another
        process's registration of the name."""
        check_name("proxy", request.name)
        if len(request.session_id) > MAX_FIELD:
            raise InvalidArgument("session id is too long")
        started = request.started_at
        if not (math.isfinite(started) and started >= 0.0):
            raise InvalidArgument(f"proxy start time {started!r} is not a time")
        if not request.session_id and not started:
            raise InvalidArgument("a deregistration names a session id or a start time")
        removed = await self._registry.deregister(request.name, request.session_id, started)
        if removed:
            log.info(
                "proxy %s deregistered (session %s)",
                request.name,
                request.session_id or "unanswered",
            )
        return pb.DeregisterResponse(removed=removed)

    async def route_stream(
        self,
        requests: AsyncIterator[pb.RouteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        await self._route_stream(requests, context)

    async def _route_stream(
        self,
        requests: AsyncIterator[pb.RouteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        session_id = first.session_id
        if not self._registry.streaming(session_id):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "unknown session: call Register first"
            )
        name = self._registry.sessions[session_id].name
        await self._held(name, max(first.version_info, first.highest_held))
        self.streams += 1
        subscribed = self._metrics.clock()
        # Nonce of each table push not answered yet -> when the proxy could
        # first have had it (the later of publish and subscribe).
        unanswered: dict[str, float] = {}
        reader = asyncio.create_task(self._read_acks(session_id, name, requests, unanswered))
        sent: Snapshot | None = None
        # The quota generation last sent, and the shares last pushed whole.
        sent_quota = 0
        sent_shares = b""
        tables: asyncio.Future[Snapshot] | None = None
        # A proxy that holds no table (a new pod, or one restarted without its
        # state) is sent none while the fleet is in question (FleetWatch):
        # the new fleet's would open it to callers with no key, and it would
        # refuse the fleet's own once adopted. Until it took one.
        holds_none = first.version_info == 0
        settling: asyncio.Future[None] | None = None
        quotas: asyncio.Future[tuple[int, bytes, bytes]] | None = None
        # Loads are the same bytes for every stream; only the generation sent
        # is per stream.
        hub = self._loads
        sent_loads = 0
        loads: asyncio.Future[tuple[int, bytes]] | None = None
        closing = asyncio.ensure_future(self._closing.wait())
        ended = asyncio.ensure_future(self._registry.ended(session_id).wait())
        # A connection outlives the certificate it was made with: the stream
        # ends as that certificate does (trial 23: a proxy whose certificate
        # had expired kept its stream, and new tables, until a restart).
        expires_at = peer_certificate_expiry(context)
        expired = (
            asyncio.ensure_future(asyncio.sleep(max(0.0, expires_at - time.time())))
            if expires_at is not None
            else None
        )
        try:
            while not reader.done():
                if settling is None and sent is None and holds_none and self.fleet.in_question():
                    settling = self._withhold(name, tables)
                    tables = None
                if tables is None and settling is None:
                    tables = asyncio.ensure_future(self._publisher.next_after(sent))
                if quotas is None and self._quotas is not None:
                    quotas = asyncio.ensure_future(
                        self._quotas.next_for(
                            name, sent_quota, sent_shares, confirm=first.takes_unchanged
                        )
                    )
                if loads is None and hub is not None:
                    loads = asyncio.ensure_future(hub.next_after(sent_loads))
                pending = tables if tables is not None else settling
                assert pending is not None
                waiting: set[asyncio.Future[Any]] = {pending, reader, closing, ended}
                if expired is not None:
                    waiting.add(expired)
                if quotas is not None:
                    waiting.add(quotas)
                if loads is not None:
                    waiting.add(loads)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if closing in done:
                    context.set_code(grpc.StatusCode.UNAVAILABLE)
                    context.set_details(linkadvice.stopping(self._registry.replica_id))
                    break
                if reader in done:
                    break  # the proxy left
                if expired is not None and expired in done:
                    assert expires_at is not None
                    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires_at))
                    log.warning("proxy %s: its client certificate expired at %s", name, when)
                    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
                    context.set_details(
                        f"the proxy's client certificate expired at {when}: give it a valid one"
                    )
                    break
                if session_id not in self._registry.sessions:
                    # Registered again since, on another stream: the proxy's
                    # own (this one lost), where ABORTED reaches nobody; or
                    # another process of its name (a group's worker and its
                    # successor in a reload), which waits before taking the
                    # name back rather than taking turns with it.
                    context.set_code(grpc.StatusCode.ABORTED)
                    context.set_details(f"proxy {name} registered again on another stream")
                    break
                payloads = []
                pushed_table = False
                if settling is not None and settling in done:
                    settling = None
                    self.fleet.waiting.discard(name)
                    log.info("proxy %s holds no route table: sending the fleet's now", name)
                if tables is not None and tables in done:
                    if sent is None and holds_none and self.fleet.in_question():
                        # The question came while its first table was on the way.
                        settling = self._withhold(name, tables)
                        tables = None
                        continue
                    sent = tables.result()
                    tables = None
                    # Compiled before a raise of the base (_held): every proxy
                    # would refuse it; the table read since follows.
                    pushed_table = sent.table.version > self._renumbered_upto
                if pushed_table:
                    assert sent is not None
                    payloads.append(sent.payload)
                    unanswered[sent.nonce] = max(sent.published_at, subscribed)
                    while len(unanswered) > MAX_UNANSWERED:
                        del unanswered[next(iter(unanswered))]
                if quotas is not None and quotas in done:
                    sent_quota, quota_payload, sent_shares = quotas.result()
                    quotas = None
                    payloads.append(quota_payload)
                send_loads = loads is not None and loads in done
                if send_loads:
                    loads = None
                for payload in payloads:
                    if not await self._write(context, name, payload):
                        return
                if pushed_table:
                    self._metrics.push_sent()
                if send_loads and hub is not None:
                    # The newest now, not the one that woke the waiter: a
                    # stream held up by the writes above skips what came meanwhile.
                    sent_loads = hub.generation
                    if not await self._write(context, name, hub.payload):
                        return
        finally:
            self.streams -= 1
            # First: a second cancellation of this handler, while it waits
            # for the unregister below, skips the rest (trial 68: 3 of 10
            # proxies stopped with no line for their stream's end).
            log.info("proxy %s stream closed", name)
            reader.cancel()
            self.fleet.waiting.discard(name)
            for waiter in (tables, quotas, loads, closing, ended, expired, settling):
                if waiter is not None:
                    waiter.cancel()
            if self._quotas is not None:
                self._quotas.forget(name)
            self.fleet.ended(name)
            # Unregister first and shielded: the handler may itself be
            # cancelled (the peer vanished), and a registration left behind
            # would only go when the replica's lease does.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._registry.unregister(session_id))
            with contextlib.suppress(BaseException):
                await reader

    def _withhold(self, name: str, tables: asyncio.Future[Snapshot] | None) -> asyncio.Future[None]:
        """Send proxy `name`, which holds no table, none until the fleet is
        no longer in question; the future is done once it is not."""
        if tables is not None:
            tables.cancel()
        self.fleet.waiting.add(name)
        log.warning(
            "proxy %s holds no route table and is sent none while the fleet id is in "
            "question (proxies refuse this replica's tables as another fleet's, or it "
            "replaced the fleet id): it serves nothing until that is settled "
            '(docs/operations.md, "etcd came back empty")',
            name,
        )
        return asyncio.ensure_future(self.fleet.settled())

    async def _write(
        self, context: grpc.aio.ServicerContext[Any, Any], name: str, payload: bytes
    ) -> bool:
        """Write one push; False if the stream was stuck and must be closed."""
        try:
            # asyncio.timeout, not wait_for: no task per write.
            async with asyncio.timeout(self._write_timeout):
                await context.write(payload)
        except TimeoutError:
            # Linkerd's rule: never let one stuck stream hold memory or block
            # others; close it, count it, let the proxy reconnect.
            self.slow_closed += 1
            log.warning("closing stream of %s: write blocked %ss", name, self._write_timeout)
            return False
        return True

    async def _read_acks(
        self,
        session_id: str,
        name: str,
        requests: AsyncIterator[pb.RouteRequest],
        unanswered: dict[str, float],
    ) -> None:
        """Record each ACK or NACK; answers to pushes in `unanswered` (this
        stream's) are counted, and an ACK's latency observed."""
        async for req in requests:
            if req.is_report:
                if self._quotas is not None:
                    self._quotas.report(name, req.demand[:MAX_SCOPES])
                self._registry.reported(
                    session_id,
                    req.requests_total,
                    req.server_errors_total,
                    req.client_errors_total,
                    {
                        s.region: (s.requests_total, s.errors_total)
                        for s in req.served[:MAX_REGIONS]
                    },
                    {
                        t.tenant: (t.refused_total, t.slot_waits_total)
                        for t in req.limited[:MAX_TENANTS]
                        if 0 < len(t.tenant) <= MAX_FIELD
                    },
                    _ejected(req),
                )
                if req.warnings_current:
                    self._registry.warned(session_id, _warnings(req))
                continue
            if not req.response_nonce:
                continue
            error = req.error_detail[:1024]
            self.fleet.answered(
                name,
                req.fleet_id[:MAX_FIELD],
                refused=bool(error),
                opening=error.startswith(WOULD_OPEN_NACK),
            )
            if error:
                log.warning("proxy NACKed push %s: %s", req.response_nonce, error)
                await self._held(name, req.version_info)
            since = unanswered.pop(req.response_nonce, None)
            if since is not None:
                latency = self._metrics.clock() - since
                self._metrics.push_answered(acked=not error, latency=latency)
            await self._registry.acked(session_id, req.version_info, error, _warnings(req))

    async def _held(self, name: str, revision: int) -> None:
        """Proxy `name` holds `revision`: if it is above this replica's
        latest table (and any told before), tell `ahead`, which reads etcd to
        tell a lagging replica from an etcd gone back. A failure is logged;
        the stream goes on."""
        latest = self._publisher.latest
        if (
            self._ahead is None
            or revision <= self._told_ahead
            or (latest is not None and revision <= latest.table.version)
        ):
            return
        self._told_ahead = revision
        try:
            if await self._ahead(revision):
                self._renumbered_upto = max(self._renumbered_upto, revision)
        except StoreError as exc:
            self._told_ahead = 0  # the next proxy's report tries again
            log.warning(
                "proxy %s holds revision %d, not checked against etcd: %s", name, revision, exc
            )


def _warnings(req: pb.RouteRequest) -> tuple[str, ...]:
    """An ACK's or report's warnings, bounded in number and length."""
    return tuple(w[:MAX_WARNING] for w in req.warnings[:MAX_WARNINGS])


def _ejected(req: pb.RouteRequest) -> list[pb.OriginEjected]:
    """A report's ejected origins, bounded in number and length, their
    durations in range (NaN and infinities to 0): what is stored of them must
    read back as numbers."""
    out = []
    for e in req.ejected[:MAX_EJECTED]:
        if not 0 < len(e.origin) <= MAX_FIELD:
            continue
        out.append(
            pb.OriginEjected(
                origin=e.origin,
                for_s=_within(e.for_s, MAX_STREAK_S),
                ejections=e.ejections,
                last_failure=e.last_failure[:MAX_FAILURE],
                ejected_s=_within(e.ejected_s, MAX_EJECTION_S),
                failed_s=_within(e.failed_s, MAX_STREAK_S),
            )
        )
    return out


def _within(seconds: float, most: float) -> float:
    return min(seconds, most) if math.isfinite(seconds) and seconds > 0 else 0.0


def peer_host(peer: str) -> str:
    """The host of a gRPC peer ("ipv4:10.0.0.6:51234", "ipv6:[::1]:51234");
    "" for any other (a Unix socket, or none)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    # gRPC escapes an IPv6 address's brackets: "ipv6:%5B::1%5D:51234".
    host = urllib.parse.unquote(rest).rpartition(":")[0]
    return host.strip("[]")
