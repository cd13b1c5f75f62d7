"""The access log, the bypass reason header and the GenAI metrics, through the
proxy's app and the origin simulator on loopback (tests/functional/test_pipeline.py's
stack), with `--access-log on`: the lines are read from the process's standard
output (pytest's capfd)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from dataplane.http.accesslog import Sampler
from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS
from dataplane.placement.keys import placement_key
from dataplane.upstream.responseids import IdKeys
from ponto.apikeys import issue_key
from ponto.originsim.app import SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_origin_max_tokens_field import UNSUPPORTED
from tests.functional.test_pipeline import (
    COMPLETION,
    ID_KEY,
    KEY,
    LIMITED_KEY,
    STREAM_203,
    Stack,
    chat,
    error_of,
    read_sse,
    stack_on,
    start_stack,
    table,
)
from tests.logcheck import errors


@pytest.fixture
async def logged(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(
        tmp_path, [SimConfig(name="o1", answer_tokens=6, seed=1)], ["--access-log=on"]
    )
    yield s
    await s.close()


def lines(stack: Stack, capfd: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """The access lines written since the last call (flushed now)."""
    stack.app[ACCESS_LOG].flush()
    return [json.loads(line) for line in capfd.readouterr().out.splitlines()]


async def test_an_origins_prefix_cache_reads_are_logged_and_counted_by_origin(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial 33: the origin's usage said how much of each prompt its KV cache
    held, and the proxy dropped it: no line, span or series said which
    replica's cache the routing used."""
    sim = SimConfig(name="o1", answer_tokens=6, seed=1, kv_cache_tokens=4096)
    s = await start_stack(tmp_path, [sim], ["--access-log=on"])
    try:
        system = {"role": "system", "content": "You answer about ships. " * 40}
        bodies = []
        for question in ("Which is fastest?", "Which is oldest?"):
            body = chat(question, temperature=0.7)  # not cacheable: both reach the origin
            body["messages"].insert(0, system)
            resp = await s.post(body)
            assert resp.status == 200
            bodies.append(await resp.json())
        first, second = lines(s, capfd)
        reported = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
        assert reported[0] == 0 < reported[1] < bodies[1]["usage"]["prompt_tokens"]
        assert (first["cached_tokens"], second["cached_tokens"]) == tuple(reported)
        registry = s.app[METRICS].registry
        prompt = registry.get_sample_value("ponto_origin_prompt_tokens_total", {"origin": "o1"})
        cached = registry.get_sample_value(
            "ponto_origin_cached_prompt_tokens_total", {"origin": "o1"}
        )
        assert prompt == sum(b["usage"]["prompt_tokens"] for b in bodies)
        assert cached == reported[1]
    finally:
        await s.close()


