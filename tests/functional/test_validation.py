"""Request validation through the whole proxy (in one process, real HTTP on
loopback) in front of a recording origin.

A valid request must reach the origin byte for byte as the client sent it; an
invalid one must get a 400 in OpenAI's shape naming the client's own param,
and reach no origin. Hypothesis generates both: valid chat requests over every
documented field, and each of them with one field made wrong.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane.http.state import HOLDER
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import COMPLETION, MODEL, Stack, error_of, start_stack

PLAIN, PROMPTED, ENFORCED, CAPPED = issue_key(), issue_key(), issue_key(), issue_key()
CEILING = 10
SYSTEM_PROMPT = "Answer in French."

ANSWERS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": COMPLETION,
    "/v1/completions": {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    "/v1/embeddings": {
        "object": "list",
        "model": MODEL,
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}],
        "usage": {"prompt_tokens": 1, "total_tokens": 1},
    },
}
STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


@dataclass
class Proxy:
    stack: Stack
    seen: list[tuple[str, bytes]]  # (path, body) of every request the origin got

    async def post(self, path: str, raw: bytes, key: str = PLAIN.key) -> Any:
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        return await self.stack.client.post(path, data=raw, headers=headers)


def route_table(url: str) -> pb.RouteTable:
    """One recording origin; four tenants with caching off (every valid request
    reaches the origin): one without prompt rules, one whose system prompt is
    prepended, one whose system prompt replaces the client's, one with a
    max_tokens ceiling."""
    off = pb.CachePolicy(mode="off")
    t = pb.RouteTable(
        version=3,
        regions=[pb.Region(name="r1", latitude=0.0, longitude=0.0)],
        origins=[
            pb.Origin(
                name="recorder", base_url=url, region="r1", models=[MODEL], weight=100, healthy=True
            )
        ],
        tenants=[
            pb.Tenant(name="plain", cache=off),
            pb.Tenant(
                name="prompted", cache=off, prompt=pb.PromptPolicy(system_prompt=SYSTEM_PROMPT)
            ),
            pb.Tenant(
                name="enforced",
                cache=off,
                prompt=pb.PromptPolicy(system_prompt=SYSTEM_PROMPT, enforce_system_prompt=True),
            ),
            pb.Tenant(name="capped", cache=off, prompt=pb.PromptPolicy(max_tokens_ceiling=CEILING)),
        ],
        keys=[
            pb.ApiKey(id=k.key_id, hash=k.key_hash, tenant=tenant)
            for k, tenant in (
                (PLAIN, "plain"),
                (PROMPTED, "prompted"),
                (ENFORCED, "enforced"),
                (CAPPED, "capped"),
            )
        ],
        auth_required=True,
    )
    t.etag = content_etag(t)
    return t


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    seen: list[tuple[str, bytes]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append((request.path, raw))
        refuse = (json.loads(raw).get("metadata") or {}).get("refuse_message")
        if refuse is not None:  # an origin refusing one message, by its own count
            dotted = refuse.startswith(".")  # OpenAI's form of some params: messages.[2]
            param = f"messages{'.' if dotted else ''}[{refuse.lstrip('.')}].content"
            err = {"message": f"'{param}' is too long", "type": "BadRequestError", "param": param}
            return web.json_response({"error": err}, status=400)
        if json.loads(raw).get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(STREAM)
            await resp.write_eof()
            return resp
        answer = ANSWERS[request.path]
        inputs = json.loads(raw).get("input")
        if request.path == "/v1/embeddings" and isinstance(inputs, list):
            # One embedding per input, as the proxy checks (a batch of strings here).
            answer = {**answer, "data": answer["data"] * len(inputs)}
        return web.json_response(answer)

    origin_app = web.Application()
    for path in ANSWERS:
        origin_app.router.add_post(path, record)
    origin = TestServer(origin_app)
    await origin.start_server()
    stack = await start_stack(tmp_path, [])
    stack.others.append(origin)
    stack.app[HOLDER].apply(route_table(str(origin.make_url("/v1"))), "control-plane")
    yield Proxy(stack, seen)
    await stack.close()


async def refused(proxy: Proxy, path: str, raw: bytes, key: str = PLAIN.key) -> dict[str, Any]:
    """The 400 error a request gets; fails if it reached the origin."""
    before = len(proxy.seen)
    resp = await proxy.post(path, raw, key)
    assert resp.status == 400, await resp.text()
    assert resp.content_type == "application/json"
    assert len(proxy.seen) == before
    return error_of(await resp.json())


# ---------------------------------------------------------------- the client's own index


def one_message(content: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})


@pytest.mark.parametrize("key", [PLAIN, PROMPTED, ENFORCED], ids=["plain", "prepended", "enforced"])
async def test_errors_name_the_clients_message_index_whatever_the_tenants_system_prompt(
    proxy: Proxy, key: Any
) -> None:
    err = await refused(proxy, "/v1/chat/completions", one_message(5), key.key)
    assert err["param"] == "messages[0].content"
    assert "'messages[0].content'" in err["message"]

    # The client's own system message counts, even where the tenant's replaces it.
    two = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "wizard"}],
    }
    err = await refused(proxy, "/v1/chat/completions", orjson.dumps(two), key.key)
    assert err["param"] == "messages[1].role"


@pytest.mark.parametrize(
    ("key", "origin_index", "client_index"),
    [
        (PLAIN, 2, "2"),
        (PROMPTED, 2, "1"),  # the tenant's system prompt came first
        (PROMPTED, 0, "system prompt added by the gateway"),
        (ENFORCED, 1, "1"),  # the client's own system message was replaced
        (PROMPTED, ".2", ".1"),  # OpenAI's dotted form, kept
    ],
    ids=["plain", "prepended", "the-gateways-own", "enforced", "dotted"],
)
async def test_an_origins_error_names_the_clients_message_index(
    proxy: Proxy, key: Any, origin_index: int | str, client_index: str
) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
        ],
        "metadata": {"refuse_message": str(origin_index)},
    }
    resp = await proxy.post("/v1/chat/completions", orjson.dumps(body), key.key)
    assert resp.status == 400
    err = error_of(await resp.json())
    dot = "." if client_index.startswith(".") else ""
    param = f"messages{dot}[{client_index.lstrip('.')}].content"
    assert (err["param"], err["message"]) == (param, f"'{param}' is too long")


@pytest.mark.parametrize("first_name", [b"max_tokens", b"max\\u005ftokens"])
async def test_a_field_named_twice_reaches_the_origin_as_the_ceiling_checked_it(
    proxy: Proxy, first_name: bytes
) -> None:
    # The parser keeps the last value (5, within the ceiling); an origin that
    # reads the first would have generated 100000 tokens had the raw body gone.
    # An escaped character makes no other name.
    raw = (b'{"model": "%s", "%s": 100000, "messages": [{"role": "user", '
           b'"content": "hi"}], "max_tokens": 5}' % (MODEL.encode(), first_name))  # fmt: skip
    resp = await proxy.post("/v1/chat/completions", raw, key=CAPPED.key)
    assert resp.status == 200, await resp.text()
    sent = proxy.seen[-1][1]
    assert sent.count(b'"max_tokens"') == 1 and b"\\u005f" not in sent
    assert json.loads(sent)["max_tokens"] == 5
    # Named once, the body goes as the client wrote it.
    once = raw.replace(b'"%s": 100000, ' % first_name, b"")
    resp = await proxy.post("/v1/chat/completions", once, key=CAPPED.key)
    assert resp.status == 200, await resp.text()
    assert proxy.seen[-1] == ("/v1/chat/completions", once)


async def test_a_model_named_twice_reaches_the_origin_as_routed(proxy: Proxy) -> None:
    """Review 35: for a tenant with no prompt rules, a body naming `model`
    twice went byte for byte: the proxy routed, limited and cached it on the
    last value, and an origin that reads the first could serve another model
    (a dearer one on the same replica) under that account. It goes written
    anew, with the model the proxy routed on."""
    raw = (b'{"model": "dearer-model", "messages": [{"role": "user", '
           b'"content": "hi"}], "model": "%s"}' % MODEL.encode())  # fmt: skip
    resp = await proxy.post("/v1/chat/completions", raw, key=PLAIN.key)
    assert resp.status == 200, await resp.text()
    sent = proxy.seen[-1][1]
    assert sent.count(b'"model"') == 1
    assert json.loads(sent)["model"] == MODEL


async def test_a_model_named_inside_the_body_is_no_duplicate(proxy: Proxy) -> None:
    """Review 37: a tool whose schema has a property named `model` made the
    body be written anew (issue 17: no body re-serialised that did not
    change). It goes byte for byte."""
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "which model?"}], '
           b'"tools": [{"type": "function", "function": {"name": "car", "parameters": '
           b'{"type": "object", "properties": {"model": {"type": "string"}}}}}]}'
           % MODEL.encode())  # fmt: skip
    resp = await proxy.post("/v1/chat/completions", raw, key=PLAIN.key)
    assert resp.status == 200, await resp.text()
    assert proxy.seen[-1] == ("/v1/chat/completions", raw)


async def test_a_valid_request_is_checked_before_the_system_prompt_is_added(proxy: Proxy) -> None:
    resp = await proxy.post("/v1/chat/completions", one_message("Bonjour"), PROMPTED.key)
    assert resp.status == 200, await resp.text()
    ((_, raw),) = proxy.seen
    sent = json.loads(raw)["messages"]
    assert sent == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Bonjour"},
    ]


# ---------------------------------------------------------------- nesting


@pytest.mark.parametrize("depth", [65, 253, 1000, 1025, 50_000])
async def test_deep_json_is_a_400_in_any_field(proxy: Proxy, depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    for raw in (
        b'{"model":"%s","messages":[{"role":"user","content":"x"}],"x":%s}'
        % (MODEL.encode(), deep),
        b'{"model":"%s","messages":[{"role":"user","content":"x","x":%s}]}'
        % (MODEL.encode(), deep),
        b'{"model":"%s","messages":%s}' % (MODEL.encode(), deep),
    ):
        err = await refused(proxy, "/v1/chat/completions", raw)
        assert err["code"] == "invalid_json"
        assert "levels deep" in err["message"]


# ---------------------------------------------------------------- what vLLM takes

# Turns of a new user's agent (the openai SDK and LangChain against vLLM),
# which the proxy refused: each reaches the origin byte for byte.
VLLM_TAKES = {
    # A reasoning model's turn cut at max_tokens while it thought: no content.
    "reasoning-only-turn": [
        {"role": "user", "content": "Plan my trip."},
        {"role": "assistant", "content": None, "reasoning": "First the dates..."},
        {"role": "user", "content": "Go on."},
    ],
    # Parts of vLLM's own types and forms, and of a type only an origin knows.
    "parts-of-any-type": [
        {
            "role": "user",
            "content": [
                "Look:",
                {"type": "input_text", "text": "this"},
                {"type": "input_image", "image_url": "https://x/y.png"},
                {"image_url": {"url": "https://x/z.png"}, "uuid": "img-2"},
                {"type": "image_url", "image_url": None, "uuid": "img-1"},
                {"type": "x-origin-part", "x": [1]},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Hm.", "closed": True},
                {"type": "text", "text": "A cat."},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "tool_reference", "name": "get_weather"}],
        },
    ],
    # Any detail and audio format: the SDK types detail "original".
    "detail-original": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a", "detail": "original"}},
                {"type": "input_audio", "input_audio": {"data": "UklG", "format": "flac"}},
            ],
        },
    ],
    "no-content-in-any-role": [
        {"role": "system", "content": None},
        {"role": "developer"},
        {"role": "user", "content": "hi"},
        {"role": "assistant"},
        {"role": "tool", "tool_call_id": "c1", "content": None},
        {"role": "user"},
    ],
}


@pytest.mark.parametrize("messages", list(VLLM_TAKES.values()), ids=list(VLLM_TAKES))
async def test_what_vllm_takes_reaches_the_origin_unchanged(
    proxy: Proxy, messages: list[dict[str, Any]]
) -> None:
    raw = orjson.dumps({"model": MODEL, "messages": messages})
    resp = await proxy.post("/v1/chat/completions", raw)
    assert resp.status == 200, await resp.text()
    assert proxy.seen == [("/v1/chat/completions", raw)]


# ---------------------------------------------------------------- generated requests

text = st.text(max_size=12)
# Any name: OpenAI takes ^[a-zA-Z0-9_-]{1,64}$, vLLM any (`server.tool`).
tool_names = st.text(min_size=1, max_size=80)
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(
        lambda url, detail: {"type": "image_url", "image_url": {"url": url, **detail}},
        st.text(min_size=1, max_size=12),
        st.fixed_dictionaries({}, optional={"detail": st.sampled_from(["auto", "low", "high"])}),
    ),
    st.builds(
        lambda data, fmt: {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
        text,
        st.sampled_from(["wav", "mp3"]),
    ),
    # vLLM's string and `thinking` parts, and a type only an origin knows.
    text,
    st.builds(lambda t: {"type": "thinking", "thinking": t}, text),
    st.builds(lambda t: {"type": "x-origin", "x": t}, text),
)
content = text | st.lists(parts, max_size=3)
tool_call = st.builds(
    lambda i, name: {
        "id": i,
        "type": "function",
        "function": {"name": name, "arguments": "{}"},
    },
    text,
    tool_names,
)
plain_turn = st.builds(
    lambda role, c: {"role": role, "content": c},
    st.sampled_from(["system", "developer", "user", "assistant"]),
    content | st.none(),  # null: none, as vLLM reads it
)


def answered(calls: list[dict[str, Any]]) -> st.SearchStrategy[list[dict[str, Any]]]:
    """An assistant turn making `calls`, then tool turns answering some of
    them (or calls of no turn), in any order: their order is the origin's
    to judge (OpenAI refuses calls left unanswered; vLLM takes them)."""
    answers = st.lists(st.sampled_from([c["id"] for c in calls]) | text, max_size=3)
    return answers.map(
        lambda ids: [
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": i, "content": "done"} for i in ids),
        ]
    )


# A conversation: plain turns, and tool calls with answers, in any order.
conversation = st.lists(
    plain_turn.map(lambda turn: [turn])
    | st.lists(tool_call, min_size=1, max_size=2).flatmap(answered),
    min_size=1,
    max_size=3,
).map(lambda rounds: [turn for turns in rounds for turn in turns])
tool = st.builds(
    lambda name, extra: {"type": "function", "function": {"name": name, **extra}},
    tool_names,
    st.fixed_dictionaries(
        {},
        optional={
            "description": text,
            "parameters": st.just({"type": "object", "properties": {}}),
            "strict": st.booleans(),
        },
    ),
)
OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    # OpenAI's bounds (2, 128, +-100, 128 tools, 16 keys) are the origin's.
    "temperature": st.floats(0, 1e6) | st.integers(0, 10),
    "top_p": st.floats(0, 1),
    "n": st.integers(1, 2**31 - 1),
    "stop": text | st.lists(text, max_size=8),
    "max_tokens": st.integers(1, 2**31 - 1),
    "max_completion_tokens": st.integers(1, 2**31 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(
        st.integers(0, 200_000).map(str), st.integers(-1000, 1000), max_size=3
    ),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "logprobs": st.booleans(),
    "tools": st.lists(tool, min_size=1, max_size=3) | st.lists(tool, min_size=129, max_size=130),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}},
        ]
    ),
    "stream": st.booleans(),
    "user": text,
    "prompt_cache_key": text,
    # Values of any JSON type (LiteLLM's clients send `tags` lists).
    "metadata": st.dictionaries(
        st.text(max_size=80),
        text
        | st.lists(text, max_size=3)
        | st.integers(-(2**63), 2**63 - 1)
        | st.booleans()
        | st.none(),
        max_size=20,
    ),
    # Any string: settings the proxy does not read (fields.SERVICE_TIER).
    "service_tier": st.sampled_from(["auto", "default", "flex", "priority"]) | text,
    "reasoning_effort": st.sampled_from(["minimal", "low", "medium", "high"]) | text,
    "verbosity": text,
    "modalities": st.lists(st.sampled_from(["text", "audio"]) | text, max_size=3),
    "store": st.booleans(),
    "top_k": st.integers(-1, 100),  # a vLLM extension: passes unchecked
}


@st.composite
def valid_chat(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": draw(conversation),
    }
    body.update(draw(st.fixed_dictionaries({}, optional=OPTIONAL)))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 20))
    if "tools" in body and draw(st.booleans()):
        named = {
            "type": "function",
            "function": {"name": draw(st.sampled_from(body["tools"]))["function"]["name"]},
        }
        body["tool_choice"] = draw(st.sampled_from(["none", "auto", "required", named]))
    return body


# Makes one field of a valid body wrong; returns the param its error must name.
Mutation = Callable[[dict[str, Any]], str]


def setting(name: str, value: Any, reported: str | None = None) -> Mutation:
    def mutate(body: dict[str, Any]) -> str:
        body[name] = value
        return reported or name

    return mutate


def in_last_message(name: str, value: Any) -> Mutation:
    """Set `name` in the client's last message: the error names its own index."""

    def mutate(body: dict[str, Any]) -> str:
        i = len(body["messages"]) - 1
        body["messages"][i] = {"role": "user", "content": "x", name: value}
        return f"messages[{i}].{name}"

    return mutate


