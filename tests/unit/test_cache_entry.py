"""Cache entries: recording streams, judging answers, replaying either form."""

from __future__ import annotations

import itertools
import json
import random
import sys
from collections.abc import Iterable
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from dataplane import jsonio
from dataplane.cache.entry import (
    CHUNK_OVERHEAD,
    DONE_FRAME,
    ENTRY_OVERHEAD,
    CachedResponse,
    ResponseKind,
    StreamRecorder,
    body_unkept_reason,
    from_completion,
    holds_tool_calls,
    judge_completion,
    split_text,
    to_completion,
    to_sse_chunks,
    unkept_reason,
)
from dataplane.http.errors import stream_broken_event
from dataplane.streaming.sse import Event

NOW = 1000.0
USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


# ---------------------------------------------------------------------------
# Builders of origin answers (the shapes OpenAI and vLLM send)


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "llama-3-8b",
        "system_fingerprint": "fp_1",
        "choices": choices,
        **extra,
    }


def delta(d: dict[str, Any], *, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}


def chat_stream(
    pieces: list[str], *, finish: str = "stop", usage: bool = True, n: int = 1
) -> list[dict[str, Any]]:
    out = [chunk([delta({"role": "assistant", "content": ""}, index=i)]) for i in range(n)]
    for piece in pieces:
        out.extend(chunk([delta({"content": piece}, index=i)]) for i in range(n))
    out.extend(chunk([delta({}, index=i, finish=finish)]) for i in range(n))
    if usage:
        out.append(chunk([], usage=USAGE))
    return out


def tool_stream() -> list[dict[str, Any]]:
    def call(index: int, **fields: Any) -> dict[str, Any]:
        return chunk([delta({"tool_calls": [{"index": index, **fields}]})])

    return [
        chunk([delta({"role": "assistant", "content": None})]),
        call(0, id="call_a", type="function", function={"name": "weather", "arguments": ""}),
        call(0, function={"arguments": '{"city": '}),
        call(1, id="call_b", type="function", function={"name": "time", "arguments": '{"tz"'}),
        call(0, function={"arguments": '"Paris"}'}),
        call(1, function={"arguments": ': "CET"}'}),
        chunk([delta({}, finish="tool_calls")]),
    ]


def sse(payloads: list[dict[str, Any]], *, eol: bytes = b"\n", done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(p) + eol + eol for p in payloads)
    return out + (b"data: [DONE]" + eol + eol if done else b"")


def chat_body(
    content: str | None = "Paris is the capital.", *, finish: str = "stop", **message: Any
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "llama-3-8b",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None, **message},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": USAGE,
    }


def record(data: bytes, **kwargs: Any) -> CachedResponse | None:
    recorder = StreamRecorder(**kwargs)
    recorder.feed(data)
    return recorder.finish(now=NOW)


def recorded(data: bytes, **kwargs: Any) -> CachedResponse:
    entry = record(data, **kwargs)
    assert entry is not None
    return entry


def payloads_of(frames: list[bytes]) -> list[bytes]:
    assert frames[-1] == DONE_FRAME
    out = []
    for f in frames[:-1]:
        assert f.startswith(b"data: ") and f.endswith(b"\n\n") and b"\n" not in f[:-2]
        out.append(f[6:-2])
    return out


def chunks_validate(frames: list[bytes]) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate_json(p) for p in payloads_of(frames)]


# ---------------------------------------------------------------------------
# Recording


def test_records_a_complete_stream_chunk_by_chunk() -> None:
    events = chat_stream(["Paris", " is", " the capital."])
    entry = recorded(sse(events))
    assert entry.streamed and entry.kind is ResponseKind.CHAT
    assert entry.model == "llama-3-8b" and entry.created_at == NOW
    assert entry.chunks == tuple(orjson.dumps(e) for e in events)
    assert entry.usage_only == (len(events) - 1,)
    assert entry.size == ENTRY_OVERHEAD + sum(len(c) + CHUNK_OVERHEAD for c in entry.chunks)


@given(
    pieces=st.lists(st.text(max_size=12), max_size=12),
    n=st.integers(1, 3),
    usage=st.booleans(),
    spread=st.sets(st.integers(0, 40), max_size=6),
)
def test_a_recorded_streams_size_is_the_one_its_chunks_give(
    pieces: list[str], n: int, usage: bool, spread: set[int]
) -> None:
    # The recorder hands its entry the size it counted for max_bytes; the
    # store charges entry.size at a put and takes it off again when the entry
    # leaves, and an entry read back from the region counts it from its
    # chunks: every count must agree, payloads spread over data lines (kept
    # rewritten on one) and texts kept unparsed included, or the bound drifts.
    events = chat_stream(pieces, usage=usage, n=n)
    raw = b""
    for i, event in enumerate(events):
        payload = orjson.dumps(event, option=orjson.OPT_INDENT_2 if i in spread else 0)
        raw += b"data: " + payload.replace(b"\n", b"\ndata: ") + b"\n\n"
    entry = recorded(raw + b"data: [DONE]\n\n")
    assert entry.chunks is not None and len(entry.chunks) == len(events)
    counted = CachedResponse(
        entry.kind,
        NOW,
        entry.model,
        chunks=entry.chunks,
        usage_only=entry.usage_only,
        usage_missing=entry.usage_missing,
    )
    assert entry.size == counted.size and entry == counted


def test_an_entry_counts_its_payload_and_the_objects_around_it() -> None:
    # What the store's byte bound charges (store.SLOT_OVERHEAD beside it): a
    # body's bytes, or each chunk's bytes and CHUNK_OVERHEAD, and the entry's
    # ENTRY_OVERHEAD.
    chunks = (b'{"a": 1}', b"", b"x" * 300)
    streamed = CachedResponse(ResponseKind.CHAT, NOW, "m", chunks=chunks)
    assert streamed.size == ENTRY_OVERHEAD + (8 + CHUNK_OVERHEAD) + CHUNK_OVERHEAD + (
        300 + CHUNK_OVERHEAD
    )
    whole = CachedResponse(ResponseKind.CHAT, NOW, "m", b"y" * 500)
    assert whole.size == ENTRY_OVERHEAD + 500


SPLIT_STREAM = (
    b": keep-alive\r\n\r\n"
    + sse(chat_stream(["Hel", "lo ", "wor", "ld"])[:2], eol=b"\r\n", done=False)
    # A payload over two data lines, CR line endings, a comment inside an event.
    + b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,\r'
    + b": a comment\r"
    + b'data: "model":"m","choices":[{"index":0,"delta":{"content":"!"},"finish_reason":null}]}\r\r'
    + b"event: message\n"
    + sse(chat_stream(["x"])[2:], done=False)
    + b"id: 7\nretry: 10\n\n"
    + b"data:[DONE]\n\n"
)


@given(cuts=st.lists(st.integers(min_value=0, max_value=len(SPLIT_STREAM)), max_size=30))
def test_recording_does_not_depend_on_how_bytes_are_split(cuts: list[int]) -> None:
    whole = recorded(SPLIT_STREAM)
    recorder = StreamRecorder()
    points = [0, *sorted(cuts), len(SPLIT_STREAM)]
    for a, b in itertools.pairwise(points):
        recorder.feed(SPLIT_STREAM[a:b])
    assert recorder.finish(now=NOW) == whole
    assert whole.chunks is not None and len(whole.chunks) == 5
    # The two-line payload is stored as one compact line.
    assert orjson.loads(whole.chunks[2])["choices"][0]["delta"] == {"content": "!"}
    assert b"\n" not in whole.chunks[2]


