"""Tenants, API keys and cache purges in the Catalog, their validation, and how
compile_table turns them into the route table proxies enforce."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import orjson
import pytest

from controlplane.catalog import KEYS, MAX_PURGES, PURGES, TENANTS, Catalog
from controlplane.compile import compile_table
from controlplane.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from controlplane.model import (
    MAX_TTL_S,
    ApiKeyRecord,
    CachePolicy,
    JwtIssuer,
    Limits,
    Origin,
    PromptPolicy,
    Purge,
    Region,
    State,
    Tenant,
    encode,
)
from controlplane.store import Fence, KeyValue
from controlplane.store.memory import MemoryStore
from dataplane.cache.regionstore import PurgeEpochs
from dataplane.policy import build_policy
from ponto.apikeys import hash_key, key_expired, parse_key_id, secret_of
from ponto.routetable import OPEN_TENANT
from ponto.v1 import routing_pb2 as pb


class Clock:
    """Wall clock for the catalog: advances one second per reading unless frozen."""

    def __init__(self, start: float = 1_000.0, step: float = 1.0) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class InterferingStore(MemoryStore):
    """Before each compare-and-swap write to `key`, first writes the next of
    `pending` (key, value): another writer winning the race."""

    def __init__(self) -> None:
        super().__init__()
        self.key = ""
        self.pending: list[tuple[str, bytes]] = []

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
        if key == self.key and if_mod_revision is not None and self.pending:
            other_key, other_value = self.pending.pop(0)
            await super().put(other_key, other_value)
        return await super().put(
            key,
            value,
            lease=lease,
            if_absent=if_absent,
            if_mod_revision=if_mod_revision,
            fence=fence,
        )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def catalog(store: MemoryStore, clock: Clock) -> Catalog:
    return Catalog(store, clock=clock)


def jwt_rs256(issuer: str = "https://idp.example", **overrides: object) -> JwtIssuer:
    return replace(
        JwtIssuer(issuer=issuer, audiences=("ponto",), jwks_file="/etc/ponto/jwks.json"),
        **overrides,  # type: ignore[arg-type]
    )


FULL = Tenant(
    name="acme",
    limits=Limits(rpm=600, tpm=100_000, concurrency=20),
    prompt=PromptPolicy(
        system_prompt="Be brief.",
        enforce_system_prompt=True,
        defaults=(("temperature", "0.2"), ("seed", "7")),
        max_tokens_ceiling=512,
        aliases=(("gpt-4o", "llama-3"), ("fast", "qwen")),
    ),
    cache=CachePolicy(mode="semantic", semantic_threshold=0.92, ttl_s=600, semantic_max_error=0.01),
    jwt=jwt_rs256(),
)


# ---------------------------------------------------------------- put_tenant


async def test_put_tenant_creates_and_reads_back_normalised(catalog: Catalog) -> None:
    stored = await catalog.put_tenant(FULL, allow_update=False)
    # Validation sorts the pairs, so equal policies compare (and hash) equal.
    assert stored.prompt.defaults == (("seed", "7"), ("temperature", "0.2"))
    assert stored.prompt.aliases == (("fast", "qwen"), ("gpt-4o", "llama-3"))
    assert await catalog.get_tenant("acme") == stored
    assert await catalog.list_tenants() == [stored]


async def test_put_tenant_defaults_empty_cache_mode_to_exact(catalog: Catalog) -> None:
    stored = await catalog.put_tenant(
        Tenant("plain", cache=CachePolicy(mode="")), allow_update=False
    )
    assert stored.cache.mode == "exact"
    assert stored.jwt is None


async def test_put_tenant_twice_needs_allow_update(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    with pytest.raises(AlreadyExists, match="acme"):
        await catalog.put_tenant(Tenant("acme", limits=Limits(rpm=1)), allow_update=False)
    assert (await catalog.get_tenant("acme")).limits == Limits()

    updated = await catalog.put_tenant(Tenant("acme", limits=Limits(rpm=1)), allow_update=True)
    assert updated.limits == Limits(rpm=1)
    assert (await catalog.get_tenant("acme")).limits == Limits(rpm=1)


async def test_put_tenant_with_allow_update_creates_a_missing_one(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("fresh"), allow_update=True)
    assert (await catalog.get_tenant("fresh")).name == "fresh"


async def test_get_and_update_missing_tenant(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.get_tenant("ghost")
    with pytest.raises(NotFound):
        await catalog.update_tenant("ghost", lambda t: t)


# ---------------------------------------------------------------- validation

INVALID: list[tuple[str, Tenant]] = [
    ("bad-name", Tenant("Acme_Corp")),
    ("negative-rpm", Tenant("acme", limits=Limits(rpm=-1))),
    ("huge-tpm", Tenant("acme", limits=Limits(tpm=10**12 + 1))),
    ("cache-mode", Tenant("acme", cache=CachePolicy(mode="fuzzy"))),
    ("threshold-low", Tenant("acme", cache=CachePolicy(semantic_threshold=0.3))),
    ("threshold-high", Tenant("acme", cache=CachePolicy(semantic_threshold=1.01))),
    ("threshold-nan", Tenant("acme", cache=CachePolicy(semantic_threshold=float("nan")))),
    ("max-error-negative", Tenant("acme", cache=CachePolicy(semantic_max_error=-0.01))),
    ("max-error-half", Tenant("acme", cache=CachePolicy(semantic_max_error=0.5))),
    ("max-error-nan", Tenant("acme", cache=CachePolicy(semantic_max_error=float("nan")))),
    ("ttl-negative", Tenant("acme", cache=CachePolicy(ttl_s=-1))),
    ("ttl-too-long", Tenant("acme", cache=CachePolicy(ttl_s=MAX_TTL_S + 1))),
    ("jwt-empty-issuer", Tenant("acme", jwt=jwt_rs256(issuer=""))),
    ("jwt-rs256-no-jwks", Tenant("acme", jwt=jwt_rs256(jwks_file=""))),
    (
        "jwt-hs256-no-secret",
        Tenant("acme", jwt=JwtIssuer("https://idp.example", algorithms=("HS256",))),
    ),
    ("jwt-unknown-alg", Tenant("acme", jwt=jwt_rs256(algorithms=("none",)))),
    ("jwt-relative-jwks", Tenant("acme", jwt=jwt_rs256(jwks_file="keys/jwks.json"))),
    (
        "jwt-relative-secret",
        Tenant(
            "acme",
            jwt=JwtIssuer("https://idp.example", algorithms=("HS256",), hs256_secret_file="hs.key"),
        ),
    ),
    (
        "jwt-bad-env",
        Tenant(
            "acme",
            jwt=JwtIssuer("https://idp.example", algorithms=("HS256",), hs256_secret_env="1-X"),
        ),
    ),
    ("jwt-leeway", Tenant("acme", jwt=jwt_rs256(leeway_s=601.0))),
    (
        "jwt-file-and-url",
        Tenant("acme", jwt=jwt_rs256(jwks_url="https://idp.example/jwks.json")),
    ),
    ("jwt-url-http", Tenant("acme", jwt=jwt_rs256(jwks_file="", jwks_url="http://idp/jwks"))),
    ("jwt-url-query", Tenant("acme", jwt=jwt_rs256(jwks_file="", jwks_url="https://i/j?k=1"))),
    ("jwt-url-userinfo", Tenant("acme", jwt=jwt_rs256(jwks_file="", jwks_url="https://u:p@i/j"))),
    ("jwt-url-scheme", Tenant("acme", jwt=jwt_rs256(jwks_file="", jwks_url="ftp://idp/jwks"))),
    ("jwt-url-space", Tenant("acme", jwt=jwt_rs256(jwks_file="", jwks_url="https://i/a b"))),
    ("jwt-lifetime-short", Tenant("acme", jwt=jwt_rs256(max_lifetime_s=10.0))),
    ("jwt-lifetime-long", Tenant("acme", jwt=jwt_rs256(max_lifetime_s=4e7))),
    ("alias-self", Tenant("acme", prompt=PromptPolicy(aliases=(("llama-3", "llama-3"),)))),
    ("alias-bad-model", Tenant("acme", prompt=PromptPolicy(aliases=(("gpt 4", "llama-3"),)))),
    ("default-messages", Tenant("acme", prompt=PromptPolicy(defaults=(("messages", "[]"),)))),
    ("default-stream", Tenant("acme", prompt=PromptPolicy(defaults=(("stream", "true"),)))),
    ("default-bad-name", Tenant("acme", prompt=PromptPolicy(defaults=(("Top-P", "1"),)))),
    ("default-not-json", Tenant("acme", prompt=PromptPolicy(defaults=(("seed", "{oops"),)))),
    ("ceiling", Tenant("acme", prompt=PromptPolicy(max_tokens_ceiling=10**7 + 1))),
    ("system-prompt", Tenant("acme", prompt=PromptPolicy(system_prompt="x" * (64 * 1024 + 1)))),
]


@pytest.mark.parametrize("bad", [t for _, t in INVALID], ids=[i for i, _ in INVALID])
async def test_put_tenant_rejects_invalid(
    catalog: Catalog, store: MemoryStore, bad: Tenant
) -> None:
    with pytest.raises(InvalidArgument):
        await catalog.put_tenant(bad, allow_update=True)
    assert (await store.list(TENANTS)).items == ()


# The proxies refuse (NACK) a table with these JWT configs (see
# dataplane.auth.authenticator._JwtVerifier.build), so the control plane must
# refuse them first: otherwise every proxy keeps its previous table and no
# later change reaches the fleet until the tenant is fixed.
PROXY_REFUSES: list[tuple[str, JwtIssuer]] = [
    (
        "hs256-file-and-env",
        JwtIssuer(
            "https://idp.example",
            algorithms=("HS256",),
            hs256_secret_file="/etc/ponto/hs.key",
            hs256_secret_env="PONTO_HS_SECRET",
        ),
    ),
    ("hs256-secret-without-hs256", jwt_rs256(hs256_secret_env="PONTO_HS_SECRET")),
    ("empty-audience", jwt_rs256(audiences=("ponto", ""))),
]


@pytest.mark.parametrize("jwt", [j for _, j in PROXY_REFUSES], ids=[i for i, _ in PROXY_REFUSES])
async def test_jwt_configs_that_proxies_refuse_are_rejected(
    catalog: Catalog, jwt: JwtIssuer
) -> None:
    with pytest.raises(InvalidArgument):
        await catalog.put_tenant(Tenant("acme", jwt=jwt), allow_update=False)


async def test_limits_beyond_the_contract_are_rejected(catalog: Catalog) -> None:
    # Limits.concurrency is a uint32 in routing.proto: a larger value makes
    # compile_table raise, and the table builder stops publishing.
    with pytest.raises(InvalidArgument):
        await catalog.put_tenant(
            Tenant("acme", limits=Limits(concurrency=2**32)), allow_update=False
        )


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
async def test_threshold_bounds_accepted(catalog: Catalog, threshold: float) -> None:
    tenant = Tenant("acme", cache=CachePolicy(semantic_threshold=threshold, ttl_s=MAX_TTL_S))
    assert (await catalog.put_tenant(tenant, allow_update=False)).cache.semantic_threshold == (
        threshold
    )


async def test_hs256_with_env_secret_accepted_and_algorithms_normalised(catalog: Catalog) -> None:
    jwt = JwtIssuer(
        "https://idp.example",
        algorithms=("RS256", "HS256", "RS256"),
        jwks_file="/etc/ponto/jwks.json",
        hs256_secret_env="PONTO_HS_SECRET",
    )
    stored = await catalog.put_tenant(Tenant("acme", jwt=jwt), allow_update=False)
    assert stored.jwt is not None
    assert stored.jwt.algorithms == ("HS256", "RS256")


# ---------------------------------------------------------------- update_tenant


@pytest.mark.parametrize(
    "url",
    [
        "https://idp.example/.well-known/jwks.json",
        "http://127.0.0.1:8080/jwks",
        "http://localhost/jwks",
        "http://[::1]:9000/jwks",
    ],
)
async def test_a_jwks_url_is_stored_and_carried_to_the_proxies(catalog: Catalog, url: str) -> None:
    """https, or http to the proxy's own machine (a sidecar identity provider)."""
    jwt = JwtIssuer("https://idp.example", jwks_url=url)
    stored = await catalog.put_tenant(Tenant("acme", jwt=jwt), allow_update=False)
    assert stored.jwt is not None and stored.jwt.jwks_url == url
    assert (await catalog.get_tenant("acme")).jwt == stored.jwt
    [carried] = compile_table(state(tenants=(stored,))).tenants
    assert (carried.jwt.jwks_url, carried.jwt.jwks_file) == (url, "")


