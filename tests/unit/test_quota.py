"""controlplane.quota: shares from demand, safe transitions, and a fleet simulation.

The simulation runs three real RateLimiters and the real compute_shares on
simulated time: Poisson clients per proxy, a leader rebalancing every second,
shares reaching each proxy after its own propagation delay. It compares what
the fleet admits with what one RateLimiter holding the whole limit admits
from the same arrivals (docs/rate-limits.md, "Accuracy").
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.quota import changed_shares, compute_shares
from dataplane.ratelimit import Admission, RateLimiter
from ponto.quota_types import Demand, ScopeLimits, Share

S = "t/acme"
P3 = ["p0", "p1", "p2"]


def fractions(shares: dict[str, dict[str, Share]], scope: str = S) -> list[float]:
    return [shares[p][scope].fraction for p in sorted(shares)]


def slots(shares: dict[str, dict[str, Share]], scope: str = S) -> list[int]:
    return [shares[p][scope].concurrency for p in sorted(shares)]


def rps(value: float, in_flight: int = 0, peak: int = 0) -> Demand:
    return Demand(requests_per_s=value, concurrency_peak=peak, in_flight=in_flight)


def settle(
    limits: dict[str, ScopeLimits],
    proxies: list[str],
    demand: dict[str, dict[str, Demand]],
    previous: dict[str, dict[str, Share]] | None = None,
    rounds: int = 5,
) -> dict[str, dict[str, Share]]:
    """Rebalance `rounds` times with the same demand, as the leader would."""
    shares = previous or {}
    for _ in range(rounds):
        shares = compute_shares(limits, proxies, demand, shares)
    return shares


# ---------------------------------------------------------------- allocation


def test_idle_scope_is_split_evenly_and_unlimited_scopes_get_nothing() -> None:
    limits = {S: ScopeLimits(rpm=600, concurrency=9), "t/free": ScopeLimits()}
    shares = compute_shares(limits, P3, {}, {})
    assert fractions(shares) == pytest.approx([1 / 3] * 3)
    assert sum(fractions(shares)) <= 1
    assert slots(shares) == [3, 3, 3]
    assert all("t/free" not in row for row in shares.values())
    assert compute_shares(limits, [], {}, {}) == {}


def test_fractions_follow_demand_with_a_floor_for_idle_proxies() -> None:
    limits = {S: ScopeLimits(rpm=600)}  # 10 requests per second
    demand = {"p0": {S: rps(12.0)}, "p1": {S: rps(3.0)}}
    f = fractions(settle(limits, P3, demand))
    # Over-subscribed (15 of 10 per second): floors of 0.02, the rest 4:1.
    assert f == pytest.approx([0.02 + 0.94 * 0.8, 0.02 + 0.94 * 0.2, 0.02], abs=1e-6)
    assert sum(f) <= 1


def test_spare_capacity_is_split_evenly_on_top_of_demand() -> None:
    limits = {S: ScopeLimits(rpm=600)}
    demand = {"p0": {S: rps(4.0)}}  # 0.4 of the limit; 0.6 to spare
    f = fractions(settle(limits, P3, demand))
    assert f == pytest.approx([0.02 + 0.94 * 0.6, 0.02 + 0.94 * 0.2, 0.02 + 0.94 * 0.2], abs=1e-6)


def test_tokens_count_when_they_bind_harder_than_requests() -> None:
    limits = {S: ScopeLimits(rpm=600, tpm=60_000)}
    demand = {
        "p0": {S: Demand(requests_per_s=9.0, tokens_per_s=100.0)},  # 0.9 requests, 0.1 tokens
        "p1": {S: Demand(requests_per_s=1.0, tokens_per_s=2700.0)},  # 0.1, 2.7
    }
    f = fractions(settle(limits, ["p0", "p1"], demand))
    assert f[0] == pytest.approx(0.02 + 0.96 * 0.9 / 3.6, abs=1e-6)


def test_a_fleet_that_owes_tokens_gives_its_share_to_the_proxies_that_owe() -> None:
    """Trial 30: long answers admitted at one proxy left it owing 6 minutes
    of a 600 TPM limit, while the others kept admitting at their shares. One
    bucket would admit nothing until repaid: the share beyond the floors
    goes to the proxies that owe, by what they owe."""
    limits = {S: ScopeLimits(tpm=600)}
    busy = Demand(requests_per_s=0.5, tokens_per_s=10.0)  # the whole limit, each
    demand = {
        "p0": {S: Demand(debt_tokens=3000.0)},
        "p1": {S: Demand(requests_per_s=0.5, tokens_per_s=10.0, debt_tokens=1000.0)},
        "p2": {S: busy},
    }
    shares = settle(limits, P3, demand)
    f = fractions(shares)
    floor = 0.02
    assert f[2] == pytest.approx(floor, abs=1e-6)
    # Every proxy is told how long the whole limit takes to repay the 4,000
    # owed (400 s), so a refusal where the share is not says as much (trial 32).
    assert {shares[p][S].fleet_debt_s for p in P3} == {400.0}
    assert f[0] == pytest.approx(floor + 0.94 * 0.75, abs=1e-6)
    assert f[1] == pytest.approx(floor + 0.94 * 0.25, abs=1e-6)
    # Repaid: demand moves the share again.
    demand = {p: {S: busy} for p in P3}
    assert fractions(settle(limits, P3, demand, settle(limits, P3, demand))) == pytest.approx(
        [1 / 3] * 3, abs=1e-6
    )


def test_a_debt_repaid_while_demand_stops_is_no_longer_told() -> None:
    """Review 48: debts owed about equally leave the fractions even, so once
    demand stopped the shares looked idle and kept their fleet_debt_s: the
    first refusal afterwards said to wait for a debt long repaid."""
    limits = {S: ScopeLimits(tpm=1000)}
    proxies = ["p0", "p1"]
    idle = settle(limits, proxies, {})
    owing = {"p0": {S: Demand(debt_tokens=52.0)}, "p1": {S: Demand(debt_tokens=48.0)}}
    shares = compute_shares(limits, proxies, owing, idle)
    assert {s[S].fleet_debt_s for s in shares.values()} == {10.0}
    shares = settle(limits, proxies, {}, shares, rounds=2)
    assert {s[S].fleet_debt_s for s in shares.values()} == {0.0}


@pytest.mark.parametrize("debt", [1e6, 1e300, 1e307])
def test_a_debt_past_reason_is_bounded(debt: float) -> None:
    """Review 48: a usage an origin got wrong told every client to wait days
    (1e6 tokens on 1000 TPM), or stopped the leader's rounds (OverflowError)."""
    limits = {S: ScopeLimits(tpm=1000)}
    demand = {"p0": {S: Demand(debt_tokens=debt)}, "p1": {S: Demand(debt_tokens=10.0)}}
    shares = settle(limits, ["p0", "p1"], demand)
    assert {s[S].fleet_debt_s for s in shares.values()} == {3600.0}
    assert sum(fractions(shares)) <= 1


