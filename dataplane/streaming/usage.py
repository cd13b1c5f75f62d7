"""Token counts of an answer, for rate-limit settlement and accounting.

Non-streaming answers carry `usage`. A chat or completions stream carries it
only in a final chunk when its request asked for
`stream_options.include_usage`. The proxy asks for it on behalf of a client
that did not (`--origin-stream-usage always`, the default: `with_usage_asked`)
and keeps that chunk from the client (`for_unasked`), so that every stream's
count is the origin's own. A stream that still has none (an origin that sends
no usage, `--origin-stream-usage client`, a stream cut before its usage chunk)
is counted by the events that carried generated text, which is what "the
streamed count" means in docs/rate-limits.md: exact for origins that send one
token per event, short for those that send several (vLLM with
`--stream-interval` or speculative decoding, some hosted APIs).

Responses answers name their counts `input_tokens` and `output_tokens`; a
Responses stream always ends with a `response.completed` event whose
`response.usage` holds them, and its text comes in `"delta": "..."` events.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dataplane import jsonio
from dataplane.ratelimit.tokens import completion_bound, continues_stored
from dataplane.streaming.splice import is_error_event
from dataplane.streaming.sse import Event


def asks_usage(body: dict[str, Any]) -> bool:
    """Whether a request asks for a stream's usage chunk
    (`stream_options.include_usage: true`)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


# What a body without `stream_options` gets after its opening brace.
_ASK_USAGE: Final = b'"stream_options":{"include_usage":true},'


