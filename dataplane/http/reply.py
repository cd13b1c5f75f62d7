"""Writing answers to the client: an origin's body or stream, a cache hit, a flight.

Each answer's headers are built once here: the origin's (hop-by-hop ones
dropped, see dataplane.upstream.forwarder), then Ponto's (`x-request-id`,
`x-ponto-cache`, where it came from), then the rate-limit headers of the
request's scopes.

An origin's error answer (400 and up) keeps none of the origin's headers and
only an allowlisted body (dataplane.http.errors.origin_error), and, like
every error, names no origin or region: those stay in the logs, under the
request id the client can quote (issue 15's allowlist). A success names them
(`x-ponto-origin`, `x-ponto-region`), for tracing which replica answered.
Any answer an origin gave, error or success, carries the origin's own request
id (ORIGIN_REQUEST_ID_HEADER) when it gave one: an opaque id, which a hosted
API's support asks for most when it refused a request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from aiohttp import HttpVersion11, hdrs, web
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.assemble import client_indexes
from dataplane.cache.coalesce import FlightFailed, Follower, Leader
from dataplane.cache.entry import CachedResponse, to_completion, to_sse_chunks
from dataplane.http.edge import EdgeProtocol, WholeAnswer
from dataplane.http.errors import (
    UPSTREAM_REFUSED,
    chat_error_event,
    origin_error,
    responses_broken_event,
    responses_error_event,
    responses_stopped_event,
    stream_broken_event,
    stream_stopped_event,
)
from dataplane.http.hold import HeldHead
from dataplane.http.state import DRAINING, SERVER_NAME, stopping
from dataplane.streaming.relay import (
    Ending,
    EventSink,
    Readable,
    RelayEnd,
    Resume,
    Stopped,
    Trim,
    Watch,
    Whole,
    Writable,
    next_sequence_number,
    relay,
    whole_events_end_answer,
    write_stopped,
)
from dataplane.streaming.splice import Transcript
from dataplane.streaming.sse import Event
from dataplane.streaming.usage import UsageCounter, asks_usage
from dataplane.upstream.forwarder import OriginAnswer
from dataplane.upstream.responseids import Rewriter, StreamIds
from dataplane.upstream.wire import head_line, media_type

if TYPE_CHECKING:
    from dataplane.cache.step import CachePlan
    from dataplane.http.pipeline import Exchange

SIMILARITY = "x-ponto-cache-similarity"
# The answering origin's own x-request-id, where the client gets the proxy's
# (trial 71: a hosted API's `req_...`, which its support asks for, was lost).
ORIGIN_REQUEST_ID_HEADER = "x-ponto-origin-request-id"
# Sent with every relayed stream's head: nginx, which buffers a proxied
# answer by default (proxy_buffering on), passes it on as it comes.
ACCEL_BUFFERING = "x-accel-buffering"


def _origin_headers(
    ex: Exchange, origin: OriginAnswer, outcome: str, *, error: bool = False
) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict() if error else origin.headers
    # Ours replace an origin's headers of the same name.
    for name, value in _ours(ex, origin, outcome, error):
        headers[name] = value
    for name, value in ex.limit_headers:
        headers[name] = value
    return headers


def _ours(ex: Exchange, origin: OriginAnswer, outcome: str, error: bool) -> list[tuple[str, str]]:
    """The headers the proxy sets on an answer of `origin`, in their order,
    but the limits' (`ex.limit_headers`, which follow them); no two of the
    same name."""
    ours: list[tuple[str, str]] = []
    if not error:  # an error answer names no origin (issue 15's allowlist)
        target = origin.target
        ours += (("x-ponto-origin", target.name), ("x-ponto-region", target.region))
    if ex.origin_request_id is not None:
        ours.append((ORIGIN_REQUEST_ID_HEADER, ex.origin_request_id))
    ours.append(("x-ponto-attempts", str(origin.attempt)))
    if origin.hedged:
        ours.append(("x-ponto-hedged", "1"))
    ours += ex.response_headers(outcome)
    return ours


def origin_body(ex: Exchange, origin: OriginAnswer, outcome: str, body: bytes) -> web.Response:
    """The origin's whole `body` as it sent it; an error one (status 400 and
    up) allowlisted, its code noted for the access log (`ex.origin_error`).
    An answer as the edge writes it (a WholeAnswer) when its headers allow
    (`_lines`), but for a stream whose head went out (`ex.held`)."""
    if origin.status < 400:
        ours = _ours(ex, origin, outcome, False)
        limits = ex.limit_lines
        lines = None
        if ex.held is None and limits is not None:
            lines = _lines(origin.headers, ours, limits)
        ours += ex.limit_headers
        if lines is not None:
            typed = hdrs.CONTENT_TYPE in origin.headers
            return WholeAnswer(origin.status, body, lines, typed, origin.headers, ours)
        headers = origin.headers
        for name, value in ours:
            headers[name] = value
        return web.Response(status=origin.status, body=body, headers=headers)
    shown = origin_error(
        origin.status,
        media_type(origin.headers),
        body,
        None if ex.sent is None else partial(client_indexes, sent=ex.sent, assembled=ex.body),
    )
    ex.origin_error = shown.code
    return web.Response(
        status=origin.status,
        body=shown.body,
        content_type="application/json",
        headers=_origin_headers(ex, origin, outcome, error=True),
    )


# Header lines as WholeAnswer holds them, by name and value: the origin's
# (whose names are none of ours) and ours apart, since an origin's header of
# one of our names is not written where ours would be. Each checked once
# (printable ASCII: aiohttp's serialisation would write the same bytes);
# cleared when full, since remaining counts and origins' own values vary.
_ORIGIN_LINES: dict[tuple[str, str], bytes] = {}
_OUR_LINES: dict[tuple[str, str], bytes] = {}
_LINES_MAX: Final = 512
# Our names, lowercased: an origin's header of one of them is replaced by
# ours in its place (CIMultiDict), which WholeAnswer's lines do not do; and
# those aiohttp's prepare (EdgeProtocol._put_whole) adds unless a handler
# set them (an origin's never reach here: forwarder.DROP_RESPONSE_HEADERS).
_OUR_NAMES: Final = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "date",
        "server",
        "connection",
        "x-ponto-origin",
        "x-ponto-region",
        ORIGIN_REQUEST_ID_HEADER,
        "x-ponto-attempts",
        "x-ponto-hedged",
        "x-request-id",
        "x-ponto-cache",
        "x-ponto-cache-reason",
        "x-ponto-cache-tier",
        "x-ponto-route",
        "age",
    }
)
# Unique to each answer: not remembered.
_OWN_IDS: Final = ("x-request-id", ORIGIN_REQUEST_ID_HEADER)


def _lines(origin: CIMultiDict[str], ours: list[tuple[str, str]], limits: bytes) -> bytes | None:
    """The lines of a WholeAnswer with `origin`'s headers, `ours` and the
    limits' lines (Admission.lines); None when a web.Response must carry
    them: an origin's header of one of our names (or a limit's), or a name
    or value that is not printable ASCII (which aiohttp writes as UTF-8, or
    refuses)."""
    out: list[bytes] = []
    known = _ORIGIN_LINES
    for pair in origin.items():
        line = known.get(pair)
        if line is None:
            name = pair[0]
            lower = name.lower()
            if lower in _OUR_NAMES or lower.startswith("x-ratelimit"):
                return None
            line = head_line(f"{pair[0]}: {pair[1]}")
            if line is None:
                return None
            if len(known) >= _LINES_MAX:
                known.clear()
            known[pair] = line
        out.append(line)
    known = _OUR_LINES
    for pair in ours:
        line = known.get(pair)
        if line is None:
            line = head_line(f"{pair[0]}: {pair[1]}")
            if line is None:
                return None
            if pair[0] not in _OWN_IDS:
                if len(known) >= _LINES_MAX:
                    known.clear()
                known[pair] = line
        out.append(line)
    out.append(limits)
    out.append(_SERVER_LINE)
    return b"".join(out)


# The Server line every answer gets (sent_now), as WholeAnswer's lines end.
_SERVER_LINE: Final = f"{hdrs.SERVER}: {SERVER_NAME}\r\n".encode()


def origin_stream(
    ex: Exchange, origin: OriginAnswer, outcome: str, frames: bytes | CachedResponse
) -> web.Response:
    """A stream the client asked for, from an origin that answered it whole (it
    ignored `stream`, as some servers do): its answer as SSE `frames` (a chat
    or completions answer as the frames of a cache replay, `_whole_stream`),
    where the client's SDK would read no event from the JSON."""
    headers = _origin_headers(ex, origin, outcome)
    # The JSON's, not the frames' (which _whole_stream sets, its limit headers
    # too: kept here, they would be sent twice).
    for name in ("content-type", "content-encoding", "cache-control"):
        headers.popall(name, None)
    for name, _ in ex.limit_headers:
        headers.popall(name, None)
    return _whole_stream(ex, frames, list(headers.items()))