async def test_an_answer_without_prefix_cache_figures_counts_none(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    # An origin whose usage says nothing of its cache (vLLM unless asked) is
    # left out of the ratio rather than counted as all misses.
    resp = await logged.post(chat("no details", temperature=0.7))
    assert "prompt_tokens_details" not in (await resp.json())["usage"]
    (line,) = lines(logged, capfd)
    assert line["cached_tokens"] is None and line["input_tokens"] > 0
    registry = logged.app[METRICS].registry
    assert registry.get_sample_value("ponto_origin_prompt_tokens_total", {"origin": "o1"}) is None


async def test_a_miss_then_a_hit_each_get_one_line(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    first = await logged.post(chat("log me"))
    await first.read()
    again = await logged.post(chat("log me"))
    await again.read()
    miss, hit = lines(logged, capfd)
    assert miss["request_id"] == first.headers["x-request-id"]
    assert (miss["method"], miss["path"], miss["endpoint"]) == (
        "POST",
        "/v1/chat/completions",
        "chat.completions",
    )
    assert (miss["tenant"], miss["key_id"], miss["model"]) == ("acme", KEY.key_id, "sim-small")
    assert (miss["origin"], miss["region"], miss["attempts"]) == ("o1", "r1", 1)
    assert (miss["cache"], miss["status"], miss["error"], miss["stream"]) == (
        "miss",
        200,
        None,
        False,
    )
    assert miss["client"] == "127.0.0.1"
    assert miss["output_tokens"] == 6 and miss["input_tokens"] > 0
    assert miss["duration_ms"] > 0 and miss["ttft_ms"] is None
    assert (hit["cache"], hit["cache_kind"], hit["origin"], hit["region"]) == (
        "hit",
        "exact",
        None,
        "r1",
    )
    assert (hit["cache_tier"], miss["cache_tier"]) == ("local", None)
    assert hit["output_tokens"] == 0  # no origin spent any


async def test_a_line_says_what_affinity_placed_the_request_by(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial 60: conversations that started alike shared one placement key
    and one replica, and nothing said so. The line names the key's source
    and hash: alike for two conversations with one start, apart for a
    session id."""
    for headers in ({}, {}, {"x-session-id": "s-1"}):
        answer = await logged.post(chat("Hello", temperature=0.7), headers=headers)
        await answer.read()
    first, second, session = (line["placement"] for line in lines(logged, capfd))
    assert first.startswith("conversation:") and first == second
    assert session.startswith("header:") and session != first
    # A MAC under the fleet's key, not the key's CRC-32, which a search of
    # candidate session ids or `user` values reverses (review of 8a4c023).
    crc = placement_key("chat.completions", {}, {"x-session-id": "s-1"}, "acme")
    assert crc is not None and session != f"header:{crc.value:08x}"
    assert session == f"header:{IdKeys([ID_KEY]).tag(b'placement', crc.value)}"


async def test_a_stream_line_has_its_time_to_first_chunk(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    resp = await logged.post(chat("stream log", stream=True))
    assert (await read_sse(resp))[-1] == "[DONE]"
    [line] = lines(logged, capfd)
    assert line["stream"] is True
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    assert line["output_tokens"] == 6


async def test_a_bypass_says_why_in_headers_and_line_streamed_or_not(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    plain = await logged.post(chat("sampled", temperature=1))
    streamed = await logged.post(chat("sampled", temperature=1, stream=True))
    store = await logged.post(chat("kept out"), headers={"cache-control": "no-store"})
    for resp, reason in ((plain, "nondeterministic"), (streamed, "nondeterministic"),
                         (store, "no-store")):  # fmt: skip
        await resp.read()
        assert resp.headers["x-ponto-cache"] == "bypass"
        assert resp.headers["x-ponto-cache-reason"] == reason
    reasons = [(line["cache"], line["cache_reason"]) for line in lines(logged, capfd)]
    assert reasons == [
        ("bypass", "nondeterministic"),
        ("bypass", "nondeterministic"),
        ("bypass", "no-store"),
    ]
    miss = await logged.post(chat("not bypassed"))
    assert miss.headers["x-ponto-cache"] == "miss"
    assert "x-ponto-cache-reason" not in miss.headers


async def test_a_miss_for_want_of_usage_says_why_in_its_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Only with the origin asked for usage when its client asks: by default
    # every stream is recorded with it.
    logged = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=6, seed=1)],
        ["--access-log=on", "--origin-stream-usage=client"],
    )
    try:
        await (await logged.post(chat("usage later", stream=True))).read()
        asks = chat("usage later", stream=True, stream_options={"include_usage": True})
        await (await logged.post(asks)).read()
        reasons = [(line["cache"], line["cache_reason"]) for line in lines(logged, capfd)]
    finally:
        await logged.close()
    assert reasons == [("miss", None), ("miss", "no-usage")]


async def test_an_error_after_the_cache_step_says_the_bypass_too(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    s = await start_stack(
        tmp_path,
        [SimConfig(name="down", mode="fail", fail_status=500)],
        ["--access-log=on", "--max-attempts=1"],
    )
    try:
        resp = await s.post(chat("nobody", temperature=1))
        assert resp.status == 502
        assert error_of(await resp.json())["code"] == "upstream_unavailable"
        assert resp.headers["x-ponto-cache"] == "bypass"
        assert resp.headers["x-ponto-cache-reason"] == "nondeterministic"
        [line] = lines(s, capfd)
        assert (line["status"], line["error"], line["attempts"], line["origin"]) == (
            502,
            "upstream_unavailable",
            1,
            None,
        )
    finally:
        await s.close()


async def test_a_failover_line_counts_both_attempts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    s = await start_stack(
        tmp_path,
        [
            SimConfig(name="bad", mode="fail", fail_status=503),
            SimConfig(name="good", answer_tokens=3, seed=4),
        ],
        ["--access-log=on"],
    )
    try:
        # The weighted order puts "bad" first about half the time.
        for i in range(40):
            resp = await s.post(chat(f"failover {i}"))
            assert resp.status == 200
            await resp.read()
            if resp.headers["x-ponto-attempts"] == "2":
                break
        logged = lines(s, capfd)
        assert all(line["origin"] == "good" for line in logged)
        last = logged[-1]
        assert (last["attempts"], last["route"]) == (2, "failover")
    finally:
        await s.close()


async def test_refusals_get_one_line_each_with_their_code(
    logged: Stack, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    unauthorized = await logged.post(chat("who"), key="sk-wrong")
    missing = await logged.client.get("/nope")
    wrong_method = await logged.client.get("/v1/chat/completions")
    broken = await logged.client.post(
        "/v1/chat/completions",
        data=b"{not json",
        headers={"authorization": f"Bearer {KEY.key}", "content-type": "application/json"},
    )
    for i in range(3):  # the limited key allows 2 a minute
        await (await logged.post(chat(f"limit {i}"), key=LIMITED_KEY.key)).read()
    expect = await logged.client.post(
        "/v1/chat/completions", json=chat("x"), headers={"expect": "something-else"}
    )
    answers = [unauthorized, missing, wrong_method, broken, expect]
    for resp in answers:
        await resp.read()
        assert resp.headers["x-request-id"]
    got = lines(logged, capfd)
    assert [(line["status"], line["error"]) for line in got] == [
        (401, "invalid_api_key"),
        (404, "not_found"),
        (405, "method_not_allowed"),
        (400, "invalid_json"),
        (200, None),
        (200, None),
        (429, "rate_limit_exceeded"),
        (417, "expectation_failed"),
    ]
    assert [line["request_id"] for line in got[:4] + got[-1:]] == [
        r.headers["x-request-id"] for r in answers
    ]
    assert got[-2]["tenant"] == "acme" and got[-2]["key_id"] == LIMITED_KEY.key_id
    assert got[0]["tenant"] is None  # nobody was authenticated
    # The human log has each refusal once, at INFO, without a traceback (the
    # only WARNING: this stack's control plane is unreachable), and no access line.
    refused = [r for r in caplog.records if r.name == "ponto.refusals"]
    assert len(refused) == 6
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in refused)
    assert not errors(caplog.records, tracebacks=True)
    assert {r.name for r in caplog.records if r.levelno > logging.INFO} <= {"dataplane.sync.link"}
    assert not any(r.getMessage().startswith("{") for r in caplog.records)


async def test_an_unknown_model_is_logged_as_asked(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    body = {**chat("which model"), "model": "no-such-model"}
    resp = await logged.post(body)
    assert resp.status == 404
    await resp.read()
    [line] = lines(logged, capfd)
    assert (line["model"], line["error"]) == ("no-such-model", "model_not_found")


async def test_sampling_writes_a_share_of_answers_and_every_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    s = await start_stack(
        tmp_path,
        [SimConfig(name="down", mode="fail", fail_status=500)],
        ["--access-log=on", "--max-attempts=1"],
    )
    try:
        draws = iter([0.9, 0.1, 0.9])
        s.app[ACCESS_LOG].sampled = Sampler(0.5, rng=lambda: next(draws), probes=True)
        for path in ("/healthz", "/health", "/readyz"):
            await (await s.client.get(path)).read()
        failed = await s.post(chat("nobody answers"))
        assert failed.status == 502
        missing = await s.client.get("/nope")
        for resp in (failed, missing):
            await resp.read()
        got = [(line["path"], line["status"]) for line in lines(s, capfd)]
        # The draws decide the successes; every error is written, without a draw.
        assert got == [("/health", 200), ("/v1/chat/completions", 502), ("/nope", 404)]
    finally:
        await s.close()


@pytest.mark.parametrize("probes", ["off", "on"])
async def test_probes_and_scrapes_are_left_out_unless_asked_for(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], probes: str
) -> None:
    """Trial 33: a kubelet's probes and a scraper's pulls outnumbered a
    quiet fleet's traffic in the access log (--access-log-probes)."""
    s = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=4, seed=1)],
        ["--access-log=on", f"--access-log-probes={probes}"],
    )
    try:
        for path in ("/healthz", "/health", "/readyz", "/metrics"):
            resp = await s.client.get(path)
            assert resp.status == 200
            await resp.read()
        answered = await s.post(chat("hello"))
        assert answered.status == 200
        await answered.read()
        got = [line["path"] for line in lines(s, capfd)]
        probed = ["/healthz", "/health", "/readyz", "/metrics"] if probes == "on" else []
        assert got == [*probed, "/v1/chat/completions"]
    finally:
        await s.close()