@given(data=st.data())
def test_every_byte_split_of_a_crlf_stream(data: st.DataObject) -> None:
    raw = sse(chat_stream(["a", "b"], usage=False), eol=b"\r\n")
    cut = data.draw(st.integers(min_value=0, max_value=len(raw)))
    recorder = StreamRecorder()
    recorder.feed(raw[:cut])
    recorder.feed(raw[cut:])
    entry = recorder.finish(now=NOW)
    assert entry is not None and entry.chunks is not None and len(entry.chunks) == 4


def test_byte_by_byte() -> None:
    raw = sse(tool_stream(), eol=b"\r\n")
    recorder = StreamRecorder()
    for i in range(len(raw)):
        recorder.feed(raw[i : i + 1])
    assert recorder.finish(now=NOW) == recorded(raw)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (sse(chat_stream(["a"]), done=False), "no [DONE]"),
        (sse(chat_stream(["a"])[:2]), "a choice has no finish_reason"),
        (
            sse(chat_stream(["a"])[:2], done=False) + stream_broken_event(),
            "an error object",
        ),
        (sse(chat_stream(["a"])[:2]) + b"event: error\ndata: {}\n\n", "an error event"),
        (sse(chat_stream(["a"], finish="length")), "finish_reason 'length'"),
        (sse(chat_stream(["a"], finish="content_filter")), "finish_reason 'content_filter'"),
        (sse(chat_stream(["a"], finish="abort")), "finish_reason 'abort'"),
        (b"data: {not json}\n\n" + DONE_FRAME, "a chunk that is not JSON"),
        (b"data: [1]\n\n" + DONE_FRAME, "a chunk that is not a JSON object"),
        (b'data: {"object":"x"}\n\n' + DONE_FRAME, "a chunk without a list of choices"),
        # A choice that is not an object, in a first chunk and in a later one.
        (b'data: {"choices":[1]}\n\n' + DONE_FRAME, "a chunk without a list of choices"),
        (
            sse(chat_stream(["a"])[:1], done=False)
            + b'data: {"object":"chat.completion.chunk","choices":[{"index":0},"x"]}\n\n'
            + DONE_FRAME,
            "a chunk without a list of choices",
        ),
        (DONE_FRAME, "no chunks"),
        (b"", "no [DONE]"),
        (sse(chat_stream(["a"]), done=False) + b"data: {", "the stream ended inside an event"),
    ],
)
def test_incomplete_or_failed_streams_are_not_kept(raw: bytes, reason: str) -> None:
    recorder = StreamRecorder()
    recorder.feed(raw)
    assert recorder.finish(now=NOW) is None
    assert recorder.reason == reason


def test_truncated_answers_are_kept_only_when_the_tenant_says_so() -> None:
    raw = sse(chat_stream(["a"], finish="length"))
    assert record(raw) is None
    assert record(raw, store_truncated=True) is not None
    assert record(sse(chat_stream(["a"], finish="content_filter")), store_truncated=True) is None


def test_every_choice_must_finish() -> None:
    events = chat_stream(["a", "b"], n=2)
    assert record(sse(events)) is not None
    unfinished = [e for e in events if e["choices"] != [delta({}, index=1, finish="stop")]]
    assert record(sse(unfinished)) is None


def test_a_last_done_without_its_blank_line_is_accepted() -> None:
    raw = sse(chat_stream(["a"]), done=False) + b"data: [DONE]"
    assert record(raw) is not None
    assert record(raw + b"\r") is not None


def test_recording_stops_past_max_bytes() -> None:
    raw = sse(chat_stream(["x" * 100] * 50))
    recorder = StreamRecorder(max_bytes=2000)
    recorder.feed(raw)
    assert recorder.finish(now=NOW) is None
    assert recorder.reason == "larger than 2000 bytes"
    assert record(raw, max_bytes=1_000_000) is not None


def test_chunks_after_done_are_ignored() -> None:
    raw = sse(chat_stream(["a"])) + b'data: {"error": {"message": "late"}}\n\n'
    assert record(raw) == recorded(sse(chat_stream(["a"])))


# ---------------------------------------------------------------------------
# Replaying a stream


def test_a_stream_replays_as_recorded_and_parses_with_the_openai_sdk() -> None:
    events = chat_stream(["Paris", " is", " the capital."])
    raw = sse(events)
    entry = recorded(raw)
    frames = to_sse_chunks(entry, include_usage=True)
    assert b"".join(frames) == raw
    parsed = chunks_validate(frames)
    assert parsed[-1].usage is not None and parsed[-1].usage.total_tokens == 13
    # Without include_usage the usage-only chunk (no choices) is left out.
    frames = to_sse_chunks(entry, include_usage=False)
    assert len(frames) == len(events)
    assert all(c.choices for c in chunks_validate(frames))


def test_a_stream_answers_a_non_streaming_request() -> None:
    entry = recorded(sse(chat_stream(["Paris", " is", " the capital."])))
    body = to_completion(entry)
    completion = ChatCompletion.model_validate_json(body)
    assert completion.id == "chatcmpl-1" and completion.object == "chat.completion"
    assert completion.model == "llama-3-8b" and completion.system_fingerprint == "fp_1"
    (choice,) = completion.choices
    assert choice.message.content == "Paris is the capital."
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert completion.usage is not None and completion.usage.prompt_tokens == 9


def test_tool_calls_are_assembled_by_index() -> None:
    entry = recorded(sse(tool_stream()))
    completion = ChatCompletion.model_validate_json(to_completion(entry))
    message = completion.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]  # type: ignore[union-attr]
    assert calls == [
        ("call_a", "weather", '{"city": "Paris"}'),
        ("call_b", "time", '{"tz": "CET"}'),
    ]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.usage is None


def test_a_tool_call_stream_opened_with_empty_content_has_content_null() -> None:
    # vLLM's first delta is {"role": "assistant", "content": ""}, before tool
    # calls too; its whole answer, as OpenAI's, has content null.
    vllm = tool_stream()
    vllm[0] = chunk([delta({"role": "assistant", "content": ""})])
    message = orjson.loads(to_completion(recorded(sse(vllm))))["choices"][0]["message"]
    assert message["content"] is None
    assert [c["id"] for c in message["tool_calls"]] == ["call_a", "call_b"]
    # Text before the calls is the answer's, and an answer of no text and no
    # call is an empty text.
    said = [vllm[0], chunk([delta({"content": "Checking."})]), *vllm[1:]]
    message = orjson.loads(to_completion(recorded(sse(said))))["choices"][0]["message"]
    assert message["content"] == "Checking."
    empty = orjson.loads(to_completion(recorded(sse(chat_stream([])))))
    assert empty["choices"][0]["message"]["content"] == ""


def test_several_choices_are_assembled_apart() -> None:
    entry = recorded(sse(chat_stream(["a", "b", "c"], n=3)))
    completion = ChatCompletion.model_validate_json(to_completion(entry))
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert {c.message.content for c in completion.choices} == {"abc"}


