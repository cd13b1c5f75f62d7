"""controlplane.quotasync: demand from proxies to the store, shares from the leader
back to every replica's streams, over MemoryStore."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson
import pytest

from controlplane import quotasync
from controlplane.catalog import LEADER_KEY, Catalog
from controlplane.compile import compile_table
from controlplane.distribute import Publisher
from controlplane.model import ApiKeyRecord, Limits, ProxyRecord, State, Tenant
from controlplane.quotasync import (
    COMPRESSED,
    DEMAND_PREFIX,
    SHARES_KEY,
    SPARE_REFRESH_ROUNDS,
    SPARE_TTL_MIN_S,
    SPARE_TTL_ROUNDS,
    EncodedRows,
    QuotaHub,
    Rebalancer,
    decode_shares,
    encode_shares,
    limits_of_table,
    spare_ttl_s,
)
from controlplane.store import Conflict, Fence, KeyValue
from controlplane.store.memory import MemoryStore
from ponto.quota_types import ScopeLimits, Share
from ponto.v1 import routing_pb2 as pb
from tests.latestores import NotServingYet

WAIT = 5.0  # generous bound for conditions that hold within a few loop turns


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds; fail after WAIT seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        await asyncio.sleep(0.002)


async def settle(turns: int = 20) -> None:
    """Let every ready task run a few times."""
    for _ in range(turns):
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def constant_lease(lease: int) -> Callable[[], Awaitable[int]]:
    async def get() -> int:
        return lease

    return get


def demand(
    scope: str,
    rps: float = 0.0,
    tps: float = 0.0,
    conc: int = 0,
    in_flight: int = 0,
    debt: float = 0.0,
) -> pb.ScopeDemand:
    return pb.ScopeDemand(
        scope=scope,
        requests_per_s=rps,
        tokens_per_s=tps,
        concurrency=conc,
        in_flight=in_flight,
        debt_tokens=debt,
    )


# ---------------------------------------------------------------- pure parts


def test_limits_of_table_lists_only_limited_scopes() -> None:
    table = pb.RouteTable(
        tenants=[
            pb.Tenant(name="acme", limits=pb.Limits(rpm=600, tpm=10_000, concurrency=4)),
            pb.Tenant(name="open"),
            pb.Tenant(name="slow", limits=pb.Limits(concurrency=1)),
        ],
        keys=[
            pb.ApiKey(id="aaaaaaaaaa", tenant="acme", limits=pb.Limits(tpm=500)),
            pb.ApiKey(id="bbbbbbbbbb", tenant="acme"),
        ],
    )
    assert limits_of_table(table) == {
        "t/acme": ScopeLimits(600, 10_000, 4),
        "t/slow": ScopeLimits(0, 0, 1),
        "k/aaaaaaaaaa": ScopeLimits(0, 500, 0),
    }
    assert limits_of_table(pb.RouteTable()) == {}


def test_shares_encode_decode_round_trip() -> None:
    shares = {
        "p2": {"t/acme": Share(0.25, 1), "k/aaaaaaaaaa": Share(0.5, 0)},
        "p1": {"t/acme": Share(0.75, 3)},
        "p3": {},
    }
    raw = encode_shares(shares, 1 / 3, 5.0)
    assert decode_shares(raw) == (shares, 1 / 3, 5.0)
    # Canonical: the same shares in another order encode to the same bytes, so
    # the leader can compare payloads to skip writes.
    reordered = {p: dict(reversed(list(s.items()))) for p, s in reversed(list(shares.items()))}
    assert encode_shares(reordered, 1 / 3, 5.0) == raw
    assert decode_shares(b"{}") == ({}, 0.0, 0.0)


async def hub_with(raw: bytes) -> QuotaHub:
    """A replica that has read `raw` as the shares key."""
    store = MemoryStore()
    await store.put(SHARES_KEY, raw)
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    await hub._load()
    return hub


def test_rows_encoded_before_make_the_same_bytes_and_follow_every_change() -> None:
    """The leader reuses a proxy's encoded rows while its shares are the same
    objects: the key must read exactly as if all were encoded anew."""
    encoded = EncodedRows()
    a, b = Share(0.5, 1), Share(0.25, 2, True, 3.0)
    rounds: list[dict[str, dict[str, Share]]] = [
        {"p1": {"t/acme": a, "k/x": b}, "p2": {"t/acme": a}},
        {"p1": {"t/acme": a, "k/x": b}, "p2": {"t/acme": a}},  # the same objects
        {"p1": {"t/acme": Share(0.5, 1), "k/x": b}, "p2": {"t/acme": Share(0.4, 1)}},
        {"p1": {"k/x": b}, "p3": {"t/acme": a}},  # a scope and a proxy gone, one new
    ]
    for shares in rounds:
        assert encode_shares(shares, 0.5, 5.0, encoded=encoded) == encode_shares(shares, 0.5, 5.0)
    # A mapping changed in place after it was encoded is not taken for the same.
    changing = {"p1": {"t/acme": a}}
    encode_shares(changing, 0.5, encoded=encoded)
    changing["p1"]["t/acme"] = Share(0.1, 0)
    assert encode_shares(changing, 0.5, encoded=encoded) == encode_shares(changing, 0.5)


async def test_spare_slots_travel_to_the_store_and_to_the_proxy() -> None:
    shares = {"p1": {"t/acme": Share(0.5, 1, spare=True), "t/full": Share(0.5, 2)}}
    raw = encode_shares(shares, 0.5)
    assert decode_shares(raw) == (shares, 0.5, 0.0)
    # Shares written before the flag existed read as "no spare".
    assert decode_shares(b'{"proxies": {"p1": {"t/acme": [0.5, 1]}}}')[0] == {
        "p1": {"t/acme": Share(0.5, 1)}
    }
    hub = await hub_with(raw)
    quota = quota_of(hub.update_for("p1"))
    assert {s.scope: s.fleet_spare for s in quota.shares} == {"t/acme": True, "t/full": False}


async def test_an_update_stamped_with_its_generation_reads_as_the_same_update() -> None:
    """The stamp goes before the update built once (protobuf merges them)."""
    hub = await hub_with(encode_shares({"p1": {"t/acme": Share(0.5, 1, True, 2.0)}}, 0.5, 5.0))
    stamped = pb.RouteUpdate.FromString(hub.update_for("p1"))
    plain = pb.RouteUpdate.FromString(hub.update_for("p1", 0))
    assert plain.quota.generation == 0 and hub.generation > 0
    plain.quota.generation = hub.generation
    assert stamped == plain and len(stamped.quota.shares) == 1
    assert pb.RouteUpdate.FromString(hub.update_for("p1", 7)).quota.generation == 7


async def test_the_fleets_debt_travels_to_the_store_and_to_the_proxy() -> None:
    shares = {
        "p1": {"t/acme": Share(0.9, 0, fleet_debt_s=365.0), "t/both": Share(0.1, 1, True, 5.0)},
        "p2": {"t/acme": Share(0.02, 0, fleet_debt_s=365.0)},
    }
    raw = encode_shares(shares, 0.5)
    assert decode_shares(raw) == (shares, 0.5, 0.0)
    # A replica that predates the debt reads the fraction, slots and flag.
    body = orjson.loads(raw)
    assert body["proxies"]["p1"]["t/acme"][:3] == [0.9, 0, 0]
    hub = await hub_with(raw)
    quota = quota_of(hub.update_for("p2"))
    assert [(s.scope, s.fleet_debt_s) for s in quota.shares] == [("t/acme", 365.0)]


# ---------------------------------------------------------------- demand in


async def test_publish_demand_writes_reports_under_the_replica_lease() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(30)
    hub = QuotaHub(store, "cp-a", constant_lease(lease), interval=0.001, wall=lambda: 100.0)
    key = DEMAND_PREFIX + "cp-a"

    async def body() -> Any:
        kv = await store.get(key)
        return None if kv is None else orjson.loads(kv.value)

    hub.report("p1", [demand("t/acme", 2.0, 150.0, 3, 1, 40.0), demand("")])  # no scope: dropped
    hub.report("p2", [demand("k/aaaaaaaaaa", rps=0.5, debt=math.nan)])  # not a number: none
    async with running(hub.publish_demand()):
        await eventually(lambda: _has(store, key), "demand written")
        kv = await store.get(key)
        assert kv is not None and kv.lease == lease
        assert await body() == {
            "proxies": {
                "p1": {"t/acme": [2.0, 150.0, 3.0, 1.0, 40.0]},
                "p2": {"k/aaaaaaaaaa": [0.5, 0.0, 0.0, 0.0, 0.0]},
            },
            "heard": {"p1": 100.0, "p2": 100.0},
        }

        # A new report replaces the proxy's previous one.
        hub.report("p1", [demand("t/acme", rps=9.0)])
        await eventually(
            lambda: _equals(
                body,
                {
                    "proxies": {
                        "p1": {"t/acme": [9.0, 0.0, 0.0, 0.0, 0.0]},
                        "p2": {"k/aaaaaaaaaa": [0.5, 0.0, 0.0, 0.0, 0.0]},
                    },
                    "heard": {"p1": 100.0, "p2": 100.0},
                },
            ),
            "report replaced",
        )
        hub.forget("p2")
        await eventually(
            lambda: _equals(
                body,
                {"proxies": {"p1": {"t/acme": [9.0, 0.0, 0.0, 0.0, 0.0]}}, "heard": {"p1": 100.0}},
            ),
            "forgotten proxy removed",
        )

        # The key lives and dies with the replica's lease.
        await store.revoke_lease(lease)
        assert await store.get(key) is None


async def _has(store: MemoryStore, key: str) -> bool:
    return await store.get(key) is not None


async def _equals(body: Callable[[], Awaitable[Any]], expected: Any) -> bool:
    return bool(await body() == expected)


async def test_publish_demand_writes_only_when_something_changed() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(30)
    calls: list[int] = []

    async def counting_lease() -> int:
        calls.append(lease)
        return lease

    hub = QuotaHub(store, "cp-a", counting_lease, interval=0.001)
    async with running(hub.publish_demand()):
        await asyncio.sleep(0.05)  # many intervals with nothing reported
        assert calls == []
        assert await store.get(DEMAND_PREFIX + "cp-a") is None

        hub.report("p1", [demand("t/acme", rps=1.0)])
        await eventually(lambda: _has(store, DEMAND_PREFIX + "cp-a"), "demand written")
        kv = await store.get(DEMAND_PREFIX + "cp-a")
        assert kv is not None
        hub.forget("never-reported")  # nothing to forget: no write
        await asyncio.sleep(0.05)
        again = await store.get(DEMAND_PREFIX + "cp-a")
        assert again is not None and again.mod_revision == kv.mod_revision
        assert len(calls) == 1


async def test_publish_demand_retries_after_an_outage() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(30)
    hub = QuotaHub(store, "cp-a", constant_lease(lease), interval=0.001)
    store.available = False
    hub.report("p1", [demand("t/acme", rps=1.0)])
    async with running(hub.publish_demand()) as task:
        await asyncio.sleep(0.02)  # several failed attempts
        assert not task.done()
        store.available = True
        await eventually(lambda: _has(store, DEMAND_PREFIX + "cp-a"), "written after outage")


async def test_publish_demand_survives_an_expired_lease() -> None:
    # The registry hands out its lease until its keepalive notices the expiry
    # (up to a third of the TTL later) and grants a new one: meanwhile writes
    # under the old lease fail with LeaseExpired.
    store = MemoryStore()
    expired = await store.grant_lease(30)
    await store.revoke_lease(expired)
    fresh = await store.grant_lease(30)
    leases = iter([expired, expired])

    async def registry_lease() -> int:
        return next(leases, fresh)

    hub = QuotaHub(store, "cp-a", registry_lease, interval=0.001)
    hub.report("p1", [demand("t/acme", rps=1.0)])
    key = DEMAND_PREFIX + "cp-a"
    task = asyncio.create_task(hub.publish_demand())

    async def written_or_dead() -> bool:
        return task.done() or await store.get(key) is not None

    try:
        await eventually(written_or_dead, "demand written under the new lease")
        assert not task.done(), f"the demand publisher died: {task.exception()!r}"
        kv = await store.get(key)
        assert kv is not None and kv.lease == fresh
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---------------------------------------------------------------- shares out


async def put_shares(
    store: MemoryStore, shares: dict[str, dict[str, Share]], default: float, ttl: float = 0.0
) -> int:
    return await store.put(SHARES_KEY, encode_shares(shares, default, ttl))


def quota_of(payload: bytes) -> pb.QuotaShares:
    update = pb.RouteUpdate.FromString(payload)
    assert not update.HasField("table")
    assert update.HasField("quota")
    return update.quota


def share_map(quota: pb.QuotaShares) -> dict[str, tuple[float, int]]:
    return {s.scope: (s.fraction, s.concurrency) for s in quota.shares}


async def test_watch_loads_existing_shares_at_start() -> None:
    store = MemoryStore()
    revision = await put_shares(store, {"p1": {"t/acme": Share(0.5, 2)}}, 0.5)
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    async with running(hub.watch()):
        generation, payload, _ = await asyncio.wait_for(hub.next_for("p1", 0), WAIT)
    assert generation == revision == hub.generation
    quota = quota_of(payload)
    assert quota.generation == revision
    assert quota.default_fraction == 0.5
    assert share_map(quota) == {"t/acme": (0.5, 2)}


async def test_shares_written_while_the_first_read_failed_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first read failed (etcd not serving yet) and the leader wrote
    shares before the watch was made: read again, not watched "from now"."""
    monkeypatch.setattr("controlplane.store.base.UNREAD_RETRY_S", 0.001)
    store = NotServingYet()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    async with running(hub.watch()):
        await asyncio.wait_for(store.failed.wait(), WAIT)
        revision = await put_shares(store, {"p1": {"t/acme": Share(0.5, 2)}}, 0.5)
        store.serving.set()  # a watch made now would start after the write
        generation, _, _ = await asyncio.wait_for(hub.next_for("p1", 0), WAIT)
    assert generation == revision


