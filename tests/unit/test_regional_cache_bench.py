"""bench/regional_cache.py's pure parts: the workload it replays, how it reads an
answer's headers, and the figures and verdicts it reports."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import pytest

from bench.regional_cache import (
    MODES,
    PROXY_COUNTS,
    QUICK,
    Sample,
    Workload,
    fault_question,
    make_workload,
    outcome_of,
    report,
    windows,
    zipf_draw,
)

INTENTS = {f"intent-{i}": [f"phrasing {j} of intent {i}" for j in range(5)] for i in range(40)}


def test_zipf_draws_favour_the_first_ranks_and_repeat_with_the_seed() -> None:
    draws = zipf_draw(100, 5000, 1.1, random.Random(3))
    assert draws == zipf_draw(100, 5000, 1.1, random.Random(3))
    assert set(draws) <= set(range(100))
    counts = Counter(draws)
    assert counts[0] > counts[1] > counts[10] > counts.get(90, 0)


def test_the_workload_repeats_questions_and_paraphrases_intents() -> None:
    work = make_workload(INTENTS, QUICK)
    assert work == make_workload(INTENTS, QUICK)
    assert len(work.exact) == QUICK.exact_requests
    assert len(work.semantic) == QUICK.semantic_requests
    assert len(set(work.exact)) <= QUICK.exact_pool
    assert len(set(work.exact)) < len(work.exact)  # repeats
    by_text = {t: label for label, ts in INTENTS.items() for t in ts}
    asked = Counter(by_text[t] for t in work.semantic)
    most_asked = asked.most_common(1)[0][0]
    # The intent asked most is asked in more than one phrasing: paraphrases.
    assert len({t for t in work.semantic if by_text[t] == most_asked}) > 1


def test_each_fault_question_is_asked_once_on_every_proxy() -> None:
    asked: dict[str, list[int]] = {}
    for i in range(4 * 41 * 3):
        asked.setdefault(fault_question(i, 4), []).append(i)
    assert len(asked) == 41 * 3
    for indexes in asked.values():
        assert sorted(i % 4 for i in indexes) == [0, 1, 2, 3]
        assert min(b - a for a, b in itertools.pairwise(indexes)) == 41


@pytest.mark.parametrize(
    ("status", "headers", "outcome"),
    [
        (200, {"x-ponto-cache": "hit", "x-ponto-cache-tier": "region"}, "region"),
        (200, {"x-ponto-cache": "hit", "x-ponto-cache-tier": "local"}, "local"),
        (200, {"x-ponto-cache": "miss"}, "miss"),
        (200, {"x-ponto-cache": "bypass"}, "bypass"),
        (200, {}, "miss"),
        (503, {"x-ponto-cache": "miss"}, "error"),
    ],
)
def test_an_answer_s_headers_say_where_it_came_from(
    status: int, headers: dict[str, str], outcome: str
) -> None:
    assert outcome_of(status, headers) == outcome


def sample(outcome: str, at: float = 0.0, seconds: float = 0.001) -> Sample:
    return Sample(proxy=0, outcome=outcome, semantic=False, seconds=seconds, at=at)


def test_the_fault_phase_is_reported_by_window() -> None:
    samples = [
        sample("local", 1.0),
        sample("region", 2.0),
        sample("miss", 5.0),
        sample("error", 6.0),
        sample("region", 9.5),
    ]
    up, down, back = windows(samples, kill_at=4.0, restart_at=8.0)
    assert up[:6] == ["Redis up", 2, 0, 1, 1, 0]
    assert down[:6] == ["Redis killed", 2, 1, 0, 0, 1]
    assert back[:6] == ["Redis restarted (empty)", 1, 0, 0, 1, 0]


def measurement(four_proxy_hits: int, failed: int, region_ms: float) -> dict[str, Any]:
    """100 requests per run: 40 hits with 1 proxy, `four_proxy_hits` with more; local
    hits take 0.5 ms, region hits `region_ms`."""
    runs: dict[tuple[str, str, int], list[Sample]] = {}
    for tenant in ("exact", "para"):
        for mode in MODES:
            for n in PROXY_COUNTS:
                hits = 40 if n == 1 else four_proxy_hits
                ss = [sample("local", seconds=0.0005)] * hits
                if mode == "redis" and n > 1:  # half of the hits from the region
                    ss[hits // 2 :] = [sample("region", seconds=region_ms / 1e3)] * (
                        hits - hits // 2
                    )
                runs[(tenant, mode, n)] = ss + [sample("miss", seconds=0.02)] * (100 - hits)
    fault = [sample("region", 1.0), *[sample("error", 5.0)] * failed, sample("region", 9.0)]
    return {"runs": runs, "floor": [0.0002], "fault": fault, "kill_at": 4.0, "restart_at": 8.0}


def aims(result: dict[str, Any]) -> dict[str, str]:
    table = next(t for t in result["tables"] if t["title"] == "Aims (issue 16)")
    return {row[0]: row[2] for row in table["rows"]}


def test_the_aims_pass_when_the_region_keeps_its_hit_rate_fast_and_without_failures() -> None:
    work = Workload(exact=["a", "a", "b"], semantic=["x"])
    verdicts = aims(report(work, measurement(39, failed=0, region_ms=1.2), QUICK, 1.0))
    assert set(verdicts.values()) == {"pass"}, verdicts


def test_the_aims_miss_when_hits_fall_region_hits_are_slow_or_requests_fail() -> None:
    work = Workload(exact=["a", "a", "b"], semantic=["x"])
    verdicts = aims(report(work, measurement(37, failed=2, region_ms=2.0), QUICK, 1.0))
    assert [v for aim, v in verdicts.items() if "resume" not in aim] == ["miss"] * 3


def test_no_region_hit_after_the_restart_is_a_miss() -> None:
    work = Workload(exact=["a", "a", "b"], semantic=["x"])
    m = measurement(39, failed=0, region_ms=1.2)
    m["fault"] = [s for s in m["fault"] if s.at < m["restart_at"]]
    verdicts = aims(report(work, m, QUICK, 1.0))
    resumed = [v for aim, v in verdicts.items() if "resume" in aim]
    assert resumed == ["miss"]
