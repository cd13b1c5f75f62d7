"""EtcdStore.revoke_lease: while etcd's last call failed, REVOKE_AWAY_S in
all, not the call timeout: a replica stopping with etcd away
waited the whole timeout for each of its leases (trial 43)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.store.base import StoreUnavailable
from controlplane.store.etcd import REVOKE_AWAY_S, EtcdStore


class _Kv:
    """etcd's KV as etcd3aio gives it: `away` fails each call as a timeout."""

    away = False

    async def get(self, key: str, **_: Any) -> Any:
        if self.away:
            raise TimeoutError
        return type("Resp", (), {"kvs": []})()


class _Lease:
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def revoke(self, lease_id: int, *, timeout: float) -> None:
        self.timeouts.append(timeout)


async def test_a_lease_is_revoked_briefly_while_etcd_is_away() -> None:
    store = EtcdStore(["127.0.0.1:1"], timeout=3.0)
    kv, lease = _Kv(), _Lease()
    client: Any = store._client  # its services replaced by the fakes above
    client.kv, client.lease = kv, lease
    await store.revoke_lease(1)  # nothing failed yet: the call timeout
    kv.away = True
    with pytest.raises(StoreUnavailable):
        await store.get("/k")
    await store.revoke_lease(2)
    kv.away = False
    await store.get("/k")  # etcd answers again
    await store.revoke_lease(3)
    # The call timeout while etcd answers (one member: no next to leave time
    # for); REVOKE_AWAY_S in all while it does not.
    assert lease.timeouts == [
        pytest.approx(3.0, abs=0.01),
        pytest.approx(REVOKE_AWAY_S, abs=0.01),
        pytest.approx(3.0, abs=0.01),
    ]