async def settled(stack: Stack, status: str) -> None:
    """Wait (bounded) until the proxy has counted an answer with `status`:
    a client's disconnect reaches the handler a few loop turns later."""
    registry = stack.app[METRICS].registry
    labels = {"endpoint": "chat.completions", "code": status}
    for _ in range(500):
        if registry.get_sample_value("ponto_requests_total", labels):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"no {status} answer was counted")


@pytest.mark.parametrize("when", ["before the first chunk", "mid-stream"])
async def test_a_client_that_leaves_gets_a_499_line_and_its_metrics(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], when: str
) -> None:
    # The aiohttp test server, like the proxy's own runner, cancels the
    # handler of a client that disconnects (handler_cancellation).
    first = when == "mid-stream"
    s = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=200, tokens_per_s=20, ttft_ms=0 if first else 30_000)],
        ["--access-log=on"],
    )
    try:
        if first:
            resp = await s.post(chat("leave me", stream=True))
            assert resp.status == 200
            await resp.content.readline()  # the first event has arrived
            resp.close()
        else:
            sent = asyncio.create_task(s.post(chat("leave me", stream=True)))
            for _ in range(500):
                if s.origin_requests():
                    break
                await asyncio.sleep(0.01)
            sent.cancel()
        await settled(s, "499")
        [line] = lines(s, capfd)
        # Sent before the client left, whether or not an answer had started:
        # the call is on its line and counted (trial 7: the origin counted
        # calls the proxy did not).
        assert (line["status"], line["error"], line["origin"], line["attempts"]) == (
            499,
            "client_disconnected",
            "o1",
            1,
        )
        assert line["stream"] is True
        assert line["ttft_ms"] is None if not first else line["ttft_ms"] > 0
        registry = s.app[METRICS].registry
        assert registry.get_sample_value(
            "gen_ai_client_operation_duration_seconds_count",
            {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
             "gen_ai_request_model": "sim-small",
             "error_type": "client_disconnected", "ponto_region": "r1",
             "ponto_cache": "miss"},
        ) == 1  # fmt: skip
        assert registry.get_sample_value("ponto_client_disconnects_total") == 1
        if not first:
            attempts = {"origin": "o1", "outcome": "cancelled"}
            assert registry.get_sample_value("ponto_upstream_attempts_total", attempts) == 1
    finally:
        await s.close()


