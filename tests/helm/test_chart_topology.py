"""The chart's topology values (`topology.origins`, `tenants`, `extraRegions`) against
`pontoctl apply -f`: the docs say a topology file pastes in unchanged, so the schema
must take every field apply takes, and refuse what apply refuses where it can say so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane import apply as topology_apply
from controlplane import cli as pontoctl
from tests.helm.test_chart import (
    CHART,
    Doc,
    container,
    helm,
    one,
    pod_spec,
    refused,
    render,
    values_file,
)

__all__ = ["helm"]  # the session fixture, used here by name

SCHEMA: Doc = json.loads((CHART / "values.schema.json").read_text())

# Where the schema holds an origin and a tenant; the fields each block takes come
# from apply.py itself, so a field added there and not here fails.
ORIGIN = ("properties", "topology", "properties", "origins", "items")
TENANT = ("properties", "topology", "properties", "tenants", "items")
TENANT_BLOCKS = {
    "limits": topology_apply.LIMIT_FIELDS,
    "cache": topology_apply.CACHE_FIELDS,
    "prompt": topology_apply.PROMPT_FIELDS,
    "jwt": topology_apply.JWT_FIELDS,
    "routing": topology_apply.ROUTING_FIELDS,
    "streams": topology_apply.STREAM_FIELDS,
}


def _at(path: tuple[str, ...]) -> Doc:
    node: Any = SCHEMA
    for key in path:
        node = node[key]
    assert isinstance(node, dict)
    return node


def _fields(node: Doc) -> set[str]:
    assert node.get("additionalProperties") is False, "an apply block refuses unknown fields"
    return set(node["properties"])


def test_the_schema_takes_the_fields_pontoctl_apply_takes() -> None:
    assert _fields(_at(("definitions", "topologyRegion"))) == set(topology_apply.REGION_FIELDS)
    assert _fields(_at(ORIGIN)) == set(topology_apply.ORIGIN_FIELDS)
    tenant = _at(TENANT)
    assert _fields(tenant) == set(topology_apply.TENANT_FIELDS)
    blocks = {k for k, v in tenant["properties"].items() if v.get("type") == "object"}
    # Every block apply reads with fields of its own is listed here (prompt.defaults
    # and the like are maps, not blocks).
    assert blocks == set(TENANT_BLOCKS)
    for block, names in TENANT_BLOCKS.items():
        assert _fields(tenant["properties"][block]) == set(names), block


# Every field apply accepts, each with a value apply accepts.
EVERY_FIELD: Doc = {
    "proxy": {
        "regions": [
            {
                "name": "us-east",
                "lat": 38.9,
                "lon": -77.4,
                "rttMs": {"eu-west": 75},
                "spillThreshold": 0.8,
                "drained": False,
            }
        ]
    },
    "topology": {
        "extraRegions": [
            {
                "name": "eu-west",
                "lat": 53.3,
                "lon": -6.3,
                "rtt_ms": {"us-east": 75},
                "spill_threshold": 0.9,
                "drained": True,
            }
        ],
        "origins": [
            {
                "name": "vllm-use1",
                "region": "us-east",
                "url": "http://vllm.us-east:8000/v1",
                "models": ["llama-3-8b", "embed-small"],
                "weight": 1000,
                "capacity": 64,
                "credential_env": "ORIGIN_USE1_KEY",
                "continuation": False,
                "probe_path": "/health",
                "drained": False,
            },
            {
                "name": "vllm-euw1",
                "region": "eu-west",
                "url": "https://vllm.eu-west.example.com/v1",
                "models": ["llama-3-8b"],
                "weight": 1,
                "credential_file": "/etc/ponto/keys/euw1",
                "probe": False,
                "model_names": {"llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct"},
                "max_tokens_field": "max_completion_tokens",
            },
        ],
        "tenants": [
            {
                "name": "acme",
                "limits": {
                    "rpm": 600,
                    "tpm": 100000,
                    "concurrency": 20,
                    "tokens_per_day": 2000000,
                    "tokens_per_month": 40000000,
                },
                "cache": {
                    "mode": "semantic",
                    "ttl_s": 3600,
                    "semantic_threshold": 0.5,
                    "semantic_max_error": 0.01,
                    "cache_nondeterministic": True,
                    "store_truncated": True,
                },
                "prompt": {
                    "system_prompt": "Be brief.",
                    "enforce_system_prompt": True,
                    "defaults": {"temperature": 0},
                    "max_tokens": 1024,
                    "aliases": {"gpt-4o": "llama-3-8b"},
                },
                "jwt": {
                    "issuer": "https://id.acme.example",
                    "audiences": ["ponto"],
                    "algorithms": ["RS256"],
                    "jwks_url": "https://id.acme.example/jwks.json",
                    "leeway_s": 30,
                    "max_lifetime_s": 3600,
                },
                "routing": {
                    "mode": "affinity",
                    "models": {"embed-small": "least-loaded"},
                    "user_sessions": True,
                    "load_bound": 1.25,
                },
                "streams": {
                    "continuation": True,
                    "max_continuations": 2,
                    "stream_idle_timeout_s": 30,
                    "hedge_ms": "auto",
                    "hedge_models": {"llama-3-8b": 500, "embed-small": "auto"},
                },
                "models": ["gpt-4o", "embed-small"],
                "suspended": False,
            },
            {
                "name": "globex",
                "cache": {"mode": "exact", "semantic_threshold": 0},
                "jwt": {
                    "issuer": "https://id.globex.example",
                    "algorithms": ["HS256"],
                    "hs256_secret_env": "GLOBEX_JWT_SECRET",
                },
                "streams": {"hedge_ms": 250},
                "routing": {"load_bound": 0},
                "suspended": True,
                "suspended_reason": "invoice unpaid",
            },
            {
                "name": "initech",
                "jwt": {
                    "issuer": "https://id.initech.example",
                    "algorithms": ["HS256", "ES256"],
                    "jwks_file": "/etc/ponto/jwks/initech.json",
                    "hs256_secret_file": "/etc/ponto/jwt/initech",
                },
            },
        ],
    },
}


def _used(doc: Any, path: str = "") -> set[str]:
    """The dotted paths of the mappings' keys in doc (list items share their list's path)."""
    if isinstance(doc, list):
        return {p for item in doc for p in _used(item, path)}
    if not isinstance(doc, dict):
        return set()
    return {f"{path}{k}" for k in doc} | {
        p for k, v in doc.items() for p in _used(v, f"{path}{k}.")
    }


def test_a_topology_with_every_field_apply_takes_renders_and_parses(
    helm: Path, tmp_path: Path
) -> None:
    # The values really use every field (the lists are apply's).
    topology = EVERY_FIELD["topology"]
    used = _used(topology["origins"]) | _used(topology["tenants"])
    assert set(topology_apply.ORIGIN_FIELDS) | set(topology_apply.TENANT_FIELDS) <= used
    for block, names in TENANT_BLOCKS.items():
        assert {f"{block}.{n}" for n in names} <= used, block
    assert set(topology_apply.REGION_FIELDS) <= _used(topology["extraRegions"])

    docs = render(helm, "-f", values_file(tmp_path, EVERY_FIELD))
    text = one(docs, "ConfigMap", "ponto-topology")["data"]["topology.yaml"]
    desired = topology_apply.parse(yaml.safe_load(text))
    assert [o.name for o in desired.origins] == ["vllm-use1", "vllm-euw1"]
    assert desired.origins[0].continuation is False
    assert desired.origins[0].probe_path == "/health" and desired.origins[1].probe is False
    assert desired.origins[1].model_names == (
        ("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct"),
    )
    assert desired.origins[1].max_tokens_field == "max_completion_tokens"
    assert desired.origins[0].max_tokens_field == "max_tokens"
    acme = desired.tenants[0]
    assert acme.routing.load_bound == pytest.approx(1.25)
    assert acme.streams.hedge_auto is True
    assert acme.models.names == ("embed-small", "gpt-4o")
    assert desired.tenants[1].suspended is True
    assert desired.tenants[1].suspended_reason == "invoice unpaid"


def _origin(**fields: Any) -> Doc:
    base = {"name": "o", "region": "us-east", "url": "http://o:8000/v1", "models": ["m"]}
    return {"topology": {"origins": [{**base, **fields}]}}


def _tenant(**fields: Any) -> Doc:
    return {"topology": {"tenants": [{"name": "t", **fields}]}}


@pytest.mark.parametrize(
    ("values", "where"),
    [
        # apply reads weight 0 as "not given" and refuses it written.
        (_origin(weight=0), "weight"),
        (_origin(weight=1001), "weight"),
        (_origin(credential_env="K", credential_file="/k"), "origins.0"),
        # Relative: apply wants it from the origin's root.
        (_origin(probe_path="health"), "probe_path"),
        (_origin(probe_path="/health#x"), "probe_path"),
        (_origin(probe_path="/", probe=False), "origins.0"),
        (_origin(model_names={"m": ""}), "model_names.m"),
        (_origin(model_names={"m": "x" * 257}), "model_names.m"),
        (_origin(model_names={"m": "llama3\n"}), "model_names.m"),
        (_origin(model_names={"M m": "x"}), 'Property name of "M m" does not match'),
        (_origin(max_tokens_field="max_output_tokens"), "max_tokens_field"),
        (_tenant(cache={"semantic_threshold": 0.3}), "semantic_threshold"),
        (_tenant(cache={"semantic_max_error": 0.5}), "semantic_max_error"),
        (_tenant(routing={"mode": "random"}), "routing.mode"),
        (_tenant(routing={"load_bound": 0.5}), "load_bound"),
        (_tenant(streams={"hedge_ms": "soon"}), "hedge_ms"),
        (_tenant(jwt={"issuer": "i", "algorithms": ["none"]}), "algorithms.0"),
        (_tenant(models=[]), "models"),
        # A reason only of a suspended tenant (trial 72: the hook Job failed).
        (_tenant(suspended=False, suspended_reason="stale"), "suspended"),
        (_tenant(suspended_reason="stale"), "suspended"),
        ({"topology": {"tenants": [{"name": "Acme"}]}}, "tenants.0.name"),
    ],
)
def test_the_schema_refuses_what_apply_refuses(
    helm: Path, tmp_path: Path, values: Doc, where: str
) -> None:
    message = refused(helm, "-f", values_file(tmp_path, values))
    assert "values don't meet the specifications of the schema" in message
    assert where in message


def _fails_the_job_at_once(job: Doc, code: int) -> bool:
    rules = job["spec"].get("podFailurePolicy", {}).get("rules", [])
    return any(
        r["action"] == "FailJob"
        and r["onExitCodes"]["containerName"] == container(job)["name"]
        and r["onExitCodes"]["operator"] == "In"
        and code in r["onExitCodes"]["values"]
        for r in rules
        if "onExitCodes" in r
    )


def test_a_refused_topology_fails_the_job_at_once_an_absent_control_plane_is_retried(
    helm: Path, tmp_path: Path
) -> None:
    job = one(render(helm, "--set", "tls.enabled=false"), "Job", "ponto-topology")
    # podFailurePolicy is refused by the API server unless the pods never restart.
    assert pod_spec(job)["restartPolicy"] == "Never"
    token = tmp_path / "admin-token"
    token.write_text("t")
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump({"regions": [{"name": "us-east", "lat": 1, "lon": 2}]}))
    args = [
        a.replace("ponto-control.ponto.svc:7000", "127.0.0.1:1")
        .replace("/etc/ponto/tokens/admin-token", str(token))
        .replace("/etc/ponto/topology/topology.yaml", str(topology))
        for a in container(job)["args"]
    ]
    # Nothing listens: the control plane is still starting, and a retry may reach it.
    unavailable = pontoctl.main(args)
    assert unavailable == 1
    assert not _fails_the_job_at_once(job, unavailable)
    # A refusal (here of the command line; INVALID_ARGUMENT exits the same) is
    # given again on every retry.
    refusal = pontoctl.main([*args, "--no-such-flag"])
    assert refusal == 2
    assert _fails_the_job_at_once(job, refusal)


def test_notes_without_the_topology_job_point_to_pontoctl(helm: Path, tmp_path: Path) -> None:
    from tests.chartrun.__main__ import render as chartrun_render  # noqa: PLC0415

    values = {
        "topology": {
            "apply": False,
            "origins": [
                {"name": "o", "region": "us-east", "url": "http://o:8000/v1", "models": ["m"]}
            ],
        }
    }
    run = chartrun_render(str(helm), [Path(values_file(tmp_path, values))], upgrade=False)
    assert not [h for h in run.hooks if h["kind"] == "Job"]
    notes = run.notes
    assert "topology Job" not in notes
    assert "job/ponto-topology" not in notes
    assert "Drain a region through values" not in notes
    assert "topology.apply is false: the chart applies no topology" in notes
    assert "Drain a region with `pontoctl drain region NAME`" in notes
    # The values' origins are not applied: the NOTES do not take them as served.
    assert "The chart applies no origins (topology.apply is false)" in notes
    # With the Job, as before.
    applied = chartrun_render(str(helm), [], upgrade=False).notes
    assert "job/ponto-topology" in applied
    assert "the topology Job re-applies drain flags" in applied
    assert "topology.apply is false" not in applied


def test_a_region_without_proxies_takes_any_name_apply_takes(helm: Path, tmp_path: Path) -> None:
    # 63 characters: apply's limit. proxy.regions' names stop at 40 (object names
    # are made of them); extra regions make no object.
    name = "r" * 63
    values = {
        "topology": {
            "extraRegions": [{"name": name, "lat": 1, "lon": 2}],
            "origins": [{"name": "o", "region": name, "url": "http://o:8000/v1", "models": ["m"]}],
        }
    }
    docs = render(helm, "-f", values_file(tmp_path, values))
    text = one(docs, "ConfigMap", "ponto-topology")["data"]["topology.yaml"]
    assert topology_apply.parse(yaml.safe_load(text)).origins[0].region == name


def test_a_reason_of_spaces_is_none_to_the_schema_as_to_apply(helm: Path, tmp_path: Path) -> None:
    """Review 281: apply takes it (stripped, no reason), the schema refused it."""
    values = _tenant(suspended=False, suspended_reason="  ")
    docs = render(helm, "-f", values_file(tmp_path, values))
    text = one(docs, "ConfigMap", "ponto-topology")["data"]["topology.yaml"]
    [tenant] = topology_apply.parse(yaml.safe_load(text)).tenants
    assert (tenant.suspended, tenant.suspended_reason) == (False, "")
