"""bench/relay_loop.py's canned streams: the shapes it measures the relay over."""

from __future__ import annotations

import json

import pytest

from bench.relay_loop import SHAPES, stream_events


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_is_a_chat_stream_of_its_events(shape: str) -> None:
    events = stream_events(3, shape)
    # A role event, 3 content events, the finish, the usage chunk, [DONE].
    assert len(events) == 7
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == [" pong"] * 3
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    nulls = [b'"usage":null' in e for e in events[:-2]]
    assert nulls == [shape != "vllm"] * 5
    if shape == "openai":
        assert all(e.endswith(b'"}\n\n') and b'"obfuscation":"' in e for e in events[:-2])
