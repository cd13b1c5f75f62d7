"""dataplane.streaming.relay driven without HTTP: what the client is written,
and what the readers see, for the relay that passes bytes through and the one
that re-frames events (continuation on)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import weakref
from collections.abc import Callable
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.streaming.relay import (
    ENDED_EARLY,
    ENDED_INSIDE_EVENT,
    KEEP_ALIVE,
    Next,
    OwnEnd,
    RelayEnd,
    Resume,
    _why,
    ends_answer,
    next_sequence_number,
    relay,
)
from dataplane.streaming.sse import Event, SseParser


class Content:
    """An origin's body, chunk by chunk, then its end."""

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class Out:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.ended = False

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def write_eof(self) -> None:
        self.ended = True


class Reader:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def event(self, ev: Event) -> None:
        self.events.append(ev)


async def no_resume(cut: str, too_long: int) -> Next | None:
    return None


STREAM = (
    b'data: {"a":1}\r\n\r\n',
    b"event: note\ndata: two\ndata: lines\n\n: keep-alive\n\n",
    b"data: [DO",
    b"NE]\n\n",
)


async def run(resume: Resume | None) -> tuple[Out, Reader, RelayEnd]:
    out, reader = Out(), Reader()
    end = await relay(
        STREAM[0],
        Content(*STREAM[1:]),
        cast(web.StreamResponse, out),
        readers=[reader],
        idle_timeout=60.0,
        resume=resume,
    )
    return out, reader, end


async def test_the_byte_relay_passes_the_origins_bytes_and_parses_them_for_readers() -> None:
    out, reader, end = await run(None)
    assert end.complete and not end.cut
    assert b"".join(out.written) == b"".join(STREAM)
    assert out.ended
    assert reader.events == [
        Event(b'{"a":1}'),
        Event(b"two\nlines", b"note"),
        Event(b"[DONE]"),
    ]
    assert reader.events[-1].done


async def test_the_event_relay_reframes_each_event_as_data_lines() -> None:
    out, reader, end = await run(no_resume)
    assert end.complete and not end.cut
    assert out.written == [
        b'data: {"a":1}\n\n',
        b"event: note\ndata: two\ndata: lines\n\n",
        b"data: [DONE]\n\n",
    ]
    assert [e.done for e in reader.events] == [False, False, True]


