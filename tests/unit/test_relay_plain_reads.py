"""The events relay's plain reads (DataSink: a read's plain events given to
its readers as their data, no Event made for each) against the path of one
Event an event: the same client bytes, ending, counts, entry and transcript,
whatever the stream and however it is cut into reads."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, cast

import pytest
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dataplane.cache.entry import CHUNK_OVERHEAD, ENTRY_OVERHEAD, StreamRecorder
from dataplane.streaming.relay import EventSink, Next, Resume, Trim, relay
from dataplane.streaming.splice import Transcript, TranscriptBudget
from dataplane.streaming.sse import Event
from dataplane.streaming.usage import UsageCounter
from tests.unit.test_stream_relay import Content, Out, no_resume


class EventsOnly:
    """A reader as the relay sees it without its `datas`: every read goes
    event by event (or by `read`), as before plain reads."""

    def __init__(self, reader: Any) -> None:
        self.event = reader.event
        if hasattr(reader, "read"):
            self.read = reader.read


def chunk_of(**members: Any) -> bytes:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return json.dumps({**head, **members}, separators=(",", ":")).encode()


def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


# A read of one content delta.
CONTENT = b"data: " + chunk_of(choices=[choice({"content": " pong"})]) + b"\n\n"


TEXTS = st.sampled_from(
    [" pong", "", "é", 'a "quoted" word', "\\u00e9", "[DONE]", "no error", "usage", "\n"]
)


@st.composite
def event_block(draw: st.DrawFn) -> list[bytes]:
    """One block's lines (without their endings)."""
    kind = draw(
        st.sampled_from(
            ["content"] * 6
            + ["usage_null"] * 3
            + ["role", "finish", "usage", "openai", "error", "named_error", "tool"]
            + ["comment", "multiline", "id", "done", "spaced", "not_json"]
        )
    )
    text = draw(TEXTS)
    if kind == "content":
        return [b"data: " + chunk_of(choices=[choice({"content": text})])]
    if kind == "role":
        return [b"data: " + chunk_of(choices=[choice({"role": "assistant", "content": ""})])]
    if kind == "finish":
        reason = draw(st.sampled_from(["stop", "length"]))
        return [b"data: " + chunk_of(choices=[choice({}, reason)])]
    if kind == "usage":
        usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
        return [b"data: " + chunk_of(choices=[], usage=usage)]
    if kind == "usage_null":
        return [b"data: " + chunk_of(choices=[choice({"content": text})], usage=None)]
    if kind == "openai":
        # OpenAI's: the null usage before the obfuscation string, or spaced,
        # or two usage keys (one in a choice), or a usage not null after a null one.
        null = draw(
            st.sampled_from(
                [
                    b'"usage":null',
                    b'"usage": null',
                    b'"usage":null,"x":{"usage":null}',
                    b'"usage":null,"x":{"usage":1}',
                ]
            )
        )
        obfuscation = draw(st.sampled_from([b"aZ3", b"", b"\\u00e9", b'\\"']))
        head = chunk_of(choices=[choice({"content": text})])[:-1]
        return [b"data: " + head + b"," + null + b',"obfuscation":"' + obfuscation + b'"}']
    if kind == "error":
        return [b'data: {"error":{"message":"overloaded"}}']
    if kind == "named_error":
        return [b"event: error", b'data: {"message":"x"}']
    if kind == "tool":
        call = {"index": 0, "function": {"arguments": text}}
        return [b"data: " + chunk_of(choices=[choice({"tool_calls": [call]})])]
    if kind == "comment":
        return [b": ping"]
    if kind == "multiline":
        return [b"data: " + chunk_of(choices=[choice({"content": text})]), b"data: more"]
    if kind == "id":
        return [b"id: 7", b"data: " + chunk_of(choices=[choice({"content": text})])]
    if kind == "done":
        return [b"data: [DONE]"]
    if kind == "spaced":
        return [b"data:" + chunk_of(choices=[choice({"content": text})])]
    return [b"data: {not json"]