MUTATIONS = [
    setting("model", 5),
    setting("model", ""),
    setting("messages", "hi"),
    setting("messages", []),
    setting("temperature", "hot"),
    setting("temperature", -0.5),
    setting("temperature", True),
    setting("top_p", -0.5),
    setting("n", "2"),
    setting("n", 0),
    setting("n", 1.5),
    setting("stop", 7),
    setting("max_tokens", 0),
    setting("max_tokens", "100"),
    setting("max_completion_tokens", 2**31),
    setting("presence_penalty", 2.5),
    setting("frequency_penalty", [0]),
    setting("logit_bias", {"1": "high"}, "logit_bias.1"),
    setting("logit_bias", "none"),
    setting("seed", 0.5),
    setting("seed", "7"),
    setting("logprobs", "yes"),
    setting("tools", {"name": "f"}),
    setting("tools", [{"type": "function", "function": {"name": 5}}], "tools[0].function.name"),
    setting("tool_choice", "sometimes"),
    setting("parallel_tool_calls", 1),
    setting("response_format", {"type": "yaml"}, "response_format.type"),
    setting("stream", "yes"),
    setting("user", 42),
    setting("prompt_cache_key", {"k": 1}),
    setting("metadata", ["tags"]),
    setting("service_tier", 1),
    setting("verbosity", {"level": "high"}),
    setting("modalities", ["text", 2], "modalities[1]"),
    setting("reasoning_effort", 3),
    setting("store", "no"),
    in_last_message("role", "wizard"),
    in_last_message("content", 5),
    in_last_message("name", 5),
]


