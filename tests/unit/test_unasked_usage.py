"""The usage the proxy asks origins for on behalf of clients that did not
(dataplane.streaming.usage: with_usage_asked, for_unasked) and the relays'
`trim`, which keeps it from them (dataplane.streaming.relay)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from dataplane.streaming.relay import relay
from dataplane.streaming.sse import Event, SseParser
from dataplane.streaming.usage import (
    UsageCounter,
    _null_cut_parsed,
    for_unasked,
    with_usage_asked,
    without_usage_asked,
    without_usage_null,
)
from tests.unit.test_stream_relay import Content


def test_a_body_without_stream_options_gets_them_after_its_brace() -> None:
    raw = b' {"model": "m", "stream": true}'
    sent = with_usage_asked(json.loads(raw), raw)
    assert sent == b' {"stream_options":{"include_usage":true},"model": "m", "stream": true}'
    assert json.loads(sent)["stream_options"] == {"include_usage": True}


def test_the_clients_bytes_come_back_from_the_spliced_ones() -> None:
    # For an origin that refuses stream_options: the proxy keeps only the
    # spliced bytes of a large body, and makes the client's again from them.
    raw = b' {"model": "m", "stream": true, "messages": [{"content": "{x}"}]}'
    assert without_usage_asked(with_usage_asked(json.loads(raw), raw)) == raw


@pytest.mark.parametrize(
    ("options", "asked"),
    [
        (None, {"include_usage": True}),
        ({"include_usage": False}, {"include_usage": True}),
        ({"include_obfuscation": True}, {"include_obfuscation": True, "include_usage": True}),
        # Without include_usage it did nothing; with it, a usage in every chunk.
        ({"continuous_usage_stats": True}, {"include_usage": True}),
    ],
)
def test_a_body_with_stream_options_keeps_the_clients_others(
    options: Any, asked: dict[str, Any]
) -> None:
    body = {"model": "m", "stream": True, "stream_options": options}
    raw = json.dumps(body).encode()
    for given in (raw, None):  # as sent, or rewritten by the proxy
        sent = json.loads(with_usage_asked(body, given))
        assert sent == {**body, "stream_options": asked}
    assert body["stream_options"] == options  # the client's body is left as it was


def test_a_rewritten_body_is_encoded_with_its_changes() -> None:
    body = {"model": "alias-resolved", "stream": True}
    sent = with_usage_asked(body, None)
    assert json.loads(sent) == {**body, "stream_options": {"include_usage": True}}


def chunk(**fields: Any) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", **fields}).encode()


CHOICE = [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]
USAGE = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


def test_for_unasked() -> None:
    plain = chunk(choices=CHOICE)
    assert for_unasked(plain) is plain
    assert for_unasked(chunk(choices=[], usage=USAGE)) is None
    assert for_unasked(json.dumps({"usage": USAGE}).encode()) is None  # choices left out
    # OpenAI's mark on every other chunk goes, byte for byte otherwise.
    assert for_unasked(chunk(choices=CHOICE, usage=None)) == plain
    compact = b'{"id":"c","choices":[],"usage":null}'
    assert for_unasked(compact) == b'{"id":"c","choices":[]}'
    # A usage on a chunk with choices is left (see for_unasked).
    finishing = chunk(choices=CHOICE, usage=USAGE)
    assert for_unasked(finishing) is finishing
    # No JSON with a null usage elsewhere than last: left as it came, not a failure.
    for broken in (b'{"usage":null', b'"usage":null}', b'{"usage":null, oops'):
        assert for_unasked(broken) is broken


def test_the_counters_trim_is_for_unasked() -> None:
    # Of the event it counted last without searching it again, of any
    # other data as for_unasked makes it.
    plain, usage = chunk(choices=CHOICE), chunk(choices=[], usage=USAGE)
    datas = [
        plain,
        usage,
        chunk(choices=CHOICE, usage=None),
        chunk(choices=CHOICE, usage=USAGE),
        b'{"usage": {"prompt_tokens": 1} no JSON',
        OPENAI,
        # Null usages last: one, two keys (left whole), the key's end alone.
        b'{"id":"c","choices":[],"usage":null}',
        b'{"x":{"usage":1},"usage":null}',
        b'{"x":1,usage":null}',
        b'x,"usage":null}',
    ]
    counter = UsageCounter()
    for data, other in itertools.product(datas, datas):
        counter.event(Event(data))
        assert counter.unasked(data) == for_unasked(data)
        assert counter.unasked(bytes(bytearray(other))) == for_unasked(other)
    counter.event(Event(plain))
    assert counter.unasked(usage) is None


# OpenAI's chunk of a stream asked for usage: the null usage, then its last
# member, `obfuscation`.
OPENAI = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],'
    b'"usage":null,"obfuscation":"aB3x"}'
)


@pytest.mark.parametrize(
    "payload",
    [
        OPENAI,
        OPENAI.replace(b'"aB3x"', b'""'),
        OPENAI.replace(b'"aB3x"', b'"a\\"b"'),  # escapes in the last string
        OPENAI.replace(b'"aB3x"', b'"a\\u0041"'),
        OPENAI.replace(b'"hi"', b'"\\u0068i"'),  # an escape elsewhere
        OPENAI.replace(b'"aB3x"}', b'"aB3x" }'),
        OPENAI.replace(b'"aB3x"}', b'"aB3x","x":1}'),
        OPENAI.replace(b'"usage":null', b'"usage": null'),
        b'{"usage":null,"obfuscation":"z"}',
        b'{"x\\"usage":null,"obfuscation":"z"}',  # the key is `x"usage`
        b'{"a":{"usage":null,"obfuscation":"z"}}',
        b'{"a":{"usage":null,"obfuscation":"z"},"b":"c"}',
        b'{"\\u0075sage":1,"usage":null,"obfuscation":"z"}',
        b'[{"usage":null,"obfuscation":"z"}]',
    ],
)
def test_a_null_usage_before_the_last_string_is_cut_as_a_parse_cuts_it(payload: bytes) -> None:
    # The cut without a parse (OpenAI's chunks) against the parse's, which
    # any payload that it does not take gets.
    at = payload.find(b'"usage"')
    assert without_usage_null(payload) == _null_cut_parsed(payload, at)


def test_openais_null_usage_is_cut_from_its_chunks() -> None:
    assert without_usage_null(OPENAI) == OPENAI.replace(b'"usage":null,', b"")


# An origin's chunks that are not JSON, with a null usage the parse is asked
# to find: elsewhere than last, and in OpenAI's place but with escapes.
NOT_JSON = [
    b'{"x":tru,"usage":null,"y":1}',
    b'{"usage":null,"obfuscation":"\xff\\u0001"}',
    b'{"usage":null , "obfuscation":"z"',
]


@pytest.mark.parametrize("payload", NOT_JSON)
def test_a_null_usage_in_a_chunk_that_is_not_json_is_left_as_it_came(payload: bytes) -> None:
    assert without_usage_null(payload) == payload
    assert for_unasked(payload) == payload


@pytest.mark.parametrize("resume", [False, True], ids=["bytes", "events"])
async def test_a_chunk_that_is_not_json_goes_through_the_trim_as_it_came(resume: bool) -> None:
    # The trim runs on the origin's bytes in the relay: a malformed chunk
    # there reaches the client as it came, and the stream goes on to its end
    # (a parse that raised ended the handler with a traceback, mid-stream).
    stream = b"".join([frame(chunk(choices=CHOICE, usage=None)), *map(frame, NOT_JSON)])
    stream += frame(b"[DONE]")

    async def never(cut: str, too_long: int) -> None:
        raise AssertionError(cut)

    out, counter = Out(), UsageCounter()
    end = await relay(
        stream,
        Content(),
        out,
        readers=[counter],
        trim=counter.unasked,
        resume=never if resume else None,
    )
    assert end.complete
    expected = stream.replace(b', "usage": null', b"")
    assert SseParser().feed(b"".join(out.written)) == SseParser().feed(expected)


class Out:
    """The client's stream: what was written to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        self.written.append(data)