async def test_next_for_wakes_only_when_this_proxys_shares_change() -> None:
    store = MemoryStore()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    async with running(hub.watch()):
        first = asyncio.ensure_future(hub.next_for("p1", 0))
        await settle()
        assert not first.done()  # no shares yet

        rev1 = await put_shares(
            store, {"p1": {"t/acme": Share(0.5, 2)}, "p2": {"t/acme": Share(0.5, 2)}}, 0.5
        )
        generation, payload, sent = await asyncio.wait_for(first, WAIT)
        assert generation == rev1
        assert share_map(quota_of(payload)) == {"t/acme": (0.5, 2)}

        waiting = asyncio.ensure_future(hub.next_for("p1", generation, sent))
        # Only p2's share moves: the hub loads the new generation, but p1's
        # payload is the same, so its stream is not woken.
        rev2 = await put_shares(
            store, {"p1": {"t/acme": Share(0.5, 2)}, "p2": {"t/acme": Share(0.4, 2)}}, 0.5
        )
        await eventually(lambda: _generation_is(hub, rev2), "hub loads the new shares")
        await settle()
        assert not waiting.done()

        # Now p1's share moves.
        rev3 = await put_shares(
            store, {"p1": {"t/acme": Share(0.3, 1)}, "p2": {"t/acme": Share(0.4, 2)}}, 0.5
        )
        generation, payload, sent = await asyncio.wait_for(waiting, WAIT)
        assert generation == rev3
        quota = quota_of(payload)
        assert quota.generation == rev3
        assert share_map(quota) == {"t/acme": (0.3, 1)}

        # A new default fraction is news for every proxy.
        again = asyncio.ensure_future(hub.next_for("p1", generation, sent))
        rev4 = await put_shares(
            store, {"p1": {"t/acme": Share(0.3, 1)}, "p2": {"t/acme": Share(0.4, 2)}}, 0.25
        )
        generation, payload, _ = await asyncio.wait_for(again, WAIT)
        assert generation == rev4
        assert quota_of(payload).default_fraction == 0.25