@st.composite
def stream_blocks(draw: st.DrawFn) -> list[bytes]:
    """A stream's blocks, each with its blank line."""
    blocks = draw(st.lists(event_block(), min_size=1, max_size=12))
    if draw(st.booleans()):
        blocks.append([b"data: [DONE]"])
    crlf = draw(st.booleans()) and draw(st.booleans())
    end = b"\r\n" if crlf else b"\n"
    return [end.join(lines) + end + end for lines in blocks]


@st.composite
def stream_reads(draw: st.DrawFn) -> list[bytes]:
    """A stream's bytes cut into reads, mostly at its blocks' ends."""
    pieces = draw(stream_blocks())
    data = b"".join(pieces)
    cuts: set[int] = set()
    at = 0
    for piece in pieces[:-1]:
        at += len(piece)
        if draw(st.integers(0, 2)):
            cuts.add(at)
    cuts |= set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=2)))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def ending(last: Event | None, too_long: int) -> bytes:
    """An ending that shows the last event relayed (and the bound)."""
    return b"data: cut after " + (last.data if last is not None else b"-") + b"%d\n\n" % too_long


class Chunks:
    """A ChunkSink (a leader's followers' copy of what the client is sent)."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def chunk(self, data: bytes) -> None:
        self.got.append(data)


def continued_by(reads: list[bytes]) -> Resume:
    """A resume that goes on once, on another origin's stream of `reads`
    (reads of one event each, say), each event rewritten as a continuation's
    is (here its id `c1` made `c2`)."""
    left = [reads]

    async def resume(cut: str, too_long: int) -> Next | None:
        if not left:
            return None
        rest = left.pop()
        return Next(rest[0], Content(*rest[1:]), lambda data: data.replace(b'"c1"', b'"c2"'), "o2")

    return resume


async def relayed(
    reads: list[bytes],
    plain: bool,
    max_bytes: int,
    limit: int,
    trimmed: bool = True,
    following: list[bytes] | None = None,
    trim: Trim | None = None,
) -> dict[str, Any]:
    """What relaying `reads` leaves; `trim`, when given, in place of the
    counter's (`trimmed`)."""
    counter = UsageCounter(finishes=[], finished=set())
    recorder = StreamRecorder(store_truncated=True, max_bytes=max_bytes)
    budget = TranscriptBudget(limit)
    transcript = Transcript(budget)
    readers: list[Any] = [counter, recorder, transcript]
    if not plain:
        readers = [EventsOnly(reader) for reader in readers]
    out = Out()
    chunks = Chunks()
    end = await relay(
        reads[0],
        Content(*reads[1:]),
        cast(web.StreamResponse, out),
        readers=cast(list[EventSink], readers),
        chunks=chunks,
        error_event=ending,
        resume=no_resume if following is None else continued_by(following),
        trim=trim or (counter.unasked if trimmed else None),
    )
    entry = recorder.finish(now=0.0, open_event=end.open_event)
    return {
        "written": out.written,
        "chunks": chunks.got,
        "ended": out.ended,
        "end": end,
        "counted": (
            counter.content_events,
            counter.event_bytes,
            counter.usage,
            counter.error_event,
            counter.finishes,
            counter.finished,
        ),
        "entry": None
        if entry is None
        else (entry.chunks, entry.size, entry.usage_only, entry.usage_missing, entry.model),
        "recorded": (recorder.reason, recorder.too_large),
        "transcript": (transcript.events, transcript.overflow, budget.held, budget.dropped),
    }


