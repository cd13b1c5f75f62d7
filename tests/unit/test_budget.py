"""Day and month token budgets: the leader's ledger (controlplane.budget), a
proxy's reckoning of what is left (Budget.left, RateLimiter), and both
through the leader's round and a replica's push (controlplane.quotasync).
The same with real processes: tests/e2e/test_budgets.py."""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import datetime
import logging
import math
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from controlplane.budget import (
    FLOOR,
    FOLDED_DAYS,
    LEDGER_PREFIX,
    Ledger,
    account,
    budgets,
    decode_ledger,
    fitted,
    shares_of,
)
from controlplane.catalog import REPLICAS, Catalog
from controlplane.compile import compile_table
from controlplane.model import ApiKeyRecord, Limits, State, Tenant
from controlplane.quotasync import (
    COMPRESSED,
    DEMAND_PREFIX,
    LEDGER_ROUNDS,
    QUOTA_FORMAT,
    SHARES_KEY,
    QuotaHub,
    Rebalancer,
    _demand_of,
    _merged,
    decode_budgets,
    decode_shares,
    json_of,
    packed,
)
from controlplane.store import MAX_REQUEST_BYTES, StoreUnavailable
from controlplane.store.base import KeyValue
from controlplane.store.memory import MemoryStore
from dataplane.http.pipeline import refusal
from dataplane.ratelimit import Share
from dataplane.ratelimit.limiter import (
    CLOSED_REPORTS,
    FIRST_COMPLETION,
    MAX_CARRIED,
    RateLimiter,
)
from dataplane.sync import quota as quota_module
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from dataplane.sync.quota import (
    COUNTS_FILE,
    QUOTA_FILE,
    QuotaState,
    other_layouts,
)
from ponto.proxynames import layout_siblings, worker_name
from ponto.quota_types import (
    Budget,
    Demand,
    Reckoning,
    ScopeLimits,
    Spent,
    seconds_to_day_end,
    seconds_to_month_end,
    utc_day,
)
from ponto.v1 import routing_pb2 as pb
from tests.latestores import ListingStore
from tests.unit.test_quotasync import (
    Fleet,
    constant_lease,
    eventually,
    limited_table,
    running,
)

DAY = 20261205
NOON = calendar.timegm((2026, 12, 5, 12, 0, 0, 0, 0, 0))
SCOPE = "t/acme"
BUDGET = ScopeLimits(tokens_per_day=1000, tokens_per_month=5000)


def spent(epoch: float, day_tokens: float, month_tokens: float, day: int = DAY) -> Spent:
    return Spent(epoch, day, day_tokens, month_tokens)


# ---------------------------------------------------------------- periods


def test_the_utc_day_and_the_ends_of_day_and_month() -> None:
    assert utc_day(NOON) == DAY
    assert utc_day(NOON + 12 * 3600) == 20261206  # midnight is the next day
    assert seconds_to_day_end(NOON) == 12 * 3600
    # December's end: the year turns.
    assert seconds_to_month_end(NOON) == (26 * 24 + 12) * 3600
    assert utc_day(NOON + seconds_to_month_end(NOON)) == 20270101


# ---------------------------------------------------------------- the ledger


def test_reports_are_cumulative_per_process_and_summed_over_the_fleet() -> None:
    ledger = account(None, {"p1": spent(1.0, 100, 300), "p2": spent(2.0, 50, 50)}, DAY)
    assert ledger.used() == (150, 350)
    # A report replaces its process's last: read twice, or lost once, the same.
    ledger = account(ledger, {"p1": spent(1.0, 120, 320)}, DAY)
    ledger = account(ledger, {"p1": spent(1.0, 120, 320)}, DAY)
    assert ledger.used() == (170, 370)


def test_a_restarted_proxy_starts_from_nothing_and_its_former_counts_stay() -> None:
    ledger = account(None, {"p1": spent(1.0, 100, 300)}, DAY)
    ledger = account(ledger, {"p1": spent(9.0, 5, 5)}, DAY)  # the same name, a new process
    assert ledger.used() == (105, 305)


def test_a_new_day_counts_from_nothing_and_a_new_month_too() -> None:
    ledger = account(None, {"p1": spent(1.0, 100, 300)}, DAY)
    tomorrow = 20261206
    # p1 has not turned its day yet: its counts are yesterday's, its month's stand.
    ledger = account(ledger, {"p1": spent(1.0, 100, 300)}, tomorrow)
    assert ledger.day == tomorrow and ledger.used() == (0, 300)
    ledger = account(ledger, {"p1": spent(1.0, 7, 307, day=tomorrow)}, tomorrow)
    assert ledger.used() == (7, 307)
    january = account(ledger, {}, 20270101)
    assert january.used() == (0, 0) and not january.seen
    # A proxy whose clock is still in December is left out of January.
    assert account(january, {"p1": spent(1.0, 9, 316, day=20261231)}, 20270101).used() == (0, 0)


def test_a_ledger_follows_the_leaders_clock_but_never_back_a_month() -> None:
    """A former leader whose clock ran a day ahead must not leave the day's
    count on tomorrow (every report of today would count for nothing);
    one a month ahead must not have its month dropped by a slow clock."""
    ledger = account(None, {"p1": spent(1.0, 10, 10, day=DAY + 1)}, DAY + 1)
    back = account(ledger, {"p1": spent(1.0, 5, 15)}, DAY)
    assert back.day == DAY and back.used() == (5, 15)
    january = account(None, {"p1": spent(1.0, 10, 10, day=20270101)}, 20270101)
    assert account(january, {}, DAY).day == 20270101


def test_processes_silent_two_days_are_folded_into_the_month() -> None:
    ledger = account(None, {"old": spent(1.0, 40, 400, day=20261201)}, 20261201)
    ledger = account(ledger, {"new": spent(2.0, 10, 10, day=20261203)}, 20261203)
    assert set(ledger.seen) == {"new@2.0"} and ledger.month_gone == 400
    assert ledger.used() == (10, 410)


def test_a_process_folded_and_heard_from_again_is_counted_once() -> None:
    """Folded after two silent days, a process's later report (cumulative:
    it holds what was folded) was added on top; one whose clock is days
    behind was folded again every round, its month growing without end."""
    ledger = account(None, {"p1": spent(1.0, 40, 400, day=20261201)}, 20261201)
    ledger = account(ledger, {}, 20261203)  # partitioned: folded
    assert ledger.used() == (0, 400) and not ledger.seen
    back = account(ledger, {"p1": spent(1.0, 10, 410, day=20261203)}, 20261203)
    assert back.used() == (10, 410) and back.month_gone == 0
    # Days behind: folded each round, counted once.
    behind = ledger
    for month_tokens in (450, 450, 460):
        behind = account(behind, {"p1": spent(1.0, 5, month_tokens, day=20261201)}, 20261203)
    assert behind.used() == (0, 460) and behind.folded == {"p1@1.0": (460, 20261203)}
    assert decode_ledger(behind.encode()) == behind


def test_a_folded_process_is_forgotten_a_week_on() -> None:
    """`folded` kept every process folded in the month: with a restart a day
    on 200 proxies, thousands of keys a ledger, and ledgers past what etcd
    takes in one request. A key goes FOLDED_DAYS after its fold (one heard
    from after is counted twice: more, not less); its count stays."""
    ledger = account(None, {"p1": spent(1.0, 40, 400, day=20261201)}, 20261201)
    ledger = account(ledger, {}, 20261203)
    assert ledger.folded == {"p1@1.0": (400, 20261203)}
    week = _after(20261203, FOLDED_DAYS - 1)
    assert account(ledger, {}, week).folded == {"p1@1.0": (400, 20261203)}
    gone = account(ledger, {}, _after(20261203, FOLDED_DAYS))
    assert not gone.folded and gone.used() == (0, 400)
    # A ledger written before the folds' days: folded on the ledger's day.
    old = decode_ledger(b'{"day": 20261203, "month_gone": 400, "folded": {"p1@1.0": 400}}')
    assert old.folded == {"p1@1.0": (400, 20261203)}


def _after(day: int, days: int) -> int:
    d = datetime.date(day // 10000, day // 100 % 100, day % 100) + datetime.timedelta(days=days)
    return d.year * 10000 + d.month * 100 + d.day


def test_a_late_report_of_an_earlier_day_is_left_out() -> None:
    """A replica that stopped keeps its key, and its last reports, until its
    lease ends: the count of yesterday replaced today's, and took back what
    the fleet had spent."""
    ledger = account(None, {"p1": spent(1.0, 60, 300, day=DAY + 1)}, DAY + 1)
    late = account(ledger, {"p1": spent(1.0, 200, 250)}, DAY + 1)
    assert late.used() == (60, 300)
    # A clock stepped back a day, counting on: taken.
    back = account(ledger, {"p1": spent(1.0, 10, 310)}, DAY + 1)
    assert back.seen["p1@1.0"].month_tokens == 310


def test_a_proxy_is_reckoned_by_its_report_as_the_ledger_took_it() -> None:
    """A report the ledger left out (late, or no numbers) still went back to
    its proxy as its count, and the proxy took off less than it spent."""
    ledger = account(None, {"p1": spent(1.0, 60, 300, day=DAY + 1)}, DAY + 1)
    late = {"p1": spent(1.0, 200, 250)}
    b = budgets(BUDGET, account(ledger, late, DAY + 1), late, ["p1"])["p1"]
    assert (b.epoch, b.day, b.spent_day, b.spent_month) == (1.0, DAY + 1, 60, 300)
    nan = {"p1": spent(2.0, math.nan, 5, day=DAY + 1)}
    b = budgets(BUDGET, account(ledger, nan, DAY + 1), nan, ["p1"])["p1"]
    assert (b.epoch, b.spent_month) == (1.0, 300)  # its last counted process
    # Folded as it reports (a clock days behind): counted in the month, its own.
    behind = {"p2": spent(3.0, 5, 70, day=DAY - 2)}
    folded = account(ledger, behind, DAY + 1)
    b = budgets(BUDGET, folded, behind, ["p2"])["p2"]
    assert folded.month_gone == 70 and (b.epoch, b.spent_month) == (3.0, 70)


def test_a_ledger_with_folded_days_reads_as_before_to_an_older_leader() -> None:
    """The fold days went into `folded` as [count, day]: a leader from before
    them (a failover mid-rollout, or a rollback) read a list where it took a
    number, refused the whole ledger, and counted the month from nothing."""
    ledger = account(None, {"p1": spent(1.0, 40, 400, day=20261201)}, 20261201)
    ledger = account(ledger, {}, 20261203)
    data = orjson.loads(ledger.encode())
    assert data["folded"] == {"p1@1.0": 400}  # what older leaders read: float(v)
    assert data["folded_on"] == {"p1@1.0": 20261203}
    assert decode_ledger(ledger.encode()) == ledger
    # As one build wrote them, [count, day]: read, not refused.
    one_build = b'{"day": 20261203, "month_gone": 400, "folded": {"p1@1.0": [400, 20261203]}}'
    assert decode_ledger(one_build).folded == {"p1@1.0": (400, 20261203)}


def test_a_report_of_a_day_that_is_no_date_is_left_out() -> None:
    """Kept, it made the ledger unreadable to the next leader, which then
    counted the month again from nothing."""
    ledger = account(None, {"p1": spent(1.0, 10, 10)}, DAY)
    ledger = account(ledger, {"p2": spent(2.0, 5, 5, day=20261200)}, DAY)
    assert set(ledger.seen) == {"p1@1.0"}
    assert decode_ledger(ledger.encode()) == ledger


def test_counts_that_are_no_numbers_are_left_out() -> None:
    bad = account(None, {"p1": spent(1.0, math.nan, 5), "p2": spent(2.0, -3, 5)}, DAY)
    assert not bad.seen


def test_a_ledger_survives_its_encoding() -> None:
    ledger = account(None, {"p1": spent(1.5, 100, 300), "p2": spent(2.25, 1, 2)}, DAY)
    again = decode_ledger(ledger.encode())
    assert again == ledger
    # A ledger written before folded processes were kept.
    old = decode_ledger(b'{"day": 20261205, "month_gone": 7, "seen": {}}')
    assert old == Ledger(DAY, 7.0) and old.used() == (0, 7)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"seen": {}}',
        b"null",
        b"[]",
        b'{"day": 20261399}',
        b'{"day": "x"}',
        b'{"day": 20261205, "seen": []}',
        b'{"day": 20261205, "seen": {"p@1": [1.0, 20261232, 1, 1]}}',
        b'{"day": 20261205, "seen": {"p@1": [1.0]}}',
        b'{"day": 20261205, "folded": {"p@1": null}}',
        b"{",
    ],
)
def test_a_ledger_that_is_not_one_is_refused_as_such(raw: bytes) -> None:
    """Anything else (AttributeError, a day that is no date past the read)
    stopped the leader's quota task."""
    with pytest.raises(ValueError):
        decode_ledger(raw)


def test_budgets_say_what_is_left_each_share_and_what_each_process_had_spent() -> None:
    reports = {"p1": spent(1.0, 600, 4500)}
    ledger = account(None, reports, DAY)
    out = budgets(BUDGET, ledger, reports, ["p1", "p2"], {"p1": 30.0})
    # p1 is asked for tokens, p2 not: p2 keeps a floor, so a client new there starts.
    assert out["p1"] == Budget(1.0, DAY, 400, 500, 600, 4500, out["p1"].share, 1000, 5000)
    assert out["p1"].share == pytest.approx(0.98)
    # p2 reported nothing: it takes off all it spends.
    assert out["p2"] == Budget(0.0, DAY, 400, 500, 0, 0, out["p2"].share, 1000, 5000)
    assert out["p2"].share == pytest.approx(0.02)
    assert out["p1"].share + out["p2"].share <= 1.0
    # No month budget: inf; spent past the budget: nothing left, not less.
    over = budgets(ScopeLimits(tokens_per_day=500), ledger, reports, ["p1"])["p1"]
    assert (over.day_left, over.month_left) == (0.0, math.inf)


def test_a_proxy_not_heard_this_round_is_reckoned_by_its_last_count() -> None:
    """Without a report this round (late, or lost with a replica) a proxy got
    no count of its own and took off all its month again: a month budget
    half spent read as spent, and refused with insufficient_quota."""
    ledger = account(None, {"p1": spent(1.0, 600, 2500)}, DAY)
    ledger = account(ledger, {"p1": spent(3.0, 10, 10)}, DAY)  # restarted since
    b = budgets(BUDGET, ledger, {}, ["p1"])["p1"]
    assert (b.epoch, b.spent_day, b.spent_month) == (3.0, 10, 10)  # its newest process
    # The process still running: only what it spent since takes off.
    assert b.reckon(BUDGET, 3.0, DAY, day_used=10, month_used=10).month_fleet == 5000 - 2510
    # A name sharing a prefix is another proxy.
    assert budgets(BUDGET, ledger, {}, ["p"])["p"].epoch == 0.0


def test_shares_follow_the_tokens_asked_for_over_a_floor() -> None:
    assert shares_of(["a", "b"], {}) == {"a": pytest.approx(0.5), "b": pytest.approx(0.5)}
    five = shares_of(list("abcde"), {"a": 10.0, "b": 10.0})
    assert five["c"] == pytest.approx(0.02) and five["a"] == pytest.approx(0.47)
    assert math.fsum(five.values()) <= 1.0
    # Many proxies: the floors take a tenth in all.
    many = shares_of([f"p{i}" for i in range(20)], {"p0": 1.0})
    assert many["p1"] == pytest.approx(0.005) and many["p0"] == pytest.approx(0.905)


# ---------------------------------------------------------------- a proxy's reckoning


