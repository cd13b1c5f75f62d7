"""Every Ponto process's log lines start with the date and time in UTC; a
throttled line is written at most once per interval and counts the rest."""

from __future__ import annotations

import logging

import pytest

from ponto.logs import Throttled, ThrottledBy, formatter


def record(created: float) -> logging.LogRecord:
    rec = logging.LogRecord("ponto.x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    rec.created, rec.msecs = created, (created % 1) * 1000
    return rec


def test_lines_carry_an_iso_date_and_time_in_utc_with_milliseconds() -> None:
    line = formatter().format(record(1_764_550_923.456))
    assert line == "2025-12-01T01:02:03.456Z INFO ponto.x: hello there"


def test_a_tag_follows_the_time() -> None:
    assert formatter("w1").format(record(0.0)).startswith("1970-01-01T00:00:00.000Z w1 INFO ")


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_throttled_line_is_written_once_per_interval_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttled = Throttled(logging.getLogger("ponto.test"), every_s=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="ponto.test"):
        assert throttled.log(logging.WARNING, "bad %s", "one")
        for _ in range(4):
            assert not throttled.log(logging.WARNING, "bad %s", "again")
        assert throttled.unlogged == 4
        clock.now += 29.9
        assert not throttled.log(logging.WARNING, "bad %s", "again")
        clock.now += 0.1
        assert throttled.log(logging.ERROR, "worse %s", "now")
        clock.now += 30
        assert throttled.log(logging.WARNING, "quiet")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "bad one"),
        (logging.ERROR, "worse now (5 more not logged)"),
        (logging.WARNING, "quiet"),
    ]
    assert throttled.unlogged == 0


def test_a_throttled_line_carries_the_traceback_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttled = Throttled(logging.getLogger("ponto.test"), clock=Clock())
    with caplog.at_level(logging.ERROR, logger="ponto.test"):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            throttled.log(logging.ERROR, "failed", exc_info=True)
    (rec,) = caplog.records
    assert rec.exc_info is not None
    assert rec.exc_info[0] is RuntimeError


def test_lines_throttled_by_key_do_not_hide_each_other(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    told = ThrottledBy(logging.getLogger("ponto.test"), every_s=60, clock=clock)
    with caplog.at_level(logging.INFO, logger="ponto.test"):
        assert told.log("o1", logging.WARNING, "o1 lies")
        assert told.log("o2", logging.WARNING, "o2 lies")  # another origin's: its own
        assert not told.log("o1", logging.WARNING, "o1 lies")
        clock.now += 60
        assert told.log("o1", logging.WARNING, "o1 lies")
    assert [r.getMessage() for r in caplog.records] == [
        "o1 lies",
        "o2 lies",
        "o1 lies (1 more not logged)",
    ]


def test_keys_past_the_bound_forget_the_one_quiet_longest() -> None:
    """Keys a request makes (the set of origins it tried) must not grow for the
    life of the process: past `max_keys`, the key whose line came longest
    ago (written or not) is forgotten, and its next line is written at once."""
    told = ThrottledBy(logging.getLogger("ponto.test"), every_s=60, max_keys=2, clock=Clock())
    assert told.log("a", logging.WARNING, "a")
    assert told.log("b", logging.WARNING, "b")
    assert not told.log("a", logging.WARNING, "a")  # a is the latest now
    assert told.log("c", logging.WARNING, "c")  # b is forgotten
    assert not told.log("a", logging.WARNING, "a")  # a is not
    assert told.log("b", logging.WARNING, "b")  # b is new again: c, the oldest, goes
    assert told.log("c", logging.WARNING, "c")
