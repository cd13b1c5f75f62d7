"""Relaying an origin's stream to the client, and who reads it on the way.

Two relays, by whether the stream may be continued on another origin
(`resume`: a chat or completions stream whose tenant has continuation on,
the default):

- Without it (continuation off, a Responses stream, a stored response
  streamed again), the origin's bytes go to the client unchanged: its line
  endings, `id:` and `retry:` lines, comments and blank lines as they came.
  Only where they are cut differs: each write ends at an event's blank line
  (the bytes after it are held until the next one ends), so a cut never
  leaves the client half an event; the stream ends with the answer's last
  event (below); and the proxy adds its own ends (the error event, or what
  `whole` gives). (A Responses stream's ids may be rewritten before
  the relay: dataplane.upstream.responseids.)
- With it, the client is sent the origin's events re-framed, not its
  bytes: each whole event as `event: NAME` (if named) and one `data: ` line
  per data line, LF line endings and a blank line (a CRLF or CR becomes LF,
  `data:x` becomes `data: x`, a byte order mark goes); `id:`, `retry:` and
  other fields are dropped (OpenAI-style streams carry none that a client
  reads); comments are dropped, and a read of the origin's with comments and
  no event is answered with a KEEP_ALIVE of the relay's own, at most every
  KEEP_ALIVE_EVERY_S; an in-band error event is a cut, never relayed; and a
  continuation's events are rewritten to look like the first origin's
  (dataplane.streaming.splice). Nearly every event (one `data: ` line, LF)
  comes out as it came in.

When anyone reads the stream (usage counting, the cache's recorder), one
`SseParser` turns the bytes into events once and each reader gets them; a
flight's leader gets the chunks written to its client for its followers.
Both relays parse every chunk: the bound on an event (`max_event_bytes`) and
the ending made of the last event relayed need it.

The client's stream ends with the answer's last event (chat's and
completions' `data: [DONE]`, a Responses stream's response.completed, .failed
or .incomplete), without waiting for the end of the origin's body, which may
come a moment later (uvicorn writes a chunked body's last chunk on its own):
a client that closes as soon as it has the last event (the openai SDK does)
has had the whole answer. The caller then lets the origin's connection wait
for that end (`OriginAnswer.ended`).

Contract: once the client has a byte the response is committed; a failure of
the origin (a cut, a body that ends before the answer's last event, a stall
past the idle timeout, an in-band error event with `resume`) is
continued on another origin when the caller gives a `resume` hook that finds
one (dataplane.streaming.splice), and otherwise ends the client's stream with
the caller's `error_event` (a well-formed SSE error event, and `data: [DONE]`
but in a Responses stream, whose error event is numbered after the last
event relayed: `next_sequence_number`), never a hang; a client that
goes away ends the relay, and the caller releases the origins' responses,
which closes their connections (vLLM then aborts the generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp

from dataplane import jsonio
from dataplane.streaming.splice import ERROR_EVENT, is_error_event
from dataplane.streaming.sse import DONE, Event, SseParser
from dataplane.timer import IdleTimeout
from dataplane.upstream.wire import DEFAULT_MAX_ANSWER_BYTES

__all__ = [
    "ERROR_EVENT",
    "STALL_CUTS",
    "ChunkSink",
    "DataSink",
    "Ending",
    "EventSink",
    "Next",
    "OwnEnd",
    "ReadSink",
    "Readable",
    "RelayEnd",
    "Resume",
    "Stopped",
    "Trim",
    "Watch",
    "Whole",
    "Writable",
    "next_sequence_number",
    "relay",
    "write_stopped",
]


class EventSink(Protocol):
    """A reader of a relayed stream's events, given each in order, as the
    origin sent it (a continuation's as rewritten). One that has a `read`
    method too (ReadSink) is given, instead, a read's events in one call
    whenever all of them reach the client."""

    def event(self, ev: Event) -> None: ...


class ReadSink(EventSink, Protocol):
    def read(self, events: list[Event]) -> None:
        """`event` of each of `events`, in order: one call a read, not one an
        event (dataplane.streaming.splice.Transcript)."""
        ...


class DataSink(EventSink, Protocol):
    def datas(self, datas: list[bytes]) -> None:
        """`event` of an unnamed event of each of `datas`, in order, none
        `[DONE]` and none holding a `"usage"` key but in a null usage
        (`"usage":null`, each such key; nor, from the relay, the word
        `error`): the events relay gives a read's plain events so, with
        no Event made for each, when every reader has this method."""
        ...

    def data(self, data: bytes) -> None:
        """`datas([data])`, one call and no list: the events relay gives a
        read of one plain event so (nearly every read of an origin that
        writes each event as it generates it)."""
        ...


class ChunkSink(Protocol):
    def chunk(self, data: bytes) -> None: ...


class Writable(Protocol):
    """The client's stream as the relay writes it (aiohttp's StreamResponse,
    prepared; or a flight leader's, dataplane.http.reply.LeaderStream). A
    client gone raises ConnectionResetError."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


class Readable(Protocol):
    """An origin's body as the relay reads it (aiohttp's StreamReader)."""

    async def readany(self) -> bytes: ...


@dataclass(slots=True)
class Next:
    """Where a broken stream goes on: another origin's stream, and how its
    events are rewritten (dataplane.streaming.splice.Splicer.rewrite)."""

    first: bytes
    content: Readable
    rewrite: Callable[[bytes], bytes | None]
    # The origin it comes from ("": the proxy's own ending).
    origin: str = ""
    # The proxy's own ending adds nothing of its own to the answer: the
    # origin had sent all of it but `[DONE]`.
    whole: bool = False
    # The proxy's own ending is the token budget's (`finish_reason: "length"`):
    # the budget was spent at the cut.
    length: bool = False


@dataclass(frozen=True, slots=True)
class OwnEnd:
    """The end the proxy writes to a stream whose origin broke it off after
    the whole answer, before its last chunks (the usage chunk, `[DONE]`)."""

    data: bytes
    # It adds nothing of its own to the answer (only `[DONE]` was missing):
    # the answer is the origin's, whole, and may be kept.
    whole: bool


class Whole(Protocol):
    def __call__(self, cut: str, before: Event | None, last: Event | None) -> OwnEnd | None:
        """At `cut` of a stream relayed as it came (no `resume`), after the
        client got `last` (and `before` it), the last whole events relayed:
        the proxy's end of an answer the origin had sent whole, or None
        (the stream was cut: the error event ends it)."""
        ...


class Trim(Protocol):
    def __call__(self, data: bytes) -> bytes | None:
        """What the client is shown of an event's `data` (its readers, and
        the ending hooks, have the event as it came): `data` itself
        (nearly always, and always for `data` without a `"usage"` key: the
        events relay asks about a read's plain events only when one holds a
        null usage),
        other bytes, or None for nothing of the event
        (dataplane.streaming.usage.for_unasked)."""
        ...


class Ending(Protocol):
    def __call__(self, last: Event | None, too_long: int) -> bytes:
        """The bytes that end a stream cut after the client got `last`, the
        last whole event relayed to it (None: not one). `too_long`: the bound
        (--max-answer-bytes) an event of the stream passed, when that cut it,
        which the same request would pass again; 0 when the origin broke the
        stream off."""
        ...


class Stopped(Protocol):
    def __call__(self, last: Event | None) -> bytes | None:
        """At a cancellation of the relay, after `last` was handed to the
        client's connection (None: not one): the bytes that end its stream if
        the server is stopping, None if the client left (nothing to write). A
        cancel that lands in a write's wait for the client to take its bytes
        (aiohttp's drain) comes after the transport took them, so they go out
        before the ending does."""
        ...


# How long a stream cancelled by a stopping server may take to be sent its
# ending: a client that does not take a few hundred bytes in that time gets none.
STOPPED_WRITE_S: Final = 1.0


class Watch(Protocol):
    """Who bounds a stream's waits by its origin's health (dataplane.upstream.stalls)."""

    def attach(self, idle: IdleTimeout) -> None: ...

    def move(self, origin: str) -> None: ...


class Resume(Protocol):
    async def __call__(self, cut: str, too_long: int) -> Next | None:
        """The stream to continue with after `cut`, or None to end with the
        error event; `too_long` as for Ending."""
        ...


@dataclass(slots=True)
class RelayEnd:
    """How a relay ended."""

    # The client got the whole answer: up to its last event (the origin's
    # body may not have ended yet), or the end the proxy wrote in its place
    # (`ended`, or `Next.whole`). A body that ended before that event did not
    # end the answer, however cleanly (ENDED_EARLY): that is a cut.
    complete: bool = False
    # Why the origin's stream stopped early, if it did ("" otherwise); with
    # continuations, the last cut that was not continued.
    cut: str = ""
    # Why each continued stream stopped, in order.
    continued: list[str] = field(default_factory=list)
    # Why the origin's stream stopped where the proxy wrote the answer's end
    # itself, with something of its own in it (a finish reason, or a usage
    # chunk it estimated): "" otherwise. Not the origin's answer: not kept.
    ended: str = ""
    # That ending was the token budget's (Next.length).
    truncated: bool = False
    # The client went away before the end. With `complete` too: a flight
    # leader's client, gone while followers were there; the origin's stream
    # was relayed to its end for them (dataplane.http.reply.LeaderStream).
    client_gone: bool = False
    # What the parser held when the stream ended (see SseParser.close).
    open_event: Event | None = None
    # The bound (--max-answer-bytes) an event passed, when that made the
    # `cut` (0 otherwise): the request's doing as much as the origin's.
    too_long: int = 0


async def relay(
    first: bytes,
    content: Readable,
    out: Writable,
    *,
    readers: Sequence[EventSink] = (),
    chunks: ChunkSink | None = None,
    error_event: bytes | Ending = b"",
    idle_timeout: float | None = None,
    resume: Resume | None = None,
    max_event_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    stopped: Stopped | None = None,
    watch: Watch | None = None,
    whole: Whole | None = None,
    trim: Trim | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RelayEnd:
    """Write `first`, then the rest of `content`, to the prepared `out`.

    A cut (read error, timeout, no chunk for `idle_timeout` seconds (after
    the first event, no event: comments do not count), an
    event longer than `max_event_bytes`, which would all be held, or the
    body's end before the answer's last event, clean or not) writes
    `error_event` (or what it makes of the last event relayed) and returns
    with `cut` set, unless `resume` gives a stream to go on with. A
    cancellation (the client vanished with the server's handler cancellation
    on, or the stopping server cancelled the handler) propagates; the caller
    learns of it in its `finally`. Before it does, what `stopped` makes of
    the last event relayed, if anything, ends the client's stream within
    STOPPED_WRITE_S: a server that stops ends a stream with an error event,
    not a cut; a client that left gets nothing.

    `watch` is given the idle bound (when there is one) and told of each
    origin continued on, so that a stream stalled on an origin the table
    marks unhealthy is cut sooner.

    Without `resume`, `whole` is asked at a cut by the origin (a read error,
    the idle timeout, its body's end) whether the answer was whole but its
    last chunks, and what it gives ends the stream in their place (`ended`
    when it adds a chunk of its own); with `resume`, the hook does that
    (dataplane.http.resume).

    With `trim`, each event reaches the client as it says (a flight's
    followers too); the readers still get it as it came. Without `resume`
    the event's bytes are cut out of the origin's, or its data replaced
    where it stands (found as one run of bytes: an event of several data
    lines, which no chunk with a usage is, goes as it came).

    With `resume`, the client is sent whole events only, re-framed as
    `data:` lines (a stream broken inside an event must not leave half an
    event before the continuation's), and an origin's in-band error event
    counts as a cut; the origin's comments become a KEEP_ALIVE of the
    relay's own, at most every KEEP_ALIVE_EVERY_S of `clock`. Without it,
    the origin's bytes go through unchanged.
    """
    # One timer for the whole stream, not one per chunk (dataplane.timer).
    idle = IdleTimeout(idle_timeout) if idle_timeout is not None else None
    if idle is not None:
        # Bounded from the stream's start, then from each event, never from
        # a comment: see _relay_events.
        idle.progress()
    if idle is None:
        watch = None
    elif watch is not None:
        watch.attach(idle)
    try:
        if resume is not None:
            return await _relay_events(
                first,
                content,
                out,
                readers,
                chunks,
                error_event,
                idle,
                resume,
                max_event_bytes,
                stopped,
                watch,
                trim,
                clock,
            )
        return await _relay_bytes(
            first,
            content,
            out,
            readers,
            chunks,
            error_event,
            idle,
            max_event_bytes,
            stopped,
            whole,
            trim,
        )
    finally:
        if idle is not None:
            idle.close()


async def _relay_bytes(
    first: bytes,
    content: Readable,
    out: Writable,
    readers: Sequence[EventSink],
    chunks: ChunkSink | None,
    error_event: bytes | Ending,
    idle: IdleTimeout | None,
    max_event_bytes: int,
    stopped: Stopped | None,
    whole_hook: Whole | None,
    trim: Trim | None,
) -> RelayEnd:
    end = RelayEnd()
    # Its readers' events, the last one for an ending made from it, and the
    # bound: the parser measures each block (Event.size) whatever the split,
    # as the events relay does, and gives no event from the first block past
    # the bound on, which is never written.
    parser = SseParser(max_event_bytes)
    last: Event | None = None  # the last whole event: the client gets each at once
    before: Event | None = None  # the one before it (a usage chunk follows the finish)
    chunk = first
    # Bytes after the last event boundary are held until the event is whole,
    # so a cut never leaves the client half an event before the error event:
    # as the pieces they came in (joined once, when the event ends), and the
    # last 3 of them (a boundary the next chunk completes starts there).
    held: list[bytes] = []
    held_size = 0
    tail = b""
    # The whole events last written: whether they end the answer is asked only
    # when the connection fails, not for every chunk.
    written = b""
    eof = False  # the stream's end is being written: nothing more may be
    answered = False  # the client is being written the answer's last event
    # What `trim` changes of the events not written yet: (data, shown).
    trimmed: list[tuple[bytes, bytes | None]] = []
    by_read, by_event = _by_read(readers)
    try:
        while True:
            events = parser.feed(chunk)
            if events and idle is not None:
                idle.progress()  # see _relay_events
            if events:  # every event parsed reaches the client (or ends it: `last`)
                for read in by_read:
                    read(events)
            for ev in events:
                for reader in by_event:
                    reader.event(ev)
                before, last = last, ev
                if trim is not None and (shown := trim(ev.data)) is not ev.data:
                    trimmed.append((ev.data, shown))
            if not held_size:
                whole = chunk
            elif _boundary(tail + chunk):
                held.append(chunk)
                whole = b"".join(held)
                held = []
                held_size = 0
            else:  # the event goes on
                whole = b""
                held.append(chunk)
                held_size += len(chunk)
                tail = (tail + chunk[-3:])[-3:]
            if whole:
                at = _boundary(whole)
                if at < len(whole):
                    rest = whole[at:]
                    held = [rest]
                    held_size = len(rest)
                    tail = rest[-3:]
                if at:
                    data = whole[:at] if held_size else whole
                    if parser.over:
                        # A block these bytes end is past the bound: the
                        # whole events before it go, none of it.
                        long = _long_block(data, max_event_bytes)
                        before_long = data[:long]
                        if trimmed:  # every event parsed ends before it
                            before_long = _trimmed(before_long, trimmed)
                        if before_long:
                            if chunks is not None:
                                chunks.chunk(before_long)
                            await out.write(before_long)
                        end.cut, end.too_long = _too_long(max_event_bytes), max_event_bytes
                        await out.write(_ending(error_event, last, max_event_bytes))
                        break
                    if trimmed:
                        # Every event parsed so far ends within `data`; nothing
                        # is left of one that held only the usage chunk.
                        data = _trimmed(data, trimmed)
                        trimmed = []
                    if data:
                        if chunks is not None:
                            chunks.chunk(data)
                        # write() waits for the client's socket to drain: backpressure
                        # reaches the origin through the unread upstream socket (but
                        # for a followed flight's leader, whose writes are queued,
                        # up to a bound: dataplane.http.reply.LeaderStream).
                        # Known before the write: a stop that lands while the
                        # client takes the last event adds no ending after it.
                        answered = whole_events_end_answer(data)
                        await out.write(data)
                        written = data
                        if answered:
                            # The client has the whole answer, and may close at once
                            # (the openai SDK does at [DONE]): its stream ends now, not
                            # at the origin's last chunk, which may come just after.
                            end.complete = True
                            break
            # A read of whole one-line events (`verbatim`) leaves nothing held
            # nor over: `held` (a property, a call) is not asked of it.
            if not parser.verbatim and (parser.over or parser.held > max_event_bytes):
                end.cut, end.too_long = _too_long(max_event_bytes), max_event_bytes
                await out.write(_ending(error_event, last, max_event_bytes))
                break
            try:
                # Awaited here, not in a coroutine of its own: a frame a read.
                if idle is None:
                    chunk = await content.readany()
                else:
                    with idle:
                        chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                cut = _why(exc, idle)
                # The body's reader keeps its error, whose traceback holds
                # this frame (`out`, so the request and its body): a cycle
                # only a full garbage collection frees.
                exc.__traceback__ = None
            else:
                if chunk:
                    continue
                data = b"".join(held)
                if ends_answer(data):  # its last event without its blank line: as it came
                    if chunks is not None:
                        chunks.chunk(data)
                    answered = True
                    await out.write(data)
                    end.complete = True
                    break
                # A body that ends, however cleanly, before the answer's last
                # event is a cut as a dropped connection is (a new user's
                # trial: a chat stream that ended after two deltas, with no
                # finish and no [DONE], was logged a whole 200, and the
                # client had half an answer and no error).
                cut = ENDED_INSIDE_EVENT if data.strip(b"\r\n") else ENDED_EARLY
            # A stream that stops after the last event ended a whole answer.
            if ends_answer(written):
                end.complete = True
                break
            own = whole_hook(cut, before, last) if whole_hook is not None else None
            if own is None:
                end.cut = cut
                await out.write(_ending(error_event, last))
                break
            # Its readers read it as the origin's last chunks (the
            # recorder keeps a whole answer only once it has [DONE]); the
            # origin's event it cut off is gone (`open_event` is not it).
            parser = SseParser(max_event_bytes)
            for ev in parser.feed(own.data):
                for reader in readers:
                    reader.event(ev)
            if chunks is not None:
                chunks.chunk(own.data)
            answered = True
            await out.write(own.data)
            end.complete = True
            if not own.whole:
                end.ended = cut
            break
        eof = True
        await out.write_eof()
    except ConnectionResetError:
        _client_left(end)
    except asyncio.CancelledError:
        # Every whole event parsed was written (held bytes are not): the
        # ending follows `last`.
        await _end_stopped(out, stopped, last, end, eof, answered)
        raise
    end.open_event = parser.close()
    return end


async def _relay_events(
    first: bytes,
    content: Readable,
    out: Writable,
    readers: Sequence[EventSink],
    chunks: ChunkSink | None,
    error_event: bytes | Ending,
    idle: IdleTimeout | None,
    resume: Resume,
    max_event_bytes: int,
    stopped: Stopped | None,
    watch: Watch | None,
    trim: Trim | None,
    clock: Callable[[], float],
) -> RelayEnd:
    end = RelayEnd()
    parser = SseParser(max_event_bytes)
    # The last event written to the client; a plain event's data alone
    # (_last_event makes it an Event).
    last: Event | bytes | None = None
    rewrite: Callable[[bytes], bytes | None] | None = None
    done = False  # the client has the stream's last event: nothing after it matters
    chunk = first
    eof = False  # the stream's end is being written: nothing more may be
    quiet_until = float("-inf")  # no keep-alive is written before (`clock`)
    by_read, by_event = _by_read(readers)
    # Every reader's `datas` and `data` (DataSink's), or None when one has none.
    sinks = _by_datas(readers)
    by_datas, by_data = sinks if sinks is not None else (None, None)
    try:
        while True:
            cut = ""
            too_long = 0  # the bound, when an event passing it made the cut
            # A read of one plain event (nearly every read of an origin that
            # writes each event as it generates it: vLLM, SGLang) goes on
            # unchanged, as a read of many does below: its readers are given
            # its data, the client its bytes (or what the trim shows of a
            # null usage), with no Event made (`last` holds its data: one is
            # made only at a cut) and none of the tests below. The data's
            # first byte (chunk[6]) `{`, an object, is no [DONE].
            one = parser.one(chunk) if by_datas is not None and rewrite is None else None
            special = 0  # where a usage but a null one starts: < 0, none
            null = -1  # where a null usage starts (OpenAI's, SGLang's: every chunk)
            # partition, not find, where only whether it holds a word is asked:
            # one argument, not a tuple of them parsed (dataplane.streaming.usage).
            if one is not None and chunk[6] == 0x7B and not chunk.partition(b"error")[1]:
                special = null = chunk.find(b'"usage"')
                while special >= 0 and chunk[special + 7 : special + 12] == b":null":
                    special = chunk.find(b'"usage"', special + 12)
            if special < 0 and one is not None and by_data is not None:
                for take_one in by_data:
                    take_one(one)
                last = one
                if idle is not None:
                    idle.progress()  # an event: see below
                framed = chunk
                if null >= 0 and trim is not None and (shown := trim(one)) is not one:
                    framed = (
                        b""
                        if shown is None
                        else b"data: " + shown + b"\n\n"
                        if shown.find(b"\n") < 0
                        else _frame(Event(shown))
                    )
                if framed:
                    if chunks is not None:
                        chunks.chunk(framed)
                    await out.write(framed)
            else:
                frames: list[bytes] = []
                # The read's leading plain events' bytes (below), and where
                # the rest starts.
                at = 0
                datas = (
                    ([one] if one is not None else parser.plain(chunk))
                    if by_datas is not None
                    else None
                )
                if datas is None:
                    events = parser.feed(chunk)
                elif len(datas) == 1:
                    # A read of one event the path above did not take (a usage
                    # chunk, [DONE], one that may be an error) costs less as an
                    # Event than the searches below (and a comprehension is a
                    # frame of its own).
                    events = [Event(datas[0], b"", len(datas[0]) + 7)]
                    datas = None
                # A chunk of whole one-line events, which is what framing each
                # would make of it, is written as it came while its events go
                # on unchanged (nearly always): not framed event by event.
                verbatim = parser.verbatim and rewrite is None
                # Its events' data are its bytes: one search of them all clears
                # every event of being an error (nearly every read), where each
                # was searched on its own.
                errors = not verbatim or chunk.find(b"error") >= 0
                if datas is not None and errors:
                    events = [Event(data, b"", len(data) + 7) for data in datas]
                elif datas is not None:
                    # Whole one-line events, free of errors, going on unchanged:
                    # those before the first that may be the usage chunk or
                    # [DONE] (nearly all: one search of the read for each) are
                    # plain, each what `event` would take as a content delta,
                    # its trim showing it as it came or (a null usage, which
                    # OpenAI puts in every chunk of a stream asked for usage)
                    # without that member. Its readers are given their data at
                    # once; no Event is made for each, and none is looked at by
                    # itself again. The rest go as below.
                    special = chunk.find(b'"usage"')
                    null = -1  # where the first null usage is, if one comes before `special`
                    while special >= 0 and chunk[special + 7 : special + 12] == b":null":
                        if null < 0:
                            null = special
                        special = chunk.find(b'"usage"', special + 12)
                    found = chunk.find(DONE)
                    if special < 0 or 0 <= found < special:
                        special = found
                    count = len(datas)
                    if special >= 0:
                        # The rest start after the blank line before `special`;
                        # counted from the read's end by their lengths (each
                        # `data: `, its data and LF LF), not by a count of the
                        # blank lines before it, which goes byte by byte.
                        blank = chunk.rfind(b"\n\n", 0, special)
                        at = blank + 2 if blank >= 0 else 0
                        rest = len(chunk) - at
                        while rest > 0:
                            count -= 1
                            rest -= len(datas[count]) + 8
                    elif count:
                        at = len(chunk)
                    if count:
                        plain = datas[:count] if count < len(datas) else datas
                        for take in by_datas or ():
                            take(plain)
                        last = plain[-1]
                        if trim is not None and 0 <= null < at:
                            # Their null usages go (a Trim's, after the readers
                            # had them): each framed as the trim shows it.
                            verbatim = False
                            for data in plain:
                                if (shown := trim(data)) is not None:
                                    frames.append(
                                        b"data: " + shown + b"\n\n"
                                        if shown.find(b"\n") < 0
                                        else _frame(Event(shown))
                                    )
                    events = [Event(data, b"", len(data) + 7) for data in datas[count:]]
                # Such a read, free of errors, reaches the client whole: its
                # readers that take a read at once are given it so.
                each = by_event if not errors else readers
                if not errors and events:
                    for read in by_read:
                        read(events)
                if (events or at) and idle is not None:
                    # The idle timeout counts from the last event, not from the
                    # last byte: an origin's comments (which the client is sent a
                    # keep-alive for) keep no stalled stream open (trial 65: one
                    # event, then `:` every second, held a stream 11 minutes).
                    # Before its first event, a queue's or a prefill's comments
                    # were the forwarder's to wait through (`first_chunk_within`,
                    # from the call); a stream committed without one (more
                    # comments than it holds) counts from its start.
                    idle.progress()
                for parsed in events:
                    ev, data = parsed, parsed.data
                    if not ev.done:
                        if rewrite is not None:
                            try:
                                rewritten = rewrite(data)
                            # An origin's bytes: whatever they hold, a cut, never a crash.
                            except Exception as exc:
                                cut = str(exc) or type(exc).__name__
                                break
                            if rewritten is None:
                                continue
                            if rewritten is not data:
                                ev, data = Event(rewritten, ev.name), rewritten
                        # is_error_event's first search, inline, in a read that
                        # may hold an error: this runs for each of its events.
                        elif errors and data.find(b"error", 0, 48) >= 0 and is_error_event(data):
                            cut = ERROR_EVENT
                            if verbatim:
                                frames = _before(chunk, events, ev, at)
                            break
                    for reader in each:
                        reader.event(ev)
                    last = ev
                    # A name first: nearly every event has none (a set lookup each).
                    if ev.done or (ev.name and ev.name in RESPONSES_ENDS):
                        done = True
                    if trim is not None and (shown := trim(data)) is not data:
                        if verbatim:
                            frames = _before(chunk, events, ev, at)
                            verbatim = False
                        if shown is None:
                            continue
                        data = shown  # framed below without an Event of its own
                    if verbatim:
                        continue
                    # _frame's common case (one data line, no name) inline: per event.
                    if not ev.name and data.find(b"\n") < 0:
                        frames.append(b"data: " + data + b"\n\n")
                    else:
                        frames.append(_frame(Event(data, ev.name)))
                if verbatim and not cut:
                    frames = [chunk]
                if frames:
                    framed = b"".join(frames)
                    if chunks is not None:
                        chunks.chunk(framed)
                    await out.write(framed)
                elif not cut and _comments(chunk) and (now := clock()) >= quiet_until:
                    # A read that completed no event, only the origin's comments
                    # (`: keep-alive`, `: ping`): the parser drops them, and the
                    # client, whose load balancer or browser may close a stream
                    # idle for long, would hear nothing while the origin pings (a
                    # new user's trial: 6 s of silence through the proxy, 1 s
                    # direct). One comment of its own, at most every
                    # KEEP_ALIVE_EVERY_S; looked for only in reads without an event.
                    quiet_until = now + KEEP_ALIVE_EVERY_S
                    if chunks is not None:
                        chunks.chunk(KEEP_ALIVE)
                    await out.write(KEEP_ALIVE)
                if done and not cut:  # the client has the whole answer: see _relay_bytes
                    end.complete = True
                    break
                # A block past the bound (its events before it were written), or
                # the one under way: never relayed, in part or whole.
                # (Not asked of a `verbatim` read: see _relay_bytes.)
                if (
                    not cut
                    and not parser.verbatim
                    and (parser.over or parser.held > max_event_bytes)
                ):
                    cut, too_long = _too_long(max_event_bytes), max_event_bytes
            if not cut:
                try:
                    if idle is None:  # see _relay_bytes
                        chunk = await content.readany()
                    else:
                        with idle:
                            chunk = await content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    cut = _why(exc, idle)
                    exc.__traceback__ = None  # see _relay_bytes
                else:
                    if chunk:
                        continue
                    # Not the answer's end, which `done` is: see _relay_bytes.
                    cut = ENDED_EARLY if parser.close() is None else ENDED_INSIDE_EVENT
            if done:  # a connection that drops after the last event ended a whole answer
                end.complete = True
                break
            following = await resume(cut, too_long)
            if following is None:
                end.cut, end.too_long = cut, too_long
                await out.write(_ending(error_event, _last_event(last), too_long))
                break
            if following.origin:
                end.continued.append(cut)
            elif not following.whole:
                end.ended = cut
                end.truncated = following.length
            if watch is not None:
                watch.move(following.origin)
            if idle is not None:
                idle.progress()  # another origin's stream: bounded from its start
            parser = SseParser(max_event_bytes)
            chunk, content, rewrite = following.first, following.content, following.rewrite
        eof = True
        await out.write_eof()
    except ConnectionResetError:
        _client_left(end)
    except asyncio.CancelledError:
        await _end_stopped(out, stopped, _last_event(last), end, eof, done)
        raise
    return end


async def _end_stopped(
    out: Writable,
    stopped: Stopped | None,
    last: Event | None,
    end: RelayEnd,
    eof: bool,
    answered: bool,
) -> None:
    """Write what `stopped` makes of `last`, and the stream's end, if it
    makes anything and the answer had not ended; a client gone, or too slow
    to take it within STOPPED_WRITE_S, gets nothing more. A stream already
    cut has its ending (written before the wait the cancellation came in),
    and one `answered` its last event: each gets only the stream's end
    (review 37: a chunked body without its last chunk; review 38: an error
    after [DONE]), and one whose end was being written (`eof`) nothing."""
    if stopped is None or end.complete or eof:
        return
    ending = stopped(last)
    if ending is not None:
        await write_stopped(out, b"" if end.cut or answered else ending)


async def write_stopped(out: Writable, ending: bytes) -> None:
    """Write `ending` (if any) and the stream's end to the client of a stream
    the stopping server cancelled, within STOPPED_WRITE_S; a client gone or
    too slow gets nothing more. The task is being cancelled already: a second
    cancellation (the server's last word) ends the write as the timeout does.
    Not for a stream whose end was being written (a second would follow its
    last chunk)."""
    with contextlib.suppress(ConnectionResetError, TimeoutError, asyncio.CancelledError):
        async with asyncio.timeout(STOPPED_WRITE_S):
            if ending:
                await out.write(ending)
            await out.write_eof()


def _by_read(
    readers: Sequence[EventSink],
) -> tuple[list[Callable[[list[Event]], None]], list[EventSink]]:
    """`readers`' `read` methods (ReadSink's), and the readers that have none."""
    by_read: list[Callable[[list[Event]], None]] = []
    by_event: list[EventSink] = []
    for reader in readers:
        read = getattr(reader, "read", None)
        if read is None:
            by_event.append(reader)
        else:
            by_read.append(read)
    return by_read, by_event


def _by_datas(
    readers: Sequence[EventSink],
) -> tuple[list[Callable[[list[bytes]], None]], list[Callable[[bytes], None]]] | None:
    """`readers`' `datas` and `data` methods (DataSink's), None when one
    has not both."""
    by_datas: list[Callable[[list[bytes]], None]] = []
    by_data: list[Callable[[bytes], None]] = []
    for reader in readers:
        take = getattr(reader, "datas", None)
        one = getattr(reader, "data", None)
        if take is None or one is None:
            return None
        by_datas.append(take)
        by_data.append(one)
    return by_datas, by_data


def _last_event(last: Event | bytes | None) -> Event | None:
    """The events relay's last event relayed, which it holds as its data
    alone when it was a plain one (as a read's plain events are given to
    DataSinks): an Event is made of it at a cut, not for every read."""
    return Event(last, b"", len(last) + 7) if isinstance(last, bytes) else last


def _client_left(end: RelayEnd) -> None:
    """The client's connection failed a write. After the answer was whole
    (`complete`: only the stream's end was left to write), the client had it
    all, and may well have closed at its last event (the openai SDK does,
    at [DONE]): not a client gone."""
    if not end.complete:
        end.client_gone = True


# Why a stream whose body ended before the answer's last event stopped: its
# last event (chat's and completions' `data: [DONE]`, a Responses stream's
# response.completed, .failed or .incomplete) is what says an answer is
# whole; a body's end is only the connection's (a chunked body's last chunk).
ENDED_EARLY: Final = "the origin's body ended before the answer's last event"
ENDED_INSIDE_EVENT: Final = "the origin's body ended inside an event"

# The events that end a Responses stream, which has no `data: [DONE]`.
RESPONSES_ENDS: Final = frozenset(
    {b"response.completed", b"response.failed", b"response.incomplete"}
)
_RESPONSES_END = re.compile(
    rb"^event: ?(?:" + b"|".join(re.escape(name) for name in sorted(RESPONSES_ENDS)) + rb")\r?$",
    re.M,
)


def next_sequence_number(last: Event | None) -> int | None:
    """The `sequence_number` of a Responses event written after `last`: one
    more than last's, 0 when nothing was relayed (OpenAI numbers a stream
    from 0), None when last carries none (an origin that numbers nothing).

    Parses only `last`, once, at a cut: the events relayed before it are
    not parsed for this."""
    if last is None:
        return 0
    try:
        obj = jsonio.loads(last.data)
    except jsonio.JSONDecodeError:
        return None
    number = obj.get("sequence_number") if isinstance(obj, dict) else None
    if isinstance(number, int) and not isinstance(number, bool) and number >= 0:
        return number + 1
    return None


def _ending(error_event: bytes | Ending, last: Event | None, too_long: int = 0) -> bytes:
    return error_event if isinstance(error_event, bytes) else error_event(last, too_long)


def ends_answer(data: bytes) -> bool:
    """Whether whole events `data` end with a stream's last event: chat's and
    completions' `data: [DONE]`, or a Responses stream's response.completed,
    .failed or .incomplete."""
    tail = data.rstrip()
    if tail.endswith(b"[DONE]"):
        return True
    last = tail[tail.rfind(b"\n\n") + 1 :]
    return b"event:" in last and _RESPONSES_END.search(last) is not None


def whole_events_end_answer(data: bytes) -> bool:
    """`ends_answer` for whole events (ending in a blank line), made on every
    chunk: a cheap look first for what it looks for, so that most chunks are
    not copied by its strip."""
    may_end = data.endswith((b"]\n\n", b"]\r\n\r\n", b"]\r\r")) or b"event:" in data
    return may_end and ends_answer(data)


def _boundary(data: bytes) -> int:
    """The end of the last whole event in data (0: none): after a blank line,
    two line endings in a row, each LF, CR or CRLF. Every such pair holds
    LF LF, LF CR or CR CR (a CRLF then an LF holds the first, a CRLF then a
    CR the second); a CR that ends it takes the LF after it, if one came."""
    at = data.rfind(b"\n\n")
    end = at + 2 if at >= 0 else 0
    if b"\r" in data:
        for pair in (b"\n\r", b"\r\r"):
            at = data.rfind(pair)
            if at >= 0:
                after = at + 2
                if data[after : after + 1] == b"\n":
                    after += 1
                end = max(end, after)
    return end


# A blank line: two line endings in a row (CRLF, CR or LF each; a CRLF is
# one, never a CR then an LF).
_BLANK = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")


def _trimmed(data: bytes, trimmed: list[tuple[bytes, bytes | None]]) -> bytes:
    """Whole events `data` as the client is shown them: each event's data
    (`trimmed`, in order) replaced where it stands, or its block (from the
    end of the block before it to its blank line's end) cut out when the
    client is shown nothing of it. An event's data not found as one run of
    bytes (several data lines) is left as it came. Runs for the few events
    a `Trim` changes (a stream's usage chunk), never for the others. A CRLF
    stream read in two between the CR and the LF that end a block cut out
    leaves that LF to the next write: an empty line, which SSE ignores."""
    at = 0
    for old, new in trimmed:
        start = data.find(old, at)
        if start < 0:
            continue
        end = start + len(old)
        if new is not None:
            data = data[:start] + new + data[end:]
            at = start + len(new)
            continue
        blank = _BLANK.search(data, end)
        end = blank.end() if blank is not None else len(data)
        block = _boundary(data[:start])
        # Line endings at the block's start stay: the end of the block
        # before it, split from it across reads (its CRLF's LF), or blank lines.
        while data[block : block + 1] in (b"\r", b"\n"):
            block += 1
        start = block
        data = data[:start] + data[end:]
        at = start
    return data


def _long_block(data: bytes, limit: int) -> int:
    """Where the first block of `data` (which starts at a block's start)
    whose size, as SseParser measures it (Event.size), passes `limit`
    starts; len(data) if none does (it ends past `data`). One pass, made
    once a stream is cut."""
    start = 0
    for blank in _BLANK.finditer(data):
        # Its lines with their endings, the blank line's own not; the blank
        # lines before it (an empty block) count for nothing.
        end = blank.start() + (2 if data[blank.start() : blank.start() + 2] == b"\r\n" else 1)
        if end - start > limit:  # its bytes are at least its size
            block = data[start:end].lstrip(b"\r\n")
            if len(block) - block.count(b"\r\n") > limit:
                return start
        start = blank.end()
    return len(data)


def _too_long(limit: int) -> str:
    return f"an event of more than {limit} bytes (--max-answer-bytes)"


# How a cut for a stall begins (_why): held against the origin only past the
# proxy's own bound (dataplane.http.resume.held_against).
STALL_CUTS: Final = ("no chunk for ", "no event, only comments, for ")


def _why(exc: BaseException, idle: IdleTimeout | None) -> str:
    if isinstance(exc, TimeoutError) and idle is not None:
        # Comments alone came since the last event: not a chunk of the answer.
        what = "no event, only comments," if idle.without_progress else "no chunk"
        if idle.capped:
            return f"{what} for {idle.delay:g} s from an origin the route table marks unhealthy"
        return f"{what} for {idle.delay:g} s"
    if isinstance(exc, aiohttp.ClientPayloadError):
        # Its text ends with the parser's error as "<...Error: 400, message=...>":
        # aiohttp's own code, not a status the origin sent (trial 45). The
        # parser's message alone, from the error that caused it.
        text = str(exc.args[0]) if exc.args else ""
        head = text.split(": <", 1)[0] or "cut"
        detail = getattr(exc.__cause__, "message", "")
        return f"the origin's body could not be read ({head}{f': {detail}' if detail else ''})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# What the events relay writes for an origin's comments, and how often at
# most (`clock`): often enough for idle timeouts counted in seconds (a load
# balancer's, a browser's), rarely enough that an origin pinging in a tight
# loop costs few writes.
KEEP_ALIVE: Final = b": keep-alive\n\n"
KEEP_ALIVE_EVERY_S: Final = 0.5


def _comments(chunk: bytes) -> bool:
    """Whether `chunk` may hold a comment line (one starting with ':'); a
    chunk that starts inside a line may be taken for one, which costs a
    keep-alive at most."""
    return chunk[:1] == b":" or b"\n:" in chunk or b"\r:" in chunk


def _before(chunk: bytes, events: list[Event], ev: Event, at: int = 0) -> list[bytes]:
    """The frames of `events` before `ev`, of a chunk that is its events
    framed (SseParser.verbatim) from `at`: its bytes up to `ev`'s, each
    event's `size` and its blank line's LF."""
    for before in events:
        if before is ev:
            break
        at += before.size + 1
    return [chunk[:at]] if at else []


def _frame(ev: Event) -> bytes:
    # Nearly every event: one data line (find, not `in`: see dataplane.streaming.sse).
    if not ev.name and ev.data.find(b"\n") < 0:
        return b"data: " + ev.data + b"\n\n"
    lines = ev.data.split(b"\n")
    head = b"event: " + ev.name + b"\n" if ev.name else b""
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
