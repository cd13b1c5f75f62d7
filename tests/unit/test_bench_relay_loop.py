"""bench/relay_loop.py's canned streams: the shapes it measures the relay over."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.relay_loop import READERS, SHAPES, _relay_once, stream_events
from dataplane.streaming.splice import TranscriptBudget


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


@pytest.mark.parametrize("names", [READERS, ("transcript",), ()])
def test_any_readers_relay_the_stream_the_client_gets_with_all(names: tuple[str, ...]) -> None:
    reads = stream_events(4, "vllm")
    budget = TranscriptBudget()
    every = asyncio.run(_relay_once(reads, budget, True))
    # Without the counter the trim still cuts the usage chunk the client did not ask for.
    assert asyncio.run(_relay_once(reads, budget, True, names)) == every
    assert b'"usage":{' not in every and every.endswith(b"data: [DONE]\n\n")
    assert budget.held == 0