@pytest.mark.parametrize("others", [2, 10])
def test_a_proxy_that_joins_a_busy_fleet_has_a_share_the_round_after(others: int) -> None:
    """Review 50: in a fleet demanding its whole limit, a newcomer's floor
    moved the others' targets by less than the hysteresis, so they were not
    cut, and it was granted nothing, round after round; its shares held back
    until it had one (QuotaHub._held), it never took traffic to show demand."""
    limits = {S: ScopeLimits(rpm=600, concurrency=10)}
    old = [f"p{i}" for i in range(others)]
    busy = {p: {S: Demand(requests_per_s=20.0)} for p in old}
    shares = settle(limits, old, busy)
    joined = compute_shares(limits, [*old, "new"], busy, shares)
    assert joined["new"][S].fraction == 0.0  # it waits for the others' cuts
    joined = compute_shares(limits, [*old, "new"], busy, joined)
    assert joined["new"][S].fraction > 0.0
    assert math.fsum(s[S].fraction for s in joined.values()) <= 1.0


def test_a_small_debt_is_repaid_where_it_is() -> None:
    """Under 10 % of the limit (a saturated tenant's answers settled past
    empty buckets): no share moves for it."""
    limits = {S: ScopeLimits(tpm=6000)}
    busy = Demand(requests_per_s=1.0, tokens_per_s=100.0)
    demand = {"p0": {S: Demand(1.0, 100.0, debt_tokens=599.0)}, "p1": {S: busy}}
    shares = settle(limits, ["p0", "p1"], demand)
    assert fractions(shares) == pytest.approx([0.5, 0.5], abs=1e-6)
    assert {s[S].fleet_debt_s for s in shares.values()} == {0.0}


def test_a_tiny_floor_per_proxy_in_a_large_fleet() -> None:
    proxies = [f"p{i:02d}" for i in range(50)]
    shares = compute_shares({S: ScopeLimits(rpm=600)}, proxies, {"p00": {S: rps(100.0)}}, {})
    f = fractions(shares)
    assert f[1] == pytest.approx(0.1 / 50, abs=1e-9)  # all floors together take 10 %
    assert sum(f) <= 1


def test_small_changes_are_not_published() -> None:
    limits = {S: ScopeLimits(rpm=600, concurrency=10)}
    before = settle(limits, P3, {p: {S: rps(5.0, peak=4)} for p in P3})
    demand = {"p0": {S: rps(5.2, peak=4)}, "p1": {S: rps(4.9, peak=5)}, "p2": {S: rps(5.1, peak=4)}}
    after = compute_shares(limits, P3, demand, before)
    assert all(after[p][S] is before[p][S] for p in P3)
    assert changed_shares(before, after) == {}


