"""Issue 15, bounded: hostile clients against a real proxy, judged request by request.

bench/fuzz.py with a small count (`make fuzz` runs 100,000+): one fleet (etcd, a
control plane, an origin simulator that logs each request's `x-sim-mark`, a
proxy), a few thousand body cases (wrong types per field, malformed JSON, deep
nesting, bad Content-Encoding), two rounds of every raw framing case, then 300
slow clients (slow-loris headers, slow bodies, slow chunks, idle) while a
normal client keeps asking. The run happens once per module; each test checks
one property of its outcome. No timing is asserted here (the p99 bar is
`make fuzz`'s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.fuzz import FD_SLACK, FuzzConfig, FuzzReport, by_case_lines, fuzz, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONFIG = FuzzConfig(
    requests=2_500,
    slow=300,
    slow_seconds=5.0,
    seed=1515,
    concurrency=16,
    bomb_mb=32,
    raw_every=1_250,
    p99_bar=False,
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzReport]:
    with start_system(tmp_path_factory.mktemp("fuzz")) as system:
        yield asyncio.run(fuzz(system, CONFIG))


def assert_none(report: FuzzReport, *kinds: str) -> None:
    """No finding of these kinds; else fail listing them by case, one example each."""
    lines = []
    for kind in kinds:
        if examples := report.verdict.findings.get(kind):
            lines.append(f"{kind}: {len(examples)}")
            lines += by_case_lines(report.verdict, kind, examples, 40)
    assert not lines, "\n".join(lines)


def test_the_proxy_never_dies(report: FuzzReport) -> None:
    assert report.proxy_alive
    assert report.origin_alive


def test_no_answer_is_a_5xx(report: FuzzReport) -> None:
    assert_none(report, "5xx")
    assert [a for a in report.slow.bad_answers if " -> 5" in a] == []


def test_every_error_is_an_openai_json_error(report: FuzzReport) -> None:
    assert_none(report, "non-JSON error")


def test_refused_requests_never_reach_the_origin(report: FuzzReport) -> None:
    assert_none(report, "refused request reached the origin", "refusal missed (2xx)")


def test_valid_requests_pass_and_every_request_is_answered(report: FuzzReport) -> None:
    assert_none(report, "valid, refused by the proxy", "no answer")


def test_errors_name_the_clients_own_message_index(report: FuzzReport) -> None:
    assert_none(report, "wrong message index")


def test_refusals_are_logged_without_a_traceback(report: FuzzReport) -> None:
    assert report.tracebacks == 0


def test_slow_clients_leave_normal_requests_alone(report: FuzzReport) -> None:
    assert report.slow.opened >= CONFIG.slow
    assert report.slow.keepalive_ms, "the normal client got no answer at all"
    assert report.slow.normal_errors == []
    assert report.slow.bad_answers == []


def test_descriptors_come_back_after_the_slow_clients_leave(report: FuzzReport) -> None:
    assert report.fds["peak"] > report.fds["before"], "the slow clients never connected"
    assert report.fds["after"] <= report.fds["before"] + FD_SLACK, report.fds
