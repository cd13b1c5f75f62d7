"""StateStore over etcd v3 (etcd3aio, native grpc.aio).

Calls carry a deadline so that an etcd outage surfaces as StoreUnavailable in
seconds instead of hanging admin calls. Watches resume from their last revision
after an etcd restart (etcd3aio reconnects); after compaction the consumer
re-lists, which the revision-only watch contract already requires.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end

from controlplane.store.base import (
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    StoreUnavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def grpc_target(endpoints: Sequence[str]) -> str | None:
    """A gRPC target for endpoints that name hosts rather than IPs.

    etcd3aio builds an `ipv4:` target, which takes IP literals only. One DNS
    name (a Kubernetes headless Service, say) becomes a `dns:` target that
    gRPC re-resolves on reconnect and balances over every address; several
    names are resolved once here. None: all IP literals, keep etcd3aio's.
    """
    hosts = [e.rsplit(":", 1)[0].strip("[]") for e in endpoints]
    try:
        for host in hosts:
            ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(endpoints) == 1:
        return f"dns:///{endpoints[0]}"
    resolved = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        for info in socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM):
            resolved.append(f"{info[4][0]}:{port}")
    log.warning("etcd endpoints resolved once at start: %s", ", ".join(resolved))
    return "ipv4:" + ",".join(dict.fromkeys(resolved))


class EtcdStore:
    def __init__(self, endpoints: Sequence[str], *, timeout: float = 3.0) -> None:
        self._endpoints = [e.removeprefix("http://").removeprefix("https://") for e in endpoints]
        self._timeout = timeout
        self._client = Etcd3Client(
            self._endpoints,
            # Retries with backoff ride out a reconnect (about 1.5 s in all),
            # all within the per-call timeout.
            rpc_max_attempts=6,
            watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=1.0,
        )
        # gRPC's default reconnect backoff grows to minutes; an etcd that comes
        # back must be used again within about a second.
        self._client._manager.grpc_options += [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._connected = False

    async def connect(self) -> None:
        """Open the channel; connecting is lazy in gRPC, so this never blocks on etcd."""
        if not self._connected:
            await self._client.connect()
            self._connected = True

    async def _call(self, what: str, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError) as exc:
            raise StoreUnavailable(f"etcd {what} failed: {exc}") from exc

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
        return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease)

    async def list(self, prefix: str) -> Listing:
        resp = await self._call(
            "list",
            self._kv.get(prefix, range_end=prefix_range_end(prefix), timeout=self._timeout),
        )
        items = tuple(
            KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs
        )
        return Listing(resp.header.revision, tuple(sorted(items, key=lambda i: i.key)))

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
        with contextlib.suppress(StoreUnavailable):
            await self._call("lease revoke", self._lease.revoke(lease_id, timeout=self._timeout))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        while True:
            assert self._client.watch is not None
            stream = self._client.watch.watch(
                prefix,
                range_end=prefix_range_end(prefix),
                # 0 asks etcd for changes from now on, not for all of history.
                start_revision=start_revision + 1 if start_revision else 0,
            )
            try:
                async for resp in stream:
                    if resp.compact_revision:
                        # History is gone: tell the consumer to re-list now.
                        start_revision = resp.compact_revision
                        log.warning("etcd watch on %s compacted at %d", prefix, start_revision)
                        yield resp.compact_revision
                        break
                    if resp.events:
                        start_revision = resp.header.revision
                        yield resp.header.revision
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                log.warning("etcd watch on %s failed (%s); retrying", prefix, exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False