def test_increases_wait_for_the_decreases_they_come_from() -> None:
    limits = {S: ScopeLimits(rpm=600)}
    even = settle(limits, P3, {})
    demand = {"p0": {S: rps(30.0)}}
    first = compute_shares(limits, P3, demand, even)
    # The idle proxies shrink at once; p0 cannot grow yet: nothing was free.
    assert fractions(first)[1] == pytest.approx(0.02, abs=1e-6)
    assert fractions(first)[0] == fractions(even)[0]
    assert sum(max(a, b) for a, b in zip(fractions(even), fractions(first), strict=True)) <= 1
    second = compute_shares(limits, P3, demand, first)
    assert fractions(second)[0] == pytest.approx(0.96, abs=1e-6)
    assert changed_shares(first, second) == {"p0": {S: second["p0"][S]}}


def test_overcommit_lets_small_increases_through_in_the_same_round() -> None:
    limits = {S: ScopeLimits(rpm=600)}
    even = settle(limits, P3, {})
    demand = {"p0": {S: rps(30.0)}}
    first = compute_shares(limits, P3, demand, even, overcommit=0.05)
    assert fractions(first)[0] == pytest.approx(fractions(even)[0] + 0.05, abs=1e-6)
    mix = [max(a, b) for a, b in zip(fractions(even), fractions(first), strict=True)]
    assert 1 < sum(mix) <= 1.05
    assert sum(fractions(first)) <= 1


def test_a_departed_proxys_share_is_given_again_at_once() -> None:
    limits = {S: ScopeLimits(rpm=600, concurrency=9)}
    three = settle(limits, P3, {})
    two = compute_shares(limits, ["p0", "p1"], {}, three)
    assert fractions(two) == pytest.approx([0.5, 0.5])
    assert slots(two) == [5, 4] or slots(two) == [4, 5]
    assert sum(slots(two)) == 9


def test_a_new_proxy_gets_its_share_once_others_have_shrunk() -> None:
    limits = {S: ScopeLimits(rpm=600)}
    two = settle(limits, ["p0", "p1"], {})
    first = compute_shares(limits, P3, {}, two)
    assert fractions(first) == pytest.approx([1 / 3, 1 / 3, 0.0])
    second = compute_shares(limits, P3, {}, first)
    assert fractions(second) == pytest.approx([1 / 3] * 3)


def test_slots_by_largest_remainder_summing_to_the_limit() -> None:
    limits = {S: ScopeLimits(concurrency=10)}
    demand = {"p0": {S: rps(1.0, peak=9)}, "p1": {S: rps(1.0, peak=6)}, "p2": {S: rps(1.0, peak=5)}}
    assert slots(settle(limits, P3, demand)) == [5, 3, 2]  # 4.5, 3, 2.5: ties to the name


def test_an_idle_proxy_gets_no_slot_when_the_limit_is_below_the_fleet_size() -> None:
    limits = {S: ScopeLimits(concurrency=2)}
    demand = {"p1": {S: rps(1.0, peak=3)}, "p2": {S: rps(1.0, peak=1)}}
    # Quotas 0, 1.5, 0.5: the tie between p1 and p2 goes to the name.
    assert slots(settle(limits, P3, demand)) == [0, 2, 0]
    assert slots(settle(limits, P3, {})) == [1, 1, 0]


def test_a_valid_rounding_is_kept_to_avoid_churn() -> None:
    limits = {S: ScopeLimits(concurrency=4)}
    before = settle(limits, P3, {p: {S: rps(1.0, peak=1)} for p in P3})
    assert slots(before) == [2, 1, 1]
    # Quotas now 1.2, 1.6, 1.2: [1, 2, 1] from scratch, but [2, 1, 1] still rounds them.
    demand = {"p0": {S: rps(1.0, peak=3)}, "p1": {S: rps(1.0, peak=4)}, "p2": {S: rps(1.0, peak=3)}}
    assert slots(compute_shares(limits, P3, demand, {})) == [1, 2, 1]
    kept = compute_shares(limits, P3, demand, before)
    assert (fractions(kept), slots(kept)) == (fractions(before), slots(before))


def test_saturated_proxies_keep_their_shares_through_noise() -> None:
    limits = {S: ScopeLimits(rpm=600, concurrency=12)}
    before = settle(limits, P3, {p: {S: rps(5.0, peak=8)} for p in P3})
    # Every proxy wants more than its third: a 20 % swing moves only refusals.
    noisy = {"p0": {S: rps(6.0, peak=9)}, "p1": {S: rps(4.2, peak=6)}, "p2": {S: rps(5.0, peak=8)}}
    assert compute_shares(limits, P3, noisy, before) == before
    # A proxy far below its target (a new client at an idle proxy) moves them.
    starving = {**noisy, "p2": {S: rps(20.0, peak=30)}}
    after = compute_shares(limits, P3, starving, before)
    assert fractions(after)[0] < fractions(before)[0]
    assert slots(after)[0] < slots(before)[0]


