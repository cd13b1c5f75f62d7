"""An origin's own names for public models (Origin.model_names): validation,
storage, the table, the apply document, pontoctl's flags and listing, the
status page's row, the proxy's targets and the body it sends."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from controlplane.api.admin import origin_pb
from controlplane.apply import ApplyError, document, parse
from controlplane.catalog import Catalog
from controlplane.cli import _origin_changes, _origin_spec, _parser, _rows_origins
from controlplane.compile import compile_table
from controlplane.errors import InvalidArgument
from controlplane.messages import origin_of
from controlplane.model import Origin, Region, State
from controlplane.store.memory import MemoryStore
from controlplane.web import _origin_row
from dataplane.routes import build_routes
from dataplane.upstream.forwarder import renamed
from ponto.routetable import content_etag
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

EAST = Region("east", 40.0, -74.0)
OLLAMA = Origin(
    "ollama",
    "http://gpu1:11434/v1",
    "east",
    ("llama-3.1-8b", "qwen"),
    model_names=(("llama-3.1-8b", "llama3.1:8b"),),
)
VLLM = Origin("vllm", "http://gpu2:8000/v1", "east", ("llama-3.1-8b",))


# ---------------------------------------------------------------- model


def test_a_name_for_a_served_model_is_kept_sorted() -> None:
    two = replace(OLLAMA, model_names=(("qwen", "qwen2.5:7b"), ("llama-3.1-8b", "llama3.1:8b")))
    assert two.validated().model_names == (
        ("llama-3.1-8b", "llama3.1:8b"),
        ("qwen", "qwen2.5:7b"),
    )
    # Looser than a public model name: a llama.cpp file path, a space.
    path = replace(OLLAMA, model_names=(("qwen", "/models/Qwen 2.5 7B-Q4_K_M.gguf"),))
    assert path.validated().model_names == (("qwen", "/models/Qwen 2.5 7B-Q4_K_M.gguf"),)
    # Pairs as a record edited by hand might hold them: one model, two names.
    twice = replace(OLLAMA, model_names=(("qwen", "a"), ("qwen", "b")))
    with pytest.raises(InvalidArgument, match="gives a model two own names"):
        twice.validated()


def test_a_name_for_a_model_the_origin_does_not_serve_is_refused() -> None:
    bad = replace(OLLAMA, model_names=(("gpt-4o", "llama3.1:8b"),))
    with pytest.raises(InvalidArgument, match="names 'gpt-4o', which is not among its models") as e:
        bad.validated()
    assert e.value.field == "model_names.gpt-4o"


@pytest.mark.parametrize(
    ("own", "problem"),
    [
        ("", "is empty"),
        ("x" * 257, "is over 256 bytes"),
        ("é" * 129, "is over 256 bytes"),  # 258 bytes in UTF-8
        ("llama3\n", "holds a control character"),
        ("a\x00b", "holds a control character"),
        ("a\x85b", "holds a control character"),
    ],
)
def test_an_own_name_empty_too_long_or_with_control_characters_is_refused(
    own: str, problem: str
) -> None:
    with pytest.raises(InvalidArgument, match=problem) as e:
        replace(OLLAMA, model_names=(("qwen", own),)).validated()
    assert e.value.field == "model_names.qwen"
    assert replace(OLLAMA, model_names=(("qwen", "x" * 256),)).validated()


def test_the_admin_spec_carries_the_names_into_the_model() -> None:
    spec = apb.OriginSpec(
        name="ollama", base_url="http://h/v1", region="east", models=["a", "b"],
        model_names={"a": "their-a"},
    )  # fmt: skip
    assert origin_of(spec).validated().model_names == (("a", "their-a"),)


async def test_the_names_are_stored_with_the_origin() -> None:
    catalog = Catalog(MemoryStore())
    await catalog.put_region(EAST, allow_update=False)
    await catalog.put_origin(OLLAMA, allow_update=False)
    (stored,) = (await catalog.snapshot()).origins
    assert stored.model_names == (("llama-3.1-8b", "llama3.1:8b"),)
    # An update with `expected` as read compares them too.
    changed = replace(OLLAMA, model_names=())
    await catalog.put_origin(changed, allow_update=True, expected=stored)
    (stored,) = (await catalog.snapshot()).origins
    assert stored.model_names == ()


def test_the_table_and_the_admin_listing_carry_the_names() -> None:
    table = compile_table(State(3, (EAST,), (OLLAMA, VLLM)))
    by_name = {o.name: o for o in table.origins}
    assert dict(by_name["ollama"].model_names) == {"llama-3.1-8b": "llama3.1:8b"}
    assert dict(by_name["vllm"].model_names) == {}
    assert dict(origin_pb(OLLAMA).model_names) == {"llama-3.1-8b": "llama3.1:8b"}
    # A change of name is a change of the table's content, pushed.
    other = compile_table(
        State(3, (EAST,), (replace(OLLAMA, model_names=(("llama-3.1-8b", "llama3.1"),)), VLLM))
    )
    assert content_etag(table) != content_etag(other)


# ---------------------------------------------------------------- apply


def test_the_document_reads_and_writes_model_names() -> None:
    doc = {
        "regions": [{"name": "east", "lat": 40, "lon": -74}],
        "origins": [
            {"name": "ollama", "region": "east", "url": "http://gpu1:11434/v1",
             "models": ["llama-3.1-8b"], "model_names": {"llama-3.1-8b": "llama3.1:8b"}},
            {"name": "vllm", "region": "east", "url": "http://gpu2:8000/v1",
             "models": ["llama-3.1-8b"]},
        ],
    }  # fmt: skip
    t = parse(doc)
    by_name = {o.name: o for o in t.origins}
    assert by_name["ollama"].model_names == (("llama-3.1-8b", "llama3.1:8b"),)
    assert by_name["vllm"].model_names == ()
    written = {o["name"]: o for o in document(t.regions, t.origins, ())["origins"]}
    assert written["ollama"]["model_names"] == {"llama-3.1-8b": "llama3.1:8b"}
    assert "model_names" not in written["vllm"]
    again = parse(document(t.regions, t.origins, ())).origins
    assert sorted(again, key=lambda o: o.name) == sorted(t.origins, key=lambda o: o.name)


@pytest.mark.parametrize(
    ("names", "error"),
    [
        ({"gpt-4o": "x"}, "origins[0].model_names.gpt-4o: model_names of origin 'o' names "
         "'gpt-4o', which is not among its models"),
        ({"m": 8}, "origins[0].model_names.m: expected a string, got 8"),
        ({"m": ""}, "origins[0].model_names.m: origin 'o': its own name for model 'm' is empty"),
        (["m"], "origins[0].model_names: expected a mapping"),
    ],
)  # fmt: skip
def test_the_document_refuses_a_bad_model_name_at_its_field(names: object, error: str) -> None:
    origin = {"name": "o", "region": "east", "url": "http://h/v1", "models": ["m"],
              "model_names": names}  # fmt: skip
    with pytest.raises(ApplyError) as raised:
        parse({"origins": [origin]})
    assert any(e.startswith(error) for e in raised.value.errors), raised.value.errors


# ---------------------------------------------------------------- pontoctl


def spec_of(current: pb.Origin | None, *flags: str) -> apb.OriginSpec:
    base = [] if current else ["--url", "http://h/v1", "--region", "east", "--models", "a,b"]
    args = _parser().parse_args(["origin", "add", "o", *base, *flags])
    return _origin_spec(args, current)


def test_origin_add_sets_model_names_and_update_keeps_or_removes_them() -> None:
    spec = spec_of(None, "--model-name", "a=their-a", "--model-name", "b = llama3.1:8b")
    assert dict(spec.model_names) == {"a": "their-a", "b": "llama3.1:8b"}
    current = pb.Origin(name="o", base_url="http://h/v1", region="east", models=["a", "b"],
                        model_names={"a": "their-a", "b": "theirs-b"})  # fmt: skip
    # --update keeps what it is not given, changes one, removes one (MODEL=).
    assert dict(spec_of(current, "--weight", "5").model_names) == {
        "a": "their-a", "b": "theirs-b"
    }  # fmt: skip
    assert dict(spec_of(current, "--model-name", "a=new-a").model_names) == {
        "a": "new-a", "b": "theirs-b"
    }  # fmt: skip
    assert dict(spec_of(current, "--model-name", "a=").model_names) == {"b": "theirs-b"}
    # A model dropped from --models takes its name along.
    assert dict(spec_of(current, "--models", "a").model_names) == {"a": "their-a"}
    # One for a model not served is the model's error, as the control plane's.
    with pytest.raises(InvalidArgument, match="not among its models"):
        origin_of(spec_of(None, "--model-name", "c=x")).validated()


def test_get_origins_shows_the_name_each_model_is_sent_as() -> None:
    resp = apb.ListOriginsResponse(origins=[origin_pb(OLLAMA), origin_pb(VLLM)])
    header, rows = _rows_origins(resp)
    shown = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert shown["ollama"]["MODELS"] == "llama-3.1-8b (as llama3.1:8b),qwen"
    assert shown["vllm"]["MODELS"] == "llama-3.1-8b"
    before, after = origin_pb(VLLM), origin_pb(replace(VLLM, model_names=(("llama-3.1-8b", "x"),)))
    assert _origin_changes(before, after) == ["models llama-3.1-8b -> llama-3.1-8b (as x)"]


def test_the_status_page_row_lists_the_names() -> None:
    assert _origin_row(origin_pb(OLLAMA), None)["model_names"] == {"llama-3.1-8b": "llama3.1:8b"}
    assert _origin_row(origin_pb(VLLM), None)["model_names"] == {}


# ---------------------------------------------------------------- proxy


def test_the_proxys_targets_carry_each_origins_names() -> None:
    table = compile_table(State(3, (EAST,), (OLLAMA, VLLM)))
    table.etag = content_etag(table)
    routes = build_routes(table, "east")
    ((*group,),) = routes.order["east"]["llama-3.1-8b"]
    names = {t.name: t.model_names for t in group}
    assert names == {"ollama": {"llama-3.1-8b": "llama3.1:8b"}, "vllm": {}}


def test_a_renamed_body_changes_only_its_model() -> None:
    body = orjson.dumps({"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}],
                         "temperature": 0.5, "stream": True})  # fmt: skip
    out = orjson.loads(renamed(body, "llama3.1:8b"))
    assert out == {**orjson.loads(body), "model": "llama3.1:8b"}
