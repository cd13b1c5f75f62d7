"""A tenant's JWT config that a proxy cannot load costs that tenant's JWTs only.

Before, it refused (NACKed) the whole route table: every proxy stayed on its
previous table, so drains, new keys and revocations of every tenant stopped
reaching it. Now the table is applied and ACKed, the tenant's JWTs are answered
503 auth_unavailable, its API keys keep working, the problem is logged once per
table, reported with the ACK and exported as a metric.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jwt
import pytest
from prometheus_client import generate_latest

from dataplane.http.errors import ApiError, AuthUnavailableError
from dataplane.http.pipeline import authenticate
from dataplane.metrics import Metrics
from dataplane.policy import build_policy
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

ISSUER = "https://idp.badjwt.example"
SECRET = "an-hs256-secret-that-is-long-enough-0123456789"
ACME_KEY, BAD_KEY = issue_key(), issue_key()
PROBLEM = (
    "JWT config of tenant 'badjwt': JWKS file '/nonexistent': cannot read: "
    "No such file or directory"
)


def table(version: int, jwks_file: str = "/nonexistent") -> pb.RouteTable:
    """Tenants acme (an API key) and badjwt (an API key and a JWT issuer whose
    JWKS file is `jwks_file`)."""
    t = pb.RouteTable(
        version=version,
        regions=[pb.Region(name="eu-west", latitude=53.0, longitude=-6.0)],
        origins=[
            pb.Origin(
                name="o-eu",
                base_url="http://o-eu.example/v1",
                region="eu-west",
                models=["llama"],
                weight=100,
                healthy=True,
            )
        ],
        tenants=[
            pb.Tenant(name="acme"),
            pb.Tenant(
                name="badjwt",
                jwt=pb.JwtIssuer(issuer=ISSUER, algorithms=["RS256"], jwks_file=jwks_file),
            ),
        ],
        keys=[
            pb.ApiKey(id=k.key_id, hash=k.key_hash, tenant=name)
            for k, name in ((ACME_KEY, "acme"), (BAD_KEY, "badjwt"))
        ],
        auth_required=True,
    )
    t.etag = content_etag(t)
    return t


def token() -> str:
    """A JWT of badjwt's issuer (whatever its signature: the proxy cannot check it)."""
    claims = {"iss": ISSUER, "sub": "u1", "exp": 4_000_000_000}
    return jwt.encode(claims, SECRET, algorithm="HS256")


def test_the_tenants_jwts_are_a_503_and_everything_else_works() -> None:
    policy = build_policy(table(3))
    assert dict(policy.authenticator.problems) == {"badjwt": PROBLEM}
    with pytest.raises(ApiError) as refused:
        authenticate(policy, f"Bearer {token()}")
    assert refused.value.status == 503
    body = json.loads(refused.value.response().body)  # type: ignore[arg-type]
    assert body["error"]["type"] == "server_error"
    assert body["error"]["code"] == "auth_unavailable"
    assert "cannot verify tokens from this issuer" in body["error"]["message"]
    assert "nonexistent" not in body["error"]["message"]
    # Its cause is logged where the table was applied; the refusal, as every
    # refusal is (the boundary's rate-limited line), as the tenant's.
    assert not refused.value.logged
    assert isinstance(refused.value, AuthUnavailableError)
    assert refused.value.owner.tenant == "badjwt"
    # Both tenants' API keys work.
    assert authenticate(policy, f"Bearer {BAD_KEY.key}").tenant == "badjwt"
    assert authenticate(policy, f"Bearer {ACME_KEY.key}").tenant == "acme"


