"""How bench/fuzz.py judges an answer, and bench/soak.py's slopes: the rules the
fuzz and soak verdicts (and tests/e2e/test_fuzz.py) rest on."""

from __future__ import annotations

import random

import orjson

from bench.fuzz import Answer, Outcome, Verdict, judge, read_answer
from bench.fuzz_cases import BodyCase, Expect, body_cases, raw_cases
from bench.soak import slope_per_min

ERROR = orjson.dumps(
    {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
)
JSON = "application/json"


def outcome(
    expect: Expect, *answers: Answer, head: bool = True, index: int | None = None
) -> Outcome:
    out = Outcome("case", "body", (expect,), ("m1",), 1, head, index=index)
    out.answers.extend(answers)
    return out


def findings(outcomes: list[Outcome], reached: set[str]) -> dict[str, int]:
    verdict = Verdict()
    judge(outcomes, reached, verdict)
    return {kind: len(v) for kind, v in verdict.findings.items() if v}


def test_an_openai_error_needs_message_type_param_and_code_in_a_json_body() -> None:
    assert read_answer(400, "application/json; charset=utf-8", ERROR).json_error
    assert not read_answer(400, "text/plain", ERROR).json_error
    assert not read_answer(400, JSON, b'{"error": "bad"}').json_error
    assert not read_answer(400, JSON, b'{"error": {"message": "bad", "type": "x"}}').json_error
    assert not read_answer(400, JSON, b"not json").json_error
    with_param = ERROR.replace(b'"param":null', b'"param":"messages[2].content"')
    assert read_answer(400, JSON, with_param).param == "messages[2].content"


def test_a_refusal_is_judged_by_status_body_and_what_reached_the_origin() -> None:
    good = read_answer(400, JSON, ERROR)
    assert findings([outcome("refuse", good)], set()) == {}
    assert findings([outcome("refuse", good)], {"m1"}) == {"refused request reached the origin": 1}
    text = read_answer(400, "text/plain", b"Bad Request")
    assert findings([outcome("refuse", text)], set()) == {"non-JSON error": 1}
    # A head that was never complete did not reach the application: any answer will do.
    assert findings([outcome("any", text, head=False)], set()) == {}
    ok = read_answer(200, JSON, b"{}")
    assert findings([outcome("refuse", ok)], {"m1"}) == {
        "refusal missed (2xx)": 1,
        "refused request reached the origin": 1,
    }
    assert findings([outcome("any", read_answer(502, JSON, ERROR))], set()) == {"5xx": 1}
    assert findings([outcome("accept")], set()) == {"no answer": 1}


def test_a_valid_request_refused_counts_against_the_proxy_only_if_it_refused_it() -> None:
    refused = read_answer(400, JSON, ERROR)
    assert findings([outcome("accept", refused)], set()) == {"valid, refused by the proxy": 1}
    assert findings([outcome("accept", refused)], {"m1"}) == {}


def test_an_error_must_name_the_clients_own_message_index() -> None:
    at_1 = read_answer(400, JSON, ERROR.replace(b'"param":null', b'"param":"messages[1]"'))
    assert findings([outcome("refuse", at_1, index=1)], set()) == {}
    assert findings([outcome("refuse", at_1, index=0)], set()) == {"wrong message index": 1}


def test_the_case_mix_is_reproducible_and_covers_every_expectation() -> None:
    one, two = body_cases(random.Random(7), 400), body_cases(random.Random(7), 400)
    assert one == two
    assert {c.expect for c in one} == {"refuse", "accept", "any"}
    assert all(isinstance(c, BodyCase) for c in one)
    labels = {c.label for c in raw_cases(random.Random(7), 8080)}
    assert {"Content-Length smaller", "no terminating chunk, then EOF", "headers 5000"} <= labels


def test_slope_per_minute_is_the_least_squares_fit() -> None:
    assert slope_per_min([(0, 10.0), (60, 12.0), (120, 14.0)]) == 2.0
    assert slope_per_min([(0, 5.0), (30, 5.0)]) == 0.0
    assert slope_per_min([(0, 5.0)]) == 0.0