@settings(max_examples=400)
@given(
    reads=stream_reads(),
    max_bytes=st.sampled_from([1 << 20, 600]),
    limit=st.sampled_from([1 << 20, 300]),
    trimmed=st.booleans(),
)
async def test_plain_reads_give_what_event_by_event_gives(
    reads: list[bytes], max_bytes: int, limit: int, trimmed: bool
) -> None:
    """With the usage trim (Ponto asked for usage on the client's behalf) and
    without it (the client asked: null usages are written as they came)."""
    assert await relayed(reads, True, max_bytes, limit, trimmed) == await relayed(
        reads, False, max_bytes, limit, trimmed
    )


@settings(max_examples=300)
@given(
    reads=stream_blocks(),
    max_bytes=st.sampled_from([1 << 20, 600]),
    limit=st.sampled_from([1 << 20, 300]),
    trimmed=st.booleans(),
    finished=st.booleans(),
    following=st.none() | stream_blocks(),
)
async def test_reads_of_one_event_each_give_what_event_by_event_gives(
    reads: list[bytes],
    max_bytes: int,
    limit: int,
    trimmed: bool,
    finished: bool,
    following: list[bytes] | None,
) -> None:
    """An origin that writes each event as it generates it (vLLM, SGLang):
    every read one block, which the relay takes by its one-event path
    (SseParser.one) when it is a plain event. `finished`: the answer ends
    as a whole one does (a finish, then [DONE]), so that the recorder may
    keep an entry, whose chunks are compared. `following`: a stream cut
    goes on on another origin's, read one block a read too, whose events
    are rewritten (a continuation's: never the one-event path's)."""
    if finished:
        reads = [
            *reads,
            b"data: " + chunk_of(choices=[choice({}, "stop")]) + b"\n\ndata: [DONE]\n\n",
        ]
    assert await relayed(reads, True, max_bytes, limit, trimmed, following) == await relayed(
        reads, False, max_bytes, limit, trimmed, following
    )


def dropping_pings(data: bytes) -> bytes | None:
    """A Trim that shows nothing of an event holding a usage key and the
    text ` ping`, and the others that hold one on two lines, the key on
    the second (what no trim of Ponto's does: the relay must frame it)."""
    if data.find(b'"usage"') < 0:
        return data
    if data.find(b'" ping"') >= 0:
        return None
    return data.replace(b'"usage"', b'\n"usage"')


async def test_a_trim_may_drop_a_read_of_one_event_or_show_it_on_lines() -> None:
    # Reads of one event each, with a null usage: the one-event path asks
    # the trim, and writes nothing of a dropped event, and an event shown
    # on two lines as two data lines, as event by event.
    ping = b"data: " + chunk_of(choices=[choice({"content": " ping"})], usage=None) + b"\n\n"
    pong = b"data: " + chunk_of(choices=[choice({"content": " pong"})], usage=None) + b"\n\n"
    reads = [ping, pong, CONTENT, b"data: [DONE]\n\n"]
    got = await relayed(reads, True, 1 << 20, 1 << 20, trim=dropping_pings)
    assert got == await relayed(reads, False, 1 << 20, 1 << 20, trim=dropping_pings)
    shown = pong[6:-2].replace(b'"usage"', b'\ndata: "usage"')
    assert b"".join(got["written"]) == b"data: " + shown + b"\n\n" + CONTENT + reads[-1]


