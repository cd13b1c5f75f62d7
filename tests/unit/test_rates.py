"""RateMeter: per-second rates from cumulative counters, restarts included."""

from __future__ import annotations

import pytest

from controlplane.rates import NamedRateMeter, RateMeter


def test_a_rate_needs_two_samples_then_is_the_difference_over_time() -> None:
    meter = RateMeter(window=10)
    assert meter.observe("p", 100.0, (0, 0)) is None
    assert meter.observe("p", 102.0, (20, 4)) == (10.0, 2.0)


def test_a_sample_not_newer_than_the_last_changes_nothing() -> None:
    meter = RateMeter(window=10)
    meter.observe("p", 100.0, (0,))
    assert meter.observe("p", 101.0, (5,)) == (5.0,)
    assert meter.observe("p", 101.0, (5,)) == (5.0,)
    assert meter.observe("p", 100.5, (9,)) == (5.0,)


def test_the_rate_covers_the_window_not_the_whole_history() -> None:
    meter = RateMeter(window=4)
    meter.observe("p", 0.0, (0,))
    for second in range(1, 11):
        rate = meter.observe("p", float(second), (second * (100 if second > 6 else 1),))
    # Since t=6 (the window's start) the counter went from 6 to 1000.
    assert rate == ((1000 - 6) / 4,)


def test_a_counter_going_down_is_a_restart_not_a_negative_rate() -> None:
    meter = RateMeter(window=10)
    meter.observe("p", 0.0, (500, 10))
    meter.observe("p", 1.0, (600, 10))
    assert meter.observe("p", 2.0, (3, 0)) is None
    assert meter.observe("p", 3.0, (13, 1)) == (10.0, 1.0)


def test_one_counter_going_down_resets_all_of_them() -> None:
    meter = RateMeter(window=10)
    meter.observe("p", 0.0, (500, 10))
    assert meter.observe("p", 1.0, (501, 2)) is None


def test_after_a_gap_longer_than_the_window_the_rate_starts_afresh() -> None:
    meter = RateMeter(window=15)
    meter.observe("p", 0.0, (0,))
    assert meter.observe("p", 5.0, (500,)) == (100.0,)
    # Nobody looked for an hour; the proxy kept answering 100 requests a second.
    assert meter.observe("p", 3_605.0, (360_500,)) is None
    assert meter.observe("p", 3_610.0, (361_000,)) == (100.0,)


def test_keys_are_independent_and_retain_forgets_the_rest() -> None:
    meter = RateMeter(window=10)
    meter.observe("a", 0.0, (0,))
    meter.observe("b", 0.0, (0,))
    assert meter.observe("a", 1.0, (3,)) == (3.0,)
    meter.retain({"a"})
    assert meter.observe("b", 1.0, (7,)) is None
    assert meter.observe("a", 2.0, (5,)) == (2.5,)


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        RateMeter(window=0)


def test_a_name_missing_from_a_sample_counted_zero_there() -> None:
    meter = NamedRateMeter(window=10)
    assert meter.observe("p", 100.0, {"a": (10, 0)}) is None
    # b first appears now: measured from the sample before, where it was 0.
    assert meter.observe("p", 102.0, {"a": (14, 2), "b": (4, 0)}) == {
        "a": (2.0, 1.0),
        "b": (2.0, 0.0),
    }
    assert meter.observe("p", 104.0, {"a": (14, 2), "b": (4, 0)}) == {
        "a": (1.0, 0.5),
        "b": (1.0, 0.0),
    }


def test_a_name_gone_or_counted_again_from_zero_leaves_the_others_alone() -> None:
    # A proxy forgets the names it counted longest ago (a restart is a new
    # session, another key): the others keep their rates.
    meter = NamedRateMeter(window=10)
    meter.observe("p", 0.0, {"a": (5,), "b": (1,)})
    assert meter.observe("p", 1.0, {"a": (6,)}) == {"a": (1.0,)}  # b forgotten
    assert meter.observe("p", 2.0, {"a": (8,)}) == {"a": (1.5,)}
    # a forgotten and counted again from 0 (its 3 before kept), b counted from 0.
    assert meter.observe("p", 4.0, {"a": (2,), "b": (3,)}) == {"a": (1.25,), "b": (0.75,)}


def test_a_first_sample_soon_after_its_start_is_measured_from_zero() -> None:
    """Trial 22: a proxy's first report held the whole burst `make demo-check`
    sent, and its rates stayed unknown: the first sample was only a start."""
    meter = RateMeter(window=10.0)
    assert meter.observe("p", 104.0, (8, 2, 0), start=100.0) == (2.0, 0.5, 0.0)
    # A start before the window, or not before the sample, is no help.
    assert meter.observe("q", 150.0, (8, 2, 0), start=100.0) is None
    assert meter.observe("r", 100.0, (8, 2, 0), start=100.0) is None
    named = NamedRateMeter(window=10.0)
    assert named.observe("p", 102.0, {"eu": (4, 0)}, start=100.0) == {"eu": (2.0, 0.0)}


def test_a_sample_heard_at_or_before_a_guess_supersedes_it() -> None:
    """A quiet proxy's counts guessed still held each second up to t=9; its
    burst, heard at 8, was written later than that. It counts, over the
    window before it: not ignored, and not over the second since a guess."""
    meter = RateMeter(window=6.0)
    meter.observe("p", 0.0, (0,))
    for second in range(1, 10):
        assert meter.observe("p", float(second), (0,), guessed=True) == (0.0,)
    # 60 since t=3, the window's start when the last guess was made.
    assert meter.observe("p", 8.0, (60,)) == (12.0,)
    # The same report read again changes nothing, nor does a guess of it.
    assert meter.observe("p", 8.0, (60,)) == (12.0,)
    assert meter.observe("p", 8.0, (60,), guessed=True) == (12.0,)
    # Guessed to hold from then on: the window slides off the burst.
    assert meter.observe("p", 14.0, (60,), guessed=True) == (0.0,)
    named = NamedRateMeter(window=6.0)
    named.observe("p", 0.0, {})
    for second in range(1, 10):
        named.observe("p", float(second), {}, guessed=True)
    assert named.observe("p", 8.0, {"acme": (12, 0)}) == {"acme": (2.4, 0.0)}


def test_a_heard_sample_is_not_superseded_by_a_later_one_heard_earlier() -> None:
    # Only guesses give way: a report older than one heard is ignored as before.
    meter = RateMeter(window=6.0)
    meter.observe("p", 0.0, (0,))
    meter.observe("p", 2.0, (20,))
    assert meter.observe("p", 3.0, (20,), guessed=True) == (20 / 3,)
    assert meter.observe("p", 1.5, (90,)) == (20 / 3,)  # older than t=2's report
    assert meter.observe("p", 2.0, (90,)) == (20 / 3,)


def test_a_late_report_after_guesses_longer_than_the_window_starts_afresh() -> None:
    # The guesses it supersedes leave a gap longer than the window: unknown.
    meter = RateMeter(window=6.0)
    meter.observe("p", 0.0, (0,))
    meter.observe("p", 10.0, (0,), guessed=True)  # nothing sampled in between
    assert meter.observe("p", 9.0, (60,)) is None
    assert meter.observe("p", 11.0, (80,)) == (10.0,)
