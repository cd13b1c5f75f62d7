"""LineBudget: lines past its rate are counted, and the next one written says how many."""

from __future__ import annotations

import pytest

from dataplane.linebudget import LineBudget


def test_lines_past_the_burst_are_counted_until_the_rate_allows_one() -> None:
    now = [0.0]
    budget = LineBudget(per_second=1.0, burst=2.0, clock=lambda: now[0])
    assert [budget.take() for _ in range(4)] == [0, 0, None, None]
    assert budget.skipped == 2
    now[0] = 0.5  # half a line earned
    assert budget.take() is None
    now[0] = 1.5
    assert budget.take() == 3  # the lines left out since the last one written
    budget.reset()
    assert (budget.skipped, budget.take(), budget.take(), budget.take()) == (0, 0, 0, None)


def test_a_burst_of_less_than_one_line_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one line"):
        LineBudget(burst=0.5)
