"""bench/instructions.py's pure parts: reading a callgrind dump, the table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import canned
from bench.instructions import (
    Count,
    callgrind,
    dumps,
    per_event,
    process_out,
    report,
    role,
    stream_body,
    total_instructions,
)

# The shape callgrind 3.19 writes when instrumentation started off: a summary of 0
# in the header and the real total at the end.
DUMP = """# callgrind format
version: 1
events: Ir
summary: 0

fn=(1) main
16 20
totals: 1234567
"""


def test_total_is_the_totals_line_not_the_summary(tmp_path: Path) -> None:
    path = tmp_path / "x.out.1"
    path.write_text(DUMP)
    assert total_instructions(path) == 1234567


def test_a_dump_without_totals_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.out.1"
    path.write_text("summary: 5\n")
    with pytest.raises(RuntimeError, match="no totals"):
        total_instructions(path)


def test_dumps_in_numeric_order(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        (tmp_path / f"x.out.{n}").write_text(DUMP)
    (tmp_path / "x.out").write_text(DUMP)
    assert [p.name for p in dumps(tmp_path / "x.out")] == ["x.out.1", "x.out.2", "x.out.10"]


def test_report_gives_ratios_to_the_pass_through() -> None:
    table = report(
        [Count("passthrough", 10, 5_000_000, 1.0), Count("features", 10, 7_500_000, 1.0)]
    ).splitlines()
    assert table[1].split() == ["passthrough", "10", "500,000", "500,000", "1.000"]
    assert table[2].split() == ["features", "10", "750,000", "750,000", "1.500"]


def test_the_idle_rate_over_the_window_is_taken_off() -> None:
    # 2 s of window at 1 M a second idle: 2 M of the 7.5 M counted are the clock's.
    counted = Count("features", 10, 7_500_000, 2.0, idle_per_s=1_000_000)
    assert counted.raw_per_request == 750_000
    assert counted.per_request == 550_000
    table = report([Count("passthrough", 10, 5_000_000, 2.0), counted]).splitlines()
    assert table[2].split() == ["features", "10", "550,000", "750,000", "1.100"]


def test_report_without_the_pass_through_has_no_ratio() -> None:
    table = report([Count("defaults", 4, 400, 1.0)]).splitlines()
    assert table[1].split() == ["defaults", "4", "100", "100", "-"]


def test_streams_are_compared_size_by_size_and_per_event() -> None:
    counts = [
        Count("passthrough", 10, 5_000_000, 1.0, tokens=16),
        Count("passthrough", 10, 5_480_000, 1.0, tokens=64),
        Count("defaults", 10, 10_000_000, 1.0, tokens=16),
        Count("defaults", 10, 19_600_000, 1.0, tokens=64),
    ]
    # (1,960,000 - 1,000,000) / 48 events, against (548,000 - 500,000) / 48.
    assert per_event(counts) == {"passthrough": 1_000.0, "defaults": 20_000.0}
    rows = [row.split() for row in report(counts).splitlines()]
    assert rows[1] == ["passthrough", "16", "10", "500,000", "500,000", "1.000"]
    assert rows[4] == ["defaults", "64", "10", "1,960,000", "1,960,000", "3.577"]
    assert rows[-2:] == [["passthrough", "1,000", "1.000"], ["defaults", "20,000", "20.000"]]


def test_one_stream_size_gives_no_slope() -> None:
    assert per_event([Count("defaults", 10, 1_000, 1.0, tokens=16)]) == {}
    assert "instr/event" not in report([Count("defaults", 10, 1_000, 1.0, tokens=16)])


def test_a_stream_request_names_its_size_and_asks_for_a_stream() -> None:
    body = json.loads(stream_body(64).replace(b"{i}", b"7"))
    assert body["model"] == canned.stream_model(64)
    assert body["stream"] is True and body["max_tokens"] == 64
    assert body["messages"][-1]["content"].endswith("7")


def test_a_group_is_launched_with_its_children_each_to_a_file_of_its_own(tmp_path: Path) -> None:
    """--workers N: valgrind follows the supervisor's exec and its workers, and
    each process writes the file process_out names for its pid (%p)."""
    out = tmp_path / "defaults.out"
    lone, group = callgrind(out), callgrind(out, children=True)
    assert "--trace-children=yes" not in lone and f"--callgrind-out-file={out}" in lone
    assert "--trace-children=yes" in group
    assert f"--callgrind-out-file={tmp_path / 'defaults-%p.out'}" in group
    assert process_out(out, 42) == tmp_path / "defaults-42.out"
    # The vgdb prefix is the group's, whatever the process: monitor asks each by pid.
    assert [a for a in lone if a.startswith("--vgdb-prefix")] == [
        a for a in group if a.startswith("--vgdb-prefix")
    ]


def test_a_process_outside_a_proxy_group_is_neither_worker_nor_supervisor() -> None:
    assert role(os.getpid()) == "other"