def test_a_process_takes_off_what_it_spent_since_the_count_others_all_they_spent() -> None:
    b = Budget(1.0, DAY, day_left=400, month_left=500, spent_day=600, spent_month=4500)
    assert b.reckon(BUDGET, 1.0, DAY, day_used=650, month_used=4550) == Reckoning(
        350, 450, 350, 450
    )
    # A process the leader did not count (started since): all of its own.
    other = b.reckon(BUDGET, 2.0, DAY, day_used=50, month_used=50)
    assert (other.day_fleet, other.month_fleet) == (350, 450)
    # A new day since the count: the whole day's budget less its own; same month.
    turned = b.reckon(BUDGET, 1.0, DAY + 1, day_used=10, month_used=4560)
    assert (turned.day_fleet, turned.month_fleet) == (990, 440)
    # No month budget.
    assert b.reckon(ScopeLimits(tokens_per_day=1000), 1.0, DAY, 650, 4550).month_fleet == math.inf
    # Its share: half of what is left, less what it spent since.
    half = Budget(1.0, DAY, 400, 500, 600, 4500, share=0.5)
    assert half.reckon(BUDGET, 1.0, DAY, 650, 4550) == Reckoning(350, 450, 150, 200)


def limiter_at_noon(limits: ScopeLimits = BUDGET) -> RateLimiter:
    limiter = RateLimiter(epoch=1.0)
    limiter.configure({SCOPE: limits}, 0.0)
    limiter.set_day(DAY, NOON, 0.0)
    return limiter


def test_a_proxy_refuses_once_the_budget_is_spent_until_the_day_ends() -> None:
    limiter = limiter_at_noon()
    first = limiter.admit([SCOPE], 600, 1.0, most=0)
    assert first.ok
    first.release(900, 2.0)  # the answer's count: the estimate was low
    refused = limiter.admit([SCOPE], 200, 3.0, most=0)  # 900 spent of 1000
    assert not refused.ok and refused.limit == "tokens_per_day"
    # Nothing refills a budget: the wait is until 00:00 UTC.
    assert refused.retry_after_s == pytest.approx(12 * 3600 - 3.0)
    # What is left still serves a request that fits it with the completion it
    # states at most (`max_tokens`), where the completion expected (the first
    # answer's 300 past its estimate) does not fit.
    assert not limiter.admit([SCOPE], 10, 4.0).ok
    assert not limiter.admit([SCOPE], 51, 4.0, most=50).ok
    assert limiter.admit([SCOPE], 50, 4.0, most=50).ok
    limiter.set_day(DAY + 1, NOON + 12 * 3600, 12 * 3600)
    assert limiter.admit([SCOPE], 200, 12 * 3600 + 1, most=0).ok  # a new day


def test_a_budget_is_charged_the_completion_expected_and_settled_to_the_count() -> None:
    """Admitted on their prompts' estimates, answers passed a budget by their
    completions: under load (six clients, two proxies) 4,524 tokens of a
    3,000 budget. The completion expected is charged at admission."""
    limiter = limiter_at_noon()
    for i in range(20):
        admitted = limiter.admit([SCOPE], 10, float(i))
        assert admitted.ok
        admitted.release(40, float(i))  # 30 past each estimate
    before = limiter.budget_left(SCOPE)
    assert before is not None and before.day_fleet == 1000 - 20 * 40
    admitted = limiter.admit([SCOPE], 10, 30.0)
    during = limiter.budget_left(SCOPE)
    assert during is not None
    # Whole tokens: the completion expected (a moving average) rounded up.
    assert before.day_fleet - during.day_fleet == 10 + math.ceil(expected_after([30] * 20))
    assert expected_after([30] * 20) == pytest.approx(30, abs=1.5)
    # Settled to what it came to: 12, not the 40 charged.
    admitted.release(12, 31.0)
    after = limiter.budget_left(SCOPE)
    assert after is not None and after.day_fleet == pytest.approx(before.day_fleet - 12)


def test_a_first_burst_is_charged_a_completion_before_any_answer_came() -> None:
    """Trial 56: expecting no completion before this process had seen an
    answer, 20 requests at once, each to come to 406 tokens, were admitted
    on their prompts against a day's 2,000 (8,120 spent). Before the first
    answer each is charged FIRST_COMPLETION, or the bound it states."""
    limiter = limiter_at_noon(ScopeLimits(tokens_per_day=2000))
    burst = [limiter.admit([SCOPE], 6, 1.0) for _ in range(20)]
    admitted = [a for a in burst if a.ok]
    assert len(admitted) == 2000 // (6 + int(FIRST_COMPLETION))
    for a in admitted:
        a.release(406, 2.0)
    left = limiter.budget_left(SCOPE)
    assert left is not None and left.day_fleet == 2000 - 406 * len(admitted)
    # Stating a bound, a request is charged no more than it.
    fresh = limiter_at_noon(ScopeLimits(tokens_per_day=2000))
    stated = [fresh.admit([SCOPE], 6, 1.0, most=94) for _ in range(30)]
    assert sum(a.ok for a in stated) == 2000 // 100
    # An embedding has no completion: charged its prompt alone.
    embeds = limiter_at_noon(ScopeLimits(tokens_per_day=2000))
    assert sum(embeds.admit([SCOPE], 100, 1.0, most=0).ok for _ in range(30)) == 20


def charge_of(
    limiter: RateLimiter, est: int, now: float, most: int | None = None, choices: int = 1
) -> float:
    """What a budget is charged at admission for a prompt of `est` (its
    expected completion too); the request then ends unanswered."""
    before = limiter.budget_left(SCOPE)
    admitted = limiter.admit([SCOPE], est, now, most=most, choices=choices)
    after = limiter.budget_left(SCOPE)
    assert admitted.ok and before is not None and after is not None
    admitted.release(None, now)
    return before.day_fleet - after.day_fleet


def expected_after(completions: Sequence[float]) -> float:
    """FIRST_COMPLETION counted as one answer, then each answer's mean with
    those before, from the fifth on a fifth (COMPLETION_WEIGHT)."""
    expected = FIRST_COMPLETION
    for n, c in enumerate(completions, 1):
        expected += max(0.2, 1 / (n + 1)) * (c - expected)
    return expected


def test_the_first_answers_move_the_completion_expected_by_their_mean_with_the_prior() -> None:
    limiter = limiter_at_noon(ScopeLimits(tokens_per_day=100_000))
    limiter.admit([SCOPE], 10, 1.0).release(60, 1.0)  # 50 past its estimate
    assert charge_of(limiter, 10, 2.0) == 10 + (256 + 50) / 2
    limiter.admit([SCOPE], 10, 3.0).release(160, 3.0)  # 150 past
    assert charge_of(limiter, 10, 4.0) == 10 + math.ceil(expected_after([50, 150]))
    for i in range(10):
        limiter.admit([SCOPE], 10, 5.0 + i).release(40, 5.0 + i)
    assert charge_of(limiter, 10, 20.0) == 10 + math.ceil(expected_after([50, 150] + [30] * 10))


def test_answers_that_say_nothing_of_a_completion_are_not_learned() -> None:
    """Review: one answer that cost nothing (a cache hit, an estimate given
    back) or that its bound cut short set the expectation to nothing, and
    the next burst overspent as in trial 56."""
    limiter = limiter_at_noon(ScopeLimits(tokens_per_day=100_000))
    limiter.admit([SCOPE], 10, 1.0).release(0, 1.0)  # a hit: given back
    limiter.admit([SCOPE], 10, 2.0, most=1).release(11, 2.0)  # max_tokens: 1
    limiter.admit([SCOPE], 10, 3.0, most=0).release(10, 3.0)  # an embedding
    assert charge_of(limiter, 10, 4.0) == pytest.approx(10 + FIRST_COMPLETION)
    # A bound above the expectation leaves the answer free: learned.
    limiter.admit([SCOPE], 10, 5.0, most=4096).release(40, 5.0)
    assert charge_of(limiter, 10, 6.0) == pytest.approx(10 + (256 + 30) / 2)


def test_the_leaders_count_covers_the_other_proxies() -> None:
    limiter = limiter_at_noon()
    assert limiter.admit([SCOPE], 100, 1.0, most=0).ok
    # The leader counted this process's 100 and the fleet's 850 in all.
    limiter.apply_budgets({SCOPE: Budget(1.0, DAY, 150, 4150, spent_day=100, spent_month=100)})
    assert limiter.budget_left(SCOPE) == Reckoning(150, 4150, 150, 4150, fresh=True)
    assert limiter.admit([SCOPE], 100, 2.0, most=0).ok
    refused = limiter.admit([SCOPE], 100, 3.0, most=0)
    assert not refused.ok and refused.limit == "tokens_per_day" and refused.exhausted


def test_a_budget_changed_since_the_count_moves_what_is_left_at_once() -> None:
    """Raised after it was spent, a budget served again only after the next
    round's count, and told its clients to come back at midnight meanwhile."""
    spent = Budget(1.0, DAY, 0, 4000, 1000, 1000, 1.0, day_limit=1000, month_limit=5000)
    raised = ScopeLimits(tokens_per_day=3000, tokens_per_month=5000)
    assert spent.reckon(raised, 1.0, DAY, 1000, 1000).day_fleet == 2000
    lowered = ScopeLimits(tokens_per_day=1000, tokens_per_month=2000)
    assert spent.reckon(lowered, 1.0, DAY, 1000, 1000).month_fleet == 1000


def test_past_its_share_a_proxy_refuses_for_a_moment_not_for_the_day() -> None:
    limiter = limiter_at_noon()
    # 400 left in the fleet, a tenth of it here (the others were asked more).
    limiter.apply_budgets({SCOPE: Budget(1.0, DAY, 400, 4000, share=0.1)})
    assert limiter.admit([SCOPE], 30, 1.0, most=0).ok
    refused = limiter.admit([SCOPE], 30, 2.0, most=0)
    assert not refused.ok and refused.limit == "tokens_per_day" and not refused.exhausted
    assert refused.retry_after_s == 1.0  # the leader's next shares follow the refusals


def test_a_share_refusal_says_the_budget_is_not_spent() -> None:
    """It read as the final one ("Rate limit reached for tokens per day")
    while the next round would admit the request."""
    limiter = limiter_at_noon()
    limiter.apply_budgets({SCOPE: Budget(1.0, DAY, 400, 4000, share=0.1)})
    assert limiter.admit([SCOPE], 30, 1.0, most=0).ok
    error = refusal(limiter.admit([SCOPE], 30, 2.0, most=0))
    assert (error.status, error.code, error.headers) == (
        429,
        "rate_limit_exceeded",
        {"retry-after": "1"},
    )
    assert error.message == (
        "Rate limit reached for this proxy's share of the tokens per day (TPD) budget; "
        "the budget is not spent. Please try again in 1s."
    )


@pytest.mark.parametrize(
    ("spent_out", "message"),
    [
        (
            "k/k123",
            "Budget reached for tokens per month of API key k123: it is spent, or too little "
            "is left for this request. It starts again at the 1st of next month, 00:00 UTC, in ",
        ),
        (
            "t/acme",
            "Budget reached for tokens per day (TPD) of tenant acme: it is spent, or too little "
            "is left for this request. It starts again at 00:00 UTC in ",
        ),
    ],
)
def test_a_budget_refusal_says_whose_budget_is_spent(spent_out: str, message: str) -> None:
    """Trial 42: a key and its tenant may each have a budget, and the refusal
    did not say which had run out."""
    limiter = RateLimiter(epoch=1.0)
    roomy = ScopeLimits(tokens_per_day=10**9, tokens_per_month=10**9)
    small = {"k/k123": ScopeLimits(tokens_per_month=100), "t/acme": ScopeLimits(tokens_per_day=100)}
    limiter.configure({"t/acme": roomy, "k/k123": roomy, spent_out: small[spent_out]}, 0.0)
    limiter.set_day(DAY, NOON, 0.0)
    while (admitted := limiter.admit(["t/acme", "k/k123"], 30, 1.0, most=0)).ok:
        admitted.release(30, 1.0)
    assert admitted.exhausted and admitted.refused_scope == spent_out
    assert refusal(admitted).message.startswith(message)


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        (ScopeLimits(tokens_per_day=1000), "tokens-per-day budget"),
        (ScopeLimits(tpm=5000, tokens_per_month=800), "tokens-per-month budget"),
        (ScopeLimits(tpm=700, tokens_per_day=1000), "tokens-per-minute limit"),
    ],
)
def test_a_prompt_past_a_whole_budget_is_a_400_not_a_wait_for_midnight(
    limits: ScopeLimits, named: str
) -> None:
    """Refused as spent until 00:00 UTC, it would have been refused again
    then, and every day after."""
    limiter = limiter_at_noon(limits)
    refused = limiter.admit([SCOPE], 1200, 1.0, most=0)
    assert refused.too_large and not refused.ok
    error = refusal(refused)
    assert (error.status, error.code) == (400, "tokens_over_limit")
    assert error.message.startswith(f"Request too large for the {named}: its prompt is")
    assert limiter.budget_left(SCOPE) in (None, limiter_at_noon(limits).budget_left(SCOPE))


def test_a_share_too_small_for_any_request_takes_one_per_count() -> None:
    """13 tokens left, two proxies asked alike: half each holds no request of
    10, and the fleet's 13 would never be spent (each proxy refusing for its
    share, for ever). A proxy that spent nothing since the count takes one."""
    limiter = limiter_at_noon()
    limiter.apply_budgets({SCOPE: Budget(1.0, DAY, 13, 4000, share=0.5)})
    assert limiter.admit([SCOPE], 10, 1.0, most=0).ok
    again = limiter.admit([SCOPE], 10, 2.0, most=0)
    assert not again.ok and again.exhausted  # 3 left in the fleet, by its count


def test_an_answer_refunded_after_the_day_turned_takes_nothing_of_the_new_day() -> None:
    limiter = limiter_at_noon()
    admitted = limiter.admit([SCOPE], 100, 1.0, most=0)
    limiter.set_day(DAY + 1, NOON + 12 * 3600, 12 * 3600)
    admitted.release(0, 12 * 3600 + 1)  # a cache hit's refund: the estimate back
    # Nothing spent today, not -100 (a negative count the leader refuses whole).
    left = limiter.budget_left(SCOPE)
    assert left is not None and left.day_fleet == 1000
    assert limiter.demand(12 * 3600 + 2)[SCOPE].spent is None  # the month's is 0 too


def test_the_day_turns_on_the_hot_path_too_when_no_report_comes() -> None:
    """The report task sets the day; without a stream to the control plane
    it makes no report, and a proxy kept yesterday's counts all day."""
    limiter = limiter_at_noon()
    assert limiter.admit([SCOPE], 990, 1.0, most=0).ok
    assert not limiter.admit([SCOPE], 20, 2.0, most=0).ok
    assert limiter.admit([SCOPE], 20, 12 * 3600 + 1.0, most=0).ok  # past 00:00 UTC
    report = limiter.demand(12 * 3600 + 2.0)[SCOPE]
    assert report.spent is not None and report.spent.day == DAY + 1
    assert report.spent.day_tokens == 20 and report.spent.month_tokens == 1010


def test_a_month_spent_is_refused_until_the_month_ends() -> None:
    limiter = limiter_at_noon()
    limiter.apply_budgets({SCOPE: Budget(1.0, DAY, 1000, 0)})
    refused = limiter.admit([SCOPE], 1, 5.0, most=0)
    assert not refused.ok and refused.limit == "tokens_per_month"
    assert refused.retry_after_s == pytest.approx(seconds_to_month_end(NOON) - 5.0)


def test_the_counts_go_in_every_report_while_the_month_has_any() -> None:
    limiter = limiter_at_noon()
    limiter.admit([SCOPE], 30, 1.0, most=0).release(40, 2.0)
    for now in (3.0, 60.0, 600.0):  # long idle: still reported
        report = limiter.demand(now)[SCOPE]
        assert report.spent == Spent(1.0, DAY, 40, 40)
    # A scope nothing was charged to is left out.
    assert limiter_at_noon().demand(1.0) == {}


