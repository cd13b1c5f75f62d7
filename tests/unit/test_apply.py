"""The topology document: parsing with every error's path, writing, planning, and
Catalog.apply's all-or-nothing write over MemoryStore."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest
import yaml

from controlplane.apply import (
    MAX_SHOWN,
    ApplyError,
    Change,
    Current,
    FieldChange,
    change_text,
    document,
    parse,
    plan,
)
from controlplane.catalog import HEALTH, Catalog
from controlplane.errors import InvalidArgument
from controlplane.model import (
    ApiKeyRecord,
    JwtIssuer,
    Limits,
    Origin,
    OriginHealth,
    PromptPolicy,
    Region,
    Tenant,
)
from controlplane.store import Listing
from controlplane.store.memory import MemoryStore

FULL = """
regions:
  - {name: us-east, lat: 38.9, lon: -77.4, rtt_ms: {eu-west: 75}, spill_threshold: 0.8}
  - {name: eu-west, lat: 53.3, lon: -6.3, drained: true}
origins:
  - {name: vllm-use1, region: us-east, url: "http://vllm:8000/v1/", models: [b, a],
     weight: 100, capacity: 64, credential_env: ORIGIN_USE1_KEY}
  - {name: hosted, region: eu-west, url: "https://api.example/v1", models: [a],
     continuation: false, credential_file: /etc/key}
tenants:
  - name: acme
    limits: {rpm: 600, tpm: 100000, concurrency: 20}
    cache: {mode: semantic, ttl_s: 3600, semantic_threshold: 0.9, store_truncated: true,
            semantic_max_error: 0.01}
    prompt: {system_prompt: "Be brief.", max_tokens: 1024, aliases: {gpt-4o: a},
             defaults: {temperature: 0, stop: ["x"], response_format: {type: json_object}}}
    jwt: {issuer: "https://id.acme.example", audiences: [ponto], algorithms: [RS256],
          jwks_file: /etc/ponto/acme-jwks.json}
    routing: {mode: affinity, models: {a: least-loaded}, user_sessions: true, load_bound: 1.25}
    streams: {continuation: false, max_continuations: 2, stream_idle_timeout_s: 30,
              hedge_ms: auto, hedge_models: {a: 500, b: auto}}
  - name: plain
