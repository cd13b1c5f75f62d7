"""What a proxy reports its region served (the status page's served and
errors per region): requests its origins answered and cache answers, not
the requests the proxy refused itself before calling any origin."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dataplane.http.state import METRICS
from dataplane.sync.link import traffic_of
from ponto.originsim.app import SIM_STATE, SimConfig
from tests.functional.test_pipeline import KEY, Stack, chat, start_stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=4, seed=1)])
    yield s
    await s.close()


async def test_the_proxy_s_own_refusals_are_no_errors_of_its_region(stack: Stack) -> None:
    assert (await stack.post(chat("what is two and two"))).status == 200
    assert (await stack.post(chat("what is two and two"))).headers["x-ponto-cache"] == "hit"
    refusals = [
        await stack.post({"model": chat("x")["model"]}),  # no messages: 400
        await stack.post(chat("hello", model="no-such-model")),  # 404
        await stack.post(chat("hello"), key=KEY.key + "x"),  # 401
        # Only-if-cached with no entry: a 504 that is the client's doing.
        await stack.post(chat("not asked before"), headers={"cache-control": "only-if-cached"}),
    ]
    assert [r.status for r in refusals] == [400, 404, 401, 504]
    assert stack.origin_requests() == 1
    m = stack.app[METRICS]
    traffic = traffic_of(m.requests, m.genai_duration, m.limited, m.not_cached, m.refused)
    # The origin's answer and the cache's: no error; the refusals arrived
    # (client errors at this proxy) but its region's origins failed nothing.
    assert traffic.served == {"r1": (2, 0)}
    assert (traffic.requests, traffic.server_errors, traffic.client_errors) == (6, 0, 4)


async def test_requests_an_origin_refused_as_bad_are_served_but_no_errors(stack: Stack) -> None:
    """An origin's 400 is the request's fault, an origin's 503 and 429 its
    region's: only those count among the region's errors (review: every
    malformed prompt an origin refused read as its region failing)."""
    state = stack.origins[0].app[SIM_STATE]
    answers = []
    for status in (400, 422, 429, 503):
        state.config = dataclasses.replace(state.config, mode="fail", fail_status=status)
        answers.append(await stack.post(chat(f"question {status}")))
    assert [r.status for r in answers] == [400, 422, 429, 502]
    assert stack.origin_requests() >= 4  # each reached the origin
    m = stack.app[METRICS]
    assert m.excused == {"r1": 2}
    traffic = traffic_of(
        m.requests, m.genai_duration, m.limited, m.not_cached, m.refused, m.excused
    )
    assert traffic.served == {"r1": (4, 2)}