def with_usage_asked(body: dict[str, Any], raw: bytes | None) -> bytes:
    """The bytes of a streamed request `body` for its origin, asking for the
    usage chunk its client did not ask for (the caller knows it did not:
    `asks_usage`). `raw`: `body` as the client sent it, None when the
    proxy changed it (then it is encoded anew, as it would have been).

    The client's other `stream_options` are kept, but vLLM's
    `continuous_usage_stats`, which has no effect without `include_usage`
    and with it would put a usage in every chunk, which the client would
    then get. A body without `stream_options` (nearly every one) costs a
    copy of its bytes with the member inserted after its opening brace (the
    body is a JSON object with members: it names a model); only one that has
    them is encoded again."""
    options = body.get("stream_options")
    if raw is not None and "stream_options" not in body:
        at = raw.find(b"{") + 1
        return raw[:at] + _ASK_USAGE + raw[at:]
    asked = (
        {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        if isinstance(options, dict)
        else {}
    )
    asked["include_usage"] = True
    return jsonio.dumps({**body, "stream_options": asked})


def without_usage_asked(sent: bytes) -> bytes:
    """The client's bytes back from `sent`, what `with_usage_asked` made of
    them by inserting its member (the caller knows it did: a body it was
    given the raw bytes of, without `stream_options`). For an origin that
    refuses the member (rare): the caller keeps `sent` alone, not both."""
    at = sent.find(b"{") + 1
    assert sent.startswith(_ASK_USAGE, at)
    return sent[:at] + sent[at + len(_ASK_USAGE) :]


def for_unasked(data: bytes) -> bytes | None:
    """What a client that did not ask for usage is shown of an event's `data`
    from an origin that was asked for it on its behalf (`with_usage_asked`):
    nothing of the usage chunk (None: a chunk with a usage and no choices),
    and the other chunks without the `"usage": null` that OpenAI (and the
    origin simulator) put in every chunk of such a stream, byte for byte
    otherwise: the stream the client would have had from the origin.

    Dropping the nulls is not needed by the SDKs (their chunk types allow a
    null usage), but what the client gets must not depend on whether the
    proxy asked: a cache replay drops them too (dataplane.cache.entry.
    to_sse_chunks). vLLM sends no such nulls, and nearly every chunk costs a
    substring search; an OpenAI-style chunk a second one, or a parse when its
    usage is not its last member. A usage on a chunk that has choices (an
    origin that puts it on the finishing chunk) is left: the client gets a
    member it did not ask for, which its SDK reads as it would from OpenAI.
    Read by the relay after the counter and the cache's recorder, which see
    the chunk as the origin sent it."""
    if data.find(_USAGE_KEY) < 0:  # find, not `in`: see dataplane.streaming.sse
        return data
    if data.find(b'"usage":null') >= 0 or data.find(b'"usage": null') >= 0:
        return without_usage_null(data)
    return _unasked_parsed(data, jsonio.loads_or_none(data))


def _unasked_parsed(data: bytes, obj: Any) -> bytes | None:
    """for_unasked of `data`, which has a usage key and no null usage, parsed
    as `obj` (None: not JSON)."""
    if isinstance(obj, dict) and obj.get("usage") is not None and not obj.get("choices"):
        return None
    return data


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    exact: bool = False  # from the origin's usage, not counted by the proxy
    # Of the prompt tokens, those the origin's prefix (KV) cache held, when
    # its usage says (`prompt_tokens_details.cached_tokens`, the Responses
    # API's `input_tokens_details`); None when it does not.
    cached_tokens: int | None = None
    # Why the proxy does not believe the origin's figures (a reason of
    # `believed`); "" when it does, or the proxy counted.
    rejected: str = ""

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _from_usage(obj: object) -> Usage | None:
    """The origin's `usage` object read, None when it has no prompt count;
    one whose counts cannot be counts (negative, not integers: trial 65's
    `-5` gave tokens back) is marked rejected (INVALID), for `believed`."""
    if not isinstance(obj, dict):
        return None
    if "prompt_tokens" in obj:
        prompt, completion = obj.get("prompt_tokens"), obj.get("completion_tokens", 0)
        details = obj.get("prompt_tokens_details")
    else:  # the Responses API's names
        prompt, completion = obj.get("input_tokens"), obj.get("output_tokens", 0)
        details = obj.get("input_tokens_details")
    if prompt is None or completion is None:
        return None  # not said: the proxy counts, as without usage
    # A figure that can be a count of tokens is an int (not a bool) of 0 or
    # more: tested in place, not by a call each (every answer's usage).
    if type(prompt) is not int or prompt < 0 or type(completion) is not int or completion < 0:
        return Usage(rejected=INVALID)
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is not None and (
        not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= prompt
    ):
        cached = None
    # Positional (prompt, completion, exact, cached_tokens): keywords cost the call more.
    return Usage(prompt, completion, True, cached)


# Why the proxy did not believe an origin's count (the `reason` of
# ponto_origin_usage_rejected_total; docs/rate-limits.md): a count that is none
# (negative, not an integer), a completion past the request's own bound, or
# far past what the answer holds, a prompt far past what the request holds,
# or a prompt of 0 tokens for a request that has one.
INVALID: Final = "invalid"
PAST_BOUND: Final = "past_max_tokens"
PAST_ANSWER: Final = "past_answer"
PAST_REQUEST: Final = "past_request"
NO_PROMPT: Final = "no_prompt"

# The ceilings are generous on purpose: they refuse absurd figures (trial 65:
# 10**12 tokens, which held a tenant's budget until midnight), never honest
# ones. A token is at least about one byte of text, so an answer's bytes bound
# the tokens it shows; beyond those, each choice may have counted tokens it
# does not show (a reasoning model's), up to HIDDEN_PER_CHOICE (past any
# model's longest output).
HIDDEN_PER_CHOICE: Final = 262_144
# A prompt counts at most two tokens per byte of its request (JSON's quoting
# makes bytes of text, not tokens), plus a chat template's and the origin's
# own system prompt (PROMPT_SLACK), plus per media part (an image's URL or an
# uploaded file's id of 50 bytes may be thousands of tokens: a tiled image,
# a video's frames, a PDF) MEDIA_TOKENS, plus a whole context window when the
# prompt continues one the origin stored (a Responses follow-up).
PROMPT_SLACK: Final = 16_384
MEDIA_TOKENS: Final = 131_072
STORED_CONTEXT: Final = 10_000_000
_MEDIA_MARKERS: Final = (b'"image_url"', b'"input_image"', b'"input_audio"', b'"audio_url"')
# Media whose tokens grow with their length, not their URL's (review: an
# hour of video is some 900k tokens, a long PDF by file id as many): a
# context window each.
_LONG_MEDIA_MARKERS: Final = (b'"input_file"', b'"file"', b'"video_url"')


@dataclass(frozen=True, slots=True)
class Ceilings:
    """The most tokens a request's answer can believably count (`ceilings`)."""

    prompt: int
    completion: int | None  # the request's own bound (max_tokens x n), when stated
    hidden: int  # completion tokens beyond the answer's bytes: HIDDEN_PER_CHOICE x n


def ceilings(
    endpoint: str,
    body: Mapping[str, Any],
    raw: bytes,
    prompt_estimate: int,
    continued_bytes: int = 0,
) -> Ceilings:
    """The ceilings of the answer to a request: `body` parsed from `raw`
    (which a tenant's system prompt may have grown since: `prompt_estimate`,
    of the body as sent, covers it), continued after cuts whose answers came
    to `continued_bytes` in all (each continuation's prompt holds them). Pure;
    counts byte markers, parses nothing."""
    choices = max((v for v in (body.get("n"), body.get("best_of")) if type(v) is int), default=1)
    media = sum(raw.count(marker) for marker in _MEDIA_MARKERS)
    prompt = 2 * (len(raw) + 4 * prompt_estimate + continued_bytes) + PROMPT_SLACK
    prompt += media * MEDIA_TOKENS
    # find, not in: on Python 3.11 `marker in raw` first tries the marker as a
    # byte's value and makes and clears a TypeError, some 1,100 instructions more.
    if continues_stored(endpoint, body) or any(raw.find(m) >= 0 for m in _LONG_MEDIA_MARKERS):
        prompt += STORED_CONTEXT
    elif endpoint == "responses" and body.get("tools"):
        # Hosted tools (web search, file search, MCP) add their results to
        # the prompt the origin counts (review: o3 with web_search, 65k).
        prompt += STORED_CONTEXT
    # Predicted Outputs: the predicted tokens rejected count as completion,
    # past max_tokens (review).
    bound = None if "prediction" in body else completion_bound(endpoint, body)
    return Ceilings(prompt, bound, HIDDEN_PER_CHOICE * max(1, choices))


def within_floors(usage: Usage, raw_size: int, answer_bytes: int, bound: int | None) -> bool:
    """Whether `believed` takes `usage` as it is, whatever else the request
    holds: its counts are under the least ceilings any request of `raw_size`
    bytes can have (no media, nothing stored, one choice, nothing continued,
    a prompt estimated at 0 tokens), and its prompt is some tokens, with
    `bound` its completion_bound. A few comparisons, the common case's
    whole check: `ceilings` counts the request's markers, and the caller
    estimates the prompt, only when it is not (every answer came through
    it, about 6 us a request)."""
    prompt = usage.prompt_tokens
    return (
        not usage.rejected
        and 0 < prompt <= 2 * raw_size + PROMPT_SLACK
        and usage.completion_tokens <= answer_bytes + HIDDEN_PER_CHOICE
        and (bound is None or usage.completion_tokens <= bound)
    )


def believed(
    usage: Usage,
    ceilings: Ceilings,
    answer_bytes: int,
    prompt_estimate: int,
    completion_estimate: int,
) -> tuple[Usage, str]:
    """`usage`, an origin's, as the proxy believes it, and why it did not
    (a reason above; "" when it did). A count that is none stands for nothing:
    the proxy's own (`prompt_estimate`, `completion_estimate`: its count of a
    stream, its estimate of a whole answer) stand instead. A completion past
    the request's bound is clamped to it; one past the answer's `answer_bytes`
    and its hidden allowance, which no honest origin sends, is the proxy's
    estimate; so is a prompt past its ceiling, and a prompt of 0 tokens when
    the request's estimate is more. The reason is the first found."""
    if usage.rejected:
        return Usage(prompt_estimate, completion_estimate), usage.rejected
    why = ""
    prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    bound = ceilings.completion
    if bound is not None and completion > bound:
        completion, why = bound, PAST_BOUND
    elif completion > answer_bytes + ceilings.hidden:
        completion, why = completion_estimate, PAST_ANSWER
    if prompt > ceilings.prompt:
        prompt, why = prompt_estimate, why or PAST_REQUEST
    elif not prompt and prompt_estimate:
        # A prompt of some tokens counted as none: old llama.cpp builds' rerank
        # and embeddings usage ("TODO: fill"), Ollama's for a prompt it had
        # cached. Charged nothing, a tenant's every such request was free.
        prompt, why = prompt_estimate, why or NO_PROMPT
    if not why:
        return usage, ""
    if cached is not None:
        cached = min(cached, prompt)
    # A prompt the proxy estimated is its own count: the continuations' prompts
    # are then added to it (pipeline.spent), as for any count of its own.
    exact = usage.exact and prompt == usage.prompt_tokens
    return Usage(prompt, completion, exact, cached), why


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


def rerank_usage_of(obj: object) -> Usage | None:
    """The usage of a rerank answer parsed (usage_of's, for Jina's API):
    vLLM's and Jina's `usage` holds only `total_tokens`, every token the
    query and documents came to, all of them prompt (a rerank generates
    nothing); llama.cpp's also `prompt_tokens`, read as usage_of reads it.
    None when it has neither."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict) or "prompt_tokens" in usage:
        return _from_usage(usage)
    total = usage.get("total_tokens")
    if total is None:
        return None
    if type(total) is not int or total < 0:  # as _from_usage tests a count
        return Usage(rejected=INVALID)
    return Usage(total, 0, exact=True)


# A delta with generated text, in compact or spaced JSON: content, text,
# tool-call arguments, Responses' deltas (response.output_text.delta and its
# kin), and (trial 71: a cut reasoning stream was charged nothing) reasoning
# (vLLM's and DeepSeek's reasoning_content, Ollama's and OpenRouter's
# reasoning), a refusal and a custom tool call's input. An empty string (the
# role chunk that opens every chat stream) is not text: the byte after the
# opening quote must not be the closing one. A compact content delta, most
# events of most streams, is found by one search; the rest by one regex.
_CONTENT = b'"content":"'
_CONTENT_SIZE: Final = len(_CONTENT)  # a constant, not two len() calls an event
_TEXT = re.compile(
    rb'"(?:content|text|arguments|delta|reasoning_content|reasoning|refusal|input)": ?"[^"]'
)


# A choice's finish_reason (OpenAI's values are short lowercase words).
FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]{1,64})"')


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

    __slots__ = (
        "_keyless",
        "_null",
        "_parsed",
        "content_events",
        "error_event",
        "event_bytes",
        "finished",
        "finishes",
        "usage",
    )

    def __init__(
        self, finishes: list[bytes] | None = None, finished: set[int] | None = None
    ) -> None:
        self.content_events = 0
        # The stream carried an in-band error event (`event: error`, or an
        # error object): its end is then no origin's failure to hold against
        # it (Forwarder.stream_cut; a request may cause it).
        self.error_event = False
        self.event_bytes = 0  # of the events' data: what bounds a believable count
        self.usage: Usage | None = None
        self.finishes = finishes
        self.finished = finished
        # The data of the last event counted, when it has no "usage" key
        # (None otherwise): `unasked` need not search it again; and the last
        # parsed for its usage, with what it parsed to: nor parse it again.
        self._keyless: bytes | None = None
        self._parsed: tuple[bytes, Any] | None = None
        # The data of the last event counted with a null usage (OpenAI's,
        # in every chunk of a stream asked for usage): `unasked` cuts it
        # without searching for it again.
        self._null: bytes | None = None

    def event(self, ev: Event) -> None:
        data = ev.data
        self.event_bytes += len(data)
        if ev.done and not ev.name:
            # `[DONE]`, every stream's last event: no usage, no text, no
            # error, no finish; its bytes count, as any event's.
            self._keyless = data
            return
        # Not `in` (see dataplane.streaming.sse), nor find, which parses a
        # tuple of its arguments: partition takes one, and gives back `data`
        # and two empty bytes when it is not found (nearly every event: only
        # the usage chunk has the key), copying nothing.
        if not data.partition(b'"usage"')[1]:
            self._keyless = data
        else:
            self._keyless = None
            if data.find(b'"usage":null') < 0 and data.find(b'"usage": null') < 0:
                obj = jsonio.loads_or_none(data)
                self._parsed = (data, obj)
                found = None if b'"estimated"' in data and _estimated(obj) else usage_of(obj)
                if found is not None:
                    self.usage = found
            else:
                self._null = data
        # Whether it has text (_CONTENT, then _TEXT), inline: this runs for
        # every event. 0x22 is the closing quote of an empty string.
        end = data.find(_CONTENT) + _CONTENT_SIZE
        if (_CONTENT_SIZE <= end < len(data) and data[end] != 0x22) or _TEXT.search(data):
            self.content_events += 1
        elif ev.name == b"error" or is_error_event(data):
            self.error_event = True
        finishes, finished = self.finishes, self.finished
        if (finishes is not None or finished is not None) and data.find(b'"finish_reason"') >= 0:
            reasons = FINISH_REASON.findall(data)
            if finishes is not None:
                finishes += reasons
            if reasons and finished is not None:
                finished.update(_finished_choices(data))

    def datas(self, datas: list[bytes]) -> None:
        """`event` of an unnamed event of each of `datas`, in order (a
        DataSink's: the relay gives a read's plain events so), which is not
        `[DONE]` and holds no `"usage"` key but in a null usage: only its
        bytes, its text and its finish are looked at, one call a read."""
        self.event_bytes += sum(map(len, datas))
        # As `event` leaves them for `unasked` of the last one.
        last = datas[-1]
        if last.find(_USAGE_KEY) < 0:
            self._keyless = last
        else:
            self._keyless, self._null = None, last
        finishes, finished = self.finishes, self.finished
        content_events = self.content_events
        for data in datas:
            # `event`'s text test, as there.
            end = data.find(_CONTENT) + _CONTENT_SIZE
            if (_CONTENT_SIZE <= end < len(data) and data[end] != 0x22) or _TEXT.search(data):
                content_events += 1
            elif is_error_event(data):
                self.error_event = True
            if (finishes is not None or finished is not None) and data.find(
                b'"finish_reason"'
            ) >= 0:
                reasons = FINISH_REASON.findall(data)
                if finishes is not None:
                    finishes += reasons
                if reasons and finished is not None:
                    finished.update(_finished_choices(data))
        self.content_events = content_events

    def data(self, data: bytes) -> None:
        """`datas([data])`, one call and no list (a DataSink's: the relay
        gives a read of one plain event so). Its body is `datas`'s loop's,
        for one: a twin kept for speed, as `datas` is `event`'s (their common
        part, text, error and finish, as a method of its own costs a call an
        event: bench.relay_loop, vllm, one event a read, 29,618 -> 30,001
        instructions an event, review 433)."""
        self.event_bytes += len(data)
        if not data.partition(_USAGE_KEY)[1]:  # not find: see `event`
            self._keyless = data
        else:
            self._keyless, self._null = None, data
        end = data.find(_CONTENT) + _CONTENT_SIZE
        if (_CONTENT_SIZE <= end < len(data) and data[end] != 0x22) or _TEXT.search(data):
            self.content_events += 1
        elif is_error_event(data):
            self.error_event = True
        finishes, finished = self.finishes, self.finished
        if (finishes is not None or finished is not None) and data.find(b'"finish_reason"') >= 0:
            reasons = FINISH_REASON.findall(data)
            if finishes is not None:
                finishes += reasons
            if reasons and finished is not None:
                finished.update(_finished_choices(data))

    def unasked(self, data: bytes) -> bytes | None:
        """`for_unasked(data)`, a Trim: for the event this counter was given
        last (the relay gives its readers an event before its trim), without
        a second search for a usage key it has none of, nor a second parse of
        a usage it parsed; any other data is searched as for_unasked
        searches it."""
        if data is self._keyless:
            return data
        # A null usage last (vLLM's place, the origin simulator's), its key
        # found once (at its place): without_usage_null's first cut, made
        # here without for_unasked's calls and searches (the relay asks this
        # of every plain event of a read that holds one). A slice: endswith
        # parses its arguments, and this is asked of OpenAI's chunks too.
        if data[-14:] == _LAST_USAGE_NULL and data.find(_USAGE_KEY) == len(data) - 13:
            return data[:-14] + b"}"
        # for_unasked's of a null usage (OpenAI's, before its obfuscation
        # string: each plain event of a read that holds one), without its call.
        if data is self._null or data.find(_NULL_USAGE) >= 0:
            return without_usage_null(data)
        parsed = self._parsed
        if parsed is not None and parsed[0] is data:
            return _unasked_parsed(data, parsed[1])
        return for_unasked(data)

    def result(self, prompt_estimate: int) -> Usage:
        """The origin's own count if it sent one (as it sent it: `believed`
        judges it), else the estimate and the events."""
        if self.usage is not None and not self.usage.rejected:
            return self.usage
        return Usage(prompt_estimate, self.content_events)


_USAGE_KEY = b'"usage"'
_NULL_USAGE = b'"usage":null'
_LAST_USAGE_NULL = b',"usage":null}'  # 14 bytes, its key 13 from the end
# OpenAI's place for it: before the `obfuscation` string that ends each chunk.
_NULL_MEMBER = b'"usage":null,'
_NULL_BEFORE_OBFUSCATION = _NULL_MEMBER + b'"obfuscation":"'
_NULL_VALUE = re.compile(rb"\s*:\s*null\s*")
_COMMA_AFTER = re.compile(rb",\s*")
_COMMA_BEFORE = re.compile(rb",\s*$")


def without_usage_null(payload: bytes) -> bytes:
    """`payload` (a stored chunk: one JSON object) without its top-level
    `"usage": null` member, byte for byte otherwise; unchanged when it has
    none, or when `"usage"` appears in it more than once (a usage key nested
    in a choice too: rare, and left whole rather than parsed further).

    Exact: the parsed object has the member at the top, and the payload holds
    `"usage"` once, so that is its key, unless the key is spelt with escapes
    (`"\\u0075sage"`): then the cut is checked to leave the object without it.
    Costs a substring search per chunk, and a parse for the chunks that have
    the key elsewhere than last or before OpenAI's last member (its
    `obfuscation` string). Never raises: a payload that is not JSON (an
    origin's, through `for_unasked`) is left as it came, but for those two
    places, which are cut unparsed."""
    at = payload.find(_USAGE_KEY)
    if at < 0 or payload.find(_USAGE_KEY, at + 1) >= 0:
        return payload
    if payload.endswith(_LAST_USAGE_NULL):
        # Last before the closing brace, after a comma (vLLM's place for it):
        # the top's member, whatever came before.
        return payload[: -len(_LAST_USAGE_NULL)] + b"}"
    value = at + len(_NULL_BEFORE_OBFUSCATION)
    if (
        payload.startswith(_NULL_BEFORE_OBFUSCATION, at)
        and payload.endswith(b'"}')
        and payload[at - 1 : at] in (b",", b"{")
        and payload.find(b'"', value, len(payload) - 2) < 0
        and payload.find(b"\\", value) < 0
        and payload.find(b"\\u") < 0
    ):
        # Followed by the object's last member, a string without escapes:
        # the top's member (a key opens after a comma or a brace, not inside
        # a string), as the parse below finds it (no key spelt with escapes).
        return payload[:at] + payload[at + len(_NULL_MEMBER) :]
    return _null_cut_parsed(payload, at)


def _null_cut_parsed(payload: bytes, at: int) -> bytes:
    """without_usage_null of `payload`, whose one `"usage"` is at `at`, by a
    parse; a payload that is not JSON (an origin's malformed chunk, relayed
    through `for_unasked`) is left as it came, not raised on: the relay's
    trim runs outside any handler of an origin's bytes."""
    obj = jsonio.loads_or_none(payload)
    if not isinstance(obj, dict) or "usage" not in obj or obj["usage"] is not None:
        return payload
    value = _NULL_VALUE.match(payload, at + len(_USAGE_KEY))
    if value is None:  # the one "usage" is not the top's key (spelt with escapes)
        return payload
    start, end = at, value.end()
    if (comma := _COMMA_AFTER.match(payload, end)) is not None:
        end = comma.end()
    elif (before := _COMMA_BEFORE.search(payload, 0, start)) is not None:
        start = before.start()
    cut = payload[:start] + payload[end:]
    if b"\\u" in payload and not _is_cut_of_usage(cut, obj):
        return payload  # the one "usage" was not the top's: its key is spelt with escapes
    return cut


def _is_cut_of_usage(cut: bytes, obj: dict[str, Any]) -> bool:
    """Whether `cut` is `obj` without its top-level usage member."""
    try:
        rest = jsonio.loads(cut)
    except jsonio.JSONDecodeError:  # the "usage" cut ended a longer key (`"a \\"usage"`)
        return False
    return bool(rest == {k: v for k, v in obj.items() if k != "usage"})