def spares(shares: dict[str, dict[str, Share]], scope: str = S) -> list[bool]:
    return [shares[p][scope].spare for p in sorted(shares)]


def test_every_proxy_is_told_whether_the_fleet_has_spare_slots() -> None:
    limits = {S: ScopeLimits(concurrency=4), "t/rates": ScopeLimits(rpm=60)}
    idle = settle(limits, P3, {})
    assert spares(idle) == [True] * 3
    # Rates only: no slots to wait for.
    assert spares(idle, "t/rates") == [False] * 3
    # Peaks of 3 of 4: one is spare somewhere, whichever proxy holds it.
    busy = {"p0": {S: rps(1.0, in_flight=2, peak=2)}, "p1": {S: rps(1.0, in_flight=1, peak=1)}}
    assert spares(compute_shares(limits, P3, busy, idle)) == [True] * 3
    # Peaks of 4: a proxy whose slots are busy refuses, as one global limit would.
    full = {**busy, "p2": {S: rps(1.0, in_flight=1, peak=1)}}
    after = compute_shares(limits, P3, full, idle)
    assert spares(after) == [False] * 3
    # And back: the flag alone changes the share (so it is pushed).
    again = compute_shares(limits, P3, {}, after)
    assert spares(again) == [True] * 3
    assert slots(again) == slots(after)


def test_no_spare_while_the_peaks_fill_the_limit_between_reports() -> None:
    # Limit 2 over 3: p0 and p1 run short requests (peak 1 each, p0 with none in
    # flight at the report), p2 has no slot and a request waiting. Requests in
    # flight say 2 of 2 are free; the peaks say the limit is used, and the
    # allocation [1, 1, 0] stands: a wait at p2 could never get a slot.
    limits = {S: ScopeLimits(concurrency=2)}
    before = {p: {S: Share(0.1, c, spare=True)} for p, c in zip(P3, (1, 1, 0), strict=True)}
    churn = {
        "p0": {S: rps(5.0, in_flight=0, peak=1)},
        "p1": {S: rps(5.0, in_flight=1, peak=1)},
        "p2": {S: rps(1.0, in_flight=0, peak=1)},
    }
    after = settle(limits, P3, churn, before, rounds=3)
    assert slots(after) == [1, 1, 0]
    assert spares(after) == [False] * 3


def test_with_spare_a_proxy_short_of_slots_gets_more_within_two_rounds() -> None:
    # Limit 20 over 14, one proxy with 1 slot busy and 1 request waiting (peak 2).
    names = [f"p{i:02d}" for i in range(14)]
    limits = {S: ScopeLimits(concurrency=20)}
    shares = settle(limits, names, {})
    short = min(names, key=lambda p: (shares[p][S].concurrency, p))
    held = shares[short][S].concurrency
    demand = {short: {S: rps(1.0, in_flight=held, peak=held + 1)}}
    first = compute_shares(limits, names, demand, shares)
    assert first[short][S].spare
    second = compute_shares(limits, names, demand, first)
    assert second[short][S].concurrency > held
    assert sum(s[S].concurrency for s in second.values()) <= 20


@pytest.mark.parametrize(("limit", "in_flight", "waiting"), [(1, 0, 1), (2, 1, 1), (10, 5, 5)])
def test_waiters_that_fill_the_limit_may_wait_until_their_slots_come(
    limit: int, in_flight: int, waiting: int
) -> None:
    # Proxy b holds `in_flight` slots, all busy, and `waiting` requests wait:
    # its peak reaches the limit exactly, and a holds the idle rest.
    limits = {S: ScopeLimits(concurrency=limit)}
    shares = {"a": {S: Share(0.5, limit - in_flight, True)}, "b": {S: Share(0.5, in_flight, True)}}
    demand = {"b": {S: rps(1.0, in_flight=in_flight, peak=in_flight + waiting)}}
    first = compute_shares(limits, ["a", "b"], demand, shares)
    # No slot is idle by the peaks, but b is owed a's: b waits, a would not.
    assert spares(first) == [False, True]
    second = compute_shares(limits, ["a", "b"], demand, first)
    assert slots(second) == [0, limit]
    assert spares(second) == [False, False]  # b holds what it is owed


