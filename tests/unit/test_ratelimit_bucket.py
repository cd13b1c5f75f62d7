"""dataplane.ratelimit.bucket: continuous refill, debt, resizing, time passed in."""

from __future__ import annotations

import math

import pytest

from dataplane.ratelimit.bucket import TokenBucket


def test_starts_full_unless_told_and_refills_continuously_to_capacity() -> None:
    b = TokenBucket.per_minute(60, now=0.0)
    assert b.refill(0.0) == 60
    assert TokenBucket.per_minute(60, now=0.0, level=0.0).refill(0.0) == 0.0
    b.take(60, 0.0)
    assert b.refill(30.0) == pytest.approx(30.0)  # half a minute, half the limit
    assert b.refill(90.0) == 60  # never above capacity
    assert b.refill(1000.0) == 60


def test_admits_while_level_covers_amount_and_take_never_blocks() -> None:
    b = TokenBucket(10.0, 1.0, 0.0)
    assert b.admits(10.0, 0.0)
    b.take(4.0, 0.0)
    assert b.admits(6.0, 0.0)
    assert not b.admits(6.5, 0.0)
    assert b.admits(6.5, 0.5)
    b.take(100.0, 0.5)  # a correction after the fact may exceed the level
    assert b.level == pytest.approx(-93.5)
    assert not b.admits(0.0, 0.5)  # debt is repaid before anything else passes


def test_amount_larger_than_capacity_passes_only_when_full_and_leaves_debt() -> None:
    b = TokenBucket(10.0, 1.0, 0.0)
    b.take(1.0, 0.0)
    assert not b.admits(25.0, 0.0)
    assert b.wait_s(25.0, 0.0) == pytest.approx(1.0)  # until full, not until 25
    assert b.admits(25.0, 1.0)
    b.take(25.0, 1.0)
    assert b.level == pytest.approx(-15.0)
    # The long-run rate holds: 25 s until the next full bucket.
    assert b.reset_s(1.0) == pytest.approx(25.0)


def test_empty_capacity_admits_nothing_and_has_no_known_wait() -> None:
    b = TokenBucket(0.0, 0.0, 0.0)
    assert not b.admits(0.0, 100.0)
    assert not b.admits(1.0, 100.0)
    assert b.wait_s(1.0, 100.0) == math.inf
    assert b.reset_s(100.0) == 0.0  # nothing missing


def test_wait_and_reset_are_exact_for_continuous_refill() -> None:
    b = TokenBucket.per_minute(120, now=0.0)  # 2 per second
    b.take(120, 0.0)
    assert b.wait_s(1.0, 0.0) == pytest.approx(0.5)
    assert b.wait_s(3.0, 0.25) == pytest.approx(1.25)
    assert b.reset_s(0.25) == pytest.approx(59.75)  # 0.5 of 120 back after 0.25 s
    assert b.wait_s(1.0, 10.0) == 0.0


def test_give_refunds_but_never_above_capacity() -> None:
    b = TokenBucket(10.0, 1.0, 0.0)
    b.take(3.0, 0.0)
    b.give(2.0, 0.0)
    assert b.level == pytest.approx(9.0)
    b.give(50.0, 0.0)
    assert b.level == 10.0


def test_shrinking_clamps_at_once_and_growing_adds_no_tokens() -> None:
    b = TokenBucket(100.0, 10.0, 0.0)
    b.take(40.0, 0.0)  # 60 left
    b.resize(30.0, 3.0, 1.0)  # refills 10 at the old rate first, then clamps
    assert b.level == 30.0
    b.take(30.0, 1.0)
    b.resize(100.0, 10.0, 1.0)
    assert b.level == 0.0  # grown, but not refilled
    assert b.refill(2.0) == pytest.approx(10.0)  # at the new rate from now on


def test_resize_counts_time_before_it_at_the_old_rate() -> None:
    b = TokenBucket(100.0, 1.0, 0.0, level=0.0)
    b.resize(100.0, 10.0, 5.0)
    assert b.level == pytest.approx(5.0)
    assert b.refill(6.0) == pytest.approx(15.0)


def test_time_going_backwards_is_no_time() -> None:
    b = TokenBucket(10.0, 1.0, 100.0, level=0.0)
    assert b.refill(50.0) == 0.0
    assert b.refill(101.0) == pytest.approx(1.0)


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        TokenBucket(-1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="negative"):
        TokenBucket(1.0, 1.0, 0.0).resize(1.0, -1.0, 0.0)
