"""What an open origin takes passes the proxy: OpenAI's own policy limits
that vLLM does not share (trial 97: more than 128 tools, tool names with
'.', temperature above 2, `n` above 128, metadata of more than 16 keys, a
tool call left unanswered; metadata values other than strings, which
LiteLLM's clients send; values outside OpenAI's sets of settings the proxy
does not read, such as `service_tier`) reach the origin simulator and get
its answer, as they would without the proxy. Their cache keys still tell
them apart (but for metadata, which changes no answer), and a budget
charged for a great many choices still admits. In-process: the proxy's app
before an origin simulator (tests.functional.test_pipeline)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dataplane.http.fields import MAX_INT
from ponto.originsim.app import SimConfig
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_budgets import BUDGETED, with_budget
from tests.functional.test_pipeline import KEY, MODEL, Stack, chat, error_of, start_stack
from tests.logcheck import errors

CHAT = "/v1/chat/completions"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=4, seed=1)])
    yield s
    await s.close()


def tools(count: int, last: str = "github.search_issues") -> list[dict[str, Any]]:
    """`count` function tools, the last named `last` (an MCP server's style)."""
    names = [f"mcp.tool_{i}" for i in range(count - 1)] + [last]
    return [{"type": "function", "function": {"name": name}} for name in names]


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f.g", "arguments": "{}"}},
]}  # fmt: skip
USER = {"role": "user", "content": "and now?"}

# (path, body) of requests OpenAI refuses by its own policy and vLLM answers.
TAKEN = [
    (CHAT, chat("many tools", tools=tools(129))),
    (CHAT, chat("a dotted name", tools=tools(1, "fs.read file"),
                tool_choice={"type": "function", "function": {"name": "fs.read file"}})),
    (CHAT, chat("hot", temperature=2.5)),
    (CHAT, chat("many choices", n=129)),
    (CHAT, chat("tagged", metadata={f"k{i}": "v" * 600 for i in range(17)})),
    # LiteLLM's clients' tags (vLLM ignores metadata; OpenAI takes strings).
    (CHAT, chat("tags", metadata={"tags": ["prod", "team-a"], "trace": {"id": 7}})),
    (CHAT, chat("biased", logit_bias={"1": 150})),
    (CHAT, chat("long ids", user="u" * 2000, prompt_cache_key="p" * 2000)),
    (CHAT, chat("schema", response_format={
        "type": "json_schema", "json_schema": {"name": "out.v2", "schema": {}}})),
    # An agent's history with its call left unanswered, and a tool turn
    # answering no call before it.
    (CHAT, {"model": MODEL, "messages": [USER, CALLED, USER]}),
    (CHAT, {"model": MODEL, "messages": [
        USER, {"role": "tool", "tool_call_id": "call_9", "content": "1"}, USER]}),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": []}, USER]}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3, "n": 200,
                         "best_of": 300}),
    ("/v1/responses", {"model": MODEL, "input": "x", "temperature": 2.5,
                       "tools": [{"type": "function", "name": f"a.b{i}"} for i in range(129)],
                       "metadata": {f"k{i}": "v" for i in range(17)}}),
    ("/v1/responses", {"model": MODEL, "input": "x", "metadata": {"tags": ["a"], "n": 1}}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "metadata": {"tags": ["a"]}}),
    # Values outside OpenAI's sets of settings the proxy does not read.
    (CHAT, chat("tiers", service_tier="gold", reasoning_effort="max", verbosity="terse",
                modalities=["text", "smell"], audio={"voice": "v", "format": "ogg"})),
    ("/v1/responses", {"model": MODEL, "input": "x", "service_tier": "gold",
                       "reasoning": {"effort": "max"}, "text": {"verbosity": "terse"}}),
    ("/v1/embeddings", {"model": MODEL, "input": ["x"] * 2049}),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["x"] * 10_001}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"), TAKEN, ids=[f"{p} {i}" for i, (p, _) in enumerate(TAKEN)]
)
async def test_what_only_openai_refuses_reaches_the_origin_and_gets_its_answer(
    stack: Stack, path: str, body: dict[str, Any]
) -> None:
    headers = {"authorization": f"Bearer {KEY.key}"}
    resp = await stack.client.post(path, json=body, headers=headers)
    answer = await resp.json()
    assert resp.status == 200, answer
    assert resp.headers["x-ponto-origin"] == "o1"
    assert stack.origin_requests() == 1
    assert answer[ANSWERED[path]], answer


