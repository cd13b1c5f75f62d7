"""The field a tenant's added max-tokens ceiling is sent to an origin in
(Origin.max_tokens_field): validation, storage (and its survival of an older
replica's rewrite), the table, the apply document, pontoctl's flag, listing
and NOT SAVED against an older control plane, the proxy's targets, the
assembly that says a ceiling was added, and the body sent."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, replace
from typing import Any

import orjson
import pytest

from controlplane.api.admin import origin_pb
from controlplane.apply import ApplyError, document, parse
from controlplane.catalog import Catalog
from controlplane.cli import _as_spec, _origin_changes, _rows_origins
from controlplane.compile import compile_table
from controlplane.errors import InvalidArgument
from controlplane.messages import origin_of
from controlplane.model import Origin, Region, State, decode_origin, encode, encode_over
from controlplane.store.memory import MemoryStore
from dataplane.assemble import Assembly, PromptRules, assembled
from dataplane.routes import TableError, build_routes
from dataplane.upstream.forwarder import renamed
from ponto.routetable import content_etag
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_cli_older_plane import BEFORE_371271B, OlderPlane, pontoctl
from tests.unit.test_origin_probe_settings import spec_of

EAST = Region("east", 40.0, -74.0)
OPENAI = Origin(
    "openai",
    "https://api.openai.com/v1",
    "east",
    ("o4-mini",),
    max_tokens_field="max_completion_tokens",
)
OLLAMA = Origin("ollama", "http://gpu1:11434/v1", "east", ("o4-mini",))


# ---------------------------------------------------------------- model


def test_the_field_is_max_tokens_by_default_or_max_completion_tokens() -> None:
    assert OLLAMA.validated().max_tokens_field == "max_tokens"
    assert OPENAI.validated().max_tokens_field == "max_completion_tokens"
    for bad in ("max_output_tokens", "", "MAX_TOKENS"):
        with pytest.raises(InvalidArgument, match="is not one of max_tokens, max_comp") as e:
            replace(OLLAMA, max_tokens_field=bad).validated()
        assert e.value.field == "max_tokens_field"


def test_the_admin_spec_carries_it_into_the_model_empty_as_the_default() -> None:
    spec = apb.OriginSpec(name="o", base_url="http://h/v1", region="east", models=["m"])
    assert origin_of(spec).validated().max_tokens_field == "max_tokens"
    spec.max_tokens_field = "max_completion_tokens"
    assert origin_of(spec).validated().max_tokens_field == "max_completion_tokens"
    spec.max_tokens_field = "max_tokens"
    assert origin_of(spec).validated().max_tokens_field == "max_tokens"
    spec.max_tokens_field = "tokens"
    with pytest.raises(InvalidArgument, match="max_tokens_field 'tokens'"):
        origin_of(spec).validated()


async def test_it_is_stored_with_the_origin_and_read_back() -> None:
    catalog = Catalog(MemoryStore())
    await catalog.put_region(EAST, allow_update=False)
    await catalog.put_origin(OPENAI, allow_update=False)
    (stored,) = (await catalog.snapshot()).origins
    assert stored.max_tokens_field == "max_completion_tokens"
    await catalog.put_origin(replace(OLLAMA, name="openai"), allow_update=True, expected=stored)
    (stored,) = (await catalog.snapshot()).origins
    assert stored.max_tokens_field == "max_tokens"
    # A record of a replica older than the field reads as the default.
    old = orjson.loads(encode(OPENAI))
    del old["max_tokens_field"]
    assert decode_origin(orjson.dumps(old)).max_tokens_field == "max_tokens"


def test_an_older_replicas_rewrite_keeps_the_field() -> None:
    """encode_over, as a replica whose Origin lacks the field runs it when
    it writes the origin again (a drain): the stored field is kept."""
    older = dataclasses.make_dataclass(
        "Origin",
        [(f.name, f.type, f) for f in dataclasses.fields(Origin) if f.name != "max_tokens_field"],
        frozen=True,
    )
    known = {f.name for f in dataclasses.fields(older)}
    drained = older(**{k: v for k, v in asdict(OPENAI).items() if k in known} | {"drained": True})
    rewritten = decode_origin(encode_over(drained, encode(OPENAI)))
    assert rewritten == replace(OPENAI, drained=True)


def test_the_table_and_the_admin_listing_carry_it_empty_for_the_default() -> None:
    table = compile_table(State(3, (EAST,), (OPENAI, OLLAMA)))
    by_name = {o.name: o for o in table.origins}
    assert by_name["openai"].max_tokens_field == "max_completion_tokens"
    # "" for the default: a table without the field means the same.
    assert by_name["ollama"].max_tokens_field == ""
    assert origin_pb(OPENAI).max_tokens_field == "max_completion_tokens"
    assert origin_pb(OLLAMA).max_tokens_field == ""
    other = compile_table(State(3, (EAST,), (replace(OPENAI, max_tokens_field="max_tokens"),)))
    assert content_etag(compile_table(State(3, (EAST,), (OPENAI,)))) != content_etag(other)


# ---------------------------------------------------------------- apply


def test_the_document_reads_and_writes_it_only_when_not_the_default() -> None:
    doc = {
        "regions": [{"name": "east", "lat": 40, "lon": -74}],
        "origins": [
            {"name": "openai", "region": "east", "url": "https://api.openai.com/v1",
             "models": ["o4-mini"], "max_tokens_field": "max_completion_tokens"},
            {"name": "ollama", "region": "east", "url": "http://gpu1:11434/v1",
             "models": ["o4-mini"], "max_tokens_field": "max_tokens"},
        ],
    }  # fmt: skip
    t = parse(doc)
    by_name = {o.name: o for o in t.origins}
    assert by_name["openai"].max_tokens_field == "max_completion_tokens"
    assert by_name["ollama"].max_tokens_field == "max_tokens"
    written = {o["name"]: o for o in document(t.regions, t.origins, ())["origins"]}
    assert written["openai"]["max_tokens_field"] == "max_completion_tokens"
    assert "max_tokens_field" not in written["ollama"]
    again = parse(document(t.regions, t.origins, ())).origins
    assert sorted(again, key=lambda o: o.name) == sorted(t.origins, key=lambda o: o.name)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("max_output_tokens", "origins[0].max_tokens_field: max_tokens_field "
         "'max_output_tokens' of origin 'o' is not one of max_tokens, max_completion_tokens"),
        (5, "origins[0].max_tokens_field: expected a string, got 5"),
    ],
)  # fmt: skip
def test_the_document_refuses_another_value_at_its_field(value: object, error: str) -> None:
    origin = {"name": "o", "region": "east", "url": "http://h/v1", "models": ["m"],
              "max_tokens_field": value}  # fmt: skip
    with pytest.raises(ApplyError) as raised:
        parse({"origins": [origin]})
    assert any(e.startswith(error) for e in raised.value.errors), raised.value.errors


# ---------------------------------------------------------------- pontoctl


def test_origin_add_sets_it_and_update_keeps_or_resets_it() -> None:
    assert spec_of(None).max_tokens_field == ""
    spec = spec_of(None, "--max-tokens-field", "max_completion_tokens")
    assert spec.max_tokens_field == "max_completion_tokens"
    # The default is asked as "", the form the control plane answers it in.
    assert spec_of(None, "--max-tokens-field", "max_tokens").max_tokens_field == ""
    current = origin_pb(replace(OPENAI, name="o"))
    assert spec_of(current, "--weight", "5").max_tokens_field == "max_completion_tokens"
    assert spec_of(current, "--max-tokens-field", "max_tokens").max_tokens_field == ""
    assert _as_spec(current).max_tokens_field == "max_completion_tokens"
    with pytest.raises(SystemExit):
        spec_of(None, "--max-tokens-field", "max_output_tokens")


def test_get_origins_shows_it_only_when_an_origin_sets_it() -> None:
    header, _ = _rows_origins(apb.ListOriginsResponse(origins=[origin_pb(OLLAMA)]))
    assert "MAX TOKENS AS" not in header
    resp = apb.ListOriginsResponse(origins=[origin_pb(OPENAI), origin_pb(OLLAMA)])
    header, rows = _rows_origins(resp)
    shown = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert shown["openai"]["MAX TOKENS AS"] == "max_completion_tokens"
    assert shown["ollama"]["MAX TOKENS AS"] == "max_tokens"
    before = origin_pb(OLLAMA)
    after = origin_pb(replace(OLLAMA, max_tokens_field="max_completion_tokens"))
    assert _origin_changes(before, after) == [
        "max_tokens_field max_tokens -> max_completion_tokens"
    ]


def test_origin_add_says_the_field_it_saved_unless_the_default() -> None:
    plane = OlderPlane(frozenset())
    plane.regions["eu"] = pb.Region(name="eu")
    added = pontoctl(
        plane, "origin", "add", "o", "--url", "http://h:8000/v1", "--region", "eu",
        "--models", "m", "--max-tokens-field", "max_completion_tokens",
    )  # fmt: skip
    assert added == "origin o in eu saved (m; weight 100; max tokens as max_completion_tokens)"
    again = pontoctl(plane, "origin", "add", "o", "--update", "--max-tokens-field", "max_tokens")
    assert again == (
        "origin o in eu saved (m; weight 100); "
        "changed: max_tokens_field max_completion_tokens -> max_tokens"
    )


def test_origin_add_against_an_older_control_plane_is_not_saved() -> None:
    plane = OlderPlane(BEFORE_371271B | {"Origin.max_tokens_field"})
    plane.regions["eu"] = pb.Region(name="eu")
    added = pontoctl(
        plane, "origin", "add", "o", "--url", "http://h:8000/v1", "--region", "eu",
        "--models", "m", "--max-tokens-field", "max_completion_tokens",
    )  # fmt: skip
    assert added.not_saved == ("max_tokens_field",)
    # The default, asked of it, is what it has: nothing lost.
    again = pontoctl(plane, "origin", "add", "o", "--update", "--max-tokens-field", "max_tokens")
    assert again.not_saved == () and again.endswith("; unchanged")


# ---------------------------------------------------------------- proxy


def routed(*origins: Origin) -> dict[str, str]:
    table = compile_table(State(3, (EAST,), origins))
    table.etag = content_etag(table)
    ((*group,),) = build_routes(table, "east").order["east"]["o4-mini"]
    return {t.name: t.max_tokens_field for t in group}


def test_the_proxys_targets_carry_each_origins_field() -> None:
    # "": max_tokens, as added: nothing to rename.
    assert routed(OPENAI, OLLAMA) == {"openai": "max_completion_tokens", "ollama": ""}


def test_a_table_with_an_unknown_field_is_refused() -> None:
    table = compile_table(State(3, (EAST,), (OPENAI,)))
    table.origins[0].max_tokens_field = "max_output_tokens"
    table.etag = content_etag(table)
    with pytest.raises(TableError, match="unknown max_tokens_field 'max_output_tokens'"):
        build_routes(table, "east")


CEILING = PromptRules(max_tokens_ceiling=100)


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        # Added to a chat request that named no limit (or null): said so.
        ("chat.completions", {}, Assembly(True, max_tokens_added=True)),
        ("chat.completions", {"max_tokens": None}, Assembly(True, max_tokens_added=True)),
        ("chat.completions", {"max_completion_tokens": None}, Assembly(True, True)),
        # The client's own, clamped or not: never added.
        ("chat.completions", {"max_tokens": 500}, Assembly(True)),
        ("chat.completions", {"max_completion_tokens": 500}, Assembly(True)),
        ("chat.completions", {"max_tokens": 5}, Assembly(False)),
        # Completions read only max_tokens; Responses max_output_tokens.
        ("completions", {}, Assembly(True)),
        ("responses", {}, Assembly(True)),
    ],
)
def test_assembly_says_when_the_ceiling_was_added_to_a_chat_request(
    endpoint: str, body: dict[str, Any], expected: Assembly
) -> None:
    assert assembled(endpoint, {"model": "m", **body}, CEILING) == expected
    assert assembled(endpoint, {"model": "m", **body}, PromptRules()) == Assembly(False)


def test_a_tenants_default_max_tokens_is_the_proxys_too() -> None:
    """Trial 72: a default max_tokens went to an origin that refuses it, as
    the ceiling found the field there and said nothing was added."""
    rules = PromptRules(max_tokens_ceiling=500, defaults={"max_tokens": 300})
    body: dict[str, Any] = {"model": "m"}
    assert assembled("chat.completions", body, rules) == Assembly(True, max_tokens_added=True)
    assert body["max_tokens"] == 300
    alone = PromptRules(defaults={"max_tokens": 300})
    assert assembled("chat.completions", {"model": "m"}, alone).max_tokens_added
    # The client's own limit: no default adds another beside it (vLLM would
    # read a default max_completion_tokens before the client's max_tokens).
    other = PromptRules(defaults={"max_completion_tokens": 300, "max_tokens": 200})
    own: dict[str, Any] = {"model": "m", "max_tokens": 50}
    assert assembled("chat.completions", own, other) == Assembly(False)
    assert own == {"model": "m", "max_tokens": 50}
    # Review 281: a default of either name is one limit, the smaller, as the
    # proxy's max_tokens (an Ollama origin read none, and two defaults gave
    # each origin another limit).
    both: dict[str, Any] = {"model": "m"}
    assert assembled("chat.completions", both, other) == Assembly(True, max_tokens_added=True)
    assert both == {"model": "m", "max_tokens": 200}
    completion = PromptRules(max_tokens_ceiling=1000, defaults={"max_completion_tokens": 300})
    alone_too: dict[str, Any] = {"model": "m"}
    assert assembled("chat.completions", alone_too, completion).max_tokens_added
    assert alone_too == {"model": "m", "max_tokens": 300}


def test_a_body_sent_in_another_field_changes_only_that_field() -> None:
    body = orjson.dumps({"model": "o4-mini", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 100, "temperature": 0.5})  # fmt: skip
    out = orjson.loads(renamed(body, None, "max_completion_tokens"))
    sent = orjson.loads(body)
    del sent["max_tokens"]
    assert out == {**sent, "max_completion_tokens": 100}
    # With the origin's own model name too, in one encoding.
    out = orjson.loads(renamed(body, "o4-mini-2025", "max_completion_tokens"))
    assert out["model"] == "o4-mini-2025" and out["max_completion_tokens"] == 100
    assert "max_tokens" not in out
    # Over a client's null in that field.
    nulled = orjson.dumps({"model": "m", "max_tokens": 100, "max_completion_tokens": None})
    assert orjson.loads(renamed(nulled, None, "max_completion_tokens")) == {
        "model": "m",
        "max_completion_tokens": 100,
    }
