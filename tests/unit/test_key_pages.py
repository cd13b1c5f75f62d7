"""ListKeys a page at a time: the pages (controlplane.keypages), the Admin
API's answers, and pontoctl, which takes every page. At 20,000 keys one
answer was 4.5 MB, past a gRPC client's default receive limit (trial 83)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from controlplane import cli
from controlplane.budget import LEDGER_PREFIX, Ledger
from controlplane.catalog import KEYS as KEY_RECORDS
from controlplane.catalog import Catalog
from controlplane.errors import InvalidArgument
from controlplane.keypages import MAX_PAGE, listing_order, page_of
from controlplane.model import ApiKeyRecord, Limits, Tenant, encode
from controlplane.store.memory import MemoryStore
from ponto.quota_types import utc_day
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import admin


def key(tenant: str, at: float, key_id: str) -> ApiKeyRecord:
    return ApiKeyRecord(key_id, "00" * 32, tenant, created_at=at)


def listed(keys: list[ApiKeyRecord]) -> list[ApiKeyRecord]:
    return sorted(keys, key=listing_order)


def pages(keys: list[ApiKeyRecord], size: int, **filter_: Any) -> Iterator[list[ApiKeyRecord]]:
    token = ""
    while True:
        page = page_of(keys, size, token, **{"tenant": "", "include_revoked": False, **filter_})
        yield list(page.keys)
        token = page.next_token
        if not token:
            return


KEYS = listed(
    [key(t, at, f"{t[0]}{i:09d}") for t in ("acme", "beta") for i, at in enumerate([3.0, 1.0, 2.0])]
    # Two keys made in the same second: their ids order them.
    + [key("acme", 2.0, "a999999999")]
)


@pytest.mark.parametrize("size", [1, 2, 3, 6, 7, 8, 100])
def test_pages_give_every_key_once_in_the_listing_order(size: int) -> None:
    got = list(pages(KEYS, size))
    assert [k for page in got for k in page] == KEYS
    assert all(len(page) == size for page in got[:-1])
    assert 0 < len(got[-1]) <= size  # no empty page at the end


def test_size_zero_is_every_key_left_and_a_size_past_the_most_is_the_most() -> None:
    assert page_of(KEYS, 0, "", tenant="", include_revoked=False).keys == KEYS
    first = page_of(KEYS, 2, "", tenant="", include_revoked=False)
    rest = page_of(KEYS, 0, first.next_token, tenant="", include_revoked=False)
    assert (rest.keys, rest.next_token) == (KEYS[2:], "")
    many = listed([key("acme", float(i), f"k{i:09d}") for i in range(MAX_PAGE + 3)])
    page = page_of(many, MAX_PAGE * 10, "", tenant="", include_revoked=False)
    assert page.keys == many[:MAX_PAGE] and page.next_token


def test_keys_made_and_gone_between_pages_do_not_move_the_others() -> None:
    """Every key present throughout is given exactly once, whatever was
    created or revoked (gone from the listing) between two pages."""
    rng = random.Random(7)
    for _ in range(200):
        before = listed(
            [key(rng.choice("abc"), float(rng.randrange(50)), f"k{i:09d}") for i in range(30)]
        )
        page = page_of(before, 7, "", tenant="", include_revoked=False)
        gone = set(rng.sample([k.id for k in before], 5))
        made = [key(rng.choice("abc"), float(rng.randrange(50)), f"n{i:09d}") for i in range(5)]
        after = listed([k for k in before if k.id not in gone] + made)
        rest = [k for p in pages_from(after, page.next_token) for k in p]
        given = [k.id for k in page.keys] + [k.id for k in rest]
        assert len(given) == len(set(given))  # none twice
        throughout = {k.id for k in before} - gone
        assert throughout <= set(given)


def pages_from(keys: list[ApiKeyRecord], token: str) -> Iterator[list[ApiKeyRecord]]:
    while token:
        page = page_of(keys, 7, token, tenant="", include_revoked=False)
        yield list(page.keys)
        token = page.next_token


def forged(*fields: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(fields)).encode()).decode()


@pytest.mark.parametrize(
    "token",
    [
        "not base64!",
        "é",
        base64.urlsafe_b64encode(b"not json").decode(),
        forged(2, "", False, "acme", 1.0, "a000000000"),  # another form
        forged(1, "", False, "acme", "1.0", "a000000000"),
        forged(1, "", False, "acme", 1.0),
        forged({"after": "a000000000"}),
        # Forged tokens that were INTERNAL, with a traceback logged: a time
        # past a float's range, lists nested past the interpreter's depth;
        # and times no key has, which json reads.
        forged(1, "", False, "acme", 10**400, "a000000000"),
        base64.urlsafe_b64encode(b"[" * 100_000 + b"]" * 100_000).decode(),
        base64.urlsafe_b64encode(b'[1, "", false, "acme", NaN, "a000000000"]').decode(),
        base64.urlsafe_b64encode(b'[1, "", false, "acme", -Infinity, "a000000000"]').decode(),
    ],
)
def test_a_token_it_did_not_make_is_refused(token: str) -> None:
    with pytest.raises(InvalidArgument, match="page_token is not one ListKeys gave") as refused:
        page_of(KEYS, 2, token, tenant="", include_revoked=False)
    assert refused.value.field == "page_token"


def test_a_token_asked_with_another_filter_or_a_negative_size_is_refused() -> None:
    token = page_of(KEYS, 2, "", tenant="acme", include_revoked=False).next_token
    for tenant, revoked in (("", False), ("beta", False), ("acme", True)):
        with pytest.raises(InvalidArgument, match="another tenant or include_revoked"):
            page_of(KEYS, 2, token, tenant=tenant, include_revoked=revoked)
    with pytest.raises(InvalidArgument, match="page_size -1 is negative"):
        page_of(KEYS, -1, "", tenant="", include_revoked=False)


async def fleet_of_keys(store: MemoryStore, n: int) -> list[str]:
    """Tenants acme and beta with n keys each, each key budgeted, and a
    ledger of spend for each: the keys' ids in listing order."""
    catalog = Catalog(store)
    ids = []
    for tenant in ("acme", "beta"):
        await catalog.put_tenant(Tenant(tenant), allow_update=False)
        for _ in range(n):
            record, _, _ = await catalog.create_key(tenant, limits=Limits(tokens_per_day=1000))
            ids.append(record.id)
            spent = Ledger(utc_day(time.time()), month_gone=7.0).encode()
            await store.put(LEDGER_PREFIX + f"k/{record.id}", spent)
    return [k.id for k in await catalog.list_keys()]