def test_reasoning_and_logprobs_are_assembled() -> None:
    def lp(token: str) -> dict[str, Any]:
        return {"content": [{"token": token, "logprob": -0.1, "bytes": None, "top_logprobs": []}]}

    events = [
        chunk([delta({"role": "assistant", "reasoning_content": "Think"})]),
        chunk([delta({"reasoning_content": "ing."})]),
        chunk([{**delta({"content": "Hi"}), "logprobs": lp("Hi")}]),
        chunk([{**delta({"content": "!"}), "logprobs": lp("!")}]),
        chunk([delta({}, finish="stop")]),
    ]
    body = orjson.loads(to_completion(recorded(sse(events))))
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Thinking."
    assert choice["message"]["content"] == "Hi!"
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["Hi", "!"]
    ChatCompletion.model_validate(body)


# ---------------------------------------------------------------------------
# Non-streamed answers


def test_a_completion_body_is_kept_and_returned_as_is() -> None:
    raw = orjson.dumps(chat_body())
    entry = from_completion(raw, now=NOW)
    assert entry is not None and not entry.streamed
    assert entry.kind is ResponseKind.CHAT and entry.model == "llama-3-8b"
    assert to_completion(entry) is raw


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        orjson.dumps({"error": {"message": "overloaded"}}),
        orjson.dumps(chat_body(finish="length")),
        orjson.dumps(chat_body(finish="content_filter")),
        orjson.dumps({**chat_body(), "choices": []}),
        orjson.dumps({**chat_body(), "choices": [{"index": 0, "message": {}}]}),
        orjson.dumps({"object": "something"}),
    ],
)
def test_bodies_that_are_not_kept(body: bytes) -> None:
    assert from_completion(body, now=NOW) is None


def test_completion_bounds() -> None:
    raw = orjson.dumps(chat_body(finish="length"))
    assert from_completion(raw, now=NOW, store_truncated=True) is not None
    assert from_completion(orjson.dumps(chat_body()), now=NOW, max_bytes=100) is None


def test_a_completion_replays_as_several_chunks() -> None:
    content = "The capital of France is Paris, which is also its largest city."
    entry = from_completion(orjson.dumps(chat_body(content)), now=NOW)
    assert entry is not None
    frames = to_sse_chunks(entry, include_usage=False)
    parsed = chunks_validate(frames)
    assert len(parsed) >= 5
    assert parsed[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in parsed]
    assert "".join(pieces) == content
    assert sum(1 for p in pieces if p) >= 3
    assert parsed[-1].choices[0].finish_reason == "stop"
    assert all(c.id == "chatcmpl-9" and c.usage is None for c in parsed)
    with_usage = chunks_validate(to_sse_chunks(entry, include_usage=True))
    assert with_usage[-1].choices == [] and with_usage[-1].usage is not None
    assert len(with_usage) == len(parsed) + 1


def test_a_completion_with_tool_calls_replays_them() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    body = chat_body(None, finish="tool_calls", tool_calls=calls)
    entry = from_completion(orjson.dumps(body), now=NOW)
    assert entry is not None
    frames = to_sse_chunks(entry, include_usage=True)
    chunks_validate(frames)
    again = recorded(b"".join(frames))
    assert orjson.loads(to_completion(again)) == body


@given(
    content=st.text(max_size=200),
    include_usage=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
)
def test_round_trip_completion_to_stream_to_completion(
    content: str, include_usage: bool, finish: str
) -> None:
    body = chat_body(content, finish=finish)
    entry = from_completion(orjson.dumps(body), now=NOW, store_truncated=True)
    assert entry is not None
    frames = to_sse_chunks(entry, include_usage=include_usage)
    chunks_validate(frames)
    back = orjson.loads(to_completion(recorded(b"".join(frames), store_truncated=True)))
    if not include_usage:
        body = {k: v for k, v in body.items() if k != "usage"}
    assert back == body
    ChatCompletion.model_validate(back)


@given(pieces=st.lists(st.text(max_size=12), max_size=12), n=st.integers(1, 3))
def test_round_trip_stream_to_completion_to_stream(pieces: list[str], n: int) -> None:
    first = recorded(sse(chat_stream(pieces, n=n)))
    completion = to_completion(first)
    ChatCompletion.model_validate_json(completion)
    entry = from_completion(completion, now=NOW)
    assert entry is not None
    frames = to_sse_chunks(entry, include_usage=True)
    chunks_validate(frames)
    second = recorded(b"".join(frames))
    assert orjson.loads(to_completion(second)) == orjson.loads(completion)


def test_text_completions_stream_and_body() -> None:
    def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }

    events = [text_chunk(" once"), text_chunk(" upon"), text_chunk(" a time", "stop")]
    entry = recorded(sse(events))
    assert entry.kind is ResponseKind.TEXT
    completion = Completion.model_validate_json(to_completion(entry))
    assert completion.choices[0].text == " once upon a time"
    assert completion.choices[0].finish_reason == "stop"

    body_entry = from_completion(to_completion(entry), now=NOW)
    assert body_entry is not None and body_entry.kind is ResponseKind.TEXT
    frames = to_sse_chunks(body_entry, include_usage=False)
    parsed = [orjson.loads(p) for p in payloads_of(frames)]
    assert len(parsed) >= 2
    assert "".join(c["choices"][0]["text"] for c in parsed) == " once upon a time"
    # The SDK builds stream chunks without validation (finish_reason is null until
    # the last); the last one validates as a Completion.
    assert Completion.model_validate(parsed[-1]).choices[0].finish_reason == "stop"
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-1" for c in parsed)


def test_embeddings_are_kept_but_never_streamed() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}],
        "model": "minilm",
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    entry = from_completion(orjson.dumps(body), now=NOW)
    assert entry is not None and entry.kind is ResponseKind.EMBEDDINGS
    CreateEmbeddingResponse.model_validate_json(to_completion(entry))
    with pytest.raises(ValueError):
        to_sse_chunks(entry, include_usage=False)


def test_an_entry_holds_exactly_one_form() -> None:
    with pytest.raises(ValueError):
        CachedResponse(kind=ResponseKind.CHAT, created_at=0, model="m")
    with pytest.raises(ValueError):
        CachedResponse(kind=ResponseKind.CHAT, created_at=0, model="m", body=b"{}", chunks=())


@given(text=st.text(max_size=300))
def test_split_text_keeps_every_character(text: str) -> None:
    pieces = split_text(text)
    assert "".join(pieces) == text
    assert all(len(p) >= 16 for p in pieces[:-1])
    assert all(p for p in pieces)


def test_split_text_cuts_on_whitespace() -> None:
    assert split_text("one two three four five six seven") == [
        "one two three four",
        " five six seven",
    ]


def test_a_usage_chunk_without_choices_is_usage_only() -> None:
    events = [*chat_stream(["a"], usage=False), {"id": "chatcmpl-1", "usage": USAGE}]
    entry = recorded(sse(events))
    assert entry.usage_only == (len(events) - 1,)
    assert len(to_sse_chunks(entry, include_usage=False)) == len(events)
    body = ChatCompletion.model_validate_json(to_completion(entry))
    assert body.usage is not None and body.usage.total_tokens == 13


