"""compile_table, Publisher and TableBuilder: from store state to published snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest

from controlplane import builder as builder_module
from controlplane import catalog as catalog_module
from controlplane.api.admin import AdminService
from controlplane.audit import AuditLog
from controlplane.builder import TableBuilder
from controlplane.catalog import (
    KEYS,
    RESPONSE_ID_KEY_BYTES,
    RESPONSE_ID_KEYS,
    RESPONSE_ID_OWNERS,
    TENANTS,
    Catalog,
    decode_state,
)
from controlplane.compile import compile_table
from controlplane.distribute import Publisher, Snapshot
from controlplane.errors import FailedPrecondition, Unavailable
from controlplane.model import ApiKeyRecord, Origin, Region, State, Tenant, decode_key, encode
from controlplane.store.base import Write
from controlplane.store.memory import MemoryStore
from ponto.routetable import content_etag
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.latestores import LateWatches

US = Region("us-east", 39.0, -77.0)
EU = Region("eu-west", 53.0, -6.0)
O1 = Origin("o1", "http://o1.example/v1", "us-east", ("llama-3", "mistral"), 300)
O2 = Origin("o2", "http://o2.example/v1", "eu-west", ("llama-3",), 100)
O3 = Origin("o3", "https://o3.example/v1", "us-east", ("qwen",), 50)


def state(
    revision: int = 10,
    regions: tuple[Region, ...] = (US, EU),
    origins: tuple[Origin, ...] = (O1, O2, O3),
) -> State:
    return State(revision, regions, origins)


# ---------------------------------------------------------------- compile


def test_compile_is_deterministic_and_order_independent() -> None:
    a = compile_table(state())
    b = compile_table(state())
    c = compile_table(
        state(
            regions=(EU, US),
            origins=(O3, O1, replace(O2, models=tuple(reversed(O2.models)))),
        )
    )
    assert a.etag == b.etag == c.etag
    assert a.SerializeToString(deterministic=True) == c.SerializeToString(deterministic=True)


def test_compile_content() -> None:
    table = compile_table(state(revision=42))
    assert table.version == 42
    assert [r.name for r in table.regions] == ["eu-west", "us-east"]
    assert [o.name for o in table.origins] == ["o1", "o2", "o3"]
    o1 = table.origins[0]
    assert (o1.base_url, o1.region, list(o1.models), o1.weight) == (
        "http://o1.example/v1",
        "us-east",
        ["llama-3", "mistral"],
        300,
    )
    assert o1.healthy is True
    assert o1.drained is False
    assert table.regions[1].latitude == 39.0
    assert table.regions[1].longitude == -77.0
    assert table.etag == content_etag(table)
    assert len(table.etag) == 64


def test_compile_unsorted_models_are_sorted() -> None:
    odd = replace(O1, models=("zeta", "alpha"))
    table = compile_table(state(origins=(odd,)))
    assert list(table.origins[0].models) == ["alpha", "zeta"]


def test_etag_ignores_revision() -> None:
    a = compile_table(state(revision=10))
    b = compile_table(state(revision=11))
    assert a.version != b.version
    assert a.etag == b.etag


@pytest.mark.parametrize(
    "change",
    [
        lambda s: replace(s, regions=(replace(US, drained=True), EU)),
        lambda s: replace(s, regions=(replace(US, latitude=40.0), EU)),
        lambda s: replace(s, regions=(replace(US, longitude=-70.0), EU)),
        lambda s: replace(s, origins=(replace(O1, drained=True), O2, O3)),
        lambda s: replace(s, origins=(replace(O1, weight=301), O2, O3)),
        lambda s: replace(s, origins=(replace(O1, base_url="http://o1.example/v2"), O2, O3)),
        lambda s: replace(s, origins=(replace(O1, models=("llama-3",)), O2, O3)),
        lambda s: replace(s, origins=(replace(O1, region="eu-west"), O2, O3)),
        lambda s: replace(s, origins=(O1, O2)),
        lambda s: replace(s, regions=(US, EU, Region("ap-south", 19.0, 73.0))),
    ],
    ids=[
        "region-drained",
        "region-latitude",
        "region-longitude",
        "origin-drained",
        "origin-weight",
        "origin-url",
        "origin-models",
        "origin-region",
        "origin-removed",
        "region-added",
    ],
)
def test_etag_changes_with_routed_fields(change: Callable[[State], State]) -> None:
    before = compile_table(state())
    after = compile_table(change(state()))
    assert after.etag != before.etag
    assert after.etag == content_etag(after)


def test_origins_in_unknown_regions_left_out() -> None:
    orphan = Origin("orphan", "http://x.example/v1", "gone", ("llama-3",))
    table = compile_table(state(origins=(O1, orphan, O2)))
    assert [o.name for o in table.origins] == ["o1", "o2"]
    assert table.etag == compile_table(state(origins=(O1, O2))).etag


def test_empty_state_compiles() -> None:
    table = compile_table(State(3))
    assert table.version == 3
    assert list(table.regions) == [] and list(table.origins) == []
    assert table.etag == content_etag(table)


# ---------------------------------------------------------------- publisher


def test_publish_first_and_identical() -> None:
    pub = Publisher("cp-a")
    initial = pub.latest
    assert initial is None
    first = pub.publish(compile_table(state(revision=10)))
    assert first is not None
    assert pub.latest is first
    assert first.version == 10
    assert pub.publish(compile_table(state(revision=10))) is None
    # Same content at a later revision is not a new snapshot either.
    assert pub.publish(compile_table(state(revision=11))) is None
    assert pub.latest is first


def test_publish_new_content_makes_new_snapshot() -> None:
    pub = Publisher("cp-a")
    first = pub.publish(compile_table(state(revision=10)))
    second = pub.publish(compile_table(state(revision=12, origins=(O1,))))
    assert first is not None and second is not None
    assert second is not first
    assert second.version == 12
    assert second.etag != first.etag
    assert second.nonce != first.nonce
    assert pub.latest is second


def test_payload_is_route_update_with_same_nonce() -> None:
    pub = Publisher("cp-a")
    table = compile_table(state())
    snap = pub.publish(table)
    assert snap is not None
    update = pb.RouteUpdate()
    update.ParseFromString(snap.payload)
    assert update.nonce == snap.nonce
    assert snap.nonce.startswith("cp-a-")
    assert update.table == table
    assert update.table.etag == snap.etag


def test_nonces_unique_across_publishes() -> None:
    pub = Publisher("cp-a")
    nonces = set()
    for rev in range(1, 6):
        snap = pub.publish(compile_table(state(revision=rev, origins=(O1,) if rev % 2 else ())))
        assert snap is not None
        nonces.add(snap.nonce)
    assert len(nonces) == 5


async def test_next_after_returns_immediately_when_newer() -> None:
    pub = Publisher("cp-a")
    snap = pub.publish(compile_table(state()))
    assert await asyncio.wait_for(pub.next_after(None), 1.0) is snap


async def test_next_after_waits_for_change() -> None:
    pub = Publisher("cp-a")
    first = pub.publish(compile_table(state()))
    waiter = asyncio.create_task(pub.next_after(first))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    assert pub.publish(compile_table(state(revision=11))) is None  # same content: no wake
    await asyncio.sleep(0.02)
    assert not waiter.done()
    second = pub.publish(compile_table(state(revision=12, origins=(O2,))))
    assert await asyncio.wait_for(waiter, 1.0) is second


async def test_next_after_coalesces() -> None:
    pub = Publisher("cp-a")
    first = pub.publish(compile_table(state(revision=1)))
    assert first is not None
    waiter = asyncio.create_task(pub.next_after(first))
    await asyncio.sleep(0)  # the waiter is now blocked on the event
    snaps: list[Snapshot | None] = [
        pub.publish(compile_table(state(revision=2, origins=(O1,)))),
        pub.publish(compile_table(state(revision=3, origins=(O2,)))),
        pub.publish(compile_table(state(revision=4, origins=(O3,)))),
    ]
    assert all(s is not None for s in snaps)
    got = await asyncio.wait_for(waiter, 1.0)
    assert got is snaps[-1]
    assert got.version == 4


async def test_many_waiters_all_wake() -> None:
    pub = Publisher("cp-a")
    waiters = [asyncio.create_task(pub.next_after(None)) for _ in range(50)]
    await asyncio.sleep(0)
    snap = pub.publish(compile_table(state()))
    done = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert all(d is snap for d in done)


# ---------------------------------------------------------------- builder


async def seed(catalog: Catalog) -> None:
    await catalog.put_region(US, allow_update=False)
    await catalog.put_origin(O1, allow_update=False)


@contextlib.asynccontextmanager
async def running(builder: TableBuilder) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(builder.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)


async def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)


async def seeded_builder(**settings: Any) -> tuple[MemoryStore, Catalog, Publisher, TableBuilder]:
    """A builder over a seeded in-memory store; settings go to TableBuilder."""
    store = MemoryStore()
    catalog = Catalog(store)
    await seed(catalog)
    pub = Publisher("cp-a")
    return store, catalog, pub, TableBuilder(catalog, pub, **settings)


async def test_build_once_publishes_store_state() -> None:
    store, _catalog, pub, builder = await seeded_builder()
    assert await builder.build_once() is True
    assert pub.latest is not None
    assert pub.latest.version == (await store.list("/ponto/state/")).revision
    assert [o.name for o in pub.latest.table.origins] == ["o1"]
    assert await builder.build_once() is False  # nothing changed
    assert builder.builds == 2


async def test_a_change_written_before_the_builders_watch_is_made_reaches_the_table() -> None:
    """etcd not serving yet (a replica started with its members): the first
    build read, a change was written, and only then was the watch made. It
    starts at the revision the build read, so the change is replayed; one
    made "from now" missed it and the proxies kept the first table."""
    store = LateWatches()
    catalog = Catalog(store)
    await seed(catalog)
    pub = Publisher("cp-a")
    builder = TableBuilder(catalog, pub, quiet=0.01, max_delay=0.05)
    async with running(builder):
        first = await asyncio.wait_for(pub.next_after(None), 1.0)
        assert first.table.origins[0].drained is False
        await catalog.set_origin_drained("o1", True)
        store.serving.set()
        second = await asyncio.wait_for(pub.next_after(first), 1.0)
        assert second.table.origins[0].drained is True


async def test_a_state_read_below_the_table_published_is_retried_until_renumbered() -> None:
    """Review of 4262eac: when the raise did not happen (etcd passed the old
    numbers meanwhile, or it was refused), nothing woke the builder and the
    change waited for the next write of the state. The build fails as a
    store failure does (retried after the back-off); once raised, it asks
    for no more."""
    _store, catalog, pub, _ = await seeded_builder()
    pub.publish(pb.RouteTable(version=1000))  # the tables proxies hold
    asked: list[int] = []
    raised = [False]

    async def behind(version: int) -> bool:
        asked.append(version)
        return raised[0]

    builder = TableBuilder(catalog, pub, behind=behind)
    with pytest.raises(Unavailable, match="below the table published last"):
        await builder.build_once()
    raised[0] = True
    assert await builder.build_once() is False  # the raise wakes it (ControlPlane)
    assert asked == [1000, 1000]
    latest = pub.latest
    assert latest is not None and latest.version == 1000


async def test_a_first_build_that_fails_is_made_again() -> None:
    """Review of 4262eac: the watch waits for a build to have read, so a
    first build that failed on something other than the store (a state that
    did not decode) was never made again, whatever changed."""
    _store, catalog, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05)
    real = catalog.snapshot
    calls = [0]

    async def snapshot() -> State:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug met on the first read")
        return await real()

    catalog.snapshot = snapshot  # type: ignore[method-assign]
    async with running(builder):
        first = await asyncio.wait_for(pub.next_after(None), 2.0)
    assert [o.name for o in first.table.origins] == ["o1"]


async def test_a_tenant_of_the_wrong_shape_is_skipped_not_fatal() -> None:
    """Review of 4262eac: a hand-edited tenant whose prompt is a list raised
    AttributeError out of the snapshot (not one of the decode errors it
    skips), and with it every build."""
    store, _catalog, pub, builder = await seeded_builder()
    await store.put(TENANTS + "odd", orjson.dumps({"name": "odd", "prompt": [1]}))
    assert await builder.build_once() is True
    latest = pub.latest
    assert latest is not None and "odd" not in {t.name for t in latest.table.tenants}


async def test_builder_publishes_initial_table_and_changes() -> None:
    store, catalog, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05)
    async with running(builder):
        first = await asyncio.wait_for(pub.next_after(None), 1.0)
        assert [o.name for o in first.table.origins] == ["o1"]
        assert builder.store_ok is True

        started = time.monotonic()
        await catalog.set_origin_drained("o1", True)
        second = await asyncio.wait_for(pub.next_after(first), 1.0)
        elapsed = time.monotonic() - started
        assert second.table.origins[0].drained is True
        assert second.version == (await store.list("/ponto/state/")).revision
        # quiet 0.01 / max 0.05; the margin absorbs a loaded CI machine.
        assert elapsed < 0.5, f"publish took {elapsed:.3f}s"


async def test_builder_ignores_changes_outside_state() -> None:
    store, _catalog, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05)
    async with running(builder):
        await asyncio.wait_for(pub.next_after(None), 1.0)
        await wait_until(lambda: builder.builds >= 1, 1.0, "first build")
        await asyncio.sleep(0.1)
        builds = builder.builds
        await store.put("/ponto/proxies/p1", b"{}")
        await asyncio.sleep(0.2)
        assert builder.builds == builds


async def test_builder_debounces_bursts() -> None:
    # The quiet period and the cap are wide against the burst's own length
    # (20 changes 1 ms apart): on a loaded CI machine, a 10 ms quiet period
    # and a 50 ms cap split one burst into four builds.
    store, catalog, pub, builder = await seeded_builder(quiet=0.2, max_delay=2.0)
    async with running(builder):
        first = await asyncio.wait_for(pub.next_after(None), 1.0)
        await asyncio.sleep(0.5)  # let the start-up build settle
        before = builder.builds
        for i in range(20):
            await catalog.put_origin(
                replace(O1, weight=i + 1), allow_update=True
            )  # each change yields to the watcher
            await asyncio.sleep(0.001)
        await wait_until(
            lambda: pub.latest is not None and pub.latest.table.origins[0].weight == 20,
            5.0,
            "last change of the burst published",
        )
        await asyncio.sleep(0.5)  # let the burst settle completely
        burst_builds = builder.builds - before
        assert 1 <= burst_builds <= 3, f"{burst_builds} builds for a burst of 20 changes"
        assert pub.latest is not None and pub.latest is not first
        assert pub.latest.version == (await store.list("/ponto/state/")).revision


async def test_a_builder_that_never_built_does_not_say_it_serves_the_last_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trial 17: a replica that never reached etcd logged "serving the last
    one", though it had none to serve."""
    store, _, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05, retry_max=0.1)
    store.available = False
    async with running(builder):
        await wait_until(lambda: "cannot build" in caplog.text, 1.0, "the failure logged")
        assert pub.latest is None
        store.available = True
        await asyncio.wait_for(pub.next_after(None), 2.0)
    said = [r.getMessage() for r in caplog.records if r.name == "controlplane.builder"]
    assert said[0].startswith(
        "cannot build the route table yet (proxies get none from this replica until it can): "
    )
    assert not any("serving the last one" in m for m in said)


