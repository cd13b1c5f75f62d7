"""dataplane.upstream.outlier: passive ejection of failing origins, and the retry budget."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dataplane.routes import Target
from dataplane.upstream.outlier import (
    EJECTED_SHOWN_S,
    FAILURE_CHARS,
    Ejected,
    OutlierDetector,
    RetryBudget,
)


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


EPS = 1 / 64  # exactly representable, so fake time adds up without rounding


def target(name: str) -> Target:
    return Target(name=name, region="us-east", base_url=f"http://{name}.example/v1", weight=100)


def names(targets: Sequence[Target]) -> list[str]:
    return [t.name for t in targets]


def fail_times(detector: OutlierDetector, origin: str, times: int) -> list[bool]:
    return [detector.failure(origin) for _ in range(times)]


# ---------------------------------------------------------------- ejection


def test_ejected_after_n_consecutive_failures_not_before() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=3, base=1.0, cap=30.0, clock=clock)
    assert fail_times(detector, "a", 2) == [False, False]
    assert not detector.ejected("a")
    assert detector.ejected_now() == 0
    assert detector.failure("a") is True
    assert detector.ejected("a")
    assert detector.ejected_now() == 1
    assert detector.ejections_total == 1
    assert not detector.ejected("b")  # never seen


def test_success_resets_the_failure_count() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=3, clock=clock)
    fail_times(detector, "a", 2)
    detector.success("a")
    assert fail_times(detector, "a", 2) == [False, False]
    assert not detector.ejected("a")
    # Only a third failure in a row ejects.
    assert detector.failure("a") is True
    assert detector.ejected("a")


def test_success_of_unknown_origin_is_harmless() -> None:
    detector = OutlierDetector(clock=FakeClock())
    detector.success("never-failed")
    assert detector.ejected_now() == 0
    assert not detector.ejected("never-failed")


def test_failures_are_counted_per_origin() -> None:
    detector = OutlierDetector(consecutive=2, clock=FakeClock())
    assert detector.failure("a") is False
    assert detector.failure("b") is False
    assert detector.failure("a") is True
    assert detector.ejected("a")
    assert not detector.ejected("b")


def test_single_failure_ejects_when_consecutive_is_one() -> None:
    detector = OutlierDetector(consecutive=1, clock=FakeClock())
    assert detector.failure("a") is True
    assert detector.ejected("a")


def test_ejection_duration_doubles_and_is_capped() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=2, base=1.0, cap=5.0, clock=clock)
    # k-th ejection lasts base * 2**(k-1), capped at 5: 1, 2, 4, 5, 5.
    for expected in (1.0, 2.0, 4.0, 5.0, 5.0):
        assert fail_times(detector, "a", 2) == [False, True]
        clock.advance(expected - EPS)
        assert detector.ejected("a"), expected
        clock.advance(EPS)
        assert not detector.ejected("a"), expected
    assert detector.ejections_total == 5


def test_ejection_duration_uses_base() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=0.25, cap=30.0, clock=clock)
    detector.failure("a")
    clock.advance(0.25 - EPS)
    assert detector.ejected("a")
    clock.advance(EPS)
    assert not detector.ejected("a")
    detector.failure("a")  # second ejection: 0.5 s
    clock.advance(0.5 - EPS)
    assert detector.ejected("a")
    clock.advance(EPS)
    assert not detector.ejected("a")


def test_failures_while_ejected_do_not_extend_the_ejection() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=2.0, cap=30.0, clock=clock)
    assert detector.failure("a") is True
    clock.advance(1.0)
    assert detector.failure("a") is False  # already ejected: no new ejection
    assert detector.ejections_total == 1
    clock.advance(1.0)
    assert not detector.ejected("a")  # ended at the original 2 s


def test_success_after_an_ejection_ends_lowers_the_multiplier() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, cap=30.0, clock=clock)
    detector.failure("a")  # 1 s
    clock.advance(1.0)
    detector.failure("a")  # 2 s
    clock.advance(2.0)
    detector.success("a")  # ejection over, healthy again: multiplier steps down
    detector.failure("a")  # so this ejection lasts 2 s, not 4 s
    clock.advance(2.0 - EPS)
    assert detector.ejected("a")
    clock.advance(EPS)
    assert not detector.ejected("a")


def test_success_during_an_ejection_keeps_the_multiplier() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, cap=30.0, clock=clock)
    detector.failure("a")  # 1 s
    clock.advance(0.5)
    detector.success("a")  # still ejected: multiplier unchanged
    assert detector.ejected("a")
    clock.advance(0.5)
    detector.failure("a")  # second ejection: 2 s
    clock.advance(2.0 - EPS)
    assert detector.ejected("a")


# ---------------------------------------------------------------- order


def test_order_moves_ejected_last_keeping_relative_order() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, clock=clock)
    candidates = [target(n) for n in ("a", "b", "c", "d", "e")]
    detector.failure("b")
    detector.failure("d")
    assert names(detector.order(candidates)) == ["a", "c", "e", "b", "d"]
    assert names(candidates) == ["a", "b", "c", "d", "e"]  # input untouched
    # Ejected in reverse order of the list: still listed in candidate order.
    detector.failure("a")
    assert names(detector.order(candidates)) == ["c", "e", "a", "b", "d"]


def test_order_without_state_or_ejections_is_unchanged() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=3, clock=clock)
    candidates = [target(n) for n in ("a", "b", "c")]
    assert names(detector.order(candidates)) == ["a", "b", "c"]
    detector.failure("a")  # one failure: not ejected
    assert names(detector.order(candidates)) == ["a", "b", "c"]


def test_order_returns_everything_when_all_are_ejected() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, clock=clock)
    candidates = [target(n) for n in ("a", "b", "c")]
    for name in ("c", "a", "b"):
        detector.failure(name)
    assert names(detector.order(candidates)) == ["a", "b", "c"]


def test_order_restores_an_origin_when_its_ejection_ends() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, clock=clock)
    candidates = [target(n) for n in ("a", "b")]
    detector.failure("a")
    assert names(detector.order(candidates)) == ["b", "a"]
    clock.advance(1.0)
    assert names(detector.order(candidates)) == ["a", "b"]


def test_order_of_empty_list() -> None:
    detector = OutlierDetector(consecutive=1, clock=FakeClock())
    detector.failure("a")
    assert detector.order([]) == []


def test_ejected_now_counts_current_ejections() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, cap=30.0, clock=clock)
    assert detector.ejected_now() == 0
    detector.failure("a")  # until +1
    clock.advance(0.5)
    detector.failure("b")  # until +1.5
    detector.failure("c")  # until +1.5
    assert detector.ejected_now() == 3
    clock.advance(0.5)
    assert detector.ejected_now() == 2
    clock.advance(1.0)
    assert detector.ejected_now() == 0
    assert detector.ejections_total == 3


# ---------------------------------------------------------------- retry budget


def test_initial_tokens_allow_cap_retries() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, floor_per_s=0.0, cap=3.0, clock=clock)
    assert [budget.try_retry() for _ in range(3)] == [True, True, True]
    assert budget.refused == 0


def test_exhausted_budget_refuses_and_counts() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, floor_per_s=0.0, cap=2.0, clock=clock)
    assert budget.try_retry()
    assert budget.try_retry()
    assert not budget.try_retry()
    assert not budget.try_retry()
    assert budget.refused == 2
    clock.advance(3600)  # no floor: time alone does not help
    assert not budget.try_retry()
    assert budget.refused == 3


def test_deposits_allow_about_one_retry_per_five_requests() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, floor_per_s=0.0, cap=10.0, clock=clock)
    while budget.try_retry():
        pass
    budget.refused = 0
    allowed = 0
    requests = 100
    for _ in range(requests):
        budget.deposit()
        if budget.try_retry():
            allowed += 1
    # 100 * 0.2 = 20 tokens; float accumulation may lose the last one.
    assert 19 <= allowed <= 20, allowed
    assert budget.refused == requests - allowed


def test_fewer_than_five_deposits_do_not_buy_a_retry() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, floor_per_s=0.0, cap=1.0, clock=clock)
    assert budget.try_retry()
    for _ in range(4):
        budget.deposit()
    assert not budget.try_retry()
    budget.deposit()
    budget.deposit()  # 6 * 0.2 >= 1, whatever the rounding
    assert budget.try_retry()


def test_deposits_are_capped() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.5, floor_per_s=0.0, cap=2.0, clock=clock)
    for _ in range(100):
        budget.deposit()
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]


def test_floor_refills_over_time() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.0, floor_per_s=8.0, cap=100.0, clock=clock)
    while budget.try_retry():
        pass
    refused = budget.refused
    assert refused == 1
    clock.advance(1 / 16)  # half a token
    assert not budget.try_retry()
    clock.advance(1 / 16)  # one token in all
    assert budget.try_retry()
    assert not budget.try_retry()
    clock.advance(5 / 8)  # five tokens
    assert sum(budget.try_retry() for _ in range(10)) == 5
    assert budget.refused == refused + 1 + 1 + 5


def test_floor_refill_is_capped() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.0, floor_per_s=10.0, cap=3.0, clock=clock)
    while budget.try_retry():
        pass
    clock.advance(3600)
    assert sum(budget.try_retry() for _ in range(10)) == 3


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5])
def test_retry_rate_tracks_ratio(ratio: float) -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=ratio, floor_per_s=0.0, cap=1.0, clock=clock)
    budget.try_retry()  # spend the initial token
    allowed = 0
    requests = 1000
    for _ in range(requests):
        budget.deposit()
        allowed += budget.try_retry()
    # "At most ratio": never above it. Float accumulation (ten deposits of 0.1
    # sum to 0.9999999999999999) may cost up to a tenth of the retries.
    assert requests * ratio * 0.9 <= allowed <= requests * ratio + 1, allowed


def test_a_busy_origin_goes_last_for_its_wait_without_being_ejected() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=3, base=1.0, cap=30.0, clock=clock)
    candidates = [target("a"), target("b"), target("c")]
    for _ in range(5):  # many 429s: still not a failure
        detector.busy("a", 10.0)
    assert names(detector.order(candidates)) == ["b", "c", "a"]
    assert not detector.ejected("a") and detector.ejected_now() == 0
    clock.advance(10.0 - EPS)
    assert names(detector.order(candidates)) == ["b", "c", "a"]
    clock.advance(EPS)
    assert names(detector.order(candidates)) == ["a", "b", "c"]
    # Busy leaves failures alone: two failures after it do not eject, a third does.
    assert fail_times(detector, "a", 3) == [False, False, True]


def test_a_busy_wait_is_capped() -> None:
    clock = FakeClock()
    detector = OutlierDetector(cap=30.0, clock=clock)
    detector.busy("a", 3600.0)
    clock.advance(30.0)
    assert names(detector.order([target("a"), target("b")])) == ["a", "b"]


def test_passed_over_is_what_order_moves_last() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, clock=clock)
    detector.failure("a")
    detector.busy("b", 2.0)
    ordered = detector.order([target(n) for n in ("a", "b", "c")])
    assert names(ordered) == ["c", "a", "b"]
    assert [detector.passed_over(n) for n in ("a", "b", "c")] == [True, True, False]
    clock.advance(2.0 + EPS)
    assert not any(detector.passed_over(n) for n in ("a", "b", "c"))


# ---------------------------------------------------------------- what is reported


def test_an_ejected_origin_is_reported_until_it_answers() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=3, base=1.0, cap=30.0, clock=clock)
    assert detector.ejected_report() == []
    fail_times(detector, "a", 2)
    assert detector.ejected_report() == []  # failing, not ejected
    detector.failure("a", "answered 500")
    clock.advance(0.5)
    assert detector.ejected_report() == [Ejected("a", 0.5, 1, "answered 500", 0.5, 0.5)]
    # Its ejection ends, it fails again: one streak, counted since its first.
    clock.advance(1.0)
    for why in ("answered 502", "", "timed out before the response started"):
        detector.failure("a", why)
    clock.advance(EPS)
    (e,) = detector.ejected_report()
    assert (e.for_s, e.ejections, e.last_failure) == (
        1.5 + EPS,
        2,
        "timed out before the response started",
    )
    assert (e.ejected_s, e.failed_s) == (2.0 - EPS, EPS)
    # Tried again after its ejection: still reported, as not ejected now.
    clock.advance(2.0)
    (e,) = detector.ejected_report()
    assert e.ejected_s == 0.0 and e.ejections == 2
    # An answer ends the streak.
    detector.success("a")
    assert detector.ejected_report() == []
    # A failure that ejects nobody is not reported; one that ejects starts anew.
    detector.failure("a", "answered 500")
    assert detector.ejected_report() == []
    fail_times(detector, "a", 2)
    assert [(e.ejections, e.for_s) for e in detector.ejected_report()] == [(1, 0.0)]


def test_an_origin_no_request_tried_since_is_reported_a_minute_after_its_last_failure() -> None:
    """A failover region's origin, ejected while its region served: nothing
    tries it once the home region is back, so no answer ends its streak."""
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=1.0, clock=clock)
    detector.failure("far", "answered 500")
    clock.advance(EJECTED_SHOWN_S - EPS)
    assert [e.origin for e in detector.ejected_report()] == ["far"]
    clock.advance(EPS)
    assert detector.ejected_report() == []
    # Tried and failing again: reported again, its streak not ended.
    detector.failure("far")
    assert [(e.ejections, e.for_s, e.ejected_s) for e in detector.ejected_report()] == [
        (2, EJECTED_SHOWN_S, 2.0)
    ]


def test_a_busy_origin_is_not_reported_and_a_long_failure_is_cut() -> None:
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, clock=clock)
    detector.busy("busy", 5.0)
    detector.failure("long", "x" * 1000)
    (e,) = detector.ejected_report()
    assert e.origin == "long" and e.last_failure == "x" * FAILURE_CHARS


def test_an_origin_the_table_says_is_back_is_not_reported_once_its_ejection_is_over() -> None:
    """SRE game-day: after a total outage every origin served again, and the
    proxy that had tried them all during it (and had no request for them
    since) reported each "ejection over, not answered since" for a minute.
    The table taking one off its unhealthy list says the probes found it
    answering: with its ejection over, that is as good as an answer, until a
    request fails it again. One the table never marked (its probes pass, its
    requests fail) stays reported as before."""
    clock = FakeClock()
    detector = OutlierDetector(consecutive=1, base=4.0, clock=clock)
    detector.table_marks_down(frozenset({"a", "b"}))  # the outage: probes fail
    for origin in ("a", "b", "c"):
        detector.failure(origin, "connection refused")

    def reported() -> list[str]:
        return [e.origin for e in detector.ejected_report()]

    clock.advance(1.0)
    detector.table_marks_down(frozenset({"b"}))  # a answers its probes again
    assert reported() == ["a", "b", "c"]  # a's ejection runs on
    clock.advance(3.0 + EPS)
    assert reported() == ["b", "c"]  # over: b's table still says down, c's never did
    detector.table_marks_down(frozenset({"b"}))  # the same word again changes nothing
    assert reported() == ["b", "c"]
    detector.failure("a", "answered 500")  # a request fails it again
    assert reported() == ["a", "b", "c"]
    clock.advance(8.0 + EPS)  # its second ejection, of 8 s, is over
    assert [(e.origin, e.ejected_s) for e in detector.ejected_report()] == [
        ("a", 0.0),
        ("b", 0.0),
        ("c", 0.0),
    ]
