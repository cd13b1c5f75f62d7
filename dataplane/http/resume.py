"""The relay's resume hook: a broken stream goes on at the next origin.

One `Continuations` per relayed stream that may be continued (a streamed
chat or completions request whose tenant allows it). When the relay reports a
cut, it reads what the client has been sent (dataplane.streaming.splice),
asks the next origin that accepts continuations for the rest, and hands the
relay that stream with a Splicer that makes it look like the original one.
It ends the stream cleanly instead when nothing is left to say (every choice
finished, or the token budget spent), and gives up (the relay then writes the
error event) when the stream cannot be continued, the request's limit of
continuations is reached, or no origin answers.

Every origin answer it opens is released when the next one takes over or when
the relay ends (`close`).

A stream that is not continued (its tenant turned continuation off) has
`Finished` instead, which ends a stream cut after the whole answer as
`Continuations` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dataplane import jsonio
from dataplane.http.errors import ApiError
from dataplane.metrics import Metrics
from dataplane.routes import Target
from dataplane.streaming.relay import ERROR_EVENT, STALL_CUTS, Next, OwnEnd
from dataplane.streaming.splice import (
    PROXY_BOUND,
    Splicer,
    StreamState,
    Transcript,
    continuation_body,
    not_continued,
    read_state,
)
from dataplane.streaming.sse import Event
from dataplane.streaming.usage import UsageCounter, asks_usage, with_usage_asked
from dataplane.upstream.forwarder import Forwarder, OriginAnswer, Sent

if TYPE_CHECKING:
    from dataplane.http.pipeline import Exchange

log = logging.getLogger(__name__)

# Not "responses": its events carry sequence numbers, item ids and a final
# response object that a splice does not rewrite, and the origin stores the
# answer it generated, which a continuation elsewhere would not complete.
CONTINUABLE = frozenset({"chat.completions", "completions"})

# The log lines of a stream its origin cut after the client had bytes, one
# per cut (ponto_stream_cuts_total counts the same cuts). The runbooks of
# PontoOriginCuttingStreams quote them (docs/helm.md, the chart's
# PrometheusRule); tests/unit/test_runbook_lines.py holds the quotes to these.
CUT_CONTINUED = "stream cut on %s after %d tokens (%s); continued on %s (%d); %s"
CUT_NOT_CONTINUED = "origin %s cut a stream: %s; not continued: %s; %s"
ENDED_BEFORE_DONE = "origin %s ended its stream after the answer, before [DONE] (%s); ended it; %s"
ENDED_BEFORE_USAGE = (
    "origin %s ended its stream after the answer, before its usage (%s); "
    "ended it with usage estimated; %s"
)
CUT_LINES = (CUT_CONTINUED, CUT_NOT_CONTINUED, ENDED_BEFORE_DONE, ENDED_BEFORE_USAGE)


class _Ended:
    """A stream with nothing left to read (for an ending the proxy writes itself)."""

    async def readany(self) -> bytes:
        return b""


class Continuations:
    """The resume hook (dataplane.streaming.relay.Resume) of one stream."""

    def __init__(
        self,
        ex: Exchange,
        forwarder: Forwarder,
        metrics: Metrics,
        transcript: Transcript,
        origin: OriginAnswer,
        candidates: Sequence[Target],
        limit: int,
    ) -> None:
        self._ex = ex
        self._forwarder = forwarder
        self._metrics = metrics
        self._transcript = transcript
        self._current = origin
        self._candidates = candidates
        self._limit = limit
        self._tried: set[str] = {origin.target.name}
        self._opened: list[OriginAnswer] = []
        # Tokens the client had when each continuation call started.
        self._starts: list[int] = [0]
        self.count = 0  # continuations that took over the stream
        self.calls = 0  # origin calls made for them, failed ones included
        # Prompt tokens of the continuation calls, estimated: the original
        # prompt plus the text sent before each (for accounting without usage).
        self.extra_prompt = 0

    async def __call__(self, cut: str, too_long: int = 0) -> Next | None:
        ex, m = self._ex, self._metrics
        name = self._current.target.name
        m.stream_cuts.labels(name).inc()
        self._current.release()  # the origin's request ends here; its slot frees
        readable = not too_long and not self._transcript.overflow
        state = read_state(self._transcript.events, ex.endpoint.name) if readable else None
        # Nothing left to say: the proxy ends the stream, and the call counts
        # as one that answered (the pipeline counts it "ok"), not also as cut.
        if state is not None and state.done and len(state.finished) >= _choices(ex.body):
            return self._finished(cut, state)
        if state is not None and budget_spent(ex.body, state.tokens):
            end = _length_end(state, ex, ex.estimate + self.extra_prompt, self.count)
            return Next(end, _Ended(), _unchanged, length=True)
        m.attempt(name, "cut_after_start").inc()
        if not too_long and cut != ERROR_EVENT and held_against(ex, cut):
            # Against its health as a 5xx is (Forwarder.stream_cut says which cuts).
            self._forwarder.stream_cut(name, cut)
        if too_long:
            # As for a whole answer past the bound (errors.upstream_too_large):
            # another origin asked the same would make as long an event.
            self._give_up(cut, "another origin would make as long an event")
            return None
        if self._transcript.overflow == PROXY_BOUND:
            self._give_up(cut, "the proxy's streams held --max-transcripts-mb already")
            return None
        if self._transcript.overflow:
            self._give_up(cut, "the answer was too long to keep for a continuation")
            return None
        if state is None:
            self._give_up(cut, "its events could not be read")
            return None
        if self.count >= self._limit:
            self._give_up(cut, f"it was continued {self.count} times already")
            return None
        body = continuation_body(ex.endpoint.name, ex.body, state)
        if body is None:
            why = not_continued(ex.body, state) or "its request cannot be asked in parts"
            self._give_up(cut, why)
            return None
        candidates = [t for t in self._candidates if t.continuation and t.name not in self._tried]
        if not candidates:
            self._give_up(cut, "no other origin accepts continuations")
            return None
        # Asked for its usage as the first call was: the client is shown none
        # of it either way (the relay's trim), and the summed usage counts.
        payload = with_usage_asked(body, None) if ex.usage_added else jsonio.dumps(body)
        headers = self._forwarder.request_headers(ex.headers, ex.request_id, ex.traceparent)
        sent = Sent()
        try:
            answer = await self._forwarder.forward(
                ex.endpoint.upstream_path,
                payload,
                headers,
                candidates,
                stream=True,
                trace=ex.trace,
                sent=sent,
                first_chunk_within=ex.idle_timeout_s,
                tenants_own=ex.idle_timeout_own,
                tenant=ex.principal.tenant,
                model=ex.model,
                max_tokens_added=ex.max_tokens_added,
                plain_body=(lambda: jsonio.dumps(body)) if ex.usage_added else None,
            )
        except asyncio.CancelledError:
            # Its client left while the continuation was being sent: the call
            # is among the request's attempts all the same (the origin saw
            # it), and is charged the prompt it was sent, as one that took
            # over is (none when no call had begun).
            self.calls += sent.calls
            self.extra_prompt += (ex.estimate + state.tokens) * sent.open
            raise
        except ApiError as exc:
            self.calls += exc.attempts
            # The code, not the message: that is the client's sentence
            # ("…; retry shortly."), and the forwarder logged the calls' causes.
            self._give_up(cut, f"the continuation call failed ({exc.code})", outcome="failed")
            return None
        self.calls += answer.calls
        self._opened.append(answer)
        self._tried.add(answer.target.name)
        if not answer.streamed or answer.status != 200:
            answer.release()
            self._give_up(cut, f"{answer.target.name} answered {answer.status}", outcome="failed")
            return None
        self.count += 1
        self._current = answer
        self.extra_prompt += ex.estimate + state.tokens
        splicer = Splicer(state, self.count, tuple(self._starts), state.tokens)
        self._starts.append(state.tokens)
        m.continuations.labels("ok").inc()
        log.info(
            CUT_CONTINUED,
            name, state.tokens, cut, answer.target.name, self.count, ex.request_id,
        )  # fmt: skip
        return Next(answer.first, answer.content, splicer.rewrite, answer.target.name)

    def _finished(self, cut: str, state: StreamState) -> Next:
        """The end of a stream cut after each choice's finish (`finished_end`)."""
        ex = self._ex
        own = finished_end(
            ex, self._current.target.name, cut, _head(state), state.usage is not None,
            state.generated, ex.estimate + self.extra_prompt, self.count,
        )  # fmt: skip
        return Next(own.data, _Ended(), _unchanged, whole=own.whole)

    @property
    def origin(self) -> str:
        """The origin streaming now (the last one continued on)."""
        return self._current.target.name

    @property
    def region(self) -> str:
        """The region of `origin`."""
        return self._current.target.region

    def close(self) -> None:
        """Release every origin answer this hook opened."""
        for answer in self._opened:
            answer.release()

    def _give_up(self, cut: str, why: str, *, outcome: str = "refused") -> None:
        self._metrics.continuations.labels(outcome).inc()
        log.warning(
            CUT_NOT_CONTINUED,
            self._current.target.name, cut, why, self._ex.request_id,
        )  # fmt: skip