async def test_a_stream_the_proxy_stops_at_shutdown_is_cancelled_not_a_client_that_left(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # No --drain-seconds: a plain stop. The server waits its shutdown timeout
    # for the stream, then cancels its handler.
    s = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=200, tokens_per_s=20)],
        ["--access-log=on"],
        shutdown_timeout=0.05,
    )
    try:
        resp = await s.post(chat("stop me", stream=True))
        assert resp.status == 200
        await resp.content.readline()  # the first event has arrived
        await s.client.server.close()
        await settled(s, "499")
        [line] = lines(s, capfd)
        assert (line["status"], line["error"], line["origin"]) == (499, "cancelled", "o1")
        registry = s.app[METRICS].registry
        assert registry.get_sample_value(
            "gen_ai_client_operation_duration_seconds_count",
            {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
             "gen_ai_request_model": "sim-small",
             "error_type": "cancelled", "ponto_region": "r1", "ponto_cache": "miss"},
        ) == 1  # fmt: skip
        # No client left: none is counted as one.
        assert registry.get_sample_value("ponto_client_disconnects_total") == 0
    finally:
        await s.close()


async def test_metrics_are_typed_and_the_genai_histograms_are_labelled(
    logged: Stack, capfd: pytest.CaptureFixture[str]
) -> None:
    await (await logged.post(chat("measure me", stream=True))).read()
    await (await logged.post(chat("measure me", stream=True))).read()  # a hit
    await (await logged.post(chat("who"), key="sk-wrong")).read()
    text = await (await logged.client.get("/metrics")).text()
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Without --redis, no regional series (trial 50: the semantic feed's were there).
    regional = ("ponto_semantic_feed", "ponto_cache_region")
    assert not [n for n, f in families.items() if n.startswith(regional) and f.samples]
    for family in families.values():
        if any(s.name.endswith("_total") for s in family.samples):
            assert family.type == "counter", family.name
    for name in ("ponto_cache_evictions", "ponto_cache_expired", "ponto_cache_purged",
                 "ponto_route_table_nacks", "ponto_requests"):  # fmt: skip
        assert families[name].type == "counter"
        assert families[name].samples[0].name == name + "_total"

    def series(name: str, suffix: str) -> list[dict[str, str]]:
        family = families[name]
        assert family.type == "histogram"
        return [s.labels for s in family.samples if s.name == name + suffix]

    duration = series("gen_ai_client_operation_duration_seconds", "_count")
    common = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
              "ponto_region": "r1"}  # fmt: skip
    assert {**common, "gen_ai_request_model": "sim-small", "error_type": "",
            "ponto_cache": "miss"} in duration  # fmt: skip
    assert {**common, "gen_ai_request_model": "sim-small", "error_type": "",
            "ponto_cache": "hit"} in duration  # fmt: skip
    # Refused before the model was read: no model, no cache step.
    assert {**common, "gen_ai_request_model": "", "error_type": "invalid_api_key",
            "ponto_cache": ""} in duration  # fmt: skip
    first = series("gen_ai_client_operation_time_to_first_chunk_seconds", "_count")
    assert {s["ponto_cache"] for s in first} == {"miss", "hit"}
    tokens = series("gen_ai_client_token_usage", "_sum")
    assert {s["gen_ai_token_type"] for s in tokens} == {"input", "output"}
    assert all(s["ponto_region"] == "r1" for s in tokens)
    info = families["ponto_proxy_info"].samples
    assert [(s.labels["proxy"], s.labels["region"], s.value) for s in info] == [
        ("functional", "r1", 1.0)
    ]
    assert logged.app[METRICS].registry.get_sample_value(
        "gen_ai_client_token_usage_sum",
        {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
         "gen_ai_request_model": "sim-small", "gen_ai_token_type": "output",
         "ponto_region": "r1"},
    ) == 6  # fmt: skip  # the hit spent no origin tokens: one answer's 6