class Endless(Content):
    """An origin's body that never ends after its chunks: past them, a read
    fails the test (the relay must not wait for the body's end)."""

    async def readany(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        raise AssertionError("read past the answer's last event")


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize(
    "last",
    [
        b"data: [DONE]\n\n",
        b"data: [DONE]\r\n\r\n",
        b'event: response.completed\ndata: {"type":"response.completed"}\n\n',
        b'event: response.failed\ndata: {"type":"response.failed"}\n\n',
    ],
)
async def test_the_clients_stream_ends_at_the_answers_last_event_not_the_bodys_end(
    continuable: bool, last: bytes
) -> None:
    # A uvicorn origin writes a chunked body's last chunk after [DONE], on its
    # own; a client that closes at [DONE] (the openai SDK) had the whole answer.
    out, reader = Out(), Reader()
    end = await relay(
        b'data: {"a":1}\n\n',
        Endless(last),
        cast(web.StreamResponse, out),
        readers=[reader],
        idle_timeout=60.0,
        resume=no_resume if continuable else None,
    )
    assert (end.complete, end.cut, out.ended) == (True, "", True)
    assert b"".join(out.written).replace(b"\r", b"").endswith(last.replace(b"\r", b""))
    assert len(reader.events) == 2


class ClosedAtTheEnd(Out):
    """A client that closed once it had the last event: the stream's end fails."""

    async def write_eof(self) -> None:
        raise ConnectionResetError("Cannot write to closing transport")


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_client_gone_after_the_last_event_had_the_whole_answer(continuable: bool) -> None:
    end = await relay(
        b'data: {"a":1}\n\n',
        Endless(b"data: [DONE]\n\n"),
        cast(web.StreamResponse, ClosedAtTheEnd()),
        idle_timeout=60.0,
        resume=no_resume if continuable else None,
    )
    assert (end.complete, end.client_gone) == (True, False)


class ClosedMidway(Out):
    """A client gone after the first write."""

    async def write(self, data: bytes) -> None:
        if self.written:
            raise ConnectionResetError("Cannot write to closing transport")
        self.written.append(data)


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_client_gone_before_the_last_event_is_gone(continuable: bool) -> None:
    end = await relay(
        b'data: {"a":1}\n\n',
        Endless(b'data: {"b":2}\n\n'),
        cast(web.StreamResponse, ClosedMidway()),
        idle_timeout=60.0,
        resume=no_resume if continuable else None,
    )
    assert (end.complete, end.client_gone) == (False, True)


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_an_event_that_only_looks_like_the_last_is_relayed_on(continuable: bool) -> None:
    chunks = (
        b'data: ["[DONE]"]\n\n',
        b"event: response.created\ndata: {}\n\n",
        b"data: [DONE]\n\n",
    )
    out = Out()
    end = await relay(
        b'data: {"a":1}\n\n',
        Endless(*chunks),
        cast(web.StreamResponse, out),
        idle_timeout=60.0,
        resume=no_resume if continuable else None,
    )
    assert end.complete
    assert b"".join(out.written).endswith(b"data: [DONE]\n\n")
    assert len(b"".join(out.written).split(b"\n\n")) == 5  # four events, all relayed


class Dropping(Content):
    """An origin's body whose connection drops after its chunks."""

    async def readany(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        raise aiohttp.ClientPayloadError("Response payload is not completed")


RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n',
)


ERROR_EVENT = b"event: error\ndata: {}\n\n"


async def relay_dropped(
    *after_first: bytes, continuable: bool, clean: bool = False
) -> tuple[Out, RelayEnd]:
    """A Responses stream whose connection drops after `after_first` (or,
    `clean`, whose body ends there)."""
    out = Out()
    end = await relay(
        RESPONSES_STREAM[0],
        (Content if clean else Dropping)(*after_first),
        cast(web.StreamResponse, out),
        readers=[Reader()],
        error_event=ERROR_EVENT,
        idle_timeout=60.0,
        resume=no_resume if continuable else None,
    )
    return out, end


@pytest.mark.parametrize("clean", [False, True], ids=["dropped", "ended"])
@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize("last", ["completed", "failed", "incomplete"])
async def test_a_responses_stream_dropped_after_its_last_event_is_whole(
    continuable: bool, last: str, clean: bool
) -> None:
    final = b'event: response.%s\ndata: {"type":"response.%s"}\n\n' % (last.encode(), last.encode())
    out, end = await relay_dropped(RESPONSES_STREAM[1], final, continuable=continuable, clean=clean)
    assert end.complete and not end.cut
    assert b"event: error" not in b"".join(out.written)


@pytest.mark.parametrize("clean", [False, True], ids=["dropped", "ended"])
@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_responses_stream_dropped_before_its_last_event_is_cut(
    continuable: bool, clean: bool
) -> None:
    """A body that ends cleanly before response.completed is cut as one
    that drops is (a new user's trial: it was taken for a whole answer)."""
    out, end = await relay_dropped(RESPONSES_STREAM[1], continuable=continuable, clean=clean)
    assert end.cut and not end.complete
    assert b"".join(out.written).endswith(ERROR_EVENT)


class KeptError(Content):
    """An origin's body whose connection dropped after its chunks, read as
    aiohttp's reader is: it keeps the error and raises it at each read."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(*chunks)
        self.error = aiohttp.ClientPayloadError("Response payload is not completed")

    async def readany(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        raise self.error


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_read_error_the_body_keeps_holds_none_of_the_relays_frames(
    continuable: bool,
) -> None:
    """With the garbage collector off, the client's stream is freed once a
    relay its origin cut returns, while the origin's body (held by its
    answer, until released) keeps the read's error: its traceback held the
    relay's frames, the client's stream (its request, its body) with them."""
    gc.collect()
    gc.disable()
    try:
        content, out = KeptError(b'data: {"a":1}\n\n'), Out()
        freed = weakref.ref(out)
        end = await relay(
            b'data: {"a":0}\n\n',
            content,
            cast(web.StreamResponse, out),
            readers=[Reader()],
            idle_timeout=60.0,
            resume=no_resume if continuable else None,
        )
        assert end.cut
        del out
        assert freed() is None
        assert content.error.__traceback__ is None
    finally:
        gc.enable()


HALF_WAY = (
    b'data: {"choices":[{"index":0,"delta":{"content":"half"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" way"},"finish_reason":null}]}\n\n',
)


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize(
    ("tail", "why"),
    [(b"", ENDED_EARLY), (b'data: {"choi', ENDED_INSIDE_EVENT)],
    ids=["after-an-event", "inside-one"],
)
async def test_a_chat_stream_whose_body_ends_before_done_is_cut(
    continuable: bool, tail: bytes, why: str
) -> None:
    """A new user's trial: two deltas, then the body's clean end (no finish,
    no [DONE]) was a complete answer: the client had half of it, no error."""
    out = Out()
    cuts: list[str] = []

    async def resume(cut: str, too_long: int) -> Next | None:
        cuts.append(cut)
        return None

    end = await relay(
        HALF_WAY[0],
        Content(HALF_WAY[1], tail),
        cast(web.StreamResponse, out),
        error_event=ERROR_EVENT,
        idle_timeout=60.0,
        resume=resume if continuable else None,
    )
    assert end.cut == why and not end.complete
    assert cuts == ([why] if continuable else [])
    written = b"".join(out.written)
    assert written == b"".join(HALF_WAY) + ERROR_EVENT  # never the half event
    assert out.ended


async def test_a_body_ended_after_the_answer_but_its_done_is_ended_by_the_whole_hook() -> None:
    """Its finish came, then the body's clean end: the `whole` hook's end
    ([DONE]) follows, as after a dropped connection."""
    out = Out()
    asked: list[tuple[str, Event | None]] = []

    def whole(cut: str, before: Event | None, last: Event | None) -> OwnEnd | None:
        asked.append((cut, last))
        return OwnEnd(b"data: [DONE]\n\n", whole=True)

    finish = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    end = await relay(
        HALF_WAY[0],
        Content(finish),
        cast(web.StreamResponse, out),
        error_event=ERROR_EVENT,
        whole=whole,
    )
    assert end.complete and not end.cut and not end.ended
    assert asked == [(ENDED_EARLY, Event(finish[6:-2]))]
    assert b"".join(out.written) == HALF_WAY[0] + finish + b"data: [DONE]\n\n"


async def test_a_last_done_without_its_blank_line_ends_the_answer() -> None:
    out = Out()
    end = await relay(HALF_WAY[0], Content(b"data: [DONE]"), cast(web.StreamResponse, out))
    assert end.complete and not end.cut
    assert end.open_event is not None and end.open_event.done
    assert b"".join(out.written) == HALF_WAY[0] + b"data: [DONE]"


NUMBERED = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","sequence_number":1}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"resp',  # half an event
)


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize("whole", [2, 0], ids=["after-events", "before-any"])
async def test_a_cut_stream_ends_with_what_its_ending_makes_of_the_last_event_relayed(
    continuable: bool, whole: int
) -> None:
    """No reader: the byte relay parses the stream for the ending alone. The
    half event the cut leaves is not sent, and is not the last one."""
    made: list[Event | None] = []

    def ending(last: Event | None, too_long: int) -> bytes:
        assert too_long == 0  # broken off, not cut by the bound
        made.append(last)
        return b"event: error\ndata: {}\n\n"

    chunks = NUMBERED if whole else (b'event: response.created\ndata: {"type"',)
    out = Out()
    end = await relay(
        chunks[0],
        Dropping(*chunks[1:]),
        cast(web.StreamResponse, out),
        error_event=ending,
        resume=no_resume if continuable else None,
    )
    assert end.cut and not end.complete
    delta = b'{"type":"response.output_text.delta","sequence_number":1}'
    assert made == [Event(delta, b"response.output_text.delta") if whole else None]
    relayed = NUMBERED[0] + NUMBERED[1][: NUMBERED[1].index(b"\n\n") + 2] if whole else b""
    assert b"".join(out.written) == relayed + b"event: error\ndata: {}\n\n"


@pytest.mark.parametrize(
    ("last", "number"),
    [
        (None, 0),
        (Event(b'{"type":"response.output_text.delta","sequence_number":7}', b"x"), 8),
        (Event(b'{"type":"response.output_text.delta"}'), None),
        (Event(b'{"sequence_number":"7"}'), None),
        (Event(b'{"sequence_number":true}'), None),
        (Event(b'{"sequence_number":-1}'), None),
        (Event(b"[7]"), None),
        (Event(b"not json"), None),
    ],
)
def test_the_sequence_number_after_the_last_event(last: Event | None, number: int | None) -> None:
    assert next_sequence_number(last) == number


@pytest.mark.parametrize(
    ("data", "last"),
    [
        (b"data: [DONE]\n\n", True),
        (b'data: {"a":1}\n\n', False),
        (b'event: response.completed\ndata: {"type":"response.completed"}\n\n', True),
        (b"event:response.failed\r\ndata: {}\r\n\r\n", True),
        (
            b"event: response.completed\ndata: {}\n\n"
            b"event: response.output_text.delta\ndata: {}\n\n",
            False,
        ),
        (b'data: {"text":"\\nevent: response.completed"}\n\n', False),
    ],
)
def test_the_last_event_of_a_stream_is_told(data: bytes, last: bool) -> None:
    assert ends_answer(data) is last


# ---------------------------------------------------------- an event's size bound

BOUND = 10_000  # max_event_bytes in the tests below


class Counted(Content):
    """An origin's body that counts the chunks read, and fails the test when
    read past them (a cut relay must not wait for the body's end)."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(*chunks)
        self.read = 0

    async def readany(self) -> bytes:
        if not self._chunks:
            raise AssertionError("read past the body")
        self.read += 1
        return self._chunks.pop(0)


BROKEN_EVENT = b"data: broken\n\n"


def bound_or_broken(last: Event | None, too_long: int) -> bytes:
    assert too_long in (0, BOUND)
    return ERROR_EVENT if too_long else BROKEN_EVENT


async def bounded(
    first: bytes, content: Content, *, continuable: bool
) -> tuple[Out, Reader, RelayEnd]:
    """Relay under max_event_bytes=BOUND, with a reader; a stream the bound
    cuts ends in ERROR_EVENT, one broken off in BROKEN_EVENT."""
    out, reader = Out(), Reader()
    end = await relay(
        first,
        content,
        cast(web.StreamResponse, out),
        readers=[reader],
        error_event=bound_or_broken,
        resume=no_resume if continuable else None,
        max_event_bytes=BOUND,
    )
    return out, reader, end


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_an_event_longer_than_the_bound_cuts_the_stream_where_it_passes(
    continuable: bool,
) -> None:
    head = b'data: {"a":1}\n\n'
    pieces = [b"data: "] + [b"x" * 1000] * 30 + [b"\n\ndata: [DONE]\n\n"]
    content = Counted(*pieces)
    out, reader, end = await bounded(head, content, continuable=continuable)
    assert end.cut == f"an event of more than {BOUND} bytes (--max-answer-bytes)"
    assert not end.complete
    # The whole events before it, then the error event: none of the long one.
    assert b"".join(out.written) == head + ERROR_EVENT
    assert reader.events == [Event(b'{"a":1}')]
    assert content.read <= BOUND // 1000 + 2  # stopped at the bound, not at the event's end


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_an_event_of_empty_data_lines_past_the_bound_cuts_the_stream(
    continuable: bool,
) -> None:
    # Each line holds a list slot in the parser, though its value is empty.
    pieces = [b"data:\n" * 1000] * 5 + [b"\ndata: [DONE]\n\n"]
    content = Counted(*pieces)
    out, _, end = await bounded(b'data: {"a":1}\n\n', content, continuable=continuable)
    assert end.cut == f"an event of more than {BOUND} bytes (--max-answer-bytes)"
    assert b"".join(out.written) == b'data: {"a":1}\n\n' + ERROR_EVENT
    assert content.read == 2  # 12,000 bytes of lines held: past the bound


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_an_event_within_the_bound_is_relayed_whole_however_it_comes(
    continuable: bool,
) -> None:
    long = b"data: " + b"x" * (BOUND - 100) + b"\n\n"
    pieces = [long[i : i + 7] for i in range(0, len(long), 7)] + [b"data: [DONE]\n\n"]
    out, reader = Out(), Reader()
    end = await relay(
        b'data: {"a":1}\n\n',
        Content(*pieces),
        cast(web.StreamResponse, out),
        readers=[reader],
        resume=no_resume if continuable else None,
        max_event_bytes=BOUND,
    )
    assert (end.complete, end.cut) == (True, "")
    assert reader.events == [Event(b'{"a":1}'), Event(long[6:-2]), Event(b"[DONE]")]
    written = b"".join(out.written)
    assert written == b'data: {"a":1}\n\n' + long + b"data: [DONE]\n\n"


_SEPARATORS = st.sampled_from(
    [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n", b"\r\r\n", b"\n\r", b"\n", b"\r\n", b"\r"]
)
# No "[DONE]": the relay ends the client's stream at the answer's last event.
_TEXT = (
    st.binary(max_size=6)
    .map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
    .filter(lambda b: b"[DONE]" not in b)
)


def _boundaries(data: bytes) -> list[int]:
    """Where each blank line ends: an empty line after a line ending, each
    ending LF, CR or CRLF (one, not a CR then an LF), scanned byte by byte."""
    ends = []
    i = line_start = 0
    while i < len(data):
        if data[i] in b"\r\n":
            end = i + 2 if data[i : i + 2] == b"\r\n" else i + 1
            if i == line_start and i > 0:
                ends.append(end)
            i = line_start = end
        else:
            i += 1
    return ends


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_TEXT, _SEPARATORS), min_size=1, max_size=12),
    st.lists(st.integers(min_value=1, max_value=9), max_size=40),
)
async def test_the_byte_relay_writes_each_event_as_soon_as_it_is_whole(
    lines: list[tuple[bytes, bytes]], sizes: list[int]
) -> None:
    """Split anywhere, a stream is written unchanged, and after each chunk
    read the client has every byte up to the last blank line read so far
    (held bytes are joined once, not on every chunk); at the body's end,
    without the answer's ([DONE]), a cut after the last whole event."""
    stream = b"".join(b"data: " + text + sep for text, sep in lines)
    chunks, at = [], 0
    for size in sizes:
        if at < len(stream):
            chunks.append(stream[at : at + size])
            at += size
    if at < len(stream):
        chunks.append(stream[at:])

    out, reader = Out(), Reader()

    class Tracked(Content):
        async def readany(self) -> bytes:
            # Before each read: every event whole in what was read is written.
            consumed = len(b"".join(chunks[: len(chunks) - len(self._chunks)]))
            expected = max(_boundaries(stream[:consumed]), default=0)
            written = len(b"".join(out.written))
            # A blank line that a CR ended when it came, whose LF came in a
            # later read (a CRLF): that LF goes with the next event.
            assert written == expected or (
                written == expected - 1 and stream[expected - 2 : expected] == b"\r\n"
            )
            return await super().readany()

    end = await relay(
        chunks[0],
        Tracked(*chunks[1:]),
        cast(web.StreamResponse, out),
        readers=[reader],
        max_event_bytes=BOUND,
    )
    whole_to = max(_boundaries(stream), default=0)
    inside = stream[whole_to:].strip(b"\r\n")
    assert end.cut == (ENDED_INSIDE_EVENT if inside else ENDED_EARLY) and not end.complete
    written = b"".join(out.written)
    # A CRLF's LF that came alone in the last read is held with the rest.
    assert written == stream[:whole_to] or (
        written == stream[: whole_to - 1] and stream[whole_to - 2 : whole_to] == b"\r\n"
    )
    whole = SseParser()
    assert reader.events == whole.feed(stream)


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize("first", [0, 100, 6000, BOUND - 10], ids=lambda n: f"first-{n}")
async def test_an_event_longer_than_the_bound_is_cut_however_its_bytes_come(
    continuable: bool, first: int
) -> None:
    """Whole with the bytes that end it, or first in part: the same stream
    is cut the same way (a trial saw a 120 KB event past a 100 KB bound
    relayed when it came in two reads, and cut when in more)."""
    head = b'data: {"a":1}\n\n'
    long = b"data: " + b"x" * (BOUND + 2000) + b"\n\n"
    rest = long + b"data: [DONE]\n\n"
    chunks = [rest[:first], rest[first:]] if first else [rest]
    out, reader, end = await bounded(head, Content(*chunks), continuable=continuable)
    assert end.cut == f"an event of more than {BOUND} bytes (--max-answer-bytes)"
    assert b"".join(out.written) == head + ERROR_EVENT
    assert reader.events == [Event(b'{"a":1}')]


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_chunk_longer_than_the_bound_of_events_within_it_is_relayed(
    continuable: bool,
) -> None:
    each = b"data: " + b"y" * (BOUND // 2) + b"\n\n"
    more = Content(b": keep-alive\n\n" + each * 3 + b"data: [DONE]\n\n")
    out, reader, end = await bounded(each * 5, more, continuable=continuable)
    assert (end.complete, end.cut) == (True, "")
    assert len(reader.events) == 9
    framed = b"".join(out.written)
    assert framed.count(each) == 8 and framed.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_long_event_after_whole_ones_in_one_chunk_cuts_the_stream_after_them(
    continuable: bool,
) -> None:
    short = b'data: {"b":2}\n\n'
    long = b"data: " + b"x" * (BOUND + 1) + b"\n\n"
    first = short * 3 + long + short + b"data: [DONE]\n\n"
    out, reader, end = await bounded(first, Content(), continuable=continuable)
    assert end.cut == f"an event of more than {BOUND} bytes (--max-answer-bytes)"
    assert b"".join(out.written) == short * 3 + ERROR_EVENT
    assert reader.events == [Event(b'{"b":2}')] * 3


# ------------------------------------------- the bound, whatever the stream and its split
#
# Streams made block by block, so that each block's size as the parser
# measures it (its lines with one byte for each line's ending, Event.size) and
# where its bytes start are known by construction: both relays must cut at
# the first block past the bound, dispatched event or not (a comment-only
# block held as long), write the whole blocks before it and none of it, feed
# their readers exactly the events the client was written, and do the same
# for every split of the bytes.

LINE_KINDS = (b"data: ", b": ", b"event: ", b"id: ")
ENDINGS = (b"\n", b"\r\n", b"\r")
SMALL_BOUND = 200


@st.composite
def block(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A block's (line, ending) pairs and the ending of its blank line; a
    line ended by CR is never followed by an ending that starts with LF,
    which would make the two one CRLF."""
    lines: list[tuple[bytes, bytes]] = []
    previous = b""
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(LINE_KINDS))
        value = b"x" * draw(st.sampled_from([0, 1, 5, 60, 95, 96, 97, 150, 199, 200, 201, 260]))
        ending = draw(st.sampled_from(ENDINGS))
        if previous == b"\r" and ending == b"\n":
            ending = b"\r\n"
        lines.append((kind + value, ending))
        previous = ending
    blank = draw(st.sampled_from(ENDINGS))
    if previous == b"\r" and blank == b"\n":
        blank = b"\r\n"
    return lines, blank


def block_bytes(b: tuple[list[tuple[bytes, bytes]], bytes]) -> bytes:
    lines, blank = b
    return b"".join(line + ending for line, ending in lines) + blank


def block_size(b: tuple[list[tuple[bytes, bytes]], bytes]) -> int:
    return sum(len(line) + 1 for line, _ in b[0])


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def parsed(data: bytes) -> list[Event]:
    return SseParser().feed(data)


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(block(), min_size=1, max_size=6),
    splits=st.lists(st.lists(st.integers(0, 10_000), max_size=6), min_size=1, max_size=3),
)
async def test_both_relays_cut_at_the_first_block_past_the_bound_whatever_the_split(
    blocks: list[tuple[list[tuple[bytes, bytes]], bytes]], splits: list[list[int]]
) -> None:
    done = b"data: [DONE]\n\n"
    stream = b"".join(map(block_bytes, blocks)) + done
    long = next((i for i, b in enumerate(blocks) if block_size(b) > SMALL_BOUND), None)
    before = b"".join(map(block_bytes, blocks[:long]))  # all of them if none is long
    for cuts in splits:
        chunks = split(stream, cuts)
        # The byte relay: the origin's bytes as they came.
        out, reader = Out(), Reader()
        end = await relay(
            chunks[0], Content(*chunks[1:]), cast(web.StreamResponse, out),
            readers=[reader], error_event=ERROR_EVENT, max_event_bytes=SMALL_BOUND,
        )  # fmt: skip
        written = b"".join(out.written)
        if long is None:
            assert written == stream and end.complete and not end.cut
        else:
            assert written.endswith(ERROR_EVENT) and end.cut.startswith("an event of more than")
            # The blocks before the long one, all but the LF of a CRLF that
            # ends one when a read split it (a CR already ends the line).
            client = written.removesuffix(ERROR_EVENT)
            assert before.startswith(client) and before[len(client) :] in (b"", b"\n"), chunks
        assert reader.events == parsed(written.removesuffix(ERROR_EVENT))
        # The events relay: the same events, re-framed, and the same cut.
        out, reader = Out(), Reader()
        end = await relay(
            chunks[0], Content(*chunks[1:]), cast(web.StreamResponse, out),
            readers=[reader], error_event=ERROR_EVENT, resume=no_resume,
            max_event_bytes=SMALL_BOUND,
        )  # fmt: skip
        written = b"".join(out.written)
        assert reader.events == parsed(before + (done if long is None else b""))
        assert written.endswith(ERROR_EVENT) == (long is not None)
        assert parsed(written.removesuffix(ERROR_EVENT)) == reader.events


class Waiting(Content):
    """An origin's body whose chunks come, then nothing: a read waits until
    the relay is cancelled."""

    async def readany(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize("stopping", [True, False], ids=["server-stops", "client-left"])
async def test_a_cancelled_relay_ends_with_what_stopped_makes_of_the_last_event(
    continuable: bool, stopping: bool
) -> None:
    """A stopping server's cancellation ends the client's stream with the
    ending `stopped` makes of the last whole event relayed (not the half
    event held); a client that left (`stopped` gives None) is written nothing."""
    out = Out()
    seen: list[Event | None] = []

    def stopped(last: Event | None) -> bytes | None:
        seen.append(last)
        return b"data: stopped\n\ndata: [DONE]\n\n" if stopping else None

    task = asyncio.create_task(
        relay(
            b'data: {"n":1}\n\n',
            Waiting(b'data: {"n":2}\n\ndata: {"n"'),
            cast(web.StreamResponse, out),
            resume=no_resume if continuable else None,
            stopped=stopped,
        )
    )
    while len(out.written) < 2:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [e.data if e else None for e in seen] == [b'{"n":2}']
    relayed = b"".join(out.written)
    assert relayed.startswith(b'data: {"n":1}\n\ndata: {"n":2}\n\n')
    assert b'{"n"' not in relayed.split(b"\n\n")[2]  # the half event held stays held
    if stopping:
        assert relayed.endswith(b"data: stopped\n\ndata: [DONE]\n\n")
        assert out.ended
    else:
        assert relayed == b'data: {"n":1}\n\ndata: {"n":2}\n\n'
        assert not out.ended


async def test_a_relay_cancelled_after_the_answer_ended_writes_nothing_more() -> None:
    class Hanging(Out):
        async def write_eof(self) -> None:
            await asyncio.Event().wait()  # the client takes the end slowly

    out = Hanging()
    await cancel_when(out, lambda: bool(out.written), b"data: [DONE]\n\n", Waiting())
    assert out.written == [b"data: [DONE]\n\n"]


async def cancel_when(
    out: Out, ready: Callable[[], bool], first: bytes, content: Content, **kwargs: Any
) -> None:
    """Relay `first` then `content` to `out`, and cancel the relay, as the
    stopping server does, once `ready()` and one more step of the loop."""
    task = asyncio.create_task(
        relay(
            first,
            content,
            cast(web.StreamResponse, out),
            stopped=lambda last: b"data: stopped\n\ndata: [DONE]\n\n",
            **kwargs,
        )
    )
    while not ready():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class EndsCounted(Out):
    """An Out that counts the stream's ends written (one is right)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends = 0

    async def write_eof(self) -> None:
        self.ends += 1
        await super().write_eof()


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
@pytest.mark.parametrize("slow_in", ["ending", "end"])
async def test_a_relay_cancelled_while_its_broken_ending_drains_ends_once(
    continuable: bool, slow_in: str
) -> None:
    """Review 36: a stream the origin broke was written its error event and
    `[DONE]`; the stop's cancellation, coming while a slow client took them,
    wrote a second error event and `[DONE]` (and, in a wait for the stream's
    end, bytes after its last chunk). Review 37: and with no second ending,
    no end either (a chunked body without its last chunk) when the wait was
    the ending's; one end when it was the end's."""

    class Slow(EndsCounted):
        async def write(self, data: bytes) -> None:
            await super().write(data)
            if slow_in == "ending" and data.startswith(ERROR_EVENT):
                await asyncio.Event().wait()  # the client takes the ending slowly

        async def write_eof(self) -> None:
            await super().write_eof()
            if slow_in == "end" and self.ends == 1:
                await asyncio.Event().wait()  # ... or the stream's end

    out = Slow()
    await cancel_when(
        out,
        lambda: (
            any(w.startswith(ERROR_EVENT) for w in out.written)
            and (slow_in == "ending" or out.ends > 0)
        ),
        b'data: {"n":1}\n\n',
        Dropping(),
        error_event=ERROR_EVENT,
        resume=no_resume if continuable else None,
    )
    assert b"stopped" not in b"".join(out.written)
    assert out.ends == 1


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_a_relay_cancelled_while_the_client_takes_its_last_event_only_ends(
    continuable: bool,
) -> None:
    """Review 38: a stop that landed while the client took the chunk holding
    `[DONE]` wrote the stop's error event and a second `[DONE]` after it."""

    class Slow(EndsCounted):
        async def write(self, data: bytes) -> None:
            await super().write(data)
            if b"[DONE]" in data:
                await asyncio.Event().wait()  # the client takes it slowly

    out = Slow()
    await cancel_when(
        out,
        lambda: any(b"[DONE]" in w for w in out.written),
        b'data: {"n":1}\n\n',
        Content(b"data: [DONE]\n\n"),
        resume=no_resume if continuable else None,
    )
    assert b"stopped" not in b"".join(out.written)
    assert out.ends == 1


async def test_a_body_cut_short_is_said_without_aiohttps_parser_code() -> None:
    """Trial 45: a cut read "ClientPayloadError: Response payload is not
    completed: <TransferEncodingError: 400, message='Not enough data…'>",
    whose 400 is aiohttp's parser code, read as the origin's status. A real
    chunked body cut short, read by aiohttp's client."""

    async def cut(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: x\n\n")
        assert request.transport is not None
        request.transport.close()
        return out

    app = web.Application()
    app.router.add_get("/", cut)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/")
        with pytest.raises(aiohttp.ClientPayloadError) as raised:
            while await resp.content.readany():
                pass
    said = _why(raised.value, None)
    assert said.startswith("the origin's body could not be read (Response payload is not completed")
    assert "Not enough data" in said and "400" not in said and "<" not in said
    assert _why(aiohttp.ClientPayloadError(), None) == "the origin's body could not be read (cut)"


@pytest.mark.parametrize("advance", [0.0, 0.6], ids=["within-the-interval", "past-it"])
async def test_the_event_relay_writes_a_keep_alive_for_the_origins_comments(
    advance: float,
) -> None:
    """A new user's trial: the origin's `: keep-alive` comments were dropped
    with continuation on, and the client heard nothing while the origin
    pinged. One comment of the relay's own for a read without an event, at
    most every KEEP_ALIVE_EVERY_S; none for a read that had one."""
    now = [100.0]

    def clock() -> float:
        now[0] += advance
        return now[0]

    out = Out()
    end = await relay(
        HALF_WAY[0],
        Content(
            b": keep-alive\n\n",
            b":ping\r\n\r\n",
            b"\n: ping\n\n" + HALF_WAY[1],
            b"data: [DONE]\n\n",
        ),
        cast(web.StreamResponse, out),
        resume=no_resume,
        clock=clock,
    )
    assert end.complete
    pings = [KEEP_ALIVE] * (2 if advance else 1)
    assert out.written == [HALF_WAY[0], *pings, HALF_WAY[1], b"data: [DONE]\n\n"]


class Paced(Content):
    """An origin's body whose chunks come `gap` seconds apart."""

    def __init__(self, gap: float, *chunks: bytes) -> None:
        super().__init__(*chunks)
        self._gap = gap

    async def readany(self) -> bytes:
        await asyncio.sleep(self._gap)
        return await super().readany()


async def test_a_continuations_stream_is_bounded_from_its_start_not_the_last_event() -> None:
    # After an event, comments alone do not start the idle timeout over (0.4 s
    # here); a continuation's stream counts from its start, not from the
    # first origin's last event, before the continuation call (0.3 s).
    async def resume(cut: str, too_long: int) -> Next | None:
        if resumed:
            return None
        resumed.append(cut)
        await asyncio.sleep(0.3)  # the continuation call
        rest = Paced(0.1, b": queued\n\n", b'data: {"b":2}\n\n', b"data: [DONE]\n\n")
        return Next(b": queued\n\n", rest, lambda data: data, "o2")

    resumed: list[str] = []
    out = Out()
    end = await relay(
        b'data: {"a":1}\n\n',
        Dropping(),
        cast(web.StreamResponse, out),
        idle_timeout=0.4,
        resume=resume,
    )
    assert end.complete and not end.cut, end
    assert len(resumed) == 1
    assert out.written[-2:] == [b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]


@pytest.mark.parametrize("continuable", [False, True], ids=["bytes", "events"])
async def test_comments_after_an_event_do_not_start_the_idle_timeout_over(
    continuable: bool,
) -> None:
    out = Out()
    end = await relay(
        b'data: {"a":1}\n\n',
        Paced(0.05, *[b": ping\n\n"] * 40, b"data: [DONE]\n\n"),
        cast(web.StreamResponse, out),
        idle_timeout=0.3,
        resume=no_resume if continuable else None,
    )
    assert end.cut == "no event, only comments, for 0.3 s"
    assert b"data: [DONE]\n\n" not in out.written


ONE_LINE_EVENTS = (b'{"a":1}', b'{"choices":[],"usage":{}}', b'{"b":2}', b"[DONE]")


@pytest.mark.parametrize(
    ("shown", "expected"),
    [
        ({}, ONE_LINE_EVENTS),
        ({b'{"choices":[],"usage":{}}': None}, (b'{"a":1}', b'{"b":2}', b"[DONE]")),
        ({b'{"b":2}': b"b"}, (b'{"a":1}', b'{"choices":[],"usage":{}}', b"b", b"[DONE]")),
        ({b'{"a":1}': None, b'{"b":2}': b"b"}, (b'{"choices":[],"usage":{}}', b"b", b"[DONE]")),
    ],
    ids=["as-it-came", "one-left-out", "one-changed", "first-left-out"],
)
async def test_a_read_of_one_line_events_reaches_the_client_as_trim_shows_each(
    shown: dict[bytes, bytes | None], expected: tuple[bytes, ...]
) -> None:
    # A read of whole one-line events is written as it came, unless an event
    # is shown otherwise: then the events before it as they came, and each
    # after it framed.
    out, reader = Out(), Reader()
    end = await relay(
        b"".join(b"data: " + data + b"\n\n" for data in ONE_LINE_EVENTS),
        Content(),
        cast(web.StreamResponse, out),
        readers=[reader],
        resume=no_resume,
        trim=lambda data: shown.get(data, data),
    )
    assert end.complete
    assert b"".join(out.written) == b"".join(b"data: " + data + b"\n\n" for data in expected)
    assert [ev.data for ev in reader.events] == list(ONE_LINE_EVENTS)


async def test_an_error_event_inside_a_read_of_one_line_events_ends_what_came_before_it() -> None:
    chunk = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: {"error":{"message":"x"}}\n\ndata: [DONE]\n\n'
    out, reader = Out(), Reader()
    end = await relay(
        chunk,
        Content(),
        cast(web.StreamResponse, out),
        readers=[reader],
        error_event=b"data: ended\n\n",
        resume=no_resume,
    )
    assert end.cut == "the origin sent an error event"
    assert b"".join(out.written) == b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: ended\n\n'
    assert [ev.data for ev in reader.events] == [b'{"a":1}', b'{"b":2}']


ERROR_SHAPES = (
    b'data: {"error":{"message":"x"}}\n\n',
    # Its data lines in pieces: never a read of one-line events.
    b'data: {"error":\ndata: {"message":"x"}}\n\n',
)


@pytest.mark.parametrize("shape", ERROR_SHAPES)
async def test_an_error_event_split_across_reads_anywhere_ends_the_stream(shape: bytes) -> None:
    # A read is cleared of errors by one search only when it is whole one-line
    # events; a read that ends an event begun before holds only part of its
    # "error", and the event must still be found one.
    stream = b'data: {"a":1}\n\n' + shape + b"data: [DONE]\n\n"
    for at in range(1, len(stream)):
        out, reader = Out(), Reader()
        end = await relay(
            stream[:at],
            Content(stream[at:]),
            cast(web.StreamResponse, out),
            readers=[reader],
            error_event=b"data: ended\n\n",
            resume=no_resume,
        )
        assert end.cut == "the origin sent an error event", at
        assert b"".join(out.written) == b'data: {"a":1}\n\ndata: ended\n\n', at
        assert [ev.data for ev in reader.events] == [b'{"a":1}'], at


async def test_a_continuations_event_is_trimmed_as_it_was_rewritten() -> None:
    # The trim (usage the client did not ask for) is shown the event the
    # continuation's rewrite made, not the next origin's as it came: the
    # client keeps the first origin's id.
    async def resume(cut: str, too_long: int) -> Next | None:
        if resumed:
            return None
        resumed.append(cut)
        rest = Content(b'data: {"id":"o2","b":2,"usage":null}\n\n', b"data: [DONE]\n\n")
        return Next(b": queued\n\n", rest, lambda data: data.replace(b'"o2"', b'"o1"'), "o2")

    def trim(data: bytes) -> bytes | None:
        return data.replace(b',"usage":null', b"")

    resumed: list[str] = []
    out, reader = Out(), Reader()
    end = await relay(
        b'data: {"id":"o1","a":1,"usage":null}\n\n',
        Content(),
        cast(web.StreamResponse, out),
        readers=[reader],
        resume=resume,
        trim=trim,
    )
    assert end.complete and resumed == [ENDED_EARLY], end
    events = b"".join(w for w in out.written if not w.startswith(b":"))  # not keep-alives
    assert events == b'data: {"id":"o1","a":1}\n\ndata: {"id":"o1","b":2}\n\ndata: [DONE]\n\n'
    assert [ev.data for ev in reader.events] == [
        b'{"id":"o1","a":1,"usage":null}',
        b'{"id":"o1","b":2,"usage":null}',
        b"[DONE]",
    ]


class ByRead(Reader):
    """A ReadSink: takes a read's events at once where the relay gives them so."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def read(self, events: list[Event]) -> None:
        self.reads += 1
        self.events += events


@pytest.mark.parametrize("continuable", [False, True])
@pytest.mark.parametrize(
    ("chunks", "whole"),
    [
        ((b'data: {"a":1}\n\ndata: {"b":2}\n\n', b"data: [DONE]\n\n"), True),
        # An in-band error inside a read of whole one-line events: with
        # `resume`, the events before it are the last the client gets.
        ((b'data: {"a":1}\n\ndata: {"error":{"message":"x"}}\n\ndata: {"b":2}\n\n',), False),
        # A read that names an error goes event by event, the next at once.
        ((b'data: {"a":"no error"}\n\n', b"data: {}\n\ndata: [DONE]\n\n"), True),
        (STREAM, False),
    ],
)
async def test_a_reader_of_whole_reads_gets_the_events_a_reader_of_each_gets(
    continuable: bool, chunks: tuple[bytes, ...], whole: bool
) -> None:
    each, by_read = Reader(), ByRead()
    await relay(
        chunks[0],
        Content(*chunks[1:]),
        cast(web.StreamResponse, Out()),
        readers=[each, by_read],
        resume=no_resume if continuable else None,
    )
    assert by_read.events == each.events
    # Every read of the byte relay; the events relay's of whole one-line
    # events, none of which may be an error (`whole`: one at least).
    assert bool(by_read.reads) == (whole or not continuable)
