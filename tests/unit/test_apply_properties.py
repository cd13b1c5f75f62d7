"""Properties of the topology document: any JSON value is either a valid topology or
an ApplyError (never another exception), and a document written from valid values
reads back to the same values."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.apply import ApplyError, Topology, document, parse

names = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
models = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,12}", fullmatch=True)
json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


def region() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"name": names, "lat": st.floats(-90, 90), "lon": st.floats(-180, 180)},
        optional={
            "rtt_ms": st.dictionaries(names, st.floats(0, 10_000), max_size=2),
            "spill_threshold": st.floats(0, 1),
            "drained": st.booleans(),
        },
    )


def origin(regions: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "name": names,
            "region": st.sampled_from(regions),
            "url": st.sampled_from(["http://h:8000/v1", "https://api.example/v1/"]),
            "models": st.lists(models, min_size=1, max_size=3, unique=True),
        },
        optional={
            "weight": st.integers(1, 1000),
            "capacity": st.integers(0, 1_000_000),
            "credential_env": st.sampled_from(["KEY", "ORIGIN_KEY"]),
            "continuation": st.booleans(),
            "drained": st.booleans(),
        },
    )


tenant = st.fixed_dictionaries(
    {"name": names},
    optional={
        "limits": st.fixed_dictionaries(
            {}, optional={"rpm": st.integers(0, 10**12), "concurrency": st.integers(0, 2**32 - 1)}
        ),
        "cache": st.fixed_dictionaries(
            {"mode": st.sampled_from(["off", "exact", "semantic"])},
            optional={
                "ttl_s": st.integers(0, 86_400),
                "semantic_threshold": st.floats(0.5, 1),
                "semantic_max_error": st.floats(0, 0.49),
            },
        ),
        "prompt": st.fixed_dictionaries(
            {},
            optional={
                # Of the controls, only tab and line breaks (model.PROMPT_CONTROLS).
                "system_prompt": st.text(
                    st.characters(exclude_categories=("Cs", "Cc")) | st.sampled_from("\t\n\r"),
                    max_size=20,
                ),
                "max_tokens": st.integers(0, 10**7),
                # Documented fields take only what a request may carry;
                # an origin's own field (top_k) any JSON scalar.
                "defaults": st.fixed_dictionaries(
                    {},
                    optional={
                        "temperature": st.floats(0, 2),
                        "top_p": st.floats(0, 1),
                        "stop": st.text(max_size=8),
                        "seed": st.integers(-(2**63), 2**63 - 1),
                        "top_k": st.integers(-(2**63), 2**63 - 1)
                        | st.floats(allow_nan=False, allow_infinity=False)
                        | st.text(),
                    },
                ),
            },
        ),
        "routing": st.fixed_dictionaries(
            {},
            optional={
                "mode": st.sampled_from(["affinity", "least-loaded", "weighted"]),
                "models": st.dictionaries(models, st.sampled_from(["affinity", "weighted"])),
                "load_bound": st.floats(1, 100),
            },
        ),
        "streams": st.fixed_dictionaries(
            {},
            optional={
                "continuation": st.booleans(),
                "hedge_ms": st.integers(0, 600_000) | st.just("auto"),
                "hedge_models": st.dictionaries(
                    models, st.integers(0, 600_000) | st.just("auto"), max_size=2
                ),
            },
        ),
    },
)


@st.composite
def topologies(draw: st.DrawFn) -> dict[str, Any]:
    regions = draw(st.lists(region(), min_size=1, max_size=3, unique_by=lambda r: r["name"]))
    in_file = [r["name"] for r in regions]
    origins = draw(st.lists(origin(in_file), max_size=3, unique_by=lambda o: o["name"]))
    tenants = draw(st.lists(tenant, max_size=3, unique_by=lambda t: t["name"]))
    return {"regions": regions, "origins": origins, "tenants": tenants}


def _sorted(t: Topology) -> tuple[Any, ...]:
    return tuple(sorted(v, key=lambda x: x.name) for v in (t.regions, t.origins, t.tenants))


@settings(max_examples=80, deadline=None)
@given(topologies())
def test_valid_documents_round_trip(doc: dict[str, Any]) -> None:
    parsed = parse(doc)
    again = parse(document(parsed.regions, parsed.origins, parsed.tenants))
    assert _sorted(again) == _sorted(parsed)


@st.composite
def damaged(draw: st.DrawFn) -> Any:
    """A valid document with one value replaced by any JSON value."""
    doc = draw(topologies())
    kind = draw(st.sampled_from(["regions", "origins", "tenants"]))
    if not doc[kind]:
        return doc
    target: dict[str, Any] = doc[kind][draw(st.integers(0, len(doc[kind]) - 1))]
    inner = [k for k, v in target.items() if isinstance(v, dict)]
    down: bool = draw(st.booleans())
    if inner and down:  # one level down: cache, prompt, defaults, ...
        target = target[draw(st.sampled_from(inner))]
        if "defaults" in target:
            target = target["defaults"]
    key = draw(st.sampled_from(sorted(target)) | st.text(max_size=6)) if target else "x"
    target[key] = draw(json_value)
    return doc


@settings(max_examples=150, deadline=None)
@given(damaged() | json_value)
def test_any_json_is_a_topology_or_an_apply_error(doc: Any) -> None:
    try:
        parse(doc)
    except ApplyError as exc:
        assert exc.errors and all(isinstance(e, str) and e for e in exc.errors)
