"""The proxy's one Server-Sent Events parser.

Every reader of an origin's stream goes through it: usage counting
(`dataplane.streaming.usage`), recording for the cache
(`dataplane.cache.entry.StreamRecorder`) and the relay that feeds both. The
relay forwards the origin's bytes unchanged when the stream may not be
continued, and then parses events only when someone reads them; one that may
be continued writes the events this parser gives, re-framed
(dataplane.streaming.relay), so what it drops (comments, `id`, `retry`)
does not reach the client.

The rules are the WHATWG ones that matter for completions: a line ends with
CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the
next are one line ending); a blank line ends an event; the `data` lines of an
event are joined with LF; one space after the colon is dropped; lines starting
with ':' are comments (keep-alives); `event` names the event; other fields
(`id`, `retry`) are ignored; one byte order mark at the stream's start is
dropped (a stream's first line after it is a line like any other). An event
is dispatched when it has data or a name, so an `event: error` without data
still counts.

Searches of bytes are `find`, not `in`: on Python 3.11 `needle in data`
first tries the needle as an integer (a byte's value) and makes and clears a
TypeError with a formatted message, some 1,100 instructions more than
`data.find(needle)` (callgrind), and these run for every event.

Chunks may split anywhere, even inside a line ending. A line that comes in
many chunks is kept as its pieces until it ends, so a long one costs its
length, not its length times its chunks. The parser holds at most the event
it is inside (`held`): its callers bound that. Pure and synchronous; one
parser per stream.
"""

from __future__ import annotations

__all__ = ["BOM", "DONE", "Event", "SseParser"]

DONE = b"[DONE]"
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: SSE lets a stream begin with one


class Event:
    """One dispatched event: its data lines joined with LF, and its name;
    `done` is True for the `data: [DONE]` sentinel that OpenAI-style streams
    end with; `size`, the bytes of its lines as they came (field names,
    comments and line endings too, a CRLF counted as one; not its blank
    line), which bounds what holding it cost (`SseParser.held`), or, for an
    event made by hand, its data and name. Immutable by convention; equal
    when data and name are.

    A plain slotted class, not a frozen dataclass: every chunk of every
    stream makes one, and each of its readers asks whether it is the
    sentinel (a frozen dataclass's init and a property cost more than the
    rest of some readers)."""

    __slots__ = ("data", "done", "name", "size")

    def __init__(self, data: bytes, name: bytes = b"", size: int = -1) -> None:
        self.data = data
        self.name = name
        self.size = size if size >= 0 else len(data) + len(name)
        # The sentinel, possibly with surrounding whitespace (a strip that
        # strips nothing returns its bytes, and bytes of another length
        # compare at once: 500 instructions where `DONE in data` first was 2,600).
        self.done = data.strip() == DONE

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Event):
            return NotImplemented
        return self.data == other.data and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.data, self.name))

    def __repr__(self) -> str:
        return f"Event(data={self.data!r}, name={self.name!r})"


