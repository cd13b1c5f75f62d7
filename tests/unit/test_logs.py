"""Every Ponto process's log lines start with the date and time in UTC."""

from __future__ import annotations

import logging

from ponto.logs import formatter


def record(created: float) -> logging.LogRecord:
    rec = logging.LogRecord("ponto.x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    rec.created, rec.msecs = created, (created % 1) * 1000
    return rec


def test_lines_carry_an_iso_date_and_time_in_utc_with_milliseconds() -> None:
    line = formatter().format(record(1_764_550_923.456))
    assert line == "2025-12-01T01:02:03.456Z INFO ponto.x: hello there"


def test_a_tag_follows_the_time() -> None:
    assert formatter("w1").format(record(0.0)).startswith("1970-01-01T00:00:00.000Z w1 INFO ")
