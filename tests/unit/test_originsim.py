"""Tests of the OpenAI-compatible origin simulator (ponto.originsim)."""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ponto.originsim import SIM_STATE, SimConfig, build_app
from ponto.originsim import app as originsim_app
from ponto.originsim.__main__ import main

SimClient = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[SimClient]]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Start simulators with SimConfig overrides; all are closed at teardown."""
    clients: list[SimClient] = []

    async def make(**overrides: Any) -> SimClient:
        config = SimConfig(name="sim-a", region="eu-west", **overrides)
        client = TestClient(TestServer(build_app(config)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: MakeClient) -> SimClient:
    return await make_client()


def chat_body(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-small", "messages": [{"role": "user", "content": text}], **extra}


async def post_json(client: SimClient, path: str, body: object, **kwargs: Any) -> Any:
    resp = await client.post(path, data=orjson.dumps(body), **kwargs)
    assert resp.status == 200, await resp.text()
    return orjson.loads(await resp.read())


def sse_payloads(raw: bytes) -> list[bytes]:
    """Split an event stream into its data payloads, checking the framing."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events]


async def metric_value(client: SimClient, line_prefix: str) -> float:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in metrics:\n{text}")


async def wait_for_metric(client: SimClient, line_prefix: str, expected: float) -> None:
    for _ in range(200):
        if await metric_value(client, line_prefix) == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{line_prefix} never reached {expected}")


async def test_chat_completion_shape_and_usage(client: SimClient) -> None:
    body = {
        "model": "sim-small",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there world"}]},
        ],
    }
    resp = await client.post(CHAT, data=orjson.dumps(body))
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert resp.headers["x-sim-origin"] == "sim-a"
    assert resp.headers["x-sim-region"] == "eu-west"
    data = orjson.loads(await resp.read())

    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["id"].startswith("chatcmpl-")
    assert data["object"] == "chat.completion"
    assert isinstance(data["created"], int)
    assert data["model"] == "sim-small"
    [choice] = data["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    assert len(choice["message"]["content"].split()) == 16
    # 2 + 3 words, plus 3 per message.
    assert data["usage"] == {"prompt_tokens": 11, "completion_tokens": 16, "total_tokens": 27}


async def test_answers_are_deterministic(client: SimClient) -> None:
    first = await post_json(client, CHAT, chat_body())
    second = await post_json(client, CHAT, chat_body())
    assert first["id"] != second["id"]
    assert first["choices"] == second["choices"]

    other_prompt = await post_json(client, CHAT, chat_body("something else"))
    other_model = await post_json(client, CHAT, {**chat_body(), "model": "sim-large"})
    content = first["choices"][0]["message"]["content"]
    assert other_prompt["choices"][0]["message"]["content"] != content
    assert other_model["choices"][0]["message"]["content"] != content


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_token_budget_gives_length_and_prefix(client: SimClient, key: str) -> None:
    full = await post_json(client, CHAT, chat_body())
    short = await post_json(client, CHAT, {**chat_body(), key: 4})
    [choice] = short["choices"]
    assert choice["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] == 4
    words = choice["message"]["content"].split()
    assert words == full["choices"][0]["message"]["content"].split()[:4]


async def test_natural_answer_length_stops_before_a_larger_budget(
    make_client: MakeClient,
) -> None:
    client = await make_client(answer_tokens=6)
    roomy = await post_json(client, CHAT, chat_body(max_tokens=100))
    assert roomy["choices"][0]["finish_reason"] == "stop"
    assert roomy["usage"]["completion_tokens"] == 6
    tight = await post_json(client, CHAT, chat_body(max_tokens=3))
    assert tight["choices"][0]["finish_reason"] == "length"
    assert tight["usage"]["completion_tokens"] == 3
    resp = await client.post("/sim/config", data=orjson.dumps({"answer_tokens": 9}))
    assert (await resp.json())["answer_tokens"] == 9
    again = await post_json(client, CHAT, chat_body(max_tokens=100))
    assert again["usage"]["completion_tokens"] == 9


async def test_completions_shape(client: SimClient) -> None:
    data = await post_json(
        client, COMPLETIONS, {"model": "sim-large", "prompt": "one two three", "max_tokens": 5}
    )
    assert data["id"].startswith("cmpl-")
    assert data["object"] == "text_completion"
    [choice] = data["choices"]
    assert set(choice) == {"text", "index", "finish_reason", "logprobs"}
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_a_null_include_usage_is_not_set(client: SimClient) -> None:
    """As OpenAI's API and vLLM read it; the proxy passes it on (trial 21:
    the simulator answered 400 "must be a boolean")."""
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": None})
    resp = await client.post(CHAT, data=orjson.dumps(body))
    assert resp.status == 200
    chunks = [orjson.loads(p) for p in sse_payloads(await resp.read())[:-1]]
    assert not any(c.get("usage") for c in chunks)


async def test_stream_chunks_usage_and_done(client: SimClient) -> None:
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    resp = await client.post(CHAT, data=orjson.dumps(body))
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    assert resp.headers["x-sim-origin"] == "sim-a"
    payloads = sse_payloads(await resp.read())

    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 5 + 2  # one per token, the finish chunk, the usage chunk
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:5])
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:5])

    finish = chunks[5]["choices"][0]
    assert finish["delta"] == {}
    assert finish["finish_reason"] == "length"

    usage_chunk = chunks[6]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert all(c["usage"] is None for c in chunks[:6])

    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:5])
    full = await post_json(client, CHAT, chat_body(max_tokens=5))
    assert streamed == full["choices"][0]["message"]["content"]