async def test_update_tenant_applies_change_and_validates(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    updated = await catalog.update_tenant(
        "acme", lambda t: replace(t, cache=CachePolicy(mode="off"))
    )
    assert updated.cache.mode == "off"
    assert (await catalog.get_tenant("acme")).cache.mode == "off"


async def test_the_open_fleets_tenant_is_changed_from_its_built_in_policy(
    catalog: Catalog,
) -> None:
    """Requests without a key belong to tenant "default", which has the built-in
    policy until a tenant of that name is added; a change of it before then
    starts from that policy and adds the record (trial 33: NOT_FOUND until
    `tenant add default`). Any other tenant must exist."""

    def semantic(t: Tenant) -> Tenant:
        return replace(t, cache=CachePolicy(mode="semantic"))

    built_in = build_policy(compile_table(await catalog.snapshot())).default
    saved = await catalog.update_tenant("default", semantic)
    assert saved == replace(Tenant("default"), cache=CachePolicy(mode="semantic")).validated()
    assert await catalog.get_tenant("default") == saved
    policy = build_policy(compile_table(await catalog.snapshot()))
    assert policy.default.cache.mode.value == "semantic"
    assert replace(policy.default, cache=built_in.cache) == built_in  # all else built in
    with pytest.raises(NotFound) as other:
        await catalog.update_tenant("acme", semantic)
    assert str(other.value) == "tenant 'acme' not found"


@pytest.mark.parametrize(
    "change",
    [
        lambda t: replace(t, cache=CachePolicy(mode="sometimes")),
        lambda t: replace(t, cache=CachePolicy(semantic_threshold=0.2)),
        lambda t: replace(t, cache=CachePolicy(ttl_s=MAX_TTL_S + 1)),
        lambda t: replace(t, jwt=jwt_rs256(jwks_file="")),
        lambda t: replace(t, jwt=jwt_rs256(jwks_file="relative/jwks.json")),
        lambda t: replace(t, prompt=PromptPolicy(aliases=(("a", "a"),))),
        lambda t: replace(t, prompt=PromptPolicy(defaults=(("messages", "[]"),))),
        lambda t: replace(t, prompt=PromptPolicy(defaults=(("temperature", "warm"),))),
    ],
    ids=[
        "cache-mode",
        "threshold",
        "ttl",
        "jwt-without-key",
        "jwt-relative-path",
        "alias-self",
        "default-messages",
        "default-not-json",
    ],
)
async def test_update_tenant_rejects_invalid_and_keeps_stored(
    catalog: Catalog, change: Callable[[Tenant], Tenant]
) -> None:
    before = await catalog.put_tenant(FULL, allow_update=False)
    with pytest.raises(InvalidArgument):
        await catalog.update_tenant("acme", change)
    assert await catalog.get_tenant("acme") == before


async def test_update_tenant_retries_on_concurrent_change() -> None:
    store = InterferingStore()
    catalog = Catalog(store)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    # Another writer changes the limits between our read and our write.
    store.key = TENANTS + "acme"
    store.pending = [(TENANTS + "acme", encode(Tenant("acme", limits=Limits(rpm=99))))]
    seen: list[Limits] = []

    def change(t: Tenant) -> Tenant:
        seen.append(t.limits)
        return replace(t, cache=CachePolicy(mode="off"))

    updated = await catalog.update_tenant("acme", change)
    # The first attempt lost the race; the second saw the concurrent write and kept it.
    assert seen == [Limits(), Limits(rpm=99)]
    assert updated.limits == Limits(rpm=99)
    assert updated.cache.mode == "off"
    assert await catalog.get_tenant("acme") == updated


async def test_update_tenant_gives_up_when_it_keeps_changing() -> None:
    store = InterferingStore()
    catalog = Catalog(store)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    store.key = TENANTS + "acme"
    store.pending = [(TENANTS + "acme", encode(Tenant("acme")))] * 100
    with pytest.raises(Unavailable, match="kept changing"):
        await catalog.update_tenant("acme", lambda t: replace(t, limits=Limits(rpm=5)))


# ---------------------------------------------------------------- JWT issuers


async def test_jwt_issuer_unique_across_tenants_on_put(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme", jwt=jwt_rs256()), allow_update=False)
    with pytest.raises(AlreadyExists, match="acme"):
        await catalog.put_tenant(Tenant("globex", jwt=jwt_rs256()), allow_update=False)
    with pytest.raises(NotFound):
        await catalog.get_tenant("globex")
    # The owner itself may be updated with its own issuer.
    await catalog.put_tenant(Tenant("acme", jwt=jwt_rs256(leeway_s=5.0)), allow_update=True)
    # Another issuer is fine.
    await catalog.put_tenant(
        Tenant("globex", jwt=jwt_rs256(issuer="https://other.example")), allow_update=False
    )


async def test_jwt_issuer_unique_across_tenants_on_update(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme", jwt=jwt_rs256()), allow_update=False)
    await catalog.put_tenant(Tenant("globex"), allow_update=False)
    with pytest.raises(AlreadyExists, match="acme"):
        await catalog.update_tenant("globex", lambda t: replace(t, jwt=jwt_rs256()))
    # Refused means not stored: two tenants with one issuer would make every
    # proxy refuse the next table.
    assert (await catalog.get_tenant("globex")).jwt is None


# ---------------------------------------------------------------- delete_tenant


async def test_delete_tenant_refused_while_keys_are_active(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    with pytest.raises(FailedPrecondition, match=record.id):
        await catalog.delete_tenant("acme")
    assert (await catalog.get_tenant("acme")).name == "acme"

    await catalog.revoke_key(record.id)
    await catalog.delete_tenant("acme")
    with pytest.raises(NotFound):
        await catalog.get_tenant("acme")


async def test_a_deleted_tenants_answers_are_purged_with_it(
    catalog: Catalog, store: MemoryStore
) -> None:
    """Trial 46: a tenant created again under a deleted one's name (perhaps
    another customer) was answered from the first one's cache, on every tier
    (the proxies', the region's Redis, the semantic feed). The deletion now
    records a purge of the tenant, at the deletion's own revision, which the
    proxies run as `cache purge --tenant` (tests/functional, purges)."""
    await catalog.put_tenant(Tenant("gamma"), allow_update=False)
    await catalog.put_tenant(Tenant("delta"), allow_update=False)
    await catalog.delete_tenant("gamma")
    (purge,) = (await catalog.snapshot()).purges
    assert (purge.tenant, purge.model) == ("gamma", "")
    assert purge.revision == (await store.list(PURGES)).revision
    assert await store.get(TENANTS + "gamma") is None
    # Refused deletions purge nothing.
    await catalog.create_key("delta")
    with pytest.raises(FailedPrecondition):
        await catalog.delete_tenant("delta")
    with pytest.raises(NotFound):
        await catalog.delete_tenant("gamma")
    assert len((await catalog.snapshot()).purges) == 1


async def test_a_tenant_made_again_is_a_new_epoch_even_once_its_deletions_purge_is_trimmed(
    catalog: Catalog,
) -> None:
    """Review of trial 46: the deletion's purge is trimmed after MAX_PURGES
    more, and a proxy that starts then read the region's entries of the
    deleted tenant (written at an epoch below it) as the new one's. The table
    carries each tenant's birth (its record's create revision) as a purge of
    it, which no trim removes: the new tenant's epoch is above every entry the
    first one wrote."""
    await catalog.put_tenant(Tenant("gamma"), allow_update=False)
    first = compile_table(await catalog.snapshot())
    old_epoch = PurgeEpochs()
    old_epoch.update((p.revision, p.tenant, p.model) for p in first.purges)
    written_at = old_epoch.epoch("gamma", "m")  # the first tenant's entries
    await catalog.delete_tenant("gamma")
    for i in range(MAX_PURGES):
        await catalog.purge_cache(model=f"m{i}")
    await catalog.put_tenant(Tenant("gamma"), allow_update=False)
    table = compile_table(await catalog.snapshot())
    assert not any(p.tenant == "gamma" and p.model == "" for p in (await catalog.snapshot()).purges)
    fresh = PurgeEpochs()  # a proxy started now
    fresh.update((p.revision, p.tenant, p.model) for p in table.purges)
    assert fresh.epoch("gamma", "m") > written_at
    assert [p.revision for p in table.purges] == sorted(p.revision for p in table.purges)
    # Other tenants' epochs are their births', not this one's.
    assert fresh.epoch("delta", "m") < fresh.epoch("gamma", "m")
    # A birth is marked as one (pontoctl get table counts operators' purges).
    births = [p for p in table.purges if p.birth]
    assert {p.tenant for p in births} == {t.name for t in table.tenants}
    assert all(not p.model for p in births)
    assert len(births) == len(table.tenants)
    assert all(not p.birth for p in table.purges if p.model)  # the operator's purges


async def test_deletions_keep_only_the_newest_purges(catalog: Catalog, store: MemoryStore) -> None:
    for i in range(MAX_PURGES + 2):
        await catalog.put_tenant(Tenant(f"t{i}"), allow_update=False)
        await catalog.delete_tenant(f"t{i}")
    kept = (await catalog.snapshot()).purges
    assert [p.tenant for p in kept] == [f"t{i}" for i in range(2, MAX_PURGES + 2)]


async def test_an_expired_key_still_holds_its_tenant_and_is_called_expired(
    catalog: Catalog, clock: Clock
) -> None:
    """Trial 30: the refusal called an expired key active. It counts (a new
    expiry revives it), and the message says which keys are expired."""
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    live, _, _ = await catalog.create_key("acme")
    old, _, _ = await catalog.create_key("acme", expires_in=5)
    clock.now += 60
    with pytest.raises(FailedPrecondition) as refused:
        await catalog.delete_tenant("acme")
    said = str(refused.value)
    assert f"not revoked: {live.id}, {old.id} (expired);" in said or (
        f"not revoked: {old.id} (expired), {live.id};" in said
    ), said
    assert "active" not in said


async def test_delete_tenant_ignores_keys_of_other_tenants(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    await catalog.put_tenant(Tenant("globex"), allow_update=False)
    await catalog.create_key("globex")
    await catalog.delete_tenant("acme")
    with pytest.raises(NotFound):
        await catalog.delete_tenant("acme")


async def test_a_key_created_while_its_tenant_is_deleted_stops_the_deletion(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key arrives after delete_tenant looked at the keys, before it
    deleted: the deletion is refused as if the key had been there."""
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    look = catalog.read
    created: list[str] = []

    async def looked_then_a_key_came(*prefixes: str) -> State:
        state = await look(*prefixes)
        if not created:
            created.append((await catalog.create_key("acme"))[0].id)
        return state

    monkeypatch.setattr(catalog, "read", looked_then_a_key_came)
    with pytest.raises(FailedPrecondition, match=created[0] if created else "not revoked"):
        await catalog.delete_tenant("acme")
    assert (await catalog.get_tenant("acme")).name == "acme"
    assert [k.id for k in await catalog.list_keys("acme")] == created


async def test_a_key_for_a_tenant_deleted_meanwhile_is_not_kept(
    store: MemoryStore, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    read = store.get

    async def read_then_deleted(key: str) -> KeyValue | None:
        found = await read(key)
        if key == TENANTS + "acme" and found is not None:
            await store.delete(key)  # another operator's DeleteTenant won the race
        return found

    monkeypatch.setattr(store, "get", read_then_deleted)
    with pytest.raises(NotFound, match="tenant 'acme' not found"):
        await catalog.create_key("acme")
    assert (await store.list(KEYS)).items == ()


# ---------------------------------------------------------------- keys


async def test_create_key_returns_the_key_once_and_stores_only_its_hash(
    catalog: Catalog, store: MemoryStore, clock: Clock
) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, key, _ = await catalog.create_key(
        "acme", description="ci runner", limits=Limits(rpm=60)
    )
    assert parse_key_id(key) == record.id
    assert record.hash == hash_key(key)
    assert record.tenant == "acme"
    assert record.description == "ci runner"
    assert record.limits == Limits(rpm=60)
    assert record.created_at == clock.now
    assert record.revoked is False

    kv = await store.get(KEYS + record.id)
    assert kv is not None
    assert key.encode() not in kv.value
    secret = secret_of(key)
    assert secret.encode() not in kv.value
    for item in (await store.list("/ponto/")).items:
        assert secret.encode() not in item.value
    assert await catalog.list_keys() == [record]


async def test_create_key_needs_an_existing_tenant_and_valid_input(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.create_key("ghost")
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    with pytest.raises(InvalidArgument):
        await catalog.create_key("acme", description="x" * 257)
    with pytest.raises(InvalidArgument):
        await catalog.create_key("acme", limits=Limits(tpm=-5))
    assert await catalog.list_keys(include_revoked=True) == []


async def test_keys_are_unique(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    issued = [await catalog.create_key("acme") for _ in range(5)]
    assert len({created.record.id for created in issued}) == 5
    assert len({created.key for created in issued}) == 5


async def test_revoke_key_sets_revoked_at_and_is_idempotent(catalog: Catalog, clock: Clock) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    revoked = await catalog.revoke_key(record.id)
    assert revoked.revoked is True
    assert revoked.revoked_at == clock.now
    assert revoked.revoked_at > record.created_at
    when = revoked.revoked_at

    again = await catalog.revoke_key(record.id)
    assert again.revoked is True
    assert again.revoked_at == when  # the first revocation's time stays
    assert await catalog.list_keys(include_revoked=True) == [again]


async def test_revoke_and_limit_unknown_or_malformed_keys(catalog: Catalog) -> None:
    with pytest.raises(NotFound):
        await catalog.revoke_key("abcdefghij")
    with pytest.raises(NotFound):
        await catalog.set_key_limits("abcdefghij", Limits(rpm=1))
    for bad in ("", "Not-An-Id", "a/b", "x" * 33):
        with pytest.raises(InvalidArgument):
            await catalog.revoke_key(bad)
        with pytest.raises(InvalidArgument):
            await catalog.set_key_limits(bad, Limits())


async def test_set_key_limits(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme", limits=Limits(rpm=10))
    updated = await catalog.set_key_limits(record.id, Limits(tpm=5_000, concurrency=3))
    assert updated.limits == Limits(tpm=5_000, concurrency=3)
    assert updated.hash == record.hash
    assert (await catalog.list_keys())[0].limits == Limits(tpm=5_000, concurrency=3)
    with pytest.raises(InvalidArgument):
        await catalog.set_key_limits(record.id, Limits(rpm=-1))
    # A revoked key serves nothing: new limits for it are refused, not stored.
    await catalog.revoke_key(record.id)
    with pytest.raises(FailedPrecondition, match="is revoked; its limits cannot change"):
        await catalog.set_key_limits(record.id, Limits(rpm=1))
    (kept,) = await catalog.list_keys(include_revoked=True)
    assert kept.limits == Limits(tpm=5_000, concurrency=3)


async def test_keys_expire_at_a_future_time_or_never(catalog: Catalog, clock: Clock) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme", expires_at=clock.now + 3600)
    assert record.expires_at == 1_000.0 + 3600
    assert not key_expired(record.expires_at, clock.now)
    assert key_expired(record.expires_at, record.expires_at)
    assert (await catalog.list_keys())[0].expires_at == record.expires_at
    for bad in (clock.now - 1, math.nan, math.inf, 1e300):
        with pytest.raises(InvalidArgument, match="expiry"):
            await catalog.create_key("acme", expires_at=bad)
    with pytest.raises(InvalidArgument, match="in the past; revoke the key instead"):
        await catalog.set_key_expiry(record.id, clock.now - 10)
    later = await catalog.set_key_expiry(record.id, clock.now + 86400)
    assert later.expires_at > record.expires_at and later.hash == record.hash
    never = await catalog.set_key_expiry(record.id, 0)
    assert never.expires_at == 0 and not key_expired(never.expires_at, clock.now)
    assert (await catalog.list_keys())[0] == never
    with pytest.raises(NotFound):
        await catalog.set_key_expiry("abcdefghij", 0)
    # A duration runs from the control plane's clock, not the caller's.
    relative, _, _ = await catalog.create_key("acme", expires_in=60)
    assert relative.expires_at == relative.created_at + 60
    moved = await catalog.set_key_expiry(record.id, expires_in=120)
    assert moved.expires_at == clock.now + 120
    for at, within in ((clock.now + 60, 60.0), (0.0, -1.0), (0.0, math.nan)):
        with pytest.raises(InvalidArgument, match="expiry"):
            await catalog.set_key_expiry(record.id, at, within)
    await catalog.revoke_key(record.id)
    with pytest.raises(FailedPrecondition, match="revoked"):
        await catalog.set_key_expiry(record.id, clock.now + 60)


async def test_list_keys_filters(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    await catalog.put_tenant(Tenant("globex"), allow_update=False)
    a1, _, _ = await catalog.create_key("acme")
    g1, _, _ = await catalog.create_key("globex")
    a2, _, _ = await catalog.create_key("acme")
    a1 = await catalog.revoke_key(a1.id)

    assert [k.id for k in await catalog.list_keys()] == [a2.id, g1.id]
    assert [k.id for k in await catalog.list_keys(include_revoked=True)] == [a1.id, a2.id, g1.id]
    assert [k.id for k in await catalog.list_keys("acme")] == [a2.id]
    assert [k.id for k in await catalog.list_keys("acme", include_revoked=True)] == [
        a1.id,
        a2.id,
    ]
    assert await catalog.list_keys("initech", include_revoked=True) == []


# ---------------------------------------------------------------- purges


async def test_purge_cache_records_and_validates(catalog: Catalog, store: MemoryStore) -> None:
    with pytest.raises(NotFound, match="tenant 'acme' not found"):
        await catalog.purge_cache("acme")  # a misspelt tenant would purge nothing
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    purge = await catalog.purge_cache("acme", "llama-3")
    assert purge.tenant == "acme"
    assert purge.model == "llama-3"
    assert purge.revision == (await store.list(PURGES)).revision
    everything = await catalog.purge_cache()
    assert everything.revision > purge.revision
    with pytest.raises(InvalidArgument):
        await catalog.purge_cache("Bad Tenant")
    with pytest.raises(InvalidArgument):
        await catalog.purge_cache(model="no spaces allowed")
    assert [(p.tenant, p.model) for p in (await catalog.snapshot()).purges] == [
        ("acme", "llama-3"),
        ("", ""),
    ]
    # An open fleet's answers are cached as tenant "default", which has no record.
    assert (await catalog.purge_cache("default")).tenant == "default"


async def test_purge_cache_keeps_only_the_newest(catalog: Catalog, store: MemoryStore) -> None:
    made = [await catalog.purge_cache(model=f"m{i}") for i in range(MAX_PURGES + 5)]
    assert len((await store.list(PURGES)).items) == MAX_PURGES
    kept = (await catalog.snapshot()).purges
    assert [p.model for p in kept] == [p.model for p in made[5:]]
    assert [p.revision for p in kept] == [p.revision for p in made[5:]]


async def test_purge_cache_keeps_the_newest_even_with_a_clock_behind() -> None:
    # Purge keys start with the writer's wall-clock time; a replica whose clock
    # is behind the others' (or a clock stepped back) writes a smaller key.
    times = iter([2_000.0] * MAX_PURGES + [1_999.0])
    catalog = Catalog(MemoryStore(), clock=lambda: next(times))
    for i in range(MAX_PURGES):
        await catalog.purge_cache(model=f"old{i}")
    newest = await catalog.purge_cache(model="newest")
    kept = (await catalog.snapshot()).purges
    assert len(kept) == MAX_PURGES
    # The purge just acknowledged to the operator must reach the proxies.
    assert kept[-1] == newest
    assert "old0" not in [p.model for p in kept]


# ---------------------------------------------------------------- snapshot


async def test_snapshot_decodes_tenants_keys_and_purges(catalog: Catalog) -> None:
    acme = await catalog.put_tenant(FULL, allow_update=False)
    plain = await catalog.put_tenant(Tenant("plain"), allow_update=False)
    record, _, _ = await catalog.create_key("acme", limits=Limits(rpm=7))
    revoked, _, _ = await catalog.create_key("plain")
    revoked = await catalog.revoke_key(revoked.id)
    purge = await catalog.purge_cache("acme")

    state = await catalog.snapshot()
    assert sorted(state.tenants, key=lambda t: t.name) == [acme, plain]
    assert sorted(state.keys, key=lambda k: k.id) == sorted([record, revoked], key=lambda k: k.id)
    assert state.purges == (purge,)
    assert state.revision >= purge.revision


async def test_snapshot_ignores_unknown_fields_and_skips_broken_values(
    catalog: Catalog, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    newer = {"name": "acme", "limits": {"rpm": 5, "burst": 9}, "future_field": True}
    await store.put(TENANTS + "acme", orjson.dumps(newer))
    await store.put(TENANTS + "broken", b"[]")
    await store.put(KEYS + "abcdefghij", b'{"id": "abcdefghij"}')  # no hash: broken
    state = await catalog.snapshot()
    assert state.tenants == (Tenant("acme", limits=Limits(rpm=5)),)
    assert state.keys == ()
    assert "broken" in caplog.text
    assert "abcdefghij" in caplog.text


async def test_a_hand_edited_value_out_of_range_does_not_break_compile(
    catalog: Catalog, store: MemoryStore
) -> None:
    # Values are JSON so operators can read (and edit) them with etcdctl. One
    # that does not fit the contract must not stop every table from compiling:
    # the table builder only survives Unavailable.
    await catalog.put_tenant(Tenant("good"), allow_update=False)
    await store.put(TENANTS + "acme", b'{"name": "acme", "limits": {"concurrency": -1}}')
    table = compile_table(await catalog.snapshot())
    assert "good" in [t.name for t in table.tenants]


# ---------------------------------------------------------------- compile


US = Region("us-east", 39.0, -77.0)
KEY_A = ApiKeyRecord("aaaaaaaaaa", "a" * 64, "acme", limits=Limits(rpm=30))
KEY_B = ApiKeyRecord("bbbbbbbbbb", "b" * 64, "acme")


def state(
    tenants: tuple[Tenant, ...] = (),
    keys: tuple[ApiKeyRecord, ...] = (),
    purges: tuple[Purge, ...] = (),
    origins: tuple[Origin, ...] = (),
) -> State:
    return State(10, (US,), origins, {}, tenants, keys, purges)


def test_compile_carries_tenants_keys_and_purges() -> None:
    acme = FULL.validated()
    table = compile_table(
        state(
            tenants=(Tenant("zeta"), acme),
            keys=(KEY_B, KEY_A),
            purges=(Purge(5, "acme", ""), Purge(8, "", "llama-3")),
        )
    )
    assert [t.name for t in table.tenants] == ["acme", "zeta"]
    t = table.tenants[0]
    assert (t.limits.rpm, t.limits.tpm, t.limits.concurrency) == (600, 100_000, 20)
    assert t.prompt.system_prompt == "Be brief."
    assert t.prompt.enforce_system_prompt is True
    assert dict(t.prompt.defaults) == {"seed": "7", "temperature": "0.2"}
    assert dict(t.prompt.aliases) == {"fast": "qwen", "gpt-4o": "llama-3"}
    assert t.prompt.max_tokens_ceiling == 512
    assert (t.cache.mode, t.cache.ttl_s) == ("semantic", 600)
    assert t.cache.semantic_threshold == pytest.approx(0.92)
    assert t.cache.semantic_max_error == pytest.approx(0.01)
    assert t.HasField("jwt")
    assert (t.jwt.issuer, list(t.jwt.audiences), list(t.jwt.algorithms), t.jwt.jwks_file) == (
        "https://idp.example",
        ["ponto"],
        ["RS256"],
        "/etc/ponto/jwks.json",
    )
    assert not table.tenants[1].HasField("jwt")

    assert [(k.id, k.hash, k.tenant) for k in table.keys] == [
        ("aaaaaaaaaa", "a" * 64, "acme"),
        ("bbbbbbbbbb", "b" * 64, "acme"),
    ]
    assert table.keys[0].limits.rpm == 30
    assert [(p.revision, p.tenant, p.model) for p in table.purges] == [
        (5, "acme", ""),
        (8, "", "llama-3"),
    ]
    assert table.auth_required is True


def test_compile_leaves_out_revoked_keys_and_keys_of_deleted_tenants() -> None:
    revoked = replace(KEY_B, revoked=True, revoked_at=5.0)
    orphan = ApiKeyRecord("cccccccccc", "c" * 64, "deleted")
    table = compile_table(state(tenants=(Tenant("acme"),), keys=(KEY_A, revoked, orphan)))
    assert [k.id for k in table.keys] == ["aaaaaaaaaa"]


def test_compile_keeps_expiring_keys_with_their_expiry_for_the_proxies() -> None:
    # Proxies refuse a key from its expiry on; the table does not change then.
    expiring = replace(KEY_B, expires_at=2_000_000_000.0)
    table = compile_table(state(tenants=(Tenant("acme"),), keys=(KEY_A, expiring)))
    assert [(k.id, k.expires_at) for k in table.keys] == [
        ("aaaaaaaaaa", 0.0),
        ("bbbbbbbbbb", 2_000_000_000.0),
    ]
    policy = build_policy(table)
    assert policy.authenticator._expiry == {"bbbbbbbbbb": 2_000_000_000.0}


@pytest.mark.parametrize(
    ("tenants", "keys", "required"),
    [
        ((), (), False),
        ((Tenant("acme"),), (), False),
        ((Tenant("acme"),), (KEY_A,), True),
        ((Tenant("acme"),), (replace(KEY_A, revoked=True),), True),
        ((Tenant("acme", jwt=jwt_rs256()),), (), True),
    ],
    ids=["empty", "tenant-only", "active-key", "only-revoked-key", "jwt-issuer"],
)
def test_compile_auth_required(
    tenants: tuple[Tenant, ...], keys: tuple[ApiKeyRecord, ...], required: bool
) -> None:
    assert compile_table(state(tenants=tenants, keys=keys)).auth_required is required


def test_compile_copies_origin_credential_locations() -> None:
    origins = (
        Origin("o1", "http://o1.example/v1", "us-east", ("llama-3",), credential_env="O1_KEY"),
        Origin("o2", "http://o2.example/v1", "us-east", ("qwen",), credential_file="/run/o2"),
    )
    table = compile_table(state(origins=origins))
    assert [(o.credential_env, o.credential_file) for o in table.origins] == [
        ("O1_KEY", ""),
        ("", "/run/o2"),
    ]


async def test_etag_changes_when_a_key_is_revoked(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    record, _, _ = await catalog.create_key("acme")
    before = compile_table(await catalog.snapshot())
    assert [k.id for k in before.keys] == [record.id]

    await catalog.revoke_key(record.id)
    after = compile_table(await catalog.snapshot())
    assert after.keys == []
    assert after.auth_required is True  # revoking the last key keeps proxies closed
    assert after.etag != before.etag


async def test_etag_stable_when_only_revision_moves(catalog: Catalog) -> None:
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    first = compile_table(await catalog.snapshot())
    await catalog.put_tenant(Tenant("acme"), allow_update=True)  # same content
    second = compile_table(await catalog.snapshot())
    assert second.version > first.version
    assert second.etag == first.etag


def test_compiled_table_round_trips_through_the_wire() -> None:
    table = compile_table(state(tenants=(FULL.validated(),), keys=(KEY_A,)))
    again = pb.RouteTable.FromString(table.SerializeToString())
    assert again == table


async def test_a_tenant_replaced_while_a_key_is_created_is_replaced(
    store: MemoryStore, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """create_key rewrites its tenant's record (unchanged): a PutTenant
    --update read before that is not refused as 'changed concurrently', since
    nothing of the tenant changed; it reads again and writes."""
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    read = store.get
    created: list[str] = []

    async def read_then_a_key_came(key: str) -> KeyValue | None:
        found = await read(key)
        if key == TENANTS + "acme" and not created:
            monkeypatch.setattr(store, "get", read)
            created.append((await catalog.create_key("acme"))[0].id)
        return found

    monkeypatch.setattr(store, "get", read_then_a_key_came)
    wanted = Tenant("acme", limits=Limits(rpm=900))
    assert await catalog.put_tenant(wanted, allow_update=True) == wanted
    assert (await catalog.get_tenant("acme")).limits.rpm == 900
    assert [k.id for k in await catalog.list_keys("acme")] == created


async def test_the_built_in_tenants_first_record_is_no_birth(catalog: Catalog) -> None:
    """Trial 61: `pontoctl tenant set default ...` gave the built-in tenant
    a record, and its birth purged every answer an open fleet had cached (in
    each proxy and the regions' Redis). Requests without a key were its own
    before: its record starts no new epoch. Other tenants' still do."""
    await catalog.put_tenant(Tenant(OPEN_TENANT), allow_update=True)
    await catalog.put_tenant(Tenant("acme"), allow_update=False)
    table = compile_table(await catalog.snapshot())
    assert {t.name for t in table.tenants} == {OPEN_TENANT, "acme"}
    assert [p.tenant for p in table.purges if p.birth] == ["acme"]
