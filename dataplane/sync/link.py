"""The proxy's link to the control plane: register, take tables, shares and
origin loads, report.

Tables go to the TableHolder (dataplane.sync.holder), which keeps serving the
last good one whatever happens to this link; rate-limit shares go to
QuotaState (dataplane.sync.quota); origin loads to whoever passed `on_loads`
(the LoadBoard, dataplane.placement.load).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client.registry import Collector

from dataplane.routes import TableError
from dataplane.sync.holder import TableHolder, TableRefused
from dataplane.upstream.outlier import Ejected
from ponto import linkadvice
from ponto.grpcconn import KEEPALIVE_OPTIONS, ClientOptions, CredentialError, aio_channel
from ponto.v1 import routing_pb2 as pb
from ponto.v1 import routing_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Traffic:
    """Requests this proxy answered since it started, and how many were errors;
    `served`: region -> (proxied requests it served, of those errors);
    `limited`: tenant -> (requests a rate limit refused, requests that waited
    for a slot)."""

    requests: int = 0
    server_errors: int = 0  # status >= 500
    client_errors: int = 0  # 400 <= status < 500
    served: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    limited: Mapping[str, tuple[int, int]] = field(default_factory=dict)


# Endpoints that are not traffic: kubelet probes (readyz answers 503 while
# the proxy is unready or draining) and Prometheus scrapes.
NOT_TRAFFIC = frozenset({"healthz", "health", "readyz", "metrics"})
# After another process took this proxy's name at the control plane: long
# enough for a group's worker to leave to its successor, short enough for a
# proxy whose registration a stray retry of its own took to come back.
SUPERSEDED_WAIT_S = 30.0
# Ejected origins one report names: the control plane takes no more
# (controlplane.api.routing.MAX_EJECTED).
MAX_EJECTED_REPORTED = 64
# The largest message a replica takes (controlplane.app): past it, it ends
# the stream (the proxy saw INTERNAL), and the proxy connected again and sent
# the next report, refused too, its table and shares lost in between. A
# report past it is not sent (_report), and said.
MAX_REPORT_BYTES = 4 * 1024 * 1024
# The deadline of a stopping proxy's Deregister: a few etcd calls at the
# control plane, and a TLS handshake. A control plane that does not answer
# in time drops the registration itself, when the stream's end reaches it or
# at its stream grace (15 s): the stop is not held up longer for it.
DEREGISTER_TIMEOUT_S = 2.0


def traffic_of(
    requests: Collector,
    operations: Collector | None = None,
    limited: Mapping[str, Sequence[int]] | None = None,
    not_cached: Collector | None = None,
    refused: Mapping[str, int] | None = None,
    excused: Mapping[str, int] | None = None,
) -> Traffic:
    """Totals of a counter of answered requests labelled with `endpoint` and
    `code` (the proxy's ponto_requests), probes and scrapes (NOT_TRAFFIC) left
    out, and of a histogram of proxied operations labelled with `ponto_region`
    and `error_type` (gen_ai_client_operation_duration_seconds) by region; read
    once a report, so a scan of their series is cheap. `limited`: tenant ->
    (refused, slot waits), the proxy's Metrics.limited, copied. `not_cached`:
    a counter by `endpoint` of 5xx answers that are the client's doing (the
    proxy's ponto_requests_not_cached), reported as client errors. `refused`:
    region -> operations of the histogram the proxy refused itself before
    calling any origin (Metrics.refused), left out of what the region served:
    its errors are what its origins failed, not its clients' bad requests
    (those stay in `client_errors`, where they arrived). `excused`: region ->
    operations origins answered that failed for their clients' doing
    (Metrics.excused: an origin's 400, a client that left), served by the
    region but none of its errors."""
    total = server = client = 0
    for family in requests.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if sample.labels.get("endpoint", "") in NOT_TRAFFIC:
                continue
            count = int(sample.value)
            total += count
            code = sample.labels.get("code", "")
            if code.startswith("5"):
                server += count
            elif code.startswith("4"):
                client += count
    for family in not_cached.collect() if not_cached is not None else ():
        for sample in family.samples:
            if sample.name.endswith("_total") and (
                sample.labels.get("endpoint", "") not in NOT_TRAFFIC
            ):
                server -= int(sample.value)
                client += int(sample.value)
    served: dict[str, tuple[int, int]] = {}
    for family in operations.collect() if operations is not None else ():
        for sample in family.samples:
            if not sample.name.endswith("_count"):
                continue
            region = sample.labels.get("ponto_region", "")
            count = int(sample.value)
            failed = count if sample.labels.get("error_type", "") else 0
            n, errors = served.get(region, (0, 0))
            served[region] = (n + count, errors + failed)
    # Each refused or excused one is a failed operation there: a refused one
    # is no region's at all, an excused one is served but no error.
    for taken, unserved in ((refused, 1), (excused, 0)):
        for region, n in (taken or {}).items():
            if region in served:
                count, errors = served[region]
                served[region] = (count - n * unserved, errors - n)
    tenants = {tenant: (int(n[0]), int(n[1])) for tenant, n in (limited or {}).items()}
    return Traffic(total, server, client, served, tenants)


class ControlPlaneClient:
    """Registers this proxy and applies pushed tables until cancelled.

    Starts on a random control plane address and, when a session ends or
    fails, takes another one at random (never the one that just failed,
    unless it is the only one), with jittered exponential backoff: losing a
    replica spreads its proxies over the others rather than moving them all
    to the next one in the list (a rolling restart had ended with every
    proxy on one replica). `rng` is the random source of both, and of the
    jitter (a seeded one in tests); `monotonic` times sessions (see _run).
    """

    def __init__(
        self,
        holder: TableHolder,
        addresses: Sequence[str],
        info: pb.ProxyInfo,
        *,
        credentials: ClientOptions | None = None,
        on_quota: Callable[[pb.QuotaShares], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        on_loads: Callable[[pb.OriginLoads], object] | None = None,
        demand: Callable[[], list[pb.ScopeDemand]] | None = None,
        traffic: Callable[[], Traffic] | None = None,
        ejected: Callable[[], Sequence[Ejected]] | None = None,
        report_interval: float = 1.0,
        deregister_timeout: float = DEREGISTER_TIMEOUT_S,
        backoff_min: float = 0.2,
        backoff_max: float = 5.0,
        superseded_wait: float = SUPERSEDED_WAIT_S,
        in_group: bool = False,
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise ValueError("no control plane address")
        self._holder = holder
        self._addresses = list(addresses)
        self._info = info
        self._backoff_min = backoff_min
        self._backoff_max = backoff_max
        self._superseded_wait = superseded_wait
        # A worker of a --workers group (see _taken).
        self._in_group = in_group
        self._sleep = sleep
        self._monotonic = monotonic
        self._random = rng or random.Random()  # noqa: S311 - spreading load, not secrets
        self._task: asyncio.Task[None] | None = None
        self._credentials = credentials or ClientOptions()
        self._on_quota = on_quota
        # Called when a session with a control plane ends.
        self._on_lost = on_lost
        self._on_loads = on_loads
        self._demand = demand
        self._traffic = traffic
        self._ejected = ejected
        self._report_interval = report_interval
        self._deregister_timeout = deregister_timeout
        # The address of the last Register sent and its session ("" until it
        # is answered): what a stop deregisters (see _deregister).
        self._registration: tuple[str, str] | None = None
        self._clock = clock
        # The last failure logged of each address: a retry that fails the
        # same way is logged at debug, so the cause stays readable in the log.
        self._said: dict[str, str] = {}
        # The warnings told on this stream (by its last ACK or report): a
        # report carries them again only when they changed (see report()).
        self._told: tuple[str, ...] = ()
        # Whether this session's replica counts rows of other names
        # (RegisterResponse.takes_named_counts; see report()).
        self._named_counts = False
        # The size of the last report not sent for its size (_sendable), 0
        # while they fit.
        self._too_large = 0
        self.connected = False
        # Of the session under way or last ended (_session), for `_run` to
        # read of one that raised: whether its Register was answered, and
        # whether its stream brought a table. `_run` clears them first.
        self._reached = False
        self._had_table = False
        self.quota_generation = 0
        self.loads_generation = 0
        self.nacks = 0
        self.connects = 0
        # Registration waits until the proxy knows the address it serves on
        # (with --listen HOST:0 that is only known after binding).
        self.address_known = asyncio.Event()
        if info.address and not info.address.endswith(":0"):
            self.address_known.set()
        # Set once the first session has applied a table, or ended without
        # one: the link has opened its first channel (gRPC core starts
        # there, touching much of its code once) and done its first work.
        self.tried = asyncio.Event()

    def set_version(self, version: str) -> None:
        """The software version this proxy registers with (read at start)."""
        self._info.version = version

    def set_address(self, address: str) -> None:
        if not self.address_known.is_set():
            self._info.address = address
            self.address_known.set()

    def stop(self) -> None:
        """End the link (run() ends cancelled): a worker leaving its group to a
        successor of its name, which has the registration now, or will."""
        if self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Register and follow the control plane until cancelled (the proxy
        stopping, or stop()); then deregister, best effort (_deregister)."""
        self._task = asyncio.current_task()
        try:
            await self._run()
        except asyncio.CancelledError:
            await self._deregister()
            raise

    async def _deregister(self) -> None:
        """Tell the control plane of the last Register sent that this process
        is leaving (Routing.Deregister), within the deregister timeout: a
        registration whose stream never opened (the proxy stopped between
        the two calls, or in the Register) had stayed listed, and counted in
        every proxy's share of a global limit, for the control plane's
        stream grace (15 s). Sent only for a registration whose stream
        brought nothing (_session forgets one whose stream answered: its end
        removes it), after this link's channel closed. A
        session superseded by another process of the name (a group worker's
        successor) is not this process's and stays. A control plane from
        before the call (UNIMPLEMENTED) or one that does not answer is said
        at DEBUG and INFO: its grace applies."""
        if self._registration is None:
            return
        address, session_id = self._registration
        self._registration = None
        if not session_id and self._info.started_at <= 0:
            return  # nothing would name this process's registration
        request = pb.DeregisterRequest(
            name=self._info.name, session_id=session_id, started_at=self._info.started_at
        )
        try:
            async with aio_channel(address, self._credentials) as channel:
                reply = await routing_pb2_grpc.RoutingStub(channel).Deregister(
                    request, timeout=self._deregister_timeout, metadata=self._credentials.metadata
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.debug("control plane at %s predates Deregister: its grace applies", address)
            else:
                log.info(
                    "could not deregister from the control plane at %s (%s: %s); it drops "
                    "this proxy's registration itself",
                    address,
                    exc.code().name,
                    exc.details(),
                )
            return
        except (OSError, CredentialError) as exc:
            log.info("could not deregister from the control plane at %s: %s", address, exc)
            return
        if reply.removed:
            log.info("deregistered from the control plane at %s", address)

    async def _run(self) -> None:
        await self.address_known.wait()
        backoff = self._backoff_min
        index = self._random.randrange(len(self._addresses))
        while True:
            address = self._addresses[index]
            index = self._other_than(index)
            got_table = False
            # Of this session alone: one that raises before its Register (a
            # TLS file unreadable) must not read as the last one's table, which
            # would retry it at the short spread for as long as it fails.
            self._reached = self._had_table = False
            wait = 0.0
            began = self._monotonic()
            try:
                got_table = await self._session(address)
            except grpc.aio.AioRpcError as exc:
                if self._stopping():
                    # The call's end is the stop's: no failure to say, no
                    # name taken to wait for.
                    raise asyncio.CancelledError from exc
                if exc.code() == grpc.StatusCode.ABORTED:
                    # Another process registered this proxy's name (see
                    # controlplane.api.routing): taking it back at once would
                    # have the two take turns.
                    wait = self._superseded_wait
                    self._taken(address, wait)
                elif linkadvice.replica_stopping(exc.code().name, exc.details() or ""):
                    # A replica restarted in turn (an upgrade) is no fault:
                    # said at INFO, without the TLS advice of a control plane
                    # never reached (trial 93: a warning on every restart).
                    if self._news(address, exc.details() or ""):
                        log.info(
                            "control plane at %s: %s; connecting to %s",
                            address,
                            exc.details(),
                            "another replica" if len(self._addresses) > 1 else "it again",
                        )
                elif self._renewed(exc):
                    log.info(
                        "control plane at %s ended the stream as the certificate it was made "
                        "with expired; connecting again with the renewed one",
                        address,
                    )
                else:
                    self._say(
                        address,
                        self._problem(
                            address, exc.code().name, exc.details() or "", reached=self._reached
                        ),
                    )
            except (OSError, CredentialError) as exc:  # e.g. a TLS file removed since start
                self._say(address, f"control plane at {address}: {exc}")
            except Exception as exc:
                # A bug, told with its traceback (once per cause, as other
                # failures are: it would recur on every session); the link must
                # outlive it, or the proxy would serve its last table for
                # ever, saying nothing.
                if self._news(address, f"control-plane link to {address} failed: {exc!r}"):
                    log.exception("control-plane link to %s failed; retrying", address)
            finally:
                self.connected = False
                self.tried.set()
                if self._on_lost is not None:
                    self._on_lost()
            # A stream that brought a table and then ended (every end but the
            # proxy's own raises: a replica stopping, a certificate expiring)
            # is a session that served, as one returning is, once it lasted
            # the longest backoff: a replica that fails every stream just
            # after its table (crash-looping, or a bug of the stream's) would
            # have each of its proxies back within the spread, twice a second
            # on average, for as long as it fails, not backing off.
            got_table = got_table or self._had_table
            if got_table and self._monotonic() - began >= self._backoff_max:
                backoff = self._backoff_min
                # A fleet whose streams end together (its replica stopping,
                # the certificate its proxies share expiring) comes back over
                # a spread, not in one instant (review 41).
                spread = self._random.uniform(0.0, 5 * self._backoff_min)
            else:
                # Full jitter keeps a fleet from reconnecting in lockstep.
                spread = self._random.uniform(self._backoff_min, backoff)
            if self._stopping():
                raise asyncio.CancelledError
            await self._sleep(wait or spread)
            backoff = min(backoff * 2, self._backoff_max)

    def _stopping(self) -> bool:
        """Whether this link's task was asked to stop (stop(), or the proxy
        stopping), read from the task. A cancellation that lands as a gRPC
        call completes can be taken by grpc.aio for the call's own end (its
        status raised as an error, even OK): unread, the link would go on
        registering its name (a worker stopped for its successor taking it
        back) and its stop would never end. Uncancelled requests (a timeout
        that fired and ended) do not count."""
        return self._task is not None and self._task.cancelling() > 0

    def _other_than(self, index: int) -> int:
        """A random address's index other than `index` (itself if it is the only one)."""
        count = len(self._addresses)
        if count == 1:
            return index
        other = self._random.randrange(count - 1)
        return other if other < index else other + 1

    def _renewed(self, exc: grpc.aio.AioRpcError) -> bool:
        """Whether the control plane ended the stream as the certificate it was
        made with expired, and the files now hold a valid one (renewed in
        place, as cert-manager does): a routine step, not a failure."""
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return False
        if "client certificate expired" not in (exc.details() or ""):
            return False
        try:
            self._credentials.check_files(self._clock())
        except CredentialError:
            return False
        return True

    def _problem(self, address: str, code: str, detail: str, *, reached: bool = False) -> str:
        """The log line of a failed session: gRPC's words and what to fix; for
        a connection the control plane closed, first this proxy's own
        certificate, which may have expired since the proxy started.
        `reached`: the control plane answered this session's Register, so no
        setting of this proxy's kept it away when the session was then cut."""
        if code == "UNAVAILABLE" and self._credentials.tls_cert:
            try:
                self._credentials.check_files(self._clock())
            except CredentialError as exc:
                return (
                    f"control plane at {address} is unreachable: {exc}; give a valid one "
                    "with --tls-cert and --tls-key [UNAVAILABLE]"
                )
        if code == "UNAVAILABLE" and reached:
            # A replica killed, or its node lost ("Stream removed (Socket
            # closed)"), or stopped past its grace ("Cancelling all calls"):
            # the TLS advice of a control plane never reached misled a
            # plaintext fleet (review of trial 93's stopping message).
            return (
                f"control plane at {address} cut the session under way ({detail}): its "
                "replica stopped or was lost [UNAVAILABLE]"
            )
        return linkadvice.proxy_refused(code, detail, address, self._credentials)

    def _taken(self, address: str, wait: float) -> None:
        """Say that another process registered this proxy's name. In a group
        that is, as a rule, this worker's successor in a reload, which
        retires this process in a moment: said at INFO, not as a problem on
        every reload. A proxy alone has no successor: another proxy was given
        its --name (a warning). The pid tells the two processes' lines apart."""
        said = (
            f"another process registered as proxy {self._info.name} "
            f"(this process is pid {os.getpid()}); it serves on with its last table "
            f"and asks again in {wait:g} s"
        )
        if not self._news(address, said):
            return
        if self._in_group:
            log.info("%s (a worker's successor in a reload registers so)", said)
        else:
            log.warning("%s (was another proxy given the same --name?)", said)

    def _say(self, address: str, problem: str) -> None:
        """Log `problem` as a warning unless it is what `address` last failed with."""
        if self._news(address, problem):
            log.warning("%s; retrying", problem)

    def _news(self, address: str, problem: str) -> bool:
        """Whether `problem` is not what `address` last failed with (then it
        is, from now on); one that is, is logged at DEBUG only."""
        if self._said.get(address) == problem:
            log.debug("%s (again)", problem)
            return False
        self._said[address] = problem
        return True

    async def _session(self, address: str) -> bool:
        # The TLS files are read again for each connection, so a certificate
        # rotated in place is taken at the next one; checked first as at
        # start (CredentialError, said once per cause by run()): a rotation
        # left half done had surfaced as gRPC's handshake errors, tens of
        # lines a second (trial 23).
        self._credentials.check_files(self._clock())
        options = [
            *KEEPALIVE_OPTIONS,
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        got_table = False
        metadata = self._credentials.metadata
        async with aio_channel(address, self._credentials, options) as channel:
            stub = routing_pb2_grpc.RoutingStub(channel)
            # started_at is judged against this clock (a clock ahead of the
            # control plane's is no start in the future).
            self._info.sent_at = time.time()
            # Noted before the call: one cancelled (the proxy stopping) may
            # still register it, by the process's start (_deregister).
            self._registration = (address, "")
            try:
                reg = await stub.Register(
                    pb.RegisterRequest(proxy=self._info), timeout=5, metadata=metadata
                )
            except grpc.aio.AioRpcError as exc:
                # OK raised: a stop taken for the call's end (see _stopping),
                # the Register done; a deadline: maybe done.
                if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK):
                    # Refused, or never sent (no connection): nothing to
                    # deregister, and nothing to say at a stop.
                    self._registration = None
                raise
            self._registration = (address, reg.session_id)
            self._reached = True
            outbox: asyncio.Queue[pb.RouteRequest] = asyncio.Queue()
            # A new session's registration holds no warnings yet.
            self._told = ()
            self._named_counts = reg.takes_named_counts
            current = self._holder.routes
            outbox.put_nowait(
                pb.RouteRequest(
                    session_id=reg.session_id,
                    version_info=current.version if current else 0,
                    takes_unchanged=True,  # QuotaState.on_quota takes `unchanged` shares
                    highest_held=max(
                        current.version if current else 0,
                        self.quota_generation,
                        self.loads_generation,
                    ),
                )
            )

            call = stub.RouteStream(metadata=metadata)

            async def send() -> None:
                # The messages, in order, written by a task of this session's:
                # a request iterator was consumed by gRPC in a task of its own,
                # which a call that ended left pending, its generator closed
                # under it (trial 27: two asyncio ERRORs in the proxy's log).
                while True:
                    await call.write(await outbox.get())

            self.connects += 1
            self._said.pop(address, None)  # a later failure is news again
            log.info("connected to control plane %s (%s)", address, reg.control_plane_id)
            tasks = (
                asyncio.create_task(send()),
                asyncio.create_task(self._report(reg.session_id, outbox)),
            )
            # Set once a table of this stream is another fleet's (the replica's
            # etcd lost its state, or is another): its quota shares and origin
            # loads are that fleet's too, computed without this proxy's
            # limits, and are not applied (the last ones stand).
            foreign = ""
            try:
                async for update in call:
                    # The stream is open at the control plane: its end removes
                    # the registration, which a stop need not deregister
                    # (review 290: a Deregister racing the stream's end wrote
                    # a departure note for nothing, and one to a replica that
                    # hangs held the stop up to its deadline).
                    self._registration = None
                    self.connected = True
                    if update.HasField("table"):
                        got_table = self._had_table = True
                        outbox.put_nowait(self._handle(reg.session_id, update))
                        self.tried.set()
                        foreign = self._foreign(update.table, address, foreign)
                    if foreign:
                        continue
                    if update.HasField("quota"):
                        self._apply_quota(update.quota)
                    if update.HasField("loads"):
                        self._apply_loads(update.loads)
            finally:
                for task in tasks:
                    task.cancel()
                # Their ends taken here: a write to the ended call fails, as
                # the call did (said by run()).
                await asyncio.gather(*tasks, return_exceptions=True)
        return got_table

    def _foreign(self, table: pb.RouteTable, address: str, was: str) -> str:
        """The fleet id of `table` if it is another fleet's than the one
        served (the holder refused it), else ""; said once per stream."""
        served = self._holder.fleet_id
        foreign = table.fleet_id if served and table.fleet_id not in ("", served) else ""
        if foreign and not was:
            log.warning(
                "control plane at %s serves fleet %s, not this proxy's (%s): its quota "
                "shares and origin loads are not applied either",
                address,
                foreign,
                served,
            )
        return foreign

    def _apply_quota(self, quota: pb.QuotaShares) -> None:
        if quota.generation and quota.generation < self.quota_generation:
            return  # an older replica's view; the newer one stands
        self.quota_generation = quota.generation
        if self._on_quota is not None:
            self._on_quota(quota)

    def _apply_loads(self, loads: pb.OriginLoads) -> None:
        """Hand pushed loads on, unless older than the last (a lagging
        replica's view after a reconnect). Called on the link's task: the
        callback must not block."""
        if loads.generation and loads.generation < self.loads_generation:
            return
        self.loads_generation = loads.generation
        if self._on_loads is not None:
            self._on_loads(loads)

    async def _report(self, session_id: str, outbox: asyncio.Queue[pb.RouteRequest]) -> None:
        """Send this proxy's rate-limit demand, its traffic counters and its
        warnings when they changed, about once an interval. A report that
        fails to be made (a bug) is told once a session, with its traceback,
        and the next one is tried: had it ended this task, no report would
        have gone for the rest of the session, and nothing said so (review 46)."""
        told = False
        while True:
            await asyncio.sleep(self._report_interval)
            told_before = self._told
            try:
                message = self.report(session_id)
            except Exception:
                if not told:
                    log.exception("could not make a report to the control plane")
                told = True
                continue
            if self._sendable(message):
                outbox.put_nowait(message)
            else:
                # Its warnings, if it carried them, go with the next one sent.
                self._told = told_before

    def _sendable(self, message: pb.RouteRequest) -> bool:
        """Whether report `message` is within what a replica takes
        (MAX_REPORT_BYTES). One past it is not sent, said once until they fit
        again: its carried rows are bounded (QuotaState.demand), so it is the
        proxy's own rows, one a scope in use here (tens of thousands), and
        neither dropping some (read as no demand) nor ending the stream
        would count them. The leader goes on from the last report sent;
        the counts, cumulative, go with the next one that fits."""
        size = message.ByteSize()
        if size <= MAX_REPORT_BYTES:
            if self._too_large:
                log.info("reports to the control plane fit again (%d bytes)", size)
                self._too_large = 0
            return True
        if not self._too_large:
            log.error(
                "report to the control plane not sent: %d bytes for %d scopes, past the "
                "%d a replica takes; until it fits, the leader goes on from this proxy's "
                "last report (its demand and budget counts stand still there, counts "
                "since go with the next report that fits): fewer scopes in use here "
                "bring it under",
                size,
                len(message.demand),
                MAX_REPORT_BYTES,
            )
        self._too_large = size
        return False

    def report(self, session_id: str) -> pb.RouteRequest:
        """One report message: demand since the last one, cumulative traffic,
        the origins passive health ejected (at most MAX_EJECTED_REPORTED), and
        the warnings (RouteRequest.warnings_current) if they are not
        those last told on this stream: a JWKS URL's set lost or found
        between two tables (trial 26: `pontoctl get proxies` said what the
        last ACK had until the next table came)."""
        message = pb.RouteRequest(session_id=session_id, is_report=True)
        warnings = self.warnings()
        if warnings != self._told:
            message.warnings.extend(warnings)
            message.warnings_current = True
            self._told = warnings
        if self._demand is not None:
            message.demand.extend(self._demand())
            if not self._named_counts:
                # An older replica would count another name's rows as this
                # proxy's own (a second time): they wait for a replica that
                # takes them, within the reports that carry them.
                for row in message.demand:
                    if any(c.proxy for c in row.closed):
                        own = [c for c in row.closed if not c.proxy]
                        del row.closed[:]
                        row.closed.extend(own)
        if self._traffic is not None:
            traffic = self._traffic()
            message.requests_total = traffic.requests
            message.server_errors_total = traffic.server_errors
            message.client_errors_total = traffic.client_errors
            for region, (n, errors) in sorted(traffic.served.items()):
                message.served.add(region=region, requests_total=n, errors_total=errors)
            for tenant, (refused, waits) in sorted(traffic.limited.items()):
                message.limited.add(tenant=tenant, refused_total=refused, slot_waits_total=waits)
        if self._ejected is not None:
            for e in self._ejected()[:MAX_EJECTED_REPORTED]:
                message.ejected.add(
                    origin=e.origin,
                    for_s=e.for_s,
                    ejections=e.ejections,
                    last_failure=e.last_failure,
                    ejected_s=e.ejected_s,
                    failed_s=e.failed_s,
                )
        return message

    def _handle(self, session_id: str, update: pb.RouteUpdate) -> pb.RouteRequest:
        try:
            self._holder.apply(update.table, "control-plane")
        except Exception as exc:
            # A TableError is the table's fault; anything else is this
            # proxy's (a bug), told with its traceback. Either way the table
            # is refused and the link lives on: escaping here, it would end
            # the link's task, and the proxy would hear of no table again.
            self.nacks += 1
            if isinstance(exc, TableRefused):
                pass  # logged by the holder, once per fleet id (not per push)
            elif isinstance(exc, TableError):
                log.error("refused route table version %d: %s", update.table.version, exc)
            else:
                log.exception(
                    "refused route table version %d: applying it failed", update.table.version
                )
            current = self._holder.routes
            return pb.RouteRequest(
                session_id=session_id,
                version_info=current.version if current else 0,
                response_nonce=update.nonce,
                error_detail=str(exc) or type(exc).__name__,
                fleet_id=self._holder.fleet_id,
            )
        self._told = self.warnings()
        return pb.RouteRequest(
            session_id=session_id,
            version_info=update.table.version,
            response_nonce=update.nonce,
            warnings=self._told,
            fleet_id=self._holder.fleet_id,
        )

    def warnings(self) -> tuple[str, ...]:
        """What an ACK reports of the table being served: a region of the
        proxy's the table lacks; each origin whose credential this proxy
        cannot have (Routes.credential_problems); each tenant whose JWT config
        this proxy could not load, with why and what it costs; and each part
        of the proxy that could not take the table (a bug). Made for every
        report too (about once a second): a variable set or a file mounted
        later clears its warning."""
        policy, routes = self._holder.policy, self._holder.routes
        if policy is None or routes is None:
            return ()
        region = routes.region_problem()
        jwt = (
            f"{problem}; that tenant's JWTs are answered 503 auth_unavailable "
            "(its API keys still work)"
            for _, problem in sorted(policy.authenticator.problems.items())
        )
        failed = (
            f"a part of this proxy could not take the table ({failure}); it keeps its "
            "previous settings (a bug: see the proxy's log)"
            for failure in self._holder.apply_failures
        )
        credentials = routes.credential_problems()
        # A bug's and the region's first: the control plane keeps 16 of them.
        return (*((region,) if region else ()), *failed, *jwt, *credentials)
