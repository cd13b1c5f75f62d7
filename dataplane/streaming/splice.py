"""Pure: continuing a broken stream on another origin, as one unbroken stream.

When an origin's stream stops after the client has bytes, the proxy asks the
next origin for the rest and splices it into the same client stream:

* `Transcript` keeps the raw data of every event relayed so far (an append
  per event; nothing is parsed unless the stream breaks), up to its own bound
  and the process's (`TranscriptBudget`).
* `read_state` turns a transcript into what was said: the stream's `id`,
  `created` and `model`, each choice's text, whether a choice finished or a
  tool call was under way, the tokens sent.
* `continuation_body` is the request that asks for the rest: for chat, the
  same request with the text so far as a final assistant message and vLLM's
  `continue_final_message: true, add_generation_prompt: false`; for
  completions, the prompt followed by the text so far. `max_tokens` shrinks
  by the tokens already sent. None when the stream cannot be continued
  (several choices, a tool call under way, a prompt that is not one string).
* `Splicer` rewrites each event of the continuation so that the client sees
  the original stream going on: the original `id`, `created` and `model`, no
  second role delta, `usage` that adds every call (the retries' prompt tokens
  counted), and `"ponto": {"continued": N}` on the event that carries the
  finish reason and on the usage event.

Only events whose data is a JSON object with `choices` are rewritten; the
`[DONE]` sentinel passes as is.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Final

from dataplane import jsonio
from dataplane.streaming.sse import Event

__all__ = [
    "Splicer",
    "StreamState",
    "Transcript",
    "TranscriptBudget",
    "continuation_body",
    "is_error_event",
    "not_continued",
    "read_state",
]

CHAT: Final = "chat.completions"
COMPLETIONS: Final = "completions"


# A stream whose events add up to more than this is not continued: the
# transcript stops there, so memory per stream stays bounded (about 10k tokens
# of a typical stream fit).
MAX_TRANSCRIPT_BYTES: Final = 4 << 20
# What all of a process's transcripts may hold together (--max-transcripts-mb):
# 4 MiB each alone let thousands of held streams grow without bound (trial 74).
# Per worker: the chart's pod (2 workers, 1 GiB) holds about 465 MB before
# requests under way, so 2 x 128 MB leaves room for the streams themselves.
# About 550 streams of 1,000 events each fit.
DEFAULT_TRANSCRIPTS_BYTES: Final = 128 << 20

# Transcript.overflow: which bound stopped it.
STREAM_BOUND: Final = "stream"
PROXY_BOUND: Final = "proxy"


class TranscriptBudget:
    """The event bytes all transcripts of one process hold (`held`), against
    `limit`, and how many transcripts each bound stopped (`dropped`, by
    STREAM_BOUND and PROXY_BOUND, for a counter read at scrape time).

    One per app; its transcripts add to it and give back, all on the event
    loop's thread (no lock)."""

    __slots__ = ("dropped", "held", "limit")

    def __init__(self, limit: int = DEFAULT_TRANSCRIPTS_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self.dropped = {STREAM_BOUND: 0, PROXY_BOUND: 0}


class Transcript:
    """The data of every event relayed so far, in order (an EventSink, a
    ReadSink and a DataSink), up to
    MAX_TRANSCRIPT_BYTES and while `budget`'s transcripts hold no more than
    its limit; `overflow` says which bound stopped it ("" while it keeps
    events). Stopped, it drops its events and gives their bytes back: the
    stream is not continued if cut.

    Its owner (the stream's relay) calls `release` once the stream has ended,
    however it ended (a cancellation included), so the budget gets back what
    the transcript held."""

    __slots__ = ("_budget", "_size", "events", "overflow")

    def __init__(self, budget: TranscriptBudget | None = None) -> None:
        self.events: list[bytes] = []
        self.overflow = ""
        self._size = 0  # also what this transcript holds of `budget`
        self._budget = budget

    def event(self, ev: Event) -> None:
        if not ev.done:
            self.data(ev.data)

    def data(self, data: bytes) -> None:
        """`event` of an unnamed event of `data`, not `[DONE]` (a DataSink's:
        the relay gives a read of one plain event so)."""
        if self.overflow:
            return
        size = len(data)
        self._size += size
        budget = self._budget
        if budget is not None:
            budget.held += size
        if self._size > MAX_TRANSCRIPT_BYTES:
            self._stop(STREAM_BOUND)
        elif budget is not None and budget.held > budget.limit:
            # The stream whose event went past the bound stops; the others
            # keep theirs (dropping every transcript at once would leave no
            # stream continuable).
            self._stop(PROXY_BOUND)
        else:
            self.events.append(data)

    def read(self, events: list[Event]) -> None:
        """`event` of each of `events` in order (the relay gives a read's
        events so when every one of them reaches the client): their data
        added at once, one call a read, not one an event; a read that would
        pass a bound goes event by event, so that the bound named is the
        one `event` would name."""
        if len(events) == 1:  # most reads of a generating origin: no comprehension's frame
            self.event(events[0])
            return
        if self.overflow:
            return
        datas = [ev.data for ev in events if not ev.done]
        size = sum(map(len, datas))
        budget = self._budget
        if self._size + size > MAX_TRANSCRIPT_BYTES or (
            budget is not None and budget.held + size > budget.limit
        ):
            for ev in events:
                self.event(ev)
            return
        self._size += size
        if budget is not None:
            budget.held += size
        self.events += datas

    def datas(self, datas: list[bytes]) -> None:
        """`event` of an unnamed event of each of `datas`, none `[DONE]`
        (a DataSink's): as `read` adds them."""
        if self.overflow:
            return
        size = sum(map(len, datas))
        budget = self._budget
        if self._size + size > MAX_TRANSCRIPT_BYTES or (
            budget is not None and budget.held + size > budget.limit
        ):
            for data in datas:
                self.data(data)
            return
        self._size += size
        if budget is not None:
            budget.held += size
        self.events += datas

    def _stop(self, bound: str) -> None:
        self.overflow = bound
        self.events = []
        if self._budget is not None:
            self._budget.dropped[bound] += 1
        self.release()

    def release(self) -> None:
        """Give the bytes held back to the budget (again: nothing more)."""
        if self._budget is not None:
            self._budget.held -= self._size
        self._size = 0


# Why a stream stopped at an origin's in-band error event (a continued one's,
# or a continuation's): the origin's answer, not its failure.
ERROR_EVENT: Final = "the origin sent an error event"


def is_error_event(data: bytes) -> bool:
    """An origin's in-band error (`{"error": …}` or vLLM's `{"object": "error", …}`):
    the stream failed, even if the connection stays open."""
    # Nearly every event: one search (find, not `in`: see dataplane.streaming.sse).
    if data.find(b"error", 0, 48) < 0:
        return False
    head = data[:48].lstrip()
    return head.startswith(b'{"error"') or b'"object":"error"' in head.replace(b" ", b"")


@dataclass(slots=True)
class StreamState:
    """What a stream has said so far."""

    id: str = ""
    created: int = 0
    model: str = ""
    object: str = ""
    text: dict[int, str] = field(default_factory=dict)  # per choice index
    finished: set[int] = field(default_factory=set)
    tool_calls: bool = False
    # Reasoning deltas were streamed: they cannot be resent as a prefill.
    reasoning: bool = False
    # Events that carried text: the tokens sent (vLLM sends one token per event).
    tokens: int = 0
    # Events that carried anything generated: text, tool-call arguments or
    # reasoning (a usage the proxy estimates counts them all).
    generated: int = 0
    # The stream's own usage event, if it had one (then it was complete).
    usage: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        """Every choice has its finish reason: only the end of the stream is missing."""
        return bool(self.text) and self.finished >= set(self.text)


def read_state(events: list[bytes], endpoint: str) -> StreamState | None:
    """The state after `events`, or None when an event is not a chunk this
    proxy understands (then the stream is not continued)."""
    state = StreamState()
    for data in events:
        try:
            obj = jsonio.loads(data)
        except jsonio.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        if not state.id:
            state.id = str(obj.get("id", ""))
            created = obj.get("created", 0)
            state.created = created if isinstance(created, int) else 0
            state.model = str(obj.get("model", ""))
            state.object = str(obj.get("object", ""))
        usage = obj.get("usage")
        if isinstance(usage, dict):
            state.usage = usage
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return None
        for choice in choices:
            if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
                return None
            index = choice.get("index", 0)
            piece = _piece(choice, endpoint)
            if piece is None:
                return None
            if piece:
                state.tokens += 1
            state.text[index] = state.text.get(index, "") + piece
            if choice.get("finish_reason") is not None:
                state.finished.add(index)
            delta = choice.get("delta")
            other = False  # generated, but not text
            if isinstance(delta, dict):
                if delta.get("tool_calls"):
                    state.tool_calls = other = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    state.reasoning = other = True
                other = other or bool(delta.get("refusal"))
            if piece or other:
                state.generated += 1
    return state


def _piece(choice: dict[str, Any], endpoint: str) -> str | None:
    if endpoint == COMPLETIONS:
        text = choice.get("text", "")
        return text if isinstance(text, str) else None
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        return None
    content = delta.get("content") or ""
    return content if isinstance(content, str) else None


# Requests whose continuation would not continue the same answer: constrained
# decoding restarts its grammar at the prefill (the joined output would not
# parse), an echoed prompt would be echoed again with the text.
_CONSTRAINED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")  # fmt: skip


def unresumable(body: dict[str, Any]) -> bool:
    """True for a request whose stream cannot be continued whatever was said."""
    if body.get("echo") or any(body.get(name) is not None for name in _CONSTRAINED):
        return True
    response_format = body.get("response_format")
    return isinstance(response_format, dict) and response_format.get("type") != "text"


def not_continued(body: dict[str, Any], state: StreamState) -> str:
    """Why a stream that said `state` cannot be continued whatever the
    origins ("" if it can): the first that holds, for the log."""
    if state.tool_calls:
        return "a tool call was being streamed"
    if state.reasoning:
        return "reasoning was streamed"
    if len(state.text) > 1 or body.get("n", 1) not in (1, None):
        return "the request asked for several choices"
    if body.get("echo"):
        return "the request echoes its prompt"
    if unresumable(body):
        return "the request constrains its output"
    return ""


def continuation_body(
    endpoint: str, body: dict[str, Any], state: StreamState
) -> dict[str, Any] | None:
    """The request for the rest of the answer, or None if it cannot be asked
    (`not_continued` says why, unless the request's own form is the reason:
    a token limit or messages or prompt of a type no origin takes)."""
    if not_continued(body, state):
        return None
    partial = state.text.get(0, "")
    out = copy.copy(body)
    out["stream"] = True
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if limit is None:
            continue
        if not isinstance(limit, int) or isinstance(limit, bool):
            return None
        left = limit - state.tokens
        if left < 1:
            return None  # nothing is left to generate: the caller ends the stream
        out[name] = left
    if not partial:
        return out  # nothing was said yet: the same request again
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        last = messages[-1] if messages else None
        said = last.get("content", "") if isinstance(last, dict) else None
        if (
            body.get("continue_final_message") is True
            and isinstance(last, dict)
            and last.get("role") == "assistant"
            and (said is None or isinstance(said, str))
        ):
            # The client's own prefill: the partial text continues it. A
            # content null or left out is an empty one, as vLLM reads it (a
            # turn of reasoning alone, continued).
            out["messages"] = [*messages[:-1], {**last, "content": (said or "") + partial}]
        else:
            out["messages"] = [*messages, {"role": "assistant", "content": partial}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        return out
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + partial
        return out
    return None


@dataclass(slots=True)
class Splicer:
    """Rewrites one continuation's events into the original stream."""

    state: StreamState
    continued: int  # this is the Nth continuation of the request
    # Tokens the client had when each earlier call started (0 for the first).
    starts: tuple[int, ...]
    # Tokens the client had when this call started: its prompt is the original
    # prompt followed by them.
    before: int

    def rewrite(self, data: bytes) -> bytes | None:
        """The event's data as the client should see it; None drops the event.

        Raises ValueError for an event that is not a chunk (an in-band error
        included): the caller treats it as another cut.
        """
        if is_error_event(data):
            # As the first origin's error event is (review: this one counted
            # against the continuation's health, a request may cause it).
            raise ValueError(ERROR_EVENT)
        obj = jsonio.loads(data)
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("choices"), list)
            or not all(isinstance(c, dict) for c in obj["choices"])
        ):
            raise ValueError("the continuation sent an event that is not a chunk")
        s = self.state
        # A client that got no whole event before the cut has seen nothing to
        # keep: the continuation's own identity and role delta stand.
        seen = bool(s.id)
        if seen:
            obj["id"], obj["created"], obj["model"] = s.id, s.created, s.model
        finishing = False
        choices = []
        for choice in obj["choices"]:
            delta = choice.get("delta")
            if isinstance(delta, dict) and seen:
                delta.pop("role", None)  # the client had the role at the start
            if choice.get("finish_reason") is not None:
                finishing = True
            elif not _says_anything(choice, delta):
                continue
            choices.append(choice)
        obj["choices"] = choices
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self._summed(usage)
            finishing = True
        elif not choices:
            return None
        if finishing:
            obj["ponto"] = {"continued": self.continued}
        return jsonio.dumps(obj)

    def _summed(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt = usage.get("prompt_tokens", 0)
        completion = usage.get("completion_tokens", 0)
        for value in (prompt, completion):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return usage  # not a count this proxy can add to
        # Every call's prompt was the original one plus the text sent before it.
        original = max(0, prompt - self.before)
        out = dict(usage)
        out["prompt_tokens"] = prompt + sum(original + start for start in self.starts)
        out["completion_tokens"] = self.before + completion
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out


def _says_anything(choice: dict[str, Any], delta: object) -> bool:
    if isinstance(delta, dict):
        return any(v not in (None, "", []) for v in delta.values())
    text = choice.get("text")
    return (isinstance(text, str) and bool(text)) or choice.get("logprobs") is not None
