"""NamedRateMeter reads every step of its window: a name forgotten (and
counted again from 0) between the window's ends keeps what was counted before."""

from __future__ import annotations

from controlplane.rates import NamedRateMeter


def test_a_name_forgotten_between_the_windows_ends_keeps_what_was_counted_before() -> None:
    meter = NamedRateMeter(window=15)
    meter.observe("p", 0.0, {"a": (2,)})
    assert meter.observe("p", 5.0, {"a": (12,)}) == {"a": (2.0,)}  # 10 in 5 s
    # Forgotten, then counted again from 0: 1 more. 11 over the 10 s at least.
    rates = meter.observe("p", 10.0, {"a": (1,)})
    assert rates is not None and rates["a"][0] == 1.1, rates


def test_a_name_forgotten_and_counted_past_its_old_count_is_not_undercounted() -> None:
    meter = NamedRateMeter(window=15)
    meter.observe("p", 0.0, {"a": (5,)})
    meter.observe("p", 5.0, {"b": (1,)})  # a forgotten
    # a counted again from 0: 7 since. Its counters did not "fall" from 5.
    rates = meter.observe("p", 10.0, {"a": (7,), "b": (1,)})
    assert rates is not None and rates["a"][0] == 0.7, rates
