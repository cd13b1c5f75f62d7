"""The one SSE parser: the same events however the bytes are split, with every
line ending the spec allows."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dataplane.streaming.sse import Event, SseParser

STREAM = (
    b": keep-alive\n"
    b'data: {"a":1}\n\n'
    b"event: ping\n\n"
    b"data: first line\ndata:second line\n\n"
    b"id: 7\nretry: 10\ndata: [DONE]\n\n"
)
EVENTS = [
    Event(b'{"a":1}'),
    Event(b"", b"ping"),
    Event(b"first line\nsecond line"),
    Event(b"[DONE]"),
]


def parse(data: bytes, cuts: list[int]) -> tuple[list[Event], Event | None]:
    parser = SseParser()
    events: list[Event] = []
    start = 0
    for cut in [*cuts, len(data)]:
        events += parser.feed(data[start:cut])
        start = cut
    return events, parser.close()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_every_split_gives_the_same_events(ending: bytes) -> None:
    data = STREAM.replace(b"\n", ending)
    for cut in range(len(data) + 1):
        assert parse(data, [cut]) == (EVENTS, None), f"split at {cut}"
    assert parse(data, list(range(1, len(data)))) == (EVENTS, None)


def test_a_crlf_split_between_chunks_is_one_line_ending() -> None:
    events, _ = parse(b"data: x\r\n\r\ndata: y\r\n\r\n", [8, 9, 10])
    assert events == [Event(b"x"), Event(b"y")]


def test_a_stream_that_stops_inside_an_event_says_so() -> None:
    events, open_event = parse(b"data: whole\n\ndata: [DONE]", [])
    assert events == [Event(b"whole")]
    assert open_event == Event(b"[DONE]") and open_event.done
    _, cut = parse(b'data: {"choices":', [])
    assert cut is not None and not cut.done
    assert parse(b"data: x\n\n", []) == ([Event(b"x")], None)


def test_one_space_after_the_colon_is_dropped_and_no_more() -> None:
    events, _ = parse(b"data:  two spaces\n\ndata:none\n\n", [])
    assert events == [Event(b" two spaces"), Event(b"none")]


def test_an_empty_chunk_between_cr_and_lf_changes_nothing() -> None:
    parser = SseParser()
    events = parser.feed(b"data: x\r") + parser.feed(b"") + parser.feed(b"\ndata: y\n\n")
    assert events == [Event(b"x\ny")]


def test_an_event_knows_the_done_sentinel_by_its_data_alone() -> None:
    assert Event(b"[DONE]").done
    assert Event(b"  [DONE] \n").done  # whitespace around it, as the parser may leave
    assert Event(b"[DONE]" + b" " * 40).done
    assert not Event(b'{"text": "[DONE]"}').done
    assert not Event(b"").done


def test_events_are_equal_by_data_and_name() -> None:
    assert Event(b"x") == Event(b"x", b"")
    assert Event(b"x") != Event(b"x", b"ping")
    assert Event(b"x") != Event(b"y")
    assert len({Event(b"x"), Event(b"x"), Event(b"x", b"ping")}) == 2
    assert repr(Event(b"x", b"e")) == "Event(data=b'x', name=b'e')"


@pytest.mark.parametrize(
    ("chunks", "events"),
    [
        ([b"data: x\n\n", b"data: y\n\n"], [Event(b"x"), Event(b"y")]),
        # What an earlier chunk left pending joins the whole event that follows.
        ([b"event: named\n", b"data: y\n\n"], [Event(b"y", b"named")]),
        ([b"data: a\n", b"data: b\n\n"], [Event(b"a\nb")]),
        ([b"data: a", b"data: b\n\n"], [Event(b"adata: b")]),
        ([b"data: x\r", b"data: y\n\n"], [Event(b"x\ny")]),  # a CR ended a line, not the event
        # Not one whole event of one data line.
        ([b"data: a\ndata: b\n\n"], [Event(b"a\nb")]),
        ([b"data: a\r\n\n"], [Event(b"a")]),
        ([b"data: a\n\ndata: b\n\n"], [Event(b"a"), Event(b"b")]),
    ],
)
def test_a_chunk_of_one_whole_event_after_any_state(
    chunks: list[bytes], events: list[Event]
) -> None:
    parser = SseParser()
    got: list[Event] = []
    for chunk in chunks:
        got += parser.feed(chunk)
    assert got == events


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: a\n\ndata: b\n\ndata: c\n\n",  # one step: events of one line each
        b"data: \n\ndata: [DONE]\n\n",
        b"data: a\n\ndata:b\n\n",  # not `data: `: the lines
        b"data: a\n\n\ndata: b\n\n",  # an empty line more
        b"data: a\n\n: ping\ndata: b\n\n",
        b"data: a\n\ndata: b\ndata: c\n\n",
        b"data: a\n\nevent: e\ndata: b\n\n",
        b"data: a\n\ndata: b\n\ndata: c\n",  # the last event goes on
        b"data: a\n\ndata: b\r\n\r\n",
        b"data: a\n\ndata: x\n\ndata: b\n\n\n\n",
    ],
)
def test_a_chunk_of_several_events_gives_what_its_bytes_one_by_one_give(chunk: bytes) -> None:
    def sized(events: list[Event]) -> list[tuple[bytes, bytes, int]]:
        return [(e.data, e.name, e.size) for e in events]

    for limit in (0, 7, 8, 64):  # none, one an 8-byte event passes, ones it does not
        whole, by_byte = SseParser(limit), SseParser(limit)
        one_by_one = [ev for i in range(len(chunk)) for ev in by_byte.feed(chunk[i : i + 1])]
        assert sized(whole.feed(chunk)) == sized(one_by_one)
        assert (whole.over, whole.held) == (by_byte.over, by_byte.held)


# Pieces of streams: whole one-line events (what feed takes in one step),
# lines and line endings of every kind, comments, names, fields without a space.
_PIECES = st.one_of(
    st.sampled_from(
        [
            b"data: ",
            b"data:",
            b"event: e\n",
            b": ping\n",
            b"id: 1\n",
            b"[DONE]",
            b"x",
            b"\n",
            b"\r",
            b"\r\n",
            b"\n\n",
            b"data: [DONE]\n\n",
            b"data: \n\n",
            b"data: x\r\n\n",
        ]
    ),
    st.binary(max_size=4).map(lambda b: b"data: " + b + b"\n\n"),
    st.binary(max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(_PIECES, max_size=3), max_size=8))
def test_any_split_parses_as_byte_by_byte(chunked: list[list[bytes]]) -> None:
    # Chunks of whole pieces often are one whole event, after any state; a
    # chunk of one byte never is: every split must give what the line loop gives.
    parser = SseParser()
    events: list[Event] = []
    for pieces in chunked:
        events += parser.feed(b"".join(pieces))
    stream = b"".join(b"".join(pieces) for pieces in chunked)
    assert (events, parser.close()) == parse(stream, list(range(1, len(stream))))


def test_what_the_parser_holds_is_the_event_it_is_inside() -> None:
    parser = SseParser()
    for piece in (b"data: ", b"x" * 1000, b"y" * 1000):  # a line in pieces
        assert parser.feed(piece) == []
    assert parser.held == 2006
    assert parser.feed(b"\ndata: zz\nevent: n") == []  # two data lines, a name under way
    assert parser.held == 2007 + len(b"data: zz\n") + len(b"event: n")
    assert parser.feed(b"\n\ndata: a") == [Event(b"x" * 1000 + b"y" * 1000 + b"\nzz", b"n")]
    assert parser.held == len(b"data: a")
    assert parser.close() == Event(b"a")
    assert parser.held == 0


def test_what_the_parser_holds_is_counted_not_summed_over_the_line_pieces() -> None:
    """The event relay asks `held` after every chunk: summing the pieces of
    the line under way each time would cost a line in N chunks N**2 / 2 (a
    1.3 MB line in 16-byte chunks: over a minute of the event loop). Each
    piece is measured a bounded number of times, however many came before."""

    class Piece(bytes):
        measured = 0

        def __len__(self) -> int:
            Piece.measured += 1
            return super().__len__()

    parser = SseParser()
    parser.feed(b"data: ")
    pieces = 2000
    for n in range(1, pieces + 1):
        assert parser.feed(Piece(b"x" * 16)) == []
        assert parser.held == 6 + 16 * n
    assert Piece.measured <= 5 * pieces
    assert parser.feed(b"\n\n") == [Event(b"x" * 16 * pieces)]
    assert parser.held == 0


@pytest.mark.parametrize("line", [b"data:\n", b"data: \r\n", b"data:xy\r", b"data\n"])
def test_every_data_line_held_counts_as_it_came_an_empty_one_too(line: bytes) -> None:
    """An event of short data lines holds a list slot and an object for each:
    counted by their values alone, one of empty lines would be held for ever
    at a `held` of 0 (and one of two-byte values at a twentieth of its memory)."""
    parser = SseParser()
    assert parser.feed(line * 1000) == []
    assert parser.held == len(line.replace(b"\r\n", b"\n")) * 1000
    (event,) = parser.feed(line[len(line.rstrip(b"\r\n")) :])  # a blank line
    assert event.data.count(b"\n") == 999
    assert parser.held == 0


_LINES = st.sampled_from(
    [b"data: x", b"data:yy", b"data", b": comment", b"event: e", b"id: 1", b"data: " + b"z" * 40]
)


@settings(max_examples=300, deadline=None)
# Hypothesis found it: the fast path took "data: x" for a whole event after
# "id: 1" had come alone, and the event's size lost the id line.
@example(events=[[b"id: 1", b"data: x"]], ending=b"\n", cuts=[6])
@given(
    st.lists(st.lists(_LINES, min_size=1, max_size=6), min_size=1, max_size=5),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_an_events_size_is_its_lines_as_they_came_however_they_are_split(
    events: list[list[bytes]], ending: bytes, cuts: list[int]
) -> None:
    """The relays bound an event by its size and, while it comes, by `held`:
    both must be the same however the bytes are split, or one stream would
    be cut or not by how the network cut it. `held` never passes the size of
    the event it grows into."""
    stream = b"".join(ending.join(lines) + ending * 2 for lines in events)
    dispatched = [lines for lines in events if any(not x.startswith(b":") for x in lines)]
    # A line's ending counts as one byte, whichever it is; the blank line not.
    sizes = [sum(len(line) + 1 for line in lines) for lines in dispatched]
    named = [lines for lines in dispatched if any(x.startswith((b"data", b"event")) for x in lines)]
    whole, _ = parse(stream, sorted({c for c in cuts if c < len(stream)}))
    assert len(whole) == len(named)
    expected = [size for lines, size in zip(dispatched, sizes, strict=True) if lines in named]
    assert [e.size for e in whole] == expected
    parser = SseParser()
    for lines in events:
        group = ending.join(lines) + ending * 2
        most, got = 0, []
        for i in range(len(group)):
            got += parser.feed(group[i : i + 1])
            if not got:
                most = max(most, parser.held)
        assert all(most <= event.size for event in got)


@pytest.mark.parametrize(
    "first", [b"data: x\n\n", b": ping\n\ndata: x\n\n", b"data:x\r\rdata: y\r\r"]
)
def test_a_byte_order_mark_at_the_start_is_dropped_however_it_is_split(first: bytes) -> None:
    data = b"\xef\xbb\xbf" + first
    want, _ = parse(first, [])
    assert want  # the stream has events to lose
    for cut in range(len(data) + 1):
        for second in range(cut, len(data) + 1):
            assert parse(data, [cut, second]) == (want, None), (cut, second)


def test_a_byte_order_mark_past_the_start_is_a_lines_bytes() -> None:
    # Only the stream's start may have one: a second makes the line a field
    # of another name (WHATWG), here neither data nor event.
    assert parse(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n", []) == ([], None)
    assert parse(b"data: x\n\n\xef\xbb\xbfdata: y\n\n", [9]) == ([Event(b"x")], None)
    # Bytes that began like one, and were not, are the line's.
    assert parse(b"\xefdata: x\n\n", [1]) == ([], None)


# Pieces of SSE as origins send it, odd ones too: CRLF and CR alone, comments,
# names, ids, a byte order mark, lines without their space.
_PIECES = st.sampled_from(
    [
        *(b"data: ", b"data:", b"data: [DONE]", b"{}", b"x", b" "),
        *(b"\n", b"\n\n", b"\r", b"\r\n", b": c", b"event: error", b"id: 1", b"\xef\xbb\xbf"),
        *(b"data: a\n\n", b"data: b\n\n"),
    ]
)


@settings(max_examples=1000, database=None)
@given(st.lists(st.lists(_PIECES, max_size=8).map(b"".join), max_size=5))
def test_a_verbatim_chunk_is_its_events_framed(chunks: list[bytes]) -> None:
    """Differential (review 324): a chunk's events are those it gives fed a
    byte at a time (which takes no fast path); one the parser calls verbatim
    is what framing its events one by one (`data: ` + data + LF LF) makes,
    and each event's size (and its blank line's LF) finds where the next
    begins, as the relay writes such a chunk as it came, or up to an event
    (relay._before)."""
    parser, bytewise = SseParser(), SseParser()
    for chunk in chunks:
        events = parser.feed(chunk)
        # The same events, sizes too, as fed a byte at a time (no fast path).
        alone = [ev for i in range(len(chunk)) for ev in bytewise.feed(chunk[i : i + 1])]
        assert [(ev, ev.size) for ev in events] == [(ev, ev.size) for ev in alone]
        if not parser.verbatim:
            continue
        framed = [b"data: " + ev.data + b"\n\n" for ev in events]
        assert b"".join(framed) == chunk
        assert not any(ev.name for ev in events)
        at = 0
        for i, ev in enumerate(events):
            assert chunk[:at] == b"".join(framed[:i])
            at += ev.size + 1


@settings(max_examples=1000, database=None)
@given(
    st.lists(st.lists(_PIECES, max_size=8).map(b"".join), max_size=5),
    st.sampled_from([0, 7, 8, 64]),
)
@example([b"data: x\ny", b"\n\n"], 0)  # one LF where the blank line's first goes
@example([b"data: x\r\n\n"], 0)  # a CRLF then an LF: its data is x, no CR
@example([b"data: x\ry\n\n"], 0)  # a lone CR ends a line
@example([b"id: 1\n", b"data: x\n\n"], 10)  # a line counted (14 bytes) before it
def test_one_gives_what_feed_gives(chunks: list[bytes], limit: int) -> None:
    """Differential: `one` (the relay's test for a read of one event) gives
    the data of a chunk of one plain event, the parser then left as feeding
    it leaves it (`verbatim`), or None and nothing consumed: the same events
    (sizes too), `over`, `held` and end as fed a byte at a time (no fast path),
    after any state and under any bound (none, one an 8-byte event passes,
    ones it does not)."""
    parser, bytewise = SseParser(limit), SseParser(limit)
    for chunk in chunks:
        data = parser.one(chunk)
        if data is None:
            events = parser.feed(chunk)
        else:
            assert parser.verbatim
            events = [Event(data, b"", len(data) + 7)]
        alone = [ev for i in range(len(chunk)) for ev in bytewise.feed(chunk[i : i + 1])]
        assert [(ev, ev.size) for ev in events] == [(ev, ev.size) for ev in alone]
        assert parser.over == bytewise.over
        if parser.over:  # what it holds then is nobody's: the relay cuts
            return
        assert parser.held == bytewise.held
    assert parser.close() == bytewise.close()
