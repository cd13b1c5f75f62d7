"""Cache entries: complete 200 answers, kept either as a JSON body or as the SSE chunks
an origin streamed, and their conversion to whichever form a request asks for.

- `from_completion` checks and wraps a non-streamed body;
- `StreamRecorder` is fed a stream's raw bytes as they are relayed and, at the end,
  says whether they form a complete answer worth keeping;
- `to_sse_chunks` replays an entry as SSE frames (a stored stream keeps its original
  chunking; a stored body is cut into several chunks so a replay still streams);
- `to_completion` gives an entry as a non-streamed body.

Replays keep the original `id` and `created`: a hit can then be traced to the
answer that filled the entry, and rewriting every chunk on every hit would cost a
parse and a dump per chunk. The handler marks hits with `x-ponto-cache: hit`.

Everything here is pure and synchronous. An entry is immutable and may be
replayed by any number of tasks at once; a recorder belongs to one relay.
"""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from operator import itemgetter
from typing import Any, Final

from dataplane import jsonio
from dataplane.streaming.sse import Event, SseParser
from dataplane.streaming.usage import without_usage_null

# Approximate memory of the Python objects around the payload bytes, so the
# store's byte bound tracks memory rather than only payload length.
ENTRY_OVERHEAD = 256
# A chunk's bytes object and its place in the tuple are some 48 bytes beside
# its payload; the rest is what a long load of streams leaves between their
# small objects: with 48, a proxy's cache of streams of 256 events held 2-3 %
# more RSS than its bound (bench/memory.py --stream), where store.py's
# SLOT_OVERHEAD leaves whole answers 18-31 % under theirs (RSS 0.69-0.82
# of what is counted, bench/entry_rss.py).
CHUNK_OVERHEAD = 72

DONE_FRAME = b"data: [DONE]\n\n"

# Finish reasons of a complete, natural answer. "eos_token" and "stop_sequence"
# are what TGI reports for the same. Anything else ("length" unless the tenant
# allows it, "content_filter", vLLM's "abort", an unknown value) is not kept.
NATURAL_FINISH = frozenset({"stop", "tool_calls", "function_call", "eos_token", "stop_sequence"})

# Replays of a stored body cut content into pieces of at least this many
# characters, on whitespace: several chunks, like a real stream, cheaply.
REPLAY_PIECE_CHARS = 16


# How the deltas of a streamed tool call merge, by the member that says what
# the call does (named by its `type`): that member's name comes whole (some
# origins repeat it in every delta) and one text of it comes in pieces, which
# are concatenated: a function's arguments, a custom tool's input. The call's
# id and type, and any other member, come whole. A stream that sends a member
# these rules do not know in more than one delta of a call (an unknown type's
# text in pieces, say) is not kept: joining or replacing its values would be a
# guess, and a wrong guess would be served as the origin's answer.
_TOOL_PIECES: Final = {"function": "arguments", "custom": "input"}
_TOOL_WHOLE = frozenset({"index", "id", "type"})

# Object-valued members of a chat delta (but `function_call`, joined by its own
# rule) that come in pieces, and their text members, which are concatenated as
# OpenAI's SDK accumulates them (openai-python's lib/streaming/_deltas.py); any
# other of their members comes once and is taken whole. An audio answer streams
# {"id", "transcript": "hel"}, {"data", "transcript": "lo"}, ..., {"expires_at"}
# (a trial: the last piece alone was stored, and served as message.audio). A
# stream with another object member in more than one delta of a choice, or one
# of these with a whole member twice or a text member that is not text, is not
# kept, as a tool call's unknown member in pieces is not.
_DELTA_PIECES: Final = {"audio": frozenset({"data", "transcript"})}


class ResponseKind(enum.StrEnum):
    CHAT = "chat"  # chat.completion / chat.completion.chunk
    TEXT = "text"  # text_completion (legacy completions)
    EMBEDDINGS = "embeddings"  # object "list" of embeddings
    RERANK = "rerank"  # a ranking's `results` (Jina's and Cohere's rerank API)


# Read per answer: an enum member read through its class costs some 1,000
# instructions on Python 3.11 (see dataplane.cache.policy.decide).
_CHAT, _TEXT, _EMBEDDINGS = ResponseKind.CHAT, ResponseKind.TEXT, ResponseKind.EMBEDDINGS
_RERANK = ResponseKind.RERANK