def test_a_streams_usage_indexes_cost_no_more_than_a_tuple_of_them() -> None:
    # Nearly every recorded stream has a usage-only chunk (the forwarder asks
    # for usage, for its count), and what holds its index is outside the
    # store's count: a frozenset of one index is 216 bytes, its tuple 48.
    events = [*chat_stream(["a"], usage=False), {"id": "chatcmpl-1", "usage": USAGE}]
    entry = recorded(sse(events))
    assert sys.getsizeof(entry.usage_only) <= sys.getsizeof((len(events) - 1,))
    assert sys.getsizeof(recorded(sse(chat_stream(["a"], usage=False))).usage_only) <= (
        sys.getsizeof(())
    )


# ---------------------------------------------------------------------------
# Usage: asked for (stream_options.include_usage) or not


def asked_stream(pieces: list[str]) -> list[dict[str, Any]]:
    """A stream as OpenAI sends it to a client that asked for usage: `usage`
    null on every chunk but the last, then OpenAI's `obfuscation` member."""
    events = chat_stream(pieces)
    return [
        {**e, "obfuscation": "xYz"} if e["choices"] else e
        for e in ({**e, "usage": e.get("usage")} for e in events)
    ]


def test_a_stream_without_usage_for_a_request_that_did_not_ask_cannot_answer_one_that_does() -> (
    None
):
    entry = recorded(sse(chat_stream(["a", "b"], usage=False)))
    assert entry.usage_missing
    assert entry.answers(include_usage=False) and not entry.answers(include_usage=True)


def test_a_stream_that_asked_for_usage_answers_requests_that_ask_whatever_the_origin_sent() -> None:
    # The origin did not send usage though asked: a replay is as good as it.
    entry = recorded(sse(chat_stream(["a"], usage=False)), usage_asked=True)
    assert entry.answers(include_usage=True)
    # Usage on a chunk that has choices too (no usage-only chunk) is usage.
    events = chat_stream(["a"], usage=False)
    events[-1]["usage"] = USAGE
    entry = recorded(sse(events))
    assert entry.usage_only == () and entry.answers(include_usage=True)
    body = from_completion(orjson.dumps(chat_body()), now=NOW)
    assert body is not None and body.answers(include_usage=True)
    with pytest.raises(ValueError, match="stream"):
        CachedResponse(ResponseKind.CHAT, NOW, "m", body=b"{}", usage_missing=True)


def test_a_stream_recorded_with_usage_replays_without_it_to_a_request_that_did_not_ask() -> None:
    events = asked_stream(["Paris", " is", " the capital."])
    raw = sse(events)
    entry = recorded(raw, usage_asked=True)
    assert b"".join(to_sse_chunks(entry, include_usage=True)) == raw
    replay = payloads_of(to_sse_chunks(entry, include_usage=False))
    # No usage member at all, as OpenAI's own answer to such a request; the
    # rest of each chunk byte for byte (its members in their order).
    without = [{k: v for k, v in e.items() if k != "usage"} for e in events[:-1]]
    assert replay == [orjson.dumps(e) for e in without]
    assert all(c.usage is None for c in chunks_validate(to_sse_chunks(entry, include_usage=False)))


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"a":1,"usage":null}', b'{"a":1}'),
        (b'{"usage":null,"a":1}', b'{"a":1}'),
        (b'{"usage":null}', b"{}"),
        (b'{"a": 1, "usage": null, "b": 2}', b'{"a": 1, "b": 2}'),
        (b'{"a": 1 , "usage" : null }', b'{"a": 1 }'),
        # Not top-level, not null, inside a string, or nested beside a top-level one.
        (b'{"c":[{"usage":null}]}', None),
        (b'{"usage":{"total_tokens":3}}', None),
        (b'{"t":"say \\"usage\\":null","a":1}', None),
        (b'{"t":"\\"usage\\":null","usage":null}', b'{"t":"\\"usage\\":null"}'),
        (b'{"c":{"usage":null},"usage":null}', None),
        (b'{"c":{"usage":null},"\\u0075sage":null}', None),
    ],
)
def test_only_a_top_level_usage_null_is_cut_from_a_replayed_chunk(
    payload: bytes, expected: bytes | None
) -> None:
    entry = CachedResponse(ResponseKind.CHAT, NOW, "m", chunks=(payload,))
    (replayed,) = payloads_of(to_sse_chunks(entry, include_usage=False))
    assert replayed == (payload if expected is None else expected)
    assert payloads_of(to_sse_chunks(entry, include_usage=True)) == [payload]


# Keys that hold "usage" other than as the top-level member's.
NEAR_KEYS = ["usage", 'u"sage', "usage\\", 'say "usage', 'x"usage"']

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", *NEAR_KEYS]), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    members=st.dictionaries(st.sampled_from(["id", "choices", *NEAR_KEYS[1:]]), json_values),
    at=st.integers(0, 4),
    spaced=st.booleans(),
)
def test_cutting_usage_null_changes_nothing_else(
    members: dict[str, Any], at: int, spaced: bool
) -> None:
    items = list(members.items())
    items.insert(min(at, len(items)), ("usage", None))
    obj = dict(items)
    payload = json.dumps(obj).encode() if spaced else orjson.dumps(obj)
    entry = CachedResponse(ResponseKind.CHAT, NOW, "m", chunks=(payload,))
    (replayed,) = payloads_of(to_sse_chunks(entry, include_usage=False))
    nested = payload.count(b'"usage"') > 1
    if not nested:
        assert orjson.loads(replayed) == {k: v for k, v in obj.items() if k != "usage"}
    else:  # left whole, or cut only at the top
        assert replayed == payload or orjson.loads(replayed) == {
            k: v for k, v in obj.items() if k != "usage"
        }


def custom_tool_stream() -> list[dict[str, Any]]:
    """A custom tool's call as OpenAI streams it (trial 64): the input in pieces."""

    def call(**fields: Any) -> dict[str, Any]:
        return chunk([delta({"tool_calls": [{"index": 0, **fields}]})])

    return [
        chunk([delta({"role": "assistant", "content": None})]),
        call(id="call_cust1", type="custom", custom={"name": "run_sql", "input": ""}),
        call(custom={"input": "SELECT "}),
        call(custom={"input": "* FROM "}),
        call(custom={"input": "users"}),
        chunk([delta({}, finish="tool_calls")]),
    ]


CUSTOM_CALL = {
    "id": "call_cust1",
    "type": "custom",
    "custom": {"name": "run_sql", "input": "SELECT * FROM users"},
}


def test_a_custom_tool_call_is_assembled_from_its_pieces() -> None:
    # Trial 64: the assembled body held a `function` call with no name and no
    # input, served to every non-streamed repeat.
    entry = recorded(sse(custom_tool_stream()))
    body = orjson.loads(to_completion(entry))
    assert body["choices"][0]["message"]["tool_calls"] == [CUSTOM_CALL]
    assert body["choices"][0]["message"]["content"] is None
    completion = ChatCompletion.model_validate(body)
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.type == "custom" and call.custom.input == "SELECT * FROM users"


def test_function_and_custom_calls_of_one_answer_are_assembled_apart() -> None:
    stream = tool_stream()
    stream[3:3] = [
        chunk([delta({"tool_calls": [{"index": 2, "id": "c", "type": "custom",
                                      "custom": {"name": "sql", "input": "SELECT"}}]})]),
        chunk([delta({"tool_calls": [{"index": 2, "custom": {"name": "sql", "input": " 1"}}]})]),
    ]  # fmt: skip
    calls = orjson.loads(to_completion(recorded(sse(stream))))["choices"][0]["message"][
        "tool_calls"
    ]
    assert [c["type"] for c in calls] == ["function", "function", "custom"]
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert calls[2] == {"id": "c", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}}


