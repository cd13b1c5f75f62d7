"""forwarder._only_done: a stream's first chunk with no event before its
`data: [DONE]` (trial 45), and the first chunks that have one."""

from __future__ import annotations

import pytest

from dataplane.upstream.forwarder import _only_done


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: [DONE]\n\n",
        b"data:[DONE]\n\n",
        b": ping\n\ndata: [DONE]\n\n",
        b"\r\ndata: [DONE]\r\n\r\n",
    ],
)
def test_a_first_chunk_of_done_alone_is_no_answer(chunk: bytes) -> None:
    assert _only_done(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        b'data: {"choices": []}\n\n',
        b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n',
        b'data: {"choices": [{"delta": {"content": "data: [DONE]"}}]}\n\n',
        b"event: done\ndata: [DONE]\n\n",
        b": ping\n\n",
    ],
)
def test_a_first_chunk_with_an_event_or_without_done_is_an_answer(chunk: bytes) -> None:
    assert not _only_done(chunk)