class Finished:
    """The relay's `whole` hook (dataplane.streaming.relay.Whole) of a chat or
    completions stream that is not continued (its tenant turned continuation
    off): a cut after each choice's finish ends as `finished_end` says, as a
    continued stream's does, not with the error event after a whole answer.

    It reads the last two events relayed, not a transcript: one choice's
    stream is whole when the last has its finish, or is the usage chunk
    (no choices) after the one that has. Several choices' need the finish
    of each, which the counter collects when it is given a set
    (`UsageCounter.finished`; `counts_finishes`)."""

    __slots__ = ("_counter", "_ex", "_metrics", "_origin")

    def __init__(self, ex: Exchange, counter: UsageCounter, metrics: Metrics, origin: str) -> None:
        self._ex = ex
        self._counter = counter
        self._metrics = metrics
        self._origin = origin

    def __call__(self, cut: str, before: Event | None, last: Event | None) -> OwnEnd | None:
        ex, counter = self._ex, self._counter
        obj = _chunk_of(last)
        if obj is None:
            return None
        choices = _choices(ex.body)
        if choices > 1:
            finished = counter.finished is not None and len(counter.finished) >= choices
        else:
            finished = _finishes(obj) or (obj.get("choices") == [] and _finishes(_chunk_of(before)))
        if not finished:
            return None
        # The call answered (the pipeline counts it "ok"); its stream was cut.
        self._metrics.stream_cuts.labels(self._origin).inc()
        head = {name: obj[name] for name in _HEAD if name in obj}
        return finished_end(
            ex, self._origin, cut, head, counter.usage is not None,
            counter.content_events, ex.estimate, 0,
        )  # fmt: skip