"""


def full() -> Any:
    return yaml.safe_load(FULL)


def errors_of(doc: Any) -> list[str]:
    with pytest.raises(ApplyError) as raised:
        parse(doc)
    return list(raised.value.errors)


# ---------------------------------------------------------------- parse


def test_a_full_document_parses_into_normalised_values() -> None:
    t = parse(full())
    use1 = next(o for o in t.origins if o.name == "vllm-use1")
    assert use1.base_url == "http://vllm:8000/v1"
    assert use1.models == ("a", "b")
    hosted = next(o for o in t.origins if o.name == "hosted")
    assert hosted.continuation is False
    acme = t.tenants[0]
    assert acme.streams.hedge_auto and acme.streams.hedge_models == (("a", "500"), ("b", "auto"))
    assert dict(acme.prompt.defaults)["stop"] == '["x"]'
    assert (acme.cache.semantic_threshold, acme.cache.semantic_max_error) == (0.9, 0.01)
    assert t.drain_unset == {("region", "us-east"), ("origin", "vllm-use1"), ("origin", "hosted")}
    assert t.paths[("origin", "hosted")] == "origins[1]"


def test_every_error_is_reported_with_its_path() -> None:
    doc = {
        "regions": [
            {"name": "ok", "lat": 1, "lon": 1},
            {"name": "north", "lat": 200, "lon": 0},
            {"name": "x", "lat": True, "lon": 0, "colour": "red"},
        ],
        "origins": [{"name": "o", "region": "ok", "url": "ftp://h/v1", "models": ["m"]}],
        "tenants": [
            {"name": "t", "cache": {"ttl_s": -1}, "limits": {"rpm": "60"}},
            {"name": "u", "streams": {"hedge_ms": "soon"}, "routing": {"mode": "random"}},
        ],
    }
    errors = errors_of(doc)
    assert errors == [
        "regions[1].lat: latitude 200.0 of region 'north' is out of range [-90, 90]",
        "regions[2]: unknown field(s) colour; allowed: name, lat, lon, rtt_ms, spill_threshold, "
        "drained",
        "regions[2].lat: expected a number, got a boolean",
        "origins[0].url: base URL 'ftp://h/v1' is invalid: expected http(s)://host[:port]/path",
        "tenants[0].limits.rpm: expected an integer, got '60'",
        # A tenant's values are checked beside its type errors (trial 30: a
        # bad rpm was told only once a bad tpm's type was fixed), each in the
        # model's words; a field of the wrong type is not checked again.
        "tenants[0].cache.ttl_s: cache TTL -1 s of tenant 't' is not in 0..2592000",
        "tenants[1].streams.hedge_ms: expected milliseconds or auto, got 'soon'",
        "tenants[1].routing.mode: routing mode 'random' of tenant 'u' is not one of affinity, "
        "least-loaded, weighted",
    ]
    same_block = errors_of({"tenants": [{"name": "t", "limits": {"rpm": -1, "tpm": 1.5}}]})
    assert same_block == [
        "tenants[0].limits.tpm: expected an integer, got 1.5",
        "tenants[0].limits.rpm: rpm -1 of tenant 't' is not in 0..10^12",
    ]


def test_a_yaml_boolean_where_a_string_belongs_says_to_quote_it() -> None:
    """Trial 52: `cache: {mode: off}` is the boolean false in YAML 1.1, and
    was told only "expected a string, got a boolean"."""
    text = "tenants:\n- name: t\n  cache: {mode: off}\n  models: [yes]\n"
    assert errors_of(yaml.safe_load(text)) == [
        "tenants[0].cache.mode: expected a string, got the boolean false (YAML reads an "
        "unquoted off, no or false as one: quote it, 'off')",
        "tenants[0].models[0]: expected a string, got the boolean true (YAML reads an "
        "unquoted on, yes or true as one: quote it, 'on')",
    ]


def test_each_block_of_a_tenant_reports_its_own_value_error_in_one_pass() -> None:
    """A bad limit hid a bad cache TTL until the limit was fixed and the
    document applied again."""
    doc = {
        "tenants": [
            {
                "name": "t",
                "limits": {"rpm": -1},
                "cache": {"ttl_s": -1},
                "routing": {"load_bound": 101},
                "streams": {"hedge_ms": 99999999},
            },
            {"name": "u", "limits": {"rpm": 10}, "cache": {"ttl_s": 60}},
        ],
    }
    assert errors_of(doc) == [
        "tenants[0].limits.rpm: rpm -1 of tenant 't' is not in 0..10^12",
        "tenants[0].cache.ttl_s: cache TTL -1 s of tenant 't' is not in 0..2592000",
        "tenants[0].routing.load_bound: load bound 101 of tenant 't' is not in 1..100",
        "tenants[0].streams.hedge_ms: hedge delay '99999999' of tenant 't' is not auto or "
        "0..600000 ms",
    ]
    # A bad name is the tenant's one error: its blocks' messages would name it.
    assert errors_of({"tenants": [{"name": "T!", "limits": {"rpm": -1}}]}) == [
        errors_of({"tenants": [{"name": "T!"}]})[0]
    ]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tenants": [{"name": "t", "limits": {"rpm": -1}}]},
         "tenants[0].limits.rpm: rpm -1 of tenant 't' is not in 0..10^12"),
        ({"tenants": [{"name": "t", "limits": {"concurrency": -1}}]},
         "tenants[0].limits.concurrency: concurrency -1 of tenant 't' is not in 0..4294967295"),
        ({"tenants": [{"name": "t", "routing": {"models": {"m": "random"}}}]},
         "tenants[0].routing.models.m: routing mode 'random'"),
        ({"tenants": [{"name": "t", "streams": {"hedge_models": {"m": 99999999}}}]},
         "tenants[0].streams.hedge_models.m: hedge delay '99999999'"),
        ({"tenants": [{"name": "t", "prompt": {"aliases": {"a": "a"}}}]},
         "tenants[0].prompt.aliases.a: tenant 't': alias 'a' maps to itself"),
        ({"regions": [{"name": "r", "lat": 0, "lon": 0, "rtt_ms": {"B": 1}}]},
         "regions[0].rtt_ms.B: region name 'B' is invalid"),
        ({"origins": [{"name": "o", "region": "r", "url": "http://h", "models": ["m"],
                       "weight": 10**9}]},
         "origins[0].weight: weight 1000000000 of origin 'o' is not in"),
    ],
)  # fmt: skip
def test_a_value_the_model_refuses_is_reported_at_its_field(doc: Any, message: str) -> None:
    (error,) = errors_of(doc)
    assert error.startswith(message)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"regions": {"name": "x"}}, "regions: expected a list, got a mapping"),
        ({"region": []}, "document: unknown field(s) region"),
        ([1], "document: expected a mapping, got a list"),
        ({"regions": ["x"]}, "regions[0]: expected a mapping, got 'x'"),
        ({"origins": [{"name": "o", "region": "r", "url": "http://h"}]},
         "origins[0].models: required"),
        ({"regions": [{"name": "a", "lat": 1, "lon": 1}] * 2}, "region 'a' is listed twice"),
        ({"regions": [{"name": "a", "lat": 1, "lon": 1, "rtt_ms": {"b": "far"}}]},
         "regions[0].rtt_ms.b: expected a number"),
        ({"origins": [{"name": "o", "region": "r", "url": "http://h", "models": ["m"],
                       "capacity": -1}]}, "capacity -1 of origin 'o' is not in 0..1000000"),
        ({"origins": [{"name": "o", "region": "r", "url": "http://h", "models": ["m"],
                       "weight": 5000}]}, "weight 5000 of origin 'o' is not in 1..1000"),
        # Trial 66: llama.cpp names its model by its file's path; the rule and the way out.
        ({"origins": [{"name": "o", "region": "r", "url": "http://h",
                       "models": ["/models/q.gguf"]}]},
         "model name '/models/q.gguf' of origin 'o' is invalid: use 1-255 letters, digits and "
         ". _ : / @ + -, starting with a letter or digit (a file path, as llama.cpp's server "
         "names its model by default: start it with --alias NAME and list that name)"),
        # Trial 19: a written 0 was saved as the default, 100.
        ({"origins": [{"name": "o", "region": "r", "url": "http://h", "models": ["m"],
                       "weight": 0}]}, "origins[0].weight: 0 is not in 1..1000 (leave it out"),
        ({"regions": [{"name": "a", "lat": 1, "lon": 181}]}, "longitude 181.0"),
        ({"tenants": [{"name": "t", "limits": {"concurrency": 2**33}}]}, "concurrency 8589934592"),
        ({"tenants": [{"name": "t", "routing": {"models": {"": "affinity"}}}]},
         "names no model or mode"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"model": "x"}}}]},
         "'model' cannot have a default"),
        ({"tenants": [{"name": "T"}]}, "tenant name 'T' is invalid"),
        # A default the proxy's request checks would refuse reaches no origin.
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"temperature": "hot"}}}]},
         "default of 'temperature': Invalid type for 'temperature'"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"n": 0}}}]}, "default of 'n'"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"stop": 5}}}]}, "default of 'stop'"),
        # Its tokens would be charged nowhere (trial 80).
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"background": True}}}]},
         "default of 'background': Invalid value for 'background'"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"seed": 2**70}}}]},
         "tenants[0].prompt.defaults.seed: not a JSON value"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"stop": [float("nan")]}}}]},
         "tenants[0].prompt.defaults.stop: not a JSON value"),
        ({"regions": [{"name": "a", "lat": 2**2000, "lon": 1}]}, "regions[0].lat: 1"),
        ({"tenants": [{"name": "t", "prompt": {"defaults": {"stop": orjson.loads(
            "[" * 300 + "]" * 300)}}}]}, "tenants[0].prompt.defaults.stop: not a JSON value"),
    ],
)  # fmt: skip
def test_bad_documents_are_refused(doc: Any, message: str) -> None:
    assert any(message in e for e in errors_of(doc)), errors_of(doc)


# ---------------------------------------------------------------- document


def test_document_reads_back_to_the_same_values() -> None:
    t = parse(full())
    again = parse(document(t.regions, t.origins, t.tenants))
    assert sorted(again.regions, key=lambda r: r.name) == sorted(t.regions, key=lambda r: r.name)
    assert sorted(again.origins, key=lambda o: o.name) == sorted(t.origins, key=lambda o: o.name)
    assert again.tenants == t.tenants


def test_a_jwks_url_reads_back_and_is_refused_at_its_field() -> None:
    jwt = {"issuer": "https://id.acme.example", "jwks_url": "https://id.acme.example/jwks"}
    t = parse({"tenants": [{"name": "acme", "jwt": jwt}]})
    [tenant] = t.tenants
    assert tenant.jwt is not None and tenant.jwt.jwks_url == "https://id.acme.example/jwks"
    [written] = document((), (), t.tenants)["tenants"]
    assert written["jwt"]["jwks_url"] == "https://id.acme.example/jwks"
    assert "jwks_file" not in written["jwt"]
    assert parse(document((), (), t.tenants)).tenants == t.tenants
    plain = {"tenants": [{"name": "acme", "jwt": {**jwt, "jwks_url": "http://idp.example/j"}}]}
    assert errors_of(plain) == [
        "tenants[0].jwt.jwks_url: tenant 'acme': JWKS URL 'http://idp.example/j' must be "
        "https: over http anyone on the path could replace the keys and sign tokens (http "
        "is taken for a loopback host only)"
    ]


def test_document_uses_the_file_names_and_plain_numbers() -> None:
    doc = document(
        [Region("r", 1.5, 2.0)],
        [Origin("o", "http://h/v1", "r", ("m",), 100, capacity=8)],
        [Tenant("t")],
    )
    assert doc == {
        "regions": [{"name": "r", "lat": 1.5, "lon": 2.0}],
        "origins": [
            {"name": "o", "region": "r", "url": "http://h/v1", "models": ["m"], "weight": 100,
             "capacity": 8}
        ],
        "tenants": [{"name": "t", "cache": {"mode": "exact"}}],
    }  # fmt: skip


# ---------------------------------------------------------------- plan


def current_of(t: Any, **extra: Any) -> Current:
    return Current(
        {r.name: r for r in t.regions},
        {o.name: o for o in t.origins},
        {x.name: x for x in t.tenants},
        **extra,
    )


def test_plan_reports_each_change_and_nothing_for_the_same_state() -> None:
    t = parse(full())
    created = plan(t, Current(), prune=False)
    assert [(c.kind, c.name, c.action) for c in created.changes] == [
        ("region", "us-east", "created"),
        ("region", "eu-west", "created"),
        ("origin", "vllm-use1", "created"),
        ("origin", "hosted", "created"),
        ("tenant", "acme", "created"),
        ("tenant", "plain", "created"),
    ]
    same = plan(t, current_of(t), prune=True)
    assert {c.action for c in same.changes} == {"unchanged"} and not same.writes()
    doc = full()
    doc["origins"][0]["capacity"] = 32
    doc["tenants"][0]["limits"]["rpm"] = 900
    del doc["regions"][1]["drained"]  # left out: the control plane's drain state stays
    changed = plan(parse(doc), current_of(t), prune=False)
    assert [(c.name, c.fields) for c in changed.writes()] == [
        ("vllm-use1", ("capacity",)),
        ("acme", ("limits",)),
    ]


def test_an_origin_url_not_ending_with_v1_is_a_warning_of_the_plan() -> None:
    assert [w for w in plan(parse(full()), Current(), prune=False).warnings if "/v1" in w] == []
    doc = full()
    doc["origins"][1]["url"] = "https://api.example"
    warnings = plan(parse(doc), Current(), prune=False).warnings
    assert [w for w in warnings if "/v1" in w] == [
        "origin 'hosted': base URL 'https://api.example' does not end with /v1; requests go "
        "to 'https://api.example/chat/completions' and the like, where OpenAI-compatible "
        "servers serve /v1/chat/completions"
    ]


def test_an_update_says_each_value_old_to_new_and_a_dropped_block_removed() -> None:
    before = parse({"tenants": [{"name": "globex", "limits": {"rpm": 120, "tpm": 50000}}]})
    # `pontoctl limit set` stored a concurrency the file never had.
    limited = replace(before.tenants[0], limits=Limits(rpm=120, tpm=50000, concurrency=5))
    have = Current(tenants={"globex": limited})
    dropped = plan(parse({"tenants": [{"name": "globex"}]}), have, prune=False)
    (change,) = dropped.writes()
    assert change.changes == (FieldChange("limits", '{"rpm":120,"tpm":50000,"concurrency":5}', ""),)
    assert change_text((f.path, f.before, f.after) for f in change.changes) == (
        'limits {"rpm":120,"tpm":50000,"concurrency":5} -> removed'
    )
    doc = {
        "tenants": [
            {"name": "globex", "limits": {"rpm": 600, "concurrency": 5}, "cache": {"ttl_s": 60}}
        ]
    }
    (edited,) = plan(parse(doc), have, prune=False).writes()
    assert change_text((f.path, f.before, f.after) for f in edited.changes) == (
        "limits.rpm 120 -> 600; limits.tpm 50000 -> removed; cache.ttl_s unset -> 60"
    )
    assert edited.fields == ("limits", "cache")
    # A long value is cut: a plan of many objects stays one bounded answer.
    prompt = {"tenants": [{"name": "globex", "prompt": {"system_prompt": "x" * 5000}}]}
    (long,) = plan(parse(prompt), have, prune=False).writes()
    shown = {f.path: f for f in long.changes}["prompt"]
    assert len(shown.after) == MAX_SHOWN and shown.after.endswith("…")


def test_plan_checks_references_and_prune_across_the_whole_result() -> None:
    lone_origin = {"name": "o", "region": "gone", "url": "http://h/v1", "models": ["m"]}
    lone = parse({"origins": [lone_origin]})
    with pytest.raises(ApplyError) as raised:
        plan(lone, Current(), prune=False)
    assert raised.value.errors == (
        "origins[0].region: region 'gone' does not exist; list it under regions",
    )
    # A region only the control plane has is relied on, not written.
    have = Current(regions={"gone": Region("gone", 0, 0)})
    relied = plan(lone, have, prune=False)
    assert relied.relies_on == ("gone",)
    # --prune deletes from the kinds the document lists: none of regions here.
    pruned = plan(lone, have, prune=True)
    assert pruned.relies_on == ("gone",)
    assert pruned.warnings == (
        "the document has no regions list (or an empty `regions:`): --prune left the 1 "
        "region(s) the control plane has alone (`regions: []` deletes them)",
    )
    with pytest.raises(ApplyError, match="region 'gone' is deleted by --prune"):
        plan(parse({"regions": [], "origins": [lone_origin]}), have, prune=True)
    far = parse({"regions": [{"name": "a", "lat": 0, "lon": 0, "rtt_ms": {"b": 5, "gone": 9}}]})
    with pytest.raises(ApplyError) as raised:
        plan(far, have, prune=True)
    assert raised.value.errors == (
        "regions[0].rtt_ms.b: region 'b' does not exist; list it under regions",
        "regions[0].rtt_ms.gone: region 'gone' is deleted by --prune; list it under regions",
    )
    keyed = Current(tenants={"old": Tenant("old")}, active_keys={"old": ["k1"]})
    with pytest.raises(
        ApplyError, match=r"tenant 'old' .* still has keys that are not revoked: k1"
    ):
        plan(parse({"tenants": []}), keyed, prune=True)
    jwt = JwtIssuer("https://id", algorithms=("HS256",), hs256_secret_env="S")
    other = Current(tenants={"a": Tenant("a", jwt=jwt)})
    dup = parse({"tenants": [{"name": "b", "jwt": {"issuer": "https://id",
                 "algorithms": ["HS256"], "hs256_secret_env": "S"}}]})  # fmt: skip
    with pytest.raises(ApplyError, match=r"tenants\[0\].jwt.issuer: 'https://id' already belongs"):
        plan(dup, other, prune=False)
    assert plan(dup, other, prune=True).writes() == (
        Change("tenant", "b", "created", (), dup.tenants[0]),
        Change("tenant", "a", "deleted"),
    )


# ---------------------------------------------------------------- Catalog.apply


async def test_catalog_apply_writes_everything_at_one_revision() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    changes = (await catalog.apply(full(), prune=False, dry_run=False)).changes
    assert {c.action for c in changes} == {"created"}
    listing = await store.list("/ponto/state/")
    assert len({kv.mod_revision for kv in listing.items}) == 1
    state = await catalog.snapshot()
    assert {r.name: r.drained for r in state.regions} == {"us-east": False, "eu-west": True}
    again = await catalog.apply(await catalog.export(), prune=True, dry_run=False)
    assert {c.action for c in again.changes} == {"unchanged"}
    assert (await store.list("/ponto/state/")).revision == listing.revision


async def test_a_prune_past_one_transaction_is_refused_in_a_dry_run_too() -> None:
    """Review of trial 46's fix: each deleted tenant also writes its cache
    purge, so 64 deletions pass the 128 writes of a transaction. The dry run
    said it would work, and the refusal counted only the objects."""
    catalog = Catalog(MemoryStore())
    for i in range(70):
        await catalog.put_tenant(Tenant(f"t{i}"), allow_update=False)
    for dry_run in (True, False):
        with pytest.raises(InvalidArgument, match=r"changes 70 objects \(70 more writes:"):
            await catalog.apply({"tenants": []}, prune=True, dry_run=dry_run)
    assert len((await catalog.snapshot()).tenants) == 70
    # Half as many fit.
    plan = await catalog.apply({"tenants": [{"name": f"t{i}"} for i in range(35)]},
                               prune=True, dry_run=False)  # fmt: skip
    assert sum(c.action == "deleted" for c in plan.changes) == 35


async def test_catalog_apply_writes_nothing_when_any_part_is_invalid() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    bad = {
        "regions": [{"name": "good", "lat": 1, "lon": 1}, {"name": "bad", "lat": 200, "lon": 1}],
        "origins": [{"name": "o", "region": "nowhere", "url": "http://h", "models": ["m"]}],
    }
    for dry_run in (True, False):
        with pytest.raises(InvalidArgument) as raised:
            await catalog.apply(bad, prune=False, dry_run=dry_run)
        assert "latitude 200.0" in str(raised.value)
    assert (await store.list("/ponto/")).items == ()
    # References are checked after the values: the same file with a good latitude.
    bad["regions"][1]["lat"] = 2  # type: ignore[index]
    with pytest.raises(InvalidArgument, match="region 'nowhere' does not exist"):
        await catalog.apply(bad, prune=False, dry_run=True)
    assert (await store.list("/ponto/")).items == ()


async def test_catalog_apply_prunes_an_origin_with_its_health_and_keeps_revoked_keys() -> None:
    store = MemoryStore()
    catalog = Catalog(store, clock=lambda: 1000.0)
    await catalog.apply(full(), prune=False, dry_run=False)
    await catalog.put_health(OriginHealth("hosted", healthy=False, detail="down"))
    record, _, _ = await catalog.create_key("plain")
    await catalog.revoke_key(record.id)
    smaller = full()
    smaller["origins"] = smaller["origins"][:1]
    smaller["regions"] = smaller["regions"][:1]
    smaller["regions"][0]["rtt_ms"] = {}  # it named eu-west, which goes
    smaller["tenants"] = smaller["tenants"][:1]
    changes = (await catalog.apply(smaller, prune=True, dry_run=False)).changes
    assert [(c.kind, c.name) for c in changes if c.action == "deleted"] == [
        ("tenant", "plain"),
        ("origin", "hosted"),
        ("region", "eu-west"),
    ]
    assert await store.get(HEALTH + "hosted") is None
    keys: list[ApiKeyRecord] = await catalog.list_keys(include_revoked=True)
    assert [k.id for k in keys] == [record.id]
    # Trial 46: its answers go with it, in the same transaction (a tenant
    # created again under the name was answered from them).
    (purge,) = (await catalog.snapshot()).purges
    assert (purge.tenant, purge.model) == ("plain", "")
    assert purge.revision == (await store.list("/ponto/state/")).revision


async def test_prune_refuses_a_tenant_whose_key_was_created_while_it_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key created between Apply's read and its write: the write fails on the
    tenant's moved record, Apply reads again and refuses, as it would have
    with the key there from the start."""
    store = MemoryStore()
    catalog = Catalog(store, clock=lambda: 1000.0)
    await catalog.apply(full(), prune=False, dry_run=False)
    smaller = full()
    smaller["tenants"] = smaller["tenants"][:1]  # --prune deletes tenant "plain"
    read = store.list
    created: list[str] = []

    async def read_then_a_key_came(prefix: str) -> Listing:
        listing = await read(prefix)
        if not created:
            created.append((await catalog.create_key("plain"))[0].id)
        return listing

    monkeypatch.setattr(store, "list", read_then_a_key_came)
    with pytest.raises(
        InvalidArgument, match=r"tenant 'plain' .* still has keys that are not revoked"
    ):
        await catalog.apply(smaller, prune=True, dry_run=False)
    assert [t.name for t in await catalog.list_tenants()] == ["acme", "plain"]