# The extremes of what now passes (review 426), each through every step
# that reads the body: validation, the token estimate, placement, the
# exact key (or its bypass), the forward and the relay.
ODD_NAMES = ["a\u0000b", "名前.ツール", "\u202eevil", "🙂" * 40, "x" * 100_000, "", "a\nb"]
EXTREMES = [
    (CHAT, chat("many tools", tools=tools(10_000), stream=True,
                tool_choice={"type": "function", "function": {"name": "github.search_issues"}})),
    (CHAT, chat("odd names", tools=[{"type": "function", "function": {"name": name}}
                                    for name in ODD_NAMES],
                tool_choice={"type": "function", "function": {"name": "a\u0000b"}},
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "\u0000\u202e", "schema": {}}})),
    (CHAT, chat("hottest", temperature=1.7976931348623157e308, stream=True)),
    (CHAT, chat("biased", logit_bias={"1": 1e308, "2": -1e308, "3": 0.5, "00004": -5})),
    (CHAT, chat("all of them", n=MAX_INT, stream=True,
                metadata={f"k{i}": ["v" * 50] for i in range(20_000)})),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": MAX_INT, "best_of": MAX_INT,
                         "stream": True, "temperature": 1e300}),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_tool_calls": -(2**63),
                       "tools": [{"type": "function", "name": f"a\u0000{i}"}
                                 for i in range(10_000)]}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"), EXTREMES, ids=[f"{p} {i}" for i, (p, _) in enumerate(EXTREMES)]
)
async def test_the_extremes_of_what_passes_reach_the_origin_twice_and_log_no_error(
    stack: Stack, path: str, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The second time from the cache where the request is cacheable."""
    headers = {"authorization": f"Bearer {KEY.key}", "content-type": "application/json"}
    raw = orjson.dumps(body)
    for _ in range(2):
        # A stream, not bytes: aiohttp warns of a body past 1 MB as bytes.
        resp = await stack.client.post(path, data=io.BytesIO(raw), headers=headers)
        text = await resp.text()
        assert resp.status == 200, text[:500]
        hit = resp.headers.get("x-ponto-cache") == "hit"
        assert hit or resp.headers["x-ponto-origin"] == "o1", dict(resp.headers)
        # No error object (a Responses answer's is null), not mid-stream either.
        assert '"error":{' not in text.replace(" ", ""), text[:500]
    assert 1 <= stack.origin_requests() <= 2
    assert not errors(caplog.records, tracebacks=True)


# Where each endpoint's answer holds what the origin made.
ANSWERED = {
    CHAT: "choices",
    "/v1/completions": "choices",
    "/v1/responses": "output",
    "/v1/embeddings": "data",
    "/v1/rerank": "results",
}


async def test_the_exact_key_tells_apart_the_tools_past_128_and_their_dotted_names(
    stack: Stack,
) -> None:
    many = chat("which tool?", tools=tools(129))
    first = await stack.post(many)
    assert (first.status, first.headers["x-ponto-cache"]) == (200, "miss")
    again = await stack.post(chat("which tool?", tools=tools(129)))
    assert (again.status, again.headers["x-ponto-cache"]) == (200, "hit")
    # The 129th tool's name alone differs, by its dot.
    other = await stack.post(chat("which tool?", tools=tools(129, "github_search_issues")))
    assert (other.status, other.headers["x-ponto-cache"]) == (200, "miss")
    assert stack.origin_requests() == 2


async def test_metadata_of_any_values_stays_out_of_the_exact_key(stack: Stack) -> None:
    """LiteLLM's `metadata.tags` lists change no answer: a request tagged
    otherwise, or not at all, is answered by the entry of the first."""
    first = await stack.post(chat("tagged", metadata={"tags": ["prod"], "run": 1}))
    assert (first.status, first.headers["x-ponto-cache"]) == (200, "miss")
    for metadata in ({"tags": ["dev", "team-b"], "run": {"id": 2}}, None):
        again = await stack.post(chat("tagged", metadata=metadata))
        assert (again.status, again.headers["x-ponto-cache"]) == (200, "hit")
    assert stack.origin_requests() == 1


async def test_a_budget_charges_a_great_many_choices_its_whole_at_most(stack: Stack) -> None:
    """A budget expects each choice as long as one answer: here far past the
    budget (2**31 - 1 choices of at most 4 tokens). Charged beforehand no more
    than the budget's whole, the request is admitted while none of it is
    spent, settled by its answer, and once some is spent refused as too
    large for what is left (429), as any request expecting more is."""
    with_budget(stack, pb.Limits(tokens_per_day=100_000))
    many = chat("many", n=MAX_INT, max_tokens=4)
    resp = await stack.post(many, key=BUDGETED.key)
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-ponto-origin"] == "o1"
    resp = await stack.post(chat("one", max_tokens=4), key=BUDGETED.key)
    assert resp.status == 200, await resp.text()
    resp = await stack.post(many, key=BUDGETED.key)
    assert resp.status == 429, await resp.text()
    assert error_of(await resp.json())["code"] == "rate_limit_exceeded"
    assert stack.origin_requests() == 2
