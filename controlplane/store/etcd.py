"""StateStore over etcd v3 (etcd3aio, native grpc.aio).

Calls carry a deadline so that an etcd outage surfaces as StoreUnavailable in
seconds instead of hanging admin calls. Watches resume from their last revision
after an etcd restart (etcd3aio reconnects); after compaction the consumer
re-lists, which the revision-only watch contract already requires.

Endpoints may name hosts or be IPv6 literals (etcd3aio alone takes IPv4
literals only); see grpc_target for how they become one gRPC target, and
EtcdTls for TLS.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, SortOrder, prefix_range_end
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest

from controlplane.store.base import (
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    StoreUnavailable,
    Write,
    txn_size,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# With several host names, a failing call looks them up again at most this often.
RERESOLVE_INTERVAL = 5.0
# A store's watches each find etcd's revision gone back: said once in this long.
REGRESSION_TOLD_S = 60.0
# A lease revoked while etcd's last call failed gets this long, not the call
# timeout: revocation only hastens what the lease's TTL does anyway, and a
# replica stopping with etcd away waited the whole timeout for each of its
# two leases (trial 43: 7-10 s to stop). An etcd that answers does in
# milliseconds.
REVOKE_AWAY_S = 0.5


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """TLS to etcd, as PEM bytes.

    ca_cert verifies etcd's server certificate (there is no fallback to system
    roots: etcd clusters are signed by their own CA). cert_chain and cert_key,
    both or neither, are this replica's client certificate for an etcd run
    with --client-cert-auth.
    """

    ca_cert: bytes
    cert_chain: bytes | None = None
    cert_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.cert_key is None):
            raise ValueError("an etcd client certificate needs its key, and a key its certificate")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[IPv6 address]:port` (no scheme); pure.

    The host comes back without brackets. Raises ValueError naming what is
    wrong: no port or one outside 1..65535, an IPv6 address without brackets
    (its last group would read as the port), brackets around anything but an
    IPv6 address, or an IPv6 zone (`%eth0`), which a gRPC target cannot carry.
    """
    if endpoint.endswith("]"):  # [IPv6 address] without a port
        raise ValueError("is not [http[s]://]HOST:PORT")
    host, _, port = endpoint.rpartition(":")
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        if "%" in inner:
            raise ValueError("has an IPv6 zone (%...), which the etcd channel cannot use")
        if not isinstance(_ip(inner), ipaddress.IPv6Address):
            raise ValueError("has brackets around something other than an IPv6 address")
        host = inner
    elif ":" in host:
        raise ValueError("is an IPv6 address without brackets; write [ADDRESS]:PORT")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError("is not [http[s]://]HOST:PORT")
    return host, int(port)


def _host(endpoint: str) -> str:
    """The host of a checked endpoint (`split_endpoint`, which raises on others)."""
    return split_endpoint(endpoint)[0]


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_address(host: str) -> bool:
    """An IP literal, or `localhost`, which etcd3aio itself turns into 127.0.0.1."""
    return host == "localhost" or _ip(host) is not None


def _is_ipv6(host: str) -> bool:
    return isinstance(_ip(host), ipaddress.IPv6Address)


def names_to_resolve(endpoints: Sequence[str]) -> tuple[str, ...]:
    """Host names EtcdStore must look up itself before building the channel.

    None for IP literals (an `ipv4:` or `ipv6:` target) or for a single
    endpoint (a `dns:` target that gRPC resolves); every name when there are
    several endpoints, since one gRPC target cannot list several names.
    """
    if len(endpoints) < 2:
        return ()
    hosts = (_host(e) for e in endpoints)
    return tuple(dict.fromkeys(h for h in hosts if not _is_address(h)))