async def test_catalog_apply_counts_the_regions_it_relies_on_against_one_transaction() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    regions = [{"name": f"r{i}", "lat": 1, "lon": 1} for i in range(40)]
    await catalog.apply({"regions": regions}, prune=False, dry_run=False)
    before = (await store.list("/ponto/")).revision

    def origins(n: int) -> dict[str, Any]:
        return {
            "origins": [
                {"name": f"o{i}", "region": f"r{i % 40}", "url": "http://h/v1", "models": ["m"]}
                for i in range(n)
            ]
        }

    # 100 origins and the 40 regions they name (not in the file): 140 conditions.
    with pytest.raises(InvalidArgument, match="relies on 40 regions"):
        await catalog.apply(origins(100), prune=False, dry_run=False)
    assert (await store.list("/ponto/")).revision == before
    changes = (await catalog.apply(origins(88), prune=False, dry_run=False)).changes
    assert len(changes) == 88


async def test_catalog_apply_retries_from_a_fresh_read_after_a_concurrent_write() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.apply(full(), prune=False, dry_run=False)
    real_commit = store.commit
    calls = 0

    async def racing_commit(writes: Any, checks: Any = ()) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:  # another admin changes the tenant between read and write
            await catalog.put_tenant(Tenant("acme"), allow_update=True)
        return await real_commit(writes, checks)

    store.commit = racing_commit  # type: ignore[method-assign]
    doc = full()
    doc["tenants"][0]["limits"]["rpm"] = 900
    changes = (await catalog.apply(doc, prune=False, dry_run=False)).changes
    assert calls == 2
    acme = next(c for c in changes if c.name == "acme")
    assert acme.action == "updated" and "cache" in acme.fields  # judged against the new state
    stored = next(t for t in (await catalog.snapshot()).tenants if t.name == "acme")
    assert stored.limits.rpm == 900


