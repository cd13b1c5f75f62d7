"""Rerank's pure parts: its estimate, its usage, what makes an answer of it,
its cache entry and decision, and the simulator's ranking."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dataplane import jsonio
from dataplane.assemble import PromptRules, assemble
from dataplane.cache.entry import ResponseKind, from_completion, to_sse_chunks
from dataplane.cache.keys import RERANK, cache_key
from dataplane.cache.policy import CACHEABLE, RequestCacheControl, TenantCachePolicy, decide
from dataplane.http.pipeline import refusal
from dataplane.placement.picker import LEAST_LOADED, RoutingRules
from dataplane.ratelimit import RateLimiter, ScopeLimits, Share
from dataplane.ratelimit.tokens import completion_bound, estimate_prompt_tokens
from dataplane.streaming.usage import INVALID, Usage, rerank_usage_of
from dataplane.upstream.forwarder import _answer_object, _Retryable
from ponto.originsim import SimConfig, build_app
from ponto.originsim.synth import relevance

BODY: dict[str, Any] = {
    "model": "m",
    "query": "q" * 8,
    "documents": ["a" * 40, "b" * 20],
}
ANSWER: dict[str, Any] = {
    "id": "rerank-1",
    "model": "m",
    "usage": {"total_tokens": 21},
    "results": [
        {"index": 0, "document": {"text": "a" * 40}, "relevance_score": 0.9},
        {"index": 1, "document": {"text": "b" * 20}, "relevance_score": 0.1},
    ],
}


# ---------------------------------------------------------------- the estimate


def test_the_estimate_counts_the_query_once_per_document() -> None:
    # (2 * 8 + 40 + 20) characters, 4 a token: a cross-encoder reads the query
    # beside each document, and vLLM's usage counts every pair.
    assert estimate_prompt_tokens("rerank", BODY) == 19
    assert estimate_prompt_tokens("rerank", {**BODY, "documents": ["a" * 40]}) == 12


def test_a_malformed_body_estimates_what_it_can_without_raising() -> None:
    assert estimate_prompt_tokens("rerank", {"query": "q" * 8}) == 0
    assert estimate_prompt_tokens("rerank", {"documents": ["a" * 8, {"text": "x"}]}) == 2


def test_a_ranking_has_no_completion_nor_a_token_ceiling_added() -> None:
    assert completion_bound("rerank", {**BODY, "max_tokens": 100}) == 0
    body = dict(BODY)
    assert not assemble("rerank", body, PromptRules(max_tokens_ceiling=512))
    assert body == BODY


def test_rerank_is_placed_on_the_least_loaded_origin_by_default() -> None:
    assert RoutingRules().mode_for("rerank", "m") == LEAST_LOADED


def test_a_batch_too_large_for_any_wait_is_told_to_rank_fewer_documents() -> None:
    limiter = RateLimiter()
    limiter.configure({"t": ScopeLimits(tpm=10)}, 0.0)
    limiter.apply_shares({"t": Share(1.0)}, 0.0)
    refused = limiter.admit(["t"], 19, 60.0)
    assert refused.too_large
    error = refusal(refused, 2, "documents")
    assert error.status == 400 and error.code == "tokens_over_limit"
    assert "Rank its 2 documents in smaller batches" in error.message
    assert "the query counted once per document" in error.message


# ---------------------------------------------------------------- its usage


@pytest.mark.parametrize(
    ("usage", "read"),
    [
        # vLLM's and Jina's: every token is the prompt's.
        ({"total_tokens": 21}, Usage(21, 0, exact=True)),
        # llama.cpp's names the prompt as chat does.
        ({"prompt_tokens": 20, "total_tokens": 20}, Usage(20, 0, exact=True)),
        ({"total_tokens": -5}, Usage(rejected=INVALID)),
        ({"total_tokens": "21"}, Usage(rejected=INVALID)),
        ({}, None),
        (None, None),
    ],
)
def test_a_rankings_usage_is_its_total_tokens_as_prompt(usage: object, read: Usage | None) -> None:
    assert rerank_usage_of({**ANSWER, "usage": usage}) == read


# ---------------------------------------------------------------- what is an answer


def test_a_ranking_is_an_answer_of_rerank() -> None:
    assert _answer_object(jsonio.dumps(ANSWER), 200, "application/json", "/rerank") == ANSWER


@pytest.mark.parametrize(
    ("body", "why"),
    [
        # Another endpoint's answer from an origin that took the path for it.
        ({"object": "list", "data": [{"embedding": [0.1]}]}, "no results list"),
        ({"id": "c", "object": "chat.completion", "choices": []}, "no results list"),
        ({**ANSWER, "results": []}, "no results"),
        ({**ANSWER, "results": [1]}, "a result that is no object"),
        ({**ANSWER, "results": [{"relevance_score": 0.5}]}, "a result with no index"),
        ({**ANSWER, "results": [{"index": "0", "relevance_score": 0.5}]}, "no index"),
        ({**ANSWER, "results": [{"index": 0, "relevance_score": "high"}]}, "no relevance"),
    ],
)
def test_a_body_without_a_ranking_is_no_answer(body: dict[str, Any], why: str) -> None:
    with pytest.raises(_Retryable) as failed:
        _answer_object(jsonio.dumps(body), 200, "application/json", "/rerank")
    assert failed.value.outcome == "bad_answer" and why in str(failed.value)


@pytest.mark.parametrize(
    ("results", "why"),
    [
        # A client picks documents[index]: a ranking of other documents is
        # no answer of this request's (nor kept for its key).
        (ANSWER["results"] * 2, "4 results for 2 documents"),
        ([{"index": 2, "relevance_score": 0.5}], "a result for document 2 of 2"),
        ([{"index": 1, "relevance_score": 0.5}] * 2, "document 1 ranked twice"),
    ],
)
def test_a_ranking_of_other_documents_than_the_requests_is_no_answer(
    results: list[Any], why: str
) -> None:
    body = jsonio.dumps({**ANSWER, "results": results})
    with pytest.raises(_Retryable) as failed:
        _answer_object(body, 200, "application/json", "/rerank", 2)
    assert why in str(failed.value)
    if "of 2" in why:  # not counted: no index is past the documents
        assert _answer_object(body, 200, "application/json", "/rerank")


def test_top_n_of_the_documents_is_an_answer() -> None:
    body = {**ANSWER, "results": ANSWER["results"][1:]}
    assert _answer_object(jsonio.dumps(body), 200, "application/json", "/rerank", 2) == body


def test_a_2xx_error_beside_results_is_an_answer() -> None:
    body = {**ANSWER, "error": {"message": "partial"}}
    assert _answer_object(jsonio.dumps(body), 200, "application/json", "/rerank") == body


# ---------------------------------------------------------------- the cache


def test_a_ranking_is_kept_whole_and_has_no_streamed_form() -> None:
    raw = jsonio.dumps(ANSWER)
    entry = from_completion(raw, now=1.0)
    assert entry is not None
    assert (entry.kind, entry.body, entry.model) == (ResponseKind.RERANK, raw, "m")
    with pytest.raises(ValueError, match="rerank"):
        to_sse_chunks(entry, include_usage=False)


def test_rerank_is_cached_exactly_whatever_the_tenants_mode() -> None:
    semantic = TenantCachePolicy(mode="semantic")  # type: ignore[arg-type]
    for policy in (TenantCachePolicy(), semantic):
        assert decide(policy, RERANK, BODY, RequestCacheControl()) is CACHEABLE


def test_the_key_holds_every_field_that_changes_the_ranking() -> None:
    def key(body: dict[str, Any]) -> str:
        return cache_key(RERANK, body, tenant="t", model="m")

    base = key(BODY)
    assert key({**BODY, "user": "u"}) == base
    for changed in (
        {"top_n": 1},
        {"return_documents": False},
        {"query": "q" * 8 + " "},  # the exact text is scored
        {"documents": ["b" * 20, "a" * 40]},  # indexes name positions
    ):
        assert key({**BODY, **changed}) != base, changed


# ---------------------------------------------------------------- the simulator


@pytest.fixture
async def sim() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    client = TestClient(TestServer(build_app(SimConfig(name="sim-a", region="eu-west"))))
    await client.start_server()
    yield client
    await client.close()


async def test_the_simulator_ranks_as_vllm_answers(
    sim: TestClient[web.Request, web.Application],
) -> None:
    docs = ["the capital of France is Paris", "horses eat hay", "capital of France?"]
    query = "capital of France?"
    body = {"model": "sim-small", "query": query, "documents": docs}
    resp = await sim.post("/v1/rerank", data=orjson.dumps(body))
    assert resp.status == 200
    answer = await resp.json()
    assert answer["id"].startswith("rerank-") and answer["model"] == "sim-small"
    # The query's 3 words with each of 3 documents, and the documents' 12.
    assert answer["usage"] == {"total_tokens": 9 + 12}
    scores = [relevance("sim-small", query, d) for d in docs]
    order = sorted(range(3), key=lambda i: -scores[i])
    assert [r["index"] for r in answer["results"]] == order
    assert order[0] == 2 and scores[2] == pytest.approx(1.0)  # the same text
    for result in answer["results"]:
        assert result["relevance_score"] == scores[result["index"]]
        assert 0.0 <= result["relevance_score"] <= 1.0
        assert result["document"] == {"text": docs[result["index"]]}
    again = await (await sim.post("/v1/rerank", data=orjson.dumps(body))).json()
    assert again["results"] == answer["results"]  # deterministic

    top = {**body, "top_n": 1, "return_documents": False}
    answer = await (await sim.post("/v1/rerank", data=orjson.dumps(top))).json()
    assert answer["results"] == [{"index": 2, "relevance_score": scores[2]}]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim-small", "documents": ["a"]},
        {"model": "sim-small", "query": "q", "documents": [{"text": "a"}]},
        {"model": "sim-small", "query": "q", "documents": ["a"], "top_n": "1"},
    ],
)
async def test_the_simulator_refuses_what_vllm_refuses(
    sim: TestClient[web.Request, web.Application], body: dict[str, Any]
) -> None:
    resp = await sim.post("/v1/rerank", data=orjson.dumps(body))
    assert resp.status == 400
    assert (await resp.json())["error"]["message"]