class SseParser:
    """With a `limit`, the first block (an event, or lines with neither data
    nor a name) whose size passes it sets `over`: feed() returns the events
    before it, and nothing from then on.

    `verbatim`: the chunk last fed was its events exactly, each as
    `data: ` + its data + LF LF (one data line, no name, nothing held
    before or after), so that a relay that frames events so may send the
    chunk itself (dataplane.streaming.relay)."""

    __slots__ = (
        "_cr",
        "_data",
        "_limit",
        "_line",
        "_line_size",
        "_name",
        "_size",
        "_start",
        "over",
        "verbatim",
    )

    def __init__(self, limit: int = 0) -> None:
        self._limit = limit
        self.over = False
        self.verbatim = False
        # The stream's first bytes, while they may still be a byte order mark
        # (it may come split); None once past them.
        self._start: bytes | None = b""
        # The start of a line whose ending has not arrived, in the pieces it came in.
        self._line: list[bytes] = []
        # Their bytes, counted as they come: `held` is asked after every chunk,
        # and summing the pieces then would cost a line in N chunks N**2 / 2.
        self._line_size = 0
        self._cr = False  # the last chunk ended with CR: a leading LF is its pair
        self._data: list[bytes] = []
        # The bytes of the event's whole lines as they came (but a CRLF
        # counted as one), all of them, not only its data's values: an event
        # of empty data lines holds a list slot for each, and must count as
        # long as it is; and an event's size must not depend on how its bytes
        # were split (a comment line under way counts in `held`, so it counts
        # once whole too).
        self._size = 0
        self._name = b""

    @property
    def held(self) -> int:
        """The bytes of the event the parser is inside: its lines as they came
        (see Event.size), and the start of the next line. Every line kept
        counts, so what the parser holds stays within a few times this,
        however short its lines; and it never goes down until the event ends,
        whose `size` is at least every `held` on the way."""
        return self._size + self._line_size

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that `chunk` completes, in order (see `over`)."""
        datas = self.plain(chunk)
        if datas is not None:
            if len(datas) == 1:  # most reads: without a comprehension's frame
                return [Event(datas[0], b"", len(datas[0]) + 7)]
            return [Event(data, b"", len(data) + 7) for data in datas]
        if not chunk or self.over:
            return []
        if self._start is not None:
            chunk = self._start + chunk
            if len(chunk) < len(BOM) and BOM.startswith(chunk):
                self._start = chunk
                return []
            self._start = None
            if chunk.startswith(BOM):
                chunk = chunk[len(BOM) :]
                if not chunk:
                    return []
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if chunk.find(b"\r") >= 0:
            self._cr = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if chunk.find(b"\n") < 0:  # the line goes on (if the chunk was more than an LF)
            if chunk:
                self._line.append(chunk)
                self._line_size += len(chunk)
            return []
        lines = chunk.split(b"\n")
        if self._line:
            self._line.append(lines[0])
            lines[0] = b"".join(self._line)
        last = lines.pop()
        self._line = [last] if last else []
        self._line_size = len(last)
        events: list[Event] = []
        limit = self._limit
        for line in lines:
            if not line:
                if limit and self._size > limit:
                    self.over = True
                    return events
                if self._data or self._name:
                    events.append(Event(b"\n".join(self._data), self._name, self._size))
                    self._data = []
                    self._name = b""
                self._size = 0
                continue
            self._size += len(line) + 1
            if line.startswith(b"data: "):  # nearly every line
                self._data.append(line[6:])
            elif line[0] != 0x3A:  # ':' starts a comment
                name, _, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if name == b"data":
                    self._data.append(value)
                elif name == b"event":
                    self._name = value
        return events

    def plain(self, chunk: bytes) -> list[bytes] | None:
        """The data of the events `chunk` completes when it is whole events
        of one data line each (see `verbatim`, which it sets), the parser
        then left as `feed` would leave it: what `feed` would make Events of
        (each unnamed, its `size` its data's length and 7), without them.
        None, nothing consumed, when it is not (then `feed` it)."""
        self.verbatim = False
        if (
            chunk.endswith(b"\n\n")
            and chunk.startswith(b"data: ")
            and not (
                self._line or self._data or self._name or self._cr or self._size or self._start
            )
            and not self.over
            and chunk.find(b"\r") < 0
            and not (self._limit and len(chunk) - 1 > self._limit)
        ):
            # Most chunks of a stream: whole events of one data line each,
            # with nothing pending (not even a line counted in the event's
            # size, an `id:` split from its data). What `feed`'s lines make
            # of them, in a few steps: one event (its only LFs its last two),
            # or several, when every LF is of the blank line after each
            # event's one line and every event after the first starts `data: `
            # (split on a blank line and `data: `, no piece holds an LF:
            # searched for in them joined, a memchr, not by a count of the
            # chunk's LFs, which goes byte by byte).
            if chunk.find(b"\n") == len(chunk) - 2:
                self._start = None
                self.verbatim = True
                return [chunk[6:-2]]
            datas = chunk[6:-2].split(b"\n\ndata: ")
            if b"".join(datas).find(b"\n") < 0:
                self._start = None
                self.verbatim = True
                return datas
        return None

    def one(self, chunk: bytes) -> bytes | None:
        """`plain(chunk)`'s one data when `chunk` is exactly one event of one
        data line (`data: ` + data + LF LF), the parser then left as `plain`
        leaves it; None, nothing consumed, when it is not (then `plain` or
        `feed` it). `plain`'s test for a read of one event, alone and in
        fewer calls: nearly every read of an origin that writes each event
        as it generates it (vLLM, SGLang) is one."""
        if (
            chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1] == 0x0A
            and chunk[:6] == b"data: "
            # `verbatim` leaves nothing pending (plain's tests of it, at once).
            and (
                self.verbatim
                or not (
                    self._line
                    or self._data
                    or self._name
                    or self._cr
                    or self._size
                    or self._start
                    or self.over
                )
            )
            # partition: one argument, where find parses a tuple of them.
            and not chunk.partition(b"\r")[1]
            and not (self._limit and len(chunk) - 1 > self._limit)
        ):
            self._start = None
            self.verbatim = True
            return chunk[6:-2]
        return None

    def close(self) -> Event | None:
        """At the end of the stream: the event it stopped inside, if any.

        A last line without its ending is taken as a line first; an event that
        a blank line did not end is then returned (not dispatched), so callers
        decide how lenient to be with it.
        """
        if self._line:
            line = b"".join(self._line)
            self._line = []
            self._line_size = 0
            self.feed(line + b"\n")
        size, self._size = self._size, 0
        if not (self._data or self._name):
            return None
        open_event = Event(b"\n".join(self._data), self._name, size)
        self._data = []
        self._name = b""
        return open_event
