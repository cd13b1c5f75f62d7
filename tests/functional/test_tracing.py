"""Traces of proxied requests, through the in-process pipeline (real HTTP on
loopback to the origin simulator), exported to the SDK's in-memory exporter.

Each test checks the span tree (names, kinds, parents) and the attributes an
operator reads: the GenAI ones and Ponto's. Tracing off is checked in a
subprocess (no OpenTelemetry module loaded) and by what reaches the origin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from dataplane.http.errors import ApiError
from dataplane.http.state import ACCESS_LOG, METRICS, PIPELINE
from dataplane.telemetry.tracing import Tracing, resource
from dataplane.upstream.forwarder import UpstreamSettings
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.v1 import routing_pb2 as pb
from tests.functional import test_continuation, test_hedging
from tests.functional.test_hedging import SHORT, SLOW, Behaviour, RigMaker
from tests.functional.test_pipeline import (
    KEY,
    MODEL,
    Stack,
    chat,
    read_sse,
    start_stack,
)

# The hedging and continuation tests' fixtures, under names of this module's.
hedge_rigs = test_hedging.rigs
continuing_proxy = test_continuation.proxy

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    yield memory
    memory.shutdown()


async def traced_stack(
    tmp_path: Path,
    exporter: InMemorySpanExporter,
    configs: list[SimConfig] | None = None,
    extra: list[str] | None = None,
) -> Stack:
    stack = await start_stack(
        tmp_path, configs or [SimConfig(name="o1", answer_tokens=6, seed=1)], extra
    )
    stack.app[PIPELINE].tracer = tracing(exporter).tracer
    return stack


def tracing(exporter: InMemorySpanExporter) -> Tracing:
    """A proxy's tracing in region r1, every span exported as it ends."""
    return Tracing(
        resource(proxy="functional", region="r1", version="test"),
        [SimpleSpanProcessor(exporter)],
        "r1",
    )


@pytest.fixture
async def stack(tmp_path: Path, exporter: InMemorySpanExporter) -> AsyncIterator[Stack]:
    s = await traced_stack(tmp_path, exporter)
    yield s
    await s.close()


class Tree:
    """The finished spans of one request, by role."""

    def __init__(self, spans: list[ReadableSpan]) -> None:
        roots = [s for s in spans if s.kind is SpanKind.SERVER]
        assert len(roots) == 1, [s.name for s in spans]
        self.root = roots[0]
        self.spans = spans
        ctx = self.root.get_span_context()
        assert ctx is not None
        self.trace_id = ctx.trace_id
        for span in spans:
            if span is self.root:
                continue
            assert span.parent is not None and span.parent.span_id == ctx.span_id, span.name
            own = span.get_span_context()
            assert own is not None and own.trace_id == ctx.trace_id

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.root.attributes or {})

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name and s is not self.root]

    def one(self, name: str) -> dict[str, Any]:
        found = self.named(name)
        assert len(found) == 1, [s.name for s in self.spans]
        return dict(found[0].attributes or {})

    @property
    def attempts(self) -> list[ReadableSpan]:
        return [s for s in self.spans if s.kind is SpanKind.CLIENT]


def trees(exporter: InMemorySpanExporter) -> list[Tree]:
    """Every request's spans, in the order their request spans ended."""
    spans = list(exporter.get_finished_spans())
    out = []
    for root in (s for s in spans if s.kind is SpanKind.SERVER):
        ctx = root.get_span_context()
        assert ctx is not None
        out.append(Tree([s for s in spans if s.context and s.context.trace_id == ctx.trace_id]))
    return out