async def test_a_follower_of_a_cut_stream_is_logged_as_cut(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    s = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=10, tokens_per_s=20, cut_after_tokens=3)],
        ["--access-log=on"],
    )
    try:
        leader = asyncio.create_task(s.post(chat("cut for both", stream=True)))
        for _ in range(500):  # the leader's call is under way
            if s.origin_requests():
                break
            await asyncio.sleep(0.01)
        follower = await s.post(chat("cut for both", stream=True))
        assert follower.headers["x-ponto-coalesced"] == "1"
        # Its flight was this proxy's: the tier is local (CachePlan.tier).
        assert follower.headers["x-ponto-cache-tier"] == "local"
        assert "upstream_stream_broken" in (await follower.read()).decode()
        await (await leader).read()
        got = {line["cache"]: line for line in lines(s, capfd)}
        assert s.origin_requests() == 1
        assert (got["hit"]["cache_kind"], got["hit"]["cache_tier"]) == ("coalesced", "local")
        assert (got["hit"]["status"], got["hit"]["error"]) == (200, "stream_cut")
        assert got["miss"]["error"] == "stream_cut"
        # The cache's counters say what the log says: a coalesced hit.
        registry = s.app[METRICS].registry
        assert (
            registry.get_sample_value(
                "ponto_cache_requests_total", {"result": "hit", "kind": "coalesced"}
            )
            == 1
        )
        assert registry.get_sample_value("ponto_cache_hits_total", {"tier": "local"}) == 1
    finally:
        await s.close()


