"""What billing reads says which figures are the proxy's estimate (billing
trial 76): the access log's `tokens_estimated` and
ponto_tenant_estimated_tokens_total. A hedge that lost is charged the
winner's prompt count when the origin gave one (the same prompt was sent),
not the proxy's estimate of it.

The proxy's app and scripted origins on aiohttp test servers (the stream
tests' fixtures)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dataplane.http.state import ACCESS_LOG, METRICS, PIPELINE
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import Handler, Origin, Proxy, event, proxy, sse
from tests.functional.test_stream_usage import DONE, FRAMES, request
from tests.functional.test_tracing import last_tree, tracing
from tests.functional.test_whole_answers import until

__all__ = ["proxy"]  # fixtures

# The origin's count: far above the proxy's estimate of "count to twelve".
USAGE = {"prompt_tokens": 46, "completion_tokens": 12, "total_tokens": 58}


def streams(usage: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An origin's stream, with its usage chunk before [DONE] when `usage`
    (whatever the request asks), else never (an origin that ignores
    `stream_options`)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        frames = [*FRAMES, *([event("s", usage=USAGE)] if usage else []), DONE]
        await out.write(b"".join(frames))
        await out.write_eof()
        return out

    return answer


async def no_usage(request: web.Request) -> web.StreamResponse:
    """A whole chat answer without `usage`."""
    message = {"role": "assistant", "content": "twelve"}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return web.json_response({"id": "w", "object": "chat.completion", "choices": [choice]})


def first_hangs(answer: Handler) -> Handler:
    """An origin's handler whose first call (hedge or not) waits until the
    proxy ends it, and which answers every other with `answer`."""
    calls = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.Event().wait()
        return await answer(request)

    return handle


async def line_of(p: Proxy, capfd: pytest.CaptureFixture[str], raw: bytes) -> dict[str, Any]:
    """The access line of one stream `raw`, read to its end."""
    capfd.readouterr()
    resp = await p.client.post(
        "/v1/chat/completions", data=raw, headers={"content-type": "application/json"}
    )
    assert resp.status == 200
    await resp.read()
    registry = p.app[METRICS].registry
    labels = {"endpoint": "chat.completions", "code": "200"}
    await until(lambda: bool(registry.get_sample_value("ponto_requests_total", labels)))
    p.app[ACCESS_LOG].flush()
    [line] = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert isinstance(line, dict)
    return line


def accounted(p: Proxy, name: str) -> tuple[float | None, float | None]:
    """The default tenant's prompt and completion tokens in counter `name`."""
    get = p.app[METRICS].registry.get_sample_value
    who = {"tenant": "default", "key": "-"}
    return get(name, {**who, "kind": "prompt"}), get(name, {**who, "kind": "completion"})


@pytest.mark.parametrize("usage", [True, False], ids=["origin-counted", "no-usage"])
async def test_a_streams_line_and_metrics_say_whether_its_tokens_are_estimated(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str], usage: bool
) -> None:
    p = await proxy([(Origin(streams(usage)), True)], extra=["--access-log=on"])
    exporter = InMemorySpanExporter()
    p.app[PIPELINE].tracer = tracing(exporter).tracer
    line = await line_of(p, capfd, request())
    span = last_tree(exporter).attrs
    assert span.get("ponto.usage.estimated", False) is not usage
    tokens = accounted(p, "ponto_tenant_tokens_total")
    estimated = accounted(p, "ponto_tenant_estimated_tokens_total")
    if usage:
        assert (line["input_tokens"], line["output_tokens"]) == (46, 12)
        assert line["tokens_estimated"] is False
        assert estimated == (None, None)
    else:
        # The prompt by its 4-characters estimate, the completion by the
        # events that carried text: the proxy's, and said so.
        assert line["tokens_estimated"] is True
        assert line["input_tokens"] < 46 and line["output_tokens"] == 3
        assert estimated == tokens == (line["input_tokens"], 3)


async def test_a_hedge_that_lost_is_charged_the_winners_prompt(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """Billing trial 76: the loser was charged the prompt's estimate (14)
    though the winner's count (46) of the same prompt was known."""
    # The first call to arrive loses (hedge or not); one handler for both
    # origins, so either may be first.
    hangs_once = first_hangs(streams(True))
    p = await proxy(
        [(Origin(hangs_once), True), (Origin(hangs_once), True)],
        pb.StreamPolicy(hedge_ms=1),  # the hedge goes once the first call is sent
        extra=["--access-log=on"],
    )
    line = await line_of(p, capfd, request())
    assert line["attempts"] == 2  # both sent: one answered, one cancelled
    assert (line["input_tokens"], line["output_tokens"]) == (2 * 46, 12)
    assert line["tokens_estimated"] is False
    assert accounted(p, "ponto_tenant_tokens_total") == (2 * 46, 12)
    assert accounted(p, "ponto_tenant_estimated_tokens_total") == (None, None)


async def test_an_answer_given_back_is_no_estimate(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    async def refuses(request: web.Request) -> web.StreamResponse:
        error = {"message": "too long", "type": "invalid_request_error", "code": None}
        return web.json_response({"error": error}, status=400)

    p = await proxy([(Origin(refuses), True)], extra=["--access-log=on"])
    capfd.readouterr()
    resp = await p.client.post(
        "/v1/chat/completions", data=request(), headers={"content-type": "application/json"}
    )
    assert resp.status == 400
    await resp.read()
    p.app[ACCESS_LOG].flush()
    [line] = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert (line["input_tokens"], line["tokens_estimated"]) == (0, False)


async def test_a_whole_answer_without_usage_is_shown_at_the_estimate_it_is_charged(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """No count: the limits and budgets keep the prompt's estimate
    (Admission.release(None)), and the access line and the metrics show it,
    the proxy's (trial 98: they showed nothing, the budget the estimate)."""
    p = await proxy([(Origin(no_usage), True)], extra=["--access-log=on"])
    raw = request(stream=False)
    line = await line_of(p, capfd, raw)
    estimate = estimate_prompt_tokens("chat.completions", json.loads(raw))
    assert estimate > 0
    assert (line["input_tokens"], line["output_tokens"]) == (estimate, 0)
    assert line["tokens_estimated"] is True
    tokens = accounted(p, "ponto_tenant_tokens_total")
    assert tokens == accounted(p, "ponto_tenant_estimated_tokens_total") == (estimate, None)


async def test_a_whole_answer_without_usage_whose_hedge_lost_is_charged_both_prompts(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """No count of the winner's: each call is charged the prompt's
    estimate, the cancelled hedge's too (it was dropped with the count
    that was not there: one estimate charged for two prompts sent)."""
    hangs_once = first_hangs(no_usage)
    p = await proxy(
        [(Origin(hangs_once), True), (Origin(hangs_once), True)],
        pb.StreamPolicy(hedge_ms=1),
        extra=["--access-log=on"],
    )
    raw = request(stream=False)
    line = await line_of(p, capfd, raw)
    estimate = estimate_prompt_tokens("chat.completions", json.loads(raw))
    assert line["attempts"] == 2
    assert (line["input_tokens"], line["output_tokens"]) == (2 * estimate, 0)
    assert line["tokens_estimated"] is True
    tokens = accounted(p, "ponto_tenant_tokens_total")
    assert tokens == accounted(p, "ponto_tenant_estimated_tokens_total") == (2 * estimate, None)
