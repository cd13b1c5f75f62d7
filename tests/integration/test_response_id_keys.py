"""The fleet's Responses id key (RouteTable.response_id_keys) and its fleet id
(RouteTable.fleet_id): each made once, by whichever control-plane replica
first builds a table without it, with a create-if-absent write, so replicas
that race all serve the one that won; against a real etcd and MemoryStore."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from controlplane.builder import TableBuilder
from controlplane.catalog import (
    FLEET_ID,
    RESPONSE_ID_KEY_BYTES,
    RESPONSE_ID_KEYS,
    Catalog,
    fleet_id_of,
)
from controlplane.distribute import Publisher
from controlplane.model import decode_fleet_id
from controlplane.store import StateStore
from controlplane.store.etcd import EtcdStore
from controlplane.store.memory import MemoryStore
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration

REPLICAS = 4


@pytest.fixture(params=["memory", "etcd"])
def endpoint(request: pytest.FixtureRequest) -> EtcdEndpoint | None:
    """None for MemoryStore, else the session etcd, wiped. Sync, as the
    integration tests' etcd_endpoint is (tests/integration/conftest.py), and
    for its reasons."""
    if request.param == "memory":
        return None
    found: EtcdEndpoint = request.getfixturevalue("clean_etcd")
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


async def test_replicas_that_race_all_publish_the_one_fleet_id_made(
    stores: list[StateStore],
) -> None:
    """The fleet id (RouteTable.fleet_id) is made as the key is, derived from
    it: a store restored from a snapshot taken before the id was made, or of
    a fleet older than fleet ids, gets the id its proxies serve."""
    publishers = [Publisher(f"cp-{i}") for i in range(REPLICAS)]
    builders = [
        TableBuilder(Catalog(store), pub) for store, pub in zip(stores, publishers, strict=True)
    ]
    await asyncio.gather(*(b.build_once() for b in builders))
    ids = {p.latest.table.fleet_id for p in publishers if p.latest is not None}
    assert len(ids) == 1
    (fleet_id,) = ids
    stored = await stores[0].get(FLEET_ID)
    assert stored is not None and decode_fleet_id(stored.value) == fleet_id
    key = publishers[0].latest.table.response_id_keys[0] if publishers[0].latest else b""
    assert fleet_id == fleet_id_of(key) and len(fleet_id) == 16
    # Every replica made it or read it; none says the fleet was lost.
    assert not any(b.fleet.replaced for b in builders)
    # Gone from the store (a snapshot of before it), it is made the same again.
    await stores[0].delete(FLEET_ID)
    again = Publisher("cp-late")
    late = TableBuilder(Catalog(stores[-1]), again)
    await late.build_once()
    assert again.latest is not None and again.latest.table.fleet_id == fleet_id


async def test_adopting_a_fleet_id_publishes_it_and_a_wiped_store_makes_another(
    stores: list[StateStore],
) -> None:
    """etcd wiped under a replica that served fleet A: it makes another id
    (a new Responses key), says so, and publishes it; `fleet adopt A` makes
    its tables A's again."""
    pub = Publisher("cp-0")
    catalog = Catalog(stores[0])
    builder = TableBuilder(catalog, pub)
    await builder.build_once()
    assert pub.latest is not None
    served = pub.latest.table.fleet_id
    await stores[0].delete_range("/ponto/", "/ponto0")
    await builder.build_once()
    made = pub.latest.table.fleet_id
    assert made not in ("", served)
    assert builder.fleet.replaced == served and served in builder.fleet.problem()
    assert await catalog.adopt_fleet(served) == made
    await builder.build_once()
    assert pub.latest.table.fleet_id == served
    assert builder.fleet.replaced == "" and builder.fleet.problem() == ""
    assert await catalog.adopt_fleet(served) == served  # again: no change