async def test_stream_without_usage_and_completions_stream(client: SimClient) -> None:
    resp = await client.post(CHAT, data=orjson.dumps(chat_body(stream=True)))
    payloads = sse_payloads(await resp.read())
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 16 + 1
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    body = {"model": "sim-small", "prompt": "x", "max_tokens": 3, "stream": True}
    resp = await client.post(COMPLETIONS, data=orjson.dumps(body))
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert chunks[-1]["choices"][0] == {
        "text": "",
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
    }


async def test_embeddings_shape(client: SimClient) -> None:
    data = await post_json(client, EMBEDDINGS, {"model": "sim-small", "input": ["a b", "c"]})
    assert data["object"] == "list"
    assert data["model"] == "sim-small"
    assert data["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert [d["index"] for d in data["data"]] == [0, 1]
    for item in data["data"]:
        assert item["object"] == "embedding"
        vector = item["embedding"]
        assert len(vector) == 8
        assert all(isinstance(v, float) for v in vector)
        assert math.isclose(math.sqrt(sum(v * v for v in vector)), 1.0)
    assert data["data"][0]["embedding"] != data["data"][1]["embedding"]

    single = await post_json(client, EMBEDDINGS, {"model": "sim-small", "input": "a b"})
    assert single["data"][0]["embedding"] == data["data"][0]["embedding"]

    # The openai client asks for base64 by default.
    packed = await post_json(
        client, EMBEDDINGS, {"model": "sim-small", "input": "a b", "encoding_format": "base64"}
    )
    decoded = struct.unpack("<8f", base64.b64decode(packed["data"][0]["embedding"]))
    assert decoded == pytest.approx(single["data"][0]["embedding"], rel=1e-6)


async def test_embeddings_take_dimensions_as_openai_shortens_them(client: SimClient) -> None:
    """Trial 79: `dimensions` was ignored (8 numbers whatever was asked), so
    no test through the simulator could tell a request for 4 from one for 8."""
    full = await post_json(client, EMBEDDINGS, {"model": "sim-small", "input": "a b"})
    whole = full["data"][0]["embedding"]
    for dims in (1, 4, 8):
        body = {"model": "sim-small", "input": ["a b", "c"], "dimensions": dims}
        data = await post_json(client, EMBEDDINGS, body)
        for item in data["data"]:
            assert len(item["embedding"]) == dims
            assert math.isclose(math.sqrt(sum(v * v for v in item["embedding"])), 1.0)
        # The whole vector's first numbers, normalised again.
        norm = math.sqrt(sum(v * v for v in whole[:dims]))
        assert data["data"][0]["embedding"] == pytest.approx([v / norm for v in whole[:dims]])
    packed = await post_json(
        client,
        EMBEDDINGS,
        {"model": "sim-small", "input": "a b", "encoding_format": "base64", "dimensions": 3},
    )
    assert len(base64.b64decode(packed["data"][0]["embedding"])) == 3 * 4


@pytest.mark.parametrize("dims", [0, 9, 4.0, True, "4"])
async def test_embeddings_refuse_dimensions_the_model_has_not(
    client: SimClient, dims: object
) -> None:
    body = {"model": "sim-small", "input": "a b", "dimensions": dims}
    resp = await client.post(EMBEDDINGS, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["param"], error["code"]) == ("dimensions", "invalid_value")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
        (COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}),
        (EMBEDDINGS, {"model": "gpt-9", "input": "hi"}),
    ],
)
async def test_unknown_model_is_404(client: SimClient, path: str, body: object) -> None:
    resp = await client.post(path, data=orjson.dumps(body))
    assert resp.status == 404
    error = orjson.loads(await resp.read())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    assert error["code"] == "model_not_found"
    assert "gpt-9" in error["message"]


