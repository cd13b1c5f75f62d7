"""Token counts of an answer, for rate-limit settlement and accounting.

Non-streaming answers carry `usage`. A stream carries it only in a final chunk
when the client asked for `stream_options.include_usage`; otherwise the count
is the number of events that carried generated text (origins such as vLLM
send one token per event), which is what "the streamed count" means in
docs/rate-limits.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from dataplane import jsonio


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    exact: bool = False  # from the origin's usage, not counted by the proxy

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _from_usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("prompt_tokens")
    completion = obj.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion, exact=True)


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a complete JSON answer, or None if it has none."""
    if b'"usage"' not in body:
        return None
    try:
        data = jsonio.loads(body)
    except jsonio.JSONDecodeError:
        return None
    return _from_usage(data.get("usage")) if isinstance(data, dict) else None


# A delta with generated text, in compact or spaced JSON. An empty string
# (the role chunk that opens every chat stream) is not text: the byte after
# the opening quote must not be the closing one.
_TEXT_MARKERS = (
    b'"content":"',
    b'"content": "',
    b'"text":"',
    b'"text": "',
    b'"arguments":"',
    b'"arguments": "',
)


def _has_text(event: bytes) -> bool:
    for marker in _TEXT_MARKERS:
        at = event.find(marker)
        while at >= 0:
            end = at + len(marker)
            if end < len(event) and event[end] != 0x22:  # '"'
                return True
            at = event.find(marker, end)
    return False


class UsageTap:
    """Counts a relayed SSE stream as it passes (a StreamTap).

    Cheap: events are split on blank lines; only an event that mentions
    "usage" is parsed as JSON.
    """

    __slots__ = ("_buf", "complete", "content_events", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.content_events = 0
        self.usage: Usage | None = None
        self.complete = False

    def feed(self, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        for event in events:
            if (
                b'"usage"' in event
                and b'"usage":null' not in event
                and b'"usage": null' not in event
            ):
                payload = event.partition(b"data:")[2].strip()
                try:
                    data = jsonio.loads(payload)
                except jsonio.JSONDecodeError:
                    data = None
                if isinstance(data, dict):
                    found = _from_usage(data.get("usage"))
                    if found is not None:
                        self.usage = found
            if _has_text(event):
                self.content_events += 1

    def end(self, complete: bool) -> None:
        self.complete = complete

    def result(self, prompt_estimate: int) -> Usage:
        if self.usage is not None:
            return self.usage
        return Usage(prompt_estimate, self.content_events)


class Taps:
    """Several taps as one."""

    __slots__ = ("_taps",)

    def __init__(self, *taps: object) -> None:
        self._taps = taps

    def feed(self, chunk: bytes) -> None:
        for tap in self._taps:
            tap.feed(chunk)  # type: ignore[attr-defined]

    def end(self, complete: bool) -> None:
        for tap in self._taps:
            tap.end(complete)  # type: ignore[attr-defined]
