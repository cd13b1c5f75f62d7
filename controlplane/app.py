"""Composition root of the control plane."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
from collections.abc import Callable

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane.api.admin import AdminService
from controlplane.api.guard import TokenGuard
from controlplane.api.metered import AdminCalls
from controlplane.api.routing import RoutingService
from controlplane.audit import AuditLog
from controlplane.builder import TableBuilder
from controlplane.catalog import REPLICAS, Catalog
from controlplane.compaction import Compactor
from controlplane.distribute import Publisher
from controlplane.election import Leadership
from controlplane.errors import Unavailable
from controlplane.fleetid import FleetWatch
from controlplane.health import Prober
from controlplane.loadsync import LoadHub, LoadScraper, stale_after
from controlplane.metrics import ControlMetrics
from controlplane.model import is_loopback
from controlplane.quotasync import QuotaHub, Rebalancer
from controlplane.readiness import ReplicaHealth
from controlplane.registry import ProxyRegistry
from controlplane.settings import Settings
from controlplane.store import StateStore, StoreError
from controlplane.store.instrumented import InstrumentedStore
from controlplane.store.rebased import RebasedStore
from controlplane.web import StatusWeb
from ponto.cliargs import cannot_listen, hostport, listen_address
from ponto.grpcconn import KEEPALIVE_OPTIONS, MIN_PING_INTERVAL_MS
from ponto.listening import tcp_site
from ponto.v1 import admin_pb2, admin_pb2_grpc, routing_pb2
from ponto.writefile import write_atomic

log = logging.getLogger(__name__)


# gRPC servers bind with SO_REUSEPORT unless told not to: a second replica
# started on a taken port would share it, each answering some of the calls
# (trial 17: 8 of 10 admin calls went to the newcomer).
NO_REUSEPORT = ("grpc.so_reuseport", 0)


class ListenError(Exception):
    """An address the replica cannot listen on; the message names it and says why."""


def _address(listen: str) -> tuple[str, int]:
    """`listen` read as every command line reads it (Settings made in code are
    not parsed), or ListenError."""
    try:
        return listen_address(listen)
    except argparse.ArgumentTypeError as exc:
        raise ListenError(f"cannot listen on {listen}: {exc}") from None


def _bind(listen: str, add_port: Callable[[str], int]) -> int:
    """The port `add_port` bound `listen` to, or ListenError. The address is
    tried first with a socket of this process's own, which says why it cannot
    be bound (gRPC says only that it failed, on a line of its own)."""
    host, port = _address(listen)
    listen = hostport(host, port)  # gRPC refuses ":7070"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        # A family the kernel lacks (IPv6 disabled): gRPC falls back from a
        # wildcard to IPv4 on its own, so that is for its bind to judge.
        if exc.errno != errno.EAFNOSUPPORT:
            raise ListenError(cannot_listen(listen, exc)) from None
    try:
        port = add_port(listen)
    except RuntimeError:  # gRPC's "Failed to bind to address": its log says why
        port = 0
    if not port:
        raise ListenError(f"cannot listen on {listen}: the address is in use or not this host's")
    return port


class ControlPlane:
    """All parts of one replica, wired; start() binds, stop() releases.

    `metrics` (a new ControlMetrics if None) is served at /metrics of
    --http-listen; every call to `store` goes through it (InstrumentedStore).
    """

    def __init__(
        self, settings: Settings, store: StateStore, *, metrics: ControlMetrics | None = None
    ) -> None:
        self.settings = settings
        self.metrics = (
            metrics if metrics is not None else ControlMetrics(replica=settings.replica_id)
        )
        self.store = rebased = RebasedStore(InstrumentedStore(store, self.metrics))
        store = rebased
        self.catalog = Catalog(store)
        self.audit = AuditLog(
            store,
            replica=settings.replica_id,
            retention_days=settings.audit_retention_days,
            max_entries=settings.audit_max_entries,
        )
        self.publisher = Publisher(settings.replica_id, clock=self.metrics.clock)
        self.fleet = FleetWatch()
        self.builder = TableBuilder(
            self.catalog,
            self.publisher,
            quiet=settings.debounce_quiet,
            max_delay=settings.debounce_max,
            behind=self._ahead,
            fleet=self.fleet,
        )
        self.registry = ProxyRegistry(
            self.catalog,
            settings.replica_id,
            lease_ttl=settings.lease_ttl,
            traffic_every=settings.traffic_interval,
            current_version=self._current_version,
            current_etag=lambda: self.publisher.latest.etag if self.publisher.latest else "",
            store_epoch=lambda: rebased.base,
        )
        rebased.on_rebase(self._renumbered)
        self.quotas = QuotaHub(
            store, settings.replica_id, self.registry.lease, settings.quota_interval
        )
        self.loads = LoadHub(store, max_age=stale_after(settings.probe))
        self.routing = RoutingService(
            self.registry,
            self.publisher,
            self.quotas,
            self.loads,
            metrics=self.metrics,
            ahead=self._ahead,
            fleet=self.fleet,
        )
        self.leadership = Leadership(store, settings.replica_id, ttl=settings.leader_ttl)
        self.rebalancer = Rebalancer(
            store,
            self.catalog,
            self.publisher,
            fence=lambda: self.leadership.fence,
            interval=settings.quota_interval,
        )
        self.prober = Prober(
            self.catalog,
            settings.probe,
            may_write=lambda: self.leadership.is_leader,
            fence=lambda: self.leadership.fence,
            metrics=self.metrics,
        )
        self.scraper = LoadScraper(
            store, self.publisher, settings.probe, fence=lambda: self.leadership.fence
        )
        self.compactor = Compactor(rebased, settings.etcd_compaction_interval)
        self.health = health.aio.HealthServicer()
        self.status = ReplicaHealth(self.health, store, self.publisher)
        security = settings.security
        self.server = grpc.aio.server(
            interceptors=[
                AdminCalls(self.metrics),  # first: it counts what the guard refuses
                TokenGuard(
                    bootstrap_token=security.bootstrap_tokens,
                    admin_token=security.admin_tokens,
                    require_roles=bool(security.tls_client_ca),
                    on_refused=self.metrics.routing_refused,
                ),
            ],
            options=[
                *KEEPALIVE_OPTIONS,
                NO_REUSEPORT,
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ],
        )
        self.metrics.bind(
            table=self._latest_table,
            acked_versions=lambda: [r.acked_version for r in self.registry.sessions.values()],
            is_leader=lambda: self.leadership.is_leader,
            load_ages=self.scraper.ages,
            leader_terms=lambda: self.leadership.terms,
            loads=lambda: self.loads.loads,
            budgets=self.rebalancer.budget_use,
            fleet=self.fleet,
        )
        # Health alone, in plaintext, for kubelet probes (--health-listen).
        self.health_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0
        self.health_port = 0
        # The status page, its API and /metrics (--http-listen); drains from it are audited.
        self.web = StatusWeb(
            self.catalog,
            self.publisher,
            settings.replica_id,
            admin_token=security.admin_tokens,
            writes_off=_writes_off(settings),
            audit=self.audit,
            metrics=self.metrics,
            loads=self.loads.fresh,
            last_loads=lambda: self.loads.loads,
            suspensions=lambda: self.builder.suspensions,
            fleet_problem=self.fleet.problem,
            proxies_seen=self.fleet.seen,
            traffic_every=settings.traffic_interval,
        )
        self.web_runner: web.AppRunner | None = None
        self.http_port = 0

    async def _ahead(self, revision: int) -> bool:
        """A proxy holds `revision`, above this replica's latest table: if
        etcd went back, number above it (the state is published again by
        _renumbered)."""
        return await self.store.ensure_above(revision)

    def _renumbered(self, upto: int) -> None:
        """The store's numbering base changed (RebasedStore.on_rebase), by
        whichever path: publish the state again under the new numbers even
        where its content is the same. Only when this replica's own
        ensure_above raised it had been done: a raise seen first by another
        watch of this replica, or in a listing holding another replica's,
        left proxies on the table of before an etcd restore."""
        self.publisher.renumbered(upto)
        self.builder.wake()

    async def _follow_replicas(self) -> None:
        """Read the replicas' keys at each change of them (and every beat of
        the lease anyway: a change the watch missed while it re-created its
        stream), so that this replica sees each one's renewals as they
        happen (controlplane.beats), not only when someone asks."""
        changed = asyncio.Event()
        every = max(self.settings.lease_ttl / 3, 0.2)

        async def follow() -> None:
            async for _ in self.store.watch(REPLICAS, 0):
                changed.set()

        follower = asyncio.create_task(follow(), name="replica-keys-watch")
        try:
            while True:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for lets a
                # cancellation go when the event is set at the same moment, and
                # stop() then waited for this loop for good (a flaky e2e hang).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every):
                        await changed.wait()
                changed.clear()
                try:
                    await self.catalog.list_replicas()
                except Unavailable as exc:
                    log.debug("replica keys not read: %s", exc)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, StoreError):
                await follower

    def _current_version(self) -> int:
        latest = self.publisher.latest
        return latest.version if latest else 0

    def _latest_table(self) -> routing_pb2.RouteTable | None:
        latest = self.publisher.latest
        return latest.table if latest else None

    async def start(self) -> None:
        self.server.add_generic_rpc_handlers((self.routing.handler(),))
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminService(
                self.catalog,
                self.publisher,
                self.audit,
                token_required=bool(self.settings.security.admin_token),
                loads=self.loads.fresh,
            ),
            self.server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.status.publish()  # not ready until a table is built (readiness.py)
        reflection.enable_server_reflection(
            (
                routing_pb2.DESCRIPTOR.services_by_name["Routing"].full_name,
                admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        credentials = self.settings.security.server_credentials()
        self.port = _bind(
            self.settings.listen,
            lambda listen: (
                self.server.add_insecure_port(listen)
                if credentials is None
                else self.server.add_secure_port(listen, credentials)
            ),
        )
        await self.server.start()
        if self.settings.health_listen:
            self.health_server = grpc.aio.server(options=[NO_REUSEPORT])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bind(
                self.settings.health_listen, self.health_server.add_insecure_port
            )
            await self.health_server.start()
        if self.settings.http_listen:
            await self._serve_http(self.settings.http_listen)
        self._tasks = [
            asyncio.create_task(self.builder.run(), name="table-builder"),
            asyncio.create_task(self.registry.keepalive(), name="lease-keepalive"),
            asyncio.create_task(self.registry.flush_acks(), name="ack-flush"),
            asyncio.create_task(self.registry.watch(), name="proxy-registrations"),
            asyncio.create_task(self.leadership.run(self._lead), name="election"),
            asyncio.create_task(self.quotas.publish_demand(), name="quota-demand"),
            asyncio.create_task(self.quotas.watch(), name="quota-shares"),
            asyncio.create_task(self.loads.watch(), name="origin-loads"),
            asyncio.create_task(self.status.run(), name="health-status"),
            asyncio.create_task(self._follow_replicas(), name="replica-heartbeats"),
        ]
        if self.settings.http_listen:
            # The page's rates are measured whether or not anyone views it.
            self._tasks.append(
                asyncio.create_task(self.web.sample_forever(), name="status-page-rates")
            )
        security = self.settings.security
        host = self.settings.listen.rsplit(":", 1)[0]
        log.info(
            "control plane %s serving on %s:%d (%s; proxies %s; admin %s)",
            self.settings.replica_id,
            host,
            self.port,
            "mutual TLS, certificates of each service's role"
            if security.tls_client_ca
            else ("TLS" if security.tls_cert else "plaintext"),
            "need the bootstrap token" if security.bootstrap_token else "are not authenticated",
            "needs the admin token" if security.admin_token else "is not authenticated",
        )
        if (
            not security.tls_cert
            and (security.bootstrap_token or security.admin_token)
            and not is_loopback(host)
        ):
            # As the status page's writes are off under mutual TLS for the same
            # reason: a token in plaintext is anyone's who can watch the wire.
            log.warning(
                "tokens cross the network in the clear on %s:%d (no --tls-cert): anyone "
                "who can watch it can take them; give the control plane a certificate",
                host,
                self.port,
            )
        await self.registry.announce(f"{host}:{self.port}")
        if self.settings.ready_file:
            write_atomic(self.settings.ready_file, f"{host}:{self.port}".encode())

    async def _serve_http(self, listen: str) -> None:
        host, port = _address(listen)
        self.web_runner = self.web.runner()
        await self.web_runner.setup()
        try:
            site = tcp_site(self.web_runner, host, port)
            await site.start()
        except OSError as exc:
            raise ListenError(cannot_listen(listen, exc)) from None
        self.http_port = self.web_runner.addresses[0][1]
        log.info(
            "status page on http://%s/ (changes %s)",
            hostport(host, self.http_port),
            {
                "token": "need the admin token",
                "open": "are not authenticated",
                "off": "are off",
            }[self.web.writes],
        )

    async def _lead(self) -> None:
        """The loops only the leader runs, for one term. One that fails ends
        the term: the others are cancelled and awaited, as they are when the
        term ends otherwise, so this returns only once each has ended (the
        election revokes the lease after; the Rebalancer writes its last
        counts meanwhile, fenced: if the lease ended first, those writes
        fail). Under asyncio.gather a loop that failed left the others
        running on past the term, their writes unfenced, and a cancelled one
        ended the gather while the others still ran. A single loop's failure
        is raised as itself, for the election's log."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.prober.run(), name="health-probes")
                group.create_task(self.rebalancer.run(), name="quota-rebalance")
                group.create_task(self.scraper.run(), name="load-scrape")
                group.create_task(self.audit.run_trim(), name="audit-trim")
                if self.compactor.interval:
                    group.create_task(self.compactor.run(), name="etcd-compaction")
        except BaseExceptionGroup as failed:
            if len(failed.exceptions) == 1:
                raise failed.exceptions[0] from None
            raise

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Stopping the server ends no stream by itself (each waits out the
        # grace): the streams are ended here meanwhile, and their handlers
        # awaited, which the server's stop does not do.
        server_stopped = asyncio.create_task(self.server.stop(grace))
        await self.routing.close(grace)
        await server_stopped
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.web_runner is not None:
            await self.web_runner.cleanup()
        await self.registry.close()
        await self.store.close()


def _writes_off(settings: Settings) -> str:
    """Why the status page may not change anything, "" if it may."""
    if settings.http_writes:
        return ""
    if settings.security.tls_client_ca:
        return (
            "changes from this page are off: the control plane uses mutual TLS, and this "
            "plain-HTTP port cannot check an admin certificate (the admin token would cross "
            "it in the clear); use pontoctl, or start the control plane with --http-writes on"
        )
    return "changes from this page are off (--http-writes off); use pontoctl"


async def over_etcd(settings: Settings) -> ControlPlane:
    """A replica over the etcd of `settings`, connected, not started; the watch
    restarts the store handles itself are counted in the replica's metrics."""
    from controlplane.store.etcd import EtcdStore  # noqa: PLC0415

    metrics = ControlMetrics(replica=settings.replica_id)
    store = EtcdStore(
        settings.etcd,
        timeout=settings.etcd_timeout,
        tls=settings.etcd_tls,
        watch_failed=lambda: metrics.etcd_error("watch"),
    )
    await store.connect()
    return ControlPlane(settings, store, metrics=metrics)


async def freeze_when_built(publisher: Publisher, freeze: Callable[[], None] = gc.freeze) -> None:
    """Once the first route table is published, collect and `freeze` what the
    process holds then (its modules, the state decoded, the table): moved out
    of the collector's generations, it is not traversed again by every full
    collection. At 20,000 keys those ran about once a second during a bulk
    key load, 50 ms of CPU each (up to 0.7 s on a busy machine), on the
    event loop or in the worker thread decoding the state, which holds the
    loop as long. Objects frozen are still freed when no longer referenced;
    only cycles among them are kept."""
    await publisher.next_after(None)
    gc.collect()
    freeze()


async def serve(settings: Settings) -> int:
    """Run a replica until SIGTERM or SIGINT; the process's exit status (1:
    an address it cannot listen on, said in one line)."""
    plane = await over_etcd(settings)
    try:
        await plane.start()
    except ListenError as exc:
        log.error("%s", exc)
        await plane.stop(grace=0)
        return 1
    # The process's alone: a test's ControlPlane leaves its heap as it is.
    frozen = asyncio.create_task(freeze_when_built(plane.publisher), name="heap-freeze")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    frozen.cancel()
    await plane.stop()
    return 0