async def test_malformed_json_is_400(client: SimClient) -> None:
    resp = await client.post(CHAT, data=b'{"model": "sim-small", "messages": [')
    assert resp.status == 400
    assert resp.headers["x-sim-origin"] == "sim-a"
    error = orjson.loads(await resp.read())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"

    resp = await client.post(CHAT, data=orjson.dumps({"model": "sim-small", "messages": []}))
    assert resp.status == 400
    assert orjson.loads(await resp.read())["error"]["param"] == "messages"


async def test_x_sim_fail_header(client: SimClient) -> None:
    resp = await client.post(CHAT, data=orjson.dumps(chat_body()), headers={"x-sim-fail": "429"})
    assert resp.status == 429
    assert resp.headers["x-sim-region"] == "eu-west"
    error = orjson.loads(await resp.read())["error"]
    assert error["type"] == "rate_limit_error"

    resp = await client.get("/v1/models", headers={"x-sim-fail": "503"})
    assert resp.status == 503
    assert orjson.loads(await resp.read())["error"]["type"] == "server_error"

    resp = await client.post(CHAT, data=orjson.dumps(chat_body()), headers={"x-sim-fail": "ok"})
    assert resp.status == 400
    assert orjson.loads(await resp.read())["error"]["param"] == "x-sim-fail"


async def test_x_sim_drop_closes_without_response(
    client: SimClient, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post(CHAT, data=orjson.dumps(chat_body()), headers={"x-sim-drop": "before"})
    # The origin itself is unharmed.
    assert (await client.get("/health")).status == 200
    dropped = 'ponto_sim_requests_total{endpoint="/v1/chat/completions",status="dropped"}'
    assert await metric_value(client, dropped) == 1.0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_x_sim_cut_after_truncates_stream(
    client: SimClient, caplog: pytest.LogCaptureFixture
) -> None:
    resp = await client.post(
        CHAT, data=orjson.dumps(chat_body(stream=True)), headers={"x-sim-cut-after": "3"}
    )
    assert resp.status == 200
    events: list[bytes] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line.strip())
    assert len(events) == 3
    assert b"data: [DONE]" not in events
    assert (await client.get("/health")).status == 200
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_x_sim_delay_ms(client: SimClient) -> None:
    started = time.monotonic()
    resp = await client.get("/v1/models", headers={"x-sim-delay-ms": "150"})
    assert resp.status == 200
    assert time.monotonic() - started >= 0.15


