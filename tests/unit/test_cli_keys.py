"""`pontoctl key`: expiry durations go to the control plane as durations, and
a control plane that drops the expiry is called out; descriptions are one line
of text shown as it is."""

from __future__ import annotations

import re
from typing import Any

import grpc
import pytest

from controlplane.cli import (
    KEY_WAIT_EVERY_S,
    KEY_WAIT_S,
    UsageError,
    _not_taken,
    _parser,
    _rows_keys,
    run,
)
from controlplane.errors import InvalidArgument
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import admin


class Stub:
    """Records the requests; answers as a control plane would, or as one that
    predates key expiry (`expiry` False: the field is dropped)."""

    keys: tuple[apb.ApiKeyInfo, ...] = ()

    def __init__(self, *, expiry: bool = True) -> None:
        self.expiry = expiry
        self.requests: list[Any] = []

    def CreateKey(self, req: apb.CreateKeyRequest) -> apb.CreateKeyResponse:
        self.requests.append(req)
        at = 1_900_000_000.0 + req.expires_in_s if self.expiry and req.expires_in_s else 0.0
        key = apb.ApiKeyInfo(id="abcdefghij", tenant=req.tenant, expires_at=at)
        return apb.CreateKeyResponse(key=key, secret="sk-ponto-abcdefghij-SECRET")

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        self.requests.append(req)
        return apb.ListKeysResponse(keys=self.keys)

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[pb.Tenant(name="acme")])

    def ListOrigins(self, req: apb.ListRequest) -> apb.ListOriginsResponse:
        return apb.ListOriginsResponse(origins=[pb.Origin(name="o1", models=["sim-small"])])

    def RevokeKey(self, req: apb.KeyRequest) -> apb.ApiKeyInfo:
        self.requests.append(req)
        return apb.ApiKeyInfo(id=req.id, tenant="acme", revoked=True)

    def SetKeyExpiry(self, req: apb.SetKeyExpiryRequest) -> apb.ApiKeyInfo:
        self.requests.append(req)
        at = 1_900_000_000.0 + req.expires_in_s if req.expires_in_s else 0.0
        return apb.ApiKeyInfo(id=req.id, tenant="acme", expires_at=at)


def pontoctl(stub: Stub, *argv: str) -> str:
    return run(_parser().parse_args(list(argv)), stub)


def test_durations_are_sent_as_durations_for_the_control_planes_clock() -> None:
    stub = Stub()
    out = pontoctl(stub, "key", "create", "--tenant", "acme", "--expires-in", "2h")
    assert stub.requests[0].expires_in_s == 7200 and stub.requests[0].expires_at == 0
    assert out.splitlines()[0].startswith("key abcdefghij created for tenant acme, expiring 2030")
    assert out.splitlines()[-1] == "sk-ponto-abcdefghij-SECRET"
    assert "expires 2030" in pontoctl(stub, "key", "expire", "abcdefghij", "--in", "7d")
    assert stub.requests[1].expires_in_s == 7 * 86400
    assert "no longer expires" in pontoctl(stub, "key", "expire", "abcdefghij", "--never")
    assert (stub.requests[2].expires_in_s, stub.requests[2].expires_at) == (0, 0)


def test_a_control_plane_that_drops_the_expiry_is_called_out() -> None:
    out = pontoctl(Stub(expiry=False), "key", "create", "--tenant", "acme", "--expires-in", "1h")
    assert "WITHOUT AN EXPIRY" in out.splitlines()[0]
    assert "pontoctl key expire abcdefghij --in" in out
    assert out.splitlines()[-1] == "sk-ponto-abcdefghij-SECRET"  # still shown, last
    plain = pontoctl(Stub(expiry=False), "key", "create", "--tenant", "acme")
    assert "EXPIRY" not in plain and "expiring" not in plain


def test_key_list_has_one_field_per_column_and_says_expired() -> None:
    resp = apb.ListKeysResponse(
        keys=[
            apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme", created_at=1.7e9),
            apb.ApiKeyInfo(id="bbbbbbbbbb", tenant="acme", created_at=1.7e9, expires_at=1.0),
            apb.ApiKeyInfo(
                id="cccccccccc", tenant="acme", limits=pb.Limits(rpm=5), revoked=True, expires_at=1
            ),
        ]
    )
    header, rows = _rows_keys(resp)
    assert header[-2:] == ["EXPIRES", "STATE"]
    lines = [" ".join(row).split() for row in rows]
    assert all(len(line) == len(header) for line in lines)
    assert [line[-1] for line in lines] == ["active", "expired", "revoked"]
    assert lines[1][header.index("EXPIRES")] == "1970-01-01T00:00:01Z"


