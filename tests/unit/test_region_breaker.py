"""The regional cache's circuit breaker, on an injected clock."""

from __future__ import annotations

import pytest

from dataplane.cache.breaker import Admit, Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_closed_admits_every_call(clock: Clock) -> None:
    b = Breaker(clock=clock)
    assert [b.allow() for _ in range(3)] == [Admit.CLOSED] * 3
    assert b.closed


def test_a_failure_opens_it_until_the_retry_time(clock: Clock) -> None:
    b = Breaker(clock=clock, base_s=0.25, cap_s=5)
    assert b.failure(b.allow() or Admit.CLOSED)
    assert not b.closed
    assert b.allow() is None
    clock.now += 0.24
    assert b.allow() is None
    clock.now += 0.01
    assert b.allow() is Admit.PROBE


def test_one_probe_at_a_time(clock: Clock) -> None:
    b = Breaker(clock=clock)
    b.failure(Admit.CLOSED)
    clock.now += 1
    assert b.allow() is Admit.PROBE
    assert b.allow() is None


def test_a_probe_that_works_closes_it_and_resets_the_delay(clock: Clock) -> None:
    b = Breaker(clock=clock, base_s=0.25, cap_s=5)
    b.failure(Admit.CLOSED)
    clock.now += 0.25
    b.failure(b.allow() or Admit.CLOSED)  # a failed probe: 0.5
    clock.now += 0.5
    probe = b.allow()
    assert probe is Admit.PROBE
    assert b.success(probe)
    assert b.closed
    assert b.allow() is Admit.CLOSED
    b.failure(Admit.CLOSED)
    assert b.delay_s == 0.25


def test_failed_probes_double_the_delay_up_to_the_cap(clock: Clock) -> None:
    b = Breaker(clock=clock, base_s=0.25, cap_s=5)
    b.failure(Admit.CLOSED)
    delays = []
    for _ in range(7):
        clock.now += b.delay_s
        probe = b.allow()
        assert probe is Admit.PROBE
        b.failure(probe)
        delays.append(b.delay_s)
    assert delays == [0.5, 1, 2, 4, 5, 5, 5]


def test_late_outcomes_of_calls_admitted_while_closed_change_nothing(clock: Clock) -> None:
    b = Breaker(clock=clock, base_s=0.25, cap_s=5)
    first, second, third = b.allow(), b.allow(), b.allow()
    assert first is second is third is Admit.CLOSED
    assert b.failure(first)
    assert not b.failure(second)  # does not double the delay or move the retry time
    assert not b.success(third)  # does not close it
    assert not b.closed
    assert b.delay_s == 0.25
    clock.now += 0.25
    assert b.allow() is Admit.PROBE


def test_an_abandoned_probe_frees_the_slot(clock: Clock) -> None:
    b = Breaker(clock=clock)
    b.failure(Admit.CLOSED)
    clock.now += 1
    probe = b.allow()
    assert probe is Admit.PROBE
    b.abandon(probe)
    assert b.allow() is Admit.PROBE


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Breaker(clock=lambda: 0.0, base_s=2, cap_s=1)