async def _generation_is(hub: QuotaHub, revision: int) -> bool:
    return hub.generation == revision


async def test_every_rewrite_confirms_the_spare_flags_to_their_proxies() -> None:
    store = MemoryStore()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    shares = {"p1": {"t/acme": Share(0.5, 1, spare=True)}, "p2": {"t/acme": Share(0.5, 1)}}
    async with running(hub.watch()):
        await put_shares(store, shares, 0.5, ttl=5.0)
        got = {}
        for name in ("p1", "p2"):
            generation, payload, sent = await asyncio.wait_for(hub.next_for(name, 0), WAIT)
            quota = quota_of(payload)
            assert (quota.spare_ttl_s, quota.unchanged) == (5.0, False)
            got[name] = (generation, sent)
        p1 = asyncio.ensure_future(hub.next_for("p1", *got["p1"], confirm=True))
        p2 = asyncio.ensure_future(hub.next_for("p2", *got["p2"], confirm=True))
        # p1 again, on the stream of a proxy from before `unchanged` (it would
        # read one as empty shares): sent shares only when they change.
        p1_old = asyncio.ensure_future(hub.next_for("p1", *got["p1"]))
        # The leader writes the same shares again.
        rewritten = await put_shares(store, shares, 0.5, ttl=5.0)
        generation, payload, sent = await asyncio.wait_for(p1, WAIT)
        assert (generation, sent) == (rewritten, got["p1"][1])
        confirmed = quota_of(payload)
        assert confirmed == pb.QuotaShares(generation=rewritten, spare_ttl_s=5.0, unchanged=True)
        # p2's shares carry no flag: nothing to confirm, nothing sent.
        await settle()
        assert not p2.done() and not p1_old.done()
        for waiting in (p2, p1_old):
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting


async def test_a_proxy_hears_nothing_until_the_leader_grants_it_a_share() -> None:
    """Trial 34: a proxy that restarted, or reconnected after its stream was
    lost, was pushed no shares (not rebalanced yet) and then a share of
    nothing (the round that admits a newcomer grants it nothing until the
    others' cuts land), each replacing the shares it held: it refused every
    request for seconds. Its shares are held back until they admit."""
    store = MemoryStore()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    async with running(hub.watch()):
        waiting = asyncio.ensure_future(hub.next_for("p3", 0))
        two = {"p1": {"t/acme": Share(0.5, 0)}, "p2": {"t/acme": Share(0.5, 0)}}
        await put_shares(store, two, 0.5)
        await settle()
        assert not waiting.done()  # not rebalanced yet
        admitted = {p: {"t/acme": Share(0.3, 0)} for p in ("p1", "p2")}
        admitted["p3"] = {"t/acme": Share(0.0, 0)}
        await put_shares(store, admitted, 0.3)
        await settle()
        assert not waiting.done()  # a share of nothing, this round
        granted = {**admitted, "p3": {"t/acme": Share(0.3, 0)}}
        revision = await put_shares(store, granted, 0.3)
        generation, payload, _ = await asyncio.wait_for(waiting, WAIT)
        assert generation == revision
        assert share_map(quota_of(payload)) == {"t/acme": (0.3, 0)}


