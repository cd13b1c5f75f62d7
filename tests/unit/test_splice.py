"""Splicing a continuation into a broken stream (pure parts)."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.http.resume import budget_spent
from dataplane.streaming.splice import (
    PROXY_BOUND,
    STREAM_BOUND,
    Splicer,
    Transcript,
    TranscriptBudget,
    continuation_body,
    is_error_event,
    not_continued,
    read_state,
)
from dataplane.streaming.sse import Event

CHAT = "chat.completions"


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None,
          index: int = 0, ident: str = "chatcmpl-1", **extra: Any) -> bytes:  # fmt: skip
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    body = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": 111,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    return json.dumps(body).encode()


def transcript(*events: bytes) -> list[bytes]:
    t = Transcript()
    for data in events:
        t.event(Event(data))
    t.event(Event(b"[DONE]"))  # never kept
    return t.events


def test_state_reads_text_tokens_and_identity() -> None:
    events = transcript(chunk("", role=True), chunk("Hello"), chunk(" wor"), chunk("ld"))
    state = read_state(events, CHAT)
    assert state is not None
    assert (state.id, state.created, state.model) == ("chatcmpl-1", 111, "m")
    assert state.text == {0: "Hello world"}
    assert state.tokens == 3
    assert not state.done and not state.tool_calls


def test_state_knows_a_finished_stream_and_a_tool_call_and_garbage() -> None:
    done = read_state(transcript(chunk("a"), chunk(finish="stop")), CHAT)
    assert done is not None and done.done
    tool = json.loads(chunk())
    tool["choices"][0]["delta"]["tool_calls"] = [{"index": 0, "function": {"arguments": "{"}}]
    state = read_state([json.dumps(tool).encode()], CHAT)
    assert state is not None and state.tool_calls
    assert read_state([b"not json"], CHAT) is None
    assert read_state([b'{"no": "choices"}'], CHAT) is None


def test_chat_continuation_asks_vllm_to_continue_the_final_message() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    state = read_state(transcript(chunk("", role=True), chunk("Hel"), chunk("lo")), CHAT)
    assert state is not None
    out = continuation_body(CHAT, body, state)
    assert out is not None
    assert out["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_tokens"] == 8 and out["stream"] is True
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # the original is kept
    # Nothing said yet: the same request again.
    empty = read_state(transcript(chunk("", role=True)), CHAT)
    assert empty is not None
    again = continuation_body(CHAT, body, empty)
    assert again is not None and "continue_final_message" not in again


def test_completions_continuation_extends_the_prompt() -> None:
    event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " alpha beta", "finish_reason": None}]}  # fmt: skip
    state = read_state([json.dumps(event).encode()], "completions")
    assert state is not None
    out = continuation_body("completions", {"model": "m", "prompt": ["Once"]}, state)
    assert out is not None and out["prompt"] == "Once alpha beta"
    assert continuation_body("completions", {"prompt": [1, 2]}, state) is None


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [], "n": 2},
        {"messages": [], "max_tokens": 2},  # the budget is spent
    ],
)
def test_what_cannot_be_continued(body: dict[str, Any]) -> None:
    state = read_state(transcript(chunk("a"), chunk("b")), CHAT)
    assert state is not None
    assert continuation_body(CHAT, body, state) is None


def test_why_a_stream_is_not_continued_names_the_one_reason() -> None:
    """Trial 45: the log listed every reason there could be."""
    plain = read_state(transcript(chunk("a")), CHAT)
    tool = json.loads(chunk())
    tool["choices"][0]["delta"]["tool_calls"] = [{"index": 0, "function": {"arguments": "{"}}]
    tools = read_state([json.dumps(tool).encode()], CHAT)
    thought = json.loads(chunk())
    thought["choices"][0]["delta"]["reasoning_content"] = "hmm"
    thinking = read_state([json.dumps(thought).encode()], CHAT)
    assert plain is not None and tools is not None and thinking is not None
    assert not_continued({}, plain) == ""
    assert not_continued({}, tools) == "a tool call was being streamed"
    assert not_continued({}, thinking) == "reasoning was streamed"
    assert not_continued({"n": 2}, plain) == "the request asked for several choices"
    assert not_continued({"echo": True}, plain) == "the request echoes its prompt"
    for constrained in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}):
        assert not_continued(constrained, plain) == "the request constrains its output"


def test_splicer_keeps_the_stream_identity_and_drops_the_second_role() -> None:
    state = read_state(transcript(chunk("", role=True), chunk("Hel")), CHAT)
    assert state is not None
    splicer = Splicer(state, 1, (0,), state.tokens)
    assert splicer.rewrite(chunk("", role=True, ident="chatcmpl-2")) is None
    out = json.loads(splicer.rewrite(chunk("lo", ident="chatcmpl-2")) or b"")
    assert out["id"] == "chatcmpl-1" and out["created"] == 111
    assert out["choices"][0]["delta"] == {"content": "lo"}
    assert "ponto" not in out
    final = json.loads(splicer.rewrite(chunk(finish="stop", ident="x")) or b"")
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["ponto"] == {"continued": 1}


def test_splicer_sums_usage_over_every_call() -> None:
    state = read_state(transcript(chunk("a"), chunk("b"), chunk("c")), CHAT)
    assert state is not None
    # Second continuation: the first call started at 0 tokens, the first
    # continuation at 1; this one at 3. Its prompt is the original (10) + 3.
    splicer = Splicer(state, 2, (0, 1), 3)
    usage = {"prompt_tokens": 13, "completion_tokens": 4, "total_tokens": 17}
    out = json.loads(splicer.rewrite(json.dumps({
        "id": "x", "created": 2, "model": "m", "choices": [], "usage": usage,
    }).encode()) or b"")  # fmt: skip
    assert out["usage"] == {
        "prompt_tokens": 13 + 10 + 11,
        "completion_tokens": 3 + 4,
        "total_tokens": 41,
    }
    assert out["ponto"] == {"continued": 2}


def test_error_events_are_cuts() -> None:
    assert is_error_event(b'{"error": {"message": "boom"}}')
    assert is_error_event(b'{"object": "error", "message": "x"}')
    assert not is_error_event(chunk("error"))
    assert is_error_event(b'  {"object":"error","message":"x"}')
    # Only the start of an event says it is an error: "error" further on is content.
    assert not is_error_event(b'{"id": "c", "choices": [], "x": "' + b"." * 40 + b'error"}')
    state = read_state(transcript(chunk("a")), CHAT)
    assert state is not None
    with pytest.raises(ValueError, match="error event"):
        Splicer(state, 1, (0,), 1).rewrite(b'{"error": {"message": "again"}}')


def test_a_stream_cut_before_its_first_whole_event_keeps_the_continuations_identity() -> None:
    state = read_state([], CHAT)
    assert state is not None and not state.done
    out = continuation_body(CHAT, {"messages": [{"role": "user", "content": "x"}]}, state)
    assert out is not None and "continue_final_message" not in out
    first = json.loads(
        Splicer(state, 1, (0,), 0).rewrite(chunk("Hi", role=True, ident="c2")) or b""
    )
    assert first["id"] == "c2"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}


@pytest.mark.parametrize(
    "extra",
    [
        {"echo": True},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        {"guided_json": {"type": "object"}},
        {"max_tokens": 5.0},
    ],
)
def test_requests_whose_continuation_would_change_the_answer_are_not_continued(
    extra: dict[str, Any],
) -> None:
    state = read_state(transcript(chunk("a")), CHAT)
    assert state is not None
    assert continuation_body(CHAT, {"messages": [], **extra}, state) is None
    plain = continuation_body(CHAT, {"messages": [], "response_format": {"type": "text"}}, state)
    assert plain is not None


def test_reasoning_cannot_be_continued() -> None:
    thinking = json.loads(chunk())
    thinking["choices"][0]["delta"]["reasoning_content"] = "Let me think"
    state = read_state([json.dumps(thinking).encode(), chunk("The answer")], CHAT)
    assert state is not None and state.reasoning
    assert continuation_body(CHAT, {"messages": []}, state) is None


def test_a_clients_own_prefill_is_extended_not_followed_by_a_second_message() -> None:
    state = read_state(transcript(chunk(" upon a time")), CHAT)
    assert state is not None
    body = {
        "messages": [{"role": "user", "content": "a story"},
                     {"role": "assistant", "content": "Once"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }  # fmt: skip
    out = continuation_body(CHAT, body, state)
    assert out is not None
    assert out["messages"] == [
        {"role": "user", "content": "a story"},
        {"role": "assistant", "content": "Once upon a time"},
    ]


@pytest.mark.parametrize("thought", [{"content": None}, {}])
def test_a_prefill_without_content_is_extended_as_an_empty_one(thought: dict[str, Any]) -> None:
    # vLLM reads a null or absent content as empty and continues that turn
    # (its reasoning kept): a second assistant turn after it is another prompt.
    state = read_state(transcript(chunk("Paris.")), CHAT)
    assert state is not None
    turn = {"role": "assistant", "reasoning": "The capital...", **thought}
    body = {
        "messages": [{"role": "user", "content": "Capital of France?"}, turn],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    out = continuation_body(CHAT, body, state)
    assert out is not None
    assert out["messages"][1:] == [
        {"role": "assistant", "reasoning": "The capital...", "content": "Paris."}
    ]


@pytest.mark.parametrize("bad", [b'{"choices": [null]}', b'{"choices": [1]}', b"[1, 2]"])
def test_a_continuation_chunk_that_is_not_one_is_a_cut_not_a_crash(bad: bytes) -> None:
    state = read_state(transcript(chunk("a")), CHAT)
    assert state is not None
    with pytest.raises(ValueError, match="not a chunk"):
        Splicer(state, 1, (0,), 1).rewrite(bad)


def test_usage_that_is_not_a_count_is_passed_on_unsummed() -> None:
    state = read_state(transcript(chunk("a")), CHAT)
    assert state is not None
    usage = {"prompt_tokens": -50, "completion_tokens": 5, "total_tokens": -45}
    out = json.loads(Splicer(state, 1, (0,), 1).rewrite(json.dumps(
        {"id": "x", "created": 1, "model": "m", "choices": [], "usage": usage}
    ).encode()) or b"")  # fmt: skip
    assert out["usage"] == usage


def test_a_transcript_past_its_bound_keeps_nothing() -> None:
    t = Transcript()
    big = b"x" * (1 << 20)
    for _ in range(5):
        t.event(Event(big))
    assert t.overflow and t.events == []


def test_transcripts_share_the_processs_bound_and_give_back_what_they_held() -> None:
    # Trial 74: 4 MiB per stream alone let thousands of held streams grow
    # without bound; all transcripts together now keep to the budget's limit.
    budget = TranscriptBudget(limit=250)
    first, second, third = Transcript(budget), Transcript(budget), Transcript(budget)
    first.event(Event(b"a" * 100))
    second.event(Event(b"b" * 100))
    assert budget.held == 200
    third.event(Event(b"c" * 100))  # past the limit: this one stops, the others keep theirs
    assert third.overflow == PROXY_BOUND and third.events == []
    assert first.events == [b"a" * 100] and not first.overflow
    assert budget.held == 200 and budget.dropped == {STREAM_BOUND: 0, PROXY_BOUND: 1}
    third.event(Event(b"c"))  # a stopped transcript keeps nothing more
    assert budget.held == 200
    first.release()  # its stream ended
    assert budget.held == 100
    first.release()  # a second release gives back nothing
    assert budget.held == 100
    fourth = Transcript(budget)
    fourth.event(Event(b"d" * 100))
    assert fourth.events == [b"d" * 100] and budget.held == 200
    for t in (second, third, fourth):
        t.release()
    assert budget.held == 0


def test_a_transcript_past_its_own_bound_gives_its_bytes_back() -> None:
    budget = TranscriptBudget()
    t = Transcript(budget)
    big = b"x" * (1 << 20)
    for _ in range(5):
        t.event(Event(big))
    assert t.overflow == STREAM_BOUND and budget.held == 0
    assert budget.dropped == {STREAM_BOUND: 1, PROXY_BOUND: 0}


@settings(max_examples=300, deadline=None)
@given(
    reads=st.lists(
        st.lists(
            st.sampled_from([b"", b"a", b"x" * 40, b"[DONE]", b" [DONE]", b"y" * 90]).map(Event),
            max_size=6,
        ),
        max_size=6,
    ),
    held=st.integers(0, 200),
    limit=st.integers(0, 400),
    own=st.integers(0, 300),
)
def test_a_transcript_given_whole_reads_keeps_what_it_keeps_given_each_event(
    reads: list[list[Event]], held: int, limit: int, own: int
) -> None:
    # Transcript.read takes a read's events at once (the relay's cut): what it
    # keeps, holds of the budget and which bound stops it, event by event's.
    with mock.patch("dataplane.streaming.splice.MAX_TRANSCRIPT_BYTES", own):
        _read_and_each(reads, held, limit)


def _read_and_each(reads: list[list[Event]], held: int, limit: int) -> None:
    budgets = [TranscriptBudget(limit=limit) for _ in range(2)]
    by_read, by_event = Transcript(budgets[0]), Transcript(budgets[1])
    for budget in budgets:
        budget.held = held
    for events in reads:
        by_read.read(events)
        for ev in events:
            by_event.event(ev)
        assert (by_read.events, by_read.overflow) == (by_event.events, by_event.overflow)
        assert (budgets[0].held, budgets[0].dropped) == (budgets[1].held, budgets[1].dropped)


@pytest.mark.parametrize(
    ("body", "tokens", "spent"),
    [
        ({"max_tokens": 6}, 6, True),
        ({"max_tokens": 6}, 5, False),
        ({"max_completion_tokens": 4, "max_tokens": 9}, 4, True),
        ({}, 100, False),
        ({"max_tokens": 6, "n": 1}, 6, True),
        # Review 46: max_tokens counts per choice; the tokens sent are summed
        # over the choices (three each of two).
        ({"max_tokens": 6, "n": 2}, 6, False),
    ],
)
def test_a_budget_is_spent_by_the_tokens_of_one_choice(
    body: dict[str, Any], tokens: int, spent: bool
) -> None:
    assert budget_spent(body, tokens) is spent
