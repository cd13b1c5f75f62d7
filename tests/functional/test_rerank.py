"""POST /v1/rerank through the whole proxy (real HTTP on loopback) in front of
origin simulators: proxied as embeddings are (authenticated, limited by an
estimate settled from the origin's usage, kept in the exact cache and
coalesced, failed over, routed by model), and refused at the edge, with no
origin called, when it is no request vLLM would rank."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dataplane.http.state import HOLDER, METRICS
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.originsim.synth import relevance
from ponto.routetable import content_etag
from tests.functional.test_pipeline import (
    KEY,
    LIMITED_KEY,
    MODEL,
    Stack,
    error_of,
    start_stack,
    table,
)
from tests.logcheck import errors

REFUSALS = "ponto.refusals"
AUTH = {"authorization": f"Bearer {KEY.key}"}
DOCUMENTS = ["Paris is the capital of France", "horses eat hay", "capital of France"]
RERANK: dict[str, Any] = {"model": MODEL, "query": "capital of France", "documents": DOCUMENTS}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1")], ["--forward-headers=x-sim-delay-ms"])
    yield s
    await s.close()


async def rerank(s: Stack, body: Any, key: str = KEY.key, **headers: str) -> Any:
    return await s.client.post(
        "/v1/rerank", json=body, headers={"authorization": f"Bearer {key}", **headers}
    )


def tokens(s: Stack, kind: str) -> float:
    value = s.app[METRICS].registry.get_sample_value(
        "ponto_tenant_tokens_total", {"tenant": "acme", "key": KEY.key_id, "kind": kind}
    )
    return value or 0.0


async def test_a_ranking_is_relayed_counted_from_its_usage_and_kept(stack: Stack) -> None:
    first = await rerank(stack, RERANK)
    assert first.status == 200, await first.text()
    assert first.headers["x-ponto-cache"] == "miss"
    assert first.headers["x-ponto-origin"] == "o1"
    body = await first.json()
    scores = [relevance(MODEL, RERANK["query"], d) for d in DOCUMENTS]
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -scores[i])
    assert body["results"][0]["document"] == {"text": DOCUMENTS[2]}
    # vLLM's usage, only total_tokens, is every token prompt (the simulator's
    # words: the query's 3 with each of 3 documents, and the documents' 12).
    assert body["usage"] == {"total_tokens": 21}
    assert (tokens(stack, "prompt"), tokens(stack, "completion")) == (21, 0)

    again = await rerank(stack, RERANK)
    assert again.headers["x-ponto-cache"] == "hit"
    assert await again.json() == body
    assert stack.origin_requests() == 1
    assert tokens(stack, "prompt") == 21  # a hit spends nothing
    # Another top_n is another answer.
    other = await rerank(stack, {**RERANK, "top_n": 1})
    assert other.headers["x-ponto-cache"] == "miss"
    assert [r["index"] for r in (await other.json())["results"]] == [body["results"][0]["index"]]
    assert stack.origin_requests() == 2


@pytest.mark.parametrize("top_n", [0, -1])
async def test_a_top_n_below_one_is_every_document_left_out_for_the_origin(
    stack: Stack, top_n: int
) -> None:
    # vLLM's default top_n, 0, ranks every document, and so does any below 1;
    # llama.cpp ranks none for 0: the proxy leaves it out, and keys the
    # request as one without it.
    first = await rerank(stack, {**RERANK, "top_n": top_n})
    assert first.status == 200, await first.text()
    assert len((await first.json())["results"]) == len(DOCUMENTS)
    sent = stack.origins[0].app[SIM_STATE].stats.last_request
    assert sent is not None and isinstance(sent["body"], dict)
    assert "top_n" not in sent["body"]
    again = await rerank(stack, RERANK)
    assert again.headers["x-ponto-cache"] == "hit"
    assert stack.origin_requests() == 1


async def test_identical_rankings_in_flight_make_one_origin_call(stack: Stack) -> None:
    answers = await asyncio.gather(
        *(rerank(stack, RERANK, **{"x-sim-delay-ms": "200"}) for _ in range(3))
    )
    assert [a.status for a in answers] == [200] * 3
    assert sorted(a.headers["x-ponto-cache"] for a in answers) == ["hit", "hit", "miss"]
    assert len({await a.read() for a in answers}) == 1
    assert stack.origin_requests() == 1


async def test_a_failing_origin_is_failed_over(tmp_path: Path) -> None:
    s = await start_stack(
        tmp_path, [SimConfig(name="down", mode="fail", fail_status=503), SimConfig(name="up")]
    )
    try:
        attempts = set()
        # Ties for the least loaded origin go either way: until one went to
        # the failing origin first (each query its own cache entry).
        for i in range(64):
            resp = await rerank(s, {**RERANK, "query": f"q{i}"})
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-ponto-origin"] == "up"
            assert (await resp.json())["results"]
            attempts.add(resp.headers["x-ponto-attempts"])
            if "2" in attempts:
                break
        assert "2" in attempts
    finally:
        await s.close()


async def test_a_model_no_origin_serves_is_refused_at_the_edge(stack: Stack) -> None:
    resp = await rerank(stack, {**RERANK, "model": "bge-reranker-v2-m3"})
    assert resp.status == 404
    assert error_of(await resp.json())["code"] == "model_not_found"
    assert stack.origin_requests() == 0


async def test_a_caller_without_a_key_is_refused(stack: Stack) -> None:
    resp = await stack.client.post("/v1/rerank", json=RERANK)
    assert resp.status == 401
    error_of(await resp.json())
    assert stack.origin_requests() == 0


async def test_a_batch_past_a_whole_limit_is_told_to_rank_fewer_documents(stack: Stack) -> None:
    t = table([("o1", str(stack.origins[0].make_url("/v1")))], version=4)
    t.keys[1].limits.tpm = 100
    t.etag = content_etag(t)
    stack.app[HOLDER].apply(t, "control-plane")
    body = {**RERANK, "documents": ["word " * 100] * 3}
    resp = await rerank(stack, body, key=LIMITED_KEY.key)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert err["code"] == "tokens_over_limit"
    assert "Rank its 3 documents in smaller batches" in err["message"]
    assert stack.origin_requests() == 0


BAD = [
    ({"model": MODEL, "documents": DOCUMENTS}, "query", "missing_required_parameter"),
    ({**RERANK, "query": ""}, "query", "empty_string"),
    ({**RERANK, "query": {"text": "q"}}, "query", "invalid_type"),
    ({**RERANK, "documents": []}, "documents", "empty_array"),
    ({**RERANK, "documents": [{"text": "Paris"}]}, "documents[0]", "invalid_type"),
    ({**RERANK, "top_n": "3"}, "top_n", "invalid_type"),
    ({**RERANK, "return_documents": "no"}, "return_documents", "invalid_type"),
    ({**RERANK, "stream": True}, "stream", "invalid_value"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD)
async def test_a_bad_request_is_a_400_that_reaches_no_origin_logged_once(
    stack: Stack, caplog: pytest.LogCaptureFixture, body: dict[str, Any], param: str, code: str
) -> None:
    caplog.set_level(logging.INFO, logger=REFUSALS)
    resp = await rerank(stack, body)
    assert resp.status == 400
    err = error_of(await resp.json())
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert stack.origins[0].app[SIM_STATE].stats.last_request is None
    assert not errors(caplog.records, tracebacks=True)
    [line] = [r for r in caplog.records if r.name == REFUSALS]
    assert "POST /v1/rerank" in line.getMessage() and line.exc_info is None