async def test_only_rebalanced_proxies_get_the_default_fraction() -> None:
    store = MemoryStore()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    revision = await put_shares(store, {"p1": {"t/acme": Share(0.5, 4)}, "p2": {}}, 0.5)
    async with running(hub.watch()):
        await eventually(lambda: _generation_is(hub, revision), "shares loaded")
    # p2 was counted by the leader: the default applies to its scopes.
    quota = quota_of(hub.update_for("p2"))
    assert quota.generation == revision
    assert list(quota.shares) == []
    assert quota.default_fraction == 0.5
    # A proxy the leader has not seen yet gets nothing: the leader did not
    # count it, so a default share could take the fleet over the limit.
    newcomer = quota_of(hub.update_for("newcomer"))
    assert newcomer.generation == revision
    assert list(newcomer.shares) == []
    assert newcomer.default_fraction == 0.0


@pytest.mark.parametrize(
    "bad_value",
    [
        b'{"proxies": {"p1": {"t/acme": [0.5]}}}',
        b'{"proxies": {"p1": {"t/acme": [0.5, null]}}}',
        b'{"proxies": {"p1": {"t/acme": {"fraction": 0.5}}}}',
        b'{"proxies": {"p1": [[0.5, 1]]}}',
        b'{"proxies": [["p1"]]}',
        COMPRESSED + zlib.compress(b'{"proxies": {}}')[:-3],  # cut short
        COMPRESSED + b"not zlib",
    ],
    ids=[
        "short row",
        "null in a row",
        "row not a list",
        "scopes not an object",
        "proxies not an object",
        "compressed, cut short",
        "not compressed",
    ],
)
async def test_undecodable_shares_are_ignored(
    bad_value: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    hub = QuotaHub(store, "cp-a", constant_lease(0), interval=1.0)
    good = await put_shares(store, {"p1": {"t/acme": Share(0.5, 1)}}, 0.5)
    with caplog.at_level(logging.ERROR, logger="controlplane.quotasync"):
        async with running(hub.watch()):
            await eventually(lambda: _generation_is(hub, good), "good shares loaded")
            bad = await store.put(SHARES_KEY, bad_value)
            await eventually(lambda: _logged(caplog, "undecodable"), "bad shares logged")
            assert hub.generation == good != bad
    assert share_map(quota_of(hub.update_for("p1"))) == {"t/acme": (0.5, 1)}


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return text in caplog.text


# ---------------------------------------------------------------- rebalancer

KEY_ID = "aaaaaaaaaa"


def limited_table(revision: int = 10, *, concurrency: int = 10) -> pb.RouteTable:
    return compile_table(
        State(
            revision,
            tenants=(
                Tenant("acme", limits=Limits(rpm=600, concurrency=concurrency)),
                Tenant("open"),
            ),
            keys=(ApiKeyRecord(KEY_ID, "a" * 64, "acme", limits=Limits(tpm=6_000)),),
        )
    )


def proxy(name: str) -> ProxyRecord:
    return ProxyRecord(name, "us-east", "10.0.0.1:8080", "0.1.0", f"s-{name}", "cp-a", 1.0)


class Fleet:
    """A store with a leader key, registered proxies and a publisher with a table."""

    def __init__(self, table: pb.RouteTable | None) -> None:
        self.store = MemoryStore()
        self.catalog = Catalog(self.store)
        self.publisher = Publisher("cp-a")
        if table is not None:
            self.publisher.publish(table)
        self.fence: Fence | None = None
        self.lease = 0

    async def lead(self) -> Fence:
        revision = await self.store.put(LEADER_KEY, b"cp-a")
        self.fence = Fence(LEADER_KEY, revision)
        return self.fence

    async def register(self, *names: str) -> None:
        if not self.lease:
            self.lease = await self.store.grant_lease(30)
        for name in names:
            await self.catalog.register_proxy(proxy(name), self.lease)

    def rebalancer(self) -> Rebalancer:
        return Rebalancer(
            self.store, self.catalog, self.publisher, fence=lambda: self.fence, interval=0.001
        )

    async def shares(self) -> tuple[dict[str, dict[str, Share]], float, KeyValue]:
        kv = await self.store.get(SHARES_KEY)
        assert kv is not None
        shares, default, _ = decode_shares(kv.value)
        return shares, default, kv


async def test_round_writes_shares_for_every_proxy_and_limited_scope() -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    rebalancer = fleet.rebalancer()
    await rebalancer.round()
    assert rebalancer.rounds == 1

    shares, default, _ = await fleet.shares()
    assert default == 0.5
    assert sorted(shares) == ["p1", "p2"]
    for by_scope in shares.values():
        assert sorted(by_scope) == [f"k/{KEY_ID}", "t/acme"]  # not t/open
    for scope in ("t/acme", f"k/{KEY_ID}"):
        assert math.fsum(shares[p][scope].fraction for p in shares) <= 1.0
    assert sum(shares[p]["t/acme"].concurrency for p in shares) <= 10
    assert all(shares[p][f"k/{KEY_ID}"].concurrency == 0 for p in shares)


async def test_round_skips_the_write_when_nothing_changed() -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    rebalancer = fleet.rebalancer()
    await rebalancer.round()
    *_, first = await fleet.shares()
    await rebalancer.round()
    *_, second = await fleet.shares()
    assert rebalancer.rounds == 2
    assert second.mod_revision == first.mod_revision


async def test_round_without_a_table_does_nothing() -> None:
    fleet = Fleet(None)
    await fleet.lead()
    await fleet.register("p1")
    rebalancer = fleet.rebalancer()
    await rebalancer.round()
    assert rebalancer.rounds == 0
    assert await fleet.store.get(SHARES_KEY) is None


async def test_reported_demand_moves_shares_to_the_busy_proxy() -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(fleet.lease), interval=0.001)
    # p1 asks for the whole limit (600 rpm = 10/s) and 8 slots; p2 is idle.
    hub.report("p1", [demand("t/acme", rps=10.0, conc=8, in_flight=2)])
    async with running(hub.publish_demand()):
        await eventually(lambda: _has(fleet.store, DEMAND_PREFIX + "cp-a"), "demand written")
    await fleet.rebalancer().round()
    shares, _, _ = await fleet.shares()
    assert shares["p1"]["t/acme"].fraction > shares["p2"]["t/acme"].fraction
    assert shares["p1"]["t/acme"].concurrency > shares["p2"]["t/acme"].concurrency
    assert shares["p1"]["t/acme"].concurrency + shares["p2"]["t/acme"].concurrency <= 10