class Taking:
    """A DataSink that notes how it was given each event."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []

    def event(self, ev: Event) -> None:
        self.got.append(("event", ev.data))

    def datas(self, datas: list[bytes]) -> None:
        self.got += [("datas", data) for data in datas]

    def data(self, data: bytes) -> None:
        self.got.append(("datas", data))


async def test_a_reads_content_deltas_are_given_as_data_and_the_rest_as_events() -> None:
    content = b"data: " + chunk_of(choices=[choice({"content": " pong"})]) + b"\n\n"
    usage = b"data: " + chunk_of(choices=[], usage={"prompt_tokens": 1}) + b"\n\n"
    stream = content * 3 + usage + content + b"data: [DONE]\n\n"
    taking = Taking()
    out = Out()
    await relay(
        stream,
        Content(),
        cast(web.StreamResponse, out),
        readers=[taking],
        resume=no_resume,
    )
    assert [how for how, _ in taking.got] == ["datas"] * 3 + ["event"] * 3
    assert b"".join(out.written) == stream


async def test_a_read_of_one_plain_event_is_given_as_data() -> None:
    # Reads of one event each: a plain one (a null usage too) goes to the
    # readers as its data; the usage chunk and [DONE] as events.
    content = b"data: " + chunk_of(choices=[choice({"content": " pong"})]) + b"\n\n"
    null = b"data: " + chunk_of(choices=[choice({"content": " ping"})], usage=None) + b"\n\n"
    usage = b"data: " + chunk_of(choices=[], usage={"prompt_tokens": 1}) + b"\n\n"
    reads = [content, null, content, usage, b"data: [DONE]\n\n"]
    taking = Taking()
    out = Out()
    await relay(
        reads[0],
        Content(*reads[1:]),
        cast(web.StreamResponse, out),
        readers=[taking],
        resume=no_resume,
    )
    assert [how for how, _ in taking.got] == ["datas"] * 3 + ["event"] * 2
    assert b"".join(out.written) == b"".join(reads)


class Watchful:
    """An idle bound (IdleTimeout's surface the relay uses) under which a
    wait times out unless an event came since the last wait began: the
    relay's idle timeout run out during it, with no clock."""

    delay = 30.0
    capped = False
    without_progress = True

    def __init__(self, delay: float) -> None:
        self._progress = False

    def progress(self) -> None:
        self._progress = True

    def __enter__(self) -> Watchful:
        if not self._progress:
            raise TimeoutError
        self._progress = False
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "reads",
    [
        [CONTENT * 2, CONTENT * 3, b"data: [DONE]\n\n"],
        # One event a read: the relay's one-event path (SseParser.one).
        [CONTENT] * 5 + [b"data: [DONE]\n\n"],
    ],
)
async def test_a_read_of_plain_events_alone_is_progress_for_the_idle_bound(
    monkeypatch: pytest.MonkeyPatch, reads: list[bytes]
) -> None:
    # Events are progress however the relay takes them: a read whose
    # events all go to the readers as their data keeps the stream's idle
    # bound from passing as a read of comments alone would.
    monkeypatch.setattr("dataplane.streaming.relay.IdleTimeout", Watchful)
    taking = Taking()
    out = Out()
    end = await relay(
        reads[0],
        Content(*reads[1:]),
        cast(web.StreamResponse, out),
        readers=[taking],
        idle_timeout=30.0,
        resume=no_resume,
    )
    assert [how for how, _ in taking.got] == ["datas"] * 5 + ["event"]
    assert end.cut == "" and end.complete
    assert b"".join(out.written) == b"".join(reads)


def _raw(text: bytes, finish: str | None = None) -> bytes:
    """A content chunk whose text is `text` as it is, not JSON-escaped
    (UTF-8 as OpenAI sends it, or bytes that are not UTF-8)."""
    return chunk_of(choices=[choice({"content": "@@"}, finish)]).replace(b"@@", text)


ANOTHER_CHOICE = _raw(b" pong").replace(b'"index":0', b'"index":1')

# Data a DataSink may be given (none [DONE], no usage but a null one),
# each a way its `data` may part from `event`: a chunk like the last kept
# but for its text, or for what follows it (a finish), or its text's bytes.
DATAS = st.sampled_from(
    [
        _raw(b" pong"),
        _raw(b"a"),
        _raw(b""),
        _raw("é".encode()),
        _raw(b"\xff"),
        _raw(b'\\"usage\\"'),
        _raw(b"no error"),
        _raw(b" end", "stop"),
        _raw(b" cut", "length"),
        # Like the last kept but for a byte before its text (another
        # choice's), or after it (a finish no stream sends: not natural).
        ANOTHER_CHOICE,
        _raw(b" pong").replace(b'"finish_reason":null', b'"finish_reason":"ok"'),
        chunk_of(choices=[choice({}, "stop")]),
        chunk_of(choices=[choice({"role": "assistant", "content": ""})]),
        chunk_of(choices=[choice({"content": " ping"})], usage=None),
        chunk_of(choices=[choice({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})]),
        b'{"error":{"message":"overloaded"}}',
        b"{not json",
        b"",
    ]
)


