"""The request field rules (dataplane.http.fields) and the JSON depth bound, per endpoint.

Each bad case names the param and code the client must see: the path is the
one in the body the client sent, in OpenAI's notation (`messages[0].content`).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.http.errors import ApiError
from dataplane.http.fields import (
    _PLAIN_TURNS,
    _ROLES,
    ENDPOINT_RULES,
    MAX_DEPTH,
    MAX_INT,
    brackets_of,
    check_depth,
    check_fields,
    outside_strings,
)
from dataplane.http.pipeline import ENDPOINTS, parse_json, validate

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once", **fields}


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "text", **fields}


def response(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def rerank(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "query": "capital of France?", "documents": ["Paris", "Rome"], **fields}


def refusal(endpoint: str, body: dict[str, Any]) -> ApiError:
    before = copy.deepcopy(body)
    with pytest.raises(ApiError) as caught:
        check_fields(endpoint, body, bool(body.get("stream")))
    assert body == before  # the check reads, never writes
    err = caught.value
    assert err.status == 400 and err.type == "invalid_request_error"
    return err


# ---------------------------------------------------------------- requests that pass

GOOD = [
    ("chat.completions", chat()),
    (
        "chat.completions",
        chat(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
            continue_final_message=True,
            add_generation_prompt=False,
        ),
    ),
    # As vLLM: the last message goes on, whatever its role (review 46).
    ("chat.completions", chat(continue_final_message=True)),
    ("chat.completions", chat(
        messages=[
            {"role": "system", "content": "Be brief.", "name": "sys"},
            {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}},
                {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},  # vLLM's
            ]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "1"},
            # OpenAI's multi-turn audio: the earlier audio answer by its id alone.
            {"role": "assistant", "audio": {"id": "audio_1"}},
            # A refusal given back as the SDK returned it: content null.
            {"role": "assistant", "content": None, "refusal": "I can't help with that."},
            {"role": "user", "content": "again"},
        ],
        temperature=0, top_p=1, n=2, stop=["a", "b", "c", "d"], max_tokens=5,
        max_completion_tokens=5, presence_penalty=-2, frequency_penalty=2.0,
        logit_bias={"50256": -100, "1": 3.5}, seed=-(2**63), logprobs=True, top_logprobs=20,
        tools=[TOOL, {"type": "custom", "custom": {"name": "grep"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "out", "schema": {"type": "object"},
                                         "strict": True}},
        stream=True, stream_options={"include_usage": True}, user="u-1",
        metadata={"k" * 64: "v" * 512, **{f"k{i}": "v" for i in range(15)}},
        prompt_cache_key="p", service_tier="flex", modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "mp3"}, reasoning_effort="low", store=False,
        prediction={"type": "content", "content": "x"}, verbosity="high",
        top_k=40, guided_json={"type": "object"},  # an origin's extensions pass
    )),
    ("chat.completions", chat(temperature=None, stop=None, tools=None, n=None, stream=None)),
    ("chat.completions", chat(stop="\n", tool_choice="none", response_format={"type": "text"})),
    ("chat.completions", chat(tools=[TOOL], tool_choice="required")),
    ("chat.completions", chat(
        tools=[{"type": "custom", "custom": {"name": "grep"}}],
        tool_choice={"type": "custom", "custom": {"name": "grep"}},
    )),
    ("completions", completion()),
    ("completions", completion(prompt=["a", ""], echo=True, best_of=3, n=3, suffix="end",
                               logprobs=5, stream=True, stream_options={"include_usage": False})),
    ("completions", completion(prompt=[1, 2, 3])),
    ("completions", completion(prompt=[[1, 2], [3]])),
    ("completions", completion(prompt="")),
    # A prompt scored: echoed with its logprobs, nothing generated (trial 51: refused).
    ("completions", completion(echo=True, max_tokens=0, logprobs=1)),
    # More logprobs than OpenAI gives are the origin's to take (vLLM's
    # --max-logprobs); a new user's trial had 10 refused.
    ("completions", completion(logprobs=10)),
    # So are more stop sequences than OpenAI's 4 (vLLM takes any number).
    ("chat.completions", chat(stop=["a"] * 5)),
    ("completions", completion(stop=[str(i) for i in range(64)])),
    # OpenAI's policy limits that vLLM does not share are the origin's to
    # judge (trial 97: each was refused, and answered by vLLM directly).
    ("chat.completions", chat(temperature=2.5, n=129, logit_bias={"1": 150, "2": -1000.5})),
    ("chat.completions", chat(temperature=1e30, n=MAX_INT)),
    ("completions", completion(temperature=3, n=200, best_of=MAX_INT)),
    ("responses", response(temperature=7.5, max_tool_calls=0)),
    # Past 32 bits too: the proxy counts nothing with it (review 426).
    ("responses", response(max_tool_calls=2**40)),
    ("responses", response(max_tool_calls=-(2**63))),
    ("chat.completions", chat(tools=[TOOL] * 129)),
    ("responses", response(tools=[{"type": "function", "name": "f"}] * 129)),
    # MCP servers' tools are named `server.tool`; vLLM takes any name.
    ("chat.completions", chat(
        tools=[{"type": "function", "function": {"name": "github.search issues"}},
               {"type": "function", "function": {"name": "f" * 65}},
               {"type": "custom", "custom": {"name": "fs.grep"}}],
        tool_choice={"type": "function", "function": {"name": "github.search issues"}},
        response_format={"type": "json_schema", "json_schema": {"name": "a b.c"}},
        functions=[{"name": "x.y"}],
    )),
    ("responses", response(
        tools=[{"type": "function", "name": "a.b"}, {"type": "custom", "name": "c d"}],
        tool_choice={"type": "function", "name": "a.b"},
        text={"format": {"type": "json_schema", "name": "out.v2", "schema": {}}},
    )),
    ("chat.completions", chat(
        metadata={f"k{i}": "v" * 600 for i in range(17)} | {"k" * 65: "v"},
        user="u" * 5000, safety_identifier="s" * 5000, prompt_cache_key="p" * 5000,
    )),
    ("responses", response(metadata={f"k{i}": "v" for i in range(17)}, user="u" * 5000)),
    # Metadata values of any JSON type: LiteLLM's clients send `tags` lists.
    ("chat.completions", chat(metadata={"tags": ["a", "b"], "n": 1, "x": None, "o": {"p": [1.5]}})),
    ("completions", completion(metadata={"tags": ["prod"]})),
    ("responses", response(metadata={"tags": ["a"], "flag": True})),
    # Settings the proxy does not read, which a vLLM chat endpoint ignores or
    # does not know: any string (other servers, and OpenAI's next values).
    ("chat.completions", chat(
        service_tier="gold", reasoning_effort="max", verbosity="terse",
        modalities=["text", "smell"], audio={"voice": "alloy", "format": "ogg"},
    )),
    ("completions", completion(service_tier="batch")),
    ("responses", response(
        service_tier="gold", reasoning={"effort": "max"}, text={"verbosity": "terse"},
    )),
    # A content null or left out is none, in any role, as vLLM reads it: an
    # assistant turn of reasoning alone comes back so (a new user's trial).
    ("chat.completions", chat(messages=[
        USER, {"role": "assistant", "content": None, "reasoning": "The user greets me."},
        {"role": "user", "content": "again"}, {"role": "assistant", "audio": None}])),
    *[("chat.completions", chat(messages=[{"role": role, "content": None, **extra}, USER]))
      for role, extra in [("system", {}), ("developer", {}), ("user", {}),
                          ("tool", {"tool_call_id": "c1"}), ("function", {"name": "f"})]],
    ("chat.completions", chat(messages=[{"role": "system"}, {"role": "user"},
                                        {"role": "tool", "tool_call_id": "c1"}])),
    # Parts of any type pass (vLLM's, and others an origin may know), and
    # vLLM's: a string, an untyped part told by its media, one naming media
    # vLLM holds by its uuid (a new user's trial: `thinking` was refused).
    ("chat.completions", chat(messages=[
        {"role": "user", "content": [
            "Look:", {"type": "input_text", "text": "this"},
            {"type": "input_image", "image_url": "https://x/y.png"},
            {"image_url": {"url": "https://x/z.png"}, "uuid": "img-2"},
            {"type": "image_url", "image_url": None, "uuid": "img-1"},
            {"uuid": "img-3"}, {"video_url": "https://x/v.mp4"},
            {"type": "x-origin-part", "x": [1]}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Hm.", "closed": True},
            {"type": "text", "text": "A cat."}]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "tool_reference", "name": "get_weather"}]}])),
    # An image's detail and audio's format are any string, as for the origin:
    # the SDK types detail "original" (a new user's trial: refused).
    ("chat.completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "original"}},
        {"type": "input_audio", "input_audio": {"data": "A", "format": "ogg"}}]}])),
    ("responses", response(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png", "detail": "original"}]}])),
    # An empty content array is an empty text to vLLM; `functions: []` none.
    ("chat.completions", chat(messages=[{"role": "user", "content": []}], functions=[])),
    ("embeddings", embedding(input=["x"] * 2049)),
    ("rerank", rerank(documents=["x"] * 10_001)),
    ("completions", completion(logprobs=1 << 20)),
    ("chat.completions", chat(logprobs=True, top_logprobs=50)),
    # vLLM: every token's logprobs, with --max-logprobs -1 (review 307).
    ("chat.completions", chat(logprobs=True, top_logprobs=-1)),
    ("responses", {"model": "m", "input": "hi", "top_logprobs": 50}),
    # vLLM's plain-string image URL (a new user's trial: refused invalid_type).
    ("chat.completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": "https://x/y.png"}]}])),
    ("embeddings", embedding()),
    ("embeddings", embedding(input=["a", "b"], encoding_format="base64", dimensions=256,
                             user="u")),
    ("embeddings", embedding(input=[1, 2])),
    ("embeddings", embedding(input=[[1], [2, 3]])),
    ("rerank", rerank()),
    # Jina's and Cohere's fields, vLLM's own passed on unchecked; a top_n
    # past the documents is every document, as on vLLM and Jina.
    ("rerank", rerank(documents=["", "x"], top_n=5, return_documents=False,
                      max_tokens_per_doc=512, truncate_prompt_tokens=-1, priority=0,
                      stream=False)),
    # vLLM's every document (its default, 0), which the proxy leaves out.
    ("rerank", rerank(top_n=0)),
    ("rerank", rerank(top_n=-1)),
    ("responses", response()),
    ("responses", response(
        input=[
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "Rules."},
                {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"},
                {"type": "input_file", "file_id": "file-1"},
            ]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "item_reference", "id": "msg_1"},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # other item types pass
        ],
        instructions="Be brief.", max_output_tokens=100, temperature=2, top_p=0.5,
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}},
               {"type": "web_search"}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=True,
        text={"format": {"type": "json_schema", "name": "out", "schema": {}}, "verbosity": "low"},
        stream=True, stream_options={"include_obfuscation": False}, metadata={"a": "b"},
        user="u", previous_response_id="resp_1", store=True, truncation="auto",
        reasoning={"effort": "high", "summary": "auto"}, background=False,
        include=["reasoning.encrypted_content"], top_logprobs=3,
    )),
    ("responses", response(conversation={"id": "conv_1"}, previous_response_id=None)),
    ("responses", response(tools=[{"type": "file_search"}], tool_choice={"type": "file_search"})),
    # No input where the origin holds what to answer (trial 8: OpenAI takes these).
    ("responses", {"model": "m", "prompt": {"id": "pmpt_123", "variables": {"city": "Lisbon"}}}),
    ("responses", {"model": "m", "conversation": "conv_1"}),
    ("responses", {"model": "m", "previous_response_id": "resp_abc"}),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), GOOD)
def test_documented_requests_pass(endpoint: str, body: dict[str, Any]) -> None:
    check_fields(endpoint, body, bool(body.get("stream")))


# ---------------------------------------------------------------- requests refused

C, P, E, R, K = "chat.completions", "completions", "embeddings", "responses", "rerank"
T, V, M = "invalid_type", "invalid_value", "missing_required_parameter"

BAD = [
    # what every endpoint needs
    (C, {"messages": [USER]}, "model", M),
    (C, chat(model=""), "model", "empty_string"),
    (C, chat(model=5), "model", T),
    (C, {"model": "m"}, "messages", M),
    (C, {"model": "m", "messages": None}, "messages", M),
    (P, {"model": "m"}, "prompt", M),
    (E, {"model": "m"}, "input", M),
    (R, {"model": "m"}, "input", M),
    (R, {"model": "m", "input": None, "prompt": None}, "input", M),
    # messages: the client's own indexes
    (C, chat(messages=[]), "messages", "empty_array"),
    (C, chat(messages={"role": "user"}), "messages", T),
    (C, chat(messages=[USER, "hi"]), "messages[1]", T),
    (C, chat(messages=[USER, None]), "messages[1]", T),
    (C, chat(messages=[{"content": "x"}]), "messages[0].role", M),
    (C, chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", V),
    (C, chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role", T),
    (C, chat(messages=[{"role": "assistant", "audio": {}}]), "messages[0].audio.id", M),
    (C, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", T),
    (C, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
     "messages[0].content[0].type", M),
    (C, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages[0].content[0].text", M),
    (C, chat(messages=[{"role": "user", "content": [5]}]), "messages[0].content[0]", T),
    (C, chat(messages=[{"role": "user", "content": [{"type": 5}]}]),
     "messages[0].content[0].type", T),
    (C, chat(messages=[{"role": "user", "content": [{"type": [1], "uuid": "img-1"}]}]),
     "messages[0].content[0].type", T),
    # No type, no uuid and no media vLLM tells a part by: vLLM refuses it too.
    (C, chat(messages=[{"role": "user", "content": [{"uuid": None, "name": "f"}]}]),
     "messages[0].content[0].type", M),
    (C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].image_url.url", M),
    (C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": ""}]}]),
     "messages[0].content[0].image_url", "empty_string"),
    (C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]),
     "messages[0].content[0].image_url", T),
    (C, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "u", "detail": 1}}]}]),
     "messages[0].content[0].image_url.detail", T),
    (C, chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "A", "format": ["wav"]}}]}]),
     "messages[0].content[0].input_audio.format", T),
    (C, chat(messages=[{"role": "user", "content": [{"type": "file", "file": "x"}]}]),
     "messages[0].content[0].file", T),
    (C, chat(messages=[{"role": "assistant", "content": [{"type": "refusal"}]}]),
     "messages[0].content[0].refusal", M),
    (C, chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", M),
    (C, chat(messages=[{"role": "function", "content": "x"}]), "messages[0].name", M),
    (C, chat(messages=[{"role": "user", "content": "x", "name": 1}]), "messages[0].name", T),
    (C, chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "id": "1"}]}]),
     "messages[0].tool_calls[0].function", M),
    (C, chat(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "id": "1", "function": {"name": "f", "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments", T),
    (C, chat(messages=[{"role": "assistant", "tool_calls": [{"type": "magic", "id": "1"}]}]),
     "messages[0].tool_calls[0].type", V),
    # sampling and limits
    (C, chat(temperature="hot"), "temperature", T),
    (C, chat(temperature=True), "temperature", T),
    (C, chat(temperature=-0.1), "temperature", "decimal_below_min_value"),
    (C, chat(top_p=1.01), "top_p", "decimal_above_max_value"),
    (C, chat(n="2"), "n", T),
    (C, chat(n=0), "n", "integer_below_min_value"),
    (C, chat(n=1.0), "n", T),
    # Past 32 bits: a budget multiplies the token limit by it.
    (C, chat(n=MAX_INT + 1), "n", "integer_above_max_value"),
    (C, chat(max_tokens=0), "max_tokens", "integer_below_min_value"),
    (C, chat(max_tokens=10**30), "max_tokens", "integer_above_max_value"),
    (C, chat(max_completion_tokens="5"), "max_completion_tokens", T),
    (C, chat(presence_penalty=-2.5), "presence_penalty", "decimal_below_min_value"),
    (C, chat(frequency_penalty="x"), "frequency_penalty", T),
    (C, chat(logit_bias=[1]), "logit_bias", T),
    (C, chat(logit_bias={"the": 1}), "logit_bias", V),
    (C, chat(logit_bias={"1": "high"}), "logit_bias.1", T),
    (C, chat(seed=1.5), "seed", T),
    (C, chat(seed="1"), "seed", T),
    (C, chat(seed=2**63), "seed", "integer_above_max_value"),
    (C, chat(stop=5), "stop", T),
    (C, chat(stop=["a", 1]), "stop[1]", T),
    (C, chat(logprobs=1), "logprobs", T),
    (C, chat(logprobs=True, top_logprobs=(1 << 20) + 1), "top_logprobs",
     "integer_above_max_value"),
    (C, chat(logprobs=True, top_logprobs=-2), "top_logprobs", "integer_below_min_value"),
    (C, chat(top_logprobs=2), "top_logprobs", V),
    (C, chat(logprobs=False, top_logprobs=2), "top_logprobs", V),
    # vLLM's prefill continuation (trial 28: these reached the origin)
    (C, chat(continue_final_message="yes"), "continue_final_message", T),
    (
        C,
        chat(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
            continue_final_message=True,
            add_generation_prompt=True,
        ),
        "continue_final_message",
        V,
    ),
    (C, chat(add_generation_prompt=1), "add_generation_prompt", T),
    # tools
    (C, chat(tools={"type": "function"}), "tools", T),
    (C, chat(tools=[{"type": "function"}]), "tools[0].function", M),
    (C, chat(tools=[{"function": {"name": "f"}}]), "tools[0].type", M),
    (C, chat(tools=[{"type": "plugin", "plugin": {}}]), "tools[0].type", V),
    (C, chat(tools=[TOOL, {"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[1].function.parameters", T),
    (C, chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict", T),
    (C, chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools[0].function.name", T),
    (C, chat(tool_choice="sometimes", tools=[TOOL]), "tool_choice", V),
    (C, chat(tool_choice=1, tools=[TOOL]), "tool_choice", T),
    (C, chat(tool_choice="required"), "tool_choice", V),
    (C, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice", V),
    (C, chat(tools=[TOOL], tool_choice={"type": "function"}), "tool_choice.function", M),
    (C, chat(tools=[TOOL], tool_choice={"type": "custom", "custom": {"name": "get_weather"}}),
     "tool_choice", V),
    (C, chat(parallel_tool_calls="yes"), "parallel_tool_calls", T),
    # output shape and the rest
    (C, chat(response_format="json"), "response_format", T),
    (C, chat(response_format={"type": "xml"}), "response_format.type", V),
    (C, chat(response_format={"type": "json_schema"}), "response_format.json_schema", M),
    (C, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", M),
    (C, chat(stream="yes"), "stream", T),
    (C, chat(stream_options={"include_usage": True}), "stream_options", V),
    (C, chat(stream=True, stream_options="yes"), "stream_options", T),
    (C, chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage", T),
    (C, chat(user={"id": 1}), "user", T),
    (C, chat(prompt_cache_key=123), "prompt_cache_key", T),
    (C, chat(metadata=[]), "metadata", T),
    (C, chat(metadata="tags"), "metadata", T),
    (C, chat(service_tier=1), "service_tier", T),
    (C, chat(modalities="text"), "modalities", T),
    (C, chat(modalities=[1]), "modalities[0]", T),
    (C, chat(reasoning_effort=3), "reasoning_effort", T),
    (C, chat(verbosity=["high"]), "verbosity", T),
    (C, chat(audio={"voice": "alloy", "format": 3}), "audio.format", T),
    (C, chat(store="no"), "store", T),
    (C, chat(audio={"voice": "alloy"}), "audio.format", M),
    (C, chat(prediction={"type": "content", "content": 1}), "prediction.content", T),
    # completions
    (P, completion(prompt=5), "prompt", T),
    (P, completion(prompt=[]), "prompt", "empty_array"),
    (P, completion(prompt=["a", 1]), "prompt[1]", T),
    (P, completion(prompt=[1, -1]), "prompt[1]", "integer_below_min_value"),
    (P, completion(prompt=[[1], []]), "prompt[1]", "empty_array"),
    (P, completion(prompt=[[1], ["a"]]), "prompt[1][0]", T),
    (P, completion(prompt=[True]), "prompt[0]", T),
    (P, completion(echo="yes"), "echo", T),
    (P, completion(best_of=2, n=3), "best_of", V),
    (P, completion(best_of=MAX_INT + 1), "best_of", "integer_above_max_value"),
    (P, completion(logprobs=True), "logprobs", T),
    (P, completion(logprobs=(1 << 20) + 1), "logprobs", "integer_above_max_value"),
    (P, completion(logprobs=-1), "logprobs", "integer_below_min_value"),
    (P, completion(suffix=1), "suffix", T),
    (P, completion(temperature="hot"), "temperature", T),
    (P, completion(stop=["a", 1]), "stop[1]", T),
    (P, completion(stream_options={}), "stream_options", V),
    # embeddings
    (E, embedding(input=""), "input", "empty_string"),
    (E, embedding(input=[]), "input", "empty_array"),
    (E, embedding(input=["a", ""]), "input[1]", "empty_string"),
    (E, embedding(input={"text": "a"}), "input", T),
    (E, embedding(encoding_format="hex"), "encoding_format", V),
    (E, embedding(dimensions=0), "dimensions", "integer_below_min_value"),
    (E, embedding(dimensions="256"), "dimensions", T),
    (E, embedding(user=1), "user", T),
    # rerank
    (K, {"model": "m", "documents": ["a"]}, "query", M),
    (K, {"model": "m", "query": "q"}, "documents", M),
    (K, {"query": "q", "documents": ["a"]}, "model", M),
    (K, rerank(query=""), "query", "empty_string"),
    (K, rerank(query=["q"]), "query", T),
    (K, rerank(documents=[]), "documents", "empty_array"),
    (K, rerank(documents="Paris"), "documents", T),
    # Jina's and Cohere v1's document objects, which vLLM refuses.
    (K, rerank(documents=["Paris", {"text": "Rome"}]), "documents[1]", T),
    (K, rerank(documents=["Paris", None]), "documents[1]", T),
    (K, rerank(top_n="3"), "top_n", T),
    (K, rerank(top_n=2.5), "top_n", T),
    (K, rerank(return_documents="yes"), "return_documents", T),
    (K, rerank(max_tokens_per_doc=0), "max_tokens_per_doc", "integer_below_min_value"),
    (K, rerank(stream=True), "stream", V),
    # responses
    (R, response(input=5), "input", T),
    (R, response(input=[{"content": "x"}]), "input[0].role", M),
    (R, response(input=[{"role": "tool", "content": "x"}]), "input[0].role", V),
    (R, response(input=[{"role": "user"}]), "input[0].content", M),
    (R, response(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
     "input[0].content[0].text", M),
    (R, response(input=[{"type": "function_call", "call_id": "c"}]), "input[0].name", M),
    (R, response(input=[{"type": "function_call_output", "call_id": "c", "output": 1}]),
     "input[0].output", T),
    (R, response(input=["hi"]), "input[0]", T),
    (R, response(instructions=1), "instructions", T),
    (R, response(max_output_tokens=0), "max_output_tokens", "integer_below_min_value"),
    (R, response(temperature="hot"), "temperature", T),
    (R, response(top_p=2), "top_p", "decimal_above_max_value"),
    (R, response(tools=[{"type": "function"}]), "tools[0].name", M),
    (R, response(tools=[{"type": "function", "name": ["a"]}]), "tools[0].name", T),
    (R, response(max_tool_calls=1.5), "max_tool_calls", T),
    (R, response(max_tool_calls=2**63), "max_tool_calls", "integer_above_max_value"),
    (R, response(tools=[{"type": "function", "name": "f"}],
                 tool_choice={"type": "function", "name": "g"}), "tool_choice", V),
    (R, response(tool_choice="required"), "tool_choice", V),
    (R, response(text={"format": {"type": "yaml"}}), "text.format.type", V),
    (R, response(text={"format": {"type": "json_schema", "schema": {}}}), "text.format.name", M),
    (R, response(text="json"), "text", T),
    (R, response(stream="yes"), "stream", T),
    (R, response(stream_options={"include_obfuscation": True}), "stream_options", V),
    (R, response(metadata=["tags"]), "metadata", T),
    (R, response(user=1), "user", T),
    (R, response(previous_response_id=1), "previous_response_id", T),
    (R, response(store="yes"), "store", T),
    (R, response(parallel_tool_calls=1), "parallel_tool_calls", T),
    (R, response(truncation="sometimes"), "truncation", V),
    (R, response(reasoning={"effort": 5}), "reasoning.effort", T),
    (R, response(text={"verbosity": True}), "text.verbosity", T),
    (R, response(service_tier=["flex"]), "service_tier", T),
    (R, response(include="all"), "include", T),
    # Its tokens would be known only in a later retrieve, charged no tokens (trial 80).
    (R, response(background=True), "background", V),
    # Two sources of earlier turns, which OpenAI refuses together (trial 80).
    (R, response(previous_response_id="resp_1", conversation="conv_1"), "previous_response_id", V),
    (R, response(previous_response_id="resp_1", conversation={"id": "conv_1"}),
     "previous_response_id", V),
    (R, response(background=True, stream=True), "background", V),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "param", "code"), BAD)
def test_wrong_fields_are_refused_naming_the_param(
    endpoint: str, body: dict[str, Any], param: str, code: str
) -> None:
    err = refusal(endpoint, body)
    assert (err.param, err.code) == (param, code), err.message
    assert f"'{param}'" in err.message or err.code == V


def test_long_token_prompts_pass_and_a_wrong_token_is_named() -> None:
    check_fields(P, completion(prompt=list(range(20_000))), False)
    check_fields(E, embedding(input=[list(range(5000)), [2**31 - 1]]), False)
    assert refusal(P, completion(prompt=[*range(9999), -1])).param == "prompt[9999]"
    assert refusal(P, completion(prompt=[*range(10), True])).param == "prompt[10]"
    err = refusal(E, embedding(input=[[1, 2], [3, 2**31]]))
    assert (err.param, err.code) == ("input[1][1]", "integer_above_max_value")
    assert refusal(E, embedding(input=[[1], 2])).param == "input[1]"


def test_integers_wider_than_64_bits_are_out_of_range_on_their_own_side() -> None:
    # orjson reads them as the nearest float: -2**63 - 1 as -2**63, the seed's
    # own minimum, which a comparison would call in range or above it.
    for text, code in (
        (b"-9223372036854775809", "integer_below_min_value"),
        (b"-100000000000000000000000", "integer_below_min_value"),
        (b"18446744073709551616", "integer_above_max_value"),
        (b"100000000000000000000000", "integer_above_max_value"),
        (b"1e19", "integer_above_max_value"),  # a decimal, which no integer names
    ):
        body = orjson.loads(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                            b'"seed": ' + text + b"}")  # fmt: skip
        err = refusal(C, body)
        assert (err.param, err.code) == ("seed", code), err.message
        said = "but got a number outside the 64-bit range instead."
        assert err.message.endswith(said), err.message


def test_messages_are_in_openai_words() -> None:
    assert refusal(C, chat(temperature="hot")).message == (
        "Invalid type for 'temperature': expected a decimal, but got a string instead."
    )
    assert refusal(C, {"model": "m"}).message == "Missing required parameter: 'messages'."
    assert refusal(C, chat(n=0)).message == (
        "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."
    )
    assert refusal(C, chat(messages=[{"role": "wizard", "content": "x"}])).message == (
        "Invalid value: 'wizard'. Supported values are: 'system', 'assistant', 'user', "
        "'function', 'tool', and 'developer'."
    )
    assert refusal(E, embedding(encoding_format="hex")).message == (
        "Invalid value: 'hex'. Supported values are: 'float' and 'base64'."
    )


def test_the_first_wrong_field_in_the_body_is_named() -> None:
    assert refusal(C, chat(n=0, temperature="hot")).param == "n"
    assert refusal(C, {"temperature": "hot", **chat()}).param == "temperature"


def test_every_endpoint_has_rules_and_the_proxys_endpoints_are_among_them() -> None:
    assert set(ENDPOINT_RULES) == {
        "chat.completions",
        "completions",
        "embeddings",
        "rerank",
        "responses",
    }
    assert set(ENDPOINTS) <= set(ENDPOINT_RULES)
    for name, endpoint in ENDPOINTS.items():
        assert endpoint.required in ENDPOINT_RULES[name].required


def test_validate_reads_the_stream_flag_and_treats_null_as_false() -> None:
    endpoint = ENDPOINTS["chat.completions"]
    assert validate(endpoint, chat(stream=True)) is True
    assert validate(endpoint, chat(stream=None)) is False
    assert validate(endpoint, chat()) is False
    with pytest.raises(ApiError) as caught:
        validate(endpoint, chat(stream=1))
    assert (caught.value.param, caught.value.code) == ("stream", "invalid_type")


# ---------------------------------------------------------------- nesting depth


def nested_body(depth: int) -> bytes:
    """A chat body whose deepest value sits `depth` levels down (the body is level 1)."""
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    return b'{"model":"m","messages":[{"role":"user","content":"x"}],"extra":' + inner + b"}"


def test_the_depth_bound_is_exact() -> None:
    assert parse_json(nested_body(MAX_DEPTH))["model"] == "m"
    with pytest.raises(ApiError) as caught:
        parse_json(nested_body(MAX_DEPTH + 1))
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


@pytest.mark.parametrize("depth", [253, 254, 1000, 1024, 1025, 50_000])
def test_deep_bodies_are_refused_with_a_400_before_anything_reads_them(depth: int) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json(nested_body(depth))
    err = caught.value
    assert (err.status, err.code) == (400, "invalid_json")
    assert f"more than {MAX_DEPTH} levels" in err.message


def test_depth_is_counted_in_objects_and_arrays_and_anywhere_in_the_body() -> None:
    deep_objects = b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)
    with pytest.raises(ApiError):
        parse_json(deep_objects)
    # The deep value last, after many shallow ones, in a message: its arrays
    # start at level 4 (body, messages, message), so 62 of them reach level 65.
    shallow = [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 50
    deep: Any = "x"
    for _ in range(MAX_DEPTH - 2):
        deep = [deep]
    body: dict[str, Any] = {
        "model": "m",
        "messages": [*shallow, {"role": "user", "content": "x", "d": deep}],
    }
    with pytest.raises(ApiError):
        parse_json(orjson.dumps(body))
    body["messages"][-1]["d"] = deep[0]
    assert parse_json(orjson.dumps(body))["messages"][-1]["d"] == deep[0]


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    text = "[" * 5000 + "{" * 5000
    body = orjson.dumps(chat(messages=[{"role": "user", "content": text}]))
    assert parse_json(body)["messages"][0]["content"] == text


def test_check_depth_on_a_parsed_value() -> None:
    value: Any = {}
    for _ in range(MAX_DEPTH - 1):
        value = {"k": value}
    raw = orjson.dumps(value)
    check_depth(raw, value)
    with pytest.raises(ApiError):
        check_depth(orjson.dumps([value]), [value])


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


# Strings full of what the byte scan must see through.
_TRICKY = st.text(alphabet='[]{}"\\ax\n\u00e9', max_size=8)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=20,
)


@given(value=_JSON, wrap=st.integers(0, MAX_DEPTH + 2))
def test_the_depth_of_a_body_of_many_arrays_is_found(value: Any, wrap: int) -> None:
    """Bodies of more brackets than the byte scan that judged them once took
    (4,096), all walked now that their containers are bounded."""
    for _ in range(wrap):
        value = [value]
    body = {"pad": [[]] * 4097, "v": value}
    raw = orjson.dumps(body)
    if _depth(body) > MAX_DEPTH:
        with pytest.raises(ApiError):
            check_depth(raw, body)
    else:
        check_depth(raw, body)


@given(value=_JSON, wrap=st.integers(MAX_DEPTH - 3, MAX_DEPTH + 2))
def test_the_walk_of_a_small_body_finds_its_depth(value: Any, wrap: int) -> None:
    """Bodies of more than MAX_DEPTH brackets are walked."""
    for _ in range(wrap):
        value = [{"a": value, "b": "x"}] if wrap % 2 else [value, 1]
    body = {"v": value, "pad": "[" * MAX_DEPTH}  # brackets in a string: no depth
    raw = orjson.dumps(body)
    assert brackets_of(raw) > MAX_DEPTH
    if _depth(body) > MAX_DEPTH:
        with pytest.raises(ApiError):
            check_depth(raw, body)
    else:
        check_depth(raw, body)


# ---------------------------------------------------------------- generated requests
# The chat endpoint's generated requests go through the whole proxy
# (tests/functional/test_validation.py); the others are generated here.

token_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)
words = st.text(min_size=1, max_size=8)
GENERATED: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    P: st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "prompt": st.text(max_size=8)
            | st.lists(st.text(max_size=8), min_size=1, max_size=3)
            | token_ids
            | st.lists(token_ids, min_size=1, max_size=3),
        },
        optional={
            "echo": st.booleans(),
            "suffix": st.text(max_size=5),
            "logprobs": st.integers(0, 5),
            "temperature": st.floats(0, 2),
            "max_tokens": st.integers(0, 2**31 - 1),
            "seed": st.integers(-(2**63), 2**63 - 1),
            "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=8),
            "n": st.integers(1, 5),
            "best_of": st.integers(5, 20),
            "top_k": st.integers(),  # an origin's extension
        },
    ),
    E: st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "input": words
            | st.lists(words, min_size=1, max_size=3)
            | token_ids
            | st.lists(token_ids, min_size=1, max_size=3),
        },
        optional={
            "encoding_format": st.sampled_from(["float", "base64"]),
            "dimensions": st.integers(1, 4096),
            "user": st.text(max_size=8),
        },
    ),
    R: st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "input": st.text(max_size=8)
            | st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "assistant", "system", "developer"]),
                        "content": st.text(max_size=8)
                        | st.lists(
                            st.builds(lambda t: {"type": "input_text", "text": t}, words),
                            max_size=2,
                        ),
                    },
                    optional={"type": st.just("message")},
                ),
                max_size=3,
            ),
        },
        optional={
            "instructions": st.text(max_size=8),
            "max_output_tokens": st.integers(1, 2**31 - 1),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0, 1),
            "store": st.booleans(),
            "truncation": st.sampled_from(["auto", "disabled"]),
            "parallel_tool_calls": st.booleans(),
            "previous_response_id": words,
            "reasoning": st.fixed_dictionaries(
                {}, optional={"effort": st.sampled_from(["low", "medium", "high"])}
            ),
            "text": st.just({"format": {"type": "text"}}),
            "metadata": st.dictionaries(
                st.text(max_size=8), st.text(max_size=8) | st.lists(st.text(max_size=8)), max_size=4
            ),
        },
    ),
}
WRONG: dict[str, dict[str, list[Any]]] = {
    P: {
        "prompt": [5, {}, True, []],
        "echo": ["yes", 1],
        "suffix": [1],
        "logprobs": [(1 << 20) + 1, "1", True],
        "temperature": ["hot", -1],
        "max_tokens": [-1, "1"],
        "seed": [0.5],
        "stop": [5, {}],
        "n": [0, "1"],
    },
    E: {
        "input": ["", [], 5, {}],
        "encoding_format": ["hex", 1],
        "dimensions": [0, "8", 1.5],
        "user": [1],
    },
    R: {
        "input": [5, {}],
        "instructions": [1],
        "max_output_tokens": [0, "1"],
        "temperature": ["hot", -0.5],
        "top_p": [2],
        "store": ["yes"],
        "truncation": ["sometimes"],
        "parallel_tool_calls": [1],
        "previous_response_id": [1, ""],
        "reasoning": ["high"],
        "text": ["json"],
        "metadata": [[], "tags"],
    },
}


@pytest.mark.parametrize("endpoint", [P, E, R])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_generated_requests_pass_and_one_wrong_field_is_named(
    endpoint: str, data: st.DataObject
) -> None:
    body = data.draw(GENERATED[endpoint])
    check_fields(endpoint, body, False)
    name = data.draw(st.sampled_from(sorted(WRONG[endpoint])))
    body[name] = data.draw(st.sampled_from(WRONG[endpoint][name]))
    assert refusal(endpoint, body).param == name


# ---------------------------------------------------------------- bounded cost


def test_containers_and_values_are_counted_outside_strings_only() -> None:
    from dataplane.http.fields import count_outside_strings  # noqa: PLC0415

    # An escaped quote inside a string must not end it.
    raw = json.dumps({"a": [1, 2, {"b": "[{,,}]" * 10}], "c": '"[,'}).encode()
    # Few enough anywhere: the cheap count, strings included, is the answer.
    assert count_outside_strings(raw, (b"[", b"{"), 1000) == 3 + 20 + 1
    # Too many anywhere: the exact count, strings cut out.
    assert count_outside_strings(raw, (b"[", b"{"), 5) == 3
    assert count_outside_strings(raw, (b",", b"[", b"{"), 5) == 3 + 3


# A JSON string, as the cut once found them: the oracle of `outside_strings`.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


@given(value=_JSON)
def test_the_cut_of_strings_is_that_of_a_json_string_pattern(value: Any) -> None:
    """`outside_strings` (a few C passes) cuts exactly what a regular
    expression of a JSON string does, escaped quotes and backslashes in
    keys and values included."""
    for raw in (orjson.dumps(value), json.dumps(value).encode(), json.dumps([value]).encode()):
        assert outside_strings(raw) == _JSON_STRING.sub(b"", raw)


def test_a_body_of_too_many_containers_is_refused_before_its_parse() -> None:
    from dataplane.http.fields import MAX_CONTAINERS, check_containers  # noqa: PLC0415

    many = b'{"x":[' + b",".join([b"[]"] * MAX_CONTAINERS) + b"]}"
    with pytest.raises(ApiError) as refused:
        check_containers(many)
    assert refused.value.status == 400 and refused.value.code == "invalid_json"
    check_containers(b'{"x":[' + b",".join([b"[]"] * (MAX_CONTAINERS - 2)) + b"]}")
    # Brackets inside a string (a prompt of code, say) are text, not containers.
    check_containers(json.dumps({"prompt": "[{" * MAX_CONTAINERS}).encode())


def test_too_many_values_to_key() -> None:
    from dataplane.http.fields import MAX_KEYED_VALUES, too_many_values  # noqa: PLC0415

    assert too_many_values(b'{"x":[' + b",".join([b"1"] * (MAX_KEYED_VALUES + 1)) + b"]}")
    assert not too_many_values(b'{"x":[' + b",".join([b"1"] * 1000) + b"]}")
    assert not too_many_values(json.dumps({"prompt": "a, " * MAX_KEYED_VALUES}).encode())


def test_the_turns_accepted_without_their_rules_are_ones_their_rules_accept() -> None:
    # _message accepts {"role", "content": str} of these roles without running
    # their rules: a rule that came to refuse any such turn (a length limit, a
    # field required) must take the role out of _PLAIN_TURNS.
    for role in _PLAIN_TURNS:
        for content in ("", "x", "a long turn " * 10_000, " \n\t "):
            _ROLES[role]({"role": role, "content": content})  # raises if refused
    # The others need more than a content.
    for role in set(_ROLES) - _PLAIN_TURNS:
        with pytest.raises(ApiError):
            check_fields("chat.completions", {"model": "m", "messages": [
                {"role": role, "content": "x"}]}, stream=False)  # fmt: skip


@pytest.mark.parametrize(
    "turn",
    [
        # A content null or left out is taken (as vLLM takes it); what comes
        # with it is checked still.
        {"role": "user", "content": None, "name": 5},
        {"role": "user", "content": 3},
        {"role": "user", "name": 1},
        {"role": "assistant", "content": None, "tool_calls": "f"},
        {"role": "tool", "content": "x"},
        {"role": "nobody", "content": "x"},
        {"role": ["user"], "content": "x"},
    ],
)
def test_turns_not_plain_are_still_checked(turn: dict[str, object]) -> None:
    with pytest.raises(ApiError):
        check_fields("chat.completions", {"model": "m", "messages": [turn]}, stream=False)


# ---------------------------------------------------------------- tool conversations
# Each turn checked by its role's rules; their order is the origin's to judge
# (trial 97: OpenAI's pairing refused histories vLLM answered).

ASKED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    {"id": "call_b", "type": "custom", "custom": {"name": "g", "input": "x"}},
]}  # fmt: skip
ASKED_AGAIN = {"role": "assistant", "content": "and", "tool_calls": [
    {"id": "call_c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
]}  # fmt: skip
SAID = {"role": "assistant", "content": "done"}


def answer(call_id: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": call_id, "content": "1"}


@pytest.mark.parametrize(
    "messages",
    [
        [USER, ASKED, answer("call_b"), answer("call_a"), SAID, USER],  # answered in any order
        [USER, ASKED, answer("call_a"), answer("call_b"), ASKED_AGAIN, answer("call_c")],
        [USER, ASKED, answer("call_a"), answer("call_a"), answer("call_b")],  # twice: passes
        # The conversation may end before every call is answered: the origin's to judge.
        [USER, ASKED],
        [USER, ASKED, answer("call_b")],
        # The legacy function call and its answer are not paired.
        [USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
         {"role": "function", "name": "f", "content": "1"}, USER],
        [{"role": "function", "name": "f", "content": "1"}, USER],
        [USER, {"role": "assistant", "content": "x", "tool_calls": None}, USER],
        # vLLM's own answer, sent back as a turn (review: refused as OpenAI does).
        [USER, {"role": "assistant", "content": "Hello!", "tool_calls": [],
                "reasoning_content": None}, USER],
        # Out of OpenAI's order, which vLLM leaves to the chat template
        # (trial 97: an agent's history with a call left unanswered).
        [USER, ASKED, USER],
        [USER, ASKED, answer("call_b"), SAID],
        [USER, ASKED, answer("call_a"), ASKED_AGAIN],
        [answer("call_a")],
        [USER, SAID, answer("call_a")],
        [USER, ASKED, answer("call_c")],
        [USER, ASKED, answer("call_a"), answer("call_b"), ASKED_AGAIN, answer("call_a")],
        [USER, ASKED, {"role": "function", "name": "f", "content": "1"}],
    ],
)  # fmt: skip
def test_tool_conversations_in_any_order_pass(messages: list[dict[str, Any]]) -> None:
    check_fields(C, chat(messages=messages, tools=[TOOL]), False)


PROMPT = {"id": "pmpt_123", "version": "2"}


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "name": "lookup"}, {"type": "custom", "name": "grep"}],
)
def test_a_stored_prompts_tools_are_the_origins_to_check(choice: Any) -> None:
    """Trial 71: a Responses request with a stored `prompt` (which can carry
    tools) and a tool_choice needing a tool was refused without `tools`, or
    without that tool in them; the origin knows the prompt's tools. Without a
    prompt, and on chat, the choice is checked as before; with one, its
    shape still is."""
    check_fields(R, response(prompt=PROMPT, tool_choice=choice), False)
    other = [{"type": "function", "name": "f"}]
    check_fields(R, response(prompt=PROMPT, tools=other, tool_choice=choice), False)
    for body in (response(tool_choice=choice), response(prompt=None, tool_choice=choice)):
        assert refusal(R, body).param == "tool_choice"
    if choice != "required":  # a tool named that is not in them
        assert refusal(R, response(tools=other, tool_choice=choice)).param == "tool_choice"
    bad = refusal(R, response(prompt=PROMPT, tool_choice="sometimes"))
    assert (bad.param, bad.code) == ("tool_choice", V)
    # Chat has no stored prompts: a `prompt` there (an origin's own field) changes nothing.
    assert refusal(C, chat(prompt=PROMPT, tool_choice="required")).param == "tool_choice"
    named = {"type": "function", "function": {"name": "lookup"}}
    assert refusal(C, chat(prompt=PROMPT, tools=[TOOL], tool_choice=named)).param == "tool_choice"


def test_no_tools_may_be_an_empty_list() -> None:
    """OpenAI refuses `tools: []`; vLLM, llama.cpp and TGI take it, and agent
    code sends it when it has none (review)."""
    check_fields(C, chat(tools=[]), False)
    check_fields(C, chat(tools=[], tool_choice="auto"), False)


def test_a_wrong_turn_in_a_tool_conversation_is_named_wherever_it_stands() -> None:
    err = refusal(C, chat(messages=[{"role": "user", "content": 5}, answer("call_a")]))
    assert err.param == "messages[0].content"
    err = refusal(C, chat(messages=[answer("call_a"), {"role": "user", "content": 5}]))
    assert err.param == "messages[1].content"
    err = refusal(C, chat(messages=[USER, ASKED, {"role": "tool", "content": "1"}]))
    assert (err.param, err.code) == ("messages[2].tool_call_id", M)
