"""The proxy's link to the control plane, and its last good route table.

Static stability: the proxy serves whatever table it last applied, whether or
not the control plane is reachable, and keeps a copy on disk so a restart
without a control plane still serves. A pushed table is validated first; one
that fails is NACKed and the previous one keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from dataplane.policy import CacheDefaults, EdgePolicy, build_policy
from dataplane.routes import Routes, TableError, build_routes
from ponto.grpcconn import ClientOptions, aio_channel
from ponto.v1 import routing_pb2 as pb
from ponto.v1 import routing_pb2_grpc
from ponto.writefile import write_atomic

log = logging.getLogger(__name__)
TABLE_FILE = "route_table.pb"


class TableHolder:
    """The current Routes; replaced atomically (one reference swap) on apply.

    Request handlers read `routes` without locks: a request sees either the old
    or the new table, never a mix.
    """

    def __init__(
        self,
        region: str,
        state_dir: Path | None,
        cache_defaults: CacheDefaults | None = None,
    ) -> None:
        self.region = region
        self.state_dir = state_dir
        self.cache_defaults = cache_defaults or CacheDefaults()
        self.routes: Routes | None = None
        # Compiled with routes from the same table; read together by handlers
        # in one synchronous step, so they always match.
        self.policy: EdgePolicy | None = None
        # Called after a table with new content is installed.
        self.on_apply: list[Callable[[Routes, EdgePolicy], None]] = []
        self.source = "none"
        self.applied_at = 0.0  # time.time() of the last apply
        self.received_at = 0.0  # time.time() the control plane last sent a table

    def apply(self, table: pb.RouteTable, source: str) -> bool:
        """Validate and install table; return False if it was already current."""
        current = self.routes
        if source == "control-plane":
            self.received_at = time.time()
            if (
                current is not None
                and self.source == "control-plane"
                and table.version < current.version
                and table.etag != current.etag
            ):
                raise TableError(
                    f"stale table: version {table.version} < serving {current.version}"
                )
        if current is not None and current.etag == table.etag:
            # Same content: only ever move the version forward, so the stale
            # check keeps comparing against the newest version seen.
            if table.version > current.version:
                self.routes = build_routes(table, self.region)
            self.source = source
            return False
        routes = build_routes(table, self.region)
        policy = build_policy(table, self.cache_defaults)
        self.routes = routes
        self.policy = policy
        self.source = source
        for hook in self.on_apply:
            hook(routes, policy)
        self.applied_at = time.time()
        log.info(
            "applied route table version %d from %s: %d models, %d tenants%s",
            routes.version,
            source,
            len(routes.models),
            len(policy.tenants),
            "; no API keys or JWT issuers: the proxy is OPEN, every request is tenant 'default'"
            if policy.authenticator.open
            else "",
        )
        if source == "control-plane":
            self._save(table)
        return True

    def _save(self, table: pb.RouteTable) -> None:
        if self.state_dir is None:
            return
        try:
            write_atomic(self.state_dir / TABLE_FILE, table.SerializeToString())
        except OSError as exc:
            log.error("cannot save route table to %s: %s", self.state_dir, exc)

    def load_saved(self) -> bool:
        """Serve the table saved by an earlier run, if there is a valid one."""
        if self.state_dir is None:
            return False
        path = self.state_dir / TABLE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.error("cannot read saved route table %s: %s", path, exc)
            return False
        table = pb.RouteTable()
        try:
            table.ParseFromString(data)
            self.apply(table, "disk")
        except Exception as exc:  # any damage: ignore the file, wait for a push
            log.error("ignoring saved route table %s: %s", path, exc)
            return False
        return True


class ControlPlaneClient:
    """Registers this proxy and applies pushed tables until cancelled.

    Tries the control plane addresses in turn with jittered exponential
    backoff, so losing one replica moves the proxy to another.
    """

    def __init__(
        self,
        holder: TableHolder,
        addresses: Sequence[str],
        info: pb.ProxyInfo,
        *,
        credentials: ClientOptions | None = None,
        on_quota: Callable[[pb.QuotaShares], None] | None = None,
        demand: Callable[[], list[pb.ScopeDemand]] | None = None,
        report_interval: float = 1.0,
        backoff_min: float = 0.2,
        backoff_max: float = 5.0,
    ) -> None:
        if not addresses:
            raise ValueError("no control plane address")
        self._holder = holder
        self._addresses = list(addresses)
        self._info = info
        self._backoff_min = backoff_min
        self._backoff_max = backoff_max
        self._credentials = credentials or ClientOptions()
        self._on_quota = on_quota
        self._demand = demand
        self._report_interval = report_interval
        self.connected = False
        self.quota_generation = 0
        self.nacks = 0
        self.connects = 0
        # Registration waits until the proxy knows the address it serves on
        # (with --listen HOST:0 that is only known after binding).
        self.address_known = asyncio.Event()
        if info.address and not info.address.endswith(":0"):
            self.address_known.set()

    def set_address(self, address: str) -> None:
        if not self.address_known.is_set():
            self._info.address = address
            self.address_known.set()

    async def run(self) -> None:
        await self.address_known.wait()
        backoff = self._backoff_min
        attempt = random.randrange(len(self._addresses))  # noqa: S311 - spreading load
        while True:
            address = self._addresses[attempt % len(self._addresses)]
            attempt += 1
            got_table = False
            try:
                got_table = await self._session(address)
            except grpc.aio.AioRpcError as exc:
                log.warning("control plane %s: %s %s", address, exc.code().name, exc.details())
            except OSError as exc:
                log.warning("control plane %s: %s", address, exc)
            finally:
                self.connected = False
            if got_table:
                backoff = self._backoff_min
            # Full jitter keeps a fleet from reconnecting in lockstep.
            await asyncio.sleep(random.uniform(self._backoff_min, backoff))  # noqa: S311
            backoff = min(backoff * 2, self._backoff_max)

    async def _session(self, address: str) -> bool:
        options = [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        got_table = False
        metadata = self._credentials.metadata
        async with aio_channel(address, self._credentials, options) as channel:
            stub = routing_pb2_grpc.RoutingStub(channel)
            reg = await stub.Register(
                pb.RegisterRequest(proxy=self._info), timeout=5, metadata=metadata
            )
            outbox: asyncio.Queue[pb.RouteRequest] = asyncio.Queue()
            current = self._holder.routes
            outbox.put_nowait(
                pb.RouteRequest(
                    session_id=reg.session_id, version_info=current.version if current else 0
                )
            )

            async def requests() -> AsyncIterator[pb.RouteRequest]:
                while True:
                    yield await outbox.get()

            call = stub.RouteStream(requests(), metadata=metadata)
            self.connects += 1
            log.info("connected to control plane %s (%s)", address, reg.control_plane_id)
            reporter = asyncio.create_task(self._report(reg.session_id, outbox))
            try:
                async for update in call:
                    self.connected = True
                    if update.HasField("quota"):
                        self._apply_quota(update.quota)
                    if update.HasField("table"):
                        got_table = True
                        outbox.put_nowait(self._handle(reg.session_id, update))
            finally:
                reporter.cancel()
        return got_table

    def _apply_quota(self, quota: pb.QuotaShares) -> None:
        if quota.generation and quota.generation < self.quota_generation:
            return  # an older replica's view; the newer one stands
        self.quota_generation = quota.generation
        if self._on_quota is not None:
            self._on_quota(quota)

    async def _report(self, session_id: str, outbox: asyncio.Queue[pb.RouteRequest]) -> None:
        """Send this proxy's rate-limit demand about once an interval."""
        if self._demand is None:
            return
        while True:
            await asyncio.sleep(self._report_interval)
            outbox.put_nowait(
                pb.RouteRequest(session_id=session_id, is_report=True, demand=self._demand())
            )

    def _handle(self, session_id: str, update: pb.RouteUpdate) -> pb.RouteRequest:
        try:
            self._holder.apply(update.table, "control-plane")
        except TableError as exc:
            self.nacks += 1
            log.error("refused route table version %d: %s", update.table.version, exc)
            current = self._holder.routes
            return pb.RouteRequest(
                session_id=session_id,
                version_info=current.version if current else 0,
                response_nonce=update.nonce,
                error_detail=str(exc),
            )
        return pb.RouteRequest(
            session_id=session_id,
            version_info=update.table.version,
            response_nonce=update.nonce,
        )