@settings(max_examples=300)
@given(
    datas=st.lists(DATAS, min_size=1, max_size=8),
    k=st.integers(0, 8),
    near=st.sampled_from([-1, 0, 1]),
)
# A second choice, unfinished, then the first's finish: no entry.
@example(datas=[_raw(b" pong"), ANOTHER_CHOICE, _raw(b" end", "stop")], k=3, near=1)
def test_data_is_event_of_an_unnamed_event(datas: list[bytes], k: int, near: int) -> None:
    """Each DataSink's `data` (the events relay's for a read of one plain
    event) against `event` of an unnamed event of it: the counter's counts,
    the recorder's entry and the transcript's events, the last two under a
    bound that the run's k-th data reaches exactly, or passes by a byte, or
    misses by one."""
    k = min(k, len(datas))
    kept = ENTRY_OVERHEAD + sum(len(data) + CHUNK_OVERHEAD for data in datas[:k]) + near
    held = sum(map(len, datas[:k])) + near

    def sunk(one: bool) -> tuple[Any, ...]:
        counter = UsageCounter(finishes=[], finished=set())
        recorder = StreamRecorder(store_truncated=True, max_bytes=kept)
        budget = TranscriptBudget(held)
        transcript = Transcript(budget)
        for data in datas:
            for reader in (counter, recorder, transcript):
                if one:
                    reader.data(data)
                else:
                    reader.event(Event(data))
        recorder.event(Event(b"[DONE]"))
        entry = recorder.finish(now=0.0)
        return (
            counter.content_events,
            counter.event_bytes,
            counter.error_event,
            counter.finishes,
            counter.finished,
            counter.unasked(datas[-1]),
            None if entry is None else (entry.chunks, entry.size, entry.usage_only),
            recorder.reason,
            recorder.too_large,
            transcript.events,
            transcript.overflow,
            budget.held,
        )

    assert sunk(True) == sunk(False)


class Stopping(Out):
    """A client's stream during which the server stops: the relay is
    cancelled in its `at`-th write (0 first)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self._at = at

    async def write(self, data: bytes) -> None:
        if len(self.written) == self._at:
            self._at = -1
            raise asyncio.CancelledError
        await super().write(data)


async def stopped_at(reads: list[bytes], plain: bool, at: int) -> tuple[list[bytes], Any]:
    taking = Taking()
    out = Stopping(at)
    with pytest.raises(asyncio.CancelledError):
        await relay(
            reads[0],
            Content(*reads[1:]),
            cast(web.StreamResponse, out),
            readers=[taking if plain else EventsOnly(taking)],
            resume=no_resume,
            stopped=lambda last: b"data: after " + (b"-" if last is None else last.data) + b"\n\n",
        )
    return out.written, taking.got


@pytest.mark.parametrize("at", range(3))
async def test_a_stop_during_a_read_of_one_event_ends_after_the_event_relayed_last(at: int) -> None:
    # Cancelled in the one-event path's write: the stopping ending is made
    # of the last event relayed (held as its data alone), as event by event.
    pings = [
        b"data: " + chunk_of(choices=[choice({"content": f" {i}"})]) + b"\n\n" for i in range(3)
    ]
    reads = [*pings, b"data: [DONE]\n\n"]
    written, got = await stopped_at(reads, True, at)
    assert written[-1] == b"data: after " + pings[at][6:-2] + b"\n\n"
    each_written, each_got = await stopped_at(reads, False, at)
    assert written == each_written
    assert [data for _, data in got] == [data for _, data in each_got]