# Not frozen, though never changed once made: a frozen dataclass sets each
# field through object.__setattr__, and an entry cost some 15,800 instructions
# to build (5,700 so), 1.2 % of a request kept in the cache
# (bench/instructions.py). Hashed by value, as a frozen one is. Its __init__
# is its own, checks and size in the same frame: the dataclass's, then
# __post_init__, were two (4,600 instructions an entry; one, 3,900).
@dataclass(slots=True, unsafe_hash=True, init=False)
class CachedResponse:
    """A complete answer that was a 200 from the origin. Exactly one of `body`
    (a non-streamed JSON body, as sent) or `chunks` (the `data:` payloads of a
    stream, without framing and without the final [DONE]) is set. Read only:
    one entry answers many requests, from the store and from flights."""

    kind: ResponseKind
    # The clock reading (of the clock injected into the caller) when recorded.
    created_at: float
    # The model the origin named in its answer.
    model: str
    body: bytes | None
    chunks: tuple[bytes, ...] | None
    # Indexes of chunks holding only usage (no choices), sent when the request
    # asked for stream_options.include_usage; skipped for requests that did not.
    # In increasing order. A tuple, not a set: nearly every recorded stream has
    # one (the forwarder asks for usage, for its count), and a tuple of one
    # index is 48 bytes where a frozenset is 216, uncounted by the store.
    usage_only: tuple[int, ...]
    # A stream recorded for a request that did not ask for usage, and that
    # carries none: it cannot answer a request that asks (`answers`), whose
    # client would get no usage at all where the origin would have sent it.
    usage_missing: bool
    # Approximate memory held, in bytes.
    size: int = field(init=False)

    def __init__(
        self,
        kind: ResponseKind,
        created_at: float,
        model: str,
        body: bytes | None = None,
        chunks: tuple[bytes, ...] | None = None,
        usage_only: tuple[int, ...] = (),
        usage_missing: bool = False,
        *,
        size: int | None = None,
    ) -> None:
        """`size`, given with chunks, is the caller's count of what is
        computed here otherwise: a StreamRecorder counts it as it records."""
        if (body is None) == (chunks is None):
            raise ValueError("exactly one of body and chunks must be set")
        self.kind = kind
        self.created_at = created_at
        # One string per model name however many entries name it: the name
        # parsed from each answer is a string of its own (some 60 bytes an
        # entry, which the store's SLOT_OVERHEAD does not count). Interned
        # strings are freed with their last entry.
        self.model = sys.intern(model)
        self.body = body
        self.chunks = chunks
        self.usage_only = usage_only
        self.usage_missing = usage_missing
        if chunks is not None:
            if size is None:
                # Summed in C (map), not by a generator resumed for every
                # chunk: 70 chunks 40,500 -> 17,700 instructions.
                size = ENTRY_OVERHEAD + sum(map(len, chunks)) + CHUNK_OVERHEAD * len(chunks)
            self.size = size
        elif usage_missing:
            raise ValueError("only a stored stream can be recorded without usage")
        else:
            assert body is not None
            self.size = ENTRY_OVERHEAD + len(body)

    @property
    def streamed(self) -> bool:
        return self.chunks is not None

    def answers(self, *, include_usage: bool) -> bool:
        """Whether this entry can answer a request in full: not one that asks
        for usage (stream_options.include_usage) when it was recorded without.
        A request asking for usage that the origin did not send when asked is
        answered as the origin answered it."""
        return not (include_usage and self.usage_missing)


# Why the 200 answer of a cacheable request was not kept
# (`ponto_cache_unkept_total{reason}`; `unkept_reason`).
TOO_LARGE = "too_large"  # over the entry bound (--cache-max-entry-kb)
TRUNCATED = "truncated"  # finish_reason "length" (kept with store_truncated)
CONTINUED = "continued"  # a stream spliced from several origin calls
INCOMPLETE = "incomplete"  # cut, no [DONE], an error, a shape not known
# finish_refusal's reason for an answer cut by its max_tokens.
_CUT_BY_LENGTH: Final = "finish_reason 'length'"


def unkept_reason(refusal: str | None, *, too_large: bool = False) -> str:
    """The metric's reason for an answer not kept, from `refusal` (a
    recorder's `reason`, or `finish_refusal`'s) and whether it was too large."""
    if too_large:
        return TOO_LARGE
    if refusal == _CUT_BY_LENGTH:
        return TRUNCATED
    return INCOMPLETE


def body_unkept_reason(body: bytes, obj: Any, *, max_bytes: int, store_truncated: bool) -> str:
    """`unkept_reason` of a whole 200 answer that `from_completion` did not
    keep (`obj`: the body parsed, None when it is not JSON). Pure."""
    if len(body) + ENTRY_OVERHEAD > max_bytes:
        return TOO_LARGE
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if isinstance(choices, list):
        # A loop: a comprehension makes a function and its frame per answer.
        reasons = []
        for c in choices:
            if isinstance(c, dict):
                reasons.append(c.get("finish_reason"))
        return unkept_reason(finish_refusal(reasons, store_truncated=store_truncated))
    return INCOMPLETE


def finish_refusal(finish_reasons: Iterable[Any], *, store_truncated: bool) -> str | None:
    """Why a set of finish reasons must not be kept, or None when it may be."""
    seen = False
    for reason in finish_reasons:
        seen = True
        if reason is None:
            return "a choice has no finish_reason"
        if reason == "length":
            if store_truncated:
                continue
            # The usual refusal, an answer cut by its max_tokens: its words
            # made once (the f-string's repr costs more than the rest).
            return _CUT_BY_LENGTH
        # Not a string (an origin's list or object), no finish of ours: and
        # not hashable, it would raise out of the set's test.
        if reason.__class__ is not str or reason not in NATURAL_FINISH:
            return f"finish_reason {reason!r}"
    return None if seen else "no choices"


def from_completion(
    body: bytes,
    *,
    now: float,
    store_truncated: bool = False,
    max_bytes: int | None = None,
    parsed: Any = jsonio.NOT_PARSED,
) -> CachedResponse | None:
    """Wrap a non-streamed 200 body, or None when it must not be kept: not a JSON
    object, an error object, an unknown shape, no choices, a choice that did not
    finish naturally (see `finish_refusal`), or larger than max_bytes. The caller
    checks the status first: only a 200 may be passed here. `parsed` is the body
    already parsed by the caller (None if it is not JSON), so it is parsed once."""
    return judge_completion(
        body, now=now, store_truncated=store_truncated, max_bytes=max_bytes, parsed=parsed
    )[0]


