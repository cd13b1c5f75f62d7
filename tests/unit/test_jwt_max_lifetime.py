"""A tenant's JWT max_lifetime_s, from an apply file to the proxy's verdict.

The path a topology file takes: `apply.parse` (what pontoctl and the Admin
API's Apply both run) reads and validates it into the model, the compiler
writes the route table, and the proxy builds its authenticator from the table.
"""

from __future__ import annotations

from collections.abc import Mapping

import jwt
import pytest

from controlplane import apply
from controlplane.compile import tenant_pb
from dataplane.auth.authenticator import AuthError
from dataplane.policy import build_policy
from ponto.v1 import routing_pb2 as pb

SECRET = "a-shared-secret-that-is-long-enough-for-hs256"
NOW = 1_900_000_000


def topology(jwt_block: Mapping[str, object]) -> dict[str, object]:
    block = {
        "issuer": "https://id.example",
        "audiences": ["ponto"],
        "algorithms": ["HS256"],
        "hs256_secret_env": "PONTO_TEST_JWT_SECRET",
        **jwt_block,
    }
    return {"tenants": [{"name": "acme", "jwt": block}]}


def verdict(jwt_block: Mapping[str, object], lifetime_s: int) -> str:
    """'ok' or the refusal's code for a token valid `lifetime_s` from now."""
    (tenant,) = apply.parse(topology(jwt_block)).tenants
    table = pb.RouteTable(tenants=[tenant_pb(tenant)], auth_required=True)
    auth = build_policy(table).authenticator
    claims = {"iss": "https://id.example", "aud": "ponto", "sub": "u", "iat": NOW}
    token = jwt.encode({**claims, "exp": NOW + lifetime_s}, SECRET, algorithm="HS256")
    try:
        auth.authenticate(f"Bearer {token}", NOW)
    except AuthError as exc:
        return exc.code
    return "ok"


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PONTO_TEST_JWT_SECRET", SECRET)


def test_default_is_a_day() -> None:
    assert verdict({}, 3600) == "ok"
    assert verdict({}, 86_400 + 30) == "ok"  # the default leeway
    assert verdict({}, 86_400 + 31) == "invalid_token"
    assert verdict({}, 95_617_584_000 - NOW) == "invalid_token"  # the year 5000


def test_the_files_max_lifetime_is_the_proxys() -> None:
    short = {"max_lifetime_s": 600, "leeway_s": 1}
    assert verdict(short, 601) == "ok"
    assert verdict(short, 602) == "invalid_token"
    assert verdict({"max_lifetime_s": 7 * 86_400}, 3 * 86_400) == "ok"


@pytest.mark.parametrize("value", [10, 10**9, float("inf")])
def test_out_of_range_is_refused_before_anything_is_stored(value: float) -> None:
    with pytest.raises(apply.ApplyError, match="max_lifetime_s"):
        apply.parse(topology({"max_lifetime_s": value}))


def test_a_wrong_type_is_an_apply_error() -> None:
    with pytest.raises(apply.ApplyError, match="max_lifetime_s"):
        apply.parse(topology({"max_lifetime_s": "a day"}))
