"""Token counts of an answer, for rate-limit settlement and accounting.

Non-streaming answers carry `usage`. A stream carries it only in a final chunk
when the client asked for `stream_options.include_usage`; otherwise the count
is the number of events that carried generated text (origins such as vLLM
send one token per event), which is what "the streamed count" means in
docs/rate-limits.md.

Responses answers name their counts `input_tokens` and `output_tokens`; a
Responses stream always ends with a `response.completed` event whose
`response.usage` holds them, and its text comes in `"delta": "..."` events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dataplane import jsonio
from dataplane.streaming.sse import Event


def asks_usage(body: dict[str, Any]) -> bool:
    """Whether a request asks for a stream's usage chunk
    (`stream_options.include_usage: true`)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    exact: bool = False  # from the origin's usage, not counted by the proxy
    # Of the prompt tokens, those the origin's prefix (KV) cache held, when
    # its usage says (`prompt_tokens_details.cached_tokens`, the Responses
    # API's `input_tokens_details`); None when it does not.
    cached_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _from_usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    if "prompt_tokens" in obj:
        prompt, completion = obj.get("prompt_tokens"), obj.get("completion_tokens", 0)
        details = obj.get("prompt_tokens_details")
    else:  # the Responses API's names
        prompt, completion = obj.get("input_tokens"), obj.get("output_tokens", 0)
        details = obj.get("input_tokens_details")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= prompt:
        cached = None
    return Usage(prompt, completion, exact=True, cached_tokens=cached)


def _estimated(obj: object) -> bool:
    """A usage chunk the proxy wrote itself (`"ponto": {"usage": "estimated"}`,
    dataplane.http.resume): not the origin's count. The proxy's own count
    stands instead, which sees every event it relayed (tool-call arguments
    too, which the estimate did not: review of trial 45's fix)."""
    ponto = obj.get("ponto") if isinstance(obj, dict) else None
    return isinstance(ponto, dict) and ponto.get("usage") == "estimated"


def usage_of(obj: object) -> Usage | None:
    """The usage of a complete answer already parsed, or None if it has none:
    `usage`, or `response.usage` (a Responses stream's `response.completed`)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None:
        inner = obj.get("response")
        usage = inner.get("usage") if isinstance(inner, dict) else None
    return _from_usage(usage)


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
    b'"delta":"',  # Responses: response.output_text.delta and its kin
    b'"delta": "',
)


# A choice's finish_reason (OpenAI's values are short lowercase words).
FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]{1,64})"')


def _has_text(event: bytes) -> bool:
    for marker in _TEXT_MARKERS:
        at = event.find(marker)
        while at >= 0:
            end = at + len(marker)
            if end < len(event) and event[end] != 0x22:  # '"'
                return True
            at = event.find(marker, end)
    return False


def _finished_choices(data: bytes) -> list[int]:
    """The indexes of the choices a chunk finishes."""
    obj = jsonio.loads_or_none(data)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return []
    return [
        c["index"]
        for c in choices
        if isinstance(c, dict)
        and isinstance(c.get("finish_reason"), str)
        and isinstance(c.get("index"), int)
    ]


class UsageCounter:
    """Counts a relayed stream from its parsed events (one `SseParser` per relay).

    Cheap: only an event that mentions a non-null "usage" is parsed as JSON;
    the others are searched for a text delta. Given a `finishes` list (a
    traced request's), each choice's finish_reason is added to it; given a
    `finished` set (a request of several choices), the index of each choice
    that finished (the events that carry a finish are parsed for it).
    """

    __slots__ = ("content_events", "finished", "finishes", "usage")

    def __init__(
        self, finishes: list[bytes] | None = None, finished: set[int] | None = None
    ) -> None:
        self.content_events = 0
        self.usage: Usage | None = None
        self.finishes = finishes
        self.finished = finished

    def event(self, ev: Event) -> None:
        data = ev.data
        if b'"usage"' in data and b'"usage":null' not in data and b'"usage": null' not in data:
            obj = jsonio.loads_or_none(data)
            found = None if b'"estimated"' in data and _estimated(obj) else usage_of(obj)
            if found is not None:
                self.usage = found
        if _has_text(data):
            self.content_events += 1
        finishes, finished = self.finishes, self.finished
        if (finishes is not None or finished is not None) and b'"finish_reason"' in data:
            reasons = FINISH_REASON.findall(data)
            if finishes is not None:
                finishes += reasons
            if reasons and finished is not None:
                finished.update(_finished_choices(data))

    def result(self, prompt_estimate: int) -> Usage:
        """The origin's own count if it sent one, else the estimate and the events."""
        if self.usage is not None:
            return self.usage
        return Usage(prompt_estimate, self.content_events)