def judge_completion(
    body: bytes,
    *,
    now: float,
    store_truncated: bool = False,
    max_bytes: int | None = None,
    parsed: Any = jsonio.NOT_PARSED,
) -> tuple[CachedResponse | None, str | None]:
    """`from_completion`'s entry, and when its choices' finish reasons kept it
    out, `unkept_reason` of their `finish_refusal` (None otherwise: kept, or
    not for another reason). With a max_bytes, that reason is the answer's
    `body_unkept_reason`: its checks came first and passed (not too large, a
    list of choices, each a dict), so the usual answer not kept (one its
    max_tokens cut) is judged once, not twice."""
    if max_bytes is not None and len(body) + ENTRY_OVERHEAD > max_bytes:
        return None, None
    obj = jsonio.loads_or_none(body) if parsed is jsonio.NOT_PARSED else parsed
    if not isinstance(obj, dict) or obj.get("error") is not None:
        return None, None
    kind = _body_kind(obj)
    if kind is None:
        return None, None
    if kind is _CHAT or kind is _TEXT:
        # finish_refusal's judgement of the first choice it refuses, in this
        # frame as unkept_reason names it: a list of the reasons and the two
        # calls cost some 2,300 instructions an answer.
        choices = obj["choices"]
        unkept = None if choices else INCOMPLETE  # no choices
        said, shape = ("message", dict) if kind is _CHAT else ("text", str)
        for choice in choices:
            if not isinstance(choice, dict):
                return None, None
            # A choice whose finish_reason is a string is passed on without a
            # message object (chat) or text string (completions), as why it
            # has none (forwarder._missing_answer); one replayed from the
            # cache instead of asked again would give every client an origin's
            # broken answer ("message": 5, "text": ["x"]) for the cache's TTL.
            if choice.get(said).__class__ is not shape:
                return None, None
            reason = choice.get("finish_reason")
            # A reason not a string (a list, an object) is none of ours, and
            # the set's test of one unhashable would raise (a 500).
            if unkept is None and (reason.__class__ is not str or reason not in NATURAL_FINISH):
                if reason != "length":
                    unkept = INCOMPLETE  # none, or not natural
                elif not store_truncated:
                    unkept = TRUNCATED
        if unkept is not None:
            return None, unkept
    model = obj.get("model")
    # Positional (kind, created_at, model, body): keywords cost the call more.
    return CachedResponse(kind, now, model if isinstance(model, str) else "", body), None


def _body_kind(obj: dict[str, Any]) -> ResponseKind | None:
    choices = obj.get("choices")
    if isinstance(choices, list):
        first = choices[0] if choices else None
        if obj.get("object") == "chat.completion" or (
            isinstance(first, dict) and "message" in first
        ):
            return _CHAT
        if obj.get("object") == "text_completion" or (isinstance(first, dict) and "text" in first):
            return _TEXT
        return None
    if obj.get("object") == "list" and isinstance(obj.get("data"), list):
        return _EMBEDDINGS
    if isinstance(obj.get("results"), list):
        return _RERANK
    return None