def test_a_burst_over_the_limit_at_one_proxy_gets_the_whole_limit_there() -> None:
    # Limit 3, one slot each; 5 requests at p0: 1 runs, 3 wait (the cap), 1 is
    # refused. p0 is owed all 3 slots: its waiters may wait for two of them.
    limits = {S: ScopeLimits(concurrency=3)}
    shares = settle(limits, P3, {})
    assert slots(shares) == [1, 1, 1]
    demand = {"p0": {S: rps(5.0, in_flight=1, peak=5)}}
    first = compute_shares(limits, P3, demand, shares)
    assert spares(first) == [True, False, False]
    second = compute_shares(limits, P3, demand, first)
    assert slots(second) == [3, 0, 0]
    assert spares(second) == [False] * 3  # the rest of the burst is over the limit


def test_a_tenant_hovering_at_its_limit_does_not_flip_the_flag() -> None:
    limits = {S: ScopeLimits(concurrency=20)}
    names = [f"p{i}" for i in range(4)]
    shares = settle(limits, names, {})
    flips = 0
    for peak in [5, 5, 5, 5, 4, 5, 4, 5, 5, 4, 4, 5] * 3:  # 20 or 19 in all
        demand = {p: {S: rps(1.0, in_flight=min(peak, 5), peak=peak if p == "p0" else 5)}
                  for p in names}  # fmt: skip
        new = compute_shares(limits, names, demand, shares)
        flips += spares(new)[0] != spares(shares)[0]
        shares = new
    assert flips == 1  # off once the limit was reached, and off it stays
    # Well below the limit (peaks 16 <= 20 - 2) it turns on again.
    low = {p: {S: rps(1.0, in_flight=4, peak=4)} for p in names}
    assert spares(compute_shares(limits, names, low, shares)) == [True] * 4


def test_slots_still_held_in_flight_are_not_given_to_others() -> None:
    limits = {S: ScopeLimits(concurrency=6)}
    # p0 was cut from 3 slots to 0 but still has 3 requests in flight.
    cut = {"p0": {S: Share(0.5, 0)}, "p1": {S: Share(0.5, 3)}}
    demand = {"p0": {S: rps(0.0, in_flight=3, peak=3)}, "p1": {S: rps(9.0, in_flight=3, peak=30)}}
    after = compute_shares(limits, ["p0", "p1"], demand, cut)
    # p0's requests still hold 3 of the 6, so p1 cannot grow. p0's own slot
    # (its quota 6 * 3/33 rounds up) costs nothing: it sits under those 3.
    assert slots(after) == [1, 3]
    demand["p0"] = {S: rps(0.0)}  # they have ended
    later = compute_shares(limits, ["p0", "p1"], demand, after)
    assert slots(later) == [0, 5]  # p0's last slot is freed only by this round
    assert slots(compute_shares(limits, ["p0", "p1"], demand, later)) == [0, 6]


# ---------------------------------------------------------------- properties

proxy_names = st.lists(st.sampled_from([f"p{i}" for i in range(7)]), min_size=1, unique=True)
demands = st.builds(
    Demand,
    requests_per_s=st.floats(0, 1e4),
    tokens_per_s=st.floats(0, 1e7),
    concurrency_peak=st.integers(0, 50),
    in_flight=st.integers(0, 20),
)
scope_limits = st.builds(
    ScopeLimits,
    rpm=st.integers(0, 10_000),
    tpm=st.integers(0, 10**7),
    concurrency=st.integers(0, 40),
)


Round = tuple[
    dict[str, ScopeLimits], list[str], dict[str, dict[str, Demand]], dict[str, dict[str, Share]]
]


@st.composite
def rounds(draw: st.DrawFn) -> Round:
    scopes = draw(st.lists(st.sampled_from(["t/a", "t/b", "k/1"]), min_size=1, unique=True))
    limits = {s: draw(scope_limits) for s in scopes}
    proxies = draw(proxy_names)
    demand = {
        p: {s: draw(demands) for s in scopes if draw(st.booleans())}
        for p in proxies
        if draw(st.booleans())
    }
    # A previous round the leader computed, possibly for another set of proxies.
    old_proxies = draw(proxy_names)
    old_demand = {p: {s: draw(demands) for s in scopes} for p in old_proxies}
    previous = compute_shares(limits, old_proxies, old_demand, {})
    return limits, proxies, demand, previous


def held(share: Share | None, demand: Demand | None) -> int:
    return max(share.concurrency if share else 0, demand.in_flight if demand else 0)