@st.composite
def invalid_chat(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid request with one field made wrong, and the param its error names."""
    body = draw(valid_chat())
    param = draw(st.sampled_from(MUTATIONS))(body)
    return body, param


BOUNDED = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@BOUNDED
@given(body=valid_chat())
async def test_valid_requests_reach_the_origin_unchanged(
    proxy: Proxy, body: dict[str, Any]
) -> None:
    raw = orjson.dumps(body)
    before = len(proxy.seen)
    resp = await proxy.post("/v1/chat/completions", raw)
    await resp.read()
    assert resp.status == 200, await resp.text()
    options = body.get("stream_options")
    if body.get("stream") is True and not (options or {}).get("include_usage"):
        # The usage its client did not ask for is asked of the origin
        # (--origin-stream-usage always): after the opening brace, or in
        # the client's stream_options, which are encoded again.
        asked = {"stream_options": {"include_usage": True}}
        if options is None:
            raw = b"{" + orjson.dumps(asked)[1:-1] + b"," + raw[1:]
        else:
            raw = orjson.dumps({**body, **asked})
    assert proxy.seen[before:] == [("/v1/chat/completions", raw)]


@BOUNDED
@given(case=invalid_chat())
async def test_invalid_requests_get_a_400_naming_the_param_and_reach_no_origin(
    proxy: Proxy, case: tuple[dict[str, Any], str]
) -> None:
    body, param = case
    err = await refused(proxy, "/v1/chat/completions", orjson.dumps(body))
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "good", "bad", "param"),
    [
        (
            "/v1/completions",
            {"prompt": [[1, 2], [3]], "best_of": 2},
            {"prompt": [1, "a"]},
            "prompt[1]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "logprobs": 5},
            {"prompt": "x", "logprobs": True},
            "logprobs",
        ),
        ("/v1/embeddings", {"input": ["a", "b"], "dimensions": 8}, {"input": []}, "input"),
        (
            "/v1/embeddings",
            {"input": "a"},
            {"input": "a", "encoding_format": "hex"},
            "encoding_format",
        ),
        # Trial 21: a 500 with a traceback, after the origin's call.
        (
            "/v1/embeddings",
            {"input": "a", "stream": False},
            {"input": "a", "stream": True},
            "stream",
        ),
    ],
)
async def test_completions_and_embeddings_are_checked_too(
    proxy: Proxy, path: str, good: dict[str, Any], bad: dict[str, Any], param: str
) -> None:
    raw = orjson.dumps({"model": MODEL, **good})
    resp = await proxy.post(path, raw)
    assert resp.status == 200, await resp.text()
    assert proxy.seen == [(path, raw)]
    err = await refused(proxy, path, orjson.dumps({"model": MODEL, **bad}))
    assert err["param"] == param
