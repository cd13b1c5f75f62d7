"""When a stream's first bytes commit it to the client (forwarder._begun):
at its first event of the answer, not at comments nor a Responses stream's
preamble (trial 51)."""

from __future__ import annotations

import pytest

from dataplane.upstream.forwarder import _begun, _first_event_error

CREATED = b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n'
IN_PROGRESS = b'event: response.in_progress\ndata: {"type": "response.in_progress"}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'


@pytest.mark.parametrize(
    ("chunk", "preamble", "begun"),
    [
        (b'data: {"id": "c"}\n\n', False, True),
        (b'data: {"id": "c', False, True),  # a data line not yet whole: begun
        (b": ping\n\n", False, False),
        (b": ping\r\n\r\n: ping\n\n", False, False),
        (b': ping\n\ndata: {"id": "c"}\n\n', False, True),
        (b"\n", False, False),
        (b"event: message\n", False, False),  # no data line yet
        (CREATED, True, False),
        (CREATED + IN_PROGRESS, True, False),
        (CREATED.replace(b"\n", b"\r\n") + IN_PROGRESS, True, False),
        (CREATED + IN_PROGRESS + DELTA, True, True),
        (CREATED + b"event: response.output_item.added\ndata: {", True, True),
        # No event lines: the data's type says it.
        (b'data: {"type": "response.created"}\n\n', True, False),
        (b'data: {"type":"response.output_text.delta"}\n\n', True, True),
        (b'event:response.created\ndata: {"type":"response.created"}\n\n', True, False),
        # A chat stream is not read for a preamble: its first data line begins it.
        (CREATED, False, True),
        (b": ping\n\n" + CREATED, True, False),
        # SSE's other line ends, and a byte order mark first (review 199).
        ((CREATED + DELTA).replace(b"\n", b"\r"), True, True),
        ((CREATED + IN_PROGRESS).replace(b"\n", b"\r"), True, False),
        (b": ping\r\rdata: {", False, True),
        (b"\xef\xbb\xbf: ping\n\ndata: {", False, True),
        (b"\xef\xbb\xbf" + CREATED + DELTA, True, True),
    ],
)
def test_a_stream_has_begun_at_its_first_event_of_the_answer(
    chunk: bytes, preamble: bool, begun: bool
) -> None:
    path = "/responses" if preamble else "/chat/completions"
    assert _begun(chunk, path) is begun
    assert _begun(bytearray(chunk), path) is begun


@pytest.mark.parametrize(
    ("chunk", "preamble", "error"),
    [
        (b'data: {"error": {"message": "boom"}}\n\n', False, True),
        # A chunk whose error is null, or beside choices, is an answer (review 205).
        (b'data: {"id": "c", "choices": [{"delta": {}}], "error": null}\n\n', False, False),
        (b'data: {"choices": [{"delta": {"content": "x"}}], "error": {"m": 1}}\n\n', False, False),
        (b'data: {"error": {"message": "boom"}', False, False),  # not whole yet
        (b"\xef\xbb\xbf" + b'data: {"error": {"message": "boom"}}\n\n', False, True),  # a BOM
        (b": OPENROUTER PROCESSING\n\n" * 25 + b'data: {"error": {"m": "x"}}\n\n', False, True),
        (CREATED + b'event: error\ndata: {"type": "error", "message": "m"}\n\n', True, True),
        (CREATED + DELTA, True, False),
    ],
)
def test_a_streams_first_event_of_its_answer_may_be_an_error(
    chunk: bytes, preamble: bool, error: bool
) -> None:
    assert (_first_event_error(chunk, preamble) is not None) is error
