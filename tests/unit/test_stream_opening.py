"""A stream's opening (dataplane.streaming.opening): when its first bytes
commit it to the client, at its first event of the answer, not at comments
nor a Responses stream's preamble (trial 51); and whether that event is an
error (review 201). Read as the relay's SSE parser reads a stream, however
its bytes come split."""

from __future__ import annotations

from typing import Any

import pytest

from dataplane import jsonio
from dataplane.streaming.opening import Opening
from dataplane.upstream.forwarder import _stream_error, _whole_event_first

CREATED = b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n'
IN_PROGRESS = b'event: response.in_progress\ndata: {"type": "response.in_progress"}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'


def splits(chunk: bytes) -> list[list[bytes]]:
    """`chunk` whole, in two at every cut, and byte by byte."""
    whole = [[chunk]]
    halves = [[chunk[:cut], chunk[cut:]] for cut in range(1, len(chunk))]
    return whole + halves + [[chunk[i : i + 1] for i in range(len(chunk))]]


def fed(chunks: list[bytes], responses: bool) -> Opening:
    opening = Opening(responses)
    for chunk in chunks:
        opening.feed(chunk)
    return opening


@pytest.mark.parametrize(
    ("chunk", "responses", "begun"),
    [
        (b'data: {"id": "c"}\n\n', False, True),
        (b'data: {"id": "c', False, False),  # not whole: what it says is not known
        (b": ping\n\n", False, False),
        (b": ping\r\n\r\n: ping\n\n", False, False),
        (b': ping\n\ndata: {"id": "c"}\n\n', False, True),
        (b"\n", False, False),
        (b"event: message\n", False, False),  # no data line yet
        (b"event: ping\n\n", False, False),  # a name alone is no answer
        (CREATED, True, False),
        (CREATED + IN_PROGRESS, True, False),
        (CREATED.replace(b"\n", b"\r\n") + IN_PROGRESS, True, False),
        (CREATED + IN_PROGRESS + DELTA, True, True),
        (CREATED + b"event: response.output_item.added\ndata: {", True, False),
        (CREATED + b"event: response.in_progress\ndata: {", True, False),
        # No event lines: the data's type says it, once the event is whole.
        (b'data: {"type": "response.created"}\n\n', True, False),
        (b'data: {"type":"response.output_text.delta"}\n\n', True, True),
        (b'data: {"type":"response.output_text.delta"}', True, False),
        (b'event:response.created\ndata: {"type":"response.created"}\n\n', True, False),
        # A chat stream is not read for a preamble: its first data line begins it.
        (CREATED, False, True),
        (b": ping\n\n" + CREATED, True, False),
        # SSE's other line ends, and a byte order mark first (review 199).
        ((CREATED + DELTA).replace(b"\n", b"\r"), True, True),
        ((CREATED + IN_PROGRESS).replace(b"\n", b"\r"), True, False),
        (b": ping\r\rdata: {}\r\r", False, True),
        (b": ping\r\rdata: {}\r", False, False),
        (b"\xef\xbb\xbf: ping\n\ndata: {}\n\n", False, True),
        (b"\xef\xbb\xbf" + CREATED + DELTA, True, True),
        (b"\xef\xbb\xbf" + CREATED + IN_PROGRESS, True, False),
        (CREATED.replace(b"created\n", b"created \n", 1), True, False),  # a name's trailing space
        # Keep-alives some servers send as events: no answer.
        (b"data: \n\n", False, False),
        (b"event: ping\n\ndata:\n\n", False, False),
    ],
)
def test_a_stream_has_begun_at_its_first_event_of_the_answer(
    chunk: bytes, responses: bool, begun: bool
) -> None:
    for chunks in splits(chunk):
        opening = fed(chunks, responses)
        assert opening.begun is begun, chunks
        if begun:  # it stays so: feed() says it with every chunk after
            assert opening.feed(b": more\n\n") is True


def test_feed_says_at_which_chunk_the_answer_began() -> None:
    opening = Opening(responses=True)
    assert opening.feed(b": ping\n\n") is False
    assert opening.feed(CREATED) is False
    assert opening.feed(IN_PROGRESS) is False
    assert opening.feed(DELTA[:-1]) is False  # not whole yet
    assert opening.feed(DELTA[-1:]) is True


@pytest.mark.parametrize(
    ("chunk", "unparsed", "begun"),
    [
        (b'data: {"id": "c", "choices": []}\n\n', True, True),  # nearly every chat stream's
        (b'data:{"id": "c"}\n\ndata: {"id"', True, True),
        (b'data: {"id": "c"}\nid: 4\n\n', True, True),
        (b"data: [DONE]\n\n", True, True),
        (b"data:x\n\n", True, True),
        (b'data: {"id": "c"}\n', False, False),  # no blank line yet
        (b'data: {"id": "c"}', False, False),
        (b'data: {"id": "c"}\r\n\r\n', False, True),  # other line ends: parsed
        (b'data: {"error":\ndata: {}}\n\n', False, True),  # data lines to join: parsed
        (b': ping\n\ndata: {"id": "c"}\n\n', False, True),
        # Data lines with nothing in them: no answer to the parser (review).
        (b"data: \n\n", False, False),
        (b"data:\n\n", False, False),
        (b"data: \nid: 1\n\n", False, False),
        (b"data: \ndata: x\n\n", False, True),
    ],
)
def test_a_first_chunk_taken_as_begun_unparsed_is_one_the_parser_finds_begun(
    chunk: bytes, unparsed: bool, begun: bool
) -> None:
    """forwarder._whole_event_first spares nearly every chat stream the
    parse; what it takes as begun must be so, and a Responses stream is
    always parsed (its preamble)."""
    assert _whole_event_first(chunk, responses=False) is unparsed
    assert fed([chunk], responses=False).begun is begun
    assert not _whole_event_first(chunk, responses=True)


@pytest.mark.parametrize(
    ("chunk", "responses", "error"),
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
        # An event's data lines are one value joined (SSE): an error over two.
        (b'data: {"error":\ndata: {"message": "boom"}}\n\n', False, True),
        (b'data: {"error": {"message": "boom"}}\r\n\r\n', False, True),
        (b"data: not json\n\n", False, False),
        (b'data: ["error"]\n\n', False, False),
    ],
)
def test_a_streams_first_event_of_its_answer_may_be_an_error(
    chunk: bytes, responses: bool, error: bool
) -> None:
    for chunks in splits(chunk):
        found = _stream_error(fed(chunks, responses).first_answer())
        assert (found is not None) is error, chunks


@pytest.mark.parametrize(
    ("chunk", "first"),
    [
        (b": ping\n\n", None),
        (b'data: {"a": 1}', None),  # not whole
        (b'data: {"a": 1}\n\ndata: {"b": 2}\n\n', {"a": 1}),
        (b"event: ping\n\ndata: 3\n\n", 3),
        (b"data: nope\n\n", jsonio.NOT_PARSED),
    ],
)
def test_the_first_answer_is_its_first_whole_events_data(chunk: bytes, first: Any) -> None:
    got = fed([chunk], responses=False).first_answer()
    assert got is first if first is None or first is jsonio.NOT_PARSED else got == first