def counts_finishes(body: dict[str, Any]) -> bool:
    """Whether a stream's counter must collect its finish reasons for
    `Finished` (a request of several choices)."""
    return _choices(body) > 1


def held_against(ex: Exchange, cut: str) -> bool:
    """Whether a stream's cut counts against its origin's passive health
    (Forwarder.stream_cut): not a stall past a tenant's own idle bound that is
    shorter than the proxy's (review: a tenant that chose a tight bound for
    fast failover ejected an origin every tenant shares, for gaps other
    tenants' streams wait through)."""
    return not (ex.idle_timeout_shorter and cut.startswith(STALL_CUTS))


def finished_end(
    ex: Exchange,
    origin: str,
    cut: str,
    head: dict[str, Any],
    usage_sent: bool,
    generated: int,
    prompt: int,
    continued: int,
) -> OwnEnd:
    """The end of a stream cut after each choice's finish: `[DONE]`, and
    before it the usage chunk if the client asked for one and the origin
    had not sent it yet, estimated (as for `_length_end`; trial 45: the
    SDK's `usage` stayed None). Only the `[DONE]` missing, the answer is
    the origin's, whole (it may be kept); with a usage the proxy made up,
    not."""
    if usage_sent or not asks_usage(ex.body):
        log.info(ENDED_BEFORE_DONE, origin, cut, ex.request_id)
        return OwnEnd(b"data: [DONE]\n\n", whole=True)
    log.info(ENDED_BEFORE_USAGE, origin, cut, ex.request_id)
    return OwnEnd(_usage_chunk(head, generated, prompt, continued) + b"data: [DONE]\n\n", False)