def test_a_call_of_an_unknown_type_keeps_its_members_rather_than_a_function() -> None:
    stream = [
        chunk([delta({"role": "assistant", "content": None})]),
        chunk([delta({"tool_calls": [{"index": 0, "id": "x1", "type": "mcp"}]})]),
        chunk([delta({"tool_calls": [{"index": 0, "mcp": {"server": "s", "tool": "t"}}]})]),
        chunk([delta({}, finish="tool_calls")]),
    ]
    calls = orjson.loads(to_completion(recorded(sse(stream))))["choices"][0]["message"][
        "tool_calls"
    ]
    assert calls == [{"id": "x1", "type": "mcp", "mcp": {"server": "s", "tool": "t"}}]


@pytest.mark.parametrize(
    "pieces",
    [
        [{"mcp": {"input": "a"}}, {"mcp": {"input": "b"}}],  # an unknown type in pieces
        [{"function": {"arguments": "{", "extra": "x"}}, {"function": {"extra": "y"}}],
    ],
)
def test_a_tool_call_that_cannot_be_merged_faithfully_is_not_kept(
    pieces: list[dict[str, Any]],
) -> None:
    stream = [
        chunk([delta({"role": "assistant", "content": None})]),
        *(chunk([delta({"tool_calls": [{"index": 0, "id": "x1", **p}]})]) for p in pieces),
        chunk([delta({}, finish="tool_calls")]),
    ]
    recorder = StreamRecorder()
    recorder.feed(sse(stream))
    assert recorder.finish(now=NOW) is None
    assert recorder.reason is not None and "pieces" in recorder.reason


def test_an_empty_id_in_a_later_delta_keeps_the_calls_id() -> None:
    """Review: DashScope (Qwen) sends `"id": ""` in a call's later deltas, and
    the assembled call's id was ""."""
    stream = [
        chunk([delta({"role": "assistant", "content": None})]),
        chunk([delta({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]})]),
        chunk([delta({"tool_calls": [{"index": 0, "id": "", "type": "",
                                      "function": {"name": "", "arguments": "{}"}}]})]),
        chunk([delta({}, finish="tool_calls")]),
    ]  # fmt: skip
    calls = orjson.loads(to_completion(recorded(sse(stream))))["choices"][0]["message"][
        "tool_calls"
    ]
    assert calls == [
        {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]


@pytest.mark.parametrize("one_delta", [False, True])
def test_calls_without_an_index_are_not_merged_into_one(one_delta: bool) -> None:
    """Review: calls sent without `index` all went to slot 0, and two whole
    calls were served as one with both arguments. Which call a later piece
    belongs to is then a guess: the stream is not kept."""
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"b":2}'}},
    ]
    sent = [delta({"tool_calls": calls})] if one_delta else [
        delta({"tool_calls": [call]}) for call in calls
    ]  # fmt: skip
    stream = [
        chunk([delta({"role": "assistant", "content": None})]),
        *(chunk([d]) for d in sent),
        chunk([delta({}, finish="tool_calls")]),
    ]
    recorder = StreamRecorder()
    recorder.feed(sse(stream))
    assert recorder.finish(now=NOW) is None
    assert recorder.reason == "two tool calls at one index"


def test_a_completion_with_a_custom_tool_call_replays_it_and_back() -> None:
    body = chat_body(None, finish="tool_calls", tool_calls=[CUSTOM_CALL])
    entry = from_completion(orjson.dumps(body), now=NOW)
    assert entry is not None
    frames = to_sse_chunks(entry, include_usage=True)
    # Not validated by the SDK's chunk model: it knows only function calls in deltas.
    deltas = [c["delta"] for p in payloads_of(frames) for c in orjson.loads(p)["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls == [{"index": 0, **CUSTOM_CALL}]
    assert orjson.loads(to_completion(recorded(b"".join(frames)))) == body


def test_holds_tool_calls_of_bodies_and_streams() -> None:
    def whole(body: dict[str, Any]) -> CachedResponse:
        entry = from_completion(orjson.dumps(body), now=NOW)
        assert entry is not None
        return entry

    legacy = chat_body(None, finish="function_call", function_call={"name": "f", "arguments": "{}"})
    assert holds_tool_calls(whole(chat_body(None, finish="tool_calls", tool_calls=[CUSTOM_CALL])))
    assert holds_tool_calls(whole(legacy))
    assert holds_tool_calls(recorded(sse(custom_tool_stream())))
    assert holds_tool_calls(recorded(sse(tool_stream())))
    # An empty list or a null (vLLM sends `"tool_calls": []`), and the words in content.
    assert not holds_tool_calls(whole(chat_body("ok", tool_calls=[], function_call=None)))
    assert not holds_tool_calls(whole(chat_body('say "tool_calls": [1]')))
    assert not holds_tool_calls(recorded(sse(chat_stream(['"tool_calls"', "x"]))))


# ---------------------------------------------------------------------------
# Object-valued delta members: audio


def audio_stream(*audio: dict[str, Any]) -> list[dict[str, Any]]:
    """An audio answer as OpenAI's audio models stream it: the transcript and
    the data in pieces, the id first, the expiry last."""
    return [
        chunk([delta({"role": "assistant", "content": None, "refusal": None})]),
        *(chunk([delta({"audio": a})]) for a in audio),
        chunk([delta({}, finish="stop")]),
        chunk([], usage=USAGE),
    ]


AUDIO_PIECES = (
    {"id": "audio_1", "transcript": "hel"},
    {"data": "UklGRg==", "transcript": "lo there"},
    {"data": "AAAA", "expires_at": 1729234747},
)
AUDIO = {
    "id": "audio_1",
    "data": "UklGRg==AAAA",
    "expires_at": 1729234747,
    "transcript": "hello there",
}


def sdk_message(payloads: Iterable[bytes]) -> dict[str, Any]:
    """The message OpenAI's SDK assembles from a stream's chunks."""
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for payload in payloads:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(payload))
    message: dict[str, Any] = state.get_final_completion().choices[0].message.model_dump()
    return message


def test_a_streamed_audio_answer_is_joined_as_the_sdk_joins_it() -> None:
    # A trial (openai 3.x): the non-streamed repeat got the last piece alone,
    # {"data": "AAAA", "expires_at": ...}: no id, no transcript, half the data.
    stream = audio_stream(*AUDIO_PIECES)
    entry = recorded(sse(stream))
    message = orjson.loads(to_completion(entry))["choices"][0]["message"]
    assert message["audio"] == AUDIO
    assert message["content"] is None
    assert sdk_message(map(orjson.dumps, stream[:-1]))["audio"] == AUDIO
    completion = ChatCompletion.model_validate(orjson.loads(to_completion(entry)))
    assert completion.choices[0].message.audio is not None
    assert completion.choices[0].message.audio.transcript == "hello there"


def test_openai_audio_streams_id_twice_and_is_kept_with_it_once() -> None:
    # A captured gpt-4o-audio-preview stream (review 307): the id comes with
    # the first transcript piece and again with the first data piece. The
    # same value again is no piece: kept, and the id is not doubled (the SDK
    # itself joins it into "audio_1audio_1").
    stream = audio_stream(
        {"id": "audio_1", "transcript": "hel"},
        {"id": "audio_1", "data": "UklGRg=="},
        {"transcript": "lo there"},
        {"data": "AAAA", "expires_at": 1729234747},
    )
    message = orjson.loads(to_completion(recorded(sse(stream))))["choices"][0]["message"]
    assert message["audio"] == AUDIO


def test_a_whole_audio_answer_replays_as_a_stream_the_sdk_joins_back() -> None:
    entry = from_completion(orjson.dumps(chat_body(None, audio=AUDIO)), now=NOW)
    assert entry is not None
    payloads = payloads_of(to_sse_chunks(entry, include_usage=False))
    assert sdk_message(payloads)["audio"] == AUDIO
    # And the stream it makes, kept, answers a whole request with it again.
    again = recorded(b"".join(to_sse_chunks(entry, include_usage=True)))
    assert orjson.loads(to_completion(again))["choices"][0]["message"]["audio"] == AUDIO


@pytest.mark.parametrize(
    "members",
    [
        # An object this proxy does not know, in two deltas.
        [{"widget": {"a": "x"}}, {"widget": {"a": "y"}}],
        # audio with a member it takes whole, twice and not the same.
        [{"audio": {"id": "audio_1", "data": "AA"}}, {"audio": {"id": "audio_2", "data": "BB"}}],
        # audio's data as something other than text.
        [{"audio": {"id": "audio_1", "data": {"chunk": 1}}}],
    ],
    ids=["unknown-object", "audio-id-twice", "audio-data-object"],
)
def test_a_delta_object_that_cannot_be_joined_faithfully_is_not_kept(
    members: list[dict[str, Any]],
) -> None:
    stream = [
        chunk([delta({"role": "assistant", "content": ""})]),
        *(chunk([delta(m)]) for m in members),
        chunk([delta({}, finish="stop")]),
    ]
    recorder = StreamRecorder()
    recorder.feed(sse(stream))
    assert recorder.finish(now=NOW) is None
    assert recorder.reason is not None and recorder.reason.startswith("a delta whose")
    assert unkept_reason(recorder.reason) == "incomplete"


def test_an_object_in_one_delta_is_kept_whole_and_choices_are_apart() -> None:
    # Nothing to join: the object is the origin's, as sent. The same member
    # in another choice is that choice's own.
    stream = [
        chunk([delta({"role": "assistant", "content": "hi"}, index=i) for i in (0, 1)]),
        chunk([delta({"widget": {"a": [1]}}, index=i) for i in (0, 1)]),
        chunk([delta({}, index=i, finish="stop") for i in (0, 1)]),
    ]
    body = orjson.loads(to_completion(recorded(sse(stream))))
    assert [c["message"]["widget"] for c in body["choices"]] == [{"a": [1]}] * 2


# ---------------------------------------------------------------------------
# A chunk that differs from the last kept only in its text is kept unparsed


_ROLE = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'  # noqa: E501
_TEXT = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}'  # noqa: E501
_LAST = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'  # noqa: E501
# Texts a parse would take or refuse: escapes, a lone surrogate, raw control
# bytes and quotes, UTF-8 and not, a key's bytes.
_TEXTS = [b"plain", b"", b"a\\nb", b'say \\"hi\\"', b"\\u00e9", b"\\ud800", b"tab\there",
          b"new\nline", b'un"quoted', b"caf\xc3\xa9", b"bad \xff utf8", b"back\\", b"\\x",
          b'"},"finish_reason":"length"}],"x":{"a":"', b"\\/ok", b"\x7f"]  # fmt: skip