async def relay_origin(
    request: web.Request,
    ex: Exchange,
    origin: OriginAnswer,
    plan: CachePlan,
    counter: UsageCounter,
    *,
    idle_timeout: float | None = None,
    resume: Resume | None = None,
    transcript: Transcript | None = None,
    lead: LeaderStream | None = None,
    max_event_bytes: int,
    watch: Watch | None = None,
    whole: Whole | None = None,
    shown: Rewriter | StreamIds | None = None,
    trim: Trim | None = None,
    held: web.StreamResponse | None = None,
) -> tuple[web.StreamResponse, RelayEnd]:
    """Relay the origin's stream to the client, counted, recorded and (with
    `lead`, the stream of a flight's leader) published to the flight; with
    `shown`, its bytes rewritten by it as they come (a Responses stream's ids);
    with `trim`, its events as it shows them to the client and the flight
    (the usage the proxy asked for on the client's behalf left out), counted
    and recorded as they came. `held`: the stream's head, sent already while
    the origin thought (dataplane.http.hold): the origin's headers are not
    sent."""
    if held is None:
        out = web.StreamResponse(
            status=origin.status, headers=_origin_headers(ex, origin, plan.outcome)
        )
        out.headers["cache-control"] = "no-cache"
        out.headers[hdrs.SERVER] = SERVER_NAME
        out.headers[ACCEL_BUFFERING] = "no"
    else:
        out = held
    sink: Writable = out
    if lead is None:
        if held is None:
            await _prepare_stream(out, request, ex)
    else:
        sink = lead
        try:
            if not lead.gone:
                if held is None:
                    await _prepare_stream(out, request, ex)
                lead.out = out
                protocol = request.protocol
                if isinstance(protocol, EdgeProtocol):
                    lead.release = protocol.release_drain
        except ConnectionResetError:
            if not lead.detach():
                raise
    ex.chunk_sent()  # the origin's first chunk is in hand: relay writes it at once
    readers: list[EventSink] = [counter]
    if plan.recorder is not None:
        readers.append(plan.recorder)
    if transcript is not None:
        readers.append(transcript)
    first = origin.first
    content: Readable = origin.content
    if shown is not None:
        first, content = shown.feed(first), Rewritten(content, shown)
    end = await relay(
        first,
        content,
        sink,
        readers=readers,
        chunks=plan.leader,
        error_event=_broken_stream_ending(ex),
        idle_timeout=idle_timeout,
        resume=resume,
        max_event_bytes=max_event_bytes,
        stopped=_stopped_ending(request, ex),
        watch=watch,
        whole=whole,
        trim=trim,
    )
    if lead is not None and lead.gone and not lead.lagged:
        end.client_gone = True
    return out, end