def test_prune_deletes_only_from_the_kinds_the_document_lists() -> None:
    """Trial 52: `get tenants -o yaml | apply -f - --prune` deleted every
    region and origin, the document having none."""
    have = Current(
        regions={"us": Region("us", 1, 1)},
        origins={"o1": Origin("o1", "http://h/v1", "us", ("m",))},
        tenants={"acme": Tenant("acme"), "beta": Tenant("beta")},
    )
    tenants_only = plan(parse({"tenants": [{"name": "acme"}]}), have, prune=True)
    assert [(c.kind, c.name) for c in tenants_only.writes()] == [("tenant", "beta")]
    assert tenants_only.warnings == (
        "the document has no origins list (or an empty `origins:`): --prune left the 1 "
        "origin(s) the control plane has alone (`origins: []` deletes them)",
        "the document has no regions list (or an empty `regions:`): --prune left the 1 "
        "region(s) the control plane has alone (`regions: []` deletes them)",
    )
    # An empty list is a list: all of that kind go.
    everything = plan(parse({"regions": [], "origins": [], "tenants": []}), have, prune=True)
    assert sorted((c.kind, c.name) for c in everything.writes()) == [
        ("origin", "o1"),
        ("region", "us"),
        ("tenant", "acme"),
        ("tenant", "beta"),
    ]
    # An empty document deletes nothing.
    assert plan(parse({}), have, prune=True).writes() == ()


