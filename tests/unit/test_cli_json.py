"""`pontoctl ... -o json|yaml`: 64-bit integers are numbers, not protobuf's
JSON strings, and each budgeted key carries what it spent (trial 42: a script
compared "1000" with 1000, and a reader of one key missed the top-level
`spent` list)."""

from __future__ import annotations

import json
import time

import yaml
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from controlplane.cli import _WIDE_INTS, _render_keys, _rows_keys, _table_summary, render
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def _tenants() -> apb.ListTenantsResponse:
    return apb.ListTenantsResponse(
        tenants=[
            pb.Tenant(name="acme", limits=pb.Limits(rpm=120, tokens_per_day=2000)),
            pb.Tenant(name="free"),
        ],
        spent=[apb.BudgetSpent(scope="t/acme", day=20261205, day_tokens=493, month_tokens=900)],
    )


def test_limits_are_numbers_in_json_and_yaml() -> None:
    for output, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        data = load(render(_tenants(), output, lambda _: ""))
        acme, _ = data["tenants"]
        assert acme["limits"] == {"rpm": 120, "tokens_per_day": 2000}
        assert data["spent"][0]["day"] == 20261205


class _KeysStub:
    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        raise AssertionError("JSON output needs no second call")


def test_key_list_json_has_numbers_and_spent_per_key() -> None:
    keys = apb.ListKeysResponse(
        keys=[
            apb.ApiKeyInfo(
                id="4mapalz2c5", tenant="acme", limits=pb.Limits(tokens_per_month=10**12)
            )
        ],
        spent=[apb.BudgetSpent(scope="k/4mapalz2c5", day=20261205, day_tokens=1, month_tokens=7)],
    )
    (key,) = json.loads(_render_keys(_KeysStub(), keys, "json"))["keys"]
    assert key["limits"] == {"tokens_per_month": 10**12}
    assert key["spent"]["month_tokens"] == 7


def test_key_list_json_shows_whole_tokens_and_the_closed_periods() -> None:
    """Trial: `key list -o json` showed month_tokens 18804.917 (a control
    plane before whole counts), and nothing of the day or month just closed,
    which a billing job reads."""
    row = apb.BudgetSpent(
        scope="k/4mapalz2c5", day=20270101, day_tokens=40, month_tokens=18804.917,
        last_day=20261231, last_day_tokens=2212.0, last_month=202612, last_month_tokens=20212,
    )  # fmt: skip
    keys = apb.ListKeysResponse(keys=[apb.ApiKeyInfo(id="4mapalz2c5", tenant="acme")], spent=[row])
    text = _render_keys(_KeysStub(), keys, "json")
    (key,) = json.loads(text)["keys"]
    assert key["spent"] == {
        "day": 20270101,
        "day_tokens": 40,
        "month_tokens": 18805,
        "last_day": 20261231,
        "last_day_tokens": 2212,
        "last_month": 202612,
        "last_month_tokens": 20212,
    }
    assert "18805.0" not in text and "2212.0" not in text


def test_each_key_in_json_and_yaml_has_its_state_as_the_table_does() -> None:
    """Trial 52: the table's STATE (active, expired, revoked) was not in
    `key list -o json`; a script compared expires_at with its own clock."""
    keys = apb.ListKeysResponse(
        keys=[
            apb.ApiKeyInfo(id="a", tenant="acme"),
            apb.ApiKeyInfo(id="b", tenant="acme", expires_at=time.time() + 3600),
            apb.ApiKeyInfo(id="c", tenant="acme", expires_at=time.time() - 1),
            apb.ApiKeyInfo(id="d", tenant="acme", revoked=True, expires_at=time.time() - 1),
        ],
    )
    _, rows = _rows_keys(keys)
    in_table = [row[-1] for row in rows]
    assert in_table == ["active", "active", "expired", "revoked"]
    for output, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        shown = load(_render_keys(_KeysStub(), keys, output))["keys"]
        assert [k["state"] for k in shown] == in_table


def test_an_empty_list_of_the_response_is_an_empty_list_not_left_out() -> None:
    """Trial 52: `key list -o json` and `get audit -o json` printed `{}` with
    nothing to list (MessageToDict leaves empty lists out), and a script's
    `["keys"]` failed. Within the items, fields stay as they were."""
    for output, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        assert load(_render_keys(_KeysStub(), apb.ListKeysResponse(), output)) == {
            "keys": [],
            "spent": [],
        }
        audit = load(render(apb.ListAuditResponse(), output, lambda _: ""))
        assert audit == {"entries": []}
        proxies = apb.ListProxiesResponse(proxies=[apb.ProxyStatus(acked_version=3)])
        assert load(render(proxies, output, lambda _: "")) == {
            "proxies": [{"acked_version": 3}],
        }


def test_repeated_and_nested_wide_integers_are_numbers() -> None:
    resp = apb.ListProxiesResponse(
        proxies=[apb.ProxyStatus(acked_version=7, replica_version=9)], current_version=9
    )
    data = json.loads(render(resp, "json", lambda _: ""))
    assert data["current_version"] == 9
    assert data["proxies"][0]["acked_version"] == 7 and data["proxies"][0]["replica_version"] == 9


def test_no_map_or_list_in_the_api_holds_wide_integers() -> None:
    """as_numbers passes maps by and takes a 64-bit field as one number: true
    while no map of the API holds a 64-bit integer or a message, and no
    repeated field is a 64-bit integer."""
    for module in (apb, pb):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for desc in _nested(message):
                for field in desc.fields:
                    if field.is_repeated:
                        assert field.type not in _WIDE_INTS, field.full_name
                    if field.message_type is not None and field.message_type.GetOptions().map_entry:
                        value = field.message_type.fields_by_name["value"]
                        assert value.type not in _WIDE_INTS, field.full_name
                        assert value.type != FieldDescriptor.TYPE_MESSAGE, field.full_name


def _nested(desc: Descriptor) -> list[Descriptor]:
    out = [desc]
    for inner in desc.nested_types:
        out += _nested(inner)
    return out


def test_the_table_summary_counts_purges_not_tenants_births() -> None:
    """Note 28: `get table` counted each tenant's birth (a purge the control
    plane adds) among its purges."""
    table = pb.RouteTable(
        version=9,
        etag="e" * 64,
        tenants=[pb.Tenant(name="acme"), pb.Tenant(name="free")],
        purges=[
            pb.CachePurge(revision=3, tenant="acme", birth=True),
            pb.CachePurge(revision=4, tenant="free", birth=True),
            pb.CachePurge(revision=7, tenant="acme", model="m"),
        ],
    )
    summary = _table_summary(apb.GetRouteTableResponse(table=table))
    assert "2 tenants" in summary and "1 purges;" in summary, summary