@settings(max_examples=400, deadline=None)
@given(rounds(), st.sampled_from([0.0, 0.05]))
def test_shares_never_exceed_the_limit_in_any_mix_of_old_and_new(
    case: Round, overcommit: float
) -> None:
    limits, proxies, demand, previous = case
    new = compute_shares(limits, proxies, demand, previous, overcommit=overcommit)
    assert set(new) == set(proxies)
    for scope, lim in limits.items():
        if lim.unlimited:
            assert all(scope not in new[p] for p in proxies)
            continue
        shares = [new[p][scope] for p in proxies]
        olds = [previous.get(p, {}).get(scope) for p in proxies]
        ds = [demand.get(p, {}).get(scope) for p in proxies]
        assert sum(s.fraction for s in shares) <= 1
        mix = [max(s.fraction, o.fraction if o else 0.0) for s, o in zip(shares, olds, strict=True)]
        assert sum(mix) <= 1 + overcommit
        if lim.concurrency:
            assert sum(s.concurrency for s in shares) <= lim.concurrency
            holding = [held(o, d) for o, d in zip(olds, ds, strict=True)]
            if sum(holding) <= lim.concurrency:
                mixed = sum(max(s.concurrency, h) for s, h in zip(shares, holding, strict=True))
                assert mixed <= lim.concurrency


@settings(max_examples=200, deadline=None)
@given(
    limits=scope_limits,
    proxies=proxy_names,
    junk=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 100)), min_size=7, max_size=7),
)
def test_even_an_inconsistent_previous_yields_valid_shares(
    limits: ScopeLimits, proxies: list[str], junk: list[tuple[float, int]]
) -> None:
    previous = {p: {S: Share(f, c)} for p, (f, c) in zip(proxies, junk, strict=False)}
    new = compute_shares({S: limits}, proxies, {}, previous)
    if not limits.unlimited:
        assert sum(new[p][S].fraction for p in proxies) <= 1
        assert sum(new[p][S].concurrency for p in proxies) <= limits.concurrency


# ---------------------------------------------------------------- simulation


@dataclass
class Scenario:
    limits: ScopeLimits
    rates: Callable[[int], Sequence[float]]  # arrivals/s per proxy during second t
    delays: Sequence[float] = (0.05, 0.3, 0.8)  # leader -> proxy, each way
    acked: bool = False  # previous = max(acknowledged, pushed since) instead of last pushed
    est_tokens: int = 0
    actual: tuple[int, int] = (0, 0)  # uniform range of a request's real total tokens
    hold_s: tuple[float, float] = (0.2, 0.2)  # uniform range of a request's duration
    warmup_s: int = 60  # idle at first, so that every bucket can fill
    run_s: int = 600
    seed: int = 7
    # (time, proxy, actual tokens, duration) of every request, in time order,
    # instead of `rates`' random arrivals.
    arrive: Callable[[Scenario], list[tuple[float, int, int, float]]] | None = None


@dataclass
class Outcome:
    fleet: int = 0
    single: int = 0
    fleet_tokens: int = 0
    single_tokens: int = 0
    max_in_flight: int = 0
    in_flight_area: float = 0.0  # integral of the fleet's in-flight count over time
    single_area: float = 0.0  # the same for the single limiter
    per_proxy: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def ratio(self) -> float:
        return self.fleet / self.single

    @property
    def token_ratio(self) -> float:
        return self.fleet_tokens / self.single_tokens


def arrivals(sc: Scenario, rng: random.Random) -> list[tuple[float, int, int, float]]:
    """(time, proxy, actual tokens, duration) for every request, in time order."""
    out = []
    end = sc.warmup_s + sc.run_s
    for proxy in range(3):
        t = float(sc.warmup_s)
        while t < end:
            rate = sc.rates(int(t))[proxy]
            boundary = math.floor(t) + 1.0
            gap = rng.expovariate(rate) if rate > 0 else math.inf
            if t + gap >= boundary:  # memoryless: start again at the next second
                t = boundary
                continue
            t += gap
            out.append((t, proxy, rng.randint(*sc.actual), rng.uniform(*sc.hold_s)))
    out.sort()
    return out


