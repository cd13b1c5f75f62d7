"""Catalog: validation, existence rules, drain and proxy records over MemoryStore."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import orjson
import pytest

from controlplane.api.admin import origin_pb
from controlplane.catalog import ACKS, KEYS, ORIGINS, PROXIES, REGIONS, TENANTS, Catalog
from controlplane.cli import _as_spec
from controlplane.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from controlplane.messages import origin_of
from controlplane.model import (
    DEFAULT_WEIGHT,
    Origin,
    OriginHealth,
    PromptPolicy,
    ProxyRecord,
    Region,
    Tenant,
    decode_origin,
    encode,
)
from controlplane.store import Conflict, Fence
from controlplane.store.memory import MemoryStore
from tests.latestores import ListingStore


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def catalog(store: MemoryStore) -> Catalog:
    return Catalog(store)


def region(name: str = "us-east", lat: float = 39.0, lon: float = -77.0) -> Region:
    return Region(name=name, latitude=lat, longitude=lon)


def origin(
    name: str = "o1",
    *,
    url: str = "http://origin.example:8000/v1",
    region_name: str = "us-east",
    models: tuple[str, ...] = ("llama-3",),
    weight: int = DEFAULT_WEIGHT,
) -> Origin:
    return Origin(name=name, base_url=url, region=region_name, models=models, weight=weight)


def proxy(name: str = "p1", session: str = "s1") -> ProxyRecord:
    return ProxyRecord(
        name=name,
        region="us-east",
        address="10.0.0.1:8080",
        version="0.1.0",
        session_id=session,
        control_plane_id="cp-1",
        connected_at=1.0,
    )


# ---------------------------------------------------------------- regions


@pytest.mark.parametrize(
    "bad",
    [
        region(name="Bad_Name"),
        region(name=""),
        region(name="-edge"),
        region(name="x" * 64),
        region(lat=91.0),
        region(lat=-90.5),
        region(lon=-181.0),
        region(lon=180.5),
        region(lat=math.nan),
        region(lon=math.nan),
        region(lat=math.inf),
    ],
    ids=[
        "uppercase",
        "empty",
        "leading-dash",
        "too-long",
        "lat-91",
        "lat--90.5",
        "lon--181",
        "lon-180.5",
        "lat-nan",
        "lon-nan",
        "lat-inf",
    ],
)
async def test_put_region_rejects_invalid(
    catalog: Catalog, store: MemoryStore, bad: Region
) -> None:
    with pytest.raises(InvalidArgument):
        await catalog.put_region(bad, allow_update=False)
    assert (await store.list(REGIONS)).items == ()


async def test_put_region_accepts_boundaries(catalog: Catalog) -> None:
    await catalog.put_region(region("north", 90.0, 180.0), allow_update=False)
    await catalog.put_region(region("south", -90.0, -180.0), allow_update=False)
    assert [r.name for r in await catalog.list_regions()] == ["north", "south"]


async def test_put_and_get_region(catalog: Catalog) -> None:
    stored = await catalog.put_region(region(), allow_update=False)
    assert stored == region()
    assert await catalog.get_region("us-east") == region()


async def test_get_missing_region(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.get_region("nowhere")


async def test_duplicate_region_already_exists(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    with pytest.raises(AlreadyExists):
        await catalog.put_region(region(lat=40.0), allow_update=False)
    assert (await catalog.get_region("us-east")).latitude == 39.0


async def test_region_update_allowed_keeps_drained(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    await catalog.set_region_drained("us-east", True)
    updated = await catalog.put_region(region(lat=40.0), allow_update=True)
    assert updated.drained is True
    stored = await catalog.get_region("us-east")
    assert stored.latitude == 40.0
    assert stored.drained is True


async def test_region_update_cannot_set_drained(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    drained = Region("us-east", 39.0, -77.0, drained=True)
    await catalog.put_region(drained, allow_update=True)
    assert (await catalog.get_region("us-east")).drained is False


async def test_allow_update_creates_missing_region(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=True)
    assert await catalog.get_region("us-east") == region()


async def test_drain_and_undrain_region(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    assert (await catalog.set_region_drained("us-east", True)).drained is True
    assert (await catalog.get_region("us-east")).drained is True
    assert (await catalog.set_region_drained("us-east", False)).drained is False
    assert (await catalog.get_region("us-east")).drained is False


async def test_drain_missing_region(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.set_region_drained("nowhere", True)


async def test_delete_region(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    await catalog.delete_region("us-east")
    assert await catalog.list_regions() == []


async def test_delete_missing_region(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.delete_region("nowhere")


async def test_delete_region_with_origins_fails(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    await catalog.put_origin(origin(), allow_update=False)
    with pytest.raises(FailedPrecondition, match="o1"):
        await catalog.delete_region("us-east")
    assert await catalog.get_region("us-east") == region()
    await catalog.delete_origin("o1")
    await catalog.delete_region("us-east")
    assert await catalog.list_regions() == []


async def test_delete_region_ignores_origins_of_other_regions(catalog: Catalog) -> None:
    await catalog.put_region(region(), allow_update=False)
    await catalog.put_region(region("eu-west", 53.0, -6.0), allow_update=False)
    await catalog.put_origin(origin(region_name="eu-west"), allow_update=False)
    await catalog.delete_region("us-east")
    assert [r.name for r in await catalog.list_regions()] == ["eu-west"]


# ---------------------------------------------------------------- origins


@pytest.fixture
async def with_region(catalog: Catalog) -> Catalog:
    await catalog.put_region(region(), allow_update=False)
    return catalog


async def test_origin_in_unknown_region(catalog: Catalog, store: MemoryStore) -> None:
    with pytest.raises(NotFound, match="region"):
        await catalog.put_origin(origin(region_name="nowhere"), allow_update=False)
    assert (await store.list(ORIGINS)).items == ()


@pytest.mark.parametrize(
    "url",
    [
        "ftp://origin.example/v1",
        "http:///v1",
        "http://",
        "origin.example/v1",
        "http://origin.example/v1?key=1",
        "http://origin.example/v1#frag",
        "http://origin.example:99999/v1",
        "http://origin.example/v1/chat/completions",
        "http://origin.example/v1/Completions/",
        "https://origin.example/openai/v1/embeddings",
        "http://origin.example/v1/responses",
        "http://reranker.example:8000/v1/rerank",
    ],
    ids=[
        "ftp",
        "no-host",
        "empty-host",
        "no-scheme",
        "query",
        "fragment",
        "bad-port",
        "chat-endpoint",
        "completions-endpoint",
        "embeddings-endpoint",
        "responses-endpoint",
        "rerank-endpoint",
    ],
)
async def test_origin_bad_url(with_region: Catalog, store: MemoryStore, url: str) -> None:
    with pytest.raises(InvalidArgument):
        await with_region.put_origin(origin(url=url), allow_update=False)
    assert (await store.list(ORIGINS)).items == ()


async def test_an_origin_url_naming_an_endpoint_says_which_base_url_to_give(
    with_region: Catalog,
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        url = "http://vllm.example:8000/v1/chat/completions"
        await with_region.put_origin(origin(url=url), allow_update=False)
    assert "names an endpoint (/chat/completions)" in str(refused.value)
    assert "'http://vllm.example:8000/v1'" in str(refused.value)


async def test_origin_url_trailing_slash_stripped(with_region: Catalog) -> None:
    stored = await with_region.put_origin(
        origin(url="https://origin.example/v1/"), allow_update=False
    )
    assert stored.base_url == "https://origin.example/v1"
    assert (await with_region.list_origins())[0].base_url == "https://origin.example/v1"


async def test_origin_weight_zero_means_default(with_region: Catalog) -> None:
    stored = await with_region.put_origin(origin(weight=0), allow_update=False)
    assert stored.weight == DEFAULT_WEIGHT == 100
    assert (await with_region.list_origins())[0].weight == 100


@pytest.mark.parametrize("weight", [1001, -1])
async def test_origin_weight_out_of_range(with_region: Catalog, weight: int) -> None:
    with pytest.raises(InvalidArgument, match="weight"):
        await with_region.put_origin(origin(weight=weight), allow_update=False)


@pytest.mark.parametrize("weight", [1, 1000])
async def test_origin_weight_bounds_accepted(with_region: Catalog, weight: int) -> None:
    assert (await with_region.put_origin(origin(weight=weight), allow_update=False)).weight == (
        weight
    )


@pytest.mark.parametrize(
    "models",
    [(), ("a", "a"), ("bad model",), ("-leading",)],
    ids=["none", "duplicate", "space", "leading-dash"],
)
async def test_origin_bad_models(with_region: Catalog, models: tuple[str, ...]) -> None:
    with pytest.raises(InvalidArgument):
        await with_region.put_origin(origin(models=models), allow_update=False)


async def test_origin_models_sorted(with_region: Catalog) -> None:
    stored = await with_region.put_origin(origin(models=("zeta", "alpha")), allow_update=False)
    assert stored.models == ("alpha", "zeta")


async def test_origin_bad_name(with_region: Catalog) -> None:
    with pytest.raises(InvalidArgument):
        await with_region.put_origin(origin(name="Origin_1"), allow_update=False)


async def test_duplicate_origin(with_region: Catalog) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    with pytest.raises(AlreadyExists):
        await with_region.put_origin(origin(weight=5), allow_update=False)
    assert (await with_region.list_origins())[0].weight == DEFAULT_WEIGHT


async def test_origin_update_keeps_drained(with_region: Catalog, store: MemoryStore) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    await with_region.set_origin_drained("o1", True)
    updated = await with_region.put_origin(origin(weight=7), allow_update=True)
    assert updated.drained is True
    kv = await store.get(ORIGINS + "o1")
    assert kv is not None
    stored = decode_origin(kv.value)
    assert stored.weight == 7
    assert stored.drained is True


async def test_an_update_of_what_was_read_is_refused_once_another_changed_it(
    with_region: Catalog,
) -> None:
    """Note 28: `origin add --update` read the origin, then wrote it whole: a
    change saved between the two (another operator's) was undone. Given what
    it read, the update is refused then, and nothing is written; a drain
    meanwhile (its own operation, kept by every update) refuses nothing."""
    read = await with_region.put_origin(origin(weight=5), allow_update=False)
    await with_region.set_origin_drained("o1", True)
    saved = await with_region.put_origin(origin(weight=6), allow_update=True, expected=read)
    assert (saved.weight, saved.drained) == (6, True)
    await with_region.put_origin(origin(weight=9), allow_update=True)  # another operator
    with pytest.raises(FailedPrecondition, match="was changed since it was read"):
        await with_region.put_origin(origin(weight=7), allow_update=True, expected=saved)
    assert (await with_region.list_origins())[0].weight == 9
    await with_region.delete_origin("o1")
    with pytest.raises(NotFound, match="was deleted since it was read"):
        await with_region.put_origin(origin(weight=7), allow_update=True, expected=saved)
    assert await with_region.list_origins() == []


async def test_an_update_compares_what_it_read_as_stored(
    with_region: Catalog, store: MemoryStore
) -> None:
    """Review of that fix (helper-188): what was read was validated before it
    was compared, so a record stored before a rule (a URL with a trailing
    slash, models out of order, an endpoint URL) never compared equal, and
    could not be updated at all."""
    raw = Origin("o1", "http://h:8000/v1/chat/completions/", "us-east", ("b", "a"), weight=0)
    await store.put(ORIGINS + "o1", encode(raw))
    [listed] = await with_region.list_origins()
    read = origin_of(_as_spec(origin_pb(listed)))  # as pontoctl reads it, and sends it back
    fixed = Origin("o1", "http://h:8000/v1", "us-east", ("a", "b"), weight=3)
    saved = await with_region.put_origin(fixed, allow_update=True, expected=read)
    assert (saved.base_url, saved.weight) == ("http://h:8000/v1", 3)


async def test_drain_and_undrain_origin(with_region: Catalog) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    assert (await with_region.set_origin_drained("o1", True)).drained is True
    assert (await with_region.list_origins())[0].drained is True
    assert (await with_region.set_origin_drained("o1", False)).drained is False
    assert (await with_region.list_origins())[0].drained is False


async def test_drain_missing_origin(with_region: Catalog) -> None:
    with pytest.raises(NotFound):
        await with_region.set_origin_drained("nothing", True)


async def test_delete_origin(with_region: Catalog) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    await with_region.delete_origin("o1")
    assert await with_region.list_origins() == []


async def test_delete_missing_origin(with_region: Catalog) -> None:
    with pytest.raises(NotFound):
        await with_region.delete_origin("nothing")


async def test_snapshot_reads_one_revision(with_region: Catalog, store: MemoryStore) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    snap = await with_region.snapshot()
    assert snap.revision == (await store.list(REGIONS)).revision
    assert [r.name for r in snap.regions] == ["us-east"]
    assert [o.name for o in snap.origins] == ["o1"]


async def test_snapshot_skips_undecodable_keys(
    with_region: Catalog, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    await store.put(ORIGINS + "broken", b"not json")
    await store.put(REGIONS + "list", b"[1, 2]")
    snap = await with_region.snapshot()
    assert [r.name for r in snap.regions] == ["us-east"]
    assert snap.origins == ()
    assert "broken" in caplog.text


@pytest.mark.parametrize("char", ["\x01", "\x00", "\x1b", "\x7f", "\x85"])
async def test_a_system_prompt_with_a_control_character_is_refused(
    catalog: Catalog, char: str
) -> None:
    """Trial 52: `tenant set acme --system-prompt $'a\\x01b'` was saved, and
    sent in every request."""
    bad = Tenant("acme", prompt=PromptPolicy(system_prompt=f"ab{char}c"))
    with pytest.raises(InvalidArgument) as refused:
        await catalog.put_tenant(bad, allow_update=False)
    assert str(refused.value) == (
        f"system prompt of tenant 'acme' holds the control character {char!a} (character 3): "
        "of the controls, only tab, newline and carriage return may be in it"
    )
    assert refused.value.field == "prompt.system_prompt"


async def test_a_system_prompt_may_have_tabs_and_lines(catalog: Catalog) -> None:
    text = "Be brief.\r\n\tUse lists.\nNo émoji ✓"
    fine = Tenant("acme", prompt=PromptPolicy(system_prompt=text))
    saved = await catalog.put_tenant(fine, allow_update=False)
    assert saved.prompt.system_prompt == text


async def test_a_tenant_stored_before_the_prompt_rule_stays_in_the_snapshot(
    catalog: Catalog, store: MemoryStore
) -> None:
    """A stored system prompt with a control character (saved before it was
    refused) keeps its tenant: dropped, the tenant would leave the route table."""
    old = Tenant("acme", prompt=PromptPolicy(system_prompt="a\x01b"))
    await store.put(TENANTS + "acme", encode(old))
    assert [t.prompt.system_prompt for t in (await catalog.snapshot()).tenants] == ["a\x01b"]


# ---------------------------------------------------------------- unavailable


async def test_store_unavailable_maps_to_unavailable(
    with_region: Catalog, store: MemoryStore
) -> None:
    await with_region.put_origin(origin(), allow_update=False)
    store.available = False
    calls: list[Callable[[], Awaitable[object]]] = [
        with_region.snapshot,
        lambda: with_region.put_region(region("eu-west", 53.0, -6.0), allow_update=False),
        lambda: with_region.get_region("us-east"),
        with_region.list_regions,
        lambda: with_region.delete_region("us-east"),
        lambda: with_region.set_region_drained("us-east", True),
        lambda: with_region.put_origin(origin("o2"), allow_update=False),
        with_region.list_origins,
        lambda: with_region.delete_origin("o1"),
        lambda: with_region.set_origin_drained("o1", True),
        lambda: with_region.register_proxy(proxy(), 0),
        lambda: with_region.remove_proxy("p1", "s1"),
        with_region.list_proxies,
    ]
    for call in calls:
        with pytest.raises(Unavailable):
            await call()
    store.available = True
    assert await with_region.get_region("us-east") == region()


async def test_validation_comes_before_store_access(catalog: Catalog, store: MemoryStore) -> None:
    store.available = False
    with pytest.raises(InvalidArgument):
        await catalog.put_region(region(lat=91.0), allow_update=False)


# ---------------------------------------------------------------- proxies


async def test_proxies_put_and_list(catalog: Catalog, store: MemoryStore) -> None:
    lease = await store.grant_lease(30)
    await catalog.register_proxy(proxy("p2", "s2"), lease)
    await catalog.register_proxy(proxy("p1", "s1"), lease)
    assert [p.name for p in await catalog.list_proxies()] == ["p1", "p2"]
    kv = await store.get(PROXIES + "p1")
    assert kv is not None and kv.lease == lease
    await store.revoke_lease(lease)
    assert await catalog.list_proxies() == []


async def test_remove_proxy_of_matching_session(catalog: Catalog) -> None:
    await catalog.register_proxy(proxy("p1", "s1"), 0)
    await catalog.remove_proxy("p1", "s1")
    assert await catalog.list_proxies() == []


async def test_remove_proxy_of_other_session_keeps_it(catalog: Catalog) -> None:
    await catalog.register_proxy(proxy("p1", "s1"), 0)
    await catalog.register_proxy(proxy("p1", "s2"), 0)  # re-registered elsewhere
    await catalog.remove_proxy("p1", "s1")
    assert [(p.name, p.session_id) for p in await catalog.list_proxies()] == [("p1", "s2")]


async def test_remove_missing_proxy_is_quiet(catalog: Catalog) -> None:
    await catalog.remove_proxy("ghost", "s1")
    assert await catalog.list_proxies() == []


async def test_list_proxies_skips_undecodable(catalog: Catalog, store: MemoryStore) -> None:
    await catalog.register_proxy(proxy(), 0)
    await store.put(PROXIES + "junk", b"{")
    assert [p.name for p in await catalog.list_proxies()] == ["p1"]


async def test_acks_come_from_the_proxys_own_replica(catalog: Catalog, store: MemoryStore) -> None:
    # Replicas number the same content by the revision each read it at: p1 on
    # cp-1 at cp-1's 40 is current though cp-2 serves version 41.
    await catalog.register_proxy(proxy("p1", "s1"), 0)
    await catalog.put_acks("cp-1", {"p1": (40, "")}, 0, version=40)
    # A summary another replica left behind (p1 was connected there before).
    await catalog.put_acks("cp-2", {"p1": (12, "old")}, 0, version=41)
    (p1,) = await catalog.list_proxies()
    assert (p1.acked_version, p1.last_error, p1.replica_version) == (40, "", 40)


async def test_acks_fall_back_to_any_summary_and_old_shapes(
    catalog: Catalog, store: MemoryStore
) -> None:
    await catalog.register_proxy(proxy("p1", "s1"), 0)  # on cp-1, which wrote nothing yet
    await store.put(ACKS + "cp-9", orjson.dumps({"p1": [7, ""]}))  # before replica_version
    (p1,) = await catalog.list_proxies()
    assert (p1.acked_version, p1.replica_version) == (7, 0)
    await store.put(ACKS + "cp-8", b"not json")
    assert [p.acked_version for p in await catalog.list_proxies()] == [7]


async def test_put_healths_writes_many_origins_in_as_few_transactions_as_etcd_takes(
    catalog: Catalog, store: MemoryStore
) -> None:
    """The loads of 300 origins are three transactions (127 and a fence
    each), three revisions a builder's debounce takes as one table, not 300;
    and none once the fence (leadership) is lost."""
    leader = await store.put("/ponto/leader", b"me")
    healths = [OriginHealth(f"o{i:03d}", healthy=True, inflight=i % 9) for i in range(300)]
    before = (await catalog.snapshot()).revision
    await catalog.put_healths(healths, fence=Fence("/ponto/leader", leader))
    state = await catalog.snapshot()
    assert state.revision == before + 3
    assert [state.health[h.origin].inflight for h in healths] == [h.inflight for h in healths]
    with pytest.raises(Conflict):
        await catalog.put_healths(healths[:1], fence=Fence("/ponto/leader", leader + 99))
    assert (await catalog.snapshot()).revision == before + 3


async def test_delete_healths_deletes_many_origins_in_as_few_transactions_as_etcd_takes(
    catalog: Catalog, store: MemoryStore
) -> None:
    """The health of 300 deleted origins goes in three transactions (at most
    127 and a fence each), as put_healths writes it; none once the fence is
    lost."""
    leader = await store.put("/ponto/leader", b"me")
    fence = Fence("/ponto/leader", leader)
    healths = [OriginHealth(f"o{i:03d}", healthy=True) for i in range(300)]
    await catalog.put_healths(healths, fence=fence)
    with pytest.raises(Conflict):
        await catalog.delete_healths(["o000"], fence=Fence("/ponto/leader", leader + 99))
    before = await catalog.snapshot()
    assert len(before.health) == 300
    await catalog.delete_healths((h.origin for h in healths[:299]), fence=fence)
    after = await catalog.snapshot()
    assert after.revision == before.revision + 3
    assert list(after.health) == ["o299"]


async def test_admin_reads_that_need_no_keys_do_not_read_them() -> None:
    """Trial 83, at 20,000 keys: `get regions` took 7 s, `get origins` 6 s,
    `get tenants` 9 s and each `key create` 6 to 12 s, every one reading
    and decoding the whole state, keys included. Each reads the prefixes it
    needs now, and answers the same."""
    store = ListingStore()
    catalog = Catalog(store)
    await catalog.put_region(region(), allow_update=False)
    await catalog.put_origin(origin(), allow_update=False)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    key = (await catalog.create_key("acme", models=["nope"])).record
    store.listed.clear()
    assert [r.name for r in await catalog.list_regions()] == ["us-east"]
    assert [o.name for o in await catalog.list_origins()] == ["o1"]
    assert [t.name for t in await catalog.list_tenants()] == ["acme"]
    assert await catalog.key_model_warnings(key) != ()
    await catalog.drain_warnings("region", "us-east", True)
    assert (await catalog.export())["tenants"] != []
    assert store.listed and not [p for p in store.listed if KEYS.startswith(p)]
    assert [k.id for k in await catalog.list_keys("acme")] == [key.id]