def test_prune_does_not_delete_a_region_whose_origins_it_keeps() -> None:
    """Review 200: a document listing regions and no origins deleted a
    region whose stored origins it kept; they dropped out of routing unseen,
    where DeleteRegion refuses a region with origins."""
    have = Current(
        regions={"us": Region("us", 1, 1), "eu": Region("eu", 2, 2)},
        origins={"o-eu": Origin("o-eu", "http://h/v1", "eu", ("m",))},
    )
    regions_only = parse({"regions": [{"name": "us", "lat": 1, "lon": 1}]})
    with pytest.raises(ApplyError) as raised:
        plan(regions_only, have, prune=True)
    assert raised.value.errors == (
        "region 'eu' is deleted by --prune, but origin 'o-eu', which the document does not "
        "list, is in it: list the origins (`origins:`, to delete or move them), or keep the "
        "region",
    )
    # Listed, the origin goes too (dependants first); or moved, it stays.
    both = plan(parse({"regions": regions_only_doc(), "origins": []}), have, prune=True)
    assert sorted((c.kind, c.name) for c in both.writes()) == [
        ("origin", "o-eu"),
        ("region", "eu"),
    ]
    moved = {"name": "o-eu", "region": "us", "url": "http://h/v1", "models": ["m"]}
    kept = plan(parse({"regions": regions_only_doc(), "origins": [moved]}), have, prune=True)
    assert {(c.kind, c.name, c.action) for c in kept.writes()} == {
        ("origin", "o-eu", "updated"),
        ("region", "eu", "deleted"),
    }


