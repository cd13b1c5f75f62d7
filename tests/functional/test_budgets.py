"""Day and month token budgets through the proxy's pipeline: the refusal a
client gets once a budget is spent, in OpenAI's words and with the wait to
the period's end, reaching no origin; the official openai client does not
retry it. The fleet-wide count is tests/unit/test_budget.py's and
tests/e2e/test_budgets.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from dataplane.http.state import HOLDER, METRICS, PIPELINE
from dataplane.ratelimit.limiter import FIRST_COMPLETION
from ponto.apikeys import issue_key
from ponto.originsim.app import SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import (
    MODEL,
    Stack,
    chat,
    error_of,
    exchange,
    start_stack,
    table,
)

BUDGETED = issue_key()


def with_budget(stack: Stack, limits: pb.Limits, version: int = 3) -> None:
    """The stack's table, with a key of tenant acme under `limits`."""
    t = table([("o1", str(stack.origins[0].make_url("/v1")))], version=version)
    t.keys.add(id=BUDGETED.key_id, hash=BUDGETED.key_hash, tenant="acme", limits=limits)
    t.etag = content_etag(t)
    stack.app[HOLDER].apply(t, "control-plane")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=20, seed=1)])
    yield s
    await s.close()


@pytest.mark.parametrize(
    ("limits", "code", "kind", "reset"),
    [
        (pb.Limits(tokens_per_day=60), "rate_limit_exceeded", "tokens", "00:00 UTC in"),
        (pb.Limits(tokens_per_month=60), "insufficient_quota", "insufficient_quota", "1st"),
    ],
)
async def test_a_spent_budget_is_refused_until_its_period_ends(
    stack: Stack, limits: pb.Limits, code: str, kind: str, reset: str
) -> None:
    with_budget(stack, limits)
    answered = 0
    for i in range(10):
        # Bounded as its answers are: charged no more than that beforehand
        # (unbounded, a fresh process expects 256 and would keep the last
        # tokens of so small a budget for requests that fit them whole).
        resp = await stack.post(chat(f"question {i}", max_tokens=20), key=BUDGETED.key)
        if resp.status != 200:
            break
        await resp.read()
        answered += 1
    # Each answer charges its prompt and 20 completion tokens: 60 is spent in
    # two or three.
    assert 2 <= answered <= 3
    assert resp.status == 429
    err = error_of(await resp.json())
    assert (err["code"], err["type"]) == (code, kind)
    assert reset in err["message"]
    assert int(resp.headers["retry-after"]) > 0
    assert resp.headers["x-should-retry"] == "false"
    assert stack.origin_requests() == answered
    limit = "tokens_per_day" if limits.tokens_per_day else "tokens_per_month"
    registry = stack.app[METRICS].registry
    assert registry.get_sample_value("ponto_ratelimit_refusals_total", {"limit": limit}) == 1


async def test_the_openai_client_does_not_retry_a_spent_budget(stack: Stack) -> None:
    with_budget(stack, pb.Limits(tokens_per_day=20))
    client = openai.AsyncOpenAI(
        base_url=str(stack.client.make_url("/v1")), api_key=BUDGETED.key, max_retries=2
    )
    async with client:
        ok = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "one"}]
        )
        assert ok.choices[0].message.content
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "two"}]
            )
    assert caught.value.code == "rate_limit_exceeded"
    registry = stack.app[METRICS].registry
    # Asked once: its Retry-After is past what the SDK waits (and x-should-retry
    # says so to clients that do not look at it): no retry.
    assert (
        registry.get_sample_value("ponto_ratelimit_refusals_total", {"limit": "tokens_per_day"})
        == 1
    )
    assert stack.origin_requests() == 1


async def test_a_request_every_origin_failed_is_charged_to_no_budget(tmp_path: Path) -> None:
    """Billing trial 76: every origin answered 500 (no work done), the client
    got a 502 with null tokens in its access line and nothing in
    ponto_tenant_tokens_total, and its budgets were charged 14 tokens a
    request all the same (42 with the SDK's two retries)."""
    s = await start_stack(tmp_path, [SimConfig(name="o1", mode="fail", fail_status=500)])
    try:
        with_budget(s, pb.Limits(tokens_per_day=100_000, tokens_per_month=1_000_000))
        for _ in range(3):
            resp = await s.post(chat("word " * 50), key=BUDGETED.key)
            assert resp.status == 502
            await resp.read()
        # Only scopes with tokens charged this month are counted: none.
        assert s.app[PIPELINE].limiter.counts() == {}
    finally:
        await s.close()


@pytest.mark.parametrize("choices", [1, 8])
async def test_a_request_for_n_answers_is_charged_n_completions_beforehand(
    stack: Stack, choices: int
) -> None:
    """Trial 86: an eval's `n: 8` requests were charged one completion
    expected at admission, so a burst of them near the day's end passed the
    budget by seven answers each. The pipeline passes the choices asked."""
    with_budget(stack, pb.Limits(tokens_per_day=100_000))
    pipeline = stack.app[PIPELINE]
    ex = exchange(stack, chat("pass at k", n=choices, temperature=0.8), BUDGETED.key)
    pipeline.authenticate(ex)
    pipeline.assemble(ex)
    await pipeline.admit(ex)
    assert ex.admission is not None and ex.admission.ok
    left = pipeline.limiter.budget_left(f"k/{BUDGETED.key_id}")
    assert left is not None
    assert 100_000 - left.day_fleet == ex.estimate + choices * FIRST_COMPLETION
    pipeline.settle(ex)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": MODEL, "input": "one answer", "n": 1000}),
        ("/v1/chat/completions", chat("one answer", best_of=1000)),
    ],
)
async def test_a_field_no_api_reads_as_choices_is_not_charged_as_answers(
    stack: Stack, path: str, body: dict[str, object]
) -> None:
    """Review: a Responses request's `n` and a chat's `best_of` (no field of
    theirs, so unbounded by validation; the origin makes one answer) were
    charged that many completions expected: the whole day's budget, so that
    once any of it was spent the request was refused until the day's end."""
    with_budget(stack, pb.Limits(tokens_per_day=100_000))
    headers = {"authorization": f"Bearer {BUDGETED.key}"}
    first = await stack.post(chat("a first answer"), key=BUDGETED.key)
    assert first.status == 200
    resp = await stack.client.post(path, json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert stack.origin_requests() == 2
