"""bench/compare_table.py: the "cpu" section (canned origin) beside "max" (simulator),
which of them the CPU aims and the per-core goal read, and a relayed stream's CPU."""

from __future__ import annotations

import argparse
from typing import Any

from bench.compare import FULL, Measured, Target, add_results, answers_by_worker
from bench.compare_table import Phase, aims, build_table, goals, scaling_table


def wrk_result(throughput: float, us: float, busy: float) -> dict[str, Any]:
    return {
        "connections": 16,
        "error_ratio": 0.0,
        "throughput": throughput,
        "server_cpu": busy,
        "origin_cpu": 0.9,
        "cpu_us_per_request": us,
        "per_core": round(1e6 / us),
    }


LABELS = {"direct": "direct", "passthrough": "pass-through", "ponto": "Ponto"}
MAX = Phase("max", "wrk", False, None, {
    "direct": wrk_result(3000, 300, 0.9),
    "passthrough": wrk_result(1000, 480, 0.5),
    "ponto": wrk_result(600, 1000, 0.6),
})  # fmt: skip
CPU = Phase("cpu", "wrk", False, None, {
    "direct": wrk_result(70000, 13, 0.9),
    "passthrough": wrk_result(2800, 350, 0.98),
    "ponto": wrk_result(1050, 910, 0.96),
})  # fmt: skip


def aim(verdicts: list[dict[str, Any]], start: str) -> dict[str, Any]:
    (found,) = [v for v in verdicts if v["goal"].startswith(start)]
    return found


def test_the_cpu_section_follows_max_with_its_own_ratios() -> None:
    v = build_table(LABELS, {"max": MAX, "cpu": CPU}, {}, {}, ())
    labels = [row[0] for row in v.table.rows]
    start = labels.index("server CPU per request, canned origin (nginx), wrk closed loop 16 conns")
    assert labels.index("max rate (simulator origin), wrk closed loop, 16 conns (req/s)") < start
    section = {row[0].strip(): row for row in v.table.rows[start + 1 :]}
    assert section["server CPU per request (us)"][1:] == ["13", "350", "910", "2.60x"]
    assert section["origin (nginx) CPU busy meanwhile"][1] == "0.90"
    assert v.floor["canned_cpu_per_request"] == 2.6
    assert v.floor["cpu_per_request"] == 2.08  # "max" keeps its keys
    assert v.floor["canned_max_throughput"] == 0.38


def test_the_aims_and_the_per_core_goal_read_cpu_when_present() -> None:
    phases = {"max": MAX, "cpu": CPU}
    v = build_table(LABELS, phases, {}, {}, ())
    cpu_aim = aim(aims(phases, None, features="auth-limits-cache", workers=None),
                  "server CPU per request with key auth")  # fmt: skip
    assert cpu_aim["value"] == 2.6 and "[canned origin]" in cpu_aim["goal"]
    per_core = aim(goals(phases, {}, v.litellm, "auth-limits-cache"), "Ponto at least 8,000")
    assert per_core["value"] == round(1e6 / 910) and "canned origin" in per_core["goal"]


def test_without_cpu_they_fall_back_to_max() -> None:
    phases = {"max": MAX}
    v = build_table(LABELS, phases, {}, {}, ())
    assert not any("canned" in row[0] for row in v.table.rows)
    cpu_aim = aim(aims(phases, None, features="none", workers=None),
                  "server CPU per request with defaults")  # fmt: skip
    assert cpu_aim["value"] == 2.08 and "[simulator origin]" in cpu_aim["goal"]
    per_core = aim(goals(phases, {}, v.litellm, "none"), "Ponto at least 8,000")
    assert per_core["value"] == 1000


def stream_result(us: float) -> dict[str, Any]:
    return {
        "error_ratio": 0.0,
        "ttfb_ms": {"p50": 2.0, "p99": 3.0},
        "lateness_ms": {"p99": 0.5},
        "cpu_us_per_request": us,
    }


def test_a_streams_cpu_follows_its_ttft_with_its_ratio_over_the_floor() -> None:
    stream = Phase("stream", "open", True, 100.0, {
        "direct": stream_result(400),
        "passthrough": stream_result(500),
        "ponto": stream_result(800),
    })  # fmt: skip
    v = build_table(LABELS, {"stream": stream}, {}, {}, ())
    labels = [row[0] for row in v.table.rows]
    at = labels.index("  server CPU per stream (us)")
    assert labels[at - 1] == "  sent late, p99 (ms)"  # the TTFT rows come first
    assert v.table.rows[at][1:] == ["-", "500", "800", "1.60x"]
    assert v.floor["stream_cpu_per_request"] == 1.6


def hit_result(p50: float) -> dict[str, Any]:
    return {"error_ratio": 0.0, "latency_ms": {"p50": p50, "p99": 2 * p50}}


def test_a_hit_is_timed_against_the_origin_where_the_servers_sit_when_it_ran() -> None:
    # The origin beside the client (0.28 ms) crosses no CPU; the one on CPU 0
    # (0.50 ms) crosses what a call to Ponto crosses, and is the aim's measure.
    hit = Phase("cache-hit", "closed", False, None, {
        "direct": hit_result(0.28), "seat": hit_result(0.50), "ponto": hit_result(0.43),
    })  # fmt: skip
    verdict = aim(aims({"cache-hit": hit}, None, features="auth-limits-cache", workers=None),
                  "exact-cache hit answered faster")  # fmt: skip
    assert verdict["value"] == 0.86 and "origin on CPU 0" in verdict["goal"]
    rows = {row[0].strip(): row[1:] for row in build_table(LABELS, {"cache-hit": hit}, {}, {}, ())
            .table.rows}  # fmt: skip
    key = "exact-cache hit (Ponto) vs direct (direct: origin on CPU 0, where the servers sit)"
    assert rows[f"{key}, one at a time p50 (ms)"][:3] == ["0.500", "-", "0.430"]
    beside = rows["direct with the origin beside the client (CPU 1), p50 (ms)"]
    assert beside[:3] == ["0.280", "-", "-"]


