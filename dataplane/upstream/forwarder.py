"""Calling origins: ordered failover until one commits to an answer.

Contract: an attempt may be retried on the next candidate only while nothing can
have reached the client: connect error, 5xx, a refusal of the proxy's own
credential (401, 403, 407: the client's request was fine, another origin may
take it) or account (402), timeout (the origin's own too: 408), or a cut
before the whole body (non-streaming) or the first chunk (streaming) arrived.
`forward` returns the committed answer without writing anything; the caller
relays it (`dataplane.streaming.relay`) and releases it. What failed is
logged here, in one WARNING line per request with its id, whether another
origin then answered or none did; the client learns only a fixed message
(dataplane.http.errors).

Hedging (off unless the caller asks): when the first attempt has not committed
after a delay, the same request goes to the next candidate as well, and the
first of the two to commit answers; see `Forwarder.forward`.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import math
import re
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from dataplane import jsonio
from dataplane.http.errors import (
    CREDENTIAL_REFUSED,
    MAX_ORIGIN_ERROR_BYTES,
    UPSTREAM_FAILED,
    UPSTREAM_GATEWAY_REFUSED,
    UPSTREAM_SLOW,
    UPSTREAM_UNANSWERED,
    UPSTREAM_UNAVAILABLE,
    endpoint_not_served,
    error_blame,
    model_not_found,
    origin_busy,
    origin_error_of,
    upstream_busy,
    upstream_error_answer,
    upstream_timeout,
    upstream_too_large,
    upstream_unavailable,
)
from dataplane.linebudget import LineBudget
from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.placement.speed import output_tokens
from dataplane.routes import Target
from dataplane.streaming.opening import Opening, only_done
from dataplane.timer import Deadlines
from dataplane.upstream.credentials import CredentialError
from dataplane.upstream.hedge import AUTO, CommitTimes, HedgeSetting, hedge_budget
from dataplane.upstream.outlier import OutlierDetector, RetryBudget
from dataplane.upstream.stalls import NO_WATCH, CallWatch, NoWatch, Stalled, Stalls
from dataplane.upstream.wire import (
    DEFAULT_MAX_ANSWER_BYTES,
    LIMIT_PER_HOST,
    QUEUE_TIMEOUT,
    AnswerTooLarge,
    OriginFull,
    OriginResponse,
    OriginWire,
    head_line,
)
from ponto.logs import ThrottledBy

if TYPE_CHECKING:
    from dataplane.telemetry.tracing import RequestTrace

log = logging.getLogger(__name__)

# Never copied from an origin's response: hop-by-hop headers, those the proxy
# recomputes for the body it sends, and those about the operator's account
# with the origin or the origin's own host rather than this answer. A hosted
# API's `openai-organization` and `openai-project` name the operator's
# account, its `x-ratelimit-*` that account's limits (a client sees its own,
# dataplane.ratelimit, or none), as do the IETF draft's `ratelimit-*` and
# Anthropic's `anthropic-ratelimit-*` (all dropped by prefix,
# DROP_RESPONSE_PREFIXES). An origin's `alt-svc` and
# `strict-transport-security` would bind the proxy's host to the origin's
# protocols and TLS policy, and its `access-control-*` (TGI allows any origin)
# would stand for the proxy's --cors-origins (review 46). Its
# `www-authenticate` challenges for the origin's realm, not the proxy's: a
# client authenticates to the proxy (trial 65 saw `Bearer realm=internal`).
DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "set-cookie",
        "openai-organization",
        "openai-project",
        "anthropic-organization-id",
        "alt-svc",
        "strict-transport-security",
        "www-authenticate",
    }
)
DROP_RESPONSE_PREFIXES = ("x-ratelimit", "ratelimit", "anthropic-ratelimit", "access-control-")
# The only request headers sent on to an origin. The client's Authorization is
# never among them: client keys stay at the edge. Content-Type is not the
# client's: the proxy sends the JSON it parsed. A client's W3C trace context
# goes on as it came when the proxy does not trace (a gateway must not break
# the client's trace); when it traces, each call carries its own span's instead
# (dataplane.telemetry.tracing.AttemptSpan.inject); a request it knows
# unsampled without a span carries a new unsampled traceparent and no
# tracestate (RequestTracer.unsampled_root).
FORWARD_REQUEST_HEADERS = ("accept", "user-agent", "traceparent", "tracestate")
# Never forwarded, even when configured in `forward_headers` (naming one
# stops the proxy at start, dataplane.settings): hop-by-hop headers (RFC 9110
# 7.6.1) describe the client's connection, not the origin's; the others the
# proxy sets itself (the body goes decoded, so the client's Content-Encoding
# would misname it; the origin's credential, never the client's).
NEVER_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "authorization",
        "cookie",
        "x-request-id",
    }
)
# What the proxy sends stays far under the 8 KB request-header limit of
# common origin servers (nginx, vLLM's uvicorn/h11 at 8 KB per line or in all),
# whatever the client sent: a User-Agent is cut to MAX_FORWARDED_VALUE bytes,
# another value over it is dropped (cutting it would change its meaning),
# and headers past MAX_FORWARDED_TOTAL in all are dropped.
MAX_FORWARDED_VALUE = 512
MAX_FORWARDED_TOTAL = 2048
RETRY_STATUS_MIN = 500
# An origin too busy for the request, or a hosted API's operator account over
# its quota: another origin may take it. Refused by every origin tried, the
# client gets a 429 to come back after (errors.upstream_busy), not a 502.
BUSY = 429
# A busy origin's wait: its Retry-After, 1 s without one, at most a minute
# (an origin's clock or its daily quota must not tell every client to stay
# away for hours). The client is told the soonest wait of the origins tried;
# the origin goes last for its wait, within the outlier detector's cap (30 s).
BUSY_DEFAULT_S = 1.0
BUSY_MAX_S = 60.0
# A request no origin served is logged once per this long per set of origins
# tried (Forwarder._tell), with the count of those not logged. The sets are
# kept up to ThrottledBy's bound, the one told longest ago forgotten past it.
UNSERVED_EVERY_S = 10.0
# An origin (or a proxy in front of it) that gave up waiting for the request
# (RFC 9110: it did not receive the whole request in time): it generated
# nothing, and another origin may well take it, as after a timeout; passed
# on, the client got its 408 after one attempt (trial 51).
ORIGIN_TIMED_OUT = 408
# An origin that wants payment refuses the operator's account (its credit or
# billing), not the client's request: the client cannot fix it, another
# origin (another account or provider) may take it, and with none left it is
# a 502 like a refused credential. Passed on, the SDK raised an error telling
# the client to pay, and no other origin was tried (trial 51).
PAYMENT_REQUIRED = 402
# TGI's and TEI's answer when their model backend failed (a shard that died,
# CUDA out of memory: their ErrorType::Backend, InferError::GenerationError):
# the origin's failure, as a 5xx. Passed on as a 4xx (trial 79), the client
# got a 424 after one attempt, no other origin was asked, and the replica
# stayed in rotation failing every request.
BACKEND_FAILED = 424
BAD_REQUEST = 400
# An origin that redirects a POST is misconfigured (its base URL wants https,
# or a trailing slash): its answer is not one, and following it would resend
# the prompt, or for 301 and 302 drop it. Refused like a 5xx, with the
# Location in the operator's log line.
REDIRECTS = range(300, 400)
# The least status `_refuse` refuses (a redirect's): those under it answer.
MIN_REFUSED_STATUS: Final = REDIRECTS.start


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    connect_timeout: float = 2.0
    # Longest wait for response headers and, on streams, between chunks. A
    # non-streaming origin sends headers only when it has generated everything.
    read_timeout: float = 300.0
    max_attempts: int = 3
    # Whole-request budget across all attempts before the response starts.
    deadline: float = 600.0
    # Client headers sent on to origins besides FORWARD_REQUEST_HEADERS.
    forward_headers: tuple[str, ...] = ()
    # A CA bundle trusted for https origins besides the system's
    # (ponto.originca), and the context made of it when the flags were read.
    origin_ca: str = ""
    origin_ssl: ssl.SSLContext | None = field(default=None, compare=False, repr=False)
    # See DEFAULT_MAX_ANSWER_BYTES.
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    # Longest wait for a stream's first chunk (--first-chunk-timeout); None:
    # the stream's idle timeout, as the caller passes it.
    first_chunk_timeout: float | None = None
    # Connections to one origin (--max-origin-connections), one tenant's
    # calls under way to it (--max-origin-connections-per-tenant; 0: half of
    # the connections), and the longest wait for a connection at the cap
    # (--origin-queue-timeout): OriginWire's limit_per_host, share_limit and
    # queue_timeout.
    max_origin_connections: int = LIMIT_PER_HOST
    max_origin_connections_per_tenant: int = 0
    origin_queue_timeout: float = QUEUE_TIMEOUT

    @property
    def tenant_share(self) -> int:
        """One tenant's calls under way to one origin at most: the setting, or
        half of the connections (at least 1), so that one tenant's streams
        leave the other half to the rest."""
        return self.max_origin_connections_per_tenant or max(1, self.max_origin_connections // 2)


# The outcome of a whole answer longer than max_answer_bytes.
TOO_LARGE: Final = "too_large"
# The outcome of a 2xx whole answer that is an error and no answer (_answer_object).
ERROR_ANSWER: Final = "error_answer"
# The outcome of a 404 that says the origin lacks the request's model, which
# the route table lists it for (_check_not_found).
MODEL_MISSING: Final = "model_missing"
# The outcome of a 501 Not Implemented: the origin does not serve the
# request's endpoint for its model (llama.cpp started without --embeddings,
# Ollama, each asked for embeddings of a chat model).
NOT_SERVED: Final = "not_implemented"
NOT_IMPLEMENTED: Final = 501
# The outcomes of a call that got no connection (wire.OriginFull), by its `why`:
# none came free within --origin-queue-timeout, or the tenant held its share.
# Never sent: the next origin is tried, and neither counts against the origin.
FULL_OUTCOMES: Final = {"queue": "origin_busy", "share": "tenant_share"}


class _Retryable(Exception):
    """A failed call another origin may take (but for TOO_LARGE): its outcome
    (the metrics' label) and, when the origin answered, its status. `worked`
    is False when the origin surely spent nothing on the request: it was never
    sent (no connection, no credential) or was refused before any inference
    (a 429, a redirect, the proxy's credential refused)."""

    def __init__(
        self,
        outcome: str,
        detail: str,
        status: int | None = None,
        retry_after: str = "",
        *,
        worked: bool = True,
        shown: dict[str, str | None] | None = None,
        blame: str = "",
    ) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.status = status
        self.retry_after = retry_after  # a busy origin's Retry-After, as sent
        self.worked = worked
        # An ERROR_ANSWER's error, as a client may see it (errors.origin_error_of),
        # and whose fault it is (errors.error_blame).
        self.shown = shown
        self.blame = blame


class OriginAnswer:
    """An origin that has committed to answer: its status and headers, and either
    its whole body (`body`) or, for a stream, its first chunk (`first`) with the
    rest still to read from `content`.

    The caller relays it and then calls `release()`, which returns the
    connection to the pool when the body was read to the end and closes it
    otherwise (which also cancels generation on the origin when the client
    has gone), and ends the request in the origin's outstanding count.

    `calls` counts every origin call the forward made, this one included
    (failed attempts, a hedge that lost or won): what the access log and the
    request span report as attempts. `hedged` is True when the answer came
    from a hedge (the second copy of the request). `extra_calls` counts the
    other calls of this request that were sent and then cancelled because
    this one answered first (0 or 1): the origin spent that call's prompt
    tokens, and the caller may account them. `others_worked`: an attempt
    before it (or a hedge beside it) failed after its origin may have done
    work (_Retryable.worked); told, not billed: an error answer charges
    nothing (billing trial 76, pipeline.respond).
    """

    __slots__ = (
        "_ended",
        "_loads",
        "_resp",
        "attempt",
        "body",
        "calls",
        "extra_calls",
        "first",
        "headers",
        "hedged",
        "others_worked",
        "parsed",
        "status",
        "streamed",
        "target",
    )

    def __init__(
        self,
        target: Target,
        attempt: int,
        status: int,
        headers: CIMultiDict[str],
        body: bytes | None,
        first: bytes,
        resp: OriginResponse,
        loads: LoadBoard | None = None,
        parsed: Any = jsonio.NOT_PARSED,
    ) -> None:
        # A plain slotted class, not a dataclass: one is made every request,
        # and a dataclass's __init__ took each field as an argument with a
        # default (some 5,400 instructions against 4,100, callgrind on a loop).
        self.target = target
        self.attempt = attempt
        self.status = status
        self.headers = headers
        self.body = body
        # A stream (`body` None), as a slot: read three times a request, where
        # a property is a Python call each (some 640 instructions, callgrind).
        self.streamed = body is None
        self.first = first
        self._resp = resp
        self._loads = loads
        self.calls = 1
        self.hedged = False
        self.extra_calls = 0
        self.others_worked = False
        self._ended = False
        # A 2xx whole body, parsed by the forwarder; NOT_PARSED when it was not
        # (another status, a stream, or too large to parse before sending).
        self.parsed = parsed

    @property
    def content(self) -> aiohttp.StreamReader:
        return self._resp.content

    def ended(self) -> None:
        """The client has the whole answer (a stream's last event), though the
        origin's body may not have ended: `release` lets the connection wait
        a moment for that end instead of closing it."""
        self._ended = True

    def release(self) -> None:
        self._resp.release(ended=self._ended)
        loads, self._loads = self._loads, None
        if loads is not None:
            loads.finished(self.target.name)


# What bounds a stream's wait for its first chunk by default, for the log.
_IDLE_BOUND = "the stream idle timeout"


class _Tries:
    """One request's attempts so far, shared by the race and the failover loop.

    A plain slotted class, not a dataclass: one is made every request, and
    a dataclass's __init__ took each of its 26 fields as an argument with a
    default (some 9,100 instructions against 4,700, callgrind on a loop). A
    field added is added to __slots__ too."""

    __slots__ = (
        "backend_failed",
        "busy",
        "busy_retry_s",
        "deadline",
        "errored",
        "failed",
        "failures",
        "first_bound",
        "first_within",
        "full",
        "inputs",
        "lined",
        "made",
        "max_tokens_added",
        "method",
        "model",
        "model_missing",
        "not_served",
        "not_served_said",
        "past_deadline",
        "plain_body",
        "refused",
        "shown",
        "tenant",
        "timed_out",
        "too_large",
        "unreached",
        "unsent",
        "worked",
    )

    def __init__(
        self,
        deadline: float,
        method: str | None = None,
        tenant: str = "",
        model: str = "",
        max_tokens_added: bool = False,
        plain_body: Callable[[], bytes] | None = None,
        inputs: int = 0,
        lined: tuple[CIMultiDict[str], bytes] | None = None,
    ) -> None:
        self.deadline = deadline  # loop time
        self.failures: list[str] = []
        self.made = 0
        self.past_deadline = False
        # Some origin answered 429 (BUSY): the soonest any of them asked to be
        # tried again (busy_wait_s), None while none answered 429; and how many did.
        self.busy_retry_s: float | None = None
        self.busy = 0
        # An origin's whole answer was longer than max_answer_bytes: no other
        # origin is tried (the same request would make as long an answer).
        self.too_large = False
        # Attempts that failed (each origin's failure, not "retry budget
        # exhausted"): those an origin answered with a 5xx, those that timed out
        # once sent before the answer began, those never sent (no connection, no
        # credential): which the 502 says (_what_failed).
        self.failed = 0
        self.errored = 0
        self.timed_out = 0
        self.unreached = 0
        # Of those, the ones whose origin refused the proxy's own credential or
        # account (a 402).
        self.refused = 0
        # A stream's first chunk is due within this many seconds of the call (its
        # idle timeout), else the next origin is tried; None: the read timeout.
        self.first_within: float | None = None
        self.first_bound = _IDLE_BOUND  # what first_within is, for the log
        # Some failed attempt may have cost its origin work (_Retryable.worked, or
        # past the deadline); told, not billed: a 502 charges nothing (trial 76).
        self.worked = False
        # The error of the last 2xx answer that was one (ERROR_ANSWER) and could
        # be shown: the 502's, when no origin answered.
        self.shown: dict[str, str | None] | None = None
        # The method of a call to a path made for this request (a stored
        # response's: dataplane.http.stored), which no URL cache keeps; None:
        # the usual POST to an endpoint's fixed path.
        self.method = method
        # Whose calls these are: the share of origins' connections they count in.
        self.tenant = tenant
        # Attempts that got no connection (FULL_OUTCOMES): when every failed
        # attempt did, the client is told to come back (errors.origin_busy).
        self.full = 0
        # The last failed attempt was one of those: never sent.
        self.unsent = False
        # The model the request names, as sent (a 404 saying an origin lacks it
        # is that origin's misconfiguration); "" when not known.
        self.model = model
        # Attempts whose origin answered that it lacks the model (MODEL_MISSING).
        self.model_missing = 0
        # Attempts whose origin answered 501 (NOT_SERVED), and what the last of
        # them said (its error's message; "" when it gave none).
        self.not_served = 0
        self.not_served_said = ""
        # The origins that answered 424 (BACKEND_FAILED), each with what it said:
        # against their health only once another origin has answered the request
        # (forward), as a 424 may be the request's own doing.
        # (A tuple: no list made for each request.)
        self.backend_failed: tuple[tuple[str, str], ...] = ()
        # The body's `max_tokens` is the proxy's (the tenant's ceiling or default),
        # not the client's: sent in each origin's own field (Target.max_tokens_field).
        self.max_tokens_added = max_tokens_added
        # The body as the client's request made it, when the one sent adds
        # `stream_options.include_usage` for the proxy's count (forward's
        # `plain_body`); sent instead to an origin that refuses the member.
        self.plain_body = plain_body
        # A batch request's items, which its answer must account for (forward's
        # `inputs`): an embeddings request's inputs, a rerank's documents; 0: not
        # counted.
        self.inputs = inputs
        # The request's headers and their lines in its head (forward's `lines`):
        # the lines stand for those headers alone, not a copy an attempt changed.
        self.lined = lined


class _StreamOptionsRefused(Exception):
    """An origin answered 400 naming `stream_options`, which the proxy had
    added: the call is made again without it (Forwarder._call)."""


@dataclass(slots=True)
class Sent:
    """What `Forwarder.forward` had sent when it was cancelled (its client
    left, or the proxy stopped) before an origin answered: the calls made and
    the origin of the last, for the request's record; and of those, the ones
    still under way (`open`: not failed, so each may have cost its origin
    the prompt's prefill): 1, or 2 when a hedge ran beside the first call;
    0 when none had begun."""

    calls: int = 0
    target: Target | None = None
    open: int = 0


class Forwarder:
    """Sends a request to origins in order. One per app; safe for concurrent use
    on its event loop."""

    def __init__(
        self,
        metrics: Metrics,
        settings: UpstreamSettings,
        *,
        wire: OriginWire | None = None,
        lines: LineBudget | None = None,
        outliers: OutlierDetector | None = None,
        budget: RetryBudget | None = None,
        loads: LoadBoard | None = None,
        hedges: RetryBudget | None = None,
        commit_times: CommitTimes | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        # Counts this proxy's requests in flight per origin, for the picker.
        self.loads = loads or LoadBoard()
        self._metrics = metrics
        self._settings = settings
        self.outliers = outliers or OutlierDetector()
        self.budget = budget or RetryBudget()
        # Its own bucket: hedges never spend the retries' tokens, nor retries the hedges'.
        self.hedges = hedges or hedge_budget()
        self.commit_times = commit_times or CommitTimes()
        # Each name once (dict.fromkeys keeps the first place): a name listed
        # twice would be set twice, one header, but give origin_headers'
        # lines two, and count twice against MAX_FORWARDED_TOTAL.
        configured = dict.fromkeys(h.lower() for h in settings.forward_headers)
        self._forward = FORWARD_REQUEST_HEADERS + tuple(
            h for h in configured if h not in NEVER_FORWARDED and h not in FORWARD_REQUEST_HEADERS
        )
        self._wire = wire or OriginWire(
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            limit_per_host=settings.max_origin_connections,
            share_limit=settings.tenant_share,
            queue_timeout=settings.origin_queue_timeout,
            ssl_context=settings.origin_ssl,
        )
        self._deadlines: Deadlines | None = None  # made on the loop of the first call
        # The loop of the calls under way, set by each `forward`: on Python
        # 3.11 asyncio.get_running_loop() makes a getpid system call.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lines = lines or LineBudget()
        # Cuts a call not yet answered once its origin is marked unhealthy,
        # not before twice the time its answers usually take.
        self.stalls = stalls or Stalls(None)
        self.stalls.usual = self.commit_times.p95
        # Per origin: one that lacks a model it is listed for (MODEL_MISSING).
        self._missing_told = ThrottledBy(log, every_s=60.0)
        # Per set of origins tried: a request none of them served (`_tell`).
        self._unserved_told = ThrottledBy(log, every_s=UNSERVED_EVERY_S)
        # Origins that refused the `stream_options` the proxy adds (forward's
        # `plain_body`): asked without it from then on, by this process.
        self.refuses_stream_options: set[str] = set()

    def _refused_stream_options(self, origin: str, answer: bytes) -> None:
        """`origin` answered 400 naming the `stream_options` the proxy added:
        said once per origin and process, with the origin's words."""
        if origin in self.refuses_stream_options:
            return
        self.refuses_stream_options.add(origin)
        said = answer[:200].decode("utf-8", "replace")
        log.warning(
            "origin %s refuses stream_options (it answered 400: %s); its streams go without "
            "it from now on, counted by their events, not its usage "
            "(--origin-stream-usage client asks no origin for it)",
            origin,
            said,
        )

    async def close(self) -> None:
        """Close the idle connections to origins (calls under way end theirs)."""
        await self._wire.close()

    @property
    def max_answer_bytes(self) -> int:
        """The most of one origin answer held at once: a whole answer (longer is
        refused), or one event of a stream (its relay's bound)."""
        return self._settings.max_answer_bytes

    def candidate_limit(self) -> int:
        """Candidates worth ordering: the attempts, plus room for ejected origins."""
        return self._settings.max_attempts + self.outliers.ejected_now()

    def ttft_p95(self, origin: str, *, stream: bool = True) -> float | None:
        """The origin's recent p95 seconds from send to commit (first chunk of a
        stream, or whole body); None with too few samples. What "auto" hedges after."""
        return self.commit_times.p95(origin, stream)

    def request_headers(
        self, incoming: Mapping[str, str], request_id: str, traceparent: str | None = None
    ) -> CIMultiDict[str]:
        """The headers an origin gets: the JSON content type, the request id and
        the allowed client headers, within MAX_FORWARDED_VALUE each and
        MAX_FORWARDED_TOTAL in all (see there); with `traceparent`, that one
        (the request's own trace context, when no span of it is recorded)."""
        return self.origin_headers(incoming, request_id, traceparent)[0]

    def origin_headers(
        self, incoming: Mapping[str, str], request_id: str, traceparent: str | None = None
    ) -> tuple[CIMultiDict[str], bytes | None]:
        """`request_headers`, and their lines as a request head has them (the
        bytes aiohttp's serialisation makes of them), made as they are set,
        for `forward`'s `lines`; None when one is not printable ASCII, or a
        client's trace context is replaced (the wire serialises them then)."""
        headers: CIMultiDict[str] = CIMultiDict()
        headers["content-type"] = "application/json"
        headers["x-request-id"] = request_id
        plain = request_id.isascii() and request_id.isprintable()
        lines = [_JSON_LINE, b"x-request-id: ", request_id.encode(), b"\r\n"] if plain else []
        total = 0
        for name in self._forward:
            value = incoming.get(name)
            if value is None:
                continue
            size = len(value.encode(errors="surrogateescape"))
            if size > MAX_FORWARDED_VALUE:
                if name != "user-agent":
                    continue
                value = value.encode(errors="surrogateescape")[:MAX_FORWARDED_VALUE].decode(
                    errors="ignore"
                )
                size = MAX_FORWARDED_VALUE
            total += len(name) + size
            if total > MAX_FORWARDED_TOTAL:
                break
            headers[name] = value
            if plain:
                plain = _add_line(lines, name, value)
        if traceparent is not None:
            if plain and ("traceparent" in headers or "tracestate" in headers):
                plain = False  # set again in its place, or taken out
            headers["traceparent"] = traceparent
            headers.popall("tracestate", None)  # a client's, of another trace
            if plain:
                plain = _add_line(lines, "traceparent", traceparent)
        return headers, b"".join(lines) if plain else None

    async def forward(
        self,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        candidates: Sequence[Target],
        *,
        hedge: HedgeSetting | None = None,
        stream: bool = False,
        trace: RequestTrace | None = None,
        spent_s: float = 0.0,
        sent: Sent | None = None,
        first_chunk_within: float | None = None,
        tenants_own: bool = False,
        method: str | None = None,
        tenant: str = "",
        model: str = "",
        max_tokens_added: bool = False,
        plain_body: Callable[[], bytes] | None = None,
        inputs: int = 0,
        lines: bytes | None = None,
    ) -> OriginAnswer:
        """The first origin (in `candidates`' order, ejected ones last) that
        commits to an answer: a status under 500 but no redirect and, for a
        stream, a first chunk. Raises ApiError (502, or 504 past the deadline)
        when none does.

        `stream` says whether the request asks for a stream; it picks the
        time-to-commit window that samples go to and that "auto" reads.

        With `hedge` (a delay in seconds, or "auto": the first candidate's
        `ttft_p95`, no hedge while that is unknown) and a second candidate: if
        the first attempt has not committed within the delay, the request is
        also sent to the second candidate, when the hedge budget allows (else
        counted as refused). The first of the two to commit answers; the other
        is cancelled at once, which closes its connection (a committed one is
        released). While one of them runs, the other failing changes nothing;
        when both have failed, failover goes on sequentially from the third
        candidate. The hedge counts as an attempt (`max_attempts`) but takes
        no retry-budget token; the deadline covers both. At most one hedge per
        request, and only of the first attempt. Cancelling `forward` cancels
        every attempt it started; each one under way is counted as outcome
        "cancelled", and `sent` says what had been sent.

        With `trace`, each attempt is a span of it, and its headers carry that
        span's trace context. `spent_s` is time the request already spent out of
        its deadline (waiting for another proxy's identical call).

        `first_chunk_within` (seconds; a stream's idle timeout): a streaming
        attempt whose head or first chunk has not come within it fails and the
        next candidate is tried, as for any attempt that failed before the
        client had a byte; without it, the read timeout alone bounds the wait.
        The proxy's --first-chunk-timeout, when set, replaces it: a long
        prefill need not lengthen every stream's wait between chunks; but not
        when it is shorter than a tenant's own idle timeout (`tenants_own`),
        which wins, as it does over --stream-idle-timeout (review 48).

        `method`: a call to a path made for this one request (`path` with its
        query), with that method, and no cached URL (a stored response's);
        its time to commit is not sampled (hedges wait for inference).

        `tenant`: whose request it is. Its calls to one origin count in the
        tenant's share of this proxy's connections to it; a call past that
        share, or one that found no connection free within the queue timeout
        (OriginWire), is sent nowhere and the next candidate is tried; when
        no candidate had a connection, ApiError 503 origin_busy.

        `model`: the model the request names. An origin that answers 404
        saying it lacks that model (a LoRA adapter not loaded, a model not
        pulled), though the route table lists it, is failed over (counted in
        ponto_origin_model_missing_total, not against its health: it may
        serve its other models well); when every origin tried says so,
        ApiError 404 model_not_found.

        `max_tokens_added`: the body's `max_tokens` is one the proxy added
        (a tenant's ceiling or default) to a chat request that named no limit. An origin whose
        Target.max_tokens_field names another field is sent it in that one
        (OpenAI's reasoning models refuse max_tokens).

        `plain_body`: makes `body` without the `stream_options.include_usage` the
        proxy added to count a stream by its origin's usage
        (--origin-stream-usage always). An origin that refuses the member (a
        400 naming it: older Azure OpenAI API versions, some servers) is asked
        again at once with `plain_body`, and always with it from then on in
        this process (said once, at WARNING); its streams are then counted by
        their events, as for a client that asks for no usage with
        --origin-stream-usage client.

        `inputs`: how many inputs an embeddings request has, or documents a
        rerank request (0: not counted). A whole answer parsed before sending
        whose `data` holds another number of embeddings, or that ranks more
        documents or another than the request's, is no answer of it
        (_missing_answer).

        `lines`: `headers`' lines in a request head (`origin_headers`), which
        an attempt that sends `headers` as they are writes as they are (no
        serialisation); `headers` must not change after.
        """
        loop = self._loop = asyncio.get_running_loop()
        settings = self._settings
        tries = _Tries(
            loop.time() + settings.deadline - spent_s,
            method,
            tenant,
            model,
            max_tokens_added,
            plain_body,
            inputs,
            None if lines is None else (headers, lines),
        )
        if stream and settings.first_chunk_timeout is not None:
            if tenants_own and first_chunk_within is not None:
                first_chunk_within = max(first_chunk_within, settings.first_chunk_timeout)
            else:
                first_chunk_within = settings.first_chunk_timeout
            if first_chunk_within == settings.first_chunk_timeout:
                tries.first_bound = "--first-chunk-timeout"
        if tenants_own and tries.first_bound == _IDLE_BOUND:
            tries.first_bound = "the tenant's stream idle timeout"
        if stream and first_chunk_within is not None:
            tries.first_within = min(first_chunk_within, settings.read_timeout)
        self.budget.deposit()
        outliers = self.outliers
        candidates = outliers.order(candidates)
        attempts = settings.max_attempts
        # Every candidate ejected (order puts them last, so the first is): one
        # attempt, to the nearest, not one to each. They failed in a row
        # lately; each request calling all of them in a total outage tripled
        # the calls to origins that may be coming back, and the 502's wait.
        # The first whose ejection ends is tried first again (docs/routing.md,
        # "When every origin fails").
        if outliers.all_ejected(candidates):
            attempts = 1
        ordered = list(
            attempt_order(candidates, attempts, outliers.passed_over, hedged=hedge is not None)
        )
        answer = None
        try:
            if hedge is not None:
                # Only requests that may hedge feed the hedge budget: 10 % of them.
                self.hedges.deposit()
                if len(ordered) > 1:
                    delay = (
                        self.commit_times.p95(ordered[0].name, stream) if hedge == AUTO else hedge
                    )
                    if delay is not None:
                        answer = await self._race(
                            ordered, float(delay), path, body, headers, stream, tries, trace, sent
                        )
            ended = tries.past_deadline or tries.too_large
            if answer is None and not ended:
                # The attempts one at a time from candidate tries.made, in this
                # frame: each frame an await passes through costs some 900
                # instructions a wait, and every request waits here.
                deadlines = self._deadlines
                if deadlines is None or deadlines.loop is not loop:
                    deadlines = self._deadlines = Deadlines(loop)
                task = asyncio.current_task(loop)
                assert task is not None  # a coroutine runs in a task
                failures = tries.failures
                attempt = tries.made
                while attempt < len(ordered):
                    attempt += 1
                    if attempt > 1 and ordered[attempt - 1].name in self.stalls.unhealthy:
                        # The candidates were ordered by the table the request began
                        # with: one the table marks unhealthy since is tried after the
                        # rest (trial 59: a retry waited out a second origin marked
                        # unhealthy seconds before, where another region was healthy).
                        # In place: tries.made names its target below.
                        _healthy_first(ordered, attempt - 1, self.stalls.unhealthy)
                    target = ordered[attempt - 1]
                    if tries.deadline - loop.time() <= 0:
                        failures.append("request deadline exceeded")
                        break
                    # A call never sent (no connection for it) is no retry the budget
                    # guards origins from: else one tenant past its share would spend
                    # the tokens other tenants' failovers need.
                    if attempt > 1 and not tries.unsent and not self.budget.try_retry():
                        failures.append("retry budget exhausted")
                        self._metrics.retries_refused.inc()
                        break
                    tries.made = attempt
                    try:
                        # A deadline the socket timeouts cannot replace: an origin that
                        # trickles a body never trips the read timeout.
                        with deadlines.bound(task, tries.deadline):
                            if trace is None:
                                answer = await self._call(
                                    target, path, body, headers, attempt, stream, tries
                                )
                            else:
                                answer = await self._attempt(
                                    target, path, body, headers, attempt, stream, tries, trace
                                )
                        self._won(answer)
                        break
                    except _Retryable as exc:
                        self._failed(target, exc, tries)
                        if tries.too_large:
                            break
                    except TimeoutError:
                        self._past_deadline(target, tries)
                        break
                    except asyncio.CancelledError:
                        # Usually sent already: the origin saw it (its prefill was spent).
                        self._metrics.attempt(target.name, "cancelled").inc()
                        raise
        except asyncio.CancelledError:
            if sent is not None and tries.made:
                sent.calls, sent.target = tries.made, ordered[tries.made - 1]
                # One call at a time but in a race, which says its own.
                sent.open = sent.open or 1
            raise
        failures = tries.failures
        if answer is not None and answer.status < 400:
            # Another origin answered: those 424s were their backends' failures.
            for name, why in tries.backend_failed:
                self._failure(name, why)
        if answer is not None:
            answer.calls = tries.made
            answer.others_worked = tries.worked
            if failures:
                self._tell(
                    tries,
                    "%s: %d attempt(s) failed before origin %s answered: %s",
                    headers["x-request-id"],
                    len(failures),
                    answer.target.name,
                    "; ".join(failures),
                )
            return answer
        timed_out = bool(failures) and failures[-1].endswith("deadline exceeded")
        if not (tries.not_served and tries.not_served + tries.model_missing == tries.failed):
            # (A request no origin serves is the client's: its refusal's line
            # tells it, and _failed told each origin's 501 once a minute.)
            # Once per UNSERVED_EVERY_S per set of origins tried: in an outage
            # every request fails alike, and each one's access line has its id,
            # status and attempts already (SRE game-day: a line per request).
            self._tell(
                tries,
                "no origin could serve %s after %d attempt(s): %s",
                headers["x-request-id"],
                len(failures),
                "; ".join(failures) or "no candidate",
                key=",".join(sorted(t.name for t in ordered[: tries.made])),
            )
        if tries.too_large:
            error = upstream_too_large(settings.max_answer_bytes)
        elif timed_out:
            error = upstream_timeout()
        elif tries.busy_retry_s is not None:
            error = upstream_busy(tries.busy_retry_s)
        elif tries.full and tries.full == tries.failed:
            error = origin_busy()
        elif tries.model_missing and tries.model_missing == tries.failed:
            # Every origin tried lacks it: the client's answer is OpenAI's.
            error = model_not_found(model or "requested")
        elif tries.not_served and tries.not_served + tries.model_missing == tries.failed:
            # Every origin tried either lacks the model or does not serve the
            # endpoint for it: the request's, not a failure to retry (review 321).
            error = endpoint_not_served(model or "requested", path, tries.not_served_said)
        elif tries.shown is not None:
            error = upstream_error_answer(tries.shown)
        else:
            error = upstream_unavailable(_what_failed(tries))
            # Of every candidate, not only those tried: with all ejected, one
            # is tried, and another whose ejection ends sooner goes first then.
            error.headers["retry-after"] = str(
                retry_after(outliers.back_in(t.name for t in candidates))
            )
        error.attempts = tries.made
        error.spent = tries.worked
        try:
            raise error
        finally:
            # Its traceback holds this frame (`body`, the request's, megabytes
            # for a document): a cycle only a full garbage collection frees.
            del error

    def _tell(self, tries: _Tries, line: str, *args: object, key: str | None = None) -> None:
        """A request's failed attempts, in one line with its id; the client gets
        a fixed message (dataplane.http.errors). Busy origins alone (429s, the
        steady state of a hosted API near its quota) are told at INFO. At most
        LineBudget's rate: an origin failing at full load (a rotated key not
        updated) would write a line per request; the metrics count them all.
        With `key` (the origins tried), once per UNSERVED_EVERY_S per key
        instead, saying how many were not logged."""
        busy = tries.failures and tries.busy == len(tries.failures)
        level = logging.INFO if busy else logging.WARNING
        if key is not None:
            self._unserved_told.log(key, level, line, *args)
            return
        skipped = self._lines.take()
        if skipped is None:
            return
        if skipped:
            line += f" ({skipped} more such {'line' if skipped == 1 else 'lines'} not logged)"
        log.log(level, line, *args)

    async def _race(
        self,
        ordered: Sequence[Target],
        delay: float,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        stream: bool,
        tries: _Tries,
        trace: RequestTrace | None,
        sent: Sent | None = None,
    ) -> OriginAnswer | None:
        """The first attempt on ordered[0], hedged on ordered[1] after `delay`.

        Returns the first answer committed; None when every attempt it made
        failed (`tries` records them, and whether the deadline passed). Every
        other attempt has ended (cancelled, or released if committed) when it
        returns or raises, so the LoadBoard holds only the winner's request.
        Cancelled, it sets `sent.open` to the attempts then under way.
        """
        loop = asyncio.get_running_loop()
        metrics = self._metrics
        first_target, hedge_target = ordered[0], ordered[1]
        sent_at = loop.time()
        first = self._start(first_target, path, body, headers, 1, stream, tries, trace)
        tries.made = 1
        hedge: asyncio.Task[OriginAnswer] | None = None
        targets = {first: first_target}  # every attempt of the race
        running = dict(targets)
        hedge_at = sent_at + delay
        winner: asyncio.Task[OriginAnswer] | None = None
        answer: OriginAnswer | None = None
        try:
            while running:
                wake_for_hedge = hedge_at < tries.deadline
                wake = hedge_at if wake_for_hedge else tries.deadline
                done, _ = await asyncio.wait(
                    running,
                    timeout=max(0.0, wake - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done and not wake_for_hedge:
                    for target in running.values():
                        self._past_deadline(target, tries)
                    tries.past_deadline = True
                    return None
                if not done:
                    hedge_at = math.inf
                    if not self.hedges.try_retry():
                        metrics.hedges.labels("refused").inc()
                        continue
                    metrics.hedges.labels("started").inc()
                    hedge = self._start(hedge_target, path, body, headers, 2, stream, tries, trace)
                    running[hedge] = targets[hedge] = hedge_target
                    tries.made = 2
                    continue
                # The first attempt before the hedge: when both commit at once,
                # the one sent first answers.
                unexpected: tuple[Target, BaseException] | None = None
                for task in sorted(done, key=lambda t: t is not first):
                    target = running.pop(task)
                    if task is first:
                        hedge_at = math.inf  # a hedge is sent only while the first runs
                    exc = task.exception()
                    if exc is None:
                        if winner is None:
                            winner = task
                    elif isinstance(exc, _Retryable):
                        self._failed(target, exc, tries)
                    else:
                        unexpected = (target, exc)
                if winner is not None:
                    answer = winner.result()
                    if unexpected is not None:  # not the client's concern: it has an answer
                        log.error(
                            "attempt on %s failed", unexpected[0].name, exc_info=unexpected[1]
                        )
                    break
                if unexpected is not None:
                    raise unexpected[1]
        except asyncio.CancelledError:
            for target in running.values():
                metrics.attempt(target.name, "cancelled").inc()
            if sent is not None:
                sent.open = len(running)
            raise
        finally:
            extra = await self._end_others(
                targets, first, winner, answer, stream, sent_at, trace, len(body), sent
            )
        if answer is None:
            return None
        answer.extra_calls = extra
        if hedge is not None:
            answer.hedged = winner is hedge
            metrics.hedges.labels("won" if answer.hedged else "lost").inc()
        self._won(answer)
        return answer

    def _start(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        stream: bool,
        tries: _Tries,
        trace: RequestTrace | None,
    ) -> asyncio.Task[OriginAnswer]:
        if trace is None:  # no extra coroutine frame per call when tracing is off
            return asyncio.create_task(
                self._call(target, path, body, headers, attempt, stream, tries)
            )
        return asyncio.create_task(
            self._attempt(target, path, body, headers, attempt, stream, tries, trace)
        )

    async def _end_others(
        self,
        targets: dict[asyncio.Task[OriginAnswer], Target],
        first: asyncio.Task[OriginAnswer],
        winner: asyncio.Task[OriginAnswer] | None,
        answer: OriginAnswer | None,
        stream: bool,
        sent_at: float,
        trace: RequestTrace | None,
        body_bytes: int,
        sent: Sent | None = None,
    ) -> int:
        """End every attempt of a race but the winner; return how many were sent
        and then cancelled (or released) because the winner answered first.
        Cancelled while it waits for them, it sets `sent.open` to the winner
        and the attempts it was ending.

        Runs however the race ended. A cancelled attempt closes its own
        connection and ends its LoadBoard count (`_attempt`); one that had
        committed is released here. Counted as outcome "hedge_cancelled" only
        when there is a winner: after the deadline or a client's disconnect
        there is nobody to lose to.
        """
        loop = asyncio.get_running_loop()
        others = [t for t in targets if t is not winner]
        if trace is not None and winner is not None:
            for task in others:
                trace.hedge_lost(targets[task])
        cancelled = [t for t in others if t.cancel()]
        try:
            if cancelled:
                # They end at their next step: nothing in _attempt shields a cancel.
                await asyncio.wait(cancelled)
        except BaseException:
            # Cancelled again while waiting (the client went away): the attempts
            # still end on their own; one that commits anyway is released. The
            # request is the client's 499: the winner and the copies it was
            # ending are its cancelled calls.
            if answer is not None:
                answer.release()
            for task in cancelled:
                task.add_done_callback(_release_late)
            ended = (*cancelled, *([winner] if winner is not None else []))
            for task in ended:
                self._metrics.attempt(targets[task].name, "cancelled").inc()
            if sent is not None:
                sent.open = len(ended)
            raise
        extra = 0
        for task in others:
            if task.cancelled():
                lost = task in cancelled
            elif task.exception() is not None:
                continue  # failed before: counted when it did
            else:
                task.result().release()
                lost = True
            if not lost or winner is None:
                continue
            extra += 1
            target = targets[task]
            self._metrics.attempt(target.name, "hedge_cancelled").inc()
            if task is first and task.cancelled():
                # A lower bound of its time to commit: without it the window
                # would lose exactly the slow tail that hedges cut off, and its
                # p95 (the "auto" delay) would creep down.
                took = loop.time() - sent_at
                self.commit_times.observe(target.name, stream, took)
                if stream:  # a stream's first event, as the forwarder's samples (speed.py)
                    self.loads.speeds.observe(target.name, True, took, body_bytes=body_bytes)
        return extra

    def _won(self, answer: OriginAnswer) -> None:
        name = answer.target.name
        if answer.streamed:
            # Counted "ok" by the relay once the stream has ended, and only
            # then a success for the origin's health (`stream_answered`): an
            # origin that opens every stream and cuts each partway would
            # otherwise reset its failures at every open, and never be ejected
            # (trial 65: 817 cuts, 0 ejections). An error answered as a stream
            # is not relayed (the pipeline answers it whole): it answered.
            if answer.status >= 400:
                self.outliers.success(name)
            return
        self.outliers.success(name)
        self._metrics.upstream_attempts.add(name, "ok")

    def stream_answered(self, origin: str) -> None:
        """A stream `origin` committed to ended with the answer's end: a
        success for its passive health. Called by whoever relays the stream,
        once it has ended (dataplane.http.pipeline, stored)."""
        self.outliers.success(origin)

    def stream_cut(self, origin: str, why: str) -> None:
        """`origin` broke off a stream it had committed to (`why`, as the
        relay says: its connection dropped, its body ended before the
        answer's last event, or it stalled past the idle timeout): a failure
        for its passive health, as a 5xx is, which ejects it after
        `consecutive` in a row. Called by whoever relays the stream; not for
        a client that left, a stream the proxy cancelled (a hedge lost, the
        server stopping), an event past --max-answer-bytes (another origin
        would make as long a one, as for a whole answer), or an in-band
        error event (its blame is not read mid-stream: a request must not
        eject origins)."""
        self._failure(origin, f"cut a stream: {why}")

    def _failed(self, target: Target, exc: _Retryable, tries: _Tries) -> None:
        self._metrics.attempt(target.name, exc.outcome).inc()
        tries.failures.append(f"{target.name}: {exc}")
        tries.worked |= exc.worked
        tries.failed += 1
        tries.unsent = exc.outcome in FULL_OUTCOMES.values()
        if tries.unsent:
            tries.full += 1
            if exc.outcome == FULL_OUTCOMES["queue"]:
                # Every connection in use: the next requests try it last for a
                # while, as after a 429. Not a tenant's share, which is the
                # tenant's alone.
                self.outliers.busy(target.name, BUSY_DEFAULT_S)
            return  # busy, not failing: never against its health
        if exc.outcome == TOO_LARGE:
            tries.too_large = True
            return  # the origin did answer: not a failure of its health
        if exc.outcome == MODEL_MISSING:
            tries.model_missing += 1
            model = tries.model or "?"
            self._model_missing(target.name, model, str(exc), target.model_names.get(model, ""))
            # Not against its health: ejection is of the whole origin, which
            # may serve its other models well (one adapter not loaded would
            # take a healthy replica from every model's traffic).
            return
        if exc.outcome == NOT_SERVED:
            tries.not_served += 1
            if exc.shown is not None:
                tries.not_served_said = exc.shown["message"] or ""
            # Trial 79: as a 5xx, a client asking a chat model for embeddings
            # (llama.cpp, Ollama: 501) ejected every origin of the model, and
            # was told to retry. The origin serves its other requests well.
            self._missing_told.log(
                f"{target.name} 501",
                logging.WARNING,
                "origin %s answered 501 Not Implemented for model %s (it does not serve that "
                "endpoint for it: llama.cpp without --embeddings, or a chat model asked for "
                "embeddings?); failed over, not against its health: %s",
                target.name,
                tries.model or "?",
                exc,
            )
            return
        if exc.outcome == ERROR_ANSWER:
            tries.shown = exc.shown or tries.shown
            if exc.blame == "account":
                tries.refused += 1
            else:
                tries.errored += 1
            if exc.blame == "busy":
                # As a 429: tried last for a while, not ejected (review 205).
                self.outliers.busy(target.name, BUSY_DEFAULT_S)
            if exc.blame not in ("origin", "account"):
                # Busy, the request's or unknown: not against the origin's
                # health (a client must not be able to eject origins by its
                # requests).
                return
        elif exc.outcome == "http_5xx":
            tries.errored += 1
            if exc.status == BACKEND_FAILED:
                # TGI's 424 is any exception of its model shard, a dead shard's
                # or one a request's feature raises (a JSON schema outlines
                # cannot build): counted at once, one such request, failed
                # over to each origin and retried by the SDK, would eject them
                # all.
                tries.backend_failed += ((target.name, str(exc)),)
                return
        elif exc.outcome in ("timeout", "http_408"):
            tries.timed_out += 1
        elif exc.outcome in ("credential_refused", "account_refused"):
            tries.refused += 1
        elif not exc.worked and exc.outcome in ("connect_error", "credential_error"):
            tries.unreached += 1
        if exc.status == BUSY:
            wait = busy_wait_s(exc.retry_after, time.time())
            self.outliers.busy(target.name, wait)
            tries.busy += 1
            known = tries.busy_retry_s
            tries.busy_retry_s = wait if known is None else min(known, wait)
            return
        self._failure(target.name, str(exc))

    def _model_missing(self, origin: str, model: str, said: str, own: str = "") -> None:
        """`origin` answered that it lacks `model` (which the route table
        lists it for; asked for under its `own` name for it, when it has one):
        counted by the public name, and told at most once a minute per origin
        with the name it was sent (review: a mistyped own name was reported
        as the public model missing, which sent the operator to pull it)."""
        self._metrics.model_missing.labels(origin, model).inc()
        self._missing_told.log(
            origin,
            logging.WARNING,
            "origin %s lacks model %s%s, which the route table lists it for (a LoRA adapter "
            "not loaded, a model not pulled%s?); failed over: %s",
            origin, model, f" (sent as its own name {own!r})" if own else "",
            ", its own name for it mistyped" if own else "", said,
        )  # fmt: skip

    def _failure(self, origin: str, why: str) -> None:
        """A failure of `origin` (`why`, as logged) for its passive health; an
        ejection it makes is counted (ponto_origin_ejections_total, which
        PontoOriginFailing reads) and logged."""
        if self.outliers.failure(origin, why):
            self._metrics.ejections.labels(origin).inc()
            log.warning("origin %s ejected after repeated failures", origin)

    @staticmethod
    def _no_answer(first_within: float | None, bound: str) -> str:
        """Why an attempt timed out before its answer began, for the log."""
        if first_within is None:
            return "timed out before the response started"
        return f"sent no first chunk within {first_within:g} s ({bound})"

    def _past_deadline(self, target: Target, tries: _Tries) -> None:
        self._metrics.attempt(target.name, "deadline").inc()
        tries.failures.append(f"{target.name}: request deadline exceeded")
        tries.worked = True
        tries.failed += 1
        # Counted as _failed's are (review 199: an origin hanging to the
        # deadline never fired PontoOriginFailing).
        self._failure(target.name, "request deadline exceeded")

    async def _attempt(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        stream: bool,
        tries: _Tries,
        trace: RequestTrace,
    ) -> OriginAnswer:
        """One call inside its own span of `trace`, whose context it sends.
        `tries.deadline` (loop time) is the request's: a cancellation from then
        on is its timeout."""
        span = trace.attempt(target, attempt)
        try:
            answer = await self._call(
                target, path, body, span.inject(headers), attempt, stream, tries
            )
        except asyncio.CancelledError as exc:
            if not span.outcome and asyncio.get_running_loop().time() >= tries.deadline:
                span.outcome = "timeout"
            span.failed(exc)
            raise
        except BaseException as exc:
            span.failed(exc)
            raise
        span.committed(answer.status)
        return answer

    def _call(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        stream: bool,
        tries: _Tries | None = None,
    ) -> Coroutine[Any, Any, OriginAnswer]:
        """One call to `target` (`_call_once`); made again without the
        `stream_options` the proxy added when the origin refuses it (a
        review: every stream of a client that asked for no usage got the
        origin's 400 naming a member it never sent, and nothing said why).
        Not a coroutine itself: the common call is `_call_once`'s own, with
        no frame around it (every request makes one).

        To an origin that knows the request's model by another name
        (Target.model_names), the body sent names it so: per attempt, so a
        failover or a hedge to another origin sends that one's name, or the
        client's. So is a ceiling the proxy added as max_tokens
        (`max_tokens_added`) sent in the origin's max_tokens_field. Only those
        bodies are encoded again; others go as given."""
        plain = tries.plain_body if tries is not None else None
        names = target.model_names
        # The common attempt (no names, no ceiling added) tests two values.
        if tries is not None and (names or tries.max_tokens_added):
            own = names.get(tries.model) if names else None
            token_field = target.max_tokens_field if tries.max_tokens_added else ""
            if own is not None or token_field:
                body = renamed(body, own, token_field)
                if plain is not None:
                    plain = partial(_renamed_plain, plain, own, token_field)
        if plain is None:
            return self._call_once(target, path, body, headers, attempt, stream, tries)
        if target.name in self.refuses_stream_options:
            return self._call_once(target, path, plain(), headers, attempt, stream, tries)
        return self._call_usage_added(target, path, body, headers, attempt, stream, tries, plain)

    async def _call_usage_added(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        stream: bool,
        tries: _Tries | None,
        plain: Callable[[], bytes],
    ) -> OriginAnswer:
        """`_call` of a body holding the `stream_options` the proxy added:
        made again with `plain()` when the origin refuses the member."""
        try:
            return await self._call_once(
                target, path, body, headers, attempt, stream, tries, usage_added=True
            )
        except _StreamOptionsRefused:
            return await self._call_once(target, path, plain(), headers, attempt, stream, tries)

    async def _call_once(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        stream: bool,
        tries: _Tries | None = None,
        *,
        usage_added: bool = False,
    ) -> OriginAnswer:
        """One call to `target`, cut once the route table marks it unhealthy
        before it has answered (dataplane.upstream.stalls: `watch`).
        `usage_added`: `body` holds the `stream_options` the proxy added;
        raises _StreamOptionsRefused when the origin refuses it."""
        if target.credential is not None:
            try:
                authorization = target.credential.authorization()
            except CredentialError as exc:
                # For the log (the client's message is fixed): the variable or
                # path at fault, never a value.
                raise _Retryable("credential_error", str(exc), worked=False) from exc
            if authorization is not None:
                headers = headers.copy()
                headers["authorization"] = authorization
        watch = self._watch(target.name, stream)
        method = tries.method if tries is not None else None
        speeds = self.loads.speeds
        # Until its first event, a stream's wait shows in placement
        # (SpeedBoard.factor): the speed samples come only once calls answer.
        waiting = speeds.began(target.name, len(body)) if stream and method is None else 0
        try:
            with watch:
                first_within = tries.first_within if tries is not None else None
                bound = tries.first_bound if tries is not None else _IDLE_BOUND
                loads = self.loads
                loop = self._loop
                assert loop is not None  # a forward() runs
                sent_at = loop.time()
                loads.started(target.name)
                try:
                    tenant = tries.tenant if tries is not None else ""
                    wire = self._wire
                    if method is None:
                        lined = tries.lined if tries is not None else None
                        resp = await wire.post(
                            target.url(path),
                            body,
                            headers,
                            first_within,
                            tenant,
                            lined[1] if lined is not None and lined[0] is headers else None,
                        )
                    else:
                        resp = await wire.call(
                            method, target.url(""), path, body, headers, first_within, tenant
                        )
                except OriginFull as exc:
                    # Before ClientError, which it is too: sent nowhere, and
                    # the origin is busy, not failing (wire.OriginFull).
                    loads.finished(target.name)
                    raise _Retryable(FULL_OUTCOMES[exc.why], str(exc), worked=False) from exc
                except aiohttp.ConnectionTimeoutError as exc:
                    # Before TimeoutError, which it is too: no connection in time is
                    # an origin not reached, not one slow to answer (review 48).
                    loads.finished(target.name)
                    raise _Retryable(
                        "connect_error", f"connection timed out: {exc}", worked=False
                    ) from exc
                except TimeoutError as exc:
                    loads.finished(target.name)
                    raise _Retryable("timeout", self._no_answer(first_within, bound)) from exc
                except aiohttp.ClientError as exc:
                    loads.finished(target.name)
                    # Only a connection never made surely cost nothing: a disconnect
                    # may come after the origin began the prefill.
                    raise _Retryable(
                        "connect_error",
                        f"{type(exc).__name__}: {exc}",
                        worked=not isinstance(exc, aiohttp.ClientConnectorError),
                    ) from exc
                except BaseException:
                    loads.finished(target.name)
                    raise
                try:
                    # Every status refused is 300 or more: one comparison
                    # passes an answer by all of them.
                    if resp.status >= MIN_REFUSED_STATUS:
                        if resp.status == NOT_IMPLEMENTED and method is None:
                            raise await _not_implemented(resp)
                        _refuse(resp, tries)
                    content_type = resp.content_type
                    streamed = content_type == "text/event-stream"
                    body_read: bytes | None = None
                    first = b""
                    opening: Opening | None = None
                    try:
                        if streamed:
                            # Until the client has seen a byte, a failing origin can
                            # still be replaced by the next one: wait for the first
                            # event of the answer, past comments (an origin's keep-
                            # alive while it queues) and a Responses stream's preamble
                            # (trial 51: either committed the stream, and a stall
                            # before the first token then cut it, not failed over).
                            first = await resp.content.readany()
                            # Of an answer only: an error's body is passed on as it
                            # comes (review 199: a 400 labelled an event stream
                            # became a 502, and counted against its origin).
                            answer = 200 <= resp.status < 300
                            responses = path.startswith(RESPONSES_PATH)
                            if first and answer and not _whole_event_first(first, responses):
                                opening = Opening(responses)
                                if not opening.feed(first):
                                    first = await self._held(
                                        resp, opening, first, sent_at, first_within
                                    )
                            # A stream whose first event is an error, as a whole
                            # answer can be (review 201): another origin may answer.
                            # Read from the opening when it was parsed; else the
                            # first chunk begins with the event (one search spares
                            # nearly every stream the parse).
                            if (
                                answer
                                and opening is None
                                and b'"error"' in first[:FIRST_ERROR_SCAN]
                            ):
                                opening = Opening(responses)
                                opening.feed(first)
                            if opening is not None:
                                error = _stream_error(opening.first_answer())
                                if error is not None:
                                    raise _error_answer(error, resp.status)
                            if first_within is not None:
                                # The rest of the stream: its relay times its idle gaps.
                                resp.time_reads(self._settings.read_timeout)
                        else:
                            most = self._settings.max_answer_bytes
                            body_read = resp.read_now(most)
                            if body_read is None:
                                body_read = await resp.read(most)
                    except TimeoutError as exc:
                        if not streamed or first_within is None:
                            raise _Retryable(
                                "cut", f"response cut before it was complete: {exc}"
                            ) from exc
                        raise _Retryable("timeout", self._no_answer(first_within, bound)) from exc
                    except aiohttp.ClientError as exc:
                        raise _Retryable(
                            "cut", f"response cut before it was complete: {exc}"
                        ) from exc
                    except AnswerTooLarge as exc:
                        raise _Retryable(
                            TOO_LARGE,
                            f"answered {resp.status} with a body of more than {exc.limit} bytes "
                            f"({exc.size} or more; --max-answer-bytes)",
                            resp.status,
                        ) from exc
                    if (
                        resp.status == BAD_REQUEST
                        and body_read is not None
                        and usage_added
                        and b"stream_options" in body_read
                    ):
                        self._refused_stream_options(target.name, body_read)
                        raise _StreamOptionsRefused
                    if streamed and not first:
                        raise _Retryable("cut", "stream ended before its first chunk")
                    if streamed and resp.status == 200 and only_done(first):
                        # No event at all (trial 45: passed on as an empty answer, which
                        # the SDK reads as nothing): another origin may answer.
                        raise _Retryable("cut", "stream ended with [DONE] before any event", 200)
                    parsed: Any = jsonio.NOT_PARSED
                    if body_read is not None and 200 <= resp.status < 300 and resp.status != 204:
                        parsed = _answer_object(
                            body_read,
                            resp.status,
                            content_type,
                            path if method is None else "",
                            tries.inputs if tries is not None else 0,
                        )
                    elif resp.status == NOT_FOUND and body_read is not None and method is None:
                        # (A stored response's path is no endpoint's: an origin
                        # without it, or without the response, answers for it.)
                        # Its own name for the model, which its 404 names; the
                        # client is told the public one (forward: model_not_found).
                        model = tries.model if tries else ""
                        _check_not_found(body_read, path, target.model_names.get(model, model))
                    if resp.status < 400 and method is None:
                        # Refusals come back at once and would make "slow" look fast.
                        took = loop.time() - sent_at
                        self.commit_times.observe(target.name, stream, took)
                        self._metrics.commit_time.observe_at(
                            took, target.name, "stream" if stream else "whole"
                        )
                        if 200 <= resp.status < 300 and (
                            streamed or parsed is not jsonio.NOT_PARSED
                        ):
                            # Its speed, for placement (dataplane.placement.speed);
                            # a body too large to parse has no token count to
                            # divide by, and is no sample.
                            loads.speeds.observe(
                                target.name,
                                streamed,
                                took,
                                0 if streamed else output_tokens(parsed),
                                len(body),
                            )
                    return OriginAnswer(
                        target,
                        attempt,
                        resp.status,
                        _copy(resp),
                        body_read,
                        first,
                        resp,
                        loads,
                        parsed,
                    )
                except BaseException:
                    resp.release()
                    loads.finished(target.name)
                    raise
        except Stalled as exc:
            raise _Retryable("timeout", str(exc)) from exc
        finally:
            if waiting:
                speeds.answered(target.name, waiting)

    async def _held(
        self,
        resp: OriginResponse,
        opening: Opening,
        first: bytes,
        sent_at: float,
        first_within: float | None,
    ) -> bytes:
        """A stream's first bytes (`first`, fed to `opening` already), read on
        until they hold an event of its answer: what comes before it is not
        the answer, and the origin may still be replaced. Within
        `first_within` seconds of the call (loop time `sent_at`), as for its
        first byte: an origin that sends comments and no event is as late as
        a silent one (review 199: each comment started the per-read timeout
        again, and a pinging origin was held to the request's deadline)."""
        held = bytearray(first)
        loop = self._loop
        assert loop is not None  # a forward() runs
        try:
            async with asyncio.timeout_at(sent_at + first_within if first_within else None):
                while len(held) <= MAX_HELD_BEFORE_EVENT:  # past it: it answers
                    more = await resp.content.readany()
                    if not more:
                        raise _Retryable("cut", "stream ended before any event of its answer")
                    held += more
                    if opening.feed(more):
                        break
        except TimeoutError as exc:
            if first_within is None or loop.time() < sent_at + first_within:
                raise  # the read's own timeout: as for the first byte
            raise _Retryable(
                "timeout",
                f"sent no event of its answer within {first_within:g} s (only comments, "
                "a Responses stream's preamble, or an event not yet whole)",
            ) from exc
        return bytes(held)

    def _watch(self, origin: str, stream: bool) -> CallWatch | NoWatch:
        """The watch of a call to `origin` made in the current task: a
        CallWatch while the watch is on (Stalls.after_s), NO_WATCH when off."""
        stalls, loop = self.stalls, self._loop
        task = asyncio.current_task(loop) if stalls.after_s is not None and loop else None
        return CallWatch(stalls, origin, task, stream) if task is not None else NO_WATCH


_DELTA_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,6})?")


# What a stream may send before its first event of the answer and still be
# replaced by another origin's: comments and preamble events are small.
MAX_HELD_BEFORE_EVENT = 64 * 1024
RESPONSES_PATH = "/responses"
RERANK_PATH: Final = "/rerank"


def _whole_event_first(chunk: bytes, responses: bool) -> bool:
    """Whether a stream's first chunk begins with a whole event of the answer
    (nearly every chat stream's: `data: {...}` and its blank line), known
    without parsing it; False says only that it must be parsed (Opening). Its
    one data line holds something (review: `data: ` alone, a keep-alive some
    servers send, is no answer to the parser)."""
    if responses or not chunk.startswith(b"data:"):
        return False
    end = chunk.find(b"\n\n")
    line = chunk.find(b"\n")  # the data line's end
    return (
        end > 0
        and (line > 6 or (line == 6 and chunk[5] != 0x20))  # more than "data: "
        and chunk.find(b"\r", 0, end) < 0
        and chunk.find(b"\ndata", 0, end) < 0
    )


# How far into a stream's first chunk, which begins with its first event
# (_whole_event_first), an error is looked for before it is parsed.
FIRST_ERROR_SCAN = 512


def _stream_error(event: Any) -> dict[str, Any] | None:
    """The error a stream's first event of its answer (`event`, its parsed
    data: see Opening.first_answer) is, as a whole body holding it would be
    (`{"error": ...}`): a chat or completions chunk that is an error and no
    choice, or a Responses stream's `error` event; None otherwise."""
    if not isinstance(event, dict):
        return None
    if event.get("type") == "error":
        return {"error": event}
    if event.get("error") and not _holds_answer(event):
        return event
    return None


def _what_failed(tries: _Tries) -> str:
    """The 502's message: "could not be reached" when some origin could not
    be (or none was tried); else what every origin tried did, when they all
    did the same (refused the gateway's credentials: its operator's to fix);
    else that they failed (review 48: a 500 and a timeout, or a 500 and an
    empty retry budget, said "could not be reached")."""
    count = tries.failed
    if tries.unreached or tries.full or not count:
        return UPSTREAM_UNAVAILABLE
    if tries.errored == count:
        return UPSTREAM_FAILED
    if tries.timed_out == count:
        return UPSTREAM_SLOW
    if tries.refused == count:
        return UPSTREAM_GATEWAY_REFUSED
    return UPSTREAM_UNANSWERED


def _healthy_first(ordered: list[Target], start: int, unhealthy: frozenset[str]) -> None:
    """Puts `ordered`'s candidates from `start` on that are not `unhealthy`
    before those that are, each group in its order, in place."""
    rest = ordered[start:]
    ordered[start:] = [
        *(t for t in rest if t.name not in unhealthy),
        *(t for t in rest if t.name in unhealthy),
    ]


def attempt_order(
    ordered: Sequence[Target],
    attempts: int,
    passed_over: Callable[[str], bool] = lambda _: False,
    *,
    hedged: bool = False,
) -> Sequence[Target]:
    """The origins `attempts` tries go to, from `ordered`: its first
    `attempts`, unless they all share the first's region while another region
    follows; then that region's first that is not `passed_over` (ejected or
    busy: OutlierDetector) takes the last attempt. A region whose every
    replica fails at once (a bad rollout, its network) otherwise used every
    attempt up and answered 502 while another region was healthy (trial 19:
    three replicas, three attempts). Envoy's `previous_priorities` retry
    predicate spreads its retries across priorities the same way.

    Never the second of the attempts when the request may be `hedged`: the
    hedge goes to the second, and a hedge is to beat a slow first byte, which
    a call to a farther region rarely does (review 39)."""
    chosen = ordered[:attempts]
    if attempts < (3 if hedged else 2) or len(ordered) <= attempts:
        return chosen
    region = chosen[0].region
    for target in chosen:
        if target.region != region:
            return chosen
    for target in ordered[attempts:]:
        if target.region != region and not passed_over(target.name):
            return [*chosen[:-1], target]
    return chosen


def retry_after(back_in: float) -> int:
    """The Retry-After of a 502 no origin served, from the seconds until the
    first of the request's candidates is no longer ejected (`back_in`, 0 when
    one is not): that is when the proxy calls one of them first again, so a client
    (the OpenAI SDKs wait what it says, up to a minute) does not spend its
    retries on calls that go to an ejected origin last. At least a second,
    as a 429 without one gets (`upstream_busy`)."""
    return max(1, math.ceil(back_in))


def retry_after_seconds(value: str, now: float) -> float:
    """A `Retry-After` value in seconds from `now` (wall-clock time):
    delta-seconds (decimals too) or an HTTP date, never negative. 0 when
    absent or unreadable."""
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return 0.0
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - now)


def busy_wait_s(retry_after: str, now: float) -> float:
    """How long an origin that answered 429 with `retry_after` stays busy:
    its Retry-After, BUSY_DEFAULT_S without one, at most BUSY_MAX_S."""
    return min(BUSY_MAX_S, retry_after_seconds(retry_after, now) or BUSY_DEFAULT_S)


def _release_late(task: asyncio.Task[OriginAnswer]) -> None:
    """Done callback of an attempt abandoned mid-cancel: release an answer it
    committed anyway, and retrieve its failure so it is not logged as lost."""
    if not task.cancelled() and task.exception() is None:
        task.result().release()


# A whole body is parsed before the client gets it (to fail over when it is no
# answer) up to this size; a larger one (an embeddings batch of megabytes,
# some 40 ms to parse per 8 MB) only has its shape checked, and is parsed
# after it was sent, as before.
PARSE_BEFORE_SENDING_MAX: Final = 1 << 20


def _answer_object(
    body: bytes, status: int, content_type: str, path: str = "", inputs: int = 0
) -> Any:
    """A 2xx whole body parsed (NOT_PARSED when too large to parse before
    sending); _Retryable "bad_answer" when it is no JSON object, which every
    endpoint answers: an nginx welcome page, a gateway's login form, another
    service's JSON, a body cut short with its length (a wrong base URL or
    port, or a broken origin); or when it holds no answer of the endpoint at
    `path` (_missing_answer, with the request's `inputs`; "":
    not checked)."""
    if len(body) > PARSE_BEFORE_SENDING_MAX:
        ends = body.strip()
        if ends[:1] == b"{" and ends[-1:] == b"}":
            return jsonio.NOT_PARSED
        parsed: Any = None
    else:
        parsed = jsonio.loads_or_none(body)
    if not isinstance(parsed, dict):
        raise _Retryable(
            "bad_answer",
            f"answered {status} with a body that is not a JSON object "
            f"({content_type or 'no content type'}, {len(body)} bytes): "
            "a wrong base URL or port?",
            status,
        )
    if "error" in parsed and parsed["error"] and not _holds_answer(parsed):
        # Some hosted APIs answer a failure 200 with `{"error": {...}}`: relayed,
        # the SDK read choices None and failed (trial 51). Another origin may
        # answer; with none, the client gets a request's error as the origin
        # gave it, and an account's or the origin's as a fixed message
        # (review 201: "insufficient credit on account org-..." reached it).
        raise _error_answer(parsed, status)
    missing = _missing_answer(parsed, path, inputs)
    if missing:
        raise _Retryable(
            "bad_answer", f"answered {status} to {path} with no answer in it: {missing}", status
        )
    return parsed


def _missing_answer(parsed: dict[str, Any], path: str, inputs: int = 0) -> str:
    """What a 2xx body lacks to be an answer of the endpoint at `path`, ""
    when it lacks nothing (or `path` is no endpoint checked): chat's choices,
    each with a `message` object; completions' choices, each with a `text`;
    embeddings' `data` list, of one item per input when the request's
    `inputs` are counted (trial 79: `"data": []`, or one vector
    short of a batch, went to the client as a success and was kept in the
    cache for its TTL; the SDK's `data[0]` failed, and a client that pairs
    vectors with its texts by position paired them wrongly); a Responses
    object's `output` list. Trial 65: a
    `{"object": "chat.completion"}` without choices, `"choices": []` or a
    `"message": null` reached the SDK as a 200 (the client's code crashed on
    it), and an embeddings request answered with a chat completion was kept
    in the cache. A glance at the shape, no more: a few lookups per choice.

    An answer that says why it has nothing is one (review: a content filter's
    refusal is a 200 with no usable choice, and failing it over sent the
    prompt to every origin and ejected them): no choices beside
    `prompt_filter_results` or a `usage` (Azure OpenAI, a gateway's
    guardrail), a choice with no message or text that has its
    `finish_reason` (Gemini's "content_filter: ..."). The client gets it as
    the origin sent it."""
    if path in {"/chat/completions", "/completions"}:
        choices = parsed.get("choices")
        if not isinstance(choices, list):
            return "no choices"
        if not choices:
            said = "prompt_filter_results" in parsed or isinstance(parsed.get("usage"), dict)
            return "" if said else "no choices"
        chat = path == "/chat/completions"
        for choice in choices:
            if not isinstance(choice, dict):
                return "a choice that is no object"
            if isinstance(choice.get("finish_reason"), str):
                continue  # an answer, or why there is none
            if chat and not isinstance(choice.get("message"), dict):
                return "a choice with no message"
            if not chat and not isinstance(choice.get("text"), str):
                return "a choice with no text"
        return ""
    if path == "/embeddings":
        data = parsed.get("data")
        if not isinstance(data, list):
            return "no data list"
        if inputs and miscounted(parsed, inputs):
            return f"{len(data)} embeddings for {inputs} inputs"
        return ""
    if path == RESPONSES_PATH:
        if isinstance(parsed.get("output"), list) or parsed.get("object") == "response":
            return ""
        return "no output list"
    if path == RERANK_PATH:
        return _missing_ranking(parsed, inputs)
    return ""


def _missing_ranking(parsed: dict[str, Any], documents: int = 0) -> str:
    """What a rerank answer lacks (_missing_answer): a `results` list, each
    result an object with an integer `index` and a numeric
    `relevance_score`, which a client reads to pick its documents
    (`documents[index]`): with the request's `documents` counted, no more
    results than documents, each index one of them, none twice. An
    embeddings answer or a chat completion from an origin that took the path
    for another is none, nor is `"results": []` (a request holds at least
    one document, and `top_n` is at least one)."""
    results = parsed.get("results")
    if not isinstance(results, list):
        return "no results list"
    if not results:
        return "no results"
    if documents and len(results) > documents:
        return f"{len(results)} results for {documents} documents"
    seen: set[int] = set()
    for result in results:
        if not isinstance(result, dict):
            return "a result that is no object"
        index, score = result.get("index"), result.get("relevance_score")
        if type(index) is not int or index < 0:
            return "a result with no index"
        if documents and index >= documents:
            return f"a result for document {index} of {documents}"
        if index in seen:
            return f"document {index} ranked twice"
        seen.add(index)
        if type(score) not in (int, float):
            return "a result with no relevance_score"
    return ""


def embedding_inputs(value: Any) -> int:
    """How many embeddings an embeddings request's validated `input` asks
    for: one for a string or an array of token ids, one per item of an array
    of strings or of token-id arrays."""
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return 1


def miscounted(obj: Any, inputs: int) -> bool:
    """Whether `obj`, an embeddings answer parsed, holds a `data` list of
    another number of embeddings than its request's `inputs`
    (embedding_inputs): no answer of it (_missing_answer), never kept."""
    data = obj.get("data") if isinstance(obj, dict) else None
    return isinstance(data, list) and len(data) != inputs


def misranked(obj: Any, documents: int) -> bool:
    """Whether `obj`, a rerank answer parsed, is no ranking of its request's
    `documents` (_missing_ranking: more results than documents, an index
    past them, one twice): no answer of it, never kept."""
    return not isinstance(obj, dict) or bool(_missing_ranking(obj, documents))


NOT_FOUND = 404


def renamed(body: bytes, model: str | None, token_field: str = "") -> bytes:
    """`body` (a JSON object) as an origin is sent it (Forwarder._call):
    with `model` as its model (None: as it is), for an origin that knows the
    request's model by another name; with its `max_tokens` moved to
    `token_field` ("": left), for one that reads the proxy's added ceiling
    there."""
    obj = jsonio.loads(body)
    if model is not None:
        obj["model"] = model
    if token_field and "max_tokens" in obj:
        # Over a client's `null` in that field (no limit), never a value:
        # the ceiling is added only when the client named none.
        obj[token_field] = obj.pop("max_tokens")
    return jsonio.dumps(obj)


def _renamed_plain(plain: Callable[[], bytes], model: str | None, token_field: str) -> bytes:
    return renamed(plain(), model, token_field)


def _check_not_found(body: bytes, path: str, model: str = "") -> None:
    """Refuse (_Retryable "bad_answer") a 404 that is no OpenAI-style error:
    the origin has no such path, not no such model (trial 52: an origin
    added without /v1 in its URL answered every request 404 Not Found, which
    the client got, with no other origin tried and the origin healthy).
    Refuse too (MODEL_MISSING) one that says the origin lacks `model`: the
    proxy checked the model against the route table, which lists the origin
    for it, so the fault is the origin's (trial 65: a vLLM replica without a
    LoRA adapter had every retry relay its 404 while another served it).
    Any other OpenAI-style 404 error is the client's to read."""
    parsed = jsonio.loads_or_none(body) if len(body) <= PARSE_BEFORE_SENDING_MAX else None
    if isinstance(parsed, list) and parsed and isinstance(parsed[0], dict):
        parsed = parsed[0]  # errors as a list (Gemini's OpenAI endpoint; review 205)
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    if isinstance(parsed, dict) and (
        parsed.get("error")
        or parsed.get("object") == "error"
        or (isinstance(detail, str) and detail != "Not Found")
    ):
        said = _lacks_model(parsed, model)
        if said is not None:
            raise _Retryable(
                MODEL_MISSING,
                f"answered 404: it lacks model {model or '(unnamed)'}: {said[:200]}",
                NOT_FOUND,
                worked=False,
            )
        return  # an OpenAI-style error, or a FastAPI server's own (not its router's)
    raise _Retryable(
        "bad_answer",
        f"answered 404 to {path} with no OpenAI-style error: a wrong base URL? (OpenAI-"
        f"compatible servers serve {path} under /v1)",
        NOT_FOUND,
        worked=False,
    )


# What a 404's message says of a model it lacks: vLLM's "The model `M` does
# not exist.", Ollama's "model 'M' not found" ("..., try pulling it first").
_LACKS = re.compile(r"does not exist|not found|not loaded|unknown model|no such model", re.I)


def _lacks_model(parsed: dict[str, Any], model: str) -> str | None:
    """The message of a 404 error that says the origin lacks `model`, None
    when it says anything else: its code is `model_not_found` (hosted APIs),
    or its message names `model` (quoted) and says it is missing (vLLM,
    Ollama, a FastAPI server's `detail`). A message that names the model and no lack of
    it (an adapter's own 404 about something else) is the client's."""
    error = parsed.get("error")
    where = error if isinstance(error, dict) else parsed
    message = where.get("message")
    if isinstance(error, str):
        message = error  # Ollama's native `{"error": "model 'M' not found"}`
    elif not isinstance(message, str):
        message = parsed.get("detail")
    text = message if isinstance(message, str) else ""
    if where.get("code") == "model_not_found" or parsed.get("code") == "model_not_found":
        return text or "model_not_found"
    # Named quoted, as each server quotes it: not a part of another word.
    if model and any(f"{q}{model}{q}" in text for q in "`'\"") and _LACKS.search(text):
        return text
    return None


def _holds_answer(parsed: dict[str, Any]) -> bool:
    """Whether a 2xx body beside its `error` holds an answer: chat and
    completions' choices, embeddings' data or rerank's results, not empty (review 201: `"choices":
    null` passed), or a Responses object (its `error` is a member of every one,
    null unless it failed: a failed one is an answer, which the client reads
    as one)."""
    if "output" in parsed or parsed.get("object") == "response":
        return True
    return any(
        isinstance(parsed.get(k), list) and parsed[k] for k in ("choices", "data", "results")
    )


async def _not_implemented(resp: OriginResponse) -> _Retryable:
    """The failed attempt of a 501 Not Implemented. An OpenAI-style error
    (errors.origin_error_of) is an inference server's word that it does not
    serve the request for its model: NOT_SERVED, not against its health,
    with its message, which says what (llama.cpp: "This server does not
    support embeddings. Start it with `--embeddings`"; vLLM: any
    NotImplementedError a request's feature raises, of a model that serves
    the endpoint). Any other body (an HTML page: a plain web server that
    implements no POST, at a wrong base URL) is no such word: a 5xx like any
    other, against the origin's health."""
    try:
        body = await resp.read(MAX_ORIGIN_ERROR_BYTES)
    except (TimeoutError, aiohttp.ClientError, AnswerTooLarge):
        body = b""
    parsed = jsonio.loads_or_none(body)
    shown = origin_error_of(parsed) if isinstance(parsed, dict) else None
    if shown is None:
        return _Retryable("http_5xx", "answered 501 with no OpenAI-style error", NOT_IMPLEMENTED)
    said = f"answered 501: {(shown['message'] or '')[:200]}"
    return _Retryable(NOT_SERVED, said, NOT_IMPLEMENTED, worked=False, shown=shown)


def _error_answer(parsed: dict[str, Any], status: int) -> _Retryable:
    """The failed attempt of a 2xx body that is an error and no answer, as
    whose fault it is (errors.error_blame) has it counted: an account's as a
    refused credential (nothing generated; the origin passed over), an origin
    too busy as a 429 (not against its health), the origin's as a 5xx, the
    request's neither (a client must not eject origins by its requests), and
    only the request's shown."""
    blame = error_blame(parsed)
    said = f"answered {status} with an error and no answer: {str(parsed['error'])[:200]}"
    return _Retryable(
        ERROR_ANSWER,
        said,
        status,
        worked=blame == "origin",
        shown=origin_error_of(parsed, "upstream_error") if blame == "request" else None,
        blame=blame,
    )


def _refuse(resp: OriginResponse, tries: _Tries | None) -> None:
    """Raise the _Retryable of an answer whose status refuses the call (a
    5xx, a second origin's 424, a 429, a 408, a 402, a redirect or a refused
    credential); return for any other. A 501 to a call of an endpoint is
    `_not_implemented`'s, asked first."""
    if resp.status >= RETRY_STATUS_MIN or (
        # A second origin's 424 to one request is its answer: a request a
        # shard cannot take (a JSON schema its grammar library cannot build)
        # fails each batch it joins, so it is not sent to a third, and the
        # client gets the origin's reason, which it does not retry.
        resp.status == BACKEND_FAILED and (tries is None or not tries.backend_failed)
    ):
        raise _Retryable("http_5xx", f"answered {resp.status}", resp.status)
    if resp.status == BUSY:
        raise _Retryable(
            "http_429",
            "answered 429 (too busy, or the account with it is over its quota)",
            BUSY,
            resp.headers.get("retry-after", ""),
            worked=False,
        )
    if resp.status == ORIGIN_TIMED_OUT:
        raise _Retryable(
            "http_408",
            "answered 408 (it timed out waiting for the request)",
            resp.status,
            worked=False,
        )
    if resp.status == PAYMENT_REQUIRED:
        raise _Retryable(
            "account_refused",
            "answered 402: the operator's account with it wants payment",
            resp.status,
            worked=False,
        )
    if resp.status in REDIRECTS:
        where = resp.headers.get("location", "nowhere")[:200]
        raise _Retryable(
            "http_3xx",
            f"answered {resp.status}, a redirect to {where}: fix its base URL",
            resp.status,
            worked=False,
        )
    if resp.status in CREDENTIAL_REFUSED:
        raise _Retryable(
            "credential_refused",
            f"refused the proxy's credential ({resp.status})",
            resp.status,
            worked=False,
        )


def _copy(resp: OriginResponse) -> CIMultiDict[str]:
    """The origin's headers the client is sent: not those dropped above, nor
    those its Connection header names, hop-by-hop by its say (RFC 9110
    7.6.1; trial 36: `Connection: x-node` and `x-node: node-7.internal`
    reached clients), nor one whose value holds a control character or
    bytes that are not UTF-8 (review 279: the answer's head then failed to
    be written, and the client's connection was reset)."""
    hop = _connection_options(resp.headers)
    out: CIMultiDict[str] = CIMultiDict()
    passed = _PASSED
    for name, value in resp.headers.items():
        # By its name as sent, looked up once: an origin sends the same few
        # (a subscript, as metrics.Counter.add's: nearly always there).
        try:
            kept = passed[name]
        except KeyError:
            kept = _passed(name)
        if kept and value.isprintable() and (not hop or name.lower() not in hop):
            out.add(name, value)
    return out


# Header names as origins send them -> whether `_copy` passes them on, but for
# those a Connection header names; bounded (a name may be any string).
_PASSED: dict[str, bool] = {}
_PASSED_MAX: Final = 1024


def _passed(name: str) -> bool:
    """Whether an origin's header `name` goes to clients (unless its
    Connection header names it): not one of DROP_RESPONSE_HEADERS nor of
    DROP_RESPONSE_PREFIXES. Remembered in _PASSED while it has room."""
    lower = name.lower()
    kept = lower not in DROP_RESPONSE_HEADERS and not lower.startswith(DROP_RESPONSE_PREFIXES)
    if len(_PASSED) < _PASSED_MAX:
        _PASSED[name] = kept
    return kept


# The options of the Connection headers most answers have, without splitting
# them; each is dropped anyway (DROP_RESPONSE_HEADERS).
_USUAL_OPTIONS: Final = {
    "keep-alive": frozenset({"keep-alive"}),
    "close": frozenset({"close"}),
}


def _connection_options(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """The header names a message's Connection headers list, lowercased."""
    values = headers.getall("connection", ())
    if not values:
        return frozenset()
    if len(values) == 1 and (known := _USUAL_OPTIONS.get(values[0])) is not None:
        return known
    options: set[str] = set()
    for value in values:  # loops: nginx says keep-alive on every answer
        for option in value.split(","):
            if option := option.strip():
                options.add(option.lower())
    return frozenset(options)


# The content type of every call's body, as a line of its head.
_JSON_LINE: Final = b"content-type: application/json\r\n"


def _add_line(lines: list[bytes], name: str, value: str) -> bool:
    """Add the header's line (wire.head_line) to `lines`; False (nothing
    added) unless it is printable ASCII."""
    line = head_line(f"{name}: {value}")
    if line is None:
        return False
    lines.append(line)
    return True