class StreamRecorder:
    """Records a stream relayed to a client and judges it at the end.

    One per streamed relay; not shared between tasks. The relay hands it every
    parsed event (`event`, or a read's at once, `read`, from the relay's
    `SseParser`) or every chunk of bytes (`feed`, which parses them itself),
    then calls `finish` once the origin's stream has ended. On a cut stream or
    a client disconnect the relay simply does not call `finish` (or calls it
    and gets None, as no [DONE] was seen). An event named `error` is an error.

    usage_asked: the relayed request asked for stream_options.include_usage.
    A stream that neither asked for usage nor carried any is kept marked
    `usage_missing` (see `CachedResponse.answers`).

    `finish` gives None when the stream is not a complete, natural answer: no
    [DONE], an error event or error object, a chunk that is not a JSON object with
    choices, a choice with no finish_reason, a finish_reason that is not natural
    (`length` is kept only with store_truncated), a tool call whose deltas
    `to_completion` could not merge faithfully (see `_TOOL_PIECES`), an
    object-valued delta member it could not join (see `_DELTA_PIECES`), or more
    than max_bytes recorded (recording stops there, so a huge answer costs no
    memory). `reason` then says why.
    """

    def __init__(
        self,
        *,
        store_truncated: bool = False,
        max_bytes: int | None = None,
        usage_asked: bool = False,
    ) -> None:
        self._store_truncated = store_truncated
        self._usage_asked = usage_asked
        self._usage_seen = False
        self._max_bytes = max_bytes
        self._parser: SseParser | None = None  # only when fed bytes
        self._chunks: list[bytes] = []
        self._usage_only: list[int] = []  # increasing: each a chunk's index as it is kept
        self._size = ENTRY_OVERHEAD
        self._finish: dict[int, Any] = {}
        # The members of each tool call (by choice and call index) that have no
        # merge rule of their own (`_TOOL_PIECES`) and came in a delta already.
        self._whole_members: dict[tuple[int, int], set[str]] = {}
        # (choice, index) -> the id its call was given: a second id there is
        # a second call at the same index (origins that send no index).
        self._call_ids: dict[tuple[int, int], str] = {}
        # (choice, member) of the object-valued delta members taken whole
        # (`_DELTA_PIECES`) that came in a delta already, with their value.
        self._whole_objects: dict[tuple[int, str], Any] = {}
        self._kind: ResponseKind | None = None
        self._model = ""
        self._done = False
        # The last chunk kept whose one choice's delta is `{"content": text}`,
        # around that text, and their lengths (`_around_text`), or None.
        self._like: tuple[bytes, bytes, int, int, bool] | None = None
        self.reason: str | None = None
        # Recording stopped at max_bytes (`ponto_cache_unkept_total`'s too_large).
        self.too_large = False

    def feed(self, data: bytes) -> None:
        """Parse and record raw bytes (for a caller without a parser of its own)."""
        if self.reason is not None or not data:
            return
        if self._parser is None:
            self._parser = SseParser()
        self.read(self._parser.feed(data))

    def finish(self, *, now: float, open_event: Event | None = None) -> CachedResponse | None:
        """Judge the stream once it has ended; see the class docstring.

        open_event: what the stream's parser held when it ended (its `close()`);
        a recorder fed bytes closes its own parser.
        """
        if self._parser is not None:
            open_event = self._parser.close()
        if self.reason is None and open_event is not None:
            if not self._done and open_event.done:
                # Lenient on the last [DONE] without its blank line only.
                self._done = True
            else:
                self.reason = "the stream ended inside an event"
        if self.reason is None and not self._done:
            self.reason = "no [DONE]"
        if self.reason is None and self._kind is None:
            self.reason = "no chunks"
        if self.reason is None:
            self.reason = finish_refusal(
                self._finish.values(), store_truncated=self._store_truncated
            )
        if self.reason is not None:
            return None
        assert self._kind is not None
        return CachedResponse(
            kind=self._kind,
            created_at=now,
            model=self._model,
            chunks=tuple(self._chunks),
            usage_only=tuple(self._usage_only),
            usage_missing=not (self._usage_asked or self._usage_seen),
            size=self._size,  # as counted for max_bytes: the same sum
        )

    def _unmergeable(self, choice: int, calls: Any) -> str | None:
        """Why these tool-call deltas of a choice cannot be merged faithfully
        with the earlier ones (see `_TOOL_PIECES`), or None."""
        if not isinstance(calls, list):
            return None
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
                continue  # `to_completion` leaves it out too
            call_id = call.get("id")
            if isinstance(call_id, str) and call_id:
                # Review: calls sent without `index` were all merged into
                # slot 0, two whole calls into one with both arguments.
                had = self._call_ids.setdefault((choice, call.get("index", 0)), call_id)
                if had != call_id:
                    return "two tool calls at one index"
            for name, value in call.items():
                if value is None or name in _TOOL_WHOLE:
                    continue
                piece = _TOOL_PIECES.get(name)
                if piece is None or not isinstance(value, dict):
                    members = [name]
                else:
                    members = [
                        f"{name}.{m}"
                        for m, v in value.items()
                        if v is not None and m not in ("name", piece)
                    ]
                if not members:
                    continue
                seen = self._whole_members.setdefault((choice, call.get("index", 0)), set())
                for member in members:
                    if member in seen:
                        return f"a tool call whose {member} comes in pieces"
                    seen.add(member)
        return None

    def _unjoinable(self, choice: int, delta: dict[str, Any]) -> str | None:
        """Why this delta's object-valued members cannot be joined faithfully
        with the earlier ones of its choice (see `_DELTA_PIECES`), or None."""
        for name, value in delta.items():
            if type(value) is not dict or name == "function_call":
                continue
            pieces = _DELTA_PIECES.get(name)
            if pieces is None:
                members = [name]
            else:
                members = []
                for member, v in value.items():
                    if v is None:
                        continue
                    if member not in pieces:
                        members.append(f"{name}.{member}")
                    elif type(v) is not str:
                        return f"a delta whose {name}.{member} is not text"
            for member in members:
                got = value if pieces is None else value[member.partition(".")[2]]
                had = self._whole_objects.setdefault((choice, member), got)
                # The same value again is no piece: OpenAI's audio models
                # send audio.id with the first transcript piece and again
                # with the first data piece (review 307).
                if had is not got and had != got:
                    return f"a delta whose {member} comes in pieces"
        return None

    def _fail(self, reason: str) -> None:
        self.reason = reason
        self._chunks.clear()

    def event(self, ev: Event) -> None:
        """Record one parsed event of the stream."""
        self.read((ev,))

    def read(self, events: Sequence[Event]) -> None:
        """Record each of `events`, in order: one call a read (a ReadSink's,
        given a relayed read's events at once), not one an event. Its loop
        is `datas`'s twin, kept for speed: a read of one event, most reads
        of a stream that comes as it is generated, goes through one frame."""
        like = self._like if self.reason is None and not self._done else None
        size, bound, kept = self._size, self._max_bytes, self._chunks
        for ev in events:
            if like is not None:
                # The chunk `head` and `tail` were cut from (`_around_text`)
                # with another text in its delta, a JSON string without `\\u`
                # escapes: parsed, it would be that chunk with another string
                # where no check of `_record` looks but at its type, so it is
                # kept as that chunk was, unparsed (most chunks of a vLLM
                # stream differ in their text alone; an OpenAI stream's
                # `obfuscation` differs too, and is parsed). A few C calls,
                # inline: this runs per chunk. A named event goes to
                # `_record` (the same chunk kept, or an error event refused);
                # an empty one, or [DONE], has not `head`.
                head, tail, start, after, obfuscated = like
                payload = ev.data
                # The tail ends at the payload's end, or (OpenAI's) where
                # its obfuscation string starts, which is matched as the text.
                value = (
                    payload.rfind(_OBFUSCATION) + len(_OBFUSCATION) if obfuscated else len(payload)
                )
                end = value - after
                if (
                    not ev.name
                    and end >= start
                    and payload[:start] == head  # slices: startswith parses arguments
                    and payload[end:value] == tail
                    and _TEXT_BODY.fullmatch(payload, start, end) is not None
                    and (not obfuscated or _last_string(payload, value))
                    and (payload.isascii() or _utf8(payload))
                ):
                    # `_keep`, its size in a local.
                    size += len(payload) + CHUNK_OVERHEAD
                    if bound is not None and size > bound:
                        self._size = size
                        self._too_large()
                        return
                    kept.append(payload)
                    continue
            self._size = size
            self._record(ev)
            size = self._size
            like = self._like if self.reason is None and not self._done else None
        self._size = size

    def datas(self, payloads: list[bytes]) -> None:
        """Record an unnamed event of each of `payloads`, in order (a
        DataSink's: the relay gives a read's plain events so, with no Event
        made for each)."""
        like = self._like if self.reason is None and not self._done else None
        size, bound, kept = self._size, self._max_bytes, self._chunks
        at, count = 0, len(payloads)
        tried = False  # one run a call: each try slices every payload left
        while at < count:
            if like is not None and not like[4] and count - at > 1 and not tried:
                # A run of chunks like the last kept, told at once (a read of
                # many events: an origin that sends several a read, nginx).
                tried = True
                taken = _like_run(payloads, at, like[0], like[1])
                if taken:
                    run = len(taken)
                    grown = size + sum(map(len, taken)) + CHUNK_OVERHEAD * run
                    # Past the bound, one by one below: it fails where `_keep` would.
                    if bound is None or grown <= bound:
                        kept += taken
                        size = grown
                        at += run
                        continue
            payload = payloads[at]
            at += 1
            if like is not None:
                # As in `read` (which says why), for unnamed events: an empty
                # one, or [DONE], has not `head`, and goes to `_record`.
                head, tail, start, after, obfuscated = like
                value = (
                    payload.rfind(_OBFUSCATION) + len(_OBFUSCATION) if obfuscated else len(payload)
                )
                end = value - after
                if (
                    end >= start
                    and payload[:start] == head  # slices: startswith parses arguments
                    and payload[end:value] == tail
                    and _TEXT_BODY.fullmatch(payload, start, end) is not None
                    and (not obfuscated or _last_string(payload, value))
                    and (payload.isascii() or _utf8(payload))
                ):
                    # `_keep`, its size in a local.
                    size += len(payload) + CHUNK_OVERHEAD
                    if bound is not None and size > bound:
                        self._size = size
                        self._too_large()
                        return
                    kept.append(payload)
                    continue
            self._size = size
            self._record(Event(payload))
            size = self._size
            like = self._like if self.reason is None and not self._done else None
        self._size = size

    def data(self, payload: bytes) -> None:
        """`datas([payload])`, one call and no list (a DataSink's: the relay
        gives a read of one plain event so): `datas`'s test of a payload,
        for one. A third copy of that test (`read`'s, `datas`'s), kept for
        speed: the one-event path's a call cheaper than sharing a function
        with them (bench.relay_loop, vllm, one event a read: 29,618 ->
        30,081 instructions an event with one, review 433)."""
        like = self._like if self.reason is None and not self._done else None
        if like is not None:
            head, tail, start, after, obfuscated = like
            value = payload.rfind(_OBFUSCATION) + len(_OBFUSCATION) if obfuscated else len(payload)
            end = value - after
            if (
                end >= start
                and payload[:start] == head
                and payload[end:value] == tail
                and _TEXT_BODY.fullmatch(payload, start, end) is not None
                and (not obfuscated or _last_string(payload, value))
                and (payload.isascii() or _utf8(payload))
            ):
                # `_keep`, inline.
                self._size += len(payload) + CHUNK_OVERHEAD
                if self._max_bytes is not None and self._size > self._max_bytes:
                    self._too_large()
                else:
                    self._chunks.append(payload)
                return
        self._record(Event(payload))

    def _record(self, ev: Event) -> None:
        """Record an event not told by `read` to be like the last chunk kept."""
        if self.reason is not None:
            return
        if ev.name == b"error":
            self._fail("an error event")
            return
        payload = ev.data
        if not payload or self._done:
            return
        if ev.done:
            self._done = True
            return
        self._like = None
        try:
            obj = jsonio.loads(payload)
        except jsonio.JSONDecodeError:
            self._fail("a chunk that is not JSON")
            return
        if not isinstance(obj, dict):
            self._fail("a chunk that is not a JSON object")
            return
        if obj.get("error") is not None:
            self._fail("an error object")
            return
        choices = obj.get("choices")
        if choices is None and obj.get("usage") is not None:
            choices = []  # a usage chunk from an origin that leaves out empty choices
        if not isinstance(choices, list):
            self._fail("a chunk without a list of choices")
            return
        for c in choices:  # a loop, not all() over a generator: this runs per chunk
            if not isinstance(c, dict):
                self._fail("a chunk without a list of choices")
                return
        if self._kind is None:
            self._kind = _chunk_kind(obj)
            if self._kind is None:
                self._fail("chunks of an unknown kind")
                return
            model = obj.get("model")
            self._model = model if isinstance(model, str) else ""
        for c in choices:
            index = c.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                self._fail("a choice whose index is not an integer")
                return
            reason = c.get("finish_reason")
            # Once a choice has finished it stays finished: later chunks (usage,
            # vLLM's continuous stats) do not reopen it.
            if reason is not None:
                self._finish[index] = reason
            else:
                self._finish.setdefault(index, None)
            d = c.get("delta")
            calls = d.get("tool_calls") if type(d) is dict else None
            if calls and (why := self._unmergeable(index, calls)) is not None:
                self._fail(why)
                return
            # Most deltas are {"content": text}: told by two C calls, and
            # dict in map(type, ...) is told in C for the rest.
            if (
                type(d) is dict
                and (len(d) > 1 or "content" not in d)
                and dict in map(type, d.values())
                and (why := self._unjoinable(index, d)) is not None
            ):
                self._fail(why)
                return
        # find, not in: on Python 3.11 `b"\n" in payload` first tries the
        # needle as a byte's value and makes and clears a TypeError (some 1,100
        # instructions more, for each chunk parsed here).
        if payload.find(b"\n") >= 0:
            # Replays frame each payload as one data line.
            payload = jsonio.dumps(obj)
        if obj.get("usage") is not None:
            # Usage may come alone (OpenAI, vLLM) or on a chunk with choices.
            self._usage_seen = True
            if not choices:
                self._usage_only.append(len(self._chunks))
        elif (
            len(choices) == 1 and type(d) is dict and len(d) == 1 and type(d.get("content")) is str
        ):
            self._like = _around_text(payload)
        self._keep(payload)

    def _keep(self, payload: bytes) -> None:
        self._size += len(payload) + CHUNK_OVERHEAD
        if self._max_bytes is not None and self._size > self._max_bytes:
            self._too_large()
            return
        self._chunks.append(payload)

    def _too_large(self) -> None:
        self._fail(f"larger than {self._max_bytes} bytes")
        self.too_large = True