def _chunk_of(ev: Event | None) -> dict[str, Any] | None:
    """An event's chunk, parsed (None: not a JSON object)."""
    if ev is None or ev.done:
        return None
    obj = jsonio.loads_or_none(ev.data)
    return obj if isinstance(obj, dict) else None


def _finishes(obj: dict[str, Any] | None) -> bool:
    """Whether a chunk of one choice's stream has that choice's finish."""
    choices = obj.get("choices") if obj is not None else None
    return isinstance(choices, list) and any(
        isinstance(c, dict) and isinstance(c.get("finish_reason"), str) for c in choices
    )


_HEAD = ("id", "object", "created", "model")


def _unchanged(data: bytes) -> bytes:
    return data


def _choices(body: dict[str, Any]) -> int:
    """The choices a request asks for: a stream cut after the finish of each
    it has seen is whole only once it has seen them all (an origin may stream
    choices one after the other; review of trial 45's fix)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def budget_spent(body: dict[str, Any], tokens: int) -> bool:
    """Whether `tokens` sent are the whole budget of a request of one choice
    (`max_tokens` counts per choice, and several choices' tokens are summed:
    review 46; several choices are never continued anyway)."""
    n = body.get("n")
    if n is not None and n != 1:
        return False
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return tokens >= limit
    return False


def _length_end(state: StreamState, ex: Exchange, prompt: int, continued: int) -> bytes:
    """The final chunks of a stream whose token budget ran out as it was cut,
    which no origin ends: the finish reason, and the usage chunk if the
    client asked for one (trial 28: none came, and the SDK's `usage` stayed
    None). No origin counted that usage: its prompt is the proxy's estimate
    of every call's (as the proxy's own accounting has it), its completion
    the tokens sent, and it says so (`"ponto": {"usage": "estimated"}`)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if ex.endpoint.name == "completions":
        choice["text"] = ""
    else:
        choice["delta"] = {}
    chunk: dict[str, Any] = {**_head(state), "choices": [choice]}
    if continued:
        chunk["ponto"] = {"continued": continued}
    usage = b""
    if asks_usage(ex.body):
        chunk["usage"] = None  # as every chunk before the usage chunk has it
        usage = _usage_chunk(_head(state), state.generated, prompt, continued)
    return b"data: " + jsonio.dumps(chunk) + b"\n\n" + usage + b"data: [DONE]\n\n"


def _head(state: StreamState) -> dict[str, Any]:
    return {"id": state.id, "object": state.object, "created": state.created, "model": state.model}


def _usage_chunk(head: dict[str, Any], generated: int, prompt: int, continued: int) -> bytes:
    """The usage chunk of a stream the proxy ends, which no origin counted:
    its prompt the proxy's estimate of every call's, its completion the
    events that carried anything generated, and it says so (`"ponto": {"usage": "estimated"}`)."""
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }
    ponto: dict[str, Any] = {"continued": continued} if continued else {}
    chunk = {
        **head,
        "choices": [],
        "usage": usage,
        "ponto": {**ponto, "usage": "estimated"},
    }
    return b"data: " + jsonio.dumps(chunk) + b"\n\n"