def test_key_list_shows_limits_as_get_tenants_does_in_one_field() -> None:
    """They read "tpm=100 concurrency=2 tokens_per_day=500 spent/day=99":
    other names than `get tenants`' and spaces that split the column."""
    limits = pb.Limits(tpm=100, concurrency=2, tokens_per_day=500, tokens_per_month=900)
    resp = apb.ListKeysResponse(
        keys=[apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme", limits=limits, created_at=1.7e9)],
        spent=[apb.BudgetSpent(scope="k/aaaaaaaaaa", day=20261205, day_tokens=99.4)],
    )
    header, [row] = _rows_keys(resp)
    assert (
        row[header.index("LIMITS")] == "tpm=100,conc=2,tokens/day=500,tokens/month=900,spent/day=99"
    )
    assert len(" ".join(row).split()) == len(header)


def test_a_revoked_key_of_a_deleted_tenant_says_its_tenant_is_deleted() -> None:
    stub = Stub()
    stub.keys = (
        apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme"),
        apb.ApiKeyInfo(id="bbbbbbbbbb", tenant="initech", revoked=True),
    )
    for argv in (("get", "keys"), ("key", "list")):
        rows = [line.split() for line in pontoctl(stub, *argv).splitlines()[1:]]
        assert [row[:2] for row in rows] == [
            ["aaaaaaaaaa", "acme"],
            ["bbbbbbbbbb", "initech(deleted)"],
        ]


def test_active_keys_are_neither_revoked_nor_expired() -> None:
    stub = Stub()
    stub.keys = (
        apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme"),
        apb.ApiKeyInfo(id="bbbbbbbbbb", tenant="acme", expires_at=1.0),
        apb.ApiKeyInfo(id="cccccccccc", tenant="acme", expires_at=4e9),
    )
    listed = pontoctl(stub, "key", "list", "--active")
    assert "aaaaaaaaaa" in listed and "cccccccccc" in listed
    assert "bbbbbbbbbb" not in listed
    assert not stub.requests[0].include_revoked


def test_revoking_a_revoked_key_says_so_and_changes_nothing() -> None:
    """Trial 48: it printed "revoked" again, as if this call had revoked it."""
    stub = Stub()
    stub.keys = (
        apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme"),
        apb.ApiKeyInfo(id="bbbbbbbbbb", tenant="acme", revoked=True, revoked_at=1.7e9),
    )
    assert pontoctl(stub, "key", "revoke", "bbbbbbbbbb") == (
        "key bbbbbbbbbb of tenant acme was already revoked: nothing changed"
    )
    assert not any(isinstance(r, apb.KeyRequest) for r in stub.requests)  # no revoke sent
    assert pontoctl(stub, "key", "revoke", "aaaaaaaaaa") == "key aaaaaaaaaa of tenant acme revoked"
    assert apb.KeyRequest(id="aaaaaaaaaa") in stub.requests


def test_purge_all_with_a_scope_is_refused() -> None:
    with pytest.raises(UsageError, match="--all purges everything"):
        pontoctl(Stub(), "cache", "purge", "--all", "--tenant", "acme")


# Trial: `key create --description $'line1\nline2\t\x1b[31mred\x1b[0m'` was
# saved, and `key list` printed it raw: the row split over two lines, the
# escape recoloured the terminal.
RAW = "line1\nline2\t\x1b[31mred\x1b[0m\u202e"


@pytest.mark.parametrize("hidden", ["\n", "\t", "\x1b", "\x7f", "\u202e", "\u2066", "\u2028"])
def test_a_key_description_with_a_hidden_character_is_refused_before_the_call(
    hidden: str,
) -> None:
    stub = Stub()
    said = f"key description holds the hidden character {hidden!a} (character 4)"
    with pytest.raises(InvalidArgument, match=re.escape(said)):
        pontoctl(stub, "key", "create", "--tenant", "acme", "--description", f"ops{hidden}x")
    assert stub.requests == []
    # Text of any script, emoji sequences with their joiner, is not hidden;
    # nor the marks of mixed-direction text, a flag's tags, a soft hyphen
    # (review 39: all format characters were refused).
    shown = [
        "clé de l'équipe ✓",
        "家族 👨\u200d👩\u200d👧",
        "نص",
        "עברית\u200e (v2)",
        "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f team",
        "re\u00adcovery",
    ]
    for description in shown:
        pontoctl(stub, "key", "create", "--tenant", "acme", "--description", description)
    assert [r.description for r in stub.requests] == shown


async def test_the_admin_api_refuses_a_key_description_with_a_hidden_character() -> None:
    async with admin(MemoryStore()) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", description=RAW))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "key description holds the hidden character '\\n' (character 6): "
            "give one line of printable text"
        )
        assert (await stub.ListKeys(apb.ListKeysRequest())).keys == []