class Rewritten:
    """An origin's body (`Readable`) as `shown` rewrites it, chunk by chunk:
    what it keeps back of a chunk comes with the next, or at the body's end.
    Read by one relay."""

    __slots__ = ("_content", "_shown")

    def __init__(self, content: Readable, shown: Rewriter | StreamIds) -> None:
        self._content = content
        self._shown = shown

    async def readany(self) -> bytes:
        while True:
            chunk = await self._content.readany()
            if not chunk:
                return self._shown.flush()
            out = self._shown.feed(chunk)
            if out:
                return out


class LeaderStream:
    """The client stream of a flight's leader, as its relay writes it. Used by
    that relay (one task, the flight's: dataplane.http.pipeline.Pipeline.lead)
    and by the request that awaits it (`drained`, `let_go`, `close`).

    While the flight has no follower, a write is the client's own: the relay
    waits for it, so a slow client slows its origin's read, as any relay's
    does, at no cost of its own. Once followed, a write is queued and the
    relay goes on at once: one writer task of this stream's, parked on an
    event while the queue is empty, takes the queue to the client, so that
    the followers, who read the flight's buffer, are paced by the origin and
    not by the leader's client (a trial: a leader whose client did not read
    held a fast follower for the whole --send-timeout, one that read at
    8 KB/s paced its followers to that). The queue is bounded by the
    flight's (`Leader.max_buffer_bytes`): a client further behind is cut as
    a lagging follower is (`lagged`): what was queued is dropped, it is
    written `ending` (an error event) and its stream's end, and nothing more
    of the flight's; the flight goes on for its followers. A follower that
    joins while the relay waits for the client (a write of its own, through
    `release`, or the queue, below) ends that wait. Should the last follower
    leave while the queue is not empty, each write waits for the queue to be
    written again; once it is, writes are the relay's own again. The
    client's writes are bounded by the edge's send timeout, as any client's
    (dataplane.http.edge): a cut then ends that request alone.

    Once the client has gone (a write found it gone, or `detach`: its handler
    was cancelled) nothing more is written to it. While the flight has
    followers, writes are then dropped, so that the relay goes on: the
    origin's stream keeps feeding the followers and the cache's recorder to
    its end. With no follower left, a write raises ConnectionResetError,
    which ends the relay as a client gone ends any; `stop` (the relay's
    task's cancel) is called when the last follower leaves meanwhile, so an
    origin generating for nobody stops at once, not at its next chunk.
    """

    __slots__ = (
        "_active",
        "_direct",
        "_end",
        "_ending",
        "_leader",
        "_more",
        "_pending",
        "_pending_bytes",
        "_progress",
        "_writer",
        "_writing",
        "ended",
        "failed",
        "gone",
        "lagged",
        "let_go",
        "out",
        "release",
        "stop",
    )

    def __init__(
        self, leader: Leader, stop: Callable[[], None], *, ending: bytes | None = None
    ) -> None:
        self._leader = leader
        self.stop = stop
        self.out: web.StreamResponse | None = None  # set once prepared
        self.gone = False
        # The relay wrote the stream's end: what follows (the cache storing
        # the answer) is not stopped by the last follower leaving.
        self.ended = False
        # What is queued for the client once followed, and the writer taking
        # it there: one task, started at the first queued write, parked on
        # `_more` while the queue is empty (review r4: a task per write, and
        # once unfollowed a task and an asyncio.wait per write, 13.9 us a
        # chunk to the stream's end; unfollowed and written, the relay's
        # writes are its own again, at a lone leader's cost).
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        self._more: asyncio.Future[None] | None = None  # the parked writer's
        # The writer has work in hand (the queue, the stream's end): writes
        # are queued behind it, never written past it.
        self._active = False
        self._writing = False  # the writer waits for the client to take data
        self._end = False  # the stream's end is queued, after the data
        # Set at the writer's progress (idle, ended) and at a join: what
        # `drained` and `_caught_up` wait on (made by the first to wait).
        self._progress: asyncio.Event | None = None
        self._ending = stream_broken_event() if ending is None else ending
        # A write of data (not the stream's end) found the client gone.
        self.failed = False
        # The client fell further behind than the flight's bound: cut.
        self.lagged = False
        # Done once a lagged client has had its ending (or was found gone).
        self.let_go: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A write to the client is under way from the relay itself (not
        # followed), and what ends its wait for the client to take it (the
        # edge's: EdgeProtocol.release_drain), called when a follower joins.
        self._direct = False
        self.release: Callable[[], None] | None = None
        leader.when_joined(self._joined)

    def detach(self) -> bool:
        """The client has gone: write nothing more to it. Whether the relay
        goes on (the flight has followers)."""
        self.gone = True
        self.close()
        return self._for_followers_left()

    def _for_followers_left(self) -> bool:
        if not self._leader.followed:
            return False
        self._leader.when_deserted(self._deserted)
        return True

    def _deserted(self) -> None:
        if not self.ended:
            self.stop()

    def _joined(self) -> None:
        # A follower joined while the relay waited for a slow client to take
        # a write of its own, or (its followers gone) for the queue to be
        # written: that wait ends (the bytes stay buffered or queued for the
        # client), and the writes after it are queued. Else the follower,
        # which reads the flight's buffer, would wait as long (a review: a
        # client that took nothing held a follower that joined then for the
        # whole --send-timeout; review r4: the same after earlier followers
        # had left, the relay waiting for the queue).
        if self._direct and self.release is not None:
            self.release()
        self._progressed()

    async def write(self, data: bytes) -> None:
        if self.gone:
            self._for_followers()
        elif self.out is not None:
            if not self._active and not self._leader.followed:
                self._direct = True
                try:
                    await self.out.write(data)
                except ConnectionResetError:
                    if not self.detach():
                        raise
                finally:
                    self._direct = False
                return
            self._queue(data)
            if not self._leader.followed:
                await self._caught_up()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.gone:
            self._for_followers()
        elif self.out is not None:
            if not self._active and not self._leader.followed:
                self._retire()
                self._direct = True
                try:
                    await self.out.write_eof(data)
                except ConnectionResetError:
                    # Only the stream's end was left to write: the relay tells
                    # whether the client had the whole answer (relay._client_left);
                    # the followers' streams end with the flight, not here.
                    self.ended = True
                    raise
                finally:
                    self._direct = False
            else:
                if data:
                    self._queue(data)
                self._end = True
                self._wake()
                if not self._leader.followed:
                    self.ended = True
                    await self._caught_up()
        self.ended = True

    def _for_followers(self) -> None:
        if not self._leader.followed:
            raise ConnectionResetError("the client left, and no follower is left")

    # ------------------------------------------------------------ the queue

    @property
    def queued_bytes(self) -> int:
        """The bytes queued for the client, not yet handed to its connection:
        never more than the flight's bound."""
        return self._pending_bytes

    @property
    def delivered(self) -> bool:
        """Whether the client was handed every byte written to this stream
        (its end aside, which a client that closes at [DONE] may not take)."""
        return not (self._pending or self._writing or self.failed)

    def _queue(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        # Not followed, the writes wait for the queue (`_caught_up`): the
        # bound is the flight's, for a client that would hold its followers.
        if self._pending_bytes > self._leader.max_buffer_bytes and self._leader.followed:
            self._cut()
        self._wake()

    def _cut(self) -> None:
        """The client is further behind the flight than its bound: cut as a
        lagging follower is (reply.follow): its ending in place of the queue,
        then nothing more of the flight's."""
        self._pending.clear()
        self._pending.append(self._ending)
        self._pending_bytes = len(self._ending)
        self._end = True
        self.gone = self.lagged = True
        self._for_followers_left()

    def _wake(self) -> None:
        """Give the writer the queue: wake it where it is parked, or start it."""
        if self._active:
            return  # it takes what was queued before it parks
        self._active = True
        more = self._more
        if more is not None:
            self._more = None
            more.set_result(None)
            return
        writer = self._writer
        if writer is None or writer.done():
            writer = self._writer = asyncio.get_running_loop().create_task(self._write_pending())
            writer.add_done_callback(self._writer_ended)

    async def _write_pending(self) -> None:
        """The writer: the queue, then the stream's end once queued. Parked
        while the queue is empty and followed; ends once it is empty and
        unfollowed (the relay's writes are its own again), at the stream's
        end, or at the client's leaving."""
        out = self.out
        assert out is not None
        pending = self._pending
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    while pending:
                        data = pending.popleft()
                        self._pending_bytes -= len(data)
                        self._writing = True
                        await out.write(data)
                        self._writing = False
                    if self._end:
                        self._end = False
                        await out.write_eof()
                        return
                except ConnectionError:
                    self._write_failed()
                    return
                except BaseException:
                    self._lost()
                    raise
                finally:
                    self._writing = False
                if not self._leader.followed:
                    return
                self._active = False
                self._progressed()
                more = self._more = loop.create_future()
                await more  # `_wake`
        finally:
            # Here, not in `_writer_ended`: a write queued between the
            # writer's end and that callback would find it still active, and
            # be left in the queue with nobody to write it.
            self._more = None
            self._active = False
            self._progressed()

    def _write_failed(self) -> None:
        if self._writing:
            self.failed = True
            self._lost()
        else:
            # Only the stream's end was left to write: a client that closes
            # at [DONE] (the openai SDK does) had the whole answer, as for
            # the direct write's (relay._client_left).
            self._drop()

    def _writer_ended(self, writer: asyncio.Task[None]) -> None:
        if writer is self._writer:
            # Let go of: a writer `close` cancelled keeps its cancellation,
            # whose traceback holds the writer's frame, so this stream and its
            # client's answer (its request): a cycle only a full collection
            # frees.
            self._writer = None
            # A writer cancelled before its first step (`close` at once) ran
            # none of its code, its `finally` neither.
            if self._active:
                self._active = False
                self._progressed()
        if self.lagged and not self.let_go.done():
            self.let_go.set_result(None)

    def _retire(self) -> None:
        """End a writer parked since the last follower left: the relay
        writes the stream's end itself, and nothing is left to wake it for."""
        writer = self._writer
        if writer is not None and not writer.done():
            writer.cancel()

    def _progressed(self) -> None:
        # Waiters hold the old event; the next to wait makes a fresh one.
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    async def _progress_made(self) -> None:
        progress = self._progress
        if progress is None:
            progress = self._progress = asyncio.Event()
        await progress.wait()

    def _drop(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0
        self._end = False

    def _lost(self) -> None:
        """The client was found gone: as `detach`, from the writer."""
        self._drop()
        if not self.gone:
            self.gone = True
            self._for_followers_left()

    async def _caught_up(self) -> None:
        """Wait for the queue to be written (a write once the last follower
        left: the client paces the relay again) or for a follower to join
        (the relay goes on: review r4); ConnectionResetError if the client
        was found gone meanwhile and nobody follows."""
        while self._active and not self._leader.followed:
            await self._progress_made()
        if self.gone:
            self._for_followers()

    async def drained(self) -> None:
        """Return once the queue is written (the writer idle or ended), or
        the client found gone (`failed`). Cancelling the caller does not
        stop the writer."""
        while self._active:
            await self._progress_made()

    def close(self) -> None:
        """Write nothing more: what is queued is dropped, a write under way
        cancelled. For the request's end (its client gone, the proxy stopping)."""
        writer = self._writer
        self._drop()
        if writer is not None and not writer.done() and writer is not asyncio.current_task():
            writer.cancel()


def replay(ex: Exchange, entry: CachedResponse, similarity: float | None) -> web.Response:
    """Answer from a cache entry, in the form the request asked for."""
    headers = ex.response_headers("hit")
    if similarity is not None:
        headers.append((SIMILARITY, f"{similarity:.4f}"))
    if not ex.stream:
        return _json(ex, to_completion(entry), headers)
    return _whole_stream(ex, entry, headers)


async def follow(
    request: web.Request, ex: Exchange, follower: Follower, hold_s: float | None = None
) -> tuple[web.StreamResponse, bool] | None:
    """Answer from another request's origin call (same chunks, as they come),
    and whether the answer was whole.

    None when that call failed before this client got an event: the caller
    then makes its own (in `ex.held`, when the stream's head went out). A
    failure after events were sent ends the stream with an error event, as a
    cut relay does (not whole). `hold_s`: a stream's head goes out this long
    after the follow began when no chunk came (dataplane.http.hold).
    """
    headers = [*ex.response_headers("hit"), ("x-ponto-coalesced", "1")]
    out: web.StreamResponse | None = None
    hold = None
    if ex.stream and hold_s is not None:
        # With a head sent (an earlier flight it followed failed before an
        # event), its comments go on while it waits (review 314: none came).
        hold = HeldHead(
            hold_s,
            partial(_stream_head, ex, headers),
            partial(prepare_held, request, ex),
            sent=ex.held,
        )
    # The client has the answer's last event (its [DONE]): nothing more is
    # written to it but the stream's end, whatever comes of the flight.
    whole = False
    ending = False  # the stream's end is being written
    try:
        with follower:
            if not ex.stream:
                return _json(ex, to_completion(await follower.result()), headers), True
            async for chunk in follower:
                if out is None:
                    out = None if hold is None else await hold.stop()
                    if out is None:
                        out = await _start_stream(request, ex, headers)
                    else:
                        ex.chunk_sent()
                # Before the write: a stop that lands while the client takes
                # the [DONE] adds no ending after it (review 38).
                whole = whole_events_end_answer(chunk)
                await out.write(chunk)
            if out is None:  # the leader answered without streaming
                whole_answer = _whole_stream(ex, await follower.result(), headers)
                held = None if hold is None else await hold.stop()
                if held is not None:
                    return await into_held(ex, held, whole_answer), True
                return whole_answer, True
            whole = ending = True
            await out.write_eof()
            return out, True
    except asyncio.CancelledError:
        # The chunks are whole events (the leader's relay hands on no other).
        if out is not None and not ending and stopping(request):
            await write_stopped(out, b"" if whole else stream_stopped_event())
        elif out is None and hold is not None and (held := await hold.stop()):
            await held_stopped(request, ex, held)
        raise
    except FlightFailed as exc:
        if out is None and exc.delivered == 0:
            if hold is not None:  # its own call answers in the head sent
                ex.held = await hold.stop()
            return None
        if out is None:  # pragma: no cover - delivered implies started
            raise
        # After its answer (the flight failed storing it, say) the stream
        # only ends. Else flights are of cacheable endpoints only, which
        # Responses is not (dataplane.cache.policy): a chat or completions
        # stream, with an error event; its leader cancelled by the stopping
        # server (before this request's own cancellation came), the client is
        # told the proxy stops, not that the origin broke the stream.
        tail = b""
        if not whole:
            stopped = follower.leader_left and stopping(request)
            tail = stream_stopped_event() if stopped else stream_broken_event()
        ending = False
        try:
            if tail:
                await out.write(tail)
            ending = True
            await out.write_eof()
        except asyncio.CancelledError:
            # The stop, while the client took the tail: the stream's end
            # still follows it (review 38: a chunked body left unended).
            if not ending and stopping(request):
                await write_stopped(out, b"")
            raise
        return out, not tail
    finally:
        if hold is not None:  # stopped already, but for a leaving client
            hold.abandon()


def _broken_stream_ending(ex: Exchange) -> Ending:
    """What ends the client's stream when its origin breaks it, or the bound on
    one event cuts it: a Responses stream's error event takes the number after
    the last event relayed."""
    if ex.endpoint.name == "responses":
        return _responses_ending
    return _chat_ending


def _stopped_ending(request: web.Request, ex: Exchange) -> Stopped:
    """What ends the client's stream when the stopping server cancels its
    relay (see `stopping`): an error event, numbered in a Responses stream."""

    def ending(last: Event | None) -> bytes | None:
        if not stopping(request):
            return None
        if ex.endpoint.name == "responses":
            return responses_stopped_event(next_sequence_number(last))
        return stream_stopped_event()

    return ending


def _chat_ending(last: Event | None, too_long: int) -> bytes:
    return stream_broken_event(too_long)


def _responses_ending(last: Event | None, too_long: int) -> bytes:
    return responses_broken_event(next_sequence_number(last), too_long)


def _json(ex: Exchange, body: bytes, headers: list[tuple[str, str]]) -> web.Response:
    response = web.Response(body=body, content_type="application/json")
    response.headers.extend(headers)
    response.headers.extend(ex.limit_headers)
    return response


def _whole_stream(
    ex: Exchange, entry: bytes | CachedResponse, headers: list[tuple[str, str]]
) -> web.Response:
    """A stream answered from a stored answer: its SSE frames, every one already
    in hand, as one whole answer (a Content-Length, no chunked coding), which
    the connection takes in one write with its head (boundary.send_whole). The
    client reads the same events, in the same frames, as from a relay; sent
    frame by frame, each frame cost a write and a system call, and the first
    byte waited for aiohttp's stream preparation."""
    if isinstance(entry, bytes):  # frames already made
        body = entry
    else:
        # The request's ask, not the cache step's: an origin that ignored
        # `stream` on a bypassed request (or a tenant's cache off) left the
        # usage chunk out (trial 45).
        body = b"".join(to_sse_chunks(entry, include_usage=asks_usage(ex.body)))
    response = web.Response(body=body, content_type="text/event-stream")
    response.headers["cache-control"] = "no-cache"
    response.headers.extend(headers)
    response.headers.extend(ex.limit_headers)
    ex.chunk_sent()  # the whole stream goes to the connection next (pipeline.sent)
    return response


async def _start_stream(
    request: web.Request, ex: Exchange, headers: list[tuple[str, str]]
) -> web.StreamResponse:
    out = _stream_head(ex, headers)
    await _prepare_stream(out, request, ex)
    ex.chunk_sent()  # every caller writes its first chunk next
    return out


async def _prepare_stream(out: web.StreamResponse, request: web.Request, ex: Exchange) -> None:
    """Send a stream's head; `ex.answer` is the stream from then on. HTTP/1.0
    has no chunked coding: the stream's end is the connection's, whatever
    keep-alive the client asked for. A stream begun once the proxy stops or
    leaves its group says in its head that its connection closes after it, as
    every other answer then does (the boundary and the edge decide those only
    for answers not yet begun)."""
    if request.version < HttpVersion11 or request.app[DRAINING].active:
        out.force_close()
    ex.answer = out
    await out.prepare(request)


def held_head(ex: Exchange, outcome: str) -> web.StreamResponse:
    """The head of a stream sent before its origin answered (dataplane.http.hold):
    a relayed stream's, without what only the origin's answer says (its
    headers, `x-ponto-origin`, the attempts)."""
    return _stream_head(ex, ex.response_headers(outcome))


def _stream_head(ex: Exchange, headers: list[tuple[str, str]]) -> web.StreamResponse:
    """A stream's head (its status and headers), not sent: _start_stream's,
    and a held head's."""
    out = web.StreamResponse(status=200)
    out.content_type = "text/event-stream"
    out.headers["cache-control"] = "no-cache"
    out.headers[hdrs.SERVER] = SERVER_NAME
    out.headers[ACCEL_BUFFERING] = "no"
    out.headers.extend(headers)
    out.headers.extend(ex.limit_headers)
    return out


async def prepare_held(request: web.Request, ex: Exchange, out: web.StreamResponse) -> None:
    """Sends a held stream's head (`held_head`), as any stream's."""
    await _prepare_stream(out, request, ex)


NOT_A_STREAM: Final = (
    "The model's server answered a stream request with a whole answer that could not be "
    "sent as a stream."
)


async def held_failed(
    ex: Exchange, out: web.StreamResponse, error: dict[str, Any], recorded: str, status: int
) -> web.StreamResponse:
    """Ends a stream whose head was sent while its origin thought
    (dataplane.http.hold), and which got no answer, with `error` (an OpenAI
    error object, as the client would have had it in a JSON body) as its
    in-band error event (and `[DONE]`, in a chat or completions stream), as
    a cut stream ends: the status was sent, and was 200. `recorded`: the
    error the access log and the metrics give it (ex.stream_error); ""
    for one recorded by `status` (ex.held_status), the status of the answer
    it stands for, as an origin's error answer is: its status for the
    metrics, its code for the access log (boundary._record)."""
    ex.stream_error = recorded
    ex.held_status = status
    # No chunk of an answer: no time-to-first-chunk sample (review 314: a
    # stream no origin answered went into the TTFT histogram at the time
    # failover gave up), as the 502 it stands for had none.
    if ex.endpoint.name == "responses":
        ending = responses_error_event(0, error)
    else:
        ending = chat_error_event(error)
    await out.write(ending)
    await out.write_eof()
    return out


async def held_stopped(request: web.Request, ex: Exchange, out: web.StreamResponse) -> None:
    """Ends a stream whose head was sent while its origin thought, and whose
    request the stopping server cancelled, as a cancelled relay's
    (write_stopped); a client that left gets nothing more."""
    ending = _stopped_ending(request, ex)(None)
    if ending is not None:
        await write_stopped(out, ending)


async def into_held(
    ex: Exchange, out: web.StreamResponse, answer: web.Response
) -> web.StreamResponse:
    """A whole answer (`answer`, not sent) to a stream whose head was sent
    while its origin thought: a stream's frames (an origin that ignored
    `stream`) follow the head; an error's JSON becomes the stream's error
    event (`held_failed`), recorded by its status as an origin's error
    answer is (its status for the metrics, its code for the access log:
    boundary._record). Returns `out`, as the response the handler sent."""
    body = answer.body
    assert isinstance(body, bytes)
    if answer.status < 300 and answer.content_type == "text/event-stream":
        ex.chunk_sent()
        await out.write(body)
        await out.write_eof()
    else:
        parsed = jsonio.loads_or_none(body)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if not isinstance(error, dict) and answer.status < 300:
            # An answer, but none the proxy can make a stream of.
            error = {"message": NOT_A_STREAM, "type": "upstream_error"}
        elif not isinstance(error, dict):
            error = {"message": UPSTREAM_REFUSED, "type": "upstream_error"}
        error.setdefault("param", None)
        error.setdefault("code", None)
        await held_failed(ex, out, error, "", answer.status)
    return out