# A JSON string's body without `\u` escapes (which may be lone surrogates),
# unrolled: runs of plain bytes matched as one charset each, not a branch a
# byte (callgrind: 3,200 instructions for a token's text, 4,800 as a branch).
_TEXT_BODY: Final = re.compile(rb'[^"\\\x00-\x1f]*+(?:\\["\\/bfnrt][^"\\\x00-\x1f]*+)*+')
_DELTA_TEXT: Final = b'"delta":{"content":"'


def _around_text(payload: bytes) -> tuple[bytes, bytes, int, int, bool] | None:
    """`payload` (a chunk kept, whose one choice's delta is `{"content":
    text}`, with no usage) before and after that text, and their lengths
    (StreamRecorder.read's per chunk, taken once), or None when it is
    not found once, compact, without escapes (`_TEXT_BODY`). A `"delta":`
    key can be no string's bytes (a string's quotes are escaped), so the
    text found is a delta's: the choice's, or one nested where no check of
    StreamRecorder._record looks.

    When the chunk ends with OpenAI's `obfuscation` string (the object's
    last member: a padding that differs in every chunk, which no check of
    `_record` looks at), the part after the text ends where that string's
    value starts, and the last item is True: a chunk like it may differ in
    that value too."""
    at = payload.find(_DELTA_TEXT)
    if at < 0 or payload.find(_DELTA_TEXT, at + 1) >= 0:
        return None
    start = at + len(_DELTA_TEXT)
    text = _TEXT_BODY.match(payload, start)
    if text is None or payload[text.end() : text.end() + 1] != b'"':
        return None
    end = text.end()
    value = payload.rfind(_OBFUSCATION) + len(_OBFUSCATION)
    if value - len(_OBFUSCATION) > end and _last_string(payload, value):
        return payload[:start], payload[end:value], start, value - end, True
    return payload[:start], payload[end:], start, len(payload) - end, False