async def test_an_expired_keys_refusals_name_its_owner_and_a_wrong_keys_do_not(
    logged: Stack, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Rotation: "who still uses the key we let expire?" is answered by the logs.
    expired = issue_key()
    t = table([("o1", str(logged.origins[0].make_url("/v1")))], version=3)
    t.keys.append(pb.ApiKey(id=expired.key_id, hash=expired.key_hash, tenant="acme", expires_at=1))
    t.etag = content_etag(t)
    assert logged.app[HOLDER].apply(t, "control-plane")
    lines(logged, capfd)
    with caplog.at_level(logging.INFO, logger="ponto.refusals"):
        refused = await logged.post(chat("old key"), key=expired.key)
        wrong = await logged.post(chat("no key of ours"), key=issue_key().key)
    assert refused.status == wrong.status == 401
    assert error_of(await refused.json())["code"] == "expired_api_key"
    assert expired.key_id not in (await refused.text())  # the holder knows its key
    old, unknown = lines(logged, capfd)
    assert (old["tenant"], old["key_id"], old["error"]) == (
        "acme",
        expired.key_id,
        "expired_api_key",
    )
    assert (unknown["tenant"], unknown["key_id"], unknown["error"]) == (
        None,
        None,
        "invalid_api_key",
    )
    assert f"[key {expired.key_id} of tenant acme]" in caplog.text
    text = await (await logged.client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counted = {
        (s.labels["key"], s.labels["code"]): s.value
        for s in families["ponto_tenant_requests"].samples
        if s.name.endswith("_total") and s.labels["tenant"] == "acme"
    }
    assert counted[(expired.key_id, "401")] == 1.0


async def test_a_jwt_its_tenants_config_cannot_check_is_refused_as_that_tenants(
    logged: Stack,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """Trial 48: a tenant whose hs256_secret_file is missing had its callers
    answered 503 auth_unavailable with no refusal line, and access lines
    with tenant null, though the token's issuer names the tenant."""
    issuer = "https://idp.badjwt.example"
    t = table([("o1", str(logged.origins[0].make_url("/v1")))], version=3)
    unusable = pb.JwtIssuer(
        issuer=issuer, algorithms=["HS256"], hs256_secret_file=str(tmp_path / "missing")
    )
    t.tenants.append(pb.Tenant(name="badjwt", jwt=unusable))
    t.etag = content_etag(t)
    assert logged.app[HOLDER].apply(t, "control-plane")
    lines(logged, capfd)
    claims = {"iss": issuer, "sub": "u1", "exp": 4_000_000_000}
    token = jwt.encode(claims, "a-secret-the-proxy-cannot-check-0123456789", algorithm="HS256")
    with caplog.at_level(logging.INFO, logger="ponto.refusals"):
        refused = await logged.post(chat("my tenant's config is broken"), key=token)
        listed = await logged.client.get("/v1/models", headers={"authorization": f"Bearer {token}"})
    assert refused.status == listed.status == 503
    assert error_of(await refused.json())["code"] == "auth_unavailable"
    assert "badjwt" not in await refused.text()  # the client is told nothing more
    got = lines(logged, capfd)
    assert [(line["tenant"], line["key_id"], line["error"]) for line in got] == [
        ("badjwt", None, "auth_unavailable")
    ] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "ponto.refusals"]
    assert len(said) == 2
    assert all("503 auth_unavailable" in m and m.endswith("[tenant badjwt]") for m in said)
    counted = logged.app[METRICS].registry.get_sample_value(
        "ponto_tenant_requests_total", {"tenant": "badjwt", "key": "-", "code": "503"}
    )
    assert counted == 2.0


async def test_an_error_in_a_2xx_body_is_recorded_under_a_name_of_the_proxys(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Review 287: an origin's 200 `{"error": {...}}` judged the request's
    fault reaches the client as a 502 with the origin's own code (up to 256
    characters of anything), and that code was the metrics' error_type and
    the access line's error: label values without bound, spaces in a log
    field. Both now say `upstream_error`; the client's body keeps the code."""
    said = {"error": {"message": "bad input", "type": "invalid_request_error", "code": "code one"}}

    async def origin(request: web.Request) -> web.StreamResponse:
        return web.json_response(said)

    s = await stack_on(tmp_path, origin, args=["--access-log=on"])
    try:
        resp = await s.post(chat("an error in a 200"))
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "code one"
        [line] = lines(s, capfd)
        assert (line["status"], line["error"]) == (502, "upstream_error")
        assert s.app[METRICS].registry.get_sample_value(
            "gen_ai_client_operation_duration_seconds_count",
            {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
             "gen_ai_request_model": "sim-small", "error_type": "upstream_error",
             "ponto_region": "r1", "ponto_cache": "miss"},
        ) == 1  # fmt: skip
    finally:
        await s.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hosted_origins_own_request_id_reaches_the_client_and_the_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], stream: bool
) -> None:
    """Trial 71: a hosted API's `x-request-id` (`req_...`, what its support
    asks for) was replaced by the proxy's and written nowhere. Now the client
    gets it as x-ponto-origin-request-id and the access line as
    origin_request_id; an origin that echoes the proxy's id adds nothing.
    Its error answer has it too (its support asks for it most when it
    refused a request: it had none), names no origin (as every error), and
    its access line's error is the origin's code, where it was the status;
    the GenAI metrics' error type stays the status."""
    # The last as no client's id is taken: with a space.
    answers = iter(["req_hosted_1", "req_hosted_2", None, "two words"])

    async def hosted(request: web.Request) -> web.StreamResponse:
        theirs = next(answers) or request.headers["x-request-id"]  # the last one echoes ours
        if json.loads(await request.read())["messages"][0]["content"] == "refuse me":
            return web.json_response(UNSUPPORTED, status=400, headers={"x-request-id": theirs})
        if not stream:
            return web.json_response(COMPLETION, headers={"x-request-id": theirs})
        out = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-request-id": theirs}
        )
        await out.prepare(request)
        await out.write(STREAM_203)
        await out.write_eof()
        return out

    s = await stack_on(tmp_path, hosted, args=["--access-log=on"])
    try:
        ok = await s.post(chat("whose id", stream=stream, temperature=0.5))
        await ok.read()
        assert ok.headers["x-ponto-origin-request-id"] == "req_hosted_1"
        assert ok.headers["x-request-id"] != "req_hosted_1"  # the proxy's, as ever
        refused = await s.post(chat("refuse me", stream=stream, temperature=0.5))
        assert error_of(await refused.json()) == UNSUPPORTED["error"]
        assert refused.status == 400
        assert refused.headers["x-ponto-origin-request-id"] == "req_hosted_2"
        assert "x-ponto-origin" not in refused.headers  # an error names no origin
        assert "x-ponto-region" not in refused.headers
        assert refused.headers["x-request-id"] != "req_hosted_2"
        echoed = await s.post(chat("echo", stream=stream, temperature=0.5))
        await echoed.read()
        assert "x-ponto-origin-request-id" not in echoed.headers
        spaced = await s.post(chat("spaced", stream=stream, temperature=0.5))
        assert spaced.status == 200 and await spaced.read()
        assert "x-ponto-origin-request-id" not in spaced.headers
        logged = [(line["origin_request_id"], line["error"]) for line in lines(s, capfd)]
        assert logged == [
            ("req_hosted_1", None),
            ("req_hosted_2", "unsupported_parameter"),
            (None, None),
            (None, None),
        ]
        labels = {
            "gen_ai_operation_name": "chat",
            "gen_ai_provider_name": "openai",
            "gen_ai_request_model": "sim-small",
            "ponto_region": "r1",
            "ponto_cache": "bypass",
        }
        registry = s.app[METRICS].registry
        count = "gen_ai_client_operation_duration_seconds_count"
        assert registry.get_sample_value(count, {**labels, "error_type": "400"}) == 1
    finally:
        await s.close()