def test_key_list_escapes_what_a_stored_description_hides() -> None:
    # Stored before descriptions were checked: one row, no escape reaches the terminal.
    stub = Stub()
    stub.keys = (apb.ApiKeyInfo(id="aaaaaaaaaa", tenant="acme", description=RAW),)
    out = pontoctl(stub, "key", "list")
    assert len(out.splitlines()) == 2 and "\x1b" not in out and "\u202e" not in out
    assert "line1\\nline2\\t\\x1b[31mred\\x1b[0m\\u202e" in out.splitlines()[1]


class _Proxies:
    """ListProxies of proxies whose acked versions move as `acks` says, one step per call."""

    def __init__(self, acks: list[dict[str, int]]) -> None:
        self._acks = acks
        self.calls = 0

    def ListProxies(self, request: apb.ListRequest) -> apb.ListProxiesResponse:
        acks = self._acks[min(self.calls, len(self._acks) - 1)]
        self.calls += 1
        return apb.ListProxiesResponse(
            proxies=[
                apb.ProxyStatus(info=pb.ProxyInfo(name=name), acked_version=v)
                for name, v in acks.items()
            ]
        )


def test_key_create_waits_for_the_proxies_to_take_the_key() -> None:
    """Trial 48: the key was refused for a moment after the command returned.
    `_not_taken` asks until every proxy ACKed a table of the key's revision,
    within KEY_WAIT_S, and names those that did not (clock injected)."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    catching_up = _Proxies([{"p1": 9, "p2": 9}, {"p1": 12, "p2": 9}, {"p1": 12, "p2": 13}])
    assert _not_taken(catching_up, 12, clock=lambda: now[0], sleep=sleep) == []
    assert catching_up.calls == 3
    stuck = _Proxies([{"p1": 12, "p2": 9, "p0": 3}])
    began = now[0]
    assert _not_taken(stuck, 12, clock=lambda: now[0], sleep=sleep) == ["p0", "p2"]
    assert KEY_WAIT_S <= now[0] - began < KEY_WAIT_S + 2 * KEY_WAIT_EVERY_S  # then gave up
    unsaid = _Proxies([{"p1": 0}])
    assert _not_taken(unsaid, 0) == [] and unsaid.calls == 0  # an older control plane


class _ListingFails(_Proxies):
    def __init__(self) -> None:
        super().__init__([{}])

    def CreateKey(self, request: apb.CreateKeyRequest) -> apb.CreateKeyResponse:
        key = apb.ApiKeyInfo(id="k1", tenant=request.tenant)
        return apb.CreateKeyResponse(key=key, secret="sk-ponto-k1-SECRET", revision=42)

    def ListProxies(self, request: apb.ListRequest) -> apb.ListProxiesResponse:
        raise _Unavailable()


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "etcd list failed"


def test_a_key_is_printed_even_when_its_proxies_cannot_be_asked() -> None:
    """Review of that wait (helper-191): the key was saved, and a failed
    ListProxies ended the command before its secret was printed."""
    said = run(_parser().parse_args(["key", "create", "--tenant", "acme"]), _ListingFails())
    assert said.splitlines()[-1] == "sk-ponto-k1-SECRET"
    assert "could not learn whether the proxies have it (UNAVAILABLE etcd list failed)" in said