def regions_only_doc() -> list[dict[str, object]]:
    return [{"name": "us", "lat": 1, "lon": 1}]


def test_an_empty_kind_key_is_not_a_list_prune_deletes_from() -> None:
    """Review 200: `origins:` with every entry commented out is null, which
    --prune read as "no origins": every one deleted."""
    have = Current(origins={"o1": Origin("o1", "http://h/v1", "us", ("m",))},
                   regions={"us": Region("us", 1, 1)})  # fmt: skip
    null = plan(parse(yaml.safe_load("regions: [{name: us, lat: 1, lon: 1}]\norigins:\n")),
                have, prune=True)  # fmt: skip
    assert null.writes() == ()
    assert null.warnings[0].startswith("the document has no origins list (or an empty `origins:`)")


def test_a_prompt_stored_before_the_control_rule_is_kept_by_a_document_that_keeps_it() -> None:
    """Review 200: an export holding a tenant whose prompt predates the rule
    on control characters was refused whole on apply; only a prompt being
    set is checked."""
    old = Tenant("acme", prompt=PromptPolicy(system_prompt="a\x1bb"))
    doc = {
        "tenants": [{"name": "acme", "prompt": {"system_prompt": "a\x1bb"}, "limits": {"rpm": 5}}]
    }
    (change,) = plan(parse(doc), Current(tenants={"acme": old}), prune=False).writes()
    assert change.action == "updated"
    with pytest.raises(ApplyError, match=r"tenants\[0\].prompt.system_prompt: system prompt of "):
        plan(parse(doc), Current(), prune=False)  # a new tenant: the rule holds