@pytest.mark.parametrize(
    "value", [b"\x1b[31mred", b"\xff\xfeabc"], ids=["control-character", "not-utf-8"]
)
async def test_an_origin_header_no_client_could_be_sent_is_dropped_not_fatal(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    value: bytes,
) -> None:
    """Review 279: an origin's `x-request-id` (or any header it sends on)
    with a control character reset the client's connection, the proxy
    failing to write the answer's head; one not UTF-8 lost its access line.
    Such a header is dropped: the answer and its line are whole."""
    body = json.dumps(COMPLETION).encode()

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )  # fmt: skip
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"x-request-id: " + value + b"\r\nx-other: " + value + b"\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(raw, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    s = await start_stack(tmp_path, [], ["--access-log=on"])
    s.app[HOLDER].apply(table([("custom", f"http://127.0.0.1:{port}/v1")], version=3), "cp")
    try:
        resp = await s.post(chat("raw", temperature=0.5))
        assert resp.status == 200
        assert (await resp.json())["choices"]
        assert "x-other" not in resp.headers and "x-ponto-origin-request-id" not in resp.headers
        [line] = lines(s, capfd)
        assert line["origin_request_id"] is None and line["status"] == 200
        assert errors(caplog.records, tracebacks=True) == []
    finally:
        await s.close()
        server.close()
        await server.wait_closed()


STORED = {
    "id": "resp_far1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "sim-small",
    "output": [],
    "previous_response_id": None,
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
}


