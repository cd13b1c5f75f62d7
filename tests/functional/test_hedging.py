"""Hedged requests through the Forwarder, against real aiohttp origins on loopback.

Each origin is a tiny app whose behaviour a test sets (a delay before the
headers, a status, a stream whose first chunk comes late) and which records
what it saw, a cancellation included: the test servers cancel a handler when
its client closes the connection, as vLLM aborts a request. Delays only order
events (a slow origin is seconds slower than a fast one, and is cancelled long
before); nothing asserts how fast anything was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.http.errors import ApiError
from dataplane.linebudget import LineBudget
from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.routes import Target
from dataplane.upstream import forwarder as forwarder_module
from dataplane.upstream.credentials import OriginCredentials
from dataplane.upstream.forwarder import Forwarder, OriginAnswer, Sent, UpstreamSettings
from dataplane.upstream.hedge import CommitTimes
from dataplane.upstream.outlier import OutlierDetector, RetryBudget
from dataplane.upstream.wire import OriginResponse
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.originsim.app import build_app as sim_app

SLOW = 5.0  # an origin this slow is always cancelled before it answers
SHORT = 0.02  # a hedge delay that passes long before a slow origin answers


@dataclass
class Behaviour:
    delay: float = 0.0  # before the headers
    status: int = 200
    stream: bool = False
    first_delay: float = 0.0  # a stream's: after the headers, before its first chunk
    location: str = ""  # with a 3xx status: where it redirects
    raw: tuple[str, bytes] | None = None  # a 200 of this content type and body


@dataclass
class Origin:
    """A test origin: answers as `behaviour` says, counts requests and cancellations."""

    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    started: int = 0
    cancelled: int = 0
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.started += 1
        b = self.behaviour
        try:
            await request.read()
            await asyncio.sleep(b.delay)
            if b.location:
                return web.Response(status=b.status, headers={"location": b.location})
            if b.raw is not None:
                content_type, body = b.raw
                return web.Response(
                    status=b.status, body=body, headers={"content-type": content_type}
                )
            if b.status != 200:
                return web.json_response({"error": {"message": "no"}}, status=b.status)
            if not b.stream:
                message = {"role": "assistant", "content": "hi"}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                return web.json_response({"origin": self.name, "choices": [choice]})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(b.first_delay)
            await resp.write(f'data: {{"origin": "{self.name}"}}\n\n'.encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancel_seen.set()
            raise


@dataclass
class Rig:
    forwarder: Forwarder
    metrics: Metrics
    origins: list[Origin]
    targets: list[Target]

    def origin(self, name: str) -> Origin:
        return next(o for o in self.origins if o.name == name)

    async def forward(self, **kw: Any) -> OriginAnswer:
        headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
        return await self.forwarder.forward(
            "/chat/completions", b"{}", headers, kw.pop("targets", self.targets), **kw
        )

    def sample(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def hedges(self, outcome: str) -> float:
        return self.sample("ponto_hedges_total", {"outcome": outcome})

    def attempts(self, origin: str, outcome: str) -> float:
        return self.sample("ponto_upstream_attempts_total", {"origin": origin, "outcome": outcome})

    def outstanding(self) -> list[int]:
        return [self.forwarder.loads.outstanding(t.name) for t in self.targets]


RigMaker = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def rigs() -> AsyncIterator[RigMaker]:
    """Build rigs of N test origins; everything is closed at the end."""
    servers: list[TestServer] = []
    forwarders: list[Forwarder] = []

    async def make(*behaviours: Behaviour, **kw: Any) -> Rig:
        origins = [Origin(f"o{i}", b) for i, b in enumerate(behaviours, start=1)]
        targets = []
        for origin in origins:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", origin.handle)
            server = TestServer(app)
            await server.start_server()
            servers.append(server)
            targets.append(Target(origin.name, "r1", str(server.make_url("/v1")), 100))
        metrics = Metrics()
        settings = kw.pop("settings", UpstreamSettings())
        forwarder = Forwarder(metrics, settings, loads=LoadBoard(), **kw)
        forwarders.append(forwarder)
        return Rig(forwarder, metrics, origins, targets)

    yield make
    for forwarder in forwarders:
        await forwarder.close()
    for server in servers:
        await server.close()


async def cancelled(origin: Origin) -> None:
    """Wait (bounded) until the origin has seen its request cancelled."""
    async with asyncio.timeout(5):
        await origin.cancel_seen.wait()


async def read_rest(answer: OriginAnswer) -> bytes:
    rest = await answer.content.read()
    return answer.first + rest


# ---------------------------------------------------------------- races


async def test_a_slow_first_origin_loses_to_the_hedge_and_is_cancelled(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=SLOW), Behaviour())
    answer = await rig.forward(hedge=SHORT)
    try:
        assert answer.target.name == "o2"
        assert (answer.hedged, answer.extra_calls, answer.attempt) == (True, 1, 2)
        assert answer.calls == 2
        assert answer.body is not None and b'"o2"' in answer.body
        # The loser has ended before forward returns; the winner counts until released.
        assert rig.outstanding() == [0, 1]
    finally:
        answer.release()
    assert rig.outstanding() == [0, 0]
    await cancelled(rig.origin("o1"))
    assert [rig.hedges(o) for o in ("started", "won", "lost", "refused")] == [1, 1, 0, 0]
    assert rig.attempts("o1", "hedge_cancelled") == 1
    assert rig.attempts("o2", "ok") == 1
    assert rig.attempts("o1", "ok") == 0


async def test_a_hedge_that_loses_still_counts_as_a_call(rigs: RigMaker) -> None:
    # The first origin answers after the hedge was sent and before the hedge does.
    rig = await rigs(Behaviour(delay=0.3), Behaviour(delay=SLOW))
    answer = await rig.forward(hedge=SHORT)
    try:
        assert answer.target.name == "o1"
        assert (answer.hedged, answer.attempt, answer.extra_calls) == (False, 1, 1)
        assert answer.calls == 2  # what the access log and the span report
    finally:
        answer.release()
    await cancelled(rig.origin("o2"))
    assert [rig.hedges(o) for o in ("started", "won", "lost")] == [1, 0, 1]


async def test_a_stream_whose_first_chunk_is_late_loses_to_the_hedge(rigs: RigMaker) -> None:
    # Headers come at once; only the first chunk is slow, so the loser is
    # cancelled while the proxy reads its body.
    rig = await rigs(Behaviour(stream=True, first_delay=SLOW), Behaviour(stream=True))
    answer = await rig.forward(hedge=SHORT, stream=True)
    try:
        assert answer.streamed
        assert (answer.target.name, answer.hedged, answer.extra_calls) == ("o2", True, 1)
        assert b'"o2"' in await read_rest(answer)
    finally:
        answer.release()
    assert rig.outstanding() == [0, 0]
    await cancelled(rig.origin("o1"))
    assert rig.attempts("o1", "hedge_cancelled") == 1
    assert rig.attempts("o2", "ok") == 0  # a stream is "ok" once relayed to its end


async def test_the_hedged_origin_sees_its_request_aborted(rigs: RigMaker) -> None:
    # The origin simulator: generation holds a slot (vllm:num_requests_running)
    # until the first token; the aborted request gives it back.
    slow = TestServer(sim_app(SimConfig(name="slow", ttft_ms=60_000)))
    fast = TestServer(sim_app(SimConfig(name="fast", answer_tokens=3)))
    for server in (slow, fast):
        await server.start_server()
    targets = [
        Target("slow", "r1", str(slow.make_url("/v1")), 100),
        Target("fast", "r1", str(fast.make_url("/v1")), 100),
    ]
    rig = await rigs()
    body = (
        b'{"model": "sim-small", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    )
    try:
        headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
        answer = await rig.forwarder.forward(
            "/chat/completions", body, headers, targets, hedge=SHORT, stream=True
        )
        try:
            assert (answer.target.name, answer.hedged) == ("fast", True)
            assert b"[DONE]" in await read_rest(answer)
        finally:
            answer.release()
        state = slow.app[SIM_STATE]
        assert state.stats.requests == 1
        registry = state.metrics.registry
        labels = {"model_name": "sim-small"}
        # Left alone it would run for a minute: dropping to 0 is the abort.
        async with asyncio.timeout(5):
            while registry.get_sample_value("vllm:num_requests_running", labels):
                await asyncio.sleep(0.01)
        assert [rig.forwarder.loads.outstanding(t.name) for t in targets] == [0, 0]
    finally:
        await slow.close()
        await fast.close()


async def test_a_fast_first_origin_sends_no_hedge(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(), Behaviour())
    answer = await rig.forward(hedge=SLOW)
    answer.release()
    assert (answer.target.name, answer.hedged, answer.extra_calls) == ("o1", False, 0)
    assert rig.origin("o2").started == 0
    assert rig.hedges("started") == 0
    assert rig.outstanding() == [0, 0]


async def test_the_first_origin_answering_first_cancels_the_hedge(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=0.2), Behaviour(delay=SLOW))
    answer = await rig.forward(hedge=SHORT)
    answer.release()
    assert (answer.target.name, answer.hedged, answer.extra_calls) == ("o1", False, 1)
    await cancelled(rig.origin("o2"))
    assert [rig.hedges(o) for o in ("started", "won", "lost")] == [1, 0, 1]
    assert rig.attempts("o2", "hedge_cancelled") == 1
    assert rig.outstanding() == [0, 0]


async def test_a_failing_hedge_leaves_the_first_attempt_running(rigs: RigMaker) -> None:
    # The first attempt's 1 s leaves the hedge's 503 time to arrive before it
    # on a loaded machine (at 0.2 s, the first answered first once in CI).
    rig = await rigs(Behaviour(delay=1.0), Behaviour(status=503), Behaviour())
    answer = await rig.forward(hedge=SHORT)
    answer.release()
    assert (answer.target.name, answer.hedged, answer.extra_calls) == ("o1", False, 0)
    assert rig.origin("o3").started == 0
    assert rig.attempts("o2", "http_5xx") == 1
    assert rig.outstanding() == [0, 0, 0]


async def test_a_redirecting_origin_is_refused_and_the_next_one_answers(
    rigs: RigMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # A redirect is a misconfigured base URL, never the client's answer: followed,
    # a 301 or 302 would drop the prompt, and its Location names an origin.
    moved = "https://o1.example/v1/chat/completions"
    rig = await rigs(Behaviour(status=307, location=moved), Behaviour())
    answer = await rig.forward()
    answer.release()
    assert (answer.target.name, answer.status) == ("o2", 200)
    assert rig.attempts("o1", "http_3xx") == 1
    assert moved in caplog.text and "base URL" in caplog.text

    alone = await rigs(Behaviour(status=301, location=moved))
    with pytest.raises(ApiError) as refused:
        await alone.forward()
    assert refused.value.status == 502
    assert alone.outstanding() == [0]


async def test_an_origin_without_its_credential_is_logged_with_what_is_missing(
    rigs: RigMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # The operator's line names the variable (never a value); the client's
    # message names neither.
    rig = await rigs(Behaviour(), Behaviour())
    first = dataclasses.replace(
        rig.targets[0],
        credential=OriginCredentials("o1", credential_env="O1_KEY", environ={}),
    )
    answer = await rig.forward(targets=[first, rig.targets[1]])
    answer.release()
    assert answer.target.name == "o2"
    assert rig.attempts("o1", "credential_error") == 1
    assert "O1_KEY" in caplog.text

    with pytest.raises(ApiError) as refused:
        await rig.forward(targets=[first])
    assert "O1_KEY" not in refused.value.message


async def test_failed_attempts_are_logged_at_most_at_the_line_budgets_rate(
    rigs: RigMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # An origin refusing every request at full load: a line per request would
    # flood the log; the metrics still count every failure.
    now = [0.0]
    budget = LineBudget(per_second=1, burst=2, clock=lambda: now[0])
    never = OutlierDetector(consecutive=100)  # o1 stays in the rotation
    rig = await rigs(Behaviour(status=500), Behaviour(), lines=budget, outliers=never)
    for _ in range(5):
        (await rig.forward()).release()
    assert rig.attempts("o1", "http_5xx") == 5
    assert len([r for r in caplog.records if "before origin o2 answered" in r.getMessage()]) == 2
    now[0] = 1.0
    caplog.clear()
    (await rig.forward()).release()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.endswith("(3 more such lines not logged)")


NGINX = ("text/html", b"<html>Welcome to nginx!</html>")


@pytest.mark.parametrize(
    "raw",
    [
        NGINX,
        ("application/json", b'{"id": "x", "choices": ['),
        ("", b""),
        ("application/json", b"null"),
        ("application/json", b'["<html>"]'),
    ],
    ids=["html", "json-cut-short", "empty", "null", "array"],
)
async def test_a_200_that_is_not_json_is_a_failed_attempt_and_the_next_origin_answers(
    rigs: RigMaker, caplog: pytest.LogCaptureFixture, raw: tuple[str, bytes]
) -> None:
    # A wrong port or base URL lands on a web server's page: never the client's answer.
    rig = await rigs(Behaviour(raw=raw), Behaviour())
    answer = await rig.forward()
    answer.release()
    assert answer.body is not None
    assert (answer.target.name, answer.status) == ("o2", 200)
    assert answer.parsed == json.loads(answer.body)  # parsed once, for the pipeline
    assert answer.parsed["origin"] == "o2"
    assert rig.attempts("o1", "bad_answer") == 1
    assert "o1: answered 200 with a body that is not a JSON object" in caplog.text

    alone = await rigs(Behaviour(raw=NGINX))
    with pytest.raises(ApiError) as refused:
        await alone.forward()
    assert refused.value.status == 502


async def test_a_large_answer_is_checked_by_its_shape_and_parsed_after_sending(
    rigs: RigMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forwarder_module, "PARSE_BEFORE_SENDING_MAX", 16)
    big = b'{"data": [' + b"0.1," * 10 + b"0.1]}"
    page = ("text/html", b"<html>" + b" " * 20 + b"</html>")  # past the limit: by its shape
    rig = await rigs(Behaviour(raw=page), Behaviour())
    rig.origins[1].behaviour.raw = ("application/json", big)
    answer = await rig.forward()
    answer.release()
    assert (answer.target.name, answer.body) == ("o2", big)
    assert answer.parsed is jsonio.NOT_PARSED  # the pipeline parses it once it is sent
    assert rig.attempts("o1", "bad_answer") == 1


async def test_any_2xx_but_204_must_be_a_json_object(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(status=201, raw=NGINX), Behaviour())
    answer = await rig.forward()
    answer.release()
    assert answer.target.name == "o2"
    assert rig.attempts("o1", "bad_answer") == 1


async def test_json_under_another_content_type_is_still_an_answer(rigs: RigMaker) -> None:
    raw = b'{"ok": true, "choices": [{"message": {"content": "hi"}}]}'
    rig = await rigs(Behaviour(raw=("text/plain; charset=utf-8", raw)))
    answer = await rig.forward()
    answer.release()
    assert (answer.status, answer.parsed) == (200, json.loads(raw))
    assert rig.attempts("o1", "bad_answer") == 0


async def test_a_failing_first_attempt_leaves_the_hedge_running(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=0.1, status=502), Behaviour(delay=0.2), Behaviour())
    answer = await rig.forward(hedge=SHORT)
    answer.release()
    assert (answer.target.name, answer.hedged, answer.extra_calls) == ("o2", True, 0)
    assert rig.origin("o3").started == 0
    assert rig.attempts("o1", "http_5xx") == 1
    assert rig.hedges("won") == 1
    assert rig.outstanding() == [0, 0, 0]


async def test_when_both_fail_the_next_candidate_answers(rigs: RigMaker) -> None:
    budget = RetryBudget()
    rig = await rigs(
        Behaviour(delay=0.1, status=503), Behaviour(status=500), Behaviour(), budget=budget
    )
    answer = await rig.forward(hedge=SHORT)
    answer.release()
    assert (answer.target.name, answer.attempt, answer.hedged) == ("o3", 3, False)
    assert rig.attempts("o1", "http_5xx") == rig.attempts("o2", "http_5xx") == 1
    assert [rig.hedges(o) for o in ("started", "won", "lost")] == [1, 0, 0]
    assert rig.outstanding() == [0, 0, 0]


async def test_the_hedge_is_one_of_max_attempts(rigs: RigMaker) -> None:
    settings = UpstreamSettings(max_attempts=2)
    rig = await rigs(
        Behaviour(delay=0.1, status=503), Behaviour(status=500), Behaviour(), settings=settings
    )
    with pytest.raises(ApiError) as err:
        await rig.forward(hedge=SHORT)
    assert err.value.status == 502
    assert rig.origin("o3").started == 0
    assert rig.outstanding() == [0, 0, 0]


async def test_a_first_attempt_that_fails_before_the_delay_is_retried_without_a_hedge(
    rigs: RigMaker,
) -> None:
    rig = await rigs(Behaviour(status=503), Behaviour())
    answer = await rig.forward(hedge=SLOW)
    answer.release()
    assert (answer.target.name, answer.hedged) == ("o2", False)
    assert rig.hedges("started") == 0
    assert rig.outstanding() == [0, 0]


async def test_a_4xx_commits_and_ends_the_race(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=0.1, status=400), Behaviour(delay=SLOW))
    answer = await rig.forward(hedge=SHORT)
    answer.release()
    assert (answer.target.name, answer.status, answer.extra_calls) == ("o1", 400, 1)
    await cancelled(rig.origin("o2"))
    assert rig.outstanding() == [0, 0]


async def test_the_deadline_ends_both_attempts(rigs: RigMaker) -> None:
    settings = UpstreamSettings(deadline=0.2)
    rig = await rigs(Behaviour(delay=SLOW), Behaviour(delay=SLOW), Behaviour(), settings=settings)
    with pytest.raises(ApiError) as err:
        await rig.forward(hedge=SHORT)
    assert err.value.status == 504
    await cancelled(rig.origin("o1"))
    await cancelled(rig.origin("o2"))
    assert rig.attempts("o1", "deadline") == rig.attempts("o2", "deadline") == 1
    assert rig.attempts("o1", "hedge_cancelled") == 0
    assert rig.origin("o3").started == 0
    assert rig.outstanding() == [0, 0, 0]


async def test_without_a_hedge_the_deadline_ends_the_attempt_and_the_failover(
    rigs: RigMaker,
) -> None:
    settings = UpstreamSettings(deadline=0.2)
    rig = await rigs(Behaviour(delay=SLOW), Behaviour(), settings=settings)
    with pytest.raises(ApiError) as err:
        await rig.forward()
    assert err.value.status == 504
    await cancelled(rig.origin("o1"))
    assert rig.attempts("o1", "deadline") == 1
    assert rig.origin("o2").started == 0  # no time was left for it
    assert rig.outstanding() == [0, 0]


async def test_many_calls_each_end_at_their_own_deadline_or_answer(rigs: RigMaker) -> None:
    # Calls in flight together share the forwarder's deadline timer: the slow
    # ones time out, the quick ones answer, whatever order they end in.
    rig = await rigs(Behaviour(delay=SLOW), Behaviour(), settings=UpstreamSettings(deadline=0.3))
    slow, quick = ([t] for t in rig.targets)
    results = await asyncio.gather(
        *(rig.forward(targets=t) for t in (slow, quick, slow, quick)), return_exceptions=True
    )
    assert [getattr(r, "status", None) for r in results] == [504, 200, 504, 200]
    for r in results:
        if isinstance(r, OriginAnswer):
            r.release()
    assert rig.attempts("o1", "deadline") == 2
    assert rig.outstanding() == [0, 0]


async def test_cancelling_forward_cancels_both_attempts(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=SLOW), Behaviour(delay=SLOW))
    task = asyncio.create_task(rig.forward(hedge=SHORT))
    async with asyncio.timeout(5):
        while rig.origin("o2").started == 0:
            await asyncio.sleep(0.005)
    assert rig.outstanding() == [1, 1]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rig.outstanding() == [0, 0]
    await cancelled(rig.origin("o1"))
    await cancelled(rig.origin("o2"))
    assert rig.attempts("o1", "hedge_cancelled") == rig.attempts("o2", "hedge_cancelled") == 0
    # Both were sent (the origins saw them): counted as the request's cancelled calls.
    assert rig.attempts("o1", "cancelled") == rig.attempts("o2", "cancelled") == 1


async def test_cancelling_forward_says_what_was_sent(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=SLOW), Behaviour(delay=SLOW))
    sent = Sent()
    task = asyncio.create_task(rig.forward(hedge=SHORT, sent=sent))
    async with asyncio.timeout(5):
        while rig.origin("o2").started == 0:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent.calls == 2 and sent.target is not None and sent.target.name == "o2"
    assert sent.open == 2  # both under way: each is charged its prompt


async def test_a_failed_call_is_not_under_way_when_forward_is_cancelled(rigs: RigMaker) -> None:
    """The first attempt failed (a 500: no answer is charged for); the
    hedge, under way, is the one call `sent.open` counts."""
    rig = await rigs(Behaviour(delay=0.1, status=500), Behaviour(delay=SLOW))
    sent = Sent()
    task = asyncio.create_task(rig.forward(hedge=SHORT, sent=sent))
    async with asyncio.timeout(5):
        while rig.attempts("o1", "http_5xx") == 0:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (sent.calls, sent.open) == (2, 1)


async def test_one_candidate_means_no_hedge(rigs: RigMaker) -> None:
    rig = await rigs(Behaviour(delay=0.1))
    answer = await rig.forward(hedge=0.0)
    answer.release()
    assert (answer.target.name, answer.hedged) == ("o1", False)
    assert rig.hedges("started") == rig.hedges("refused") == 0


# ---------------------------------------------------------------- budget and auto


async def test_the_budget_refuses_hedges_past_its_share(rigs: RigMaker) -> None:
    # Time stands still: no floor. A burst of one, then one hedge per ten requests.
    budget = RetryBudget(ratio=0.1, floor_per_s=0.0, cap=1.0, clock=lambda: 0.0)
    rig = await rigs(Behaviour(), Behaviour(), hedges=budget)
    for _ in range(31):
        # A delay of 0: every request wants a hedge before its first can commit.
        answer = await rig.forward(hedge=0.0)
        answer.release()
        assert rig.outstanding() == [0, 0]
    assert rig.hedges("started") == 4  # requests 1, 11, 21 and 31
    assert rig.hedges("refused") == 27
    assert rig.hedges("won") + rig.hedges("lost") == 4


async def test_requests_without_hedging_leave_the_hedge_budget_alone(rigs: RigMaker) -> None:
    budget = RetryBudget(ratio=0.1, floor_per_s=0.0, cap=1.0, clock=lambda: 0.0)
    rig = await rigs(Behaviour(), Behaviour(), hedges=budget)
    (await rig.forward(hedge=0.0)).release()  # spends the one token
    for _ in range(20):
        (await rig.forward()).release()
    (await rig.forward(hedge=0.0)).release()
    assert rig.hedges("started") == 1
    assert rig.hedges("refused") == 1


async def test_auto_waits_for_enough_samples_then_hedges_after_the_p95(rigs: RigMaker) -> None:
    now = [0.0]
    times = CommitTimes(min_samples=20, cache_s=1.0, clock=lambda: now[0])
    rig = await rigs(Behaviour(delay=0.1), Behaviour(), commit_times=times)
    # The forwarder takes its own samples: ten fast answers from o1.
    rig.origin("o1").behaviour = Behaviour()
    for _ in range(10):
        (await rig.forward()).release()
    now[0] += 2
    assert rig.forwarder.ttft_p95("o1", stream=False) is None  # 10 < 20
    rig.origin("o1").behaviour = Behaviour(delay=0.1)
    answer = await rig.forward(hedge="auto")
    answer.release()
    assert (answer.target.name, answer.hedged) == ("o1", False)
    assert rig.origin("o2").started == 0

    for _ in range(20):
        times.observe("o1", False, 0.01)
    now[0] += 2
    p95 = rig.forwarder.ttft_p95("o1", stream=False)
    assert p95 is not None and p95 < 0.1
    assert rig.forwarder.ttft_p95("o1") is None  # streams have their own window
    rig.origin("o1").behaviour = Behaviour(delay=SLOW)
    answer = await rig.forward(hedge="auto")
    answer.release()
    assert (answer.target.name, answer.hedged) == ("o2", True)
    await cancelled(rig.origin("o1"))
    assert rig.outstanding() == [0, 0]


class FakeResponse:
    released = False

    def release(self, *, ended: bool = False) -> None:
        self.released = True


async def test_a_loser_that_committed_as_well_is_released(rigs: RigMaker) -> None:
    # Both copies commit in the same turn of the loop: no timing reaches that
    # case reliably, so the race's ending is driven with two finished attempts.
    rig = await rigs()
    loads = rig.forwarder.loads
    a, b = Target("a", "r1", "http://a", 100), Target("b", "r1", "http://b", 100)
    responses = {"a": FakeResponse(), "b": FakeResponse()}

    async def committed(target: Target, attempt: int) -> OriginAnswer:
        loads.started(target.name)
        resp = cast(OriginResponse, responses[target.name])
        return OriginAnswer(target, attempt, 200, CIMultiDict(), b"{}", b"", resp, loads)

    first = asyncio.create_task(committed(a, 1))
    hedge = asyncio.create_task(committed(b, 2))
    await asyncio.wait([first, hedge])
    answer = first.result()
    extra = await rig.forwarder._end_others(
        {first: a, hedge: b}, first, first, answer, False, 0.0, None, 0
    )
    assert extra == 1
    assert responses["b"].released and not responses["a"].released
    assert (loads.outstanding("a"), loads.outstanding("b")) == (1, 0)
    assert rig.attempts("b", "hedge_cancelled") == 1
    answer.release()
    assert loads.outstanding("a") == 0


async def test_a_client_leaving_while_the_losing_copy_ends_counts_both_calls_cancelled(
    rigs: RigMaker,
) -> None:
    """Review 18: cancelled while the race waited for its loser to end, the
    request counted neither call (no `ok` for the winner, no `hedge_cancelled`)."""
    rig = await rigs(Behaviour(), Behaviour())
    first, hedge = rig.targets
    released = []

    class Answer:
        def release(self) -> None:
            released.append(True)

    async def won() -> Answer:
        return Answer()

    async def slow_to_end() -> Answer:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # its connection still closing when the client leaves
            raise
        raise AssertionError("never ends by itself")

    winner = asyncio.create_task(won())
    loser = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    end_others: Any = rig.forwarder._end_others  # given stand-ins for the attempts
    end = asyncio.create_task(
        end_others({loser: first, winner: hedge}, loser, winner, await winner, False, 0.0, None, 0)
    )
    await asyncio.sleep(0.05)  # waiting for the loser to end
    end.cancel()
    with pytest.raises(asyncio.CancelledError):
        await end
    assert released == [True]
    assert rig.attempts(first.name, "cancelled") == rig.attempts(hedge.name, "cancelled") == 1
    assert rig.attempts(first.name, "hedge_cancelled") == 0
    with pytest.raises(asyncio.CancelledError):
        await loser
