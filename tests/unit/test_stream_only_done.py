"""opening.only_done: a stream's first chunk with no event before its
`data: [DONE]` (trial 45), and the first chunks that have one."""

from __future__ import annotations

import pytest

from dataplane.streaming.opening import only_done


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: [DONE]\n\n",
        b"data:[DONE]\n\n",
        b": ping\n\ndata: [DONE]\n\n",
        b"\r\ndata: [DONE]\r\n\r\n",
        b"data: [DONE]\n\n: ping\n\n",
    ],
)
def test_a_first_chunk_of_done_alone_is_no_answer(chunk: bytes) -> None:
    assert only_done(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        b'data: {"choices": []}\n\n',
        b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n',
        b'data: {"choices": [{"delta": {"content": "data: [DONE]"}}]}\n\n',
        b"event: done\ndata: [DONE]\n\n",
        b": ping\n\n",
        # Read to the event that decides, in whatever blocks the chunk has.
        b'data: {"a": 1}\ndata: [DONE]\n\n',
        b"data: [DONE]\n\ndata: {}\n\n",
        b"data: [DONE]\n\ndata: {}",
        b"data: [DONE]\n\ndata: [DONE]\n\n",
    ],
)
def test_a_first_chunk_with_an_event_or_without_done_is_an_answer(chunk: bytes) -> None:
    assert not only_done(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        b"\xef\xbb\xbfdata: [DONE]\n\n",  # a byte order mark first
        b"data: [DONE]",  # its blank line not yet come
        b"data:  [DONE] \r\r",
        # No event of the answer before it, as a stream's opening is read (review).
        b"event: ping\n\ndata: [DONE]\n\n",
        b"data: \n\ndata: [DONE]\n\n",
    ],
)
def test_done_alone_is_known_as_the_parser_reads_it(chunk: bytes) -> None:
    assert only_done(chunk)