async def test_the_admin_api_pages_keys_with_the_spend_of_each_page_alone() -> None:
    store = MemoryStore()
    ids = await fleet_of_keys(store, 3)
    async with admin(store) as stub:
        whole = await stub.ListKeys(apb.ListKeysRequest())
        assert [k.id for k in whole.keys] == ids and not whole.next_page_token
        assert len(whole.spent) == 6  # unpaged: as before pages
        got, token = [], ""
        while True:
            page = await stub.ListKeys(apb.ListKeysRequest(page_size=4, page_token=token))
            assert {s.scope for s in page.spent} == {f"k/{k.id}" for k in page.keys}
            got += [k.id for k in page.keys]
            token = page.next_page_token
            if not token:
                break
        assert got == ids
        acme = await stub.ListKeys(apb.ListKeysRequest(tenant="acme", page_size=2))
        assert [k.tenant for k in acme.keys] == ["acme", "acme"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListKeys(apb.ListKeysRequest(page_size=2, page_token=acme.next_page_token))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "another tenant or include_revoked" in str(refused.value.details())


class SyncAdmin:
    """The Admin API's ListKeys, ListTenants and ListOrigins over an aio stub,
    called as pontoctl calls them (synchronously), from a thread, with every
    ListKeys request recorded."""

    def __init__(self, stub: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._stub, self._loop = stub, loop
        self.asked: list[apb.ListKeysRequest] = []

    def _call(self, name: str, request: Any) -> Any:
        async def call() -> Any:  # the aio call is made on its loop
            return await getattr(self._stub, name)(request)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(30)

    def ListKeys(self, request: apb.ListKeysRequest) -> apb.ListKeysResponse:
        self.asked.append(request)
        return self._call("ListKeys", request)  # type: ignore[no-any-return]

    def ListTenants(self, request: apb.ListRequest) -> apb.ListTenantsResponse:
        return self._call("ListTenants", request)  # type: ignore[no-any-return]

    def ListOrigins(self, request: apb.ListRequest) -> pb.RouteTable:
        return self._call("ListOrigins", request)  # type: ignore[no-any-return]


async def test_pontoctl_key_list_takes_every_page(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "KEYS_PAGE", 4)
    store = MemoryStore()
    ids = await fleet_of_keys(store, 5)
    async with admin(store) as stub:
        sync = SyncAdmin(stub, asyncio.get_running_loop())

        def pontoctl(*argv: str) -> Any:
            return json.loads(cli.run(cli._parser().parse_args(list(argv)), sync))

        listed_ = await asyncio.to_thread(pontoctl, "key", "list", "-o", "json")
        assert [k["id"] for k in listed_["keys"]] == ids
        assert [r.page_size for r in sync.asked] == [4, 4, 4]
        assert all(k["spent"]["month_tokens"] == 7 for k in listed_["keys"])
        # --active keeps the spend of the keys it lists (without it, every
        # budget would read as unspent).
        active = await asyncio.to_thread(pontoctl, "key", "list", "--active", "-o", "json")
        assert [k["id"] for k in active["keys"]] == ids
        assert all(k["spent"]["month_tokens"] == 7 for k in active["keys"])
        assert len(active["spent"]) == 10


async def test_pontoctl_asks_pages_as_large_as_the_control_plane_gives() -> None:
    """Each page reads and sorts every key again on the control plane (at
    20,000 keys pages of 1,000 cost it 1.0-1.2 s of CPU, one answer 0.16 s):
    1,500 keys are one call."""
    store = MemoryStore()
    records = [key("acme", 1.8e9 + i, f"k{i:09d}") for i in range(1500)]
    for r in records:
        await store.put(KEY_RECORDS + r.id, encode(r))
    async with admin(store) as stub:
        sync = SyncAdmin(stub, asyncio.get_running_loop())
        args = cli._parser().parse_args(["key", "list", "-o", "json"])
        listed_ = json.loads(await asyncio.to_thread(cli.run, args, sync))
        assert [k["id"] for k in listed_["keys"]] == [r.id for r in records]
        assert [(r.page_size, r.page_token) for r in sync.asked] == [(MAX_PAGE, "")]


async def test_pontoctl_prints_the_pages_as_one_answer_with_the_spend_of_its_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`key list -o json` over pages is the unpaged answer: the spend rows
    in scope order (each page's are sorted among themselves only: acme's
    keys, listed first, have the later ids). --active shows the spend of
    the keys it lists alone, as a page does."""
    monkeypatch.setattr(cli, "KEYS_PAGE", 2)
    store = MemoryStore()
    catalog = Catalog(store)
    for tenant, ids in (("acme", ("z1", "z2", "z3")), ("beta", ("a1", "a2"))):
        await catalog.put_tenant(Tenant(tenant), allow_update=False)
        for n, key_id in enumerate(ids):
            record = ApiKeyRecord(
                f"{key_id}00000000",
                "00" * 32,
                tenant,
                created_at=1.8e9 + n,
                limits=Limits(tokens_per_day=1000),
                suspended=key_id == "z2",
            )
            await store.put(KEY_RECORDS + record.id, encode(record))
            spent = Ledger(utc_day(time.time()), month_gone=7.0).encode()
            await store.put(LEDGER_PREFIX + f"k/{record.id}", spent)
    async with admin(store) as stub:
        sync = SyncAdmin(stub, asyncio.get_running_loop())

        def pontoctl(*argv: str) -> Any:
            return json.loads(cli.run(cli._parser().parse_args(list(argv)), sync))

        unpaged = await stub.ListKeys(apb.ListKeysRequest(include_revoked=True))
        expected = json.loads(cli.render(unpaged, "json", cli._rows_keys))
        got = await asyncio.to_thread(pontoctl, "key", "list", "-o", "json")
        assert len(sync.asked) == 3
        assert got["spent"] == cli._spent_per_key(expected)["spent"]
        assert [s["scope"] for s in got["spent"]] == sorted(f"k/{k['id']}" for k in got["keys"])
        active = await asyncio.to_thread(pontoctl, "key", "list", "--active", "-o", "json")
        assert [k["id"] for k in active["keys"]] == [
            "z100000000",
            "z300000000",
            "a100000000",
            "a200000000",
        ]
        assert [s["scope"] for s in active["spent"]] == [
            "k/a100000000",
            "k/a200000000",
            "k/z100000000",
            "k/z300000000",
        ]


async def test_an_unpaged_ask_keeps_every_spend_and_the_rest_of_a_listing_its_own() -> None:
    """An ask without page_size or page_token answers as before pages: the
    spend of every budgeted key, the tenant filter's or not. A page_token
    with page_size 0 asks every key left: a page, its keys' spend alone."""
    store = MemoryStore()
    ids = await fleet_of_keys(store, 3)
    async with admin(store) as stub:
        acme = await stub.ListKeys(apb.ListKeysRequest(tenant="acme"))
        assert [k.tenant for k in acme.keys] == ["acme"] * 3
        assert {s.scope for s in acme.spent} == {f"k/{i}" for i in ids}
        first = await stub.ListKeys(apb.ListKeysRequest(page_size=2))
        rest = await stub.ListKeys(apb.ListKeysRequest(page_token=first.next_page_token))
        assert [k.id for k in rest.keys] == ids[2:] and not rest.next_page_token
        assert {s.scope for s in rest.spent} == {f"k/{i}" for i in ids[2:]}


class UpgradedMidway(SyncAdmin):
    """A control plane with pages for the first ListKeys, then (pontoctl's
    connection moved to another replica in a rolling upgrade) one older than
    pages: it knows neither page_size nor page_token, and answers every key."""

    def ListKeys(self, request: apb.ListKeysRequest) -> apb.ListKeysResponse:
        if self.asked:
            request = apb.ListKeysRequest(
                tenant=request.tenant, include_revoked=request.include_revoked
            )
        return super().ListKeys(request)


async def test_pontoctl_lists_each_key_once_when_an_older_replica_answers_a_later_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "KEYS_PAGE", 4)
    store = MemoryStore()
    ids = await fleet_of_keys(store, 5)
    async with admin(store) as stub:
        sync = UpgradedMidway(stub, asyncio.get_running_loop())
        args = cli._parser().parse_args(["key", "list", "-o", "json"])
        listed_ = json.loads(await asyncio.to_thread(cli.run, args, sync))
        assert [r.page_size for r in sync.asked] == [4, 0]
        assert [k["id"] for k in listed_["keys"]] == ids
        assert sorted(s["scope"] for s in listed_["spent"]) == sorted(f"k/{i}" for i in ids)
        assert len(listed_["spent"]) == len(ids)