def test_without_the_seat_origin_a_hit_is_timed_against_direct() -> None:
    hit = Phase("cache-hit", "closed", False, None, {
        "direct": hit_result(0.28), "ponto": hit_result(0.43),
    })  # fmt: skip
    verdict = aim(aims({"cache-hit": hit}, None, features="auth-limits-cache", workers=None),
                  "exact-cache hit answered faster")  # fmt: skip
    assert verdict["value"] == 1.54 and "CPU 0" not in verdict["goal"]


def test_the_workers_phase_projects_a_cpu_for_each_worker() -> None:
    """Beside the measured ratio (bounded by what wrk and the origin leave of
    the CPUs), the projection: the workers times the group's answers per proxy
    CPU-second, over one worker's; judged as the measured one is."""
    scaling = Phase("scaling", "wrk", False, None, {
        "ponto-1": {**wrk_result(5906, 168, 0.99), "per_core": 6000},
        "ponto-2": {**wrk_result(8752, 178, 1.56), "per_core": 5600,
                    "worker_answers": {"0": 60_000, "1": 40_000}},
    })  # fmt: skip
    table = scaling_table(scaling, 2)
    assert table is not None
    rows = {row[0].strip(): row[1:] for row in table.rows}
    assert rows["max rate, wrk closed loop (req/s)"] == ["5,906", "8,752", "1.48x"]
    assert rows["req/s per core of the server"] == ["6,000", "5,600", "0.93x"]
    assert rows["answers of each worker"] == ["-", "60% / 40%", ""]
    projected = "projected, a CPU of its own for each worker (req/s per core x workers)"
    assert rows[projected] == ["6,000", "11,200", "1.87x"]
    verdicts = aims({"scaling": scaling}, None, features="auth-limits-cache", workers=2)
    measured = aim(verdicts, "--workers 2 on 2 CPUs")
    assert (measured["value"], measured["pass"]) == (1.48, False)
    projection = aim(verdicts, "--workers 2 projected on a CPU of its own")
    assert (projection["value"], projection["pass"]) == (1.87, True)


def test_a_groups_chat_answers_are_counted_by_worker() -> None:
    """bench.compare reads how the kernel spread the workers phase's load from
    the group's merged /metrics: chat completions of every status, by worker."""
    exposition = "\n".join([
        "# HELP ponto_requests_total Requests answered, by endpoint and status code",
        "# TYPE ponto_requests_total counter",
        'ponto_requests_total{worker="0",endpoint="chat.completions",code="200"} 600.0',
        'ponto_requests_total{worker="0",endpoint="chat.completions",code="429"} 5.0',
        'ponto_requests_total{worker="0",endpoint="metrics",code="200"} 3.0',
        'ponto_requests_total{worker="1",endpoint="chat.completions",code="200"} 400.0',
        "",
    ])  # fmt: skip
    assert answers_by_worker(exposition) == {"0": 605.0, "1": 400.0}


def test_the_peak_rss_verdicts_say_what_the_cache_held_at_the_end() -> None:
    """A peak RSS follows how full the exact cache got (72 MB with 12.8 MB
    cached, 86 MB full): its verdicts name the bytes the proxy's
    ponto_cache_bytes gave when the peak was read, or that it was not read."""
    m = Measured(
        targets=[Target("ponto", "Ponto", "http://ponto", 1)],
        phases={},
        rss={"ponto": 72.2},
        largest={"ponto": 72.2},
        cache_on=True,
    )
    args = argparse.Namespace(ponto_features="auth-limits-cache", ponto_workers=None)
    cached = {"bytes": 12.8 * 2**20, "entries": 7938.0, "hit": 1.0, "miss": 7938.0}
    report: dict[str, Any] = {"ponto_features": "auth-limits-cache", "ponto_cache_at_end": cached}
    add_results(report, m, args, FULL)
    goal = aim(report["goals"], "Ponto peak RSS under 80 MB")
    worker = aim(report["aims"], "peak RSS of one Ponto worker")
    for verdict in (goal, worker):
        assert verdict["value"] == 72.2
        assert "[its cache held 12.8 MB at the end]" in verdict["goal"]
    # An empty cache (--ponto-features none) is read as such, not as unread.
    empty: dict[str, Any] = {
        "ponto_features": "none",
        "ponto_cache_at_end": {**cached, "bytes": 0.0},
    }
    add_results(empty, m, args, FULL)
    assert "[its cache held 0.0 MB at the end]" in aim(empty["aims"], "peak RSS of one")["goal"]
    unread: dict[str, Any] = {"ponto_features": "auth-limits-cache", "ponto_cache_at_end": {}}
    add_results(unread, m, args, FULL)
    assert "[the cache's bytes not read]" in aim(unread["aims"], "peak RSS of one")["goal"]
    assert "[the cache's bytes not read]" in aim(unread["goals"], "Ponto peak RSS")["goal"]
