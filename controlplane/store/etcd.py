"""StateStore over etcd v3 (etcd3aio, native grpc.aio).

Calls carry a deadline so that an etcd outage surfaces as StoreUnavailable in
seconds instead of hanging admin calls. Watches resume from their last revision
after an etcd restart (etcd3aio reconnects); after compaction the consumer
re-lists, which the revision-only watch contract already requires.

A member that hangs (stopped, or its disk stalled) still accepts connections,
so gRPC's round robin kept sending it every third call, each of which then
used up its whole timeout (trial: one SIGSTOPped member of three failed a
third of all calls for as long as it was stopped). So each member has its own
channel, and calls go to one of them, as etcd's own client pins an endpoint:
a call that times out or cannot connect there moves the store to the member
that failed longest ago (one that never failed first). A read, or a lease
call, gets a third of the call's timeout per attempt, and the rest of it for
attempts on the next members; a write gets one attempt unless it was not
sent at all (no connection), since a write that may have reached a member
can still be applied when that member runs again: it raises OutcomeUnknown.

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
import math
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, SortOrder, prefix_range_end
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest
from etcd3aio.connections import ConnectionManager

from controlplane.store.base import (
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    OutcomeUnknown,
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
# A call's timeout: how long a replica waits for etcd before it says the store
# is unreachable (its health's store status, "cannot build the route table
# yet"). The control plane's hidden --etcd-timeout-ms sets it, for tests that
# would otherwise wait it out (e2e test_control_plane_health runs at 1 s).
CALL_TIMEOUT_S = 3.0
# A read's attempt on one member gets this share of the call's timeout; the
# rest is for the next members. etcd answers a read in milliseconds, or in
# about an election timeout (1 s by default) while it elects a leader.
ATTEMPT_SHARE = 1 / 3
# A member that answers no keepalive ping within this is taken as gone: its
# connection closes and the watches on it are made again elsewhere
# (etcd3aio's 5 s held a watch on a hung member that long after the ping).
KEEPALIVE_TIMEOUT_MS = 2000
# The largest answer taken from etcd, as etcd's own Go client takes (its
# MaxCallRecvMsgSize, math.MaxInt32): the state is read whole at one revision
# (Catalog.snapshot), and gRPC's default of 4 MiB stopped every build past
# about 10,000 API keys (trial 83: RESOURCE_EXHAUSTED, the fleet frozen on its
# last table while keys were still created). What etcd holds is bounded by
# its --quota-backend-bytes instead (2 GiB by default).
MAX_ANSWER_BYTES = 2**31 - 1
# gRPC's words for a call that never left this process (no connection to
# the member, a name that did not resolve): a write failed so is retried on
# the next member, as it cannot have been applied.
_UNSENT = (
    "failed to connect to all addresses",
    "connections to all backends failing",
    "DNS resolution failed",
)
# A move to a member that failed less than this long ago is logged at DEBUG:
# with all of etcd away, calls go round the members and each move would warn.
MOVE_TOLD_S = 30.0


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


def member_targets(target: str) -> tuple[str, ...]:
    """One gRPC target per member of a target that lists addresses (`ipv4:`,
    `ipv6:`), each of one address; any other target (a `dns:` name, which
    gRPC resolves and balances itself) as the only one. Pure."""
    scheme, _, addresses = target.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return (target,)
    return tuple(f"{scheme}:{address}" for address in addresses.split(","))


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
        timeout: float = CALL_TIMEOUT_S,
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
        self._attempt = timeout * ATTEMPT_SHARE
        self._names = names_to_resolve(self._endpoints)
        self._target = self._full(grpc_target(self._endpoints))
        self._members: builtins.list[_Member] = []
        self._pin = 0  # the member calls go to (see the module docstring)
        self._use(self._new_members(self._target))
        self._connected = False
        self._reresolved_at = 0.0
        self._reresolving: asyncio.Task[None] | None = None
        self._regression_told = -REGRESSION_TOLD_S
        self._answering = True  # etcd's last call succeeded (or none was made)

    @property
    def target(self) -> str:
        """The gRPC target of all members (names resolved by connect(), for logs and tests)."""
        return self._target

    @property
    def pinned(self) -> str:
        """The gRPC target of the member calls go to now (for logs and tests)."""
        return self._members[self._pin].target

    @property
    def _client(self) -> Etcd3Client:
        return self._members[self._pin].client

    def _full(self, target: str | None) -> str:
        """target, or etcd3aio's own for the endpoints when it is None."""
        return target if target is not None else ConnectionManager(self._endpoints).target

    def _new_members(self, target: str) -> builtins.list[_Member]:
        return [_Member(t, self._new_client(t)) for t in member_targets(target)]

    def _use(self, members: builtins.list[_Member]) -> None:
        """Call members from now on, starting at a random one: each replica at
        a member of its own, not all at the first."""
        self._members = members
        self._pin = random.randrange(len(members))  # noqa: S311 - spread, not secrecy

    def _new_client(self, target: str) -> Etcd3Client:
        tls = self._tls
        client = Etcd3Client(
            self._endpoints,
            # One attempt: _call makes the others, on the next member.
            rpc_max_attempts=1,
            watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=1.0,
            tls_server_name=tls_server_name(self._endpoints) if tls else None,
            ca_cert=tls.ca_cert if tls else None,
            cert_chain=tls.cert_chain if tls else None,
            cert_key=tls.cert_key if tls else None,
        )
        client._manager.target = target
        # gRPC's default reconnect backoff grows to minutes; an etcd that comes
        # back must be used again within about a second.
        client._manager.grpc_options = [
            option
            for option in client._manager.grpc_options
            if option[0] != "grpc.keepalive_timeout_ms"
        ] + [
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
        ]
        return client

    async def connect(self) -> None:
        """Open the channels; connecting is lazy in gRPC, so this never blocks on etcd.

        With several host names it looks them up first (the system resolver,
        so it waits for DNS, not for etcd).
        """
        if self._connected:
            return
        if self._names:
            self._target = self._full(
                grpc_target(self._endpoints, await resolve_names(self._names))
            )
            self._use(self._new_members(self._target))
            self._reresolved_at = asyncio.get_running_loop().time()
        for member in self._members:
            await member.client.connect()
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
            target = self._full(grpc_target(self._endpoints, await resolve_names(self._names)))
            if target == self._target or not self._connected:
                return
            members = self._new_members(target)
            for member in members:
                await member.client.connect()
            # Calls look the member up each time, so new calls take the new
            # channels at once; calls and watches on the old ones fail when
            # they close (CANCELLED, or UsageError) and are retried.
            old = self._members
            self._use(members)
            self._target = target
            log.warning("etcd endpoints re-resolved; now at %s", target)
            for member in old:
                await member.client.close()
        except Exception:  # a failed look-up must not end the store; the next failure retries
            log.exception("re-resolving etcd endpoints failed")
        finally:
            self._reresolving = None

    def _member_failed(self, member: _Member, why: str) -> None:
        """member timed out or could not be reached: if calls go to it, they
        go to the member that failed longest ago from now on (the next one
        on a tie), and the watches on it are made again there."""
        now = asyncio.get_running_loop().time()
        member.failed_at = now
        members = self._members
        if members[self._pin] is not member or len(members) < 2:
            return
        n = len(members)
        pin = min(((self._pin + k) % n for k in range(1, n)), key=lambda i: members[i].failed_at)
        self._pin = pin
        told = now - members[pin].failed_at >= MOVE_TOLD_S
        (log.warning if told else log.debug)(
            "etcd member %s failed (%s); calls go to %s now",
            member.target,
            why,
            members[pin].target,
        )
        for call in builtins.list(member.watches):
            call.cancel()

    async def _call(
        self,
        what: str,
        op: Callable[[_Member, float], Awaitable[T]],
        *,
        write: bool = False,
        within: float | None = None,
    ) -> T:
        """op(member, attempt's timeout) on the member calls go to, retried on
        the next members within the call's timeout (see the module docstring).
        Raises StoreUnavailable, or OutcomeUnknown for a write that was sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout if within is None else within)
        pause = 0.05
        tries = 0
        while True:
            member = self._members[self._pin]
            left = deadline - loop.time()
            # A read's try is cut short only while another member is left to
            # try: one member (one name) or the last gets what is left (review:
            # a read that needed half the timeout could never succeed).
            last = tries >= len(self._members) - 1
            budget = left if write or last else min(left, self._attempt)
            started = loop.time()
            tries += 1
            try:
                async with asyncio.timeout(budget):
                    answer = await op(member, budget)
            except (EtcdError, TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                self._answering = False
                self._failed()
                code = _code(exc)
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise StoreUnavailable(f"etcd {what} failed: {_why(exc)}") from exc
                self._member_failed(member, _why(exc))
                if write and not _unsent(exc):
                    raise OutcomeUnknown(f"etcd {what} got no answer: {_why(exc)}") from exc
                if loop.time() - started < pause:  # refused at once: not in a tight loop
                    await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                    pause = min(pause * 2, 0.5)
                if deadline - loop.time() < 0.01:
                    tried = f" ({tries} tries)" if tries > 1 else ""
                    raise StoreUnavailable(f"etcd {what} failed: {_why(exc)}{tried}") from exc
                continue
            except asyncio.CancelledError:
                if not self._replaced(member):
                    raise
                # gRPC cancels the calls in flight on a channel it closes,
                # and _reresolve closed member's: that is not this task's
                # cancellation (review 222: callers got a bare
                # CancelledError, which ends a task as if it had been
                # stopped). A read goes on on the new members; a write may
                # have reached etcd.
                if write:
                    raise OutcomeUnknown(
                        f"etcd {what}: its channel was replaced under it (endpoints re-resolved)"
                    ) from None
                tries = 0
                continue
            self._answering = True
            return answer

    def _replaced(self, member: _Member) -> bool:
        """True when a CancelledError out of a call on member came from its
        channel closed by _reresolve, not from this task being cancelled."""
        task = asyncio.current_task()
        return (
            self._connected
            and member not in self._members
            and task is not None
            and not task.cancelling()
        )

    @property
    def _kv(self) -> Any:
        """The KV service of the member calls go to: for building a
        transaction's operations, which needs no channel."""
        return self._members[self._pin].kv

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call("get", lambda m, t: m.kv.get(key, timeout=t))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)

    async def list(self, prefix: str) -> Listing:
        resp = await self._call(
            "list",
            lambda m, t: m.kv.get(prefix, range_end=prefix_range_end(prefix), timeout=t),
        )
        return await _records(resp, ordered=False)

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        # Keys come in ascending order unsorted (SortOrder.NONE), and then etcd
        # stops at the limit before reading values; to sort (even descending)
        # it would read the whole range first.
        resp = await self._call(
            "scan",
            lambda m, t: m.kv.get(
                start, range_end=end, limit=limit, sort_order=SortOrder.NONE, timeout=t
            ),
        )
        return await _records(resp, ordered=True)

    async def count(self, start: str, end: str) -> int:
        resp = await self._call(
            "count", lambda m, t: m.kv.get(start, range_end=end, count_only=True, timeout=t)
        )
        return int(resp.count)

    async def delete_range(self, start: str, end: str) -> int:
        resp = await self._call(
            "delete range",
            lambda m, t: m.kv.delete(start, range_end=end, timeout=t),
            write=True,
        )
        return int(resp.deleted)

    async def compact(self, revision: int) -> None:
        """KV.Compact to `revision`; one etcd compacted already (its own
        --auto-compaction, another replica) is no error."""
        try:
            await self._call("compact", lambda m, t: m.kv.compact(revision, timeout=t), write=True)
        except StoreUnavailable as exc:
            if "has been compacted" not in str(exc):
                raise

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
                    "put", lambda m, t: m.kv.put(key, value, lease=lease, timeout=t), write=True
                )
                return int(resp.header.revision)
            op = self._kv.txn_op_put(key, value, lease=lease)
            txn = await self._call(
                "txn", lambda m, t: m.kv.txn(compares, [op], timeout=t), write=True
            )
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
            resp = await self._call("delete", lambda m, t: m.kv.delete(key, timeout=t), write=True)
            return bool(resp.deleted)
        op = self._kv.txn_op_delete(key)
        txn = await self._call("txn", lambda m, t: m.kv.txn(compares, [op], timeout=t), write=True)
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
        txn = await self._call("txn", lambda m, t: m.kv.txn(compares, ops, timeout=t), write=True)
        if not txn.succeeded:
            raise Conflict("a condition of the transaction failed")
        return int(txn.header.revision)

    async def grant_lease(self, ttl: int) -> int:
        # Granted twice when an attempt's answer is lost: the first lease ends
        # with its TTL, nothing put with it.
        resp = await self._call("lease grant", lambda m, t: m.lease.grant(ttl, timeout=t))
        return int(resp.ID)

    async def refresh_lease(self, lease_id: int) -> int:
        async def once(member: _Member) -> int:
            stream = member.lease.keep_alive(lease_id)
            try:
                async for resp in stream:
                    return int(resp.TTL)
                raise StoreUnavailable("lease keepalive stream ended")
            finally:
                stream.cancel()

        ttl = await self._call("lease keepalive", lambda m, _: once(m))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired")
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke lease_id, or let its TTL end it: a failure is not raised,
        and while etcd's last call failed this tries for REVOKE_AWAY_S only."""
        timeout = self._timeout if self._answering else min(self._timeout, REVOKE_AWAY_S)
        with contextlib.suppress(StoreUnavailable):
            await self._call(
                "lease revoke", lambda m, t: m.lease.revoke(lease_id, timeout=t), within=timeout
            )

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
            # The member of now: a failure may have moved calls to another, or
            # looked etcd's names up again.
            member = self._members[self._pin]
            watching = member.watch
            call: Any = None
            try:
                call = watching._stub.Watch(metadata=watching._metadata or None)
                member.watches.add(call)
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
                # see _reresolve), or the store's, as calls left its member
                # (_member_failed). Review 37: it ended every watch for good.
                self._watch_failed()
                failing = True
                log.warning("etcd watch on %s: its member was left; watching anew", prefix)
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
                    member.watches.discard(call)
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
            for member in self._members:
                await member.client.close()
            self._connected = False


