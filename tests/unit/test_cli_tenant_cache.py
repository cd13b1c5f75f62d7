"""`pontoctl tenant set NAME --semantic-max-error E` and `get tenants`, against a
fake Admin stub: the update sent, the local validation, the table row."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.cli import _parser, _rows_tenants, run
from controlplane.errors import InvalidArgument
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


class Stub:
    """The two Admin calls `tenant set` (and `limit set`) makes; keeps what
    was sent, and answers with the parts it sets applied."""

    def __init__(self, current: pb.Tenant) -> None:
        self.current = current
        self.updates: list[apb.UpdateTenantRequest] = []
        self.spent: list[apb.BudgetSpent] = []

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[self.current], spent=self.spent)

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        self.updates.append(req)
        merged = pb.Tenant()
        merged.CopyFrom(self.current)
        for part in ("limits", "cache", "routing"):
            if req.HasField(part):
                getattr(merged, part).CopyFrom(getattr(req, part))
        self.current = merged
        return merged


def tenant_set(stub: Any, *flags: str) -> str:
    return run(_parser().parse_args(["tenant", "set", "acme", *flags]), stub)


def test_semantic_max_error_is_sent_and_keeps_the_rest_of_the_cache_policy() -> None:
    stub = Stub(pb.Tenant(name="acme", cache=pb.CachePolicy(mode="semantic", ttl_s=60)))
    assert "tenant acme saved" in tenant_set(stub, "--semantic-max-error", "0.01")
    [update] = stub.updates
    assert update.cache.semantic_max_error == pytest.approx(0.01)
    assert (update.cache.mode, update.cache.ttl_s) == ("semantic", 60)
    # --semantic-threshold still sets the fixed threshold (and the bound's prior).
    tenant_set(stub, "--semantic-threshold", "0.93")
    assert stub.current.cache.semantic_threshold == pytest.approx(0.93)
    assert stub.current.cache.semantic_max_error == pytest.approx(0.01)
    # 0 turns the bound off: the fixed threshold again.
    tenant_set(stub, "--semantic-max-error", "0")
    assert stub.current.cache.semantic_max_error == 0


@pytest.mark.parametrize("bad", ["0.5", "-0.01"])
def test_a_bound_out_of_range_is_refused_before_the_update(bad: str) -> None:
    stub = Stub(pb.Tenant(name="acme"))
    with pytest.raises(InvalidArgument, match="semantic max error"):
        tenant_set(stub, "--semantic-max-error", bad)
    assert stub.updates == []


def test_a_bound_of_nan_is_refused_as_it_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    stub = Stub(pb.Tenant(name="acme"))
    with pytest.raises(SystemExit):
        tenant_set(stub, "--semantic-max-error", "nan")
    assert "must be a finite number, not 'nan'" in capsys.readouterr().err
    assert stub.updates == []


def test_get_tenants_shows_the_bound_beside_the_threshold() -> None:
    resp = apb.ListTenantsResponse(
        tenants=[
            pb.Tenant(
                name="acme",
                cache=pb.CachePolicy(
                    mode="semantic", semantic_threshold=0.9, semantic_max_error=0.01
                ),
            ),
            pb.Tenant(name="plain", cache=pb.CachePolicy(mode="semantic")),
        ]
    )
    header, rows = _rows_tenants(resp)
    cache = header.index("CACHE")
    assert rows[0][cache] == "semantic@0.9,max-err=0.01"
    assert rows[1][cache] == "semantic"


def test_the_tenants_table_shows_the_max_tokens_ceiling() -> None:
    """Trial 35: a ceiling set with `tenant set --max-tokens` showed nowhere."""
    resp = apb.ListTenantsResponse(
        tenants=[
            pb.Tenant(
                name="acme",
                limits=pb.Limits(rpm=60),
                prompt=pb.PromptPolicy(max_tokens_ceiling=512),
            ),
            pb.Tenant(name="capped", prompt=pb.PromptPolicy(max_tokens_ceiling=16)),
            pb.Tenant(name="plain"),
        ]
    )
    header, rows = _rows_tenants(resp)
    assert [row[header.index("LIMITS")] for row in rows] == [
        "rpm=60,max_tokens<=512",
        "max_tokens<=16",
        "-",
    ]


def test_limit_set_takes_the_budgets_and_the_table_shows_what_was_spent() -> None:
    stub = Stub(pb.Tenant(name="acme", limits=pb.Limits(rpm=60)))
    args = ["limit", "set", "--tenant", "acme", "--tokens-per-day", "2000000"]
    out = run(_parser().parse_args(args), stub)
    assert out == "limits of tenant acme set: rpm=60 tokens_per_day=2000000 (were: rpm=60)"
    [update] = stub.updates
    assert (update.limits.rpm, update.limits.tokens_per_day) == (60, 2000000)
    # What the leader counted, beside the budgets; nothing counted yet is 0.
    resp = apb.ListTenantsResponse(
        tenants=[
            pb.Tenant(name="acme", limits=pb.Limits(tokens_per_day=2000, tokens_per_month=9000)),
            pb.Tenant(name="new", limits=pb.Limits(tokens_per_day=5)),
        ],
        spent=[apb.BudgetSpent(scope="t/acme", day=20261205, day_tokens=1234.4, month_tokens=4321)],
    )
    header, rows = _rows_tenants(resp)
    assert [row[header.index("LIMITS")] for row in rows] == [
        "tokens/day=2000,tokens/month=9000,spent/day=1234,spent/month=4321",
        "tokens/day=5",  # nothing counted yet
    ]


def test_a_setting_the_tenant_has_is_unchanged_but_an_unknown_tenant_is_asked() -> None:
    stub = Stub(pb.Tenant(name="acme", cache=pb.CachePolicy(mode="exact")))
    assert tenant_set(stub, "--cache", "exact") == (
        "tenant acme unchanged: it already has these settings"
    )
    assert stub.updates == []
    # A misspelt name: the defaults it "already has" are no answer; the control
    # plane's is (NOT_FOUND), so the update is sent.
    elsewhere = Stub(pb.Tenant(name="other"))
    tenant_set(elsewhere, "--continuation", "on")
    assert [u.name for u in elsewhere.updates] == ["acme"]


def test_tenant_set_says_the_routing_policy_it_leaves() -> None:
    """Trial: `--model-routing`, `--load-bound` and `--user-sessions` printed
    `(cache exact; routing default)` whatever they changed."""
    stub = Stub(pb.Tenant(name="acme", cache=pb.CachePolicy(mode="exact")))
    out = tenant_set(stub, "--model-routing", "embed=least-loaded").splitlines()
    assert out == [
        "tenant acme saved (cache exact; routing default,embed=least-loaded)",
        # What changed, as the audit trail says it (trial 35).
        '  changed: routing unset -> {"models":{"embed":"least-loaded"}}',
    ]
    out = tenant_set(stub, "--load-bound", "1.5", "--user-sessions", "on").splitlines()
    assert out[0] == (
        "tenant acme saved (cache exact; routing default,embed=least-loaded,user,bound=1.5)"
    )
    assert out[1] == (
        "  changed: routing.user_sessions false -> true; routing.load_bound unset -> 1.5"
    )
    last = tenant_set(stub, "--routing", "weighted", "--model-routing", "embed=default")
    saved = last.splitlines()[0]
    assert saved == "tenant acme saved (cache exact; routing weighted,user,bound=1.5)"


def test_limit_set_says_what_it_changed_and_a_budget_that_works_otherwise_than_one_may_think() -> (
    None
):
    """Trial 42: a month budget under the day's, or one under what was spent,
    was taken without a word, and `limit set` did not say what it replaced."""
    stub = Stub(pb.Tenant(name="acme", limits=pb.Limits(rpm=60, tokens_per_day=5000)))
    stub.spent = [apb.BudgetSpent(scope="t/acme", day=20261205, day_tokens=2500, month_tokens=3007)]
    args = ["limit", "set", "--tenant", "acme", "--tokens-per-day", "3000"]
    out = run(_parser().parse_args([*args, "--tokens-per-month", "2000"]), stub)
    assert out.splitlines() == [
        "limits of tenant acme set: rpm=60 tokens_per_day=3000 tokens_per_month=2000 "
        "(were: rpm=60 tokens_per_day=5000)",
        "note: tokens_per_month 2000 is less than tokens_per_day 3000: the month's budget is "
        "reached first, and the day's never",
        "note: 3007 tokens were spent this month: the new month budget of 2000 is spent, and "
        "requests are refused until the 1st of next month, 00:00 UTC",
    ]
    # The day's budget under what was spent today; nothing changed says no "were".
    stub.current = pb.Tenant(name="acme", limits=pb.Limits(rpm=60, tokens_per_day=5000))
    out = run(
        _parser().parse_args(["limit", "set", "--tenant", "acme", "--tokens-per-day", "2500"]), stub
    )
    assert out.splitlines()[1:] == [
        "note: 2500 tokens were spent today: the new day budget of 2500 is spent, and requests "
        "are refused until 00:00 UTC"
    ]
    stub.current = pb.Tenant(name="acme", limits=pb.Limits(tokens_per_day=2500))
    sent = len(stub.updates)
    out = run(_parser().parse_args(["limit", "set", "--tenant", "acme", "--rpm", "0"]), stub)
    # Nothing to change: said so, and nothing written (trial 54: a write was audited).
    assert out.splitlines()[0] == "limits of tenant acme unchanged: tokens_per_day=2500"
    assert len(stub.updates) == sent
