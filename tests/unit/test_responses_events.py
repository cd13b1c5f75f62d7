"""dataplane.streaming.responses_events: a whole Responses answer as OpenAI's
event stream, read back by the official openai SDK's own stream state (what
`client.responses.stream` runs on)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from dataplane.streaming.responses_events import response_events


def sdk_event(raw: dict[str, Any]) -> Any:
    """An event as the SDK makes it of what it reads (its own construct_type)."""
    return construct_type(type_=ResponseStreamEvent, value=raw)


def answer(**changes: Any) -> dict[str, Any]:
    response: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "m",
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello there", "annotations": []}],
            },
            {
                "id": "fc_1",
                "type": "function_call",
                "status": "completed",
                "call_id": "call_1",
                "name": "lookup",
                "arguments": '{"q": "x"}',
            },
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 5,
        },
    }
    response.update(changes)
    return response


def events(frames: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in frames.decode().split("\n\n"):
        if not frame:
            continue
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    return out


def test_the_sdk_reads_the_events_into_the_whole_response() -> None:
    frames = response_events(answer())
    assert frames is not None
    got = events(frames)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    texts = []
    for raw in got:
        for parsed in state.handle_event(sdk_event(raw)):
            if parsed.type == "response.output_text.delta":
                texts.append(parsed.delta)
            if parsed.type == "response.completed":
                final = parsed.response
    assert "".join(texts) == "Hello there"
    assert final is not None
    assert final.output_text == "Hello there"
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert got[0]["type"] == "response.created"
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []


@pytest.mark.parametrize(
    ("status", "last"),
    [("incomplete", "response.incomplete"), ("failed", "response.failed")],
)
def test_the_last_event_follows_the_responses_status(status: str, last: str) -> None:
    frames = response_events(answer(status=status))
    assert frames is not None
    assert events(frames)[-1]["type"] == last


@pytest.mark.parametrize(
    "body",
    [
        {"object": "chat.completion", "choices": []},
        {"object": "response"},
        {"object": "response", "output": ["text"]},
    ],
)
def test_what_is_no_whole_response_makes_no_events(body: dict[str, Any]) -> None:
    assert response_events(body) is None