async def test_models_and_health(client: SimClient) -> None:
    data = await (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["sim-small", "sim-large"]
    assert all(m["object"] == "model" for m in data["data"])

    resp = await client.get("/health")
    assert resp.status == 200
    assert orjson.loads(await resp.read()) == {"status": "ok"}
    assert resp.headers["x-sim-origin"] == "sim-a"


async def test_metrics_exposes_vllm_gauges_and_counters(client: SimClient) -> None:
    await post_json(client, CHAT, chat_body())
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.content_type == "text/plain"
    text = await resp.text()
    assert 'vllm:num_requests_running{model_name="sim-small"} 0.0' in text
    assert 'vllm:num_requests_waiting{model_name="sim-large"} 0.0' in text
    assert 'ponto_sim_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text


async def test_gauges_track_running_and_waiting(make_client: MakeClient) -> None:
    # The first stream runs 2 s: the second waits that long, time enough to
    # see it on a busy machine (at 0.5 s it could end unseen).
    client = await make_client(tokens_per_s=5, max_concurrency=1)
    body = orjson.dumps(chat_body(max_tokens=10, stream=True))
    first = await client.post(CHAT, data=body)
    assert first.status == 200
    second = asyncio.create_task(client.post(CHAT, data=body))
    running = 'vllm:num_requests_running{model_name="sim-small"}'
    waiting = 'vllm:num_requests_waiting{model_name="sim-small"}'
    await wait_for_metric(client, waiting, 1.0)
    assert await metric_value(client, running) == 1.0

    assert sse_payloads(await first.read())[-1] == b"[DONE]"
    assert sse_payloads(await (await second).read())[-1] == b"[DONE]"
    assert await metric_value(client, running) == 0.0
    assert await metric_value(client, waiting) == 0.0


async def test_ttft_and_pacing(make_client: MakeClient) -> None:
    client = await make_client(ttft_ms=100, tokens_per_s=50)
    started = time.monotonic()
    await post_json(client, CHAT, chat_body(max_tokens=6))
    # First token at 100 ms, five more 20 ms apart.
    assert time.monotonic() - started >= 0.2


async def test_client_disconnect_mid_stream_is_quiet(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(tokens_per_s=50)
    resp = await client.post(CHAT, data=orjson.dumps(chat_body(max_tokens=1000, stream=True)))
    await resp.content.readline()
    resp.close()
    running = 'vllm:num_requests_running{model_name="sim-small"}'
    await wait_for_metric(client, running, 0.0)
    assert (await client.get("/health")).status == 200
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_stats_record_last_request_and_reset(client: SimClient) -> None:
    await post_json(client, CHAT, chat_body(), headers={"X-Trace": "abc"})
    await client.get("/v1/models")
    await client.post(EMBEDDINGS, data=b"not json")

    stats = await (await client.get("/sim/stats")).json()
    assert stats["requests"] == 3
    assert stats["by_endpoint"] == {CHAT: 1, "/v1/models": 1, EMBEDDINGS: 1}
    assert stats["last_request"]["body"] is None

    await post_json(client, CHAT, chat_body("check headers"), headers={"X-Trace": "abc"})
    last = (await (await client.get("/sim/stats")).json())["last_request"]
    assert last["headers"]["x-trace"] == "abc"
    assert "authorization" not in last["headers"]
    assert last["body"] == chat_body("check headers")

    # Prompt tokens are counted as prefix-cache queries even without a cache.
    assert (await (await client.get("/sim/stats")).json())["prefix_cache_queries_tokens"] == 10
    reset = await (await client.post("/sim/reset")).json()
    assert reset == {
        "requests": 0,
        "by_endpoint": {},
        "last_request": None,
        "prefix_cache_queries_tokens": 0,
        "prefix_cache_hits_tokens": 0,
        "prefill_seconds": 0.0,
    }
    # Control and health traffic is not counted.
    await client.get("/health")
    assert (await (await client.get("/sim/stats")).json())["requests"] == 0


async def test_marks_list_marked_requests_in_order_until_reset(client: SimClient) -> None:
    await post_json(client, CHAT, chat_body(), headers={"x-sim-mark": "m-1"})
    await post_json(client, CHAT, chat_body("unmarked"))
    await client.post(EMBEDDINGS, data=b"not json", headers={"x-sim-mark": "m-2"})
    await client.get("/health", headers={"x-sim-mark": "m-health"})

    assert (await (await client.get("/sim/marks")).json()) == {"marks": ["m-1", "m-2"]}
    await client.post("/sim/reset")
    assert (await (await client.get("/sim/marks")).json()) == {"marks": []}


async def test_mode_fail_via_sim_config(client: SimClient) -> None:
    resp = await client.post("/sim/config", data=orjson.dumps({"mode": "fail", "fail_status": 502}))
    assert resp.status == 200
    knobs = await resp.json()
    assert knobs["mode"] == "fail"
    assert knobs["fail_status"] == 502

    resp = await client.post(CHAT, data=orjson.dumps(chat_body()))
    assert resp.status == 502
    assert orjson.loads(await resp.read())["error"]["code"] == "sim_injected_failure"
    assert (await client.get("/health")).status == 502
    assert (await client.get("/metrics")).status == 200

    await client.post("/sim/config", data=orjson.dumps({"mode": "ok"}))
    await post_json(client, CHAT, chat_body())
    assert (await client.get("/sim/config")).status == 200


async def test_mode_drop_via_sim_config(client: SimClient) -> None:
    await client.post("/sim/config", data=orjson.dumps({"mode": "drop"}))
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post(CHAT, data=orjson.dumps(chat_body()))
    stats = await (await client.get("/sim/stats")).json()
    assert stats["requests"] == 1


@pytest.mark.parametrize(
    "change",
    [{"mode": "sometimes"}, {"fail_rate": 2}, {"fail_status": 200}, {"ttft": 1}, {"ttft_ms": "1"}],
)
async def test_sim_config_rejects_bad_settings(client: SimClient, change: object) -> None:
    resp = await client.post("/sim/config", data=orjson.dumps(change))
    assert resp.status == 400
    assert "error" in orjson.loads(await resp.read())
    assert (await (await client.get("/sim/config")).json())["mode"] == "ok"


async def test_fail_rate_and_runtime_latency(make_client: MakeClient) -> None:
    client = await make_client(fail_rate=1.0, fail_status=500, seed=7)
    resp = await client.post(CHAT, data=orjson.dumps(chat_body()))
    assert resp.status == 500
    # Random failures spare health checks; only the sticky mode affects them.
    assert (await client.get("/health")).status == 200

    await client.post("/sim/config", data=orjson.dumps({"fail_rate": 0, "ttft_ms": 120}))
    started = time.monotonic()
    await post_json(client, CHAT, chat_body())
    assert time.monotonic() - started >= 0.12
    state = client.app[SIM_STATE] if client.app is not None else None
    assert state is not None
    assert state.config.ttft_ms == 120


def test_sim_config_validates() -> None:
    with pytest.raises(ValueError, match="fail_rate"):
        SimConfig(fail_rate=1.5)
    with pytest.raises(ValueError, match="models"):
        SimConfig(models=())


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen", "nohost"],
        ["--listen", "127.0.0.1:70000"],
        ["--fail-rate", "3"],
        ["--models", ","],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_console_script_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("ponto-origin-sim")
    ready = tmp_path / "ready"
    argv = [str(script), "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--name", "proc"]
    replica = {
        "kv_cache_tokens": 4096,
        "kv_block_tokens": 32,
        "prefill_tokens_per_s": 1e6,
        "decode_slowdown": 0.5,
    }
    for key, value in replica.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 15
            while not ready.exists():
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
                assert time.monotonic() < deadline, "simulator never wrote its ready file"
                time.sleep(0.05)
            address = ready.read_text()
            host, _, port = address.rpartition(":")
            assert host == "127.0.0.1"
            assert int(port) > 0

            request = urllib.request.Request(
                f"http://{address}{CHAT}", data=orjson.dumps(chat_body()), method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as resp:
                assert resp.headers["x-sim-origin"] == "proc"
                data = orjson.loads(resp.read())
            assert data["object"] == "chat.completion"
            with urllib.request.urlopen(f"http://{address}/sim/config", timeout=10) as resp:
                knobs = orjson.loads(resp.read())
            assert {key: knobs[key] for key in replica} == replica

            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode() == f"origin-sim proc listening on http://{address}\n"


RESPONSES = "/v1/responses"


async def test_a_response_is_the_answer_to_the_chat_it_stands_for(client: SimClient) -> None:
    body = {"model": "sim-small", "input": "hello there", "instructions": "Be brief."}
    resp = await client.post(RESPONSES, json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["object"] == "response" and data["status"] == "completed"
    assert data["id"].startswith("resp_")
    text = data["output"][0]["content"][0]["text"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    chat = await (await client.post(CHAT, json={"model": "sim-small", "messages": messages})).json()
    assert text == chat["choices"][0]["message"]["content"]
    usage = data["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_a_response_stream_is_named_events_in_sequence(client: SimClient) -> None:
    body = {"model": "sim-small", "input": "stream", "stream": True, "max_output_tokens": 3}
    resp = await client.post(RESPONSES, json=body)
    raw = (await resp.read()).decode()
    frames = [f.split("\n", 1) for f in raw.split("\n\n") if f]
    events = [(head.removeprefix("event: "), orjson.loads(data[6:])) for head, data in frames]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [d["delta"] for name, d in events if name == "response.output_text.delta"]
    assert len(deltas) == 3
    name, last = events[-1]
    assert name == "response.incomplete"  # cut by max_output_tokens
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["content"][0]["text"] == "".join(deltas)
    assert last["response"]["usage"]["output_tokens"] == 3
    assert "[DONE]" not in raw


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim-small"},
        {"model": "sim-small", "input": []},
        {"model": "sim-small", "input": [5]},
        {"model": "sim-small", "input": "x", "instructions": 5},
        {"model": "sim-small", "input": "x", "max_output_tokens": 0},
    ],
)
async def test_a_bad_responses_request_is_400(client: SimClient, body: object) -> None:
    resp = await client.post(RESPONSES, json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"]


async def test_a_follow_up_without_a_store_is_a_404_as_on_vllm(client: SimClient) -> None:
    """A new user's trial: the demo's simulators kept nothing, and a
    follow-up's 200 had silently lost its earlier turns. Without a store no
    previous response is found, as vLLM answers for an id it does not hold."""
    first = await client.post(RESPONSES, json={"model": "sim-small", "input": "My name is Ana."})
    assert first.status == 200
    previous = (await first.json())["id"]
    follow = await client.post(
        RESPONSES,
        json={"model": "sim-small", "input": "What is my name?", "previous_response_id": previous},
    )
    assert follow.status == 404
    assert previous in (await follow.json())["error"]["message"]


async def test_a_held_request_answers_only_once_its_name_is_released(client: SimClient) -> None:
    hold = {"x-sim-hold": "a"}
    held = asyncio.ensure_future(post_json(client, CHAT, chat_body(), headers=hold))
    # Another name's release and other requests leave it held (a loaded
    # machine only makes it more so).
    assert (await (await client.post("/sim/release?name=b")).json()) == {"released": "b"}
    await post_json(client, CHAT, chat_body("not held"))
    done, _ = await asyncio.wait([held], timeout=0.2)
    assert not done
    assert (await (await client.post("/sim/release?name=a")).json()) == {"released": "a"}
    assert (await asyncio.wait_for(held, 10))["object"] == "chat.completion"
    # A release that came first lets a later request through at once.
    await post_json(client, CHAT, chat_body(), headers={"x-sim-hold": "b"})


async def test_a_hold_needs_a_name(client: SimClient) -> None:
    resp = await client.post(CHAT, data=orjson.dumps(chat_body()), headers={"x-sim-hold": " "})
    assert (resp.status, (await resp.json())["error"]["code"]) == (400, "invalid_sim_hold")
    resp = await client.post("/sim/release")
    assert (resp.status, (await resp.json())["error"]["param"]) == (400, "name")


async def test_hold_names_are_bounded(client: SimClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # Kept for good (a release may come first): new ones past the bound are refused.
    monkeypatch.setattr(originsim_app, "HOLD_NAMES_MAX", 2)
    for name in ("a", "b", "a"):
        assert (await client.post(f"/sim/release?name={name}")).status == 200
    resp = await client.post("/sim/release?name=c")
    assert (resp.status, (await resp.json())["error"]["code"]) == (400, "invalid_sim_hold")
    resp = await client.post(CHAT, data=orjson.dumps(chat_body()), headers={"x-sim-hold": "d"})
    assert (resp.status, (await resp.json())["error"]["code"]) == (400, "invalid_sim_hold")
    await post_json(client, CHAT, chat_body(), headers={"x-sim-hold": "b"})