async def test_a_stored_responses_routes_log_the_origin_that_answered(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial 71: GET /v1/responses/{id} at a proxy of another region than the
    storing origin answered with `x-ponto-origin`, but its line said origin
    null, attempts 0 and the proxy's region (the stored routes make no
    Exchange), and the origin's own x-request-id was the answer's. Now a
    stored route's line names the origin, its region, its request id and the
    calls, as a proxied request's does (the proxy's own error: none; calls
    made); the answer's x-request-id is the proxy's, the origin's is
    x-ponto-origin-request-id, on the origin's error answer too (which, as
    every error, names no origin)."""
    theirs = (f"req_far_{n}" for n in range(1, 100))
    arrived, release = asyncio.Event(), asyncio.Event()

    def answer(body: Any, status: int = 200) -> web.Response:
        return web.json_response(body, status=status, headers={"x-request-id": next(theirs)})

    async def create(request: web.Request) -> web.StreamResponse:
        return answer(STORED)

    async def retrieve(request: web.Request) -> web.StreamResponse:
        if request.query.get("stream") != "true":
            return answer(STORED)
        out = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-request-id": next(theirs)}
        )
        await out.prepare(request)
        for n, kind in enumerate(("response.created", "response.completed")):
            event = {"type": kind, "sequence_number": n, "response": STORED}
            await out.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
        await out.write_eof()
        return out

    async def delete(request: web.Request) -> web.StreamResponse:
        return answer({"id": STORED["id"], "object": "response.deleted", "deleted": True})

    async def cancel(request: web.Request) -> web.StreamResponse:
        error = {"message": "Cannot cancel a synchronous response.", "param": None, "code": None}
        return answer({"error": {**error, "type": "invalid_request_error"}}, 400)

    async def input_items(request: web.Request) -> web.StreamResponse:
        if request.query.get("hang") == "1":  # until its client has left
            arrived.set()
            await release.wait()
        return answer({"error": {"message": "down"}}, 500)

    far_app = web.Application()
    far_app.router.add_post("/v1/responses", create)
    far_app.router.add_get("/v1/responses/{id}", retrieve)
    far_app.router.add_delete("/v1/responses/{id}", delete)
    far_app.router.add_post("/v1/responses/{id}/cancel", cancel)
    far_app.router.add_get("/v1/responses/{id}/input_items", input_items)
    far = TestServer(far_app)
    await far.start_server()
    s = await start_stack(tmp_path, [], ["--access-log=on"])
    s.others.append(far)
    t = table([("far", str(far.make_url("/v1")))], version=3)
    t.regions.add(name="r2", latitude=40.0, longitude=100.0)
    t.origins[0].region = "r2"  # the proxy's is r1
    t.etag = content_etag(t)
    s.app[HOLDER].apply(t, "control-plane")
    auth = {"authorization": f"Bearer {KEY.key}"}
    try:
        made = await s.client.post(
            "/v1/responses", json={"model": "sim-small", "input": "x"}, headers=auth
        )
        assert made.status == 200, await made.text()
        one = f"/v1/responses/{(await made.json())['id']}"
        calls = [
            ("GET", one, 200),
            ("GET", one + "?stream=true", 200),
            ("DELETE", one, 200),
            ("POST", one + "/cancel", 400),
            ("GET", one + "/input_items", 502),
        ]
        for n, (method, path, status) in enumerate(calls, start=2):
            mine = {**auth, "x-request-id": f"mine-{n}"}
            resp = await s.client.request(method, path, headers=mine)
            await resp.read()
            assert resp.status == status, (path, await resp.text())
            assert resp.headers["x-ponto-attempts"] == "1"
            assert resp.headers["x-request-id"] == f"mine-{n}", path  # not the origin's
            if status < 400:  # the origin's answer names it
                assert resp.headers["x-ponto-origin"] == "far", path
                assert resp.headers["x-ponto-region"] == "r2", path
            else:  # an error names no origin (issue 15's allowlist)
                assert "x-ponto-origin" not in resp.headers, path
                assert "x-ponto-region" not in resp.headers, path
            if status < 500:  # the origin's answer, error or not
                assert resp.headers["x-ponto-origin-request-id"] == f"req_far_{n}", path
            else:  # the proxy's own error has no origin's id
                assert "x-ponto-origin-request-id" not in resp.headers, path
        leaving = asyncio.create_task(s.client.get(one + "/input_items?hang=1", headers=auth))
        await arrived.wait()
        leaving.cancel()
        registry = s.app[METRICS].registry
        for _ in range(500):  # its handler is cancelled a few loop turns later
            labels = {"endpoint": "responses.input_items", "code": "499"}
            if registry.get_sample_value("ponto_requests_total", labels):
                break
            await asyncio.sleep(0.01)
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        logged = [
            (line["endpoint"], line["status"], line["origin"], line["region"],
             line["origin_request_id"], line["attempts"], line["error"])
            for line in lines(s, capfd)
        ]  # fmt: skip
        assert logged == [
            ("responses", 200, "far", "r2", "req_far_1", 1, None),
            ("responses.retrieve", 200, "far", "r2", "req_far_2", 1, None),
            ("responses.retrieve", 200, "far", "r2", "req_far_3", 1, None),
            ("responses.delete", 200, "far", "r2", "req_far_4", 1, None),
            # The origin's own error answer: its origin, id and error (its
            # type: it gave no code), as a proxied one's.
            ("responses.cancel", 400, "far", "r2", "req_far_5", 1, "invalid_request_error"),
            # No answer (a 5xx is the fixed 502): the call made, no origin.
            ("responses.input_items", 502, None, "r1", None, 1, "upstream_unavailable"),
            # Its client left once the call was sent (a 499): the call, its origin.
            ("responses.input_items", 499, "far", "r2", None, 1, "client_disconnected"),
        ]
    finally:
        release.set()
        await s.close()