def _recorded(payloads: list[bytes], *, unparsed: bool) -> tuple[object, ...]:
    recorder = StreamRecorder(store_truncated=True)
    for data in payloads:
        recorder.event(Event(data))
        if not unparsed:
            recorder._like = None  # the next chunk is parsed
    recorder.event(Event(b"[DONE]"))
    entry = recorder.finish(now=NOW)
    return (recorder.reason, entry and entry.chunks, entry and entry.usage_only)


@pytest.mark.parametrize("second", _TEXTS)
@pytest.mark.parametrize("first", _TEXTS)
def test_a_chunk_kept_unparsed_is_kept_as_parsed(first: bytes, second: bytes) -> None:
    payloads = [_ROLE, _TEXT % first, _TEXT % second, _TEXT % b"third", _LAST]
    assert _recorded(payloads, unparsed=True) == _recorded(payloads, unparsed=False)


def _counting_parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The payloads jsonio.loads is given from now on (the module entry reads
    it from jsonio), in order."""
    parsed: list[bytes] = []
    real = jsonio.loads

    def loads(data: bytes | str) -> Any:
        parsed.append(data if isinstance(data, bytes) else data.encode())
        return real(data)

    monkeypatch.setattr(jsonio, "loads", loads)
    return parsed


def test_chunks_that_differ_in_their_text_alone_are_not_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = _counting_parses(monkeypatch)
    texts = [_TEXT % t for t in (b"one", b" two", b" caf\xc3\xa9", b" \\u00e9")]
    recorder = StreamRecorder()
    for data in [_ROLE, *texts, _LAST, b"[DONE]"]:
        recorder.event(Event(data))
    entry = recorder.finish(now=NOW)
    assert entry is not None and entry.chunks == (_ROLE, *texts, _LAST)
    # The role chunk, the first text (a delta of text alone), the one with
    # a `\\u` escape, and the last.
    assert parsed == [_ROLE, texts[0], texts[3], _LAST]


# Runs of chunks next to each other, as StreamRecorder.datas tells a run of
# chunks like the last kept at once: a text that ends inside an escape and
# one that would end it, a character's UTF-8 cut across two texts, a chunk
# whose text's quotes are one (its head and tail overlap), and _TEXTS' each.
_RUNS = [
    [_TEXT % b"back\\", _TEXT % b"nb"],
    [_TEXT % b"caf\xc3", _TEXT % b"\xa9"],
    [_TEXT % b"a\\\\", _TEXT % b"n"],
    [_TEXT % b"x", (_TEXT % b"").replace(b'"content":""', b'"content":"')],
    *([_TEXT % text, _TEXT % b"after"] for text in _TEXTS),
]


@pytest.mark.parametrize("run", _RUNS)
@pytest.mark.parametrize("max_bytes", [None, 1200])
@pytest.mark.parametrize("whole", [True, False])
def test_a_read_of_chunks_like_the_last_kept_is_kept_as_parsed(
    run: list[bytes], max_bytes: int | None, whole: bool
) -> None:
    # One read's plain events: the role chunk, the chunk the others are like,
    # a run of them holding `run`, a chunk like none and the last (or, not
    # `whole`, the stream ends with the run); a max_bytes that the run passes.
    other = _TEXT.replace(b'"index":0', b'"index":0,"logprobs":null') % b"other"
    payloads = [_ROLE, _TEXT % b"first", _TEXT % b"second", _TEXT % b"more", *run]
    payloads += [_TEXT % b"most", other, _LAST] if whole else [_TEXT % b"most"]
    by_datas = StreamRecorder(store_truncated=True, max_bytes=max_bytes)
    by_datas.datas(payloads)
    parsed = StreamRecorder(store_truncated=True, max_bytes=max_bytes)
    for data in payloads:
        parsed.event(Event(data))
        parsed._like = None  # the next chunk is parsed
    if whole:
        for recorder in (by_datas, parsed):
            recorder.event(Event(b"[DONE]"))
    assert _entry_of(by_datas) == _entry_of(parsed)


# Pieces of a chunk's text: escapes cut at either end, the join's byte `a`,
# UTF-8 cut across two, quotes and control bytes, a key's bytes.
_PIECES = [b"", b"a", b"\\", b"\\\\", b"\\n", b"n", b"\\u00", b"\\u00e9", b"00e9", b'"', b"\t",
           b"\n", b"\x00", b"\x7f", b"\xc3", b"\xa9", b"\xff", b"\xed\xa0\x80", b"\\x", b"/",
           b'"},"finish_reason":"length"}],"x":{"a":"']  # fmt: skip
# What a chunk of a run may differ in before its text (an index, a role,
# logprobs, its id) or after it (its finish or none, usage, a tool call,
# spacing), or a text whose quotes are one (its head and tail overlap).
_CHANGES = [(b'"index":0', b'"index":1'), (b'"delta":{', b'"delta":{"role":"user",'),
            (b'"index":0', b'"index":0,"logprobs":null'), (b'"id":"c"', b'"id":"ca"'),
            (b'"finish_reason":null', b'"finish_reason":"length"'), (b"]}", b"] }"),
            (b',"finish_reason":null', b""), (b'"index":0', b'"index":2'),
            (b"]}", b'],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'),
            (b'"}', b'","tool_calls":[{"index":0,"id":"t","function":{"name":"f"}}]}'),
            (b'"content":""', b'"content":"')]  # fmt: skip


def _fuzzed_text(rng: random.Random) -> bytes:
    # Plain but for a piece at either end now and then, so that most runs
    # hold none or one: a run is told at once only when each of it passes.
    text = b"plain a"[: rng.randint(0, 7)]
    if rng.random() < 0.12:
        piece = rng.choice(_PIECES)
        text = text + piece if rng.random() < 0.5 else piece + text
    return text


@pytest.mark.parametrize("seed", range(300))
def test_reads_of_fuzzed_chunks_are_kept_as_parsed(seed: int) -> None:
    # Streams cut into reads at random, with a max_bytes met exactly at a
    # read's end, one byte short of it or over it: `datas` keeps and refuses
    # what the chunks parsed one by one do.
    rng = random.Random(seed)
    payloads = [_ROLE]
    for _ in range(rng.randint(2, 40)):
        payload = _TEXT % _fuzzed_text(rng)
        if rng.random() < 0.1:
            payload = payload.replace(*rng.choice(_CHANGES), 1)
        payloads.append(payload)
    if seed % 5:
        payloads.append(_LAST)  # or the stream ends inside a run
    ends = [0]
    while ends[-1] < len(payloads):
        ends.append(min(len(payloads), ends[-1] + rng.choice([2, 4, 8, 16, len(payloads)])))
    max_bytes: int | None = None
    if seed % 4:
        kept = sum(len(p) + CHUNK_OVERHEAD for p in payloads[: rng.choice(ends[1:])])
        max_bytes = ENTRY_OVERHEAD + kept + rng.choice([-1, 0, 1])
    store_truncated = seed % 3 == 0
    by_datas = StreamRecorder(store_truncated=store_truncated, max_bytes=max_bytes)
    parsed = StreamRecorder(store_truncated=store_truncated, max_bytes=max_bytes)
    for start, end in itertools.pairwise(ends):
        by_datas.datas(payloads[start:end])
        for data in payloads[start:end]:
            parsed.event(Event(data))
            parsed._like = None  # the next chunk is parsed
    for recorder in (by_datas, parsed):
        recorder.event(Event(b"[DONE]"))
    got, want = by_datas.finish(now=NOW), parsed.finish(now=NOW)
    assert (by_datas.reason, by_datas.too_large, got) == (parsed.reason, parsed.too_large, want)


# OpenAI's chunks: a null usage, then an `obfuscation` string that differs
# in each (its value after the text's).
def _openai(payload: bytes, value: bytes) -> bytes:
    return payload[:-1] + b',"usage":null,"obfuscation":"' + value + b'"}'


_VALUES = [b"aB3x", b"", b"x\\\"y", b"\\u0041", b'un"quoted', b"\\x", b"tab\tx", b"bad \xff",
           b'","choices":[{"index":0,"finish_reason":"length"}],"x":"']  # fmt: skip


@pytest.mark.parametrize("value", _VALUES)
@pytest.mark.parametrize("text", _TEXTS)
def test_an_openai_chunk_kept_unparsed_is_kept_as_parsed(text: bytes, value: bytes) -> None:
    # The chunk before it has another text and value; values a parse takes and refuses.
    payloads = [
        _openai(_ROLE, b"r"),
        _openai(_TEXT % b"first", b"o1"),
        _openai(_TEXT % text, value),
        _openai(_TEXT % b"third", value + b"3"),
        _TEXT % b"no obfuscation",
        _openai(_TEXT % b"fifth", b"o5"),
        _openai(_LAST, b"l"),
    ]
    assert _recorded(payloads, unparsed=True) == _recorded(payloads, unparsed=False)
    # `datas`, `read`'s twin, given them as one read's plain events.
    by_datas = StreamRecorder(store_truncated=True)
    by_datas.datas(payloads)
    by_datas.event(Event(b"[DONE]"))
    entry = by_datas.finish(now=NOW)
    recorded = (by_datas.reason, entry and entry.chunks, entry and entry.usage_only)
    assert recorded == _recorded(payloads, unparsed=False)


# Ends an OpenAI chunk like the last kept may have in place of its string's
# closing quote and brace: the object not closed, or closed otherwise.
_ENDS = [b"x}", b'"]', b'"', b"}", b'"}}', b'"}x']


@pytest.mark.parametrize("ending", _ENDS)
def test_an_openai_chunk_like_the_last_but_for_its_end_is_parsed(ending: bytes) -> None:
    # Its text and the bytes up to its obfuscation value are the last kept
    # chunk's shape; what follows the value is not `"}`: a parse refuses it.
    like = _openai(_TEXT % b"second", b"o2")[:-2] + ending
    payloads = [_openai(_ROLE, b"r"), _openai(_TEXT % b"first", b"o1"), like, _openai(_LAST, b"l")]
    recorded = _recorded(payloads, unparsed=False)
    assert recorded[0] == "a chunk that is not JSON"
    assert _recorded(payloads, unparsed=True) == recorded
    by_datas = StreamRecorder(store_truncated=True)
    by_datas.datas(payloads)
    by_datas.event(Event(b"[DONE]"))
    assert by_datas.finish(now=NOW) is None and by_datas.reason == recorded[0]


def test_openai_chunks_that_differ_in_their_text_and_obfuscation_alone_are_not_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = _counting_parses(monkeypatch)
    texts = [_openai(_TEXT % t, v) for t, v in ((b"one", b"ab"), (b" two", b"c"), (b"3", b""))]
    recorder = StreamRecorder()
    for data in [_openai(_ROLE, b"xyz"), *texts, _openai(_LAST, b"q"), b"[DONE]"]:
        recorder.event(Event(data))
    entry = recorder.finish(now=NOW)
    assert entry is not None and entry.chunks == (
        _openai(_ROLE, b"xyz"),
        *texts,
        _openai(_LAST, b"q"),
    )
    assert parsed == [_openai(_ROLE, b"xyz"), texts[0], _openai(_LAST, b"q")]


_USAGE = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'  # noqa: E501
_SAME = Event(_TEXT % b"same")
_NAMED_ERROR = Event(_TEXT % b"an error", b"error")
_DONE = Event(b"[DONE]")
# A tail as long as the last kept's, not its bytes: not JSON.
_BAD_TAIL = Event(_TEXT.replace(b"null}]}", b"nul!}]}") % b"same length")
# Events a stream may hold: chunks of text (like the last kept or not),
# others parsed, named ones (an error too), empty ones, [DONE] and past it.
_EVENTS = [
    Event(_ROLE),
    *(Event(_TEXT % t) for t in _TEXTS),
    *[_SAME] * 4,
    Event(_LAST),
    Event(_USAGE),
    Event(_TEXT % b"named", b"message"),
    _NAMED_ERROR,
    Event(b""),
    Event(b"not json"),
    Event(_TEXT.replace(b'"delta"', b'\n"delta"') % b"two lines"),
    # A tail as long as the last kept's, not its bytes: not JSON.
    _BAD_TAIL,
    _DONE,
    Event(b" [DONE] "),
]


def _entry_of(recorder: StreamRecorder) -> tuple[object, ...]:
    entry = recorder.finish(now=NOW)
    return (recorder.reason, recorder.too_large, entry and (entry.chunks, entry.size))


# A chunk like the last kept after [DONE] in the same read, one named error,
# chunks like the last kept in one run of plain events (their size counted),
# and in one such run chunks that look like it but are not (not UTF-8, not
# its tail).
@example(events=[_SAME, Event(_LAST), _DONE, _SAME], cuts=[1], max_bytes=None)
@example(events=[_SAME, _NAMED_ERROR, _DONE], cuts=[], max_bytes=None)
@example(events=[Event(_ROLE), _SAME, _SAME, _SAME, Event(_LAST), _DONE], cuts=[], max_bytes=None)
@example(events=[_SAME, Event(_TEXT % b"bad \xff utf8"), _DONE], cuts=[], max_bytes=None)
@example(events=[_SAME, _BAD_TAIL, _DONE], cuts=[], max_bytes=None)
@settings(max_examples=600, deadline=None)
@given(
    events=st.lists(st.sampled_from(_EVENTS), max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=6),
    max_bytes=st.one_of(st.none(), st.integers(0, 3000)),
)
def test_a_recorder_given_whole_reads_records_what_it_records_given_each_event(
    events: list[Event], cuts: list[int], max_bytes: int | None
) -> None:
    # StreamRecorder.read, the relay's whole reads (a ReadSink), and
    # StreamRecorder.datas, its plain events (a DataSink), keep the chunks,
    # size and verdict `event` keeps, however the events are read, and
    # those of a recorder that parses every chunk.
    bounds = [0, *sorted(cuts), len(events)]
    by_read, by_event, parsed, by_datas = (StreamRecorder(max_bytes=max_bytes) for _ in range(4))
    for start, end in itertools.pairwise(bounds):
        by_read.read(events[start:end])
        _give(by_datas, events[start:end])
    for ev in events:
        by_event.event(ev)
        parsed.event(ev)
        parsed._like = None  # the next chunk is parsed
    assert _entry_of(by_read) == _entry_of(by_event) == _entry_of(parsed) == _entry_of(by_datas)


def _give(recorder: StreamRecorder, events: list[Event]) -> None:
    """`events` as the events relay gives a read's: its runs of unnamed
    events, none [DONE] nor with a usage key but in a null usage (a
    DataSink's contract), to `datas` (its loop is `read`'s twin, kept apart
    for speed), the others to `read`."""
    run: list[bytes] = []
    for ev in events:
        if (
            not ev.name
            and not ev.done
            and ev.data.replace(b'"usage":null', b"").find(b'"usage"') < 0
        ):
            run.append(ev.data)
            continue
        if run:
            recorder.datas(run)
            run = []
        recorder.read([ev])
    if run:
        recorder.datas(run)


_FINISHES = st.sampled_from([None, "stop", "length", "content_filter", "tool_calls"])
_CHOICE = st.one_of(
    st.builds(lambda f: {"message": {"content": "a"}, "finish_reason": f}, _FINISHES),
    st.builds(lambda f: {"text": "a", "finish_reason": f}, _FINISHES),
    st.just("not a choice"),
)


@settings(max_examples=300)
@given(
    choices=st.lists(_CHOICE, max_size=3),
    kind=st.sampled_from([{"object": "chat.completion"}, {"object": "text_completion"}, {}]),
    store_truncated=st.booleans(),
)
def test_a_whole_answer_not_kept_is_judged_as_its_body_says(
    choices: list[Any], kind: dict[str, str], store_truncated: bool
) -> None:
    """judge_completion keeps what every choice's finish allows, and the
    reason it gives for one it does not keep is body_unkept_reason's (the
    cache asks that only when judge_completion gives none)."""
    obj = {**kind, "model": "m", "choices": choices}
    body = json.dumps(obj).encode()
    entry, unkept = judge_completion(
        body, now=NOW, store_truncated=store_truncated, max_bytes=1 << 20, parsed=obj
    )
    allowed = {"stop", "tool_calls", "length"} if store_truncated else {"stop", "tool_calls"}
    finished = all(isinstance(c, dict) and c["finish_reason"] in allowed for c in choices)
    # Each choice holds what its kind's choices hold: a chat choice its message,
    # a completion's its text (a chat completion's "text" is none of it).
    first = choices[0] if choices else None
    chat = kind.get("object") == "chat.completion" or (
        isinstance(first, dict) and "message" in first
    )
    held = all(isinstance(c, dict) and ("message" if chat else "text") in c for c in choices)
    assert (entry is not None) == (bool(choices) and finished and held)
    if entry is not None:
        assert unkept is None
    elif unkept is not None or (kind and held):
        # A completion whose choices are all choices: judged once.
        assert unkept == body_unkept_reason(
            body, obj, max_bytes=1 << 20, store_truncated=store_truncated
        )


@pytest.mark.parametrize("finish", [[], {"type": "stop"}, ["stop"], 1, True])
def test_a_finish_reason_that_is_no_string_is_not_kept_and_raises_nothing(finish: Any) -> None:
    """An origin's finish_reason that is no string (a list or an object: not
    hashable) is no natural finish: its answer, whole or streamed, is not kept
    and judged incomplete, with nothing raised (before, a list or an object
    raised a TypeError out of the set's test: a 500 for a whole answer, a
    traceback at a stream's end)."""
    body = chat_body()
    body["choices"][0]["finish_reason"] = finish
    raw = json.dumps(body).encode()
    for store_truncated in (False, True):
        assert judge_completion(
            raw, now=NOW, store_truncated=store_truncated, max_bytes=1 << 20
        ) == (None, "incomplete")
        assert (
            body_unkept_reason(raw, body, max_bytes=1 << 20, store_truncated=store_truncated)
            == "incomplete"
        )
        stream = chat_stream(["a"])
        stream[-2]["choices"][0]["finish_reason"] = finish
        assert record(sse(stream), store_truncated=store_truncated) is None