# Fewer records than this are made on the event loop: a thread's hand-off
# costs more (as catalog's _DECODE_ON_LOOP).
_RECORDS_ON_LOOP = 500


def _records_of(resp: Any, ordered: bool) -> Listing:
    """The records of a range answer, sorted by key unless `ordered` says
    etcd already gave them so."""
    items = tuple(
        KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
        for kv in resp.kvs
    )
    if not ordered:
        items = tuple(sorted(items, key=lambda i: i.key))
    return Listing(resp.header.revision, items)


async def _records(resp: Any, *, ordered: bool) -> Listing:
    """_records_of, in a worker thread for a large answer: at 20,000 keys
    making the records of /ponto/state (a key decoded, five fields copied
    out of etcd's answer, a frozen record made, each) held the event loop
    0.1 s a read, on a busy machine up to 0.8 s, every table build and
    health round of both replicas during a bulk key load."""
    if len(resp.kvs) < _RECORDS_ON_LOOP:
        return _records_of(resp, ordered)
    return await asyncio.to_thread(_records_of, resp, ordered)


@dataclass(eq=False)
class _Member:
    """One etcd member's channel (target: one address, or a `dns:` name),
    when a call on it last timed out or could not connect (loop time), and
    the watch calls on it, which are cancelled when calls leave it."""

    target: str
    client: Etcd3Client
    failed_at: float = -math.inf
    watches: set[Any] = field(default_factory=set)

    @property
    def kv(self) -> Any:
        assert self.client.kv is not None, "EtcdStore.connect() not called"
        return self.client.kv

    @property
    def lease(self) -> Any:
        assert self.client.lease is not None, "EtcdStore.connect() not called"
        return self.client.lease

    @property
    def watch(self) -> Any:
        assert self.client.watch is not None, "EtcdStore.connect() not called"
        return self.client.watch


