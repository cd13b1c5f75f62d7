"""A stream's opening: what its first bytes say before the client sees any.

Until the client has seen a byte of a stream, the forwarder may still replace
a failing origin with the next one. It holds the stream's first bytes until
they hold an event of the answer (trial 51: a keep-alive comment, or a
Responses stream's response.created and response.in_progress, committed the
stream, and a stall before the first token then cut it); and a stream whose
first event of its answer is an error is failed over as a whole error answer
is (review 201).

The bytes are read by the proxy's one SSE parser (`dataplane.streaming.sse`),
so a stream's opening has the rules its relay, usage counting and recording
have: SSE's three line endings, a byte order mark first, data lines joined.
Pure and synchronous; one `Opening` per stream, fed only while it is held.
"""

from __future__ import annotations

import re
from typing import Any

from dataplane import jsonio
from dataplane.streaming.sse import Event, SseParser

__all__ = ["PREAMBLE", "Opening", "only_done"]

# A Responses stream's events before any output: the response, created, then
# in progress (OpenAI sends both at once, before the model has run).
PREAMBLE = frozenset({b"response.created", b"response.in_progress"})
_PREAMBLE_TYPE = re.compile(rb'"type"\s*:\s*"response\.(?:created|in_progress)"')


class Opening:
    """A stream's first bytes, as fed (`feed`), read as events: `begun` once
    they hold a whole event of the answer, `first_answer` its data.

    An event of the answer is one with data: not a comment, not an event
    with only a name, and, for a Responses stream (`responses`), not one of
    its preamble (PREAMBLE, by its `event` name or, without one, by its
    data's `type`). It counts once whole, so that what it says can be read
    (an error whose line came in two writes was relayed as an answer): an
    origin that sends half an event and stalls is as late as a silent one."""

    __slots__ = ("_parser", "_responses", "begun", "events")

    def __init__(self, responses: bool) -> None:
        self._parser = SseParser()
        self._responses = responses
        self.events: list[Event] = []  # the whole events fed, in order
        self.begun = False

    def feed(self, chunk: bytes) -> bool:
        """Reads `chunk`, the stream's next bytes; whether the answer has begun."""
        events = self._parser.feed(chunk)
        self.events += events
        if not self.begun:
            self.begun = any(self._of_answer(event) for event in events)
        return self.begun

    def first_answer(self) -> Any:
        """The first event of the answer's data, parsed as JSON (any value);
        `jsonio.NOT_PARSED` for data that is no JSON, and None before the
        answer has begun."""
        for event in self.events:
            if self._of_answer(event):
                parsed = jsonio.loads_or_none(event.data)
                return jsonio.NOT_PARSED if parsed is None else parsed
        return None

    def _of_answer(self, event: Event) -> bool:
        if not event.data:
            return False  # a name alone (`event: ping`), or empty data
        if not self._responses:
            return True
        if event.name:
            return event.name.rstrip() not in PREAMBLE
        return _PREAMBLE_TYPE.search(event.data, 0, 200) is None


def only_done(chunk: bytes) -> bool:
    """Whether a stream's first chunk is its `data: [DONE]` and no event of
    the answer before it (comments, names alone and empty data aside, as
    Opening reads them; its blank line may not have come): a stream without
    one event (trial 45: passed on as an empty answer, which the SDK reads as
    nothing).

    Read up to each blank line in turn (the parser's events do not depend on
    how its bytes are split), and no further than the first event that
    decides: a short answer that came whole in its first chunk, [DONE] and
    all, is not parsed here for nothing."""
    # find, not `in`: see dataplane.streaming.sse.
    if chunk.find(b"[DONE]") < 0:  # nearly every first chunk: one search
        return False
    parser = SseParser()
    said: list[Event] = []
    at = 0
    while at < len(chunk):
        blank = chunk.find(b"\n\n", at)
        end = len(chunk) if blank < 0 else blank + 2
        said += [event for event in parser.feed(chunk[at:end]) if event.data]
        if len(said) > 1 or (said and not _done_alone(said[0])):
            return False
        at = end
    last = parser.close()
    if last is not None and last.data:
        said.append(last)
    return len(said) == 1 and _done_alone(said[0])


def _done_alone(event: Event) -> bool:
    return event.done and not event.name