def traceparent(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def last_tree(exporter: InMemorySpanExporter) -> Tree:
    return trees(exporter)[-1]


async def test_a_miss_is_a_chat_span_with_its_steps_and_one_origin_call(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    resp = await stack.post(chat("hello there", max_tokens=20, top_p=0.5))
    assert resp.status == 200
    body = await resp.json()
    tree = last_tree(exporter)
    root = tree.root
    assert root.name == f"chat {MODEL}"
    assert root.status.status_code is StatusCode.UNSET
    a = tree.attrs
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == body["model"]
    assert a["gen_ai.request.max_tokens"] == 20
    # Doubles, as the conventions type them, though the JSON wrote 0.
    assert type(a["gen_ai.request.temperature"]) is float and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.request.top_p"] == 0.5
    assert a["gen_ai.response.id"] == body["id"]
    reasons = tuple(c["finish_reason"] for c in body["choices"])
    assert a["gen_ai.response.finish_reasons"] == reasons and len(reasons) == 1
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert "gen_ai.usage.cache_read.input_tokens" not in a
    assert a["http.response.status_code"] == 200
    assert "error.type" not in a
    assert a["ponto.cache"] == "miss"
    assert a["ponto.origin"] == "o1"
    assert a["ponto.region"] == "r1"
    assert a["ponto.attempts"] == 1
    assert a["ponto.tenant"] == "acme"
    assert a["ponto.route"] == resp.headers["x-ponto-route"]
    assert a["ponto.request_id"] == resp.headers["x-request-id"]
    assert tree.one("ponto.cache.lookup")["ponto.cache"] == "miss"
    tree.one("ponto.auth")
    tree.one("ponto.limits")
    [attempt] = tree.attempts
    assert attempt.name == f"chat {MODEL}"
    at = dict(attempt.attributes or {})
    origin_url = stack.origins[0].make_url("/")
    assert at["server.address"] == origin_url.host
    assert at["server.port"] == origin_url.port
    assert at["ponto.origin"] == "o1"
    assert at["ponto.region"] == "r1"
    assert at["ponto.outcome"] == "ok"
    assert at["http.response.status_code"] == 200
    # The origin got the attempt span's own context, nothing else.
    sent = stack.origins[0].app[SIM_STATE].stats.last_request
    assert sent is not None
    headers: Any = sent["headers"]
    ctx = attempt.get_span_context()
    assert ctx is not None
    assert headers["traceparent"] == traceparent(ctx)


async def test_a_cache_hit_names_the_tokens_read_from_the_cache_and_calls_no_origin(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    first = await (await stack.post(chat("twice"))).json()
    resp = await stack.post(chat("twice"))
    assert resp.headers["x-ponto-cache"] == "hit"
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["ponto.cache"] == "hit"
    assert a["gen_ai.usage.cache_read.input_tokens"] == first["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.input_tokens"] == first["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == first["usage"]["completion_tokens"]
    assert a["gen_ai.response.model"] == first["model"]
    assert a["ponto.region"] == "r1"  # the proxy's own: no origin answered
    assert a["ponto.attempts"] == 0
    assert "ponto.origin" not in a
    assert tree.one("ponto.cache.lookup")["ponto.cache"] == "hit"
    assert tree.attempts == []


@pytest.mark.parametrize("usage", ["always", "client"])
async def test_a_streamed_hit_without_usage_reports_the_estimated_prompt_read_from_the_cache(
    tmp_path: Path, exporter: InMemorySpanExporter, usage: str
) -> None:
    # Recorded without stream_options.include_usage: with the origin asked
    # only when its client asks, the cached stream states no usage, so the
    # span carries the admission estimate, marked as one. By default the
    # origin was asked: the span has its counts.
    stack = await traced_stack(tmp_path, exporter, extra=[f"--origin-stream-usage={usage}"])
    try:
        await read_sse(await stack.post(chat("stream twice", stream=True)))
        resp = await stack.post(chat("stream twice", stream=True))
        assert resp.headers["x-ponto-cache"] == "hit"
        await read_sse(resp)
    finally:
        await stack.close()
    a = last_tree(exporter).attrs
    assert a["gen_ai.usage.cache_read.input_tokens"] == a["gen_ai.usage.input_tokens"] > 0
    if usage == "client":
        assert a["ponto.usage.estimated"] is True
        assert "gen_ai.usage.output_tokens" not in a
    else:
        assert "ponto.usage.estimated" not in a
        assert a["gen_ai.usage.output_tokens"] == 6


async def test_a_bypass_says_why(stack: Stack, exporter: InMemorySpanExporter) -> None:
    resp = await stack.post(chat("random please", temperature=0.9))
    assert resp.headers["x-ponto-cache"] == "bypass"
    await resp.read()
    tree = last_tree(exporter)
    assert tree.attrs["ponto.cache"] == "bypass"
    assert tree.attrs["ponto.cache.reason"] == "nondeterministic"
    lookup = tree.one("ponto.cache.lookup")
    assert lookup["ponto.cache.reason"] == "nondeterministic"
    assert len(tree.attempts) == 1


async def test_a_failover_is_two_origin_calls_under_one_request(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    s = await traced_stack(
        tmp_path,
        exporter,
        [
            SimConfig(name="bad", mode="fail", fail_status=503),
            SimConfig(name="good", answer_tokens=3, seed=4),
        ],
    )
    try:
        # The weighted order puts "bad" first about half the time.
        for i in range(30):
            resp = await s.post(chat(f"failover {i}"))
            assert resp.status == 200
            await resp.read()
            if resp.headers["x-ponto-attempts"] == "2":
                break
        else:
            pytest.fail("no request went to the failing origin first")
    finally:
        await s.close()
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["ponto.attempts"] == 2
    assert a["ponto.origin"] == "good"
    assert a["ponto.route"] == "failover"
    assert a["http.response.status_code"] == 200
    first, second = sorted(tree.attempts, key=lambda span: span.start_time or 0)
    fa, sa = dict(first.attributes or {}), dict(second.attributes or {})
    assert (fa["ponto.origin"], fa["ponto.outcome"], fa["error.type"]) == (
        "bad",
        "http_5xx",
        "http_5xx",
    )
    assert fa["http.response.status_code"] == 503  # what the origin answered
    assert first.status.status_code is StatusCode.ERROR
    assert (sa["ponto.origin"], sa["ponto.outcome"]) == ("good", "ok")
    assert (fa["ponto.attempt"], sa["ponto.attempt"]) == (1, 2)


async def test_a_hedge_is_a_second_origin_call_and_the_loser_says_why_it_ended(
    hedge_rigs: RigMaker, exporter: InMemorySpanExporter
) -> None:
    rig = await hedge_rigs(Behaviour(delay=SLOW), Behaviour())
    tracer = tracing(exporter).tracer
    trace = tracer.begin("chat.completions", "POST", "/v1/chat/completions", {}, "id")
    answer = await rig.forward(hedge=SHORT, trace=trace)
    answer.release()
    trace.answered(answer)
    trace.finish(None, 200, None)
    assert answer.calls == 2
    tree = last_tree(exporter)
    assert tree.attrs["ponto.origin"] == "o2"
    outcomes = {
        str((s.attributes or {})["ponto.origin"]): (
            (s.attributes or {})["ponto.outcome"],
            s.status.status_code,
        )
        for s in tree.attempts
    }
    assert outcomes == {
        "o1": ("hedge_cancelled", StatusCode.UNSET),  # not a failure of o1's
        "o2": ("ok", StatusCode.UNSET),
    }


async def test_a_continued_stream_is_one_request_with_a_call_to_each_origin(
    continuing_proxy: Callable[..., Awaitable[test_continuation.Proxy]],
    exporter: InMemorySpanExporter,
) -> None:
    first, second = (
        await test_continuation.first_origin("cut"),
        await test_continuation.second_origin(),
    )
    p = await continuing_proxy([(first, True), (second, True)], pb.StreamPolicy(hedge_ms=0))
    p.app[PIPELINE].tracer = tracing(exporter).tracer
    chunks, _ = await p.stream()
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["ponto.attempts"] == 2
    # The origin that finished the answer, as the access log and the metrics say.
    assert (a["ponto.origin"], a["ponto.region"]) == ("o1", "r1")
    assert a["gen_ai.usage.output_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    calls = sorted(tree.attempts, key=lambda span: span.start_time or 0)
    assert [(s.attributes or {})["ponto.origin"] for s in calls] == ["o0", "o1"]
    assert all((s.attributes or {})["ponto.outcome"] == "ok" for s in calls)


async def test_a_stream_span_lasts_to_the_end_and_counts_its_tokens(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    request = chat("stream me", stream=True, stream_options={"include_usage": True})
    resp = await stack.post(request)
    events = await read_sse(resp)
    usage = json.loads(events[-2])["usage"]
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.response.model"] == json.loads(events[0])["model"]
    assert a["gen_ai.response.id"] == json.loads(events[0])["id"]
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert a["gen_ai.response.finish_reasons"] == tuple(f for f in finishes if f)
    assert len(a["gen_ai.response.finish_reasons"]) == 1
    assert a["ponto.cache"] == "miss"
    [attempt] = tree.attempts
    # The request span covers the whole stream, the attempt only its start.
    assert tree.root.end_time is not None and attempt.end_time is not None
    assert tree.root.end_time >= attempt.end_time


async def test_an_origins_prefix_cache_reads_are_the_spans_cache_read_tokens(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    """The conventions' gen_ai.usage.cache_read.input_tokens: of the input
    tokens, those a provider-managed cache served (here the origin's prefix
    cache, as its usage says; trial 33)."""
    sim = SimConfig(name="o1", answer_tokens=6, seed=1, kv_cache_tokens=4096)
    s = await traced_stack(tmp_path, exporter, [sim])
    try:
        system = {"role": "system", "content": "You answer about ships. " * 40}
        for question in ("Which is fastest?", "Which is oldest?"):
            body = chat(question, temperature=0.7)
            body["messages"].insert(0, system)
            resp = await s.post(body)
            usage = (await resp.json())["usage"]
        a = last_tree(exporter).attrs
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == cached > 0
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > cached
    finally:
        await s.close()


async def test_an_embedding_has_input_tokens_only(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    """The conventions count no output tokens for embeddings: none on the
    span, and no output series in gen_ai_client_token_usage."""
    resp = await stack.client.post(
        "/v1/embeddings",
        json={"model": MODEL, "input": "embed me"},
        headers={"authorization": f"Bearer {KEY.key}"},
    )
    assert resp.status == 200
    body = await resp.json()
    a = last_tree(exporter).attrs
    assert a["gen_ai.operation.name"] == "embeddings"
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert "gen_ai.usage.output_tokens" not in a
    assert "gen_ai.response.id" not in a and "gen_ai.response.finish_reasons" not in a
    registry = stack.app[METRICS].registry
    labels = {"gen_ai_operation_name": "embeddings", "gen_ai_provider_name": "openai",
              "gen_ai_request_model": MODEL, "ponto_region": "r1"}  # fmt: skip
    sample = registry.get_sample_value
    assert sample("gen_ai_client_token_usage_count", {**labels, "gen_ai_token_type": "input"})
    assert (
        sample("gen_ai_client_token_usage_count", {**labels, "gen_ai_token_type": "output"}) is None
    )


async def test_a_refusal_is_a_client_error_with_no_origin_call(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    resp = await stack.post(chat("who am i"), key="sk-wrong")
    assert resp.status == 401
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["http.response.status_code"] == 401
    assert a["error.type"] == (await resp.json())["error"]["code"]
    # A server span's 4xx is the client's error (HTTP semantic conventions).
    assert tree.root.status.status_code is StatusCode.UNSET
    auth = tree.named("ponto.auth")[0]
    assert auth.status.status_code is StatusCode.ERROR
    assert tree.attempts == []
    assert not tree.named("ponto.cache.lookup")
    assert stack.origin_requests() == 0

    missing = await stack.post(chat("who serves this?", model="no-such-model"))
    assert missing.status == 404
    tree = last_tree(exporter)
    # Refused before its model was known (served): the span keeps the route's name.
    assert tree.root.name == "POST /v1/chat/completions"
    assert "gen_ai.request.model" not in tree.attrs
    assert tree.attempts == []


async def test_a_refused_body_gives_the_span_none_of_its_values(
    stack: Stack, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "m" * 100_000
    for body in (
        chat("seed out of range", seed=18446744073709551615),
        chat("too hot", temperature=1e308 * 10, max_tokens=2**70),
        {"model": huge, "messages": "not a list", "seed": 2**64},
    ):
        resp = await stack.post(body)
        assert resp.status == 400
        tree = last_tree(exporter)
        assert tree.root.name == "POST /v1/chat/completions"
        assert not [k for k in tree.attrs if k.startswith("gen_ai.request.")]
    # What an OTLP exporter would send encodes without a complaint.
    encode_spans(list(exporter.get_finished_spans()))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and
                r.name.startswith("opentelemetry")]  # fmt: skip
    assert stack.origin_requests() == 0


async def test_a_cut_stream_names_its_error_on_the_request_span(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    s = await traced_stack(
        tmp_path, exporter, [SimConfig(name="o1", answer_tokens=8, cut_after_tokens=2)]
    )
    try:
        resp = await s.post(chat("cut me", stream=True))
        assert resp.status == 200
        await resp.read()
    finally:
        await s.close()
    tree = last_tree(exporter)
    assert tree.attrs["http.response.status_code"] == 200
    assert tree.attrs["error.type"] == "stream_cut"
    assert tree.root.status.status_code is StatusCode.ERROR


async def test_a_client_that_leaves_mid_stream_ends_its_span_once_with_a_499(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    s = await traced_stack(
        tmp_path, exporter, [SimConfig(name="o1", answer_tokens=200, tokens_per_s=20)]
    )
    try:
        resp = await s.post(chat("leave me", stream=True))
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
        # The disconnect reaches the handler a few turns later; wait for the
        # request's span, not an attempt's (which ended at the origin's head):
        # closing the stack first would cancel the handler as a stop does.
        for _ in range(500):
            if any(s.kind is SpanKind.SERVER for s in exporter.get_finished_spans()):
                break
            await asyncio.sleep(0.01)
    finally:
        await s.close()
    [tree] = trees(exporter)
    a = tree.attrs
    assert (a["http.response.status_code"], a["error.type"]) == (499, "client_disconnected")
    assert (a["ponto.origin"], a["ponto.attempts"]) == ("o1", 1)
    assert tree.root.status.status_code is StatusCode.UNSET  # the client's doing


async def test_a_failed_continuation_call_counts_as_an_attempt(
    continuing_proxy: Callable[..., Awaitable[test_continuation.Proxy]],
    exporter: InMemorySpanExporter,
    capfd: pytest.CaptureFixture[str],
) -> None:
    async def down(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"error": {"message": "down"}}, status=500)

    first = await test_continuation.first_origin("cut")
    p = await continuing_proxy(
        [(first, True), (test_continuation.Origin(down), True)],
        pb.StreamPolicy(hedge_ms=0),
        extra=["--access-log=on"],
    )
    p.app[PIPELINE].tracer = tracing(exporter).tracer
    chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    tree = last_tree(exporter)
    a = tree.attrs
    assert a["ponto.attempts"] == 2  # the first call and the continuation's failed one
    assert (a["ponto.origin"], a["error.type"]) == ("o0", "stream_cut")
    failed = [dict(c.attributes or {}) for c in tree.attempts if c.attributes and
              c.attributes["ponto.origin"] == "o1"]  # fmt: skip
    assert [(f["ponto.outcome"], f["http.response.status_code"]) for f in failed] == [
        ("http_5xx", 500)
    ]
    # The access log counts the same calls.
    p.app[ACCESS_LOG].flush()
    [line] = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert (line["attempts"], line["origin"], line["error"]) == (2, "o0", "stream_cut")


async def test_an_origin_call_past_the_deadline_is_a_timeout(
    hedge_rigs: RigMaker, exporter: InMemorySpanExporter
) -> None:
    rig = await hedge_rigs(Behaviour(delay=SLOW), settings=UpstreamSettings(deadline=0.05))
    trace = tracing(exporter).tracer.begin(
        "chat.completions", "POST", "/v1/chat/completions", {}, "id"
    )
    with pytest.raises(ApiError) as raised:
        await rig.forward(trace=trace)
    assert raised.value.status == 504
    trace.finish(None, 504, "upstream_timeout")
    [call] = last_tree(exporter).attempts
    at = dict(call.attributes or {})
    assert (at["ponto.outcome"], at["error.type"]) == ("timeout", "timeout")


async def test_the_clients_traceparent_is_honoured_and_not_sent_on(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    resp = await stack.post(
        chat("in your trace"),
        headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"},
    )
    assert resp.status == 200
    tree = last_tree(exporter)
    assert f"{tree.trace_id:032x}" == CLIENT_TRACE
    parent = tree.root.parent
    assert parent is not None and parent.is_remote
    assert f"{parent.span_id:016x}" == CLIENT_PARENT
    [attempt] = tree.attempts
    ctx = attempt.get_span_context()
    assert ctx is not None
    sent = stack.origins[0].app[SIM_STATE].stats.last_request
    assert sent is not None
    headers: Any = sent["headers"]
    assert headers["traceparent"] == traceparent(ctx)
    assert traceparent(ctx).startswith(f"00-{CLIENT_TRACE}-")
    assert headers["tracestate"] == "vendor=abc"  # the trace's state, carried on


async def test_a_request_the_sampler_drops_exports_nothing_and_says_so_downstream(
    tmp_path: Path, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    s = await traced_stack(tmp_path, exporter)
    tracer = s.app[PIPELINE].tracer
    assert tracer is not None
    begun: list[str] = []
    begin = tracer.begin

    def counting(*args: Any, **kwargs: Any) -> Any:
        begun.append(args[0])
        return begin(*args, **kwargs)

    monkeypatch.setattr(tracer, "begin", counting)
    try:
        resp = await s.post(chat("not sampled", temperature=0.5))
        assert resp.status == 200
        assert exporter.get_finished_spans() == ()
        assert begun == []  # known unsampled before the SDK is asked: no span at all
        sent = s.origins[0].app[SIM_STATE].stats.last_request
        assert sent is not None
        headers: Any = sent["headers"]
        version, trace_id, _, flags = headers["traceparent"].split("-")
        assert version == "00"
        assert int(flags, 16) & 1 == 0  # not sampled: the origin need not record
        assert int(trace_id, 16) != 0

        # A client's tracestate alone belongs to no trace the origin gets: dropped.
        resp = await s.post(chat("state only", temperature=0.5), headers={"tracestate": "v=1"})
        assert resp.status == 200
        sent = s.origins[0].app[SIM_STATE].stats.last_request
        assert sent is not None
        headers = sent["headers"]
        assert headers["traceparent"].endswith("-00") and "tracestate" not in headers

        # A client's sampled trace is followed (parent-based), whatever the ratio.
        resp = await s.post(chat("sampled"), headers={"traceparent": CLIENT_TRACEPARENT})
        assert resp.status == 200
        assert f"{last_tree(exporter).trace_id:032x}" == CLIENT_TRACE
        assert begun == ["chat.completions"]  # a request with a parent asks the sampler
    finally:
        await s.close()


async def test_off_the_clients_trace_context_reaches_the_origin_unchanged(
    tmp_path: Path,
) -> None:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=2, seed=1)])
    try:
        assert s.app[PIPELINE].tracer is None
        resp = await s.post(
            chat("untraced"),
            headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"},
        )
        assert resp.status == 200
        sent = s.origins[0].app[SIM_STATE].stats.last_request
        assert sent is not None
        headers: Any = sent["headers"]
        assert headers["traceparent"] == CLIENT_TRACEPARENT
        assert headers["tracestate"] == "vendor=abc"
    finally:
        await s.close()


def test_off_the_proxy_loads_no_opentelemetry_code() -> None:
    """Everything a proxy imports to serve, and an app built and started, in a
    fresh interpreter with no OTEL_* variable."""
    code = """
import asyncio, sys, tempfile
import dataplane.run
from dataplane.http.server import build_app
from dataplane.settings import parse
from aiohttp.test_utils import TestServer

async def main():
    with tempfile.TemporaryDirectory() as d:
        app = build_app(parse(["--region=r1", "--control-plane=127.0.0.1:9", f"--state-dir={d}"]))
        server = TestServer(app)
        await server.start_server()
        await server.close()

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


async def test_an_only_if_cached_miss_is_not_a_server_error(
    stack: Stack, exporter: InMemorySpanExporter
) -> None:
    """A 504 not_cached is the client's directive answered: no ERROR status."""
    headers = {"authorization": f"Bearer {KEY.key}", "cache-control": "only-if-cached"}
    resp = await stack.client.post("/v1/chat/completions", json=chat("hi"), headers=headers)
    assert resp.status == 504
    tree = last_tree(exporter)
    assert tree.attrs["error.type"] == "not_cached"
    assert tree.root.status.status_code is StatusCode.UNSET