async def test_a_store_away_is_said_once_and_its_return_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trial 18: a replica whose etcd was away logged a warning at every
    retry (64 in 3.5 minutes)."""
    caplog.set_level(logging.DEBUG, "controlplane.builder")
    store, _, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05, retry_max=0.05)
    store.available = False
    async with running(builder):
        await wait_until(lambda: len(caplog.records) >= 5, 5.0, "a few tries")
        store.available = True
        await asyncio.wait_for(pub.next_after(None), 2.0)
    said = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "controlplane.builder"
    ]
    assert [level for level, _ in said if level == "WARNING"] == ["WARNING"]
    assert ("INFO", "route table built again: the state store answers") in said


async def test_builder_keeps_last_snapshot_when_store_unavailable() -> None:
    store, catalog, pub, builder = await seeded_builder(quiet=0.01, max_delay=0.05, retry_max=0.1)
    async with running(builder):
        first = await asyncio.wait_for(pub.next_after(None), 1.0)
        await wait_until(lambda: builder.store_ok, 1.0, "store_ok after first build")
        await catalog.set_origin_drained("o1", True)
        store.available = False  # before the builder could read the change
        await wait_until(lambda: not builder.store_ok, 1.0, "builder notices the outage")
        assert pub.latest is first
        await asyncio.sleep(0.2)  # a few retries later: still the last good table
        assert pub.latest is first
        assert not builder.store_ok

        store.available = True
        recovered = await asyncio.wait_for(pub.next_after(first), 2.0)
        assert recovered.table.origins[0].drained is True
        await wait_until(lambda: builder.store_ok, 1.0, "store_ok after recovery")


async def test_the_first_build_makes_the_fleets_response_id_key_once() -> None:
    store, _catalog, pub, builder = await seeded_builder()
    assert await builder.build_once() is True
    assert pub.latest is not None
    (key,) = pub.latest.table.response_id_keys
    assert len(key) == RESPONSE_ID_KEY_BYTES
    made = await store.get(RESPONSE_ID_KEYS)
    assert made is not None
    assert await builder.build_once() is False  # kept, not made again
    assert list(pub.latest.table.response_id_keys) == [key]
    again = await store.get(RESPONSE_ID_KEYS)
    assert again is not None and again.mod_revision == made.mod_revision


async def test_a_rotated_key_comes_first_and_the_old_one_after_it() -> None:
    store, _catalog, pub, builder = await seeded_builder()
    new, old = b"n" * 32, b"o" * 32
    await store.put(RESPONSE_ID_KEYS, orjson.dumps({"keys": [new.hex(), old.hex()]}))
    await builder.build_once()
    assert pub.latest is not None
    assert list(pub.latest.table.response_id_keys) == [new, old]


@pytest.mark.parametrize(
    "value", [b"not json", b'{"keys": []}', b'{"keys": ["00"]}', b'{"keys": "ab"}', b"[]"]
)
async def test_unusable_stored_keys_are_logged_and_left_out(
    value: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store, _catalog, pub, builder = await seeded_builder()
    await store.put(RESPONSE_ID_KEYS, value)
    await builder.build_once()  # still builds: proxies then pin nothing
    assert pub.latest is not None and not pub.latest.table.response_id_keys
    assert any(RESPONSE_ID_KEYS in r.getMessage() for r in caplog.records)
    assert await store.get(RESPONSE_ID_KEYS) is not None  # never overwritten


async def test_an_operators_view_of_the_table_shows_the_id_keys_blank() -> None:
    store, catalog, pub, builder = await seeded_builder()
    await builder.build_once()
    service = AdminService(catalog, pub, AuditLog(store, replica="cp-a"), token_required=False)
    shown = await service.GetRouteTable(apb.ListRequest(), cast(Any, None))
    assert list(shown.table.response_id_keys) == [b""]
    assert pub.latest is not None and len(pub.latest.table.response_id_keys[0]) == 32
    assert shown.table.etag == pub.latest.table.etag


async def test_the_first_table_marks_where_ids_began_to_be_signed_for_records() -> None:
    """Review of f0455bc: ids signed for a tenant's name alone are taken only
    for a record born before the fleet began to sign for records; the first
    table built marks that revision once (RESPONSE_ID_OWNERS, its create
    revision), and every table carries it."""
    store, catalog, pub, builder = await seeded_builder()
    assert await builder.build_once() is True
    kv = await store.get(RESPONSE_ID_OWNERS)
    assert kv is not None
    latest = pub.latest
    assert latest is not None
    assert latest.table.response_id_owners_from == kv.create_revision > 0
    await catalog.put_region(Region("eu", 1.0, 2.0), allow_update=False)
    assert await builder.build_once() is True
    latest = pub.latest
    assert latest is not None and latest.table.response_id_owners_from == kv.create_revision


async def test_a_large_state_is_decoded_and_compiled_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 20,000 keys decoding took 0.6 s and compiling 0.8 s, on the event
    loop: the election's keep-alives and every probe waited (trial 83: both
    replicas lost leadership once during a bulk key load). Both run in a
    worker thread now, and the table is the same."""
    store, catalog, pub, builder = await seeded_builder()
    await catalog.put_tenant(Tenant("t1"), allow_update=False)
    writes = [
        Write(KEYS + f"k{i:04d}", encode(ApiKeyRecord(f"k{i:04d}", f"{i:064x}", "t1")))
        for i in range(600)
    ]
    for start in range(0, len(writes), 100):
        await store.commit(writes[start : start + 100])
    threads: dict[str, int] = {}

    def recorded(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            threads[name] = threading.get_ident()
            return f(*args)

        return run

    monkeypatch.setattr(catalog_module, "decode_state", recorded("decode", decode_state))
    monkeypatch.setattr(builder_module, "compile_table", recorded("compile", compile_table))
    assert await builder.build_once() is True
    loop_thread = threading.get_ident()
    assert set(threads) == {"decode", "compile"}
    assert loop_thread not in threads.values()
    assert pub.latest is not None
    assert len(pub.latest.table.keys) == 600


async def put_keys(store: MemoryStore, count: int, tenant: str) -> None:
    """Keys k0000.. of `tenant`, written 100 a transaction."""
    for start in range(0, count, 100):
        await store.commit(
            [
                Write(KEYS + f"k{i:04d}", encode(ApiKeyRecord(f"k{i:04d}", f"{i:064x}", tenant)))
                for i in range(start, min(start + 100, count))
            ]
        )


def decodes_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the keys the catalog decodes from now on, in order."""
    decoded: list[str] = []
    real = decode_key

    def counted(raw: bytes) -> ApiKeyRecord:
        key = real(raw)
        decoded.append(key.id)
        return key

    monkeypatch.setattr(catalog_module, "decode_key", counted)
    return decoded


async def test_a_snapshot_decodes_the_keys_changed_since_the_last_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 20,000 keys every change decoded every key again (0.6 s); a key
    whose value is as last decoded is taken as it was. A changed key is
    decoded anew, and a deleted one is gone."""
    store, catalog, _pub, _builder = await seeded_builder()
    await catalog.put_tenant(Tenant("t1"), allow_update=False)
    await put_keys(store, 600, "t1")
    decoded = decodes_counted(monkeypatch)
    assert len((await catalog.snapshot()).keys) == 600
    assert len(decoded) == 600
    decoded.clear()
    await store.put(
        KEYS + "k0001", encode(ApiKeyRecord("k0001", f"{1:064x}", "t1", description="renamed"))
    )
    await store.delete(KEYS + "k0002")
    state = await catalog.snapshot()
    assert decoded == ["k0001"]
    by_id = {k.id: k for k in state.keys}
    assert by_id["k0001"].description == "renamed"
    assert "k0002" not in by_id and len(by_id) == 599
    await store.put(KEYS + "k0002", encode(ApiKeyRecord("k0002", f"{2:064x}", "t1")))
    assert len((await catalog.snapshot()).keys) == 600
    assert decoded == ["k0001", "k0002"]
    # Shrunk below the size decoded off the loop, the state keeps no keys
    # of its larger past (review 341: they stayed until it grew again).
    for start in range(0, 550, 110):
        await store.commit([Write(KEYS + f"k{i:04d}", None) for i in range(start, start + 110)])
    assert len((await catalog.snapshot()).keys) == 50
    assert catalog._keys == {}


async def test_a_read_of_the_keys_decodes_those_changed_since_the_snapshot_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`delete_tenant`, `key list` and a tenant's model warnings read the
    keys alone (Catalog.read), and decoded all 20,000 each time (0.5-0.8 s
    on a busy machine): those as the last snapshot decoded them are taken
    from it, a key changed since is decoded anew, and the read leaves the
    snapshot's keys as they were."""
    store, catalog, _pub, _builder = await seeded_builder()
    await catalog.put_tenant(Tenant("t1"), allow_update=False)
    await catalog.put_tenant(Tenant("t2"), allow_update=False)
    await put_keys(store, 600, "t1")  # past the size decoded on the loop, which keeps none
    decoded = decodes_counted(monkeypatch)
    await catalog.snapshot()
    assert len(catalog._keys) == 600
    known = dict(catalog._keys)
    decoded.clear()
    await store.put(
        KEYS + "k0007", encode(ApiKeyRecord("k0007", f"{7:064x}", "t2", description="moved"))
    )
    keys = await catalog.list_keys("t2")
    assert [(k.id, k.description) for k in keys] == [("k0007", "moved")]
    assert decoded == ["k0007"]
    assert catalog._keys == known
    decoded.clear()
    with pytest.raises(FailedPrecondition, match="k0000"):
        await catalog.delete_tenant("t1")
    assert decoded == ["k0007"]  # not in the snapshot yet: decoded again