def splits(data: bytes, cuts: int) -> list[list[bytes]]:
    """`data` cut at every `cuts` points (every one of them for short data)."""
    out = []
    for points in itertools.combinations(range(1, len(data)), cuts):
        edges = [0, *points, len(data)]
        out.append([data[a:b] for a, b in itertools.pairwise(edges)])
    return out


def frame(data: bytes, end: bytes = b"\n") -> bytes:
    return b"data: " + data + end + end


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
@pytest.mark.parametrize("resume", [False, True], ids=["bytes", "events"])
async def test_the_relays_keep_the_usage_from_the_client_and_count_by_it(
    end: bytes, resume: bool
) -> None:
    first = chunk(choices=CHOICE, usage=None)
    usage = chunk(choices=[], usage=USAGE)
    stream = b"".join(
        [
            frame(first, end),
            b": keep-alive" + end + end,
            frame(usage, end),
            frame(b"[DONE]", end),
        ]
    )
    if resume:  # re-framed: LF, no comment (a read of only it is a keep-alive of the relay's)
        expected = frame(chunk(choices=CHOICE)) + frame(b"[DONE]")
    else:  # the origin's bytes, but the usage chunk and the null
        expected = stream.replace(frame(usage, end), b"").replace(b', "usage": null', b"")

    async def never(cut: str, too_long: int) -> None:
        raise AssertionError(cut)

    # Every way the stream may come in two or three reads: the usage chunk
    # alone in one, split across two, or with its neighbours.
    for chunks in [[stream], *splits(stream, 1), *splits(stream, 2)[::97]]:
        out, counter = Out(), UsageCounter()
        end_ = await relay(
            chunks[0],
            Content(*chunks[1:]),
            out,
            readers=[counter],
            trim=counter.unasked,  # as the pipeline trims
            resume=never if resume else None,
        )
        assert end_.complete, chunks
        written = b"".join(out.written)
        assert SseParser().feed(written) == SseParser().feed(expected), chunks
        if not resume and end == b"\n":
            # Byte for byte. (A CRLF stream split between the CR and the LF
            # of the usage chunk's blank line gets an empty line more.)
            assert written == expected, chunks
        assert counter.result(0).completion_tokens == 7  # the origin's count
