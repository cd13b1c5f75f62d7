"""The pure parts of hedging: the time-to-commit window, the budget, the setting."""

from __future__ import annotations

import math

import pytest

from dataplane.upstream.hedge import AUTO, CommitTimes, check_setting, hedge_budget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_p95_below_the_minimum_of_samples() -> None:
    times = CommitTimes(min_samples=20, clock=FakeClock())
    for _ in range(19):
        times.observe("o1", True, 0.1)
    assert times.p95("o1", True) is None
    assert times.p95("unknown", True) is None


def test_p95_is_the_nearest_rank_of_the_window() -> None:
    times = CommitTimes(min_samples=20, clock=FakeClock())
    for ms in range(100, 0, -1):  # arrival order does not matter
        times.observe("o1", True, ms / 1000)
    assert times.p95("o1", True) == pytest.approx(0.095)


def test_the_window_keeps_only_the_last_samples() -> None:
    clock = FakeClock()
    times = CommitTimes(window=128, min_samples=20, clock=clock)
    for _ in range(128):
        times.observe("o1", False, 10.0)
    for _ in range(128):
        times.observe("o1", False, 1.0)
    assert times.p95("o1", False) == 1.0


def test_p95_is_cached_briefly_then_follows_new_samples() -> None:
    clock = FakeClock()
    times = CommitTimes(min_samples=20, cache_s=1.0, clock=clock)
    for _ in range(20):
        times.observe("o1", True, 0.1)
    assert times.p95("o1", True) == 0.1
    for _ in range(128):
        times.observe("o1", True, 0.5)
    assert times.p95("o1", True) == 0.1  # the cached value, for up to cache_s
    clock.now += 1.0
    assert times.p95("o1", True) == 0.5


def test_streams_and_whole_bodies_have_their_own_windows() -> None:
    times = CommitTimes(min_samples=1, clock=FakeClock())
    times.observe("o1", True, 0.2)
    times.observe("o1", False, 9.0)
    assert times.p95("o1", True) == 0.2
    assert times.p95("o1", False) == 9.0
    assert times.p95("o2", True) is None


def test_the_hedge_budget_allows_a_tenth_of_requests_past_its_burst() -> None:
    clock = FakeClock()
    budget = hedge_budget(clock)
    allowed = 0
    for _ in range(1000):
        budget.deposit()
        allowed += budget.try_retry()
    # The burst (its cap, 10) and then one in ten; time stands still, so no floor.
    assert allowed == 10 + 99
    assert budget.refused == 1000 - allowed
    clock.now += 3.0  # the floor: one a second when traffic is quiet
    assert [budget.try_retry() for _ in range(4)] == [True, True, True, False]


def test_a_setting_is_auto_or_seconds() -> None:
    assert check_setting("auto") == AUTO
    assert check_setting(0) == 0.0
    assert check_setting(0.25) == 0.25
    for bad in (-1, math.inf, math.nan, "fast", True, None):
        with pytest.raises(ValueError, match="hedge delay"):
            check_setting(bad)


@pytest.mark.parametrize(
    ("endpoint", "body", "hedged"),
    [
        ("chat.completions", {}, True),
        ("responses", {}, False),  # stored by default: a hedge would store it twice
        ("responses", {"store": True}, False),
        ("responses", {"store": False}, True),
    ],
)
def test_stored_responses_are_never_hedged(
    endpoint: str, body: dict[str, object], hedged: bool
) -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from dataplane.http.pipeline import Pipeline  # noqa: PLC0415
    from dataplane.policy import StreamRules  # noqa: PLC0415

    ex = SimpleNamespace(
        endpoint=SimpleNamespace(name=endpoint),
        body=body,
        model="m",
        tenant=SimpleNamespace(streams=StreamRules(hedge=AUTO)),
    )
    assert Pipeline.hedge_for(ex) == (AUTO if hedged else None)  # type: ignore[arg-type]