def simulate(sc: Scenario) -> Outcome:
    rng = random.Random(sc.seed)
    limits = {S: sc.limits}
    fleet = [RateLimiter() for _ in P3]
    for rl in fleet:
        rl.configure(limits, 0.0)
    single = RateLimiter()
    single.configure(limits, 0.0)
    single.apply_shares({S: Share(1.0, sc.limits.concurrency)}, 0.0)

    seq = itertools.count()
    events: list[tuple[float, int, str, object]] = []

    def at(t: float, kind: str, payload: object) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    for item in sc.arrive(sc) if sc.arrive is not None else arrivals(sc, rng):
        at(item[0], "arrive", item)
    end = sc.warmup_s + sc.run_s
    for k in range(1, end + 1):
        at(float(k), "round", None)

    published: dict[str, dict[str, Share]] = {}
    acked: dict[str, Share] = {}
    pending: dict[str, list[tuple[int, Share]]] = {p: [] for p in P3}
    out = Outcome()
    in_flight = single_in_flight = 0
    last_t = 0.0

    def bound(p: str) -> dict[str, Share]:
        shares = [s for _, s in pending[p]] + ([acked[p]] if p in acked else [])
        if not shares:
            return {}
        return {S: Share(max(s.fraction for s in shares), max(s.concurrency for s in shares))}

    while events:
        t, n, kind, payload = heapq.heappop(events)
        out.in_flight_area += in_flight * (t - last_t)
        out.single_area += single_in_flight * (t - last_t)
        last_t = t
        if kind == "arrive":
            assert isinstance(payload, tuple)
            _, proxy, actual, hold = payload
            est = sc.est_tokens
            adm = fleet[proxy].admit([S], est, t)
            if adm.ok:
                out.fleet += 1
                out.fleet_tokens += actual
                out.per_proxy[proxy] += 1
                in_flight += 1
                out.max_in_flight = max(out.max_in_flight, in_flight)
                at(t + hold, "release", (adm, actual, True))
            ref = single.admit([S], est, t)
            if ref.ok:
                out.single += 1
                out.single_tokens += actual
                single_in_flight += 1
                at(t + hold, "release", (ref, actual, False))
        elif kind == "release":
            assert isinstance(payload, tuple)
            adm, actual, in_fleet = payload
            assert isinstance(adm, Admission)
            adm.release(actual if sc.actual != (0, 0) else None, t)
            if in_fleet:
                in_flight -= 1
            else:
                single_in_flight -= 1
        elif kind == "round":
            demand = {p: rl.demand(t) for p, rl in zip(P3, fleet, strict=True)}
            previous = {p: bound(p) for p in P3} if sc.acked else published
            published = compute_shares(limits, P3, demand, previous)
            for i, p in enumerate(P3):
                share = published[p][S]
                pending[p].append((n, share))
                at(t + sc.delays[i], "deliver", (i, n, share))
        elif kind == "deliver":
            assert isinstance(payload, tuple)
            i, push, share = payload
            fleet[i].apply_shares({S: share}, t)
            at(t + sc.delays[i], "ack", (i, push, share))
        elif kind == "ack":
            assert isinstance(payload, tuple)
            i, push, share = payload
            p = P3[i]
            acked[p] = share
            pending[p] = [(m, s) for m, s in pending[p] if m > push]
    return out


def even(t: int) -> Sequence[float]:
    return (5.0, 5.0, 5.0)


def uneven(t: int) -> Sequence[float]:
    return (11.0, 3.0, 1.0)


