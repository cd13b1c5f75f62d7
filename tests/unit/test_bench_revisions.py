"""bench/revisions.py's arithmetic: per-round ratios and the two orders combined."""

from __future__ import annotations

import math

import pytest

from bench.revisions import Order, combined


def test_ratios_are_head_over_base_per_round() -> None:
    order = Order("head", head_us=[90.0, 110.0], base_us=[100.0, 100.0])
    assert order.ratios() == [0.9, 1.1]


def test_an_advantage_of_the_first_started_cancels_out() -> None:
    # Head truly costs 0.9 of base; whichever starts first measures 2 % cheaper.
    head_first = Order("head", head_us=[0.9 * 0.98 * 100] * 3, base_us=[100.0] * 3)
    base_first = Order("base", head_us=[0.9 * 100] * 3, base_us=[0.98 * 100] * 3)
    assert combined([head_first, base_first]) == pytest.approx(0.9)


def test_each_order_counts_by_its_median_round() -> None:
    noisy = Order("head", head_us=[80.0, 90.0, 300.0], base_us=[100.0, 100.0, 100.0])
    calm = Order("base", head_us=[90.0], base_us=[100.0])
    assert combined([noisy, calm]) == pytest.approx(math.sqrt(0.9 * 0.9))


def test_no_rounds_is_an_error_not_a_ratio() -> None:
    with pytest.raises(ValueError, match="no round"):
        combined([Order("head")])