@pytest.mark.parametrize(
    "bad_value", [b"not json", COMPRESSED + b"not zlib"], ids=["not json", "not compressed"]
)
async def test_round_ignores_undecodable_demand(
    bad_value: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1")
    await fleet.store.put(DEMAND_PREFIX + "cp-b", bad_value)
    await fleet.rebalancer().round()
    shares, default, _ = await fleet.shares()
    assert default == 1.0
    assert sorted(shares["p1"]) == [f"k/{KEY_ID}", "t/acme"]
    assert "cp-b" in caplog.text


async def test_stale_fence_raises_conflict_and_stops_run() -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1")
    rebalancer = fleet.rebalancer()
    await rebalancer.round()
    *_, before = await fleet.shares()

    # Another replica becomes the leader: our fence no longer holds.
    await fleet.store.delete(LEADER_KEY)
    await fleet.store.put(LEADER_KEY, b"cp-b")
    await fleet.register("p2")  # something to write
    with pytest.raises(Conflict):
        await rebalancer.round()
    *_, after = await fleet.shares()
    assert after.mod_revision == before.mod_revision

    # run() ends on the conflict rather than fighting the new leader.
    await asyncio.wait_for(fleet.rebalancer().run(), WAIT)
    *_, after_run = await fleet.shares()
    assert after_run.mod_revision == before.mod_revision


async def test_run_resumes_from_the_stored_shares() -> None:
    # No concurrency limit, so no spare flag that a new leader must confirm.
    fleet = Fleet(limited_table(concurrency=0))
    await fleet.lead()
    await fleet.register("p1", "p2")
    await fleet.rebalancer().round()
    *_, written = await fleet.shares()

    # A new leader's rebalancer starts from what is stored: same state, no write.
    successor = fleet.rebalancer()
    async with running(successor.run()):
        await eventually(lambda: _rounds_at_least(successor, 3), "a few rounds")
    *_, after = await fleet.shares()
    assert after.mod_revision == written.mod_revision


async def test_shares_with_spare_flags_are_rewritten_every_few_rounds() -> None:
    """Rewritten unchanged, so that their proxies hear a leader still moves
    slots; the first round of a new leader rewrites at once, confirming
    flags that proxies stopped counting while there was none."""
    fleet = Fleet(limited_table())  # an idle fleet: every slot is spare
    await fleet.lead()
    await fleet.register("p1", "p2")
    rebalancer = fleet.rebalancer()
    revisions = []
    for _ in range(2 * SPARE_REFRESH_ROUNDS + 1):
        await rebalancer.round()
        *_, kv = await fleet.shares()
        revisions.append(kv.mod_revision)
    shares, _, kv = await fleet.shares()
    assert all(shares[p]["t/acme"].spare for p in ("p1", "p2"))
    assert len(set(revisions)) == 3  # rounds 1, 3 and 5 wrote
    assert decode_shares(kv.value)[2] == spare_ttl_s(0.001) == SPARE_TTL_MIN_S

    successor = fleet.rebalancer()
    async with running(successor.run()):
        await eventually(lambda: _rounds_at_least(successor, 1), "a round")
    *_, after = await fleet.shares()
    assert after.mod_revision > kv.mod_revision
    assert after.value == kv.value  # the same shares, confirmed


def test_the_spare_ttl_spans_a_few_rounds_and_never_less_than_the_floor() -> None:
    assert spare_ttl_s(1.0) == SPARE_TTL_ROUNDS * 1.0 > SPARE_REFRESH_ROUNDS * 1.0
    assert spare_ttl_s(0.05) == SPARE_TTL_MIN_S


async def _rounds_at_least(rebalancer: Rebalancer, n: int) -> bool:
    return rebalancer.rounds >= n


async def _hub_is_current(hub: QuotaHub, fleet: Fleet) -> bool:
    *_, kv = await fleet.shares()
    return hub.generation == kv.mod_revision


async def test_default_shares_of_new_scopes_count_as_given() -> None:
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    rebalancer = fleet.rebalancer()
    await rebalancer.round()
    first, default, _ = await fleet.shares()
    assert default == 0.5

    # A tenant gets limited after that rebalance: until the next one, each
    # proxy applies the default fraction (0.5) to it.
    table = compile_table(
        State(
            11,
            tenants=(
                Tenant("acme", limits=Limits(rpm=600, concurrency=10)),
                Tenant("open", limits=Limits(rpm=60)),
            ),
            keys=(ApiKeyRecord(KEY_ID, "a" * 64, "acme", limits=Limits(tpm=6_000)),),
        )
    )
    assert fleet.publisher.publish(table) is not None
    # p1 wants all of it at once.
    await fleet.store.put(
        DEMAND_PREFIX + "cp-a",
        orjson.dumps({"proxies": {"p1": {"t/open": [1.0, 0.0, 0.0, 0.0]}}}),
        lease=fleet.lease,
    )
    await rebalancer.round()
    second, _, _ = await fleet.shares()
    applied = {p: max(default, second[p]["t/open"].fraction) for p in ("p1", "p2")}
    # Whichever of the default and the new share each proxy applies while the
    # push travels, the fleet stays within the limit.
    assert math.fsum(applied.values()) <= 1.0
    assert second["p1"]["t/open"].fraction > second["p2"]["t/open"].fraction
    assert first["p1"]["t/acme"] == second["p1"]["t/acme"]


async def test_no_limits_means_default_fraction_zero_and_no_pushes_on_join() -> None:
    fleet = Fleet(compile_table(State(10, tenants=(Tenant("open"),))))
    await fleet.lead()
    await fleet.register("p1")
    rebalancer = fleet.rebalancer()
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(fleet.lease), interval=1.0)
    async with running(hub.watch()):
        await rebalancer.round()
        shares, default, _ = await fleet.shares()
        assert default == 0.0
        assert shares == {"p1": {}}
        generation, payload, sent = await asyncio.wait_for(hub.next_for("p1", 0), WAIT)
        assert list(quota_of(payload).shares) == []
        assert quota_of(payload).default_fraction == 0.0

        waiting = asyncio.ensure_future(hub.next_for("p1", generation, sent))
        for name in ("p2", "p3"):
            await fleet.register(name)
            await rebalancer.round()
            await eventually(lambda: _hub_is_current(hub, fleet), "hub has the latest shares")
            await settle()
            assert not waiting.done()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting


async def test_a_tables_limits_are_read_once_not_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 20,000 keys reading every key's limits was 30 ms of the leader's
    event loop a round (a round a second); a new table's limits apply at the
    next round."""
    tables: list[pb.RouteTable] = []

    def counted(table: pb.RouteTable) -> dict[str, ScopeLimits]:
        tables.append(table)
        return limits_of_table(table)

    monkeypatch.setattr(quotasync, "limits_of_table", counted)
    fleet = Fleet(limited_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    rebalancer = fleet.rebalancer()
    for _ in range(3):
        await rebalancer.round()
    assert len(tables) == 1
    shares, *_ = await fleet.shares()
    assert sum(shares[p]["t/acme"].concurrency for p in shares) == 10
    snap = fleet.publisher.publish(limited_table(11, concurrency=4))
    assert snap is not None
    await rebalancer.round()
    await rebalancer.round()
    assert tables == [tables[0], snap.table]
    shares, *_ = await fleet.shares()
    assert sum(shares[p]["t/acme"].concurrency for p in shares) == 4


def test_limits_of_table_reads_limits_of_zeros_as_none() -> None:
    table = pb.RouteTable(
        tenants=[pb.Tenant(name="zeros", limits=pb.Limits()), pb.Tenant(name="day")],
        keys=[pb.ApiKey(id="cccccccccc", limits=pb.Limits(tokens_per_month=9))],
    )
    table.tenants[1].limits.tokens_per_day = 5
    assert limits_of_table(table) == {
        "t/day": ScopeLimits(tokens_per_day=5),
        "k/cccccccccc": ScopeLimits(tokens_per_month=9),
    }