@pytest.mark.parametrize(
    "content",
    [
        None,
        b"not json",
        b'{"keys": "nope"}',
        b'{"keys": []}',
        # Review 44: an alg that is no string raised TypeError out of the
        # table's compilation (the whole table refused), and deep nesting
        # RecursionError.
        b'{"keys": [{"kty": "RSA", "kid": "x", "alg": []}]}',
        b"[" * 100_000,
    ],
    ids=["missing", "not-json", "keys-not-list", "no-keys", "alg-list", "deep"],
)
def test_any_broken_jwks_file_is_the_tenants_problem(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "jwks.json"
    if content is not None:
        path.write_bytes(content)
    policy = build_policy(table(3, jwks_file=str(path)))
    assert list(policy.authenticator.problems) == ["badjwt"]
    assert authenticate(policy, f"Bearer {ACME_KEY.key}").tenant == "acme"


def test_the_table_is_applied_acked_with_the_problem_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    holder = TableHolder("eu-west", None)
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(holder, ["127.0.0.1:1"], info)
    with caplog.at_level(logging.ERROR, logger="dataplane.sync.holder"):
        ack = link._handle("s-1", pb.RouteUpdate(table=table(7), nonce="n7"))
        # The same content again, under a newer version: not logged again.
        again = link._handle("s-1", pb.RouteUpdate(table=table(8), nonce="n8"))
    # ACKs, not NACKs: the table is served.
    assert (ack.version_info, ack.error_detail, again.version_info) == (7, "", 8)
    assert holder.routes is not None and holder.routes.version == 8
    assert link.nacks == 0
    # Each ACK says what the proxy cannot use of it.
    expected = (
        f"{PROBLEM}; that tenant's JWTs are answered 503 auth_unavailable (its API keys still work)"
    )
    assert list(ack.warnings) == list(again.warnings) == [expected]
    [logged] = [r for r in caplog.records if "badjwt" in r.getMessage()]
    assert logged.getMessage().startswith(PROBLEM)
    assert "503 auth_unavailable" in logged.getMessage()
    assert logged.exc_info is None


def loading_table(tmp_path: Path) -> pb.RouteTable:
    """table(3) with a JWKS file that loads (badjwt's issuer takes HS256)."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0" * 6}]}))
    t = table(3, jwks_file=str(jwks))
    t.tenants[1].jwt.algorithms[:] = ["HS256"]
    t.etag = content_etag(t)
    return t


def link_of(holder: TableHolder) -> ControlPlaneClient:
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    return ControlPlaneClient(holder, ["127.0.0.1:1"], info)


def test_a_table_whose_configs_all_load_acks_without_warnings(tmp_path: Path) -> None:
    ack = link_of(TableHolder("eu-west", None))._handle(
        "s-1", pb.RouteUpdate(table=loading_table(tmp_path), nonce="n3")
    )
    assert (ack.version_info, ack.error_detail, list(ack.warnings)) == (3, "", [])


def test_reports_carry_the_warnings_only_when_they_changed(tmp_path: Path) -> None:
    """Trial 26: what a proxy cannot use of its table may change between two
    tables (a JWKS URL's set fetched late, a part of the proxy that takes the
    table again); the next report tells the whole list, an empty one when
    none is left, and later reports leave it out until it changes again."""
    holder = TableHolder("eu-west", None)
    link = link_of(holder)

    def told(report: pb.RouteRequest) -> list[str] | None:
        return list(report.warnings) if report.warnings_current else None

    assert told(link.report("s-1")) is None  # no table, nothing to tell
    ack = link._handle("s-1", pb.RouteUpdate(table=loading_table(tmp_path), nonce="n3"))
    assert list(ack.warnings) == []
    assert told(link.report("s-1")) is None
    holder.apply_failures = ("QuotaState.on_table: boom",)
    expected = [
        "a part of this proxy could not take the table (QuotaState.on_table: boom); it "
        "keeps its previous settings (a bug: see the proxy's log)"
    ]
    assert told(link.report("s-1")) == expected
    assert told(link.report("s-1")) is None
    holder.apply_failures = ()
    assert told(link.report("s-1")) == []
    assert told(link.report("s-1")) is None
    # What an ACK told, a report does not repeat.
    ack = link._handle("s-1", pb.RouteUpdate(table=table(4), nonce="n4"))
    assert len(ack.warnings) == 1
    assert told(link.report("s-1")) is None


def test_the_metric_names_the_tenant() -> None:
    holder = TableHolder("eu-west", None)
    metrics = Metrics()
    metrics.bind_auth(lambda: holder.policy.authenticator.problems if holder.policy else {})
    name = "ponto_jwt_config_unavailable"
    assert f'{name}{{tenant="badjwt"}}' not in generate_latest(metrics.registry).decode()
    holder.apply(table(3), "control-plane")
    assert f'{name}{{tenant="badjwt"}} 1.0' in generate_latest(metrics.registry).decode()