def _like_run(payloads: list[bytes], at: int, head: bytes, tail: bytes) -> list[bytes]:
    """The run of `payloads` from `at` on, in a row, that are each `head`, a JSON
    string's body without `\\u` escapes (`_TEXT_BODY`) and `tail`, UTF-8:
    what StreamRecorder.datas's test of each tells, told by C calls over
    them all (none when it cannot tell: they go one by one), not bytecode and a
    regex call each.

    Their bodies are checked joined by a plain byte (`a`): one that ends
    inside an escape makes `\\a` of it, which fails, so the join passes only
    when each does. `head` and `tail` are a kept chunk's, UTF-8 (it was
    parsed) and ASCII where they meet the text (a quote): a payload is
    UTF-8 when its text is, and the texts when their join is."""
    rest = payloads[at:] if at else payloads
    ends = (head, tail)
    # Searches are no help here: a long needle made of what the payloads
    # repeat costs bytes.split more than these slices.
    heads = map(itemgetter(slice(len(head))), rest)
    pairs = zip(heads, map(itemgetter(slice(-len(tail), None)), rest), strict=True)
    run = len(list(takewhile(ends.__eq__, pairs)))
    if not run:
        return []
    taken = rest[:run] if run < len(rest) else rest
    if min(map(len, taken)) < len(head) + len(tail):  # a head and tail that overlap
        return []
    texts = b"a".join(map(itemgetter(slice(len(head), -len(tail))), taken))
    if _TEXT_BODY.fullmatch(texts) is None or not (texts.isascii() or _utf8(texts)):
        return []
    return taken


# What a chunk of OpenAI's ends with: its `obfuscation` member, a string.
_OBFUSCATION: Final = b',"obfuscation":"'


def _last_string(payload: bytes, value: int) -> bool:
    """Whether `payload` ends with a string from `value` to its object's
    closing brace (the top's: the last byte), without `\\u` escapes
    (`_TEXT_BODY`): no quote in it ends it early, and none after it."""
    return (
        payload.endswith(b'"}')
        and _TEXT_BODY.fullmatch(payload, value, len(payload) - 2) is not None
    )


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _chunk_kind(obj: dict[str, Any]) -> ResponseKind | None:
    kind = obj.get("object")
    if kind == "chat.completion.chunk":
        return ResponseKind.CHAT
    if kind == "text_completion":
        return ResponseKind.TEXT
    for c in obj.get("choices") or []:
        if "delta" in c:
            return ResponseKind.CHAT
        if "text" in c:
            return ResponseKind.TEXT
    return None


_CALL_KEYS = (b'"tool_calls"', b'"function_call"')


def holds_tool_calls(entry: CachedResponse) -> bool:
    """Whether `entry`'s answer calls a tool or a (legacy) function: a chat
    answer with a non-empty `tool_calls`, or a `function_call`, in a choice's
    message (a stored body) or delta (a stored stream). Pure. Costs a
    substring search per payload, and a parse of those that name either key
    or hold an escape (a key may be spelt with one)."""
    if entry.kind is not ResponseKind.CHAT:
        return False
    whole = entry.body is not None
    payloads = (entry.body,) if entry.body is not None else entry.chunks or ()
    for payload in payloads:
        if b"\\u" not in payload and not any(k in payload for k in _CALL_KEYS):
            continue
        obj = jsonio.loads_or_none(payload)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for c in choices if isinstance(choices, list) else ():
            part = c.get("message" if whole else "delta") if isinstance(c, dict) else None
            if isinstance(part, dict) and (part.get("tool_calls") or part.get("function_call")):
                return True
    return False


# ---------------------------------------------------------------------------
# Replays


def _frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


_PIECE = re.compile(r"\s*\S+|\s+")


def split_text(text: str, target: int = REPLAY_PIECE_CHARS) -> list[str]:
    """Cut text on whitespace into pieces of at least `target` characters (the
    last may be shorter); the pieces concatenate to exactly `text`."""
    pieces: list[str] = []
    current = ""
    for m in _PIECE.finditer(text):
        current += m.group()
        if len(current) >= target:
            pieces.append(current)
            current = ""
    if current:
        pieces.append(current)
    return pieces


_USAGE_KEY = b'"usage"'