def test_a_scope_back_in_the_table_counts_under_an_epoch_of_its_own() -> None:
    """Limits removed and given back dropped the scope's counts; the next
    report, of the same process's epoch and lower, replaced the ledger's, and
    the fleet forgot what this proxy had spent."""
    limiter = limiter_at_noon()
    limiter.admit([SCOPE], 300, 1.0, most=0).release(300, 1.0)
    before = limiter.demand(2.0)[SCOPE].spent
    limiter.configure({}, 3.0)
    limiter.configure({SCOPE: BUDGET}, 4.0)
    limiter.admit([SCOPE], 20, 5.0, most=0).release(20, 5.0)
    after = limiter.demand(6.0)[SCOPE].spent
    assert before is not None and after is not None
    assert after.epoch > before.epoch and (after.day_tokens, after.month_tokens) == (20, 20)
    ledger = account(account(None, {"p1": before}, DAY), {"p1": after}, DAY)
    assert ledger.used() == (320, 320)
    # The leader's count of the new epoch is its own: 20 since takes off, not 320.
    limiter.apply_budgets({SCOPE: budgets(BUDGET, ledger, {"p1": after}, ["p1"])["p1"]})
    left = limiter.budget_left(SCOPE)
    assert left is not None and left.day_fleet == 1000 - 320


def test_a_scope_back_after_the_clock_stepped_back_still_counts_under_a_later_epoch() -> None:
    """A scope's epoch was the wall time it came back: after the clock stepped
    back, earlier than the epoch it had before, and the leader took the older
    count for this process's newest."""
    limiter = limiter_at_noon()
    epochs = []
    for now, wall in ((4.0, NOON + 4), (8.0, NOON - 3600), (12.0, NOON - 3600)):
        limiter.configure({}, now - 1)
        limiter.set_day(DAY, wall, now)
        limiter.configure({SCOPE: BUDGET}, now)
        limiter.admit([SCOPE], 5, now, most=0).release(5, now)
        report = limiter.demand(now + 0.5)[SCOPE].spent
        assert report is not None
        epochs.append(report.epoch)
    assert 1.0 < epochs[0] < epochs[1] < epochs[2]


def test_a_prompt_that_fits_a_budget_only_without_its_completion_is_admitted_when_whole() -> None:
    """Charged the completion expected on top, a prompt of 500 with answers
    of 600 came to more than a day's 1,000: refused as spent until 00:00 UTC,
    and then again, every day, though the prompt fits. Its charge is capped
    at the whole budget, so it is admitted while the budget is whole."""
    limits = ScopeLimits(tokens_per_day=1000)
    limiter = limiter_at_noon(limits)
    for i in range(15):  # answers of 600 past their estimates, one a day
        limiter.set_day(_after(DAY, i), NOON + i * 86400, i * 86400.0)
        limiter.admit([SCOPE], 1, i * 86400.0).release(601, i * 86400.0 + 1)
    now = 15 * 86400.0
    limiter.set_day(_after(DAY, 15), NOON + now, now)
    admitted = limiter.admit([SCOPE], 500, now + 1)
    assert admitted.ok
    refused = limiter.admit([SCOPE], 500, now + 2)
    assert not refused.ok and refused.limit == "tokens_per_day" and not refused.too_large


def test_a_proxy_with_budgets_only_is_ready_without_shares_and_reports_its_day() -> None:
    limiter = RateLimiter(epoch=7.0)
    state = QuotaState(limiter, clock=lambda: 1.0, wall=lambda: NOON)
    state.on_limits({SCOPE: BUDGET})
    assert state.ready
    assert limiter.admit([SCOPE], 25, 1.0, most=0).ok
    [row] = state.demand()
    assert (row.spent_epoch, row.spent_day, row.day_tokens, row.month_tokens) == (7.0, DAY, 25, 25)
    # The leader's counts come with the shares; -1 is no such budget.
    state.on_quota(
        pb.QuotaShares(
            generation=5,
            budgets=[pb.ScopeBudget(scope=SCOPE, epoch=7.0, day=DAY, day_left=10, month_left=-1)],
        )
    )
    assert limiter.budget_left(SCOPE) == Reckoning(-15, math.inf, -15, math.inf)


def proxy_process(
    state_dir: Path,
    epoch: float,
    *,
    name: str = "p1",
    limits: dict[str, ScopeLimits] | None = None,
    wall: float = NOON,
) -> tuple[RateLimiter, QuotaState]:
    """A proxy process `name` started at `epoch` with `state_dir`, its clock
    at `wall`, the leader away: what it saved before, then its table."""
    limiter = RateLimiter(epoch=epoch)
    state = QuotaState(limiter, state_dir, clock=lambda: 1.0, wall=lambda: wall, proxy=name)
    state.load_saved()
    state.on_limits({SCOPE: BUDGET} if limits is None else limits)
    return limiter, state


def spend_until_refused(limiter: RateLimiter) -> int:
    spent = 0
    while limiter.admit([SCOPE], 100, 1.0, most=0).ok and spent < 10_000:
        spent += 100
    return spent


def stop(state: QuotaState) -> None:
    """As the proxy stops: its counts saved (in place: no loop runs), the lock let go."""
    state.save_counts()
    state.close()


def saved_counts(state_dir: Path, proxy: str, counts: dict[str, list[float]]) -> None:
    (state_dir / COUNTS_FILE).write_bytes(orjson.dumps({"proxy": proxy, "counts": counts}))


def test_a_proxy_restarted_while_the_leader_is_away_goes_on_from_its_counts(
    tmp_path: Path,
) -> None:
    """Trial 42: what a process spent since the leader's last count went with
    it, and the process after it spent it again: a day budget of 2,000
    served 4,030 tokens over two restarts, and the ledger never heard of
    half of them."""
    first, state = proxy_process(tmp_path, epoch=7.0)
    # The leader's last count, saved with the shares: nothing of this process yet.
    budget = pb.ScopeBudget(
        scope=SCOPE, epoch=7.0, day=DAY, day_left=1000, month_left=5000, share=1.0
    )
    state.on_quota(pb.QuotaShares(generation=5, budgets=[budget]))
    assert spend_until_refused(first) == 1000
    stop(state)  # the leader heard none of it
    second, state = proxy_process(tmp_path, epoch=9.0)
    assert spend_until_refused(second) == 0
    # To the leader, the same process: what it spent is counted once.
    [row] = state.demand()
    assert (row.spent_epoch, row.spent_day, row.day_tokens, row.month_tokens) == (
        7.0,
        DAY,
        1000,
        1000,
    )
    state.close()


def test_a_resumed_count_is_never_below_the_leaders_count_of_that_process(
    tmp_path: Path,
) -> None:
    """Killed between a report and the save, a process left less than the
    leader had heard of it; the next went on from that, reported less under
    the same epoch, and the ledger went back (helper-174)."""
    first, state = proxy_process(tmp_path, epoch=7.0)
    assert spend_until_refused(first) == 1000
    state.close()  # killed: the last save, below, is older than the leader's count
    saved_counts(tmp_path, "p1", {SCOPE: [7.0, DAY, 900, 900]})
    budget = pb.ScopeBudget(
        scope=SCOPE, epoch=7.0, day=DAY, day_left=0, month_left=4000, spent_day=1000,
        spent_month=1000, share=1.0,
    )  # fmt: skip
    (tmp_path / QUOTA_FILE).write_bytes(
        pb.QuotaShares(generation=6, budgets=[budget]).SerializeToString()
    )
    _, state = proxy_process(tmp_path, epoch=9.0)
    [row] = state.demand()
    assert (row.spent_epoch, row.day_tokens, row.month_tokens) == (7.0, 1000, 1000)
    state.close()


def test_during_a_reload_the_new_process_counts_its_own(tmp_path: Path) -> None:
    """A reload starts the new process beside the old, which spends on until
    it stops: had the new one gone on from the old one's counts, both would
    report under one epoch, each less than the two spent (helper-174)."""
    old, old_state = proxy_process(tmp_path, epoch=7.0)
    old.admit([SCOPE], 300, 1.0, most=0)
    old_state.save_counts()
    new, new_state = proxy_process(tmp_path, epoch=9.0)
    assert new.counts() == {}  # its own, from nothing
    new.admit([SCOPE], 100, 1.0, most=0)
    new_state.save_counts()  # not while the old one holds them
    stop(old_state)
    assert orjson.loads((tmp_path / COUNTS_FILE).read_bytes())["counts"] == {
        SCOPE: [7.0, DAY, 300.0, 300.0]
    }
    new_state.save_counts()  # the old one gone: now the new one's
    assert orjson.loads((tmp_path / COUNTS_FILE).read_bytes())["counts"] == {
        SCOPE: [9.0, DAY, 100.0, 100.0]
    }
    new_state.close()


def test_a_state_dir_another_proxy_holds_is_warned_of_not_taken_for_a_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 90: a second proxy given the first one's --state-dir was told
    "another process of this proxy holds its budget counts (a reload)"."""
    old, old_state = proxy_process(tmp_path, epoch=7.0)
    old.admit([SCOPE], 300, 1.0, most=0)
    old_state.save_counts()
    with caplog.at_level(logging.INFO, logger="dataplane.sync.quota"):
        reload, reload_state = proxy_process(tmp_path, epoch=8.0)
        other, other_state = proxy_process(tmp_path, epoch=9.0, name="p2")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "holds" in r.getMessage()]
    assert said == [
        (logging.INFO, "another process of this proxy holds its budget counts (a reload): "
                       "this one counts its own from nothing"),
        (logging.WARNING, f"--state-dir {tmp_path} is in use by proxy p1, which holds its "
                          "budget counts: give each proxy a directory of its own; this one "
                          "counts its own from nothing"),
    ]  # fmt: skip
    assert other.counts() == {} == reload.counts()
    for state in (old_state, reload_state, other_state):
        state.close()


def test_a_scope_the_first_table_lacks_takes_its_counts_when_it_comes(tmp_path: Path) -> None:
    saved_counts(tmp_path, "p1", {SCOPE: [7.0, DAY, 600, 600]})
    limiter, state = proxy_process(tmp_path, epoch=9.0, limits={"t/other": BUDGET})
    # Saved meanwhile, they are kept: a second restart before the scope comes keeps them.
    assert limiter.admit(["t/other"], 50, 1.0, most=0).ok
    state.save_counts()
    assert orjson.loads((tmp_path / COUNTS_FILE).read_bytes())["counts"] == {
        SCOPE: [7.0, DAY, 600, 600],
        "t/other": [9.0, DAY, 50, 50],
    }
    state.on_limits({SCOPE: BUDGET, "t/other": BUDGET})
    assert limiter.counts() == {
        SCOPE: Spent(7.0, DAY, 600, 600),
        "t/other": Spent(9.0, DAY, 50, 50),
    }
    state.close()


def test_the_leaders_count_of_last_month_is_not_taken_into_this_one(tmp_path: Path) -> None:
    """The process ran into the 1st with the leader away since the 30th: the
    saved shares held November's count of it (4,000), and the process after
    a restart on the 1st took it as December's."""
    first = calendar.timegm((2026, 12, 1, 12, 0, 0, 0, 0, 0))
    saved_counts(tmp_path, "p1", {SCOPE: [7.0, 20261201, 100, 100]})
    budget = pb.ScopeBudget(
        scope=SCOPE, epoch=7.0, day=20261130, day_left=100, month_left=1000, spent_day=900,
        spent_month=4000, share=1.0,
    )  # fmt: skip
    (tmp_path / QUOTA_FILE).write_bytes(
        pb.QuotaShares(generation=6, budgets=[budget]).SerializeToString()
    )
    limiter, state = proxy_process(tmp_path, epoch=9.0, wall=first)
    assert limiter.counts() == {SCOPE: Spent(7.0, 20261201, 100, 100)}
    state.close()


def test_a_state_dir_not_made_yet_is_made_and_one_that_cannot_be_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's DIR/wI is made by its first save, and the lock came first:
    no counts were saved, and each second said so."""
    limiter, state = proxy_process(tmp_path / "w0", epoch=7.0)
    limiter.admit([SCOPE], 100, 1.0, most=0)
    stop(state)
    assert (tmp_path / "w0" / COUNTS_FILE).exists()
    (tmp_path / "file").write_bytes(b"")
    limiter, state = proxy_process(tmp_path / "file", epoch=7.0)
    limiter.admit([SCOPE], 100, 1.0, most=0)
    for _ in range(3):
        state.save_counts()
    said = [r for r in caplog.records if "budget counts" in r.getMessage()]
    assert [r.levelname for r in said] == ["ERROR"] and not said[0].exc_info
    assert said[0].getMessage().startswith(f"budget counts not saved in {tmp_path / 'file'}")


@pytest.mark.parametrize(
    ("saved", "proxy", "taken"),
    [
        ([7.0, DAY - 1, 600, 4500], "p1", Spent(7.0, DAY, 0, 4500)),  # yesterday's: the month's
        ([7.0, DAY - 2, 600, 4500], "p1", None),  # older: that process may be folded away
        ([7.0, 20261130, 600, 4500], "p1", None),  # last month's
        ([7.0, DAY, 600, 4500], "p2", None),  # another proxy's (renamed, the dir kept)
        ([7.0, DAY + 1, 600, 4500], "p1", None),  # of a day to come (a clock stepped back)
    ],
)
def test_saved_counts_are_taken_only_of_this_proxy_and_of_today_or_yesterday(
    saved: list[float], proxy: str, taken: Spent | None, tmp_path: Path
) -> None:
    saved_counts(tmp_path, proxy, {SCOPE: saved})
    limiter, state = proxy_process(tmp_path, epoch=9.0)
    assert limiter.counts() == ({} if taken is None else {SCOPE: taken})
    assert spend_until_refused(limiter) == (500 if taken else 1000)
    assert limiter.counts()[SCOPE].epoch == (7.0 if taken else 9.0)
    state.close()


def test_damaged_saved_counts_are_said_once_and_not_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / COUNTS_FILE).write_bytes(b"{not json")
    limiter, state = proxy_process(tmp_path, epoch=9.0)
    assert spend_until_refused(limiter) == 1000
    [error] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert error.getMessage().startswith("ignoring saved budget counts") and not error.exc_info
    state.close()


# ---------------------------------------------------------------- the leader's round


def budget_table(revision: int = 10) -> pb.RouteTable:
    return compile_table(
        State(
            revision,
            tenants=(Tenant("acme", limits=Limits(tokens_per_day=1000, tokens_per_month=5000)),),
            keys=(ApiKeyRecord("k" * 10, "a" * 64, "acme"),),
        )
    )


async def report(fleet: Fleet, proxy: str, day_tokens: float, epoch: float = 1.0) -> None:
    """What a replica writes of `proxy`'s report (QuotaHub.publish_demand)."""
    hub = QuotaHub(fleet.store, f"cp-{proxy}", constant_lease(fleet.lease), interval=0.001)
    hub.report(
        proxy,
        [
            pb.ScopeDemand(
                scope=SCOPE,
                spent_epoch=epoch,
                spent_day=DAY,
                day_tokens=day_tokens,
                month_tokens=day_tokens,
            )
        ],
    )
    await fleet.store.put(
        DEMAND_PREFIX + f"cp-{proxy}",
        orjson.dumps({"proxies": hub._demand}),
        lease=fleet.lease,
    )


def noon_rebalancer(fleet: Fleet, interval: float = 0.001) -> Rebalancer:
    """The fleet's leader, its rounds every `interval`, its clock at NOON."""
    return Rebalancer(
        fleet.store, fleet.catalog, fleet.publisher, lambda: fleet.fence, interval, lambda: NOON
    )