def moving(t: int) -> Sequence[float]:
    """A hot spot that moves to the next proxy every minute."""
    hot = (t // 60) % 3
    return tuple(12.0 if i == hot else 1.5 for i in range(3))


def flapping(t: int) -> Sequence[float]:
    """All demand jumps between two proxies every 3 s: the worst case for transitions."""
    return (15.0, 0.0, 0.0) if (t // 3) % 2 else (0.0, 15.0, 0.0)


RPM = ScopeLimits(rpm=600)  # 10 per second; demand is 15 per second


@pytest.mark.parametrize("acked", [False, True], ids=["last-pushed", "acked"])
@pytest.mark.parametrize("rates", [even, uneven, moving, flapping])
def test_fleet_admits_about_what_one_bucket_would(
    rates: Callable[[int], Sequence[float]], acked: bool
) -> None:
    out = simulate(Scenario(RPM, rates, acked=acked))
    assert out.ratio <= 1.05, out
    assert out.ratio >= (0.9 if rates in (even, uneven) else 0.8), out


def round_robin(
    gap_s: float, tokens: int, stay_s: float = 0.0
) -> Callable[[Scenario], list[tuple[float, int, int, float]]]:
    """One request every `gap_s`, to each proxy in turn (a load balancer's),
    or with `stay_s`, to one proxy for that long, then the next."""

    def arrive(sc: Scenario) -> list[tuple[float, int, int, float]]:
        times = itertools.takewhile(
            lambda t: t < sc.warmup_s + sc.run_s, itertools.count(float(sc.warmup_s), gap_s)
        )
        return [
            (t, int((t - sc.warmup_s) // stay_s) % 3 if stay_s else i % 3, tokens, 0.2)
            for i, t in enumerate(times)
        ]

    return arrive


@pytest.mark.parametrize(
    ("gap_s", "least"),
    [(10.0, 0.99), (5.0, 0.9), (3.0, 0.9)],  # 2,400 TPM asked; 4,800; 8,000
)
def test_large_requests_spread_over_the_proxies_are_served_as_one_bucket_would(
    gap_s: float, least: float
) -> None:
    """Trial 47: a client whose 400-token requests a load balancer spread
    over the proxies, under its 3000 TPM, got 1 in 9 through. Each request
    read as minutes of the limit to its proxy's 5 s demand average, pulled
    the others' shares to it and clamped their buckets, and the next request
    went to one of them. Before the fix: 0.02, 0.56, 0.79 of one bucket."""
    sc = Scenario(ScopeLimits(tpm=3000), even, est_tokens=400, actual=(400, 400),
                  arrive=round_robin(gap_s, 400))  # fmt: skip
    out = simulate(sc)
    assert least <= out.ratio <= 1.05, out


@pytest.mark.parametrize(
    ("limits", "gap_s", "tokens", "least"),
    [(ScopeLimits(rpm=30), 2.0, 0, 0.7), (ScopeLimits(tpm=3000), 10.0, 400, 0.6)],
)
def test_a_client_that_moves_between_proxies_is_served_near_one_bucket(
    limits: ScopeLimits, gap_s: float, tokens: int, least: float
) -> None:
    """Review of trial 47's fix: demand averaged over up to a minute lingered
    at the proxy a sparse client had left, and built slowly at the next (at
    30 RPM, moving each minute, 0.62 of one bucket; 0.81 with the 5 s average
    before the fix, 0.75 now; 400 tokens every 10 s: 0.70 before, 0.67 now).
    A scope with no attempt for twice its gap fades at the short average."""
    sc = Scenario(limits, even, est_tokens=tokens, actual=(tokens, tokens),
                  arrive=round_robin(gap_s, tokens, stay_s=60.0))  # fmt: skip
    out = simulate(sc)
    assert least <= out.ratio <= 1.05, out


def test_even_demand_is_served_evenly() -> None:
    out = simulate(Scenario(RPM, even))
    assert out.ratio >= 0.97, out
    assert max(out.per_proxy) / min(out.per_proxy) < 1.05, out


def test_slow_propagation_still_within_five_percent() -> None:
    # Pushes take longer than a rebalance round: proxies lag behind the leader.
    out = simulate(Scenario(RPM, moving, delays=(0.3, 1.5, 2.5)))
    assert 0.8 <= out.ratio <= 1.05, out


@pytest.mark.parametrize("rates", [even, uneven])
def test_tokens_settled_after_the_call_are_limited_globally(
    rates: Callable[[int], Sequence[float]],
) -> None:
    sc = Scenario(
        ScopeLimits(tpm=60_000),  # 1000 tokens per second
        rates,
        est_tokens=200,
        actual=(100, 600),  # completions charged at release
        hold_s=(0.5, 3.0),
    )
    out = simulate(sc)
    assert 0.9 <= out.token_ratio <= 1.05, out


def long_answers_then_steady(t: int) -> Sequence[float]:
    """A burst at proxy 0 in the first 2 s (after the warm-up), then a steady
    trickle at the other two."""
    return (7.0, 0.0, 0.0) if t < 62 else (0.0, 1.0, 1.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_burst_of_long_answers_is_repaid_by_the_fleet_as_one_bucket_would(seed: int) -> None:
    """Trial 30: answers several times their estimates, admitted at one
    proxy, put it in debt; the other proxies kept admitting at their shares
    meanwhile, and over 5 minutes the fleet admitted 1.2x the tokens of one
    bucket. The share moves to the proxy that owes until it has repaid."""
    sc = Scenario(
        ScopeLimits(tpm=600),
        long_answers_then_steady,
        est_tokens=28,
        actual=(100, 300),
        hold_s=(3.0, 6.0),
        run_s=300,
        seed=seed,
    )
    out = simulate(sc)
    assert 0.75 <= out.token_ratio <= 1.05, out


@pytest.mark.parametrize("acked", [False, True], ids=["last-pushed", "acked"])
@pytest.mark.parametrize("rates", [even, uneven, moving])
def test_concurrency_never_exceeds_the_global_limit(
    rates: Callable[[int], Sequence[float]], acked: bool
) -> None:
    sc = Scenario(ScopeLimits(concurrency=12), rates, hold_s=(1.0, 3.0), acked=acked)
    out = simulate(sc)
    assert out.max_in_flight <= 12, out
    # Refused requests do not queue, so even one limiter leaves slots idle
    # between a release and the next arrival; compare with it.
    # Smaller pools idle more (Erlang loss): about 0.9 of the single one here.
    assert out.in_flight_area >= 0.85 * out.single_area, out


@pytest.mark.parametrize("rates", [even, moving])
def test_acknowledged_shares_hold_even_when_proxies_lag_rounds_behind(
    rates: Callable[[int], Sequence[float]],
) -> None:
    slow = (0.3, 1.5, 2.5)
    conc = simulate(Scenario(ScopeLimits(concurrency=12), rates, hold_s=(1.0, 3.0), delays=slow))
    assert conc.max_in_flight > 12  # bounding by the last push is not enough here...
    sc = Scenario(ScopeLimits(concurrency=12), rates, hold_s=(1.0, 3.0), delays=slow, acked=True)
    assert simulate(sc).max_in_flight <= 12  # ...bounding by acknowledgements is