def grpc_target(
    endpoints: Sequence[str], addresses: Mapping[str, Sequence[str]] | None = None
) -> str | None:
    """The gRPC target for endpoints (`host:port`, `[IPv6 address]:port`); pure.

    None: all IPv4 literals, keep etcd3aio's `ipv4:` target. One DNS name (a
    Kubernetes headless Service, say) becomes a `dns:` target that gRPC
    re-resolves on reconnect and balances over every address. Otherwise a
    list of addresses: the literals, and for several endpoints with names the
    `addresses` each name had (name -> addresses, as resolve_names finds them for
    names_to_resolve); names missing from it are left out, and if nothing is
    left the first endpoint becomes a `dns:` target, so the channel keeps
    trying while the names do not resolve yet.

    A list is `ipv4:` unless it holds an IPv6 address; then it is `ipv6:`,
    and its IPv4 addresses are written IPv4-mapped (`[::ffff:10.0.0.1]:2379`):
    gRPC's `ipv4:` and `ipv6:` schemes each refuse the other family's
    addresses, and gRPC dials an IPv4-mapped address over IPv4.
    """
    if len(endpoints) == 1 and not _is_address(_host(endpoints[0])):
        return f"dns:///{endpoints[0]}"
    if not names_to_resolve(endpoints) and not any(_is_ipv6(_host(e)) for e in endpoints):
        return None
    addresses = addresses or {}
    resolved: list[tuple[str, int]] = []
    for endpoint in endpoints:
        host, port = split_endpoint(endpoint)
        if _is_address(host):
            resolved.append(("127.0.0.1" if host == "localhost" else host, port))
        else:
            resolved += [(address, port) for address in addresses.get(host, ())]
    if not resolved:
        return f"dns:///{endpoints[0]}"
    if not any(_is_ipv6(address) for address, _ in resolved):
        return "ipv4:" + ",".join(dict.fromkeys(f"{a}:{port}" for a, port in resolved))
    return "ipv6:" + ",".join(
        dict.fromkeys(f"[{a if _is_ipv6(a) else '::ffff:' + a}]:{port}" for a, port in resolved)
    )


def tls_server_name(endpoints: Sequence[str]) -> str:
    """The name etcd's certificates are checked against: the first endpoint's host.

    One target of several addresses carries no name of its own, so with
    several endpoints every member's certificate must list the first one's
    host (etcd certificates usually list every member, or a wildcard).
    """
    return _host(endpoints[0])


GetAddrInfo = Callable[..., Awaitable[list[tuple[Any, ...]]]]


async def resolve_names(
    names: Sequence[str], getaddrinfo: GetAddrInfo | None = None
) -> dict[str, tuple[str, ...]]:
    """The addresses of each name that resolves now (the system resolver, or
    `getaddrinfo` like the loop's); others are logged. Its IPv4 addresses
    when it has any (a dual-stack name stays on IPv4, as before IPv6 was
    looked up), else its IPv6 ones: an IPv6-only cluster's names work too."""
    lookup = getaddrinfo or asyncio.get_running_loop().getaddrinfo
    found: dict[str, tuple[str, ...]] = {}
    for name in names:
        try:
            infos = await lookup(name, None, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("etcd endpoint %s does not resolve: %s", name, exc)
            continue
        v4 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET]
        # A scoped address (fe80::1%eth0) cannot go into a gRPC target.
        v6 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET6 and "%" not in str(i[4][0])]
        if v4 or v6:
            found[name] = tuple(dict.fromkeys(v4 or v6))
    return found