async def heard_from(
    fleet: Fleet, replica: str, at: float, scope: str, *, tokens: float, rate: float = 5.0
) -> None:
    """`replica`'s report, as it writes it, of p1 heard at `at` charging
    `scope` `tokens` today at `rate` tokens a second."""
    row = [0, rate, 0, 0, 0, 1.0, DAY, tokens, tokens]
    body = {"proxies": {"p1": {scope: row}}, "heard": {"p1": at}}
    await fleet.store.put(DEMAND_PREFIX + replica, orjson.dumps(body))


async def leader_round(fleet: Fleet) -> None:
    """A new leader's first round at NOON: the ledgers read, then counted."""
    rebalancer = noon_rebalancer(fleet)
    await rebalancer.read_ledgers()
    await rebalancer.round()


async def test_the_leader_counts_the_fleet_keeps_the_count_and_pushes_whats_left() -> None:
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    await report(fleet, "p1", 300)
    await report(fleet, "p2", 450, epoch=2.0)
    await leader_round(fleet)
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    assert kv is not None and decode_ledger(kv.value).used() == (750, 750)
    shares = await fleet.store.get(SHARES_KEY)
    assert shares is not None
    pushed = decode_budgets(orjson.loads(shares.value))
    one, two = pushed["p1"][SCOPE], pushed["p2"][SCOPE]
    assert one == Budget(1.0, DAY, 250, 4250, 300, 300, one.share, 1000, 5000)
    assert two == Budget(2.0, DAY, 250, 4250, 450, 450, two.share, 1000, 5000)
    assert one.share == pytest.approx(0.5) == two.share
    # A replica's push to p1 carries them, -1 for none.
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(fleet.lease), interval=0.001)
    await hub._load()
    update = pb.RouteUpdate.FromString(hub.update_for("p1"))
    [b] = update.quota.budgets
    assert (b.scope, b.epoch, b.day_left, b.month_left, b.spent_day) == (SCOPE, 1.0, 250, 4250, 300)

    # A new leader goes on from the ledger: p1 restarted, and reports anew.
    await fleet.store.delete_range(DEMAND_PREFIX, DEMAND_PREFIX + "\xff")
    await report(fleet, "p1", 20, epoch=3.0)
    rebalancer = noon_rebalancer(fleet)
    await rebalancer.read_ledgers()

    async def stored() -> tuple[float, float]:
        kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
        assert kv is not None
        return decode_ledger(kv.value).used()

    await rebalancer.round()  # a new leader's first: written
    assert await stored() == (770, 770)

    # Then a ledger is written every LEDGER_ROUNDS rounds, or once its counts
    # moved 1 % of a budget (10 of 1,000): the counts of a busy scope change
    # every round, and a write each was an etcd revision each.
    await report(fleet, "p1", 29, epoch=3.0)  # 9 more
    for _ in range(LEDGER_ROUNDS - 1):
        await rebalancer.round()
        assert await stored() == (770, 770)
    pushed = decode_budgets(orjson.loads((await fleet.store.get(SHARES_KEY)).value))  # type: ignore[union-attr]
    assert pushed["p1"][SCOPE].day_left == 1000 - 779  # counted at once all the same
    await rebalancer.round()
    assert await stored() == (779, 779)
    await report(fleet, "p1", 39, epoch=3.0)  # 10 more: at once
    await rebalancer.round()
    assert await stored() == (789, 789)
    # Under a tenth of the budget left, every change at once: a count short
    # there (a proxy restarted with the leader) admits past the budget.
    await report(fleet, "p1", 150, epoch=3.0)
    await rebalancer.round()
    assert await stored() == (900, 900)
    await report(fleet, "p1", 151, epoch=3.0)
    await rebalancer.round()
    assert await stored() == (901, 901)


async def test_the_leader_says_what_each_budget_has_spent_for_its_metrics() -> None:
    """Trial 56: a budget's use was in `pontoctl get tenants` only, with
    nothing to alert on. The leader's rounds say it per budget and period: in
    the leader's UTC day and month (a ledger of yesterday has spent nothing
    today), and nothing of a scope no longer budgeted."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    await report(fleet, "p1", 300)
    await report(fleet, "p2", 450, epoch=2.0)
    now = [float(NOON)]
    rebalancer = Rebalancer(
        fleet.store, fleet.catalog, fleet.publisher, lambda: fleet.fence, 0.001, lambda: now[0]
    )
    await rebalancer.read_ledgers()
    assert rebalancer.budget_use() == []  # before the term's first round
    await rebalancer.round()
    assert rebalancer.budget_use() == [
        (SCOPE, "day", 750, 1000),
        (SCOPE, "month", 750, 5000),
    ]
    now[0] += 86_400  # the next day, before any round of it
    assert rebalancer.budget_use() == [(SCOPE, "day", 0, 1000), (SCOPE, "month", 750, 5000)]
    now[0] += 31 * 86_400  # the next month
    assert rebalancer.budget_use() == [(SCOPE, "day", 0, 1000), (SCOPE, "month", 0, 5000)]
    now[0] = float(NOON)
    fleet.publisher.publish(compile_table(State(11, tenants=(Tenant("acme"),))))
    await rebalancer.round()
    assert rebalancer.budget_use() == []


async def test_a_ledger_of_a_scope_no_longer_budgeted_goes_once_its_month_is_over() -> None:
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await report(fleet, "p1", 300)
    await leader_round(fleet)
    fleet.publisher.publish(compile_table(State(11, tenants=(Tenant("acme"),))))
    await leader_round(fleet)  # the same month: kept, should the budget come back
    assert await fleet.store.get(LEDGER_PREFIX + SCOPE) is not None
    january = Rebalancer(
        fleet.store, fleet.catalog, fleet.publisher, lambda: fleet.fence, 0.001,
        lambda: NOON + 40 * 86400,
    )  # fmt: skip
    await january.read_ledgers()
    await january.round()
    assert await fleet.store.get(LEDGER_PREFIX + SCOPE) is None


def many_budgeted(n: int) -> pb.RouteTable:
    return compile_table(
        State(
            12,
            tenants=tuple(Tenant(f"t{i:03}", limits=Limits(tokens_per_day=1000)) for i in range(n)),
        )
    )


async def test_ledgers_past_a_transactions_limit_are_all_written() -> None:
    """Past 128 budgeted scopes charged in a round, one transaction of all
    ledgers was refused (etcd's --max-txn-ops; MemoryStore's the same) with
    a ValueError the quota task did not catch: the leader's quotas stopped."""
    fleet = Fleet(many_budgeted(300))
    await fleet.lead()
    await fleet.register("p1")
    rows = {f"t/t{i:03}": [0, 5.0, 0, 0, 0, 1.0, DAY, 7.0, 7.0] for i in range(300)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": {"p1": rows}}))
    await leader_round(fleet)
    listing = await fleet.store.list(LEDGER_PREFIX)
    assert len(listing.items) == 300
    assert all(decode_ledger(kv.value).used() == (7, 7) for kv in listing.items)


async def test_of_two_replicas_reports_of_one_proxy_the_later_is_counted() -> None:
    """A proxy moved to another replica stays in the report of the one it
    left until that replica's lease ends; whichever key listed last won, and
    the older count could replace the newer."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await heard_from(fleet, "cp-a", 200.0, SCOPE, tokens=50.0)
    await heard_from(fleet, "cp-b", 100.0, SCOPE, tokens=30.0)
    await leader_round(fleet)
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    assert kv is not None and decode_ledger(kv.value).used() == (50, 50)


async def test_a_report_with_figures_that_are_no_numbers_drops_only_those() -> None:
    """NaN went into the replica's JSON as null; the leader then dropped the
    reports of all the replica's proxies."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1", "p2")
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(fleet.lease), interval=0.001)

    def row(month_tokens: float, rps: float, tps: float) -> pb.ScopeDemand:
        return pb.ScopeDemand(
            scope=SCOPE,
            requests_per_s=rps,
            tokens_per_s=tps,
            spent_epoch=1.0,
            spent_day=DAY,
            day_tokens=40,
            month_tokens=month_tokens,
        )

    hub.report("p1", [row(40, 1.0, math.inf)])
    hub.report("p2", [row(math.nan, math.nan, 1.0)])
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": hub._demand}))
    await leader_round(fleet)
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    assert kv is not None and decode_ledger(kv.value).used() == (40, 40)


async def test_budgets_in_the_shares_that_are_not_such_leave_a_replicas_shares_as_they_were() -> (
    None
):
    fleet = Fleet(budget_table())
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(0), interval=0.001)
    good = {"proxies": {}, "budgets": {"fleet": {SCOPE: [DAY, 10, 20, 1000, 5000]}}}
    await fleet.store.put(SHARES_KEY, orjson.dumps(good))
    await hub._load()
    generation = hub.generation
    for bad in ([1], {"fleet": [1]}, {"fleet": {}, "proxies": [1]}, {"fleet": {SCOPE: 3}}):
        await fleet.store.put(SHARES_KEY, orjson.dumps({"proxies": {}, "budgets": bad}))
        with pytest.raises(ValueError):
            decode_budgets({"budgets": bad})
        await hub._load()
        assert hub.generation == generation


