"""The fleet's Responses id key (RouteTable.response_id_keys): made once, by
whichever control-plane replica first builds a table without it, with a
create-if-absent write, so replicas that race all serve the one that won;
against a real etcd and MemoryStore."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import pytest

from controlplane.builder import TableBuilder
from controlplane.catalog import RESPONSE_ID_KEY_BYTES, RESPONSE_ID_KEYS, Catalog
from controlplane.distribute import Publisher
from controlplane.store import StateStore
from controlplane.store.etcd import EtcdStore
from controlplane.store.memory import MemoryStore
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration

REPLICAS = 4


@pytest.fixture(params=["memory", "etcd"])
def endpoint(request: pytest.FixtureRequest) -> EtcdEndpoint | None:
    """None for MemoryStore, else the session etcd, wiped. Sync, as
    test_store_contract.etcd_endpoint is, and for its reasons."""
    if request.param == "memory":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        found: EtcdEndpoint = request.getfixturevalue("clean_etcd")
        gc.collect()
    return found


@pytest.fixture
async def stores(endpoint: EtcdEndpoint | None) -> AsyncIterator[list[StateStore]]:
    """REPLICAS stores over one state: each replica's own client of etcd,
    or one MemoryStore shared."""
    clients: list[StateStore]
    if endpoint is None:
        clients = [MemoryStore()] * REPLICAS
    else:
        etcds = [EtcdStore([endpoint.endpoint], timeout=5.0) for _ in range(REPLICAS)]
        for etcd in etcds:
            await etcd.connect()
        clients = list(etcds)
    yield clients
    for store in set(clients):
        await store.close()


async def test_replicas_that_race_all_publish_the_one_key_made(stores: list[StateStore]) -> None:
    publishers = [Publisher(f"cp-{i}") for i in range(REPLICAS)]
    builders = [
        TableBuilder(Catalog(store), pub) for store, pub in zip(stores, publishers, strict=True)
    ]
    await asyncio.gather(*(b.build_once() for b in builders))
    keys = set()
    for pub in publishers:
        assert pub.latest is not None
        assert len(pub.latest.table.response_id_keys) == 1
        keys.add(pub.latest.table.response_id_keys[0])
    assert len(keys) == 1
    (key,) = keys
    assert len(key) == RESPONSE_ID_KEY_BYTES
    stored = await stores[0].get(RESPONSE_ID_KEYS)
    assert stored is not None and key.hex() in stored.value.decode()
    # Later builds (another replica's restart) keep it.
    again = Publisher("cp-late")
    await TableBuilder(Catalog(stores[-1]), again).build_once()
    assert again.latest is not None and list(again.latest.table.response_id_keys) == [key]
    assert len({p.latest.etag for p in publishers if p.latest is not None}) == 1
