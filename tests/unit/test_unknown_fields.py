"""A record a newer control plane wrote keeps what this version does not know
when this version writes it again (trial 69: a replica of two days before,
changing a tenant's cache TTL during a rolling upgrade, erased its suspension,
budgets and model list for good; a drain erased an origin's probe setting)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from controlplane.catalog import KEYS, ORIGINS, REGIONS, TENANTS, Catalog
from controlplane.model import (
    CachePolicy,
    Limits,
    Origin,
    Region,
    Tenant,
    decode_tenant,
    encode,
    encode_over,
)
from controlplane.store.memory import MemoryStore

# What a newer version might add: a field of its own at the top, and one in a
# nested record (a limit of a kind this version has no name for).
NEWER = {"quarantined": True, "retention": {"days": 7}}
NEWER_LIMIT = {"tokens_per_week": 9000}


def newer(value: Any) -> bytes:
    """value as a newer control plane would store it."""
    data = orjson.loads(encode(value))
    data.update(NEWER)
    if isinstance(data.get("limits"), dict):
        data["limits"].update(NEWER_LIMIT)
    return orjson.dumps(data)


def kept(raw: bytes) -> bool:
    data = orjson.loads(raw)
    limits = data.get("limits", NEWER_LIMIT)
    return all(data.get(k) == v for k, v in NEWER.items()) and (
        limits.get("tokens_per_week") == 9000
    )


def test_encode_over_keeps_unknown_fields_at_every_depth_and_writes_known_ones() -> None:
    stored = newer(Tenant("acme", limits=Limits(rpm=5), suspended=True))
    changed = Tenant("acme", limits=Limits(rpm=7), cache=CachePolicy(ttl_s=300))
    raw = encode_over(changed, stored)
    assert kept(raw)
    assert decode_tenant(raw) == changed  # what this version knows is as written
    data = orjson.loads(raw)
    assert data["suspended"] is False and data["limits"]["rpm"] == 7


@pytest.mark.parametrize("stored", [None, b"", b"[1, 2]", b"not json"])
def test_nothing_is_kept_from_no_record_or_one_that_is_not_an_object(
    stored: bytes | None,
) -> None:
    assert encode_over(Tenant("acme"), stored) == encode(Tenant("acme"))


def test_a_field_of_a_record_this_version_replaced_whole_is_replaced() -> None:
    # jwt (a record or None): None written over a stored issuer is this
    # version's own choice, not an unknown field.
    stored = orjson.loads(encode(Tenant("acme")))
    stored["jwt"] = {"issuer": "https://id.example", "algorithms": ["RS256"]}
    data = orjson.loads(encode_over(Tenant("acme"), orjson.dumps(stored)))
    assert data["jwt"] is None


async def test_every_rewrite_of_the_catalog_keeps_a_newer_versions_fields() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_region(Region("r1", 40.0, -74.0), allow_update=False)
    await catalog.put_origin(
        Origin("o1", "http://127.0.0.1:9/v1", "r1", models=("m",)), allow_update=False
    )
    await catalog.put_tenant(Tenant("acme", limits=Limits(rpm=5)), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    for key in (REGIONS + "r1", ORIGINS + "o1", TENANTS + "acme", KEYS + record.id):
        current = await store.get(key)
        assert current is not None
        data = orjson.loads(current.value)
        data.update(NEWER)
        if isinstance(data.get("limits"), dict):
            data["limits"].update(NEWER_LIMIT)
        await store.put(key, orjson.dumps(data))

    async def stored(key: str) -> bytes:
        kv = await store.get(key)
        assert kv is not None
        return kv.value

    # Each way this version writes a record again.
    await catalog.drain_region("r1", True)
    await catalog.drain_origin("o1", True)
    await catalog.update_tenant("acme", lambda t: replace(t, cache=CachePolicy(ttl_s=300)))
    await catalog.set_key_limits(record.id, Limits(rpm=3))
    await catalog.set_key_suspended(record.id, True)
    for key in (REGIONS + "r1", ORIGINS + "o1", TENANTS + "acme", KEYS + record.id):
        assert kept(await stored(key)), key
    origin = Origin("o1", "http://127.0.0.1:9/v1", "r1", models=("m", "n"))
    await catalog.put_origin(origin, allow_update=True)
    await catalog.put_tenant(Tenant("acme", limits=Limits(rpm=9)), allow_update=True)
    assert kept(await stored(ORIGINS + "o1"))
    assert kept(await stored(TENANTS + "acme"))
    plan = await catalog.apply(
        {"tenants": [{"name": "acme", "limits": {"rpm": 11}}]}, prune=False, dry_run=False
    )
    assert plan.writes()
    assert kept(await stored(TENANTS + "acme"))
    assert orjson.loads(await stored(TENANTS + "acme"))["limits"]["rpm"] == 11