async def test_a_round_that_fails_on_a_defect_is_logged_and_the_next_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the store's errors were caught: any other ended the leader's
    quota task, and it led on without shares or counts."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await report(fleet, "p1", 300)
    rebalancer = noon_rebalancer(fleet)
    real, failed = rebalancer._account, list[bool]()

    async def once_broken(*args: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RuntimeError("a defect")
        return await real(*args)

    rebalancer._account = once_broken  # type: ignore[method-assign,assignment]
    async with running(rebalancer.run()):

        async def counted() -> bool:
            return await fleet.store.get(LEDGER_PREFIX + SCOPE) is not None

        await eventually(counted, "a later round counted")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [
        "quota rebalances failed, tried again each round"
    ]


async def test_idle_proxies_take_the_fleets_row_and_the_shares_key_stays_small() -> None:
    """Every proxy's row of every budgeted scope was written: 1,000 scopes
    and 20 proxies came to 1.3 MB, near etcd's 1.5 MiB request limit, past
    which the leader could write no shares at all, rates' included."""
    fleet = Fleet(many_budgeted(1000))
    await fleet.lead()
    proxies = [f"proxy-{i:02}" for i in range(20)]
    await fleet.register(*proxies)
    rows = {f"t/t{i:03}": [0, 5.0, 0, 0, 0, 1.0, DAY, 7.0, 7.0] for i in range(1000)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": {"proxy-00": rows}}))
    await leader_round(fleet)
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None and len(json_of(kv.value)) < 200_000
    pushed = decode_budgets(orjson.loads(json_of(kv.value)))
    assert set(pushed) == {"", "proxy-00"}
    # What a replica pushes an idle proxy: the fleet's row, an idle share.
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(0), interval=0.001)
    await hub._load()
    sent = pb.RouteUpdate.FromString(hub.update_for("proxy-07")).quota.budgets
    assert len(sent) == 1000 and sent[0].share == pytest.approx(0.005)
    for scope in ("t/t000", "t/t999"):
        busy, idle = pushed["proxy-00"][scope], pushed[""][scope]
        assert (busy.epoch, busy.spent_day) == (1.0, 7)
        assert idle == Budget(0.0, DAY, 993, math.inf, 0, 0, idle.share, 1000, 0)
        # The idle proxies' floors: a tenth in all, as shares_of gives them.
        assert idle.share == pytest.approx(0.005)
        assert busy.share + 19 * idle.share <= 1.0


def test_budgets_from_a_leader_that_wrote_every_proxys_row() -> None:
    older = {"budgets": {"fleet": {SCOPE: [DAY, 10, 20, 1000, 5000]}, "proxies": {}}}
    assert decode_budgets(older)[""][SCOPE].share == FLOOR


async def test_ledgers_past_etcds_request_limit_are_written_in_several_transactions() -> None:
    """Ledgers were split by count only: 128 of them with 100 processes each
    came to more than etcd's 1.5 MiB a request, and every round failed before
    the shares were written (MemoryStore refuses what etcd refuses)."""
    fleet = Fleet(many_budgeted(128))
    await fleet.lead()
    names = [f"{'edge-proxy-' * 9}{i:03}" for i in range(100)]
    await fleet.register(*names)
    rows = {f"t/t{i:03}": [0, 5.0, 0, 0, 0, 1.0, DAY, 7.0, 7.0] for i in range(128)}
    body = {"proxies": dict.fromkeys(names, rows)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps(body))
    await leader_round(fleet)
    listing = await fleet.store.list(LEDGER_PREFIX)
    assert sum(len(kv.value) for kv in listing.items) > MAX_REQUEST_BYTES
    assert len(listing.items) == 128
    assert all(decode_ledger(kv.value).used() == (700, 700) for kv in listing.items)
    assert await fleet.store.get(SHARES_KEY) is not None


async def test_a_ledger_too_large_for_etcd_keeps_neither_the_others_nor_the_shares(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scope counted on thousands of processes in two days has a ledger
    larger than etcd takes: it was in the first transaction, and the round
    ended there, every round, with no ledger or share written. It is not
    sent (etcd refusing it every round read as etcd failing, in the metrics
    and PontoEtcdErrors), and said once, not every round."""
    fleet = Fleet(many_budgeted(21))
    await fleet.lead()
    await fleet.register("p1")
    small = {f"t/t{i:03}": [0, 5.0, 0, 0, 0, 1.0, DAY, 7.0, 7.0] for i in range(1, 21)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": {"p1": small}}))
    row = {"t/t000": [0, 5.0, 0, 0, 0, 1.0, DAY, 1.0, 1.0]}
    for replica in range(4):
        many = {f"{'proxy-' * 20}{replica}-{i:04}": row for i in range(3000)}
        await fleet.store.put(DEMAND_PREFIX + f"cp-{replica}", orjson.dumps({"proxies": many}))
    rebalancer = noon_rebalancer(fleet)
    await rebalancer.read_ledgers()
    for _ in range(3):
        await rebalancer.round()
    written = {kv.key for kv in (await fleet.store.list(LEDGER_PREFIX)).items}
    assert written == {LEDGER_PREFIX + f"t/t{i:03}" for i in range(1, 21)}
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None and "t/t000" in decode_budgets(orjson.loads(kv.value))["p1"]
    assert [r.levelname for r in caplog.records if "not kept" in r.getMessage()] == ["ERROR"]
    assert not [r for r in caplog.records if "not written" in r.getMessage()]  # nothing refused


def test_a_ledger_too_large_loses_its_oldest_folded_keys_first() -> None:
    """Folded keys are what a ledger can lose: their counts stay in the
    month, and a process of theirs heard from again is counted twice (more,
    not less)."""
    old = {f"{'proxy-' * 20}{i:05}": spent(1.0, 1, 1, day=20261201) for i in range(3000)}
    ledger = account(None, old, 20261201)
    new = {f"{'proxy-' * 20}{i:05}": spent(2.0, 1, 1, day=20261203) for i in range(3000, 6000)}
    ledger = account(ledger, new, 20261203)  # the first 3,000 folded on the 3rd
    later = {f"{'proxy-' * 20}{i:05}": spent(3.0, 1, 1, day=20261205) for i in range(6000, 7000)}
    ledger = account(ledger, later, 20261205)  # 3,000 more folded on the 5th
    assert len(ledger.folded) == 6000 and len(ledger.encode()) > 1_000_000
    small = fitted(ledger, 1_000_000)
    assert len(small.encode()) <= 1_000_000 and small.used() == ledger.used() == (1000, 7000)
    assert small.seen == ledger.seen and 0 < len(small.folded) < 6000
    # The newest kept (all of the 5th's), and as many as fit: one more would not.
    newest = sorted(ledger.folded.items(), key=lambda kv: (kv[1][1], kv[0]))
    kept = len(small.folded)
    assert small.folded == dict(newest[-kept:]) and kept > 3000
    one_more = Ledger(ledger.day, ledger.month_gone, ledger.seen, dict(newest[-(kept + 1) :]))
    assert len(one_more.encode()) > 1_000_000
    # Rows alone past the bound: kept whole, folded keys none.
    assert fitted(ledger, 100).seen == ledger.seen and not fitted(ledger, 100).folded


async def test_of_two_replicas_reports_the_furthest_counts_are_taken() -> None:
    """A replica whose clock runs ahead (or that predates `heard`) had its
    report taken as the later one, and its older count replaced the newer:
    the ledger went back, for as long as its key lived."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await heard_from(fleet, "cp-a", 200.0, SCOPE, tokens=30.0, rate=9.0)
    await heard_from(fleet, "cp-b", 100.0, SCOPE, tokens=50.0, rate=1.0)
    await leader_round(fleet)
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    assert kv is not None and decode_ledger(kv.value).used() == (50, 50)


async def test_a_scope_in_the_earlier_of_two_reports_only_is_counted() -> None:
    """Only the later report's scopes were kept: a scope the proxy charged
    in the other replica's report only went uncounted while both keys
    lived."""
    fleet = Fleet(many_budgeted(2))
    await fleet.lead()
    await fleet.register("p1")
    await heard_from(fleet, "cp-a", 200.0, "t/t000", tokens=30.0)
    await heard_from(fleet, "cp-b", 100.0, "t/t001", tokens=30.0)
    await leader_round(fleet)
    for scope in ("t/t000", "t/t001"):
        kv = await fleet.store.get(LEDGER_PREFIX + scope)
        assert kv is not None and decode_ledger(kv.value).used() == (30, 30)


def test_of_a_scope_in_the_earlier_report_only_the_counts_are_kept_not_the_rates() -> None:
    """The proxy leaves out scopes it is no longer busy in: the earlier
    report's rates and requests in flight of such a scope are stale, and
    took share from the others while its key lived."""
    counts = spent(1.0, 30, 30)
    earlier = {"t/x": Demand(9.0, 500.0, 4, 3, 0.0, counts), "t/y": Demand(5.0, 50.0)}
    later = {"t/z": Demand(1.0, 10.0)}
    assert _merged(earlier, later, True) == {"t/x": Demand(spent=counts), "t/z": later["t/z"]}


async def test_every_row_too_large_for_etcd_gives_way_to_the_idle_rows() -> None:
    """While an older replica ran, every proxy's rows went out, and past
    etcd's request limit no shares went out at all, rate shares included,
    for the whole upgrade."""
    fleet = Fleet(many_budgeted(1000))
    await fleet.lead()
    await fleet.register(*[f"proxy-{i:02}" for i in range(40)])
    rows = {f"t/t{i:03}": [0, 5.0, 0, 0, 0, 1.0, DAY, 7.0, 7.0] for i in range(1000)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": {"proxy-00": rows}}))
    await fleet.store.put(REPLICAS + "cp-old", orjson.dumps({"id": "cp-old"}))
    await leader_round(fleet)
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None and set(orjson.loads(kv.value)["budgets"]["proxies"]) == {"proxy-00"}


async def test_without_budgets_a_round_does_not_list_the_replicas() -> None:
    fleet = Fleet(limited_table())
    fleet.store = ListingStore()
    fleet.catalog = Catalog(fleet.store)
    await fleet.lead()
    await fleet.register("p1", "p2")
    await leader_round(fleet)
    assert await fleet.store.get(SHARES_KEY) is not None
    assert REPLICAS not in fleet.store.listed


async def test_while_a_replica_reads_no_idle_share_every_proxy_gets_its_row() -> None:
    """A replica from before idle shares gave a proxy without a row a floor
    (2 %): with no demand among three proxies, a fiftieth where a third was
    due; with 50, shares summing to 1.88. While one runs, all rows go out."""
    fleet = Fleet(many_budgeted(2))
    await fleet.lead()
    await fleet.register("p1", "p2", "p3")
    await fleet.store.put(REPLICAS + "cp-new", orjson.dumps({"quota_format": QUOTA_FORMAT}))
    await fleet.store.put(REPLICAS + "cp-old", orjson.dumps({"id": "cp-old"}))
    await leader_round(fleet)
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None
    rows = orjson.loads(kv.value)["budgets"]["proxies"]
    assert sorted(rows) == ["p1", "p2", "p3"]
    assert all(row["t/t000"][3] == pytest.approx(1 / 3) for row in rows.values())
    # Once every replica reads the idle share, idle proxies have no row.
    await fleet.store.delete(REPLICAS + "cp-old")
    await leader_round(fleet)
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None and orjson.loads(kv.value)["budgets"]["proxies"] == {}


def test_counts_below_zero_are_reported_as_none_not_as_nothing_spent() -> None:
    hub = QuotaHub(MemoryStore(), "cp-a", constant_lease(0), interval=0.001)
    for proxy, month_tokens in (("p1", -40), ("p2", 40)):
        row = pb.ScopeDemand(
            scope=SCOPE, spent_epoch=1.0, spent_day=DAY, day_tokens=5, month_tokens=month_tokens
        )
        hub.report(proxy, [row])
    assert len(hub._demand["p1"][SCOPE]) == 5
    assert hub._demand["p2"][SCOPE][5:] == [1.0, DAY, 5, 40]


def many_keyed(n: int) -> pb.RouteTable:
    keys = tuple(
        ApiKeyRecord(f"k{i:09}", "a" * 64, "acme", limits=Limits(rpm=600, tpm=100_000))
        for i in range(n)
    )
    return compile_table(State(12, tenants=(Tenant("acme"),), keys=keys))


async def fleet_of_100_proxies_and_1000_keys() -> Fleet:
    fleet = Fleet(many_keyed(1000))
    await fleet.lead()
    names = [f"ponto-proxy-us-east-7d9f8c6b5-{i:03x}-w{w}" for i in range(50) for w in range(2)]
    await fleet.register(*names)
    rows = {f"k/k{i:09}": [1.0, 50.0, 0, 0, 0] for i in range(0, 1000, 7)}
    await fleet.store.put(DEMAND_PREFIX + "cp-a", orjson.dumps({"proxies": {names[0]: rows}}))
    return fleet


async def test_the_shares_of_100_proxies_and_1000_limited_keys_are_written_compressed() -> None:
    """Every proxy has a row for every scope with rates: 100 proxy processes
    (50 pods of 2 workers) and 1,000 rate-limited keys came to 2.8 MB, past
    etcd's 1.5 MiB a request, and the leader wrote no shares at all: proxies
    kept old shares, and new ones had none (every limited request refused)."""
    fleet = await fleet_of_100_proxies_and_1000_keys()
    await fleet.store.put(REPLICAS + "cp-a", orjson.dumps({"quota_format": QUOTA_FORMAT}))
    await leader_round(fleet)
    kv = await fleet.store.get(SHARES_KEY)
    assert kv is not None and kv.value.startswith(COMPRESSED)
    assert len(json_of(kv.value)) > MAX_REQUEST_BYTES > len(kv.value)
    shares, _, _ = decode_shares(kv.value)
    assert len(shares) == 100 and all(len(by_scope) == 1000 for by_scope in shares.values())
    # A replica reads it, and pushes each proxy its own.
    hub = QuotaHub(fleet.store, "cp-a", constant_lease(0), interval=0.001)
    await hub._load()
    quota = pb.RouteUpdate.FromString(hub.update_for(sorted(shares)[5])).quota
    assert quota.generation == kv.mod_revision and len(quota.shares) == 1000


async def test_while_a_replica_reads_no_compressed_shares_they_are_json_and_too_large_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = await fleet_of_100_proxies_and_1000_keys()
    await fleet.store.put(REPLICAS + "cp-old", orjson.dumps({"quota_format": 2}))
    rebalancer = noon_rebalancer(fleet)
    for _ in range(3):
        await rebalancer.round()
    assert await fleet.store.get(SHARES_KEY) is None
    too_large = [r for r in caplog.records if "past etcd's request limit" in r.getMessage()]
    assert [r.levelname for r in too_large] == ["ERROR"]
    # Small enough, plain JSON for such a replica (and for etcdctl).
    small = Fleet(limited_table())
    await small.lead()
    await small.register("p1")
    await small.store.put(REPLICAS + "cp-old", orjson.dumps({"quota_format": 2}))
    await leader_round(small)
    kv = await small.store.get(SHARES_KEY)
    assert kv is not None and kv.value.startswith(b"{")


async def test_shares_too_large_even_compressed_are_not_compressed_again_each_round(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Compressing megabytes of shares takes the event loop for tens of
    milliseconds; the same shares, as large, are not tried again each round."""
    caplog.set_level(logging.INFO)
    fleet = await fleet_of_100_proxies_and_1000_keys()
    await fleet.store.put(REPLICAS + "cp-a", orjson.dumps({"quota_format": QUOTA_FORMAT}))
    monkeypatch.setattr("controlplane.quotasync.MAX_REQUEST_BYTES", 20_000)  # under its 33 KB
    packs: list[int] = []

    def counted(body: bytes, readers: int) -> bytes:
        packs.append(len(body))
        return packed(body, readers)

    monkeypatch.setattr("controlplane.quotasync.packed", counted)
    rebalancer = noon_rebalancer(fleet)
    for _ in range(3):
        await rebalancer.round()
    assert len(packs) == 1 and await fleet.store.get(SHARES_KEY) is None
    assert [r.levelname for r in caplog.records if "not written" in r.getMessage()] == ["ERROR"]
    # Other shares (a proxy more) are tried again, and written once they fit.
    monkeypatch.setattr("controlplane.quotasync.MAX_REQUEST_BYTES", MAX_REQUEST_BYTES)
    await fleet.register("one-more")
    await rebalancer.round()
    assert len(packs) == 2 and await fleet.store.get(SHARES_KEY) is not None
    assert [r.getMessage()[:27] for r in caplog.records if "written again" in r.getMessage()] == [
        "quota shares written again "
    ]


def busy_hub(store: MemoryStore, lease: int, proxies: int, scopes: int) -> QuotaHub:
    """A replica whose `proxies` proxies report every one of `scopes` keys."""
    hub = QuotaHub(store, "cp-a", constant_lease(lease), interval=0.001)
    rows = [
        pb.ScopeDemand(scope=f"k/k{i:09}", requests_per_s=1.0, tokens_per_s=50.0)
        for i in range(scopes)
    ]
    for p in range(proxies):
        hub.report(f"ponto-proxy-us-east-7d9f8c6b5-{p:03x}", rows)
    return hub


async def test_a_large_demand_report_is_written_compressed_and_counted() -> None:
    """A replica's demand is one key of all its proxies' scopes: 100 proxies
    each busy in 600 keys came to 2.3 MB, past etcd's 1.5 MiB, and was
    never written (logged at DEBUG): the leader counted none of them."""
    fleet = Fleet(many_keyed(600))
    await fleet.lead()
    await fleet.store.put(REPLICAS + "cp-a", orjson.dumps({"quota_format": QUOTA_FORMAT}))
    hub = busy_hub(fleet.store, await fleet.store.grant_lease(30), 100, 600)
    key = DEMAND_PREFIX + "cp-a"
    async with running(hub.publish_demand()):
        await eventually(lambda: _written(fleet.store, key), "demand written")
    kv = await fleet.store.get(key)
    assert kv is not None and kv.value.startswith(COMPRESSED)
    assert len(json_of(kv.value)) > MAX_REQUEST_BYTES > len(kv.value)
    await fleet.register("ponto-proxy-us-east-7d9f8c6b5-000", "idle")
    await leader_round(fleet)
    shares = (await fleet.shares())[0]
    # Asked in every key, the proxy has the most of each share; the idle one a floor.
    busy, idle = shares["ponto-proxy-us-east-7d9f8c6b5-000"], shares["idle"]
    assert all(busy[s].fraction > 0.5 > idle[s].fraction for s in busy) and len(busy) == 600


async def test_a_demand_report_too_large_for_etcd_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """And not sent: etcd refuses it, and each refusal counted as etcd failing
    (PontoEtcdErrors, with a runbook pointing at etcd)."""
    store = MemoryStore()
    await store.put(REPLICAS + "cp-old", orjson.dumps({"quota_format": 2}))
    hub = busy_hub(store, await store.grant_lease(30), 100, 600)
    sent: list[str] = []
    put = store.put

    async def recorded(key: str, value: bytes, **kwargs: Any) -> int:
        sent.append(key)
        return await put(key, value, **kwargs)

    store.put = recorded  # type: ignore[method-assign]
    async with running(hub.publish_demand()):
        await eventually(lambda: _logged(caplog, "demand report not written"), "logged")
        hub.report("one-more", [])  # the demand changed: tried again, alike
        await asyncio.sleep(0.05)
    assert [r.levelname for r in caplog.records if "not written" in r.getMessage()] == ["ERROR"]
    assert await store.get(DEMAND_PREFIX + "cp-a") is None and sent == []


async def test_a_large_demand_report_while_etcd_is_away_is_not_called_too_large(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whether it fits was decided on the JSON when etcd could not say which
    replicas read it compressed: an ERROR that it was too large, for one
    that compresses to 28 KB."""
    store = MemoryStore()
    await store.put(REPLICAS + "cp-a", orjson.dumps({"quota_format": QUOTA_FORMAT}))
    hub = busy_hub(store, await store.grant_lease(30), 100, 600)
    store.available = False
    async with running(hub.publish_demand()):
        await asyncio.sleep(0.05)  # many intervals, etcd away in each
        store.available = True
        await eventually(lambda: _written(store, DEMAND_PREFIX + "cp-a"), "demand written")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def _written(store: MemoryStore, key: str) -> bool:
    return await store.get(key) is not None


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


# ------------------------------------------------------ a term's last counts


async def _ledger_used(fleet: Fleet) -> tuple[float, float] | None:
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    return None if kv is None else decode_ledger(kv.value).used()


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def counted_unwritten(fleet: Fleet, rebalancer: Rebalancer) -> asyncio.Task[None]:
    """`rebalancer` running as `fleet`'s leader, with p1's 300 tokens written
    in its ledger and 305 counted but not yet (half a percent of the day's
    1,000 waits LEDGER_ROUNDS rounds)."""
    await fleet.register("p1")
    await report(fleet, "p1", 300)
    task = asyncio.create_task(rebalancer.run())

    async def counted(tokens: float) -> bool:
        ledger = rebalancer._ledgers.get(SCOPE)
        return ledger is not None and ledger.used() == (tokens, tokens)

    await eventually(lambda: _is(_ledger_used(fleet), (300, 300)), "300 written")
    await report(fleet, "p1", 305)
    await eventually(lambda: counted(305), "305 counted")
    assert await _ledger_used(fleet) == (300, 300)
    return task


async def end_term(fleet: Fleet, task: asyncio.Task[None]) -> None:
    """As the election ends a term: the fence cleared, then the loops cancelled."""
    fleet.fence = None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("still_leader", [True, False])
async def test_a_term_that_ends_writes_the_counts_it_had_not_written(
    still_leader: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A ledger moved less than 1 % is written ten rounds on: a leader stopped
    meanwhile took those counts with it, and what processes that stopped too
    had counted was lost (a rolling upgrade of proxies and control plane).
    Written as the term ends, fenced by it: a leader that lost its
    leadership writes nothing."""
    caplog.set_level(logging.INFO)
    fleet = Fleet(budget_table())
    await fleet.lead()
    task = await counted_unwritten(fleet, noon_rebalancer(fleet, interval=0.01))
    if not still_leader:
        await fleet.lead()  # another term: the first's fence no longer holds
    await end_term(fleet, task)
    assert await _ledger_used(fleet) == ((305, 305) if still_leader else (300, 300))
    said = [r.getMessage() for r in caplog.records if "as the term ended" in r.getMessage()]
    assert said == [
        "budget ledgers' last counts written as the term ended (1)"
        if still_leader
        else "budget ledgers' last counts not written as the term ended (1 of 1): "
        "no longer the leader"
    ]


async def test_a_term_that_ends_before_reading_the_ledgers_writes_none_of_a_former_terms() -> None:
    """The same Rebalancer leads again: what its former term counted and did
    not write is not this term's to write, since another leader may have
    written since. A term ended before it had read the ledgers wrote them,
    fenced by its own valid leadership, over the newer ones."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    rebalancer = noon_rebalancer(fleet, interval=0.01)
    task = await counted_unwritten(fleet, rebalancer)
    fleet.store.available = False  # the first term's last counts are not written
    await end_term(fleet, task)
    fleet.store.available = True
    # Another leader counts 400, then this one leads again and its term ends
    # while it reads the shares.
    await report(fleet, "p1", 400)
    await leader_round(fleet)
    assert await _ledger_used(fleet) == (400, 400)
    await fleet.lead()
    reading = asyncio.Event()
    stored_get = fleet.store.get

    async def slow_get(key: str) -> KeyValue | None:
        if key == SHARES_KEY:
            reading.set()
            await asyncio.Event().wait()
        return await stored_get(key)

    fleet.store.get = slow_get  # type: ignore[method-assign]
    task = asyncio.create_task(rebalancer.run())
    await asyncio.wait_for(reading.wait(), 5)
    await end_term(fleet, task)
    assert await _ledger_used(fleet) == (400, 400)


@pytest.mark.parametrize("etcd", ["away", "not answering"])
async def test_a_terms_last_counts_wait_at_most_a_moment_for_etcd(
    etcd: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The election revokes the lease, and a shutdown goes on, once the
    leader's loops have ended: the last write waits FLUSH_S, no longer, and
    says what it did not write."""
    monkeypatch.setattr("controlplane.quotasync.FLUSH_S", 0.05)
    fleet = Fleet(budget_table())
    await fleet.lead()
    task = await counted_unwritten(fleet, noon_rebalancer(fleet, interval=0.01))
    if etcd == "away":
        fleet.store.available = False
    else:

        async def hang(*args: object, **kwargs: object) -> int:
            await asyncio.Event().wait()
            return 0

        monkeypatch.setattr(fleet.store, "commit", hang)
    await asyncio.wait_for(end_term(fleet, task), 5)
    fleet.store.available = True
    assert await _ledger_used(fleet) == (300, 300)
    said = [r.getMessage() for r in caplog.records if "as the term ended" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("budget ledgers' last counts not written as the term ended (1 of 1)")
    assert ("0.05 s" in said[0]) == (etcd == "not answering")


async def test_a_new_term_says_again_that_the_ledgers_are_not_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Said once while it lasts, a term: a term that ended while the writes
    failed left the next one's first failure at DEBUG."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await report(fleet, "p1", 300)

    async def refused(*args: object, **kwargs: object) -> int:
        raise StoreUnavailable("etcd is away")

    monkeypatch.setattr(fleet.store, "commit", refused)
    rebalancer = noon_rebalancer(fleet, interval=0.01)

    async def said(times: int, rounds: int) -> bool:
        warned = sum(
            r.levelno == logging.WARNING and r.getMessage().startswith("budget ledgers not written")
            for r in caplog.records
        )
        assert warned <= times
        return warned == times and rebalancer.rounds >= rounds

    async with running(rebalancer.run()):
        await eventually(lambda: said(1, 3), "said in the first term, and three rounds")
    async with running(rebalancer.run()):
        await eventually(lambda: said(2, 6), "said again in the second, and three rounds")


class Clocks:
    """A proxy process's monotonic clock and the wall's, moved by hand."""

    def __init__(self, wall: float) -> None:
        self.now = 0.0
        self.wall = wall

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


TPM = {SCOPE: ScopeLimits(tpm=600)}  # 10 tokens a second with the whole share


def tpm_process(
    state_dir: Path, clocks: Clocks, *, share_first: bool = True
) -> tuple[RateLimiter, QuotaState]:
    limiter = RateLimiter(epoch=clocks.wall)
    state = QuotaState(
        limiter, state_dir, clock=lambda: clocks.now, wall=lambda: clocks.wall, proxy="p1"
    )
    state.load_saved()
    if share_first:
        state.on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    state.on_limits(TPM)
    return limiter, state


@pytest.mark.parametrize("share_first", [True, False], ids=["share-first", "table-first"])
def test_a_restarted_proxy_owes_what_its_last_process_owed(
    tmp_path: Path, share_first: bool
) -> None:
    """Trial 56: a proxy restarted with its key 2.5 minutes in debt admitted
    at once (its buckets start at 0 at boot), and, reporting no debt, let
    the other proxies admit too. Its debt is saved with its counts, as the
    wall time it is repaid, and the next process owes it until then."""
    clocks = Clocks(NOON)
    first, state = tpm_process(tmp_path, clocks)
    clocks.advance(60.0)  # the boot's empty bucket full
    admitted = first.admit([SCOPE], 100, clocks.now)
    assert admitted.ok
    admitted.release(3100, clocks.now)  # 3,000 past the estimate: 250 s in debt
    stop(state)
    saved = orjson.loads((tmp_path / COUNTS_FILE).read_bytes())
    assert saved["debts"] == {SCOPE: [0.0, NOON + 60 + 250]}
    clocks = Clocks(NOON + 120)  # restarted a minute later: 190 s still owed
    second, state = tpm_process(tmp_path, clocks, share_first=share_first)
    if not share_first:  # no share, no refill: owed once the share comes
        assert not second.admit([SCOPE], 1, clocks.now).ok
        state.on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    clocks.advance(10.0)
    refused = second.admit([SCOPE], 1, clocks.now)
    assert not refused.ok and refused.limit == "tokens"
    assert refused.retry_after_s == pytest.approx(180.1, abs=0.2)
    # Its reports say the debt (the leader's fleet debt holds the others).
    [row] = state.demand()
    assert row.debt_tokens == pytest.approx(1800, abs=2)
    clocks.advance(181.0)
    assert second.admit([SCOPE], 1, clocks.now).ok
    stop(state)


def test_a_debt_repaid_before_the_restart_is_not_owed(tmp_path: Path) -> None:
    clocks = Clocks(NOON)
    first, state = tpm_process(tmp_path, clocks)
    clocks.advance(60.0)
    first.admit([SCOPE], 100, clocks.now).release(700, clocks.now)  # 60 s in debt
    stop(state)
    clocks = Clocks(NOON + 60 + 61)
    second, state = tpm_process(tmp_path, clocks)
    clocks.advance(1.0)
    assert second.admit([SCOPE], 5, clocks.now).ok  # the boot's empty bucket, refilling
    stop(state)


def test_a_debt_is_saved_as_when_it_is_repaid_which_refill_does_not_move() -> None:
    limiter = RateLimiter(epoch=1.0)
    limiter.set_day(DAY, NOON, 0.0)
    limiter.apply_shares({SCOPE: Share(1.0, 0)}, 0.0)
    limiter.configure(TPM, 0.0)
    limiter.admit([SCOPE], 0, 60.0)  # refilled: full
    limiter.admit([SCOPE], 100, 60.0).release(700, 60.0)
    # 100 past a full bucket, refilled at 10 a second: repaid 10 s on.
    assert limiter.debts(60.0) == {SCOPE: (0.0, NOON + 70)}
    assert limiter.debts(65.0) == {SCOPE: (0.0, NOON + 70)}
    assert limiter.debts(70.0) == {}


def test_a_reloads_new_process_owes_what_the_old_one_owed(tmp_path: Path) -> None:
    """The old process holds the counts until it stops (its new one counts
    its own), but what its buckets owe is owed by the new one too."""
    clocks = Clocks(NOON)
    old, old_state = tpm_process(tmp_path, clocks)
    clocks.advance(60.0)
    draining = old.admit([SCOPE], 100, clocks.now)  # a stream still under way
    old.admit([SCOPE], 100, clocks.now).release(3100, clocks.now)
    old_state.save_counts()  # as each second: the old process still runs
    new_clocks = Clocks(clocks.wall)
    new, new_state = tpm_process(tmp_path, new_clocks)
    assert new.counts() == {}
    assert new.debts(0.0) == {SCOPE: (0.0, NOON + 60 + 260)}  # 2,600 owed at 10 a second
    new_clocks.advance(10.0)
    assert not new.admit([SCOPE], 1, new_clocks.now).ok
    # The old one's last stream settles as it drains: 3,000 more owed, saved
    # as it stops; the new one, holding the counts now, owes that too.
    clocks.advance(10.0)
    draining.release(3100, clocks.now)
    stop(old_state)
    new_state.save_counts()  # takes the lock: reads the old one's last debts
    assert new.debts(new_clocks.now) == {SCOPE: (0.0, NOON + 70 + 550)}
    saved = orjson.loads((tmp_path / COUNTS_FILE).read_bytes())
    assert saved["debts"] == {SCOPE: [0.0, NOON + 70 + 550]}
    stop(new_state)


def test_a_saved_debt_is_owed_an_hour_at_most(tmp_path: Path) -> None:
    """Review: a wall clock stepped back a day between two processes made
    the next one owe the day (and report it to the leader)."""
    (tmp_path / COUNTS_FILE).write_bytes(
        orjson.dumps({"proxy": "p1", "counts": {}, "debts": {SCOPE: [0.0, NOON + 86400]}})
    )
    clocks = Clocks(NOON)
    limiter, state = tpm_process(tmp_path, clocks)
    clocks.advance(1.0)
    refused = limiter.admit([SCOPE], 1, clocks.now)
    assert not refused.ok and refused.retry_after_s == pytest.approx(3600, abs=2)
    stop(state)


def test_a_workers_change_carries_the_old_names_counts_but_not_their_debts(
    tmp_path: Path,
) -> None:
    """A debt is saved as the time its bucket is repaid at its process's
    share; another layout's processes have other shares, so worker 0 of
    the next layout, which carries the old name's budget counts, owes none
    of its debts (docs/rate-limits.md: an amount it cannot know)."""
    (tmp_path / COUNTS_FILE).write_bytes(
        orjson.dumps(
            {
                "proxy": "p1",
                "counts": {SCOPE: [7.0, DAY, 600, 600]},
                "debts": {SCOPE: [0.0, NOON + 100]},
            }
        )
    )
    clocks = Clocks(NOON)
    limiter = RateLimiter(epoch=NOON)
    name = worker_name("p1", 0, 4)
    state = QuotaState(
        limiter,
        tmp_path / "w0",
        clock=lambda: clocks.now,
        wall=lambda: clocks.wall,
        proxy=name,
        others=other_layouts(tmp_path / "w0", 0, 4),
        siblings=layout_siblings(name, 0, 4),
    )
    state.load_saved()
    state.on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    state.on_limits({SCOPE: ScopeLimits(tpm=600, tokens_per_day=1000, tokens_per_month=5000)})
    [row] = [c for d in state.demand() if d.scope == SCOPE for c in d.closed]
    assert (row.proxy, row.day_tokens) == ("p1", 600)  # the counts: carried
    assert limiter.debts(clocks.now) == {}  # the debt: not owed
    clocks.advance(1.0)  # a bucket starts empty: a second's refill
    assert limiter.admit([SCOPE], 1, clocks.now).ok
    stop(state)


@pytest.mark.parametrize("workers", [2, 11])
def test_a_worker_named_anew_carries_what_its_old_name_saved(tmp_path: Path, workers: int) -> None:
    """A NAME of 58 to 60 characters was kept whole in its workers' names
    (NAME-w0, up to 63) and is cut to WORKER_ROOM now: the upgraded worker
    finds its directory's counts under its old name, this proxy's still
    (same_proxy), and carries them under it, with the rows that name
    carried. Taken for another proxy's, they were dropped, and the last
    interval of the old name with them."""
    name = "n" * (60 if workers < 11 else 59)
    old, new = f"{name}-w0", worker_name(name, 0, workers)
    assert new != old
    (tmp_path / "w0").mkdir()
    (tmp_path / "w0" / COUNTS_FILE).write_bytes(
        orjson.dumps(
            {
                "proxy": old,
                "counts": {SCOPE: [7.0, DAY, 600, 600]},
                "carried_of": {SCOPE: [["p9", 5.0, DAY, 10, 10]]},
            }
        )
    )
    clocks = Clocks(NOON)
    state = QuotaState(
        RateLimiter(epoch=NOON),
        tmp_path / "w0",
        clock=lambda: clocks.now,
        wall=lambda: clocks.wall,
        proxy=new,
        others=other_layouts(tmp_path / "w0", 0, workers),
        siblings=layout_siblings(new, 0, workers),
    )
    state.load_saved()
    state.on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    state.on_limits({SCOPE: ScopeLimits(tpm=600, tokens_per_day=1000, tokens_per_month=5000)})
    rows = {(c.proxy, c.day_tokens) for d in state.demand() if d.scope == SCOPE for c in d.closed}
    assert rows == {(old, 600), ("p9", 10)}
    stop(state)


def test_a_debt_of_a_limit_the_first_table_lacks_is_owed_when_it_comes(tmp_path: Path) -> None:
    """Review: a saved table without the scope's tpm dropped its token debt,
    and the control plane's table then made the bucket full."""
    (tmp_path / COUNTS_FILE).write_bytes(
        orjson.dumps({"proxy": "p1", "counts": {}, "debts": {SCOPE: [0.0, NOON + 100]}})
    )
    clocks = Clocks(NOON)
    limiter = RateLimiter(epoch=NOON)
    state = QuotaState(
        limiter, tmp_path, clock=lambda: clocks.now, wall=lambda: clocks.wall, proxy="p1"
    )
    state.load_saved()
    state.on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
    state.on_limits({SCOPE: ScopeLimits(rpm=600)})  # the disk's older table
    clocks.advance(10.0)
    state.on_limits({SCOPE: ScopeLimits(rpm=600, tpm=600)})  # a new limit: starts full
    assert not limiter.admit([SCOPE], 1, clocks.now).ok  # but owes 90 s
    stop(state)


def test_damaged_debts_leave_the_counts_standing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = {"proxy": "p1", "counts": {SCOPE: [7.0, DAY, 600, 600]}, "debts": {SCOPE: None}}
    (tmp_path / COUNTS_FILE).write_bytes(orjson.dumps(saved))
    limiter, state = proxy_process(tmp_path, epoch=9.0)
    assert limiter.counts() == {SCOPE: Spent(7.0, DAY, 600, 600)}
    [error] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert error.getMessage().startswith("ignoring saved debts") and not error.exc_info
    state.close()


# ---------------------------------------------------------------- closed periods and reloads

DEC31 = 20261231
JAN1 = 20270101
LAST_SECONDS = calendar.timegm((2026, 12, 31, 23, 59, 30, 0, 0, 0))


def test_a_months_last_interval_reported_after_the_turn_counts_in_that_month() -> None:
    """Trial: a proxy's counts zeroed at midnight before its report was built,
    and the leader's December stayed at 18,805 of 20,212 tokens. Its final
    counts of December come with its January reports (Demand.closed), and
    the ledger keeps the closed month's total."""
    ledger = account(None, {"p1": spent(1.0, 805, 18_805, day=DEC31)}, DEC31)
    ledger = account(ledger, {"p2": spent(2.0, 5, 5, day=DEC31)}, JAN1)
    assert ledger.used() == (0, 0)
    final = spent(1.0, 2212, 20_212, day=DEC31)
    ledger = account(ledger, {"p1": spent(1.0, 40, 40, day=JAN1)}, JAN1, {"p1": [final]})
    assert ledger.used() == (40, 40)
    assert ledger.closed_used() == (DEC31, 2217, 202612, 20_217)
    # Sent again and again (each report for ten minutes): counted once.
    ledger = account(ledger, {"p1": spent(1.0, 50, 50, day=JAN1)}, JAN1, {"p1": [final]})
    assert ledger.closed_used() == (DEC31, 2217, 202612, 20_217)
    # Kept in the ledger (a new leader reads it) until the next turn.
    assert decode_ledger(ledger.encode()) == ledger
    assert account(ledger, {}, 20270201).closed_used()[2:] == (202701, 50)
    # A leader whose clock is still in December takes it into its month.
    behind = account(None, {"p1": spent(1.0, 805, 18_805, day=DEC31)}, DEC31)
    behind = account(behind, {"p1": spent(1.0, 40, 40, day=JAN1)}, DEC31, {"p1": [final]})
    assert behind.used() == (2212, 20_212)


def test_a_closed_month_counts_a_folded_process_once() -> None:
    """Review 311: at the month's turn a folded process's count stayed in
    the closed month's folded total, and its later reports of that month
    (a clock days behind; a proxy back after days cut off) were added on
    top: 2,400 of a December's 1,800 tokens."""
    dec28, dec29 = 20261228, 20261229
    # p2's clock is three days behind: folded every round, counted once.
    ledger = account(None, {"p1": spent(1.0, 100, 1000, day=DEC31)}, DEC31)
    ledger = account(ledger, {"p2": spent(2.0, 50, 600, day=dec28)}, DEC31)
    assert ledger.used() == (100, 1600) and "p2@2.0" in ledger.folded
    final = spent(1.0, 200, 1100, day=DEC31)
    ledger = account(ledger, {"p1": spent(1.0, 5, 5, day=JAN1)}, JAN1, {"p1": [final]})
    assert ledger.closed_used()[2:] == (202612, 1700)
    # Its December reports go on in January: each replaces the last.
    for month_tokens in (650, 700, 700):
        ledger = account(ledger, {"p2": spent(2.0, 60, month_tokens, day=dec29)}, JAN1)
    assert ledger.closed_used()[2:] == (202612, 1800)
    assert decode_ledger(ledger.encode()) == ledger
    # A proxy cut off for days, back after the turn with its final count.
    cut = account(None, {"p1": spent(1.0, 100, 500, day=20261220)}, 20261220)
    cut = account(cut, {"p3": spent(3.0, 30, 300, day=20261227)}, 20261227)
    assert "p1@1.0" in cut.folded and cut.used()[1] == 800
    cut = account(cut, {}, JAN1, {"p1": [spent(1.0, 30, 530, day=20261226)]})
    assert cut.closed_used()[2:] == (202612, 830)


def test_a_days_final_counts_count_in_that_day_though_a_later_day_displaced_them() -> None:
    ledger = account(None, {"p1": spent(1.0, 100, 300), "p2": spent(2.0, 50, 50)}, DAY)
    # p1 turned its day before the leader did: its final count of DAY comes
    # with its first of the next, which displaces it as p1's row.
    ledger = account(
        ledger, {"p1": spent(1.0, 7, 327, day=DAY + 1)}, DAY, {"p1": [spent(1.0, 120, 320)]}
    )
    assert ledger.used() == (50, 377)
    ledger = account(ledger, {}, DAY + 1)
    assert ledger.used() == (7, 377)
    assert ledger.closed_used()[:2] == (DAY, 170)
    # The month is counted by p1's newest row, not its closed one too.
    assert account(ledger, {}, DAY + 2).closed_used()[:2] == (DAY + 1, 7)


def limiter_at(wall: float, limits: ScopeLimits = BUDGET) -> RateLimiter:
    limiter = RateLimiter(epoch=1.0)
    limiter.configure({SCOPE: limits}, 0.0)
    limiter.set_day(utc_day(wall), wall, 0.0)
    return limiter


def test_a_turn_reports_the_closed_periods_final_counts_and_answers_settle_there() -> None:
    """An answer admitted at 23:59:59 and ended after midnight was settled
    into January (floored at 0): December kept its over-reservation, and
    the refund came out of January."""
    limiter = limiter_at(LAST_SECONDS)
    limiter.admit([SCOPE], 100, 1.0, most=50).release(140, 2.0)  # 140
    streaming = limiter.admit([SCOPE], 100, 29.0, most=50)  # 150 charged
    assert limiter.demand(29.5)[SCOPE].spent == Spent(1.0, DEC31, 290, 290)
    limiter.set_day(JAN1, LAST_SECONDS + 31, 31.0)  # the report task, past midnight
    report = limiter.demand(31.5)[SCOPE]
    assert report.spent is None and report.closed == (Spent(1.0, DEC31, 290, 290),)
    streaming.release(120, 40.0)  # 30 less than charged: given back to December
    assert limiter.admit([SCOPE], 10, 41.0, most=0).ok
    report = limiter.demand(42.0)[SCOPE]
    assert report.spent == Spent(1.0, JAN1, 10, 10)
    assert report.closed == (Spent(1.0, DEC31, 260, 260),)
    # In 600 reports (ten minutes), then no longer.
    for i in range(CLOSED_REPORTS - 2):
        assert limiter.demand(43.0 + i)[SCOPE].closed
    assert limiter.demand(700.0)[SCOPE].closed == ()


def test_within_a_month_a_late_settlement_moves_the_closed_day_and_the_month() -> None:
    limiter = limiter_at_noon()
    streaming = limiter.admit([SCOPE], 100, 1.0, most=50)
    limiter.set_day(DAY + 1, NOON + 12 * 3600, 12 * 3600)
    streaming.release(200, 12 * 3600 + 1)  # 50 past the charge
    report = limiter.demand(12 * 3600 + 2)[SCOPE]
    assert report.spent == Spent(1.0, DAY + 1, 0, 200)
    assert report.closed == (Spent(1.0, DAY, 200, 200),)


def test_counts_are_whole_tokens_though_the_completion_expected_is_not() -> None:
    """Trial: ponto_control_budget_spent_tokens 1411.0000000000002, a month
    of 18804.917 tokens: the completion expected (a moving average) was
    charged with its fractions."""
    limiter = limiter_at_noon(ScopeLimits(tokens_per_day=100_000))
    for i, answer in enumerate((61, 77, 93)):
        limiter.admit([SCOPE], 10, float(i)).release(answer, float(i))
    open_ = [limiter.admit([SCOPE], 10, 5.0) for _ in range(3)]
    [counts] = limiter.counts().values()
    expected = expected_after([51, 67, 83])
    assert expected != int(expected)  # 114.25: charged 115
    assert counts.day_tokens == 231 + 3 * (10 + math.ceil(expected))
    for a in open_:
        a.release(None, 6.0)
    assert limiter.counts()[SCOPE].day_tokens == 231 + 30


def test_a_reloads_old_worker_reports_its_final_counts_through_the_new_one_once(
    tmp_path: Path,
) -> None:
    """Trial: with the leader up, two reloads lost 2,080 of 10,400 tokens: the
    old worker stops reporting once the new one registers, serves on (and
    settles as it drains), and saves its counts as it stops, which the new
    one's saves replaced unheard."""
    old, old_state = proxy_process(tmp_path, epoch=7.0)
    old.admit([SCOPE], 300, 1.0, most=0)
    reports = [old_state.demand()]  # the leader hears 300 of it
    new, new_state = proxy_process(tmp_path, epoch=9.0)  # registers: the old one goes quiet
    old.admit([SCOPE], 200, 1.0, most=0)
    new.admit([SCOPE], 100, 1.0, most=0)
    reports.append(new_state.demand())
    stop(old_state)  # its last 200, saved as it stops
    reports += [new_state.demand(), new_state.demand()]
    [row] = reports[-1]
    assert [(c.epoch, c.day, c.day_tokens) for c in row.closed] == [(7.0, DAY, 500)]
    assert (row.spent_epoch, row.day_tokens) == (9.0, 100)
    ledger = None
    for report in reports:
        d = {r.scope: r for r in report}[SCOPE]
        ledger = account(
            ledger,
            {"p1": Spent(d.spent_epoch, d.spent_day, d.day_tokens, d.month_tokens)},
            DAY,
            {"p1": [Spent(c.epoch, c.day, c.day_tokens, c.month_tokens) for c in d.closed]},
        )
    assert ledger is not None and ledger.used() == (600, 600)
    # Killed after it took them: its successor carries the old one's counts on.
    new_state.close()
    _, third = proxy_process(tmp_path, epoch=11.0)
    [row] = third.demand()
    assert (row.spent_epoch, row.day_tokens) == (9.0, 100)
    assert [(c.epoch, c.day_tokens) for c in row.closed] == [(7.0, 500)]
    third.close()


def test_closed_counts_go_through_a_replica_to_the_leader() -> None:
    hub = QuotaHub(MemoryStore(), "cp-a", constant_lease(0), interval=0.001)
    row = pb.ScopeDemand(scope=SCOPE, spent_epoch=9.0, spent_day=DAY, day_tokens=5, month_tokens=5)
    row.closed.add(epoch=7.0, day=DAY, day_tokens=500, month_tokens=500)
    row.closed.add(epoch=7.0, day=DAY - 1, day_tokens=-1, month_tokens=40)  # not a count
    hub.report("p1", [row])
    got = _demand_of(hub._demand["p1"][SCOPE])
    assert got.spent == Spent(9.0, DAY, 5, 5) and got.closed == (Spent(7.0, DAY, 500, 500),)
    # A month's first report: no count of its own yet, its closed ones all the same.
    first = pb.ScopeDemand(scope=SCOPE)
    first.closed.add(epoch=9.0, day=DEC31, day_tokens=8, month_tokens=80)
    hub.report("p2", [first])
    got = _demand_of(hub._demand["p2"][SCOPE])
    assert got.spent is None and got.closed == (Spent(9.0, DEC31, 8, 80),)


async def test_the_closed_periods_totals_are_listed_beside_todays() -> None:
    store = MemoryStore()
    ledger = account(None, {"p1": spent(1.0, 805, 18_805, day=DEC31)}, DEC31)
    final = spent(1.0, 2212, 20_212, day=DEC31)
    ledger = account(ledger, {"p1": spent(1.0, 40, 40, day=JAN1)}, JAN1, {"p1": [final]})
    await store.put(LEDGER_PREFIX + SCOPE, ledger.encode())
    catalog = Catalog(store)
    jan1_noon = calendar.timegm((2027, 1, 1, 12, 0, 0, 0, 0, 0))
    assert await catalog.budgets_spent("t/", jan1_noon) == {
        SCOPE: (JAN1, 40, 40, DEC31, 2212, 202612, 20_212)
    }
    # A ledger not counted since the turn: what it counted is the closed period's.
    before = account(None, {"p1": spent(1.0, 805, 18_805, day=DEC31)}, DEC31)
    await store.put(LEDGER_PREFIX + SCOPE, before.encode())
    assert await catalog.budgets_spent("t/", jan1_noon) == {
        SCOPE: (JAN1, 0, 0, DEC31, 805, 202612, 18_805)
    }


def test_a_restart_across_midnight_reports_the_closed_days_final_counts(tmp_path: Path) -> None:
    """Stopped before midnight and started after it, a process goes on from
    its month's count, and its saved count of the day before (its final one
    of that day) goes with its reports for that day's total."""
    first, state = proxy_process(tmp_path, epoch=7.0)
    first.admit([SCOPE], 300, 1.0, most=0)
    stop(state)  # the leader heard none of it
    _, state = proxy_process(tmp_path, epoch=9.0, wall=NOON + 86400)
    [row] = state.demand()
    assert (row.spent_epoch, row.spent_day, row.day_tokens, row.month_tokens) == (
        7.0,
        DAY + 1,
        0,
        300,
    )
    assert [(c.epoch, c.day, c.day_tokens) for c in row.closed] == [(7.0, DAY, 300)]
    state.close()


def test_a_proxy_cut_off_across_two_turns_still_reports_the_first_ones_final_counts() -> None:
    """Review 311: cut off from 20:00 Dec 31 to 00:30 Jan 2, a proxy sent
    only its final count of Jan 1: December's, never sent, was overwritten
    at the second turn, and the leader's December stayed short of it."""
    limiter = limiter_at(LAST_SECONDS)
    limiter.admit([SCOPE], 100, 1.0, most=50).release(400, 2.0)
    limiter.set_day(JAN1, LAST_SECONDS + 31, 31.0)  # no report in between
    limiter.admit([SCOPE], 10, 32.0, most=0).release(30, 33.0)
    limiter.set_day(20270102, LAST_SECONDS + 86_431, 86_431.0)
    report = limiter.demand(86_432.0)[SCOPE]
    assert set(report.closed) == {Spent(1.0, DEC31, 400, 400), Spent(1.0, JAN1, 30, 30)}


def test_carried_rows_are_each_processs_newest_and_bounded() -> None:
    """Review 311: a reload every five minutes put 10, 20, 30, 40 closed
    rows in every report, and each reload reset the window of them all."""
    limiter = limiter_at_noon()
    for epoch in range(1, 41):
        limiter.carry({SCOPE: [spent(float(epoch), 1, 10), spent(float(epoch), 2, 20)]})
    rows = limiter.carried()[SCOPE]
    assert len(rows) == MAX_CARRIED
    assert rows == [spent(float(e), 2, 20) for e in range(33, 41)]


def test_a_worker_two_reloads_retired_before_it_held_the_counts_leaves_them_to_the_holder(
    tmp_path: Path,
) -> None:
    """Two reloads in a row: the first one's new worker is retired by the
    second while the first one's old worker still drains, so it never holds
    the lock, and saved nothing as it stopped; what it spent since its
    successor registered was lost."""
    old, old_state = proxy_process(tmp_path, epoch=7.0)
    old.admit([SCOPE], 300, 1.0, most=0)
    first, first_state = proxy_process(tmp_path, epoch=9.0)
    first.admit([SCOPE], 100, 1.0, most=0)
    _, second_state = proxy_process(tmp_path, epoch=11.0)
    stop(old_state)
    second_state.save_counts()  # the second takes the lock, and the old one's counts
    first.admit([SCOPE], 50, 1.0, most=0)  # after the second registered: unreported
    stop(first_state)  # no lock: its counts in a file of its own
    second_state.save_counts()
    [row] = second_state.demand()
    assert sorted((c.epoch, c.day_tokens) for c in row.closed) == [(7.0, 300), (9.0, 150)]
    second_state.save_counts()  # carried in the save before: its file goes
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == [COUNTS_FILE]
    saved = orjson.loads((tmp_path / COUNTS_FILE).read_bytes())
    assert sorted(row[0] for row in saved["carried"][SCOPE]) == [7.0, 9.0]
    second_state.close()


async def test_the_leader_counts_a_proxys_closed_counts_through_a_replica() -> None:
    """From the proxy's report to the ledger in etcd: a reload's new worker
    reports its own counts and, beside them, the old worker's final ones."""
    fleet = Fleet(budget_table())
    await fleet.lead()
    await fleet.register("p1")
    await report(fleet, "p1", 300)  # the old worker's last report
    await leader_round(fleet)
    hub = QuotaHub(fleet.store, "cp-p1", constant_lease(fleet.lease), interval=0.001)
    row = pb.ScopeDemand(scope=SCOPE, spent_epoch=9.0, spent_day=DAY, day_tokens=5, month_tokens=5)
    row.closed.add(epoch=1.0, day=DAY, day_tokens=340, month_tokens=340)  # its final counts
    hub.report("p1", [row])
    body = orjson.dumps({"proxies": hub._demand})
    await fleet.store.put(DEMAND_PREFIX + "cp-p1", body, lease=fleet.lease)
    await leader_round(fleet)
    kv = await fleet.store.get(LEDGER_PREFIX + SCOPE)
    assert kv is not None and decode_ledger(kv.value).used() == (345, 345)


def test_a_request_for_n_completions_is_charged_n_expected_and_teaches_one() -> None:
    """Trial 86: an eval's `n: 8` requests (pass@k) were each charged one
    completion expected at admission, so a burst of them near a budget's end
    passed it by seven answers each, and their answers, learned whole, made
    the next `n: 1` requests expect eight. Each choice is an answer."""
    limiter = limiter_at_noon(ScopeLimits(tokens_per_day=100_000))
    limiter.admit([SCOPE], 10, 1.0).release(60, 1.0)  # 50 past its estimate
    assert charge_of(limiter, 10, 2.0) == 10 + (256 + 50) / 2
    # n: 8 is charged eight completions expected, the bound it states at most.
    assert charge_of(limiter, 10, 3.0, choices=8) == 10 + 8 * (256 + 50) / 2
    assert charge_of(limiter, 10, 4.0, most=8 * 100, choices=8) == 10 + 8 * 100
    # Its answer, 8 times 50 past its estimate, is learned as answers of 50 each.
    limiter.admit([SCOPE], 10, 5.0, choices=8).release(10 + 8 * 50, 5.0)
    assert charge_of(limiter, 10, 6.0) == 10 + math.ceil(expected_after([50, 50]))
    # Near the end of a budget, a burst of n: 8 fits by eight answers each.
    tight = limiter_at_noon(ScopeLimits(tokens_per_day=10_000))
    burst = [tight.admit([SCOPE], 10, 1.0, choices=8) for _ in range(8)]
    assert sum(a.ok for a in burst) == 10_000 // (10 + 8 * int(FIRST_COMPLETION)) == 4


# ---------------------------------------------------------------- --workers changed


def layout_process(
    root: Path, epoch: float, index: int | None, workers: int
) -> tuple[RateLimiter, QuotaState]:
    """Worker `index` of a proxy "p1" started with `--workers workers` and
    `--state-dir root` (None: `--workers 1`), as dataplane.settings.as_worker
    names and places it, the leader away."""
    name = "p1" if index is None else worker_name("p1", index, workers)
    state_dir = root if index is None else root / f"w{index}"
    limiter = RateLimiter(epoch=epoch)
    state = QuotaState(
        limiter,
        state_dir,
        clock=lambda: 1.0,
        wall=lambda: NOON,
        proxy=name,
        others=other_layouts(state_dir, index, workers),
        siblings=layout_siblings(name, index, workers),
    )
    state.load_saved()
    state.on_limits({SCOPE: BUDGET})
    return limiter, state


def through_a_replica(ledger: Ledger | None, reports: dict[str, list[pb.ScopeDemand]]) -> Ledger:
    """One round of `reports` (proxy name -> its report), as a replica
    writes them for the leader and the leader counts them (QuotaHub.report,
    Rebalancer._account)."""
    hub = QuotaHub(MemoryStore(), "cp-a", constant_lease(0), interval=0.001)
    for proxy, rows in reports.items():
        hub.report(proxy, rows)
    written = orjson.loads(orjson.dumps(hub._report_body()))["proxies"]
    demand = {p: {s: _demand_of(v) for s, v in by.items()} for p, by in written.items()}
    counts = {p: d.spent for p, by in demand.items() if (d := by.get(SCOPE)) and d.spent}
    closed = {p: d.closed for p, by in demand.items() if (d := by.get(SCOPE)) and d.closed}
    return account(ledger, counts, DAY, closed)


def test_a_workers_change_reports_the_old_names_last_counts_under_their_names_once(
    tmp_path: Path,
) -> None:
    """Trial 90: 290 tokens to `--workers 1`, restarted with `--workers 4`:
    the ledger rose by 175, the other 115 (the last report interval, saved as
    it stopped) only once `--workers 1` came back. The new layout's worker 0
    carries the names gone (the single one's, slots past N) under their
    names; then 4 -> 2 and 2 -> 1, each counted once."""
    single, state = layout_process(tmp_path, 7.0, None, 1)
    single.admit([SCOPE], 175, 1.0, most=0)
    ledger = through_a_replica(None, {"p1": state.demand()})
    single.admit([SCOPE], 115, 1.0, most=0)  # the last interval, unreported
    stop(state)
    spent_so_far = 290

    def layout(epoch: float, workers: int, spend: int) -> list[QuotaState]:
        nonlocal ledger, spent_so_far
        procs = [layout_process(tmp_path, epoch + i, i, workers) for i in range(workers)]
        for limiter, _ in procs:
            limiter.admit([SCOPE], spend, 1.0, most=0)
        for _ in range(2):  # reported again: changes nothing
            rounds = {s._proxy: s.demand() for _, s in procs}
            ledger = through_a_replica(ledger, rounds)
        for limiter, _ in procs:
            limiter.admit([SCOPE], spend, 1.0, most=0)  # unreported
        spent_so_far += 2 * spend * workers
        for _, s in procs:
            stop(s)
        return [s for _, s in procs]

    layout(10.0, 4, 10)  # 1 -> 4
    assert ledger.used()[0] == 290 + 4 * 10  # the 115 too, and once
    layout(20.0, 2, 20)  # 4 -> 2: w2 and w3's last 10 each carried by w0
    assert ledger.used()[0] == spent_so_far - 2 * 20
    layout(30.0, 3, 5)  # 2 -> 3: no name gone
    assert ledger.used()[0] == spent_so_far - 3 * 5
    # 3 -> 1: the single one goes on from its own counts (epoch 7) and
    # carries every worker's.
    _, state = layout_process(tmp_path, 40.0, None, 1)
    for _ in range(2):
        ledger = through_a_replica(ledger, {"p1": state.demand()})
    assert ledger.used() == (spent_so_far, spent_so_far)
    state.close()


def test_carried_rows_past_a_reports_bound_are_counted_once_each_as_they_go_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 -> 1 with a bound of some 5 rows a report (CARRIED_REPORT_BYTES):
    each report carries a few names' last counts; the leader, which keeps
    each process's last row, counts them all once the turn is done, and
    again the same at the next turn."""
    monkeypatch.setattr(quota_module, "CARRIED_REPORT_BYTES", 250)
    procs = [layout_process(tmp_path, 10.0 + i, i, 16) for i in range(16)]
    for limiter, state in procs:
        limiter.admit([SCOPE], 10, 1.0, most=0)  # unreported
        stop(state)
    _, single = layout_process(tmp_path, 40.0, None, 1)
    ledger = None
    sent, counted = [], []
    for _ in range(8):
        report = single.demand()
        sent.append(len(report[0].closed))
        ledger = through_a_replica(ledger, {"p1": report})
        counted.append(ledger.used()[0])
    assert sent == [5] * 8  # the rows of 16 names, round the end and again
    assert counted == [50, 100, 150, 160, 160, 160, 160, 160]
    single.close()


def test_only_worker_0_carries_the_names_gone_and_waits_while_one_runs(tmp_path: Path) -> None:
    """Worker 0 of N carries the single process's directory and the slots
    past N; the other workers none (each name's rows once). One whose
    process still holds its counts reports them itself: taken once it stops."""
    for index in (0, 1, 2):
        (tmp_path / f"w{index}").mkdir()
    (tmp_path / "w10").mkdir()
    (tmp_path / "w01").mkdir()  # no slot's
    assert other_layouts(tmp_path, None, 1) == [tmp_path / f"w{i}" for i in (0, 1, 2, 10)]
    assert other_layouts(tmp_path / "w0", 0, 2) == [tmp_path, tmp_path / "w2", tmp_path / "w10"]
    assert other_layouts(tmp_path / "w1", 1, 2) == []
    old, old_state = layout_process(tmp_path, 7.0, 2, 3)  # p1-w2 of 3, still running
    old.admit([SCOPE], 100, 1.0, most=0)
    old_state.save_counts()
    _, new_state = layout_process(tmp_path, 9.0, 0, 2)
    assert SCOPE not in new_state._limiter.carried()
    stop(old_state)
    new_state.save_counts()
    [row] = new_state.demand()
    assert [(c.proxy, c.epoch, c.day_tokens) for c in row.closed] == [("p1-w2", 7.0, 100)]
    new_state.save_counts()
    # Saved for the process after it, apart from its own name's (a build
    # before names would count them as its own).
    saved = orjson.loads((tmp_path / "w0" / COUNTS_FILE).read_bytes())
    assert saved["carried_of"] == {SCOPE: [["p1-w2", 7.0, DAY, 100.0, 100.0]]}
    assert "carried" not in saved
    new_state.close()
    # Two names' processes that started at one instant are two rows; and
    # the bound on them is each name's (`--workers 1` after 16 carries 16).
    limiter = limiter_at_noon()
    limiter.carry({SCOPE: [Spent(1.0, DAY, 10, 10, "p1-w0"), Spent(1.0, DAY, 20, 20, "p1-w1")]})
    assert len(limiter.carried()[SCOPE]) == 2
    limiter.carry({SCOPE: [Spent(2.0, DAY, 1, 1, f"p1-w{i}") for i in range(16)]})
    limiter.carry({SCOPE: [spent(float(e), 1, 1) for e in range(3, 13)]})
    rows = limiter.carried()[SCOPE]
    assert len(rows) == 2 + 16 + MAX_CARRIED
    assert [s.epoch for s in rows if not s.proxy] == [float(e) for e in range(5, 13)]


def test_another_names_rows_go_only_to_a_replica_that_takes_them() -> None:
    """A replica from before SpentCount.proxy would count them as the
    reporter's own: twice."""
    demand = pb.ScopeDemand(scope=SCOPE, spent_epoch=9.0, spent_day=DAY, day_tokens=5)
    demand.closed.add(epoch=7.0, day=DAY, day_tokens=50, month_tokens=50)
    demand.closed.add(epoch=8.0, day=DAY, day_tokens=60, month_tokens=60, proxy="p1")
    client = ControlPlaneClient(
        TableHolder("us-east", None),
        ["127.0.0.1:1"],
        pb.ProxyInfo(name="p1-w0"),
        demand=lambda: [pb.ScopeDemand.FromString(demand.SerializeToString())],
    )
    [row] = client.report("s").demand
    assert [c.epoch for c in row.closed] == [7.0]
    client._named_counts = True  # RegisterResponse.takes_named_counts
    [row] = client.report("s").demand
    assert [(c.epoch, c.proxy) for c in row.closed] == [(7.0, ""), (8.0, "p1")]


def test_a_replica_writes_another_names_rows_under_that_name_of_the_same_proxy() -> None:
    hub = QuotaHub(MemoryStore(), "cp-a", constant_lease(0), interval=0.001)
    carrying = pb.ScopeDemand(scope=SCOPE, spent_epoch=9.0, spent_day=DAY, day_tokens=5)
    carrying.closed.add(epoch=7.0, day=DAY, day_tokens=50, month_tokens=50, proxy="p1")
    carrying.closed.add(epoch=6.0, day=DAY, day_tokens=70, month_tokens=70, proxy="p1-w3")
    carrying.closed.add(epoch=5.0, day=DAY, day_tokens=90, month_tokens=90, proxy="p2")
    hub.report("p1-w0", [carrying])
    hub.report("p1-w3", [pb.ScopeDemand(scope=SCOPE, requests_per_s=2.0)])  # it runs here too
    body = hub._report_body()
    rows = {p: _demand_of(by[SCOPE]) for p, by in body["proxies"].items()}
    assert rows["p1-w0"].closed == ()
    assert rows["p1"].closed == (spent(7.0, 50, 50),) and rows["p1"].spent is None
    assert rows["p1-w3"].requests_per_s == 2.0
    assert rows["p1-w3"].closed == (spent(6.0, 70, 70),)
    assert "p2" not in rows  # another proxy's name: not this one's to report
    assert "p1" not in body["heard"]
    hub.forget("p1-w0")
    assert set(hub._report_body()["proxies"]) == {"p1-w3"}


def test_worker_0_carries_no_copy_of_a_name_its_own_layout_runs(tmp_path: Path) -> None:
    """4 -> 1 -> 4: the single process saved the workers' last counts among
    those it carried, and worker 0 of the next 4 carried that copy of
    p1-w1's while p1-w1 went on from its own counts under the same key: a
    round without p1-w1's report (its reload's drain, a restart) took the
    leader's count of it back to the copy's."""
    procs = [layout_process(tmp_path, 10.0 + i, i, 4) for i in range(4)]
    for limiter, _ in procs:
        limiter.admit([SCOPE], 10, 1.0, most=0)
    ledger = through_a_replica(None, {s._proxy: s.demand() for _, s in procs})
    for _, s in procs:
        stop(s)
    _, single = layout_process(tmp_path, 20.0, None, 1)
    ledger = through_a_replica(ledger, {"p1": single.demand()})
    stop(single)
    procs = [layout_process(tmp_path, 30.0 + i, i, 4) for i in range(4)]
    procs[1][0].admit([SCOPE], 500, 1.0, most=0)
    ledger = through_a_replica(ledger, {s._proxy: s.demand() for _, s in procs})
    assert ledger.used()[0] == 540
    # p1-w1's report missing from a round: worker 0's alone.
    ledger = through_a_replica(ledger, {"p1-w0": procs[0][1].demand()})
    assert ledger.used()[0] == 540
    # Nor is one saved for worker 0's next process.
    saved = orjson.loads((tmp_path / "w0" / COUNTS_FILE).read_bytes())
    assert not any(r[0] == "p1-w1" for rows in saved.get("carried_of", {}).values() for r in rows)
    for _, s in procs:
        stop(s)
    # The names as the workers' own, a long name cut to fit too.
    for base in ("p1", "x" * 70):
        assert layout_siblings(worker_name(base, 0, 12), 0, 12) == [
            worker_name(base, i, 12) for i in range(1, 12)
        ]
    assert layout_siblings("p1-w1", 1, 4) == layout_siblings("p1", None, 1) == []


def test_a_proxy_named_as_a_worker_is_of_its_own_workers_names() -> None:
    """A proxy named `edge-w2` (a name of its own, not a worker's) whose
    --workers changes is `edge-w2-w0`...: its replica took none of the
    single one's rows from worker 0 (their names cut to `edge` and
    `edge-w2`), nor the workers' from the single one, and that last
    interval was lost."""
    hub = QuotaHub(MemoryStore(), "cp-a", constant_lease(0), interval=0.001)
    carrying = pb.ScopeDemand(scope=SCOPE)
    carrying.closed.add(epoch=7.0, day=DAY, day_tokens=50, month_tokens=50, proxy="edge-w2")
    carrying.closed.add(epoch=8.0, day=DAY, day_tokens=60, month_tokens=60, proxy="edge-w2-w5")
    carrying.closed.add(epoch=9.0, day=DAY, day_tokens=70, month_tokens=70, proxy="edge-w3-w0")
    hub.report("edge-w2-w0", [carrying])
    single = pb.ScopeDemand(scope=SCOPE)
    single.closed.add(epoch=6.0, day=DAY, day_tokens=40, month_tokens=40, proxy="edge-w2-w1")
    single.closed.add(epoch=5.0, day=DAY, day_tokens=30, month_tokens=30, proxy="edge-w3-w1")
    hub.report("edge-w2", [single])
    rows = {p: _demand_of(by[SCOPE]) for p, by in hub._report_body()["proxies"].items()}
    assert set(rows) == {"edge-w2", "edge-w2-w0", "edge-w2-w5", "edge-w2-w1"}
    assert rows["edge-w2"].closed == (spent(7.0, 50, 50),)
    assert rows["edge-w2-w1"].closed == (spent(6.0, 40, 40),)