def to_sse_chunks(entry: CachedResponse, *, include_usage: bool) -> list[bytes]:
    """The SSE frames that answer a streaming request from `entry`, ending with
    `data: [DONE]`. include_usage is the request's stream_options.include_usage:
    usage-only chunks are sent only when asked for, because clients that did not
    ask often read `choices[0]` of every chunk, and so is the `"usage": null`
    that a stream recorded with usage has on its other chunks (OpenAI sends no
    usage member to a client that did not ask; see `without_usage_null`).

    A stored stream replays its own chunks. A stored body becomes, per choice, a
    role chunk, the content in several pieces (in one piece with its logprobs
    when it has any), other message fields, each tool call whole, and a finish
    chunk; then the usage chunk. Raises ValueError for embeddings and rerank,
    which have no streamed form."""
    if entry.chunks is not None:
        chunks: Iterable[bytes] = entry.chunks
        if not include_usage:
            chunks = [
                without_usage_null(c) if _USAGE_KEY in c else c
                for i, c in enumerate(entry.chunks)
                if i not in entry.usage_only
            ]
        replay = [_frame(c) for c in chunks]
        replay.append(DONE_FRAME)
        return replay
    assert entry.body is not None
    if entry.kind is ResponseKind.EMBEDDINGS or entry.kind is ResponseKind.RERANK:
        raise ValueError(f"an {entry.kind} answer cannot be streamed")
    obj: dict[str, Any] = jsonio.loads(entry.body)
    chat = entry.kind is ResponseKind.CHAT
    base: dict[str, Any] = {
        "id": obj.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": obj.get("created", 0),
        "model": obj.get("model", entry.model),
    }
    for name in ("system_fingerprint", "service_tier"):
        if obj.get(name) is not None:
            base[name] = obj[name]
    if include_usage:
        base["usage"] = None  # as OpenAI marks every chunk but the last
    frames: list[bytes] = []

    def emit(choice: dict[str, Any]) -> None:
        frames.append(_frame(jsonio.dumps({**base, "choices": [choice]})))

    for choice in obj.get("choices", []):
        if chat:
            _replay_chat_choice(choice, emit)
        else:
            _replay_text_choice(choice, emit)
    usage = obj.get("usage")
    if include_usage and usage is not None:
        frames.append(_frame(jsonio.dumps({**base, "choices": [], "usage": usage})))
    frames.append(DONE_FRAME)
    return frames


# Message fields replayed by their own rules; any other field (reasoning_content,
# annotations, audio, ...) is replayed whole in a delta of its own.
_MESSAGE_FIELDS = frozenset({"role", "content", "refusal", "tool_calls", "function_call"})


_Emit = Callable[[dict[str, Any]], None]