class _WatchEnded(Exception):
    """etcd ended a watch's stream, or cancelled the watch."""


def _rpc_error(exc: BaseException) -> grpc.aio.AioRpcError | None:
    """The gRPC error of exc: itself, or what etcd3aio raised it from."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc
    if isinstance(exc.__cause__, grpc.aio.AioRpcError):
        return exc.__cause__
    return None


def _code(exc: BaseException) -> grpc.StatusCode | None:
    """exc's gRPC status: a timeout is DEADLINE_EXCEEDED, a closed channel
    (UsageError) UNAVAILABLE, as either is for another member to answer."""
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, grpc.aio.UsageError):
        return grpc.StatusCode.UNAVAILABLE
    rpc = _rpc_error(exc)
    return rpc.code() if rpc is not None else None


def _unsent(exc: BaseException) -> bool:
    """Whether a failed call never left this process (see _UNSENT), or was
    refused by a closed channel (UsageError): no member can apply it."""
    if isinstance(exc, grpc.aio.UsageError):
        return True
    rpc = _rpc_error(exc)
    if rpc is None or rpc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = rpc.details() or ""
    return any(words in details for words in _UNSENT)


def _why(exc: BaseException) -> str:
    """An etcd call's failure in one line: gRPC's own str() is a multi-line
    dump with its debug string."""
    rpc = _rpc_error(exc)
    if rpc is not None:
        return f"{rpc.code().name} ({rpc.details()})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