class EtcdStore:
    """StateStore on an etcd cluster; see the module docstring.

    endpoints are `host:port` or `[IPv6 address]:port` (as split_endpoint
    checks), optionally with `http://` or `https://`; hosts may be IP
    literals or names. With tls, every endpoint is reached over TLS;
    an `https://` endpoint without it is refused (ValueError).

    How names are followed: one endpoint that is a name (the recommended form,
    e.g. a headless Service) is re-resolved by gRPC itself whenever it
    reconnects. Several endpoints with names are looked up here at connect()
    and again when calls fail (at most every RERESOLVE_INTERVAL seconds); the
    channel is rebuilt only if the addresses changed. The limit: a member that
    moves to a new address is not picked up while the others still answer.

    `watch_failed` is called each time a watch fails and is restarted, here
    or inside etcd3aio (its consumer never sees that), for the replica's metrics.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 3.0,
        tls: EtcdTls | None = None,
        watch_failed: Callable[[], None] = lambda: None,
    ) -> None:
        if tls is None and any(e.startswith("https://") for e in endpoints):
            raise ValueError(
                "https:// etcd endpoints need the CA that signed etcd's certificate (--etcd-ca)"
            )
        self._endpoints = [e.removeprefix("http://").removeprefix("https://") for e in endpoints]
        self._timeout = timeout
        self._tls = tls
        self._watch_failed = watch_failed
        self._names = names_to_resolve(self._endpoints)
        self._target = grpc_target(self._endpoints)
        self._client = self._new_client(self._target)
        self._connected = False
        self._reresolved_at = 0.0
        self._reresolving: asyncio.Task[None] | None = None
        self._regression_told = -REGRESSION_TOLD_S
        self._answering = True  # etcd's last call succeeded (or none was made)

    @property
    def target(self) -> str:
        """The gRPC target in use (names resolved by connect(), for logs and tests)."""
        return str(self._client._manager.target)

    def _new_client(self, target: str | None) -> Etcd3Client:
        tls = self._tls
        client = Etcd3Client(
            self._endpoints,
            # Retries with backoff ride out a reconnect (about 1.5 s in all),
            # all within the per-call timeout.
            rpc_max_attempts=6,
            watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=1.0,
            tls_server_name=tls_server_name(self._endpoints) if tls else None,
            ca_cert=tls.ca_cert if tls else None,
            cert_chain=tls.cert_chain if tls else None,
            cert_key=tls.cert_key if tls else None,
        )
        if target is not None:
            client._manager.target = target
        # gRPC's default reconnect backoff grows to minutes; an etcd that comes
        # back must be used again within about a second.
        client._manager.grpc_options += [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        return client

    async def connect(self) -> None:
        """Open the channel; connecting is lazy in gRPC, so this never blocks on etcd.

        With several host names it looks them up first (the system resolver,
        so it waits for DNS, not for etcd).
        """
        if self._connected:
            return
        if self._names:
            self._target = grpc_target(self._endpoints, await resolve_names(self._names))
            self._client = self._new_client(self._target)
            self._reresolved_at = asyncio.get_running_loop().time()
        await self._client.connect()
        self._connected = True
        tls = self._tls
        log.info(
            "etcd at %s over %s",
            self.target,
            "plaintext"
            if tls is None
            else f"{'mutual TLS' if tls.cert_chain else 'TLS'} (server name "
            f"{tls_server_name(self._endpoints)})",
        )

    def _failed(self) -> None:
        """A call failed: with several names, look them up again soon (in the background)."""
        if not self._names or not self._connected or self._reresolving is not None:
            return
        now = asyncio.get_running_loop().time()
        if now - self._reresolved_at < RERESOLVE_INTERVAL:
            return
        self._reresolved_at = now
        self._reresolving = asyncio.create_task(self._reresolve(), name="etcd-reresolve")

    async def _reresolve(self) -> None:
        try:
            target = grpc_target(self._endpoints, await resolve_names(self._names))
            if target == self._target or not self._connected:
                return
            client = self._new_client(target)
            await client.connect()
            # Calls look the client up each time, so new calls take the new
            # channel at once; calls and watches on the old one fail when it
            # closes (CANCELLED, or UsageError) and are retried by their callers.
            old, self._client, self._target = self._client, client, target
            log.warning("etcd endpoints re-resolved; now at %s", target)
            await old.close()
        except Exception:  # a failed look-up must not end the store; the next failure retries
            log.exception("re-resolving etcd endpoints failed")
        finally:
            self._reresolving = None

    async def _call(self, what: str, aw: Awaitable[T]) -> T:
        try:
            answer = await aw
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            self._answering = False
            self._failed()
            raise StoreUnavailable(f"etcd {what} failed: {_why(exc)}") from exc
        self._answering = True
        return answer

    @property
    def _kv(self) -> Any:
        assert self._client.kv is not None, "EtcdStore.connect() not called"
        return self._client.kv

    @property
    def _lease(self) -> Any:
        assert self._client.lease is not None, "EtcdStore.connect() not called"
        return self._client.lease

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call("get", self._kv.get(key, timeout=self._timeout))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)

    async def list(self, prefix: str) -> Listing:
        resp = await self._call(
            "list",
            self._kv.get(prefix, range_end=prefix_range_end(prefix), timeout=self._timeout),
        )
        items = tuple(
            KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
            for kv in resp.kvs
        )
        return Listing(resp.header.revision, tuple(sorted(items, key=lambda i: i.key)))

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        # Keys come in ascending order unsorted (SortOrder.NONE), and then etcd
        # stops at the limit before reading values; to sort (even descending)
        # it would read the whole range first.
        resp = await self._call(
            "scan",
            self._kv.get(
                start, range_end=end, limit=limit, sort_order=SortOrder.NONE, timeout=self._timeout
            ),
        )
        items = tuple(
            KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
            for kv in resp.kvs
        )
        return Listing(resp.header.revision, items)

    async def count(self, start: str, end: str) -> int:
        resp = await self._call(
            "count", self._kv.get(start, range_end=end, count_only=True, timeout=self._timeout)
        )
        return int(resp.count)

    async def delete_range(self, start: str, end: str) -> int:
        resp = await self._call(
            "delete range", self._kv.delete(start, range_end=end, timeout=self._timeout)
        )
        return int(resp.deleted)

    def _compares(
        self, key: str, if_absent: bool, if_mod_revision: int | None, fence: Fence | None = None
    ) -> builtins.list[Any]:
        from etcd3aio._protobuf import Compare  # noqa: PLC0415

        kv = self._kv
        compares: builtins.list[Any] = []
        if if_absent:
            compares.append(kv.txn_compare_create_revision(key, 0))
        for k, rev in (
            (key, if_mod_revision),
            (fence.key, fence.mod_revision) if fence else ("", None),
        ):
            if rev is None:
                continue
            c = Compare(result=Compare.EQUAL, target=Compare.MOD, key=k.encode())
            c.mod_revision = rev
            compares.append(c)
        return compares

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        lease: int = 0,
        if_absent: bool = False,
        if_mod_revision: int | None = None,
        fence: Fence | None = None,
    ) -> int:
        compares = self._compares(key, if_absent, if_mod_revision, fence)
        try:
            if not compares:
                resp = await self._call(
                    "put", self._kv.put(key, value, lease=lease, timeout=self._timeout)
                )
                return int(resp.header.revision)
            op = self._kv.txn_op_put(key, value, lease=lease)
            txn = await self._call("txn", self._kv.txn(compares, [op], timeout=self._timeout))
        except StoreUnavailable as exc:
            if "lease not found" in str(exc):
                raise LeaseExpired(f"lease {lease:x} not found") from exc
            raise
        if not txn.succeeded:
            raise Conflict(f"condition on {key} failed")
        return int(txn.header.revision)

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        compares = self._compares(key, False, if_mod_revision)
        if not compares:
            resp = await self._call("delete", self._kv.delete(key, timeout=self._timeout))
            return bool(resp.deleted)
        op = self._kv.txn_op_delete(key)
        txn = await self._call("txn", self._kv.txn(compares, [op], timeout=self._timeout))
        if not txn.succeeded:
            raise Conflict(f"condition on {key} failed")
        return bool(txn.responses[0].response_delete_range.deleted)

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        if len({w.key for w in writes}) != len(writes):
            raise ValueError("a transaction names a key twice")
        if txn_size(writes, checks) > MAX_TXN_OPS:
            raise ValueError(f"a transaction has more than {MAX_TXN_OPS} writes or conditions")
        compares: builtins.list[Any] = []
        for w in writes:
            compares += self._compares(w.key, False, w.if_mod_revision)
        for c in checks:
            compares += self._compares(c.key, False, c.mod_revision)
        kv = self._kv
        ops = [
            kv.txn_op_delete(w.key) if w.value is None else kv.txn_op_put(w.key, w.value)
            for w in writes
        ]
        txn = await self._call("txn", kv.txn(compares, ops, timeout=self._timeout))
        if not txn.succeeded:
            raise Conflict("a condition of the transaction failed")
        return int(txn.header.revision)

    async def grant_lease(self, ttl: int) -> int:
        resp = await self._call("lease grant", self._lease.grant(ttl, timeout=self._timeout))
        return int(resp.ID)

    async def refresh_lease(self, lease_id: int) -> int:
        async def once() -> int:
            stream = self._lease.keep_alive(lease_id)
            try:
                async for resp in stream:
                    return int(resp.TTL)
                raise StoreUnavailable("lease keepalive stream ended")
            finally:
                stream.cancel()

        ttl = await self._call("lease keepalive", asyncio.wait_for(once(), self._timeout))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired")
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke lease_id, or let its TTL end it: a failure is not raised,
        and while etcd's last call failed this tries for REVOKE_AWAY_S only."""
        timeout = self._timeout if self._answering else min(self._timeout, REVOKE_AWAY_S)
        with contextlib.suppress(StoreUnavailable):
            await self._call("lease revoke", self._lease.revoke(lease_id, timeout=timeout))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        """Its own stream, re-created after a failure (etcd restarted, or
        away) from the last revision seen: a call written to, not fed by a
        request generator as etcd3aio's watch is, whose re-creations left
        gRPC's task consuming the generator pending, logged at ERROR by
        asyncio as each was collected (trial 17). A failure is logged once,
        at WARNING, until the watch is created again (INFO); the tries
        between are at DEBUG."""
        failing = False
        while True:
            if not self._connected:
                return  # the store was closed (review 38: it failed on, every 0.5 s)
            # The client of now: a failure may have looked etcd's names up again.
            watching = self._client.watch
            assert watching is not None, "EtcdStore.connect() not called"
            call: Any = None
            try:
                call = watching._stub.Watch(metadata=watching._metadata or None)
                create = WatchCreateRequest(
                    key=prefix.encode(),
                    range_end=prefix_range_end(prefix),
                    # 0 asks etcd for changes from now on, not for all of history.
                    start_revision=start_revision + 1 if start_revision else 0,
                )
                await call.write(WatchRequest(create_request=create))
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise _WatchEnded("the stream ended")
                    if resp.created:
                        log.debug("etcd watch on %s created at %d", prefix, resp.header.revision)
                        if failing:
                            failing = False
                            log.info("etcd watch on %s resumed", prefix)
                        if start_revision > resp.header.revision:
                            # etcd is behind what this watch saw: restored from
                            # a backup, or its data lost. From start_revision it
                            # would yield nothing until etcd got back there, and
                            # the table would freeze (trial 34): read again now.
                            await self._regressed(prefix, start_revision, resp.header.revision)
                            start_revision = resp.header.revision
                            yield resp.header.revision
                            break
                        if not start_revision:
                            # Watched "from now": a stream re-created after a
                            # failure resumes from here, and gets what was
                            # written meanwhile (review 37: a drain made while
                            # the watch was down never reached the table). One
                            # from a revision has its replay still to come.
                            start_revision = resp.header.revision
                    if resp.compact_revision:
                        # History is gone: tell the consumer to re-list now.
                        start_revision = resp.compact_revision
                        log.warning("etcd watch on %s compacted at %d", prefix, start_revision)
                        yield resp.compact_revision
                        break
                    if resp.canceled:
                        raise _WatchEnded(f"etcd cancelled it: {resp.cancel_reason}")
                    if resp.events:
                        start_revision = resp.header.revision
                        yield resp.header.revision
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # Not this task's cancellation: gRPC's of the call, whose
                # channel closed under it (the names of etcd looked up again,
                # see _reresolve). Review 37: it ended every watch for good.
                self._watch_failed()
                failing = True
                log.warning("etcd watch on %s: its channel was replaced; watching anew", prefix)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, _WatchEnded) as exc:
                self._watch_failed()
                self._failed()
                (log.debug if failing else log.warning)(
                    "etcd watch on %s failed (%s); retrying every 0.5 s", prefix, _why(exc)
                )
                failing = True
                await asyncio.sleep(0.5)
            finally:
                if call is not None:
                    call.cancel()

    async def _regressed(self, prefix: str, seen: int, now: int) -> None:
        """Say, once for all of a store's watches, that etcd's revision went
        back, once a linearizable read agrees: a member a little behind the
        others answered `now` too (review 50), and that is no loss."""
        with contextlib.suppress(StoreUnavailable):  # else `now` stands: etcd said it
            now = (await self.list(prefix)).revision
        if now >= seen:
            log.debug("etcd watch on %s created on a member behind (%d)", prefix, seen)
            return
        clock = time.monotonic()
        if clock - self._regression_told < REGRESSION_TOLD_S:
            return
        self._regression_told = clock
        log.error(
            "etcd's revision went back from %d to %d: it was restored from a backup, or "
            "its data was lost. Everything is read again from it (docs/architecture.md, "
            "Versions)",
            seen,
            now,
        )

    async def close(self) -> None:
        if self._reresolving is not None:
            self._reresolving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reresolving
        if self._connected:
            await self._client.close()
            self._connected = False


class _WatchEnded(Exception):
    """etcd ended a watch's stream, or cancelled the watch."""


def _why(exc: BaseException) -> str:
    """An etcd call's failure in one line: gRPC's own str() is a multi-line
    dump with its debug string."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} ({exc.details()})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