def _replay_chat_choice(choice: dict[str, Any], emit: _Emit) -> None:
    index = choice.get("index", 0)
    message: dict[str, Any] = choice.get("message") or {}
    logprobs = choice.get("logprobs")

    def delta(d: dict[str, Any], finish: Any = None, lp: Any = None) -> None:
        emit({"index": index, "delta": d, "logprobs": lp, "finish_reason": finish})

    content = message.get("content")
    # An empty string opens a text answer, as OpenAI's first chunk; null a
    # tool-call-only one, so that a reassembled body keeps content null.
    delta({"role": message.get("role") or "assistant", "content": "" if content else None})
    for name, value in message.items():
        # Before the content, as reasoning models stream their reasoning first.
        if name not in _MESSAGE_FIELDS and value is not None:
            delta({name: value})
    if isinstance(content, str) and content:
        if logprobs is not None:
            delta({"content": content}, lp=logprobs)
            logprobs = None
        else:
            for piece in split_text(content):
                delta({"content": piece})
    if message.get("refusal"):
        delta({"refusal": message["refusal"]})
    if message.get("function_call") is not None:
        delta({"function_call": message["function_call"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        delta({"tool_calls": [{"index": i, **call}]})
    delta({}, finish=choice.get("finish_reason"), lp=logprobs)


def _replay_text_choice(choice: dict[str, Any], emit: _Emit) -> None:
    index = choice.get("index", 0)
    text = choice.get("text") or ""
    logprobs = choice.get("logprobs")

    def piece(t: str, finish: Any = None, lp: Any = None) -> None:
        emit({"index": index, "text": t, "logprobs": lp, "finish_reason": finish})

    if logprobs is not None:
        piece(text, lp=logprobs)
    else:
        for p in split_text(text):
            piece(p)
    piece("", finish=choice.get("finish_reason"))


def to_completion(entry: CachedResponse) -> bytes:
    """The non-streamed body that answers a request from `entry`.

    A stored body is returned as is. A stored stream is assembled: per choice
    index, string deltas concatenated (content, refusal, reasoning, ...), list
    deltas extended, tool calls gathered by index (`_TOOL_PIECES`: a
    function's arguments and a custom tool's input concatenated, the rest
    taken whole), audio's data and transcript concatenated (`_DELTA_PIECES`:
    its other members, and any other object, taken whole), the last
    finish_reason, logprobs lists concatenated; usage
    from the usage chunk if any; id, created, model and system_fingerprint
    from the first chunk."""
    if entry.body is not None:
        return entry.body
    assert entry.chunks is not None
    chat = entry.kind is ResponseKind.CHAT
    head: dict[str, Any] | None = None
    usage: Any = None
    choices: dict[int, _Choice] = {}
    for payload in entry.chunks:
        obj: dict[str, Any] = jsonio.loads(payload)
        if head is None:
            head = obj
        if obj.get("usage") is not None:
            usage = obj["usage"]
        for c in obj.get("choices", []):
            acc = choices.get(c.get("index", 0))
            if acc is None:
                acc = choices[c.get("index", 0)] = _Choice()
            acc.add(c, chat=chat)
    assert head is not None
    out: dict[str, Any] = {
        "id": head.get("id", ""),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created", 0),
        "model": head.get("model", entry.model),
        "choices": [choices[i].build(i, chat=chat) for i in sorted(choices)],
    }
    for name in ("system_fingerprint", "service_tier"):
        if head.get(name) is not None:
            out[name] = head[name]
    if usage is not None:
        out["usage"] = usage
    return jsonio.dumps(out)


class _Choice:
    """The parts of one choice gathered from stream chunks."""

    def __init__(self) -> None:
        self.role: Any = None
        self.strings: dict[str, list[str]] = {}
        self.lists: dict[str, list[Any]] = {}
        self.others: dict[str, Any] = {}
        self.tools: dict[int, dict[str, Any]] = {}
        self.joined: dict[str, dict[str, Any]] = {}  # `_DELTA_PIECES`
        self.function_call: dict[str, Any] | None = None
        self.logprobs: dict[str, Any] | None = None
        self.finish: Any = None

    def add(self, c: dict[str, Any], *, chat: bool) -> None:
        if c.get("finish_reason") is not None:
            self.finish = c["finish_reason"]
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            self._merge_logprobs(lp)
        if not chat:
            text = c.get("text")
            if isinstance(text, str):
                self.strings.setdefault("text", []).append(text)
            return
        delta = c.get("delta")
        if not isinstance(delta, dict):
            return
        for name, value in delta.items():
            if value is None:
                continue
            if name == "role":
                self.role = value
            elif name == "tool_calls" and isinstance(value, list):
                for call in value:
                    self._add_tool_call(call)
            elif name == "function_call" and isinstance(value, dict):
                if self.function_call is None:
                    self.function_call = {"name": "", "arguments": ""}
                _extend_call(self.function_call, value)
            elif isinstance(value, str):
                self.strings.setdefault(name, []).append(value)
            elif isinstance(value, list):
                self.lists.setdefault(name, []).extend(value)
            elif name in _DELTA_PIECES and isinstance(value, dict):
                self._add_pieces(name, value)
            else:
                # The recorder keeps no stream where an object comes twice.
                self.others[name] = value

    def _add_pieces(self, name: str, value: dict[str, Any]) -> None:
        """Gather one delta of an object joined by `_DELTA_PIECES`: its text
        members in pieces (joined once, in `build`: audio's data is large,
        and concatenated a piece at a time it would be copied per piece),
        the rest whole."""
        slot = self.joined.setdefault(name, {})
        pieces = _DELTA_PIECES[name]
        for member, v in value.items():
            if v is None:
                continue
            have = slot.get(member)
            if member in pieces and isinstance(v, str):
                if isinstance(have, _Pieces):
                    have.append(v)
                else:
                    slot[member] = _Pieces([v])
            else:
                slot[member] = v

    def _add_tool_call(self, call: Any) -> None:
        """Merge one delta of a tool call by the rules of `_TOOL_PIECES`; the
        recorder has refused a stream whose calls these rules cannot merge."""
        if not isinstance(call, dict):
            return
        index = call.get("index", 0)
        if not isinstance(index, int):
            return
        slot = self.tools.get(index)
        if slot is None:
            slot = self.tools[index] = {"id": ""}
        for name, value in call.items():
            if name == "index" or value is None:
                continue
            if name in ("id", "type") and not value:
                continue  # review: "" in a later delta (DashScope's) is no new id
            piece = _TOOL_PIECES.get(name)
            if piece is not None and isinstance(value, dict):
                part = slot.get(name)
                if not isinstance(part, dict):
                    part = slot[name] = {"name": "", piece: ""}
                _extend_call(part, value, piece)
            else:
                slot[name] = value

    def _merge_logprobs(self, lp: dict[str, Any]) -> None:
        if self.logprobs is None:
            self.logprobs = {}
        for name, value in lp.items():
            if isinstance(value, list):
                have = self.logprobs.get(name)
                self.logprobs[name] = (have if isinstance(have, list) else []) + value
            elif value is not None or name not in self.logprobs:
                self.logprobs[name] = value

    def build(self, index: int, *, chat: bool) -> dict[str, Any]:
        joined = {name: "".join(parts) for name, parts in self.strings.items()}
        if not chat:
            return {
                "index": index,
                "text": joined.get("text", ""),
                "logprobs": self.logprobs,
                "finish_reason": self.finish,
            }
        content: str | None = joined.pop("content", "")
        if not content and (self.tools or self.function_call or self.joined):
            # An audio answer, like a tool call, has no text: content null, as
            # a whole answer has it. vLLM opens every stream with a delta of
            # `"content": ""`, which is no text (trial 97: a stored tool-call
            # stream answered a whole request with content "", where OpenAI's
            # whole answers, and vLLM's under `tool_choice: "auto"`, say null).
            content = None
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": content,
            "refusal": joined.pop("refusal", None),
        }
        message.update(joined)
        message.update(self.lists)
        message.update(self.others)
        for name, slot in self.joined.items():
            message[name] = {
                m: "".join(v) if isinstance(v, _Pieces) else v for m, v in slot.items()
            }
        if self.function_call is not None:
            message["function_call"] = self.function_call
        if self.tools:
            message["tool_calls"] = [_tool_call(self.tools[i]) for i in sorted(self.tools)]
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish,
        }


class _Pieces(list[str]):
    """The pieces of a text member of a `_DELTA_PIECES` object, told apart
    from a whole member's value that happens to be a list."""


def _extend_call(call: dict[str, Any], part: dict[str, Any], piece: str = "arguments") -> None:
    """Merge a delta's `part` of a call (`function`, `custom`, a legacy
    `function_call`) into `call`: its name taken whole (some origins repeat it
    in every delta), its `piece` member (arguments, input) concatenated, any
    other member taken whole."""
    for name, value in part.items():
        if name == piece and isinstance(value, str):
            have = call.get(piece)
            call[piece] = (have if isinstance(have, str) else "") + value
        elif name == "name":
            if isinstance(value, str) and value:
                call["name"] = value
        elif value is not None:
            call[name] = value


def _tool_call(slot: dict[str, Any]) -> dict[str, Any]:
    """A tool call gathered from its deltas, in the order OpenAI gives its
    members (id, type, then the rest). A call whose deltas never said its type
    takes the one its members show (`function` when none does, as before
    custom tools existed); a call of a known type gets its member even when no
    delta carried one, so that its shape stays valid."""
    kind = slot.get("type")
    if kind is None:
        kind = next((name for name in _TOOL_PIECES if name in slot), "function")
    call: dict[str, Any] = {"id": slot.get("id", ""), "type": kind}
    piece = _TOOL_PIECES.get(kind) if isinstance(kind, str) else None
    if piece is not None and not isinstance(slot.get(kind), dict):
        call[kind] = {"name": "", piece: ""}
    call.update((name, value) for name, value in slot.items() if name not in call)
    return call
