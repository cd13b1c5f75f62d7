"""The request pipeline: one straight path from request to settled answer.

    authenticate -> parse -> assemble -> admit -> cache -> place -> forward
        -> relay (dataplane.http.reply) -> settle

An `Exchange` carries one request through it; each step reads what earlier
steps set and adds its own part. Every step is a method with one job; those
that do not read or write the socket (authenticate, assemble, admit, settle)
take only an Exchange, so a test drives them with no HTTP server at all. Every refusal is an
ApiError (OpenAI error shape, right status), raised before anything reaches an
origin; the error boundary (dataplane.http.errors) answers it.

Who is calling is settled before the body is read: a caller without a valid
credential costs the proxy no more than its headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from aiohttp import hdrs, web
from aiohttp.streams import EMPTY_PAYLOAD
from multidict import CIMultiDictProxy

from dataplane import jsonio
from dataplane.assemble import assembled, every_document, names_twice, ruled_fields
from dataplane.auth.authenticator import (
    OPEN_PRINCIPAL,
    AuthError,
    AuthUnavailable,
    KeysPending,
    Principal,
)
from dataplane.cache.entry import CachedResponse, from_completion
from dataplane.cache.keys import COSTLY_ABOVE, costly_to_normalise
from dataplane.cache.step import CachePlan, CacheRequest, EdgeCache
from dataplane.geo.home import ClientLocator
from dataplane.http import reply
from dataplane.http.body import BodyTimeout, OverFramed, decode_body
from dataplane.http.boundary import CLIENT_GONE, gone_reason, hand_over, send_whole
from dataplane.http.edge import EdgeProtocol, WholeAnswer, bare
from dataplane.http.errors import (
    ApiError,
    AuthUnavailableError,
    Unauthorized,
    api_key_suspended,
    bad_request,
    body_too_large,
    model_not_found,
    no_route_table,
    not_cached,
    pinned_origin_failed,
    pinned_origin_unhealthy,
    previous_response_gone,
    previous_response_not_found,
    several_authorizations,
    tenant_suspended,
)
from dataplane.http.fields import (
    brackets_of,
    check_containers,
    check_depth,
    check_fields,
    invalid_type,
    too_deep,
    too_many_values,
)
from dataplane.http.hold import HeldHead, Holds
from dataplane.http.requestid import origin_request_id
from dataplane.http.resume import (
    CONTINUABLE,
    CUT_NOT_CONTINUED,
    Continuations,
    Finished,
    counts_finishes,
    held_against,
)
from dataplane.http.state import CONTINUE_PENDING, REQUEST_ID, SERVER_NAME, Draining, stopping
from dataplane.metrics import Metrics
from dataplane.offload import OFF_LOOP_ABOVE, OffLoop
from dataplane.placement.keys import SESSION_HEADER, Key, placement_key
from dataplane.placement.picker import AFFINITY, Picker
from dataplane.policy import EdgePolicy, TenantRules
from dataplane.ratelimit.limiter import Admission, RateLimiter, format_duration
from dataplane.ratelimit.tokens import (
    completion_bound,
    completion_choices,
    continues_stored,
    estimate_prompt_tokens,
)
from dataplane.routes import Point, Routes, Target
from dataplane.streaming.relay import STOPPED_WRITE_S
from dataplane.streaming.responses_events import response_events
from dataplane.streaming.splice import Transcript, TranscriptBudget
from dataplane.streaming.usage import (
    Usage,
    UsageCounter,
    asks_usage,
    believed,
    ceilings,
    rerank_usage_of,
    usage_of,
    with_usage_asked,
    within_floors,
    without_usage_asked,
)
from dataplane.sync.holder import TableHolder
from dataplane.upstream.forwarder import (
    Forwarder,
    OriginAnswer,
    Sent,
    embedding_inputs,
    miscounted,
    misranked,
)
from dataplane.upstream.hedge import HedgeSetting
from dataplane.upstream.responseids import Rewriter, StreamIds, ids_of, rewrite_words
from dataplane.upstream.stalls import Stalls
from ponto.logs import ThrottledBy

if TYPE_CHECKING:
    from dataplane.telemetry.tracing import RequestTrace, RequestTracer

__all__ = ["ENDPOINTS", "Endpoint", "Exchange", "Pipeline"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the metrics label, e.g. "chat.completions"
    upstream_path: str  # appended to an origin's base URL
    required: str  # the field every request must carry


ENDPOINTS = {
    e.name: e
    for e in (
        Endpoint("chat.completions", "/chat/completions", "messages"),
        Endpoint("completions", "/completions", "prompt"),
        Endpoint("embeddings", "/embeddings", "input"),
        # Jina's and Cohere's rerank API, as vLLM and llama.cpp serve it at
        # /v1/rerank: proxied like embeddings (no stream, no completion).
        # Not vLLM's unversioned /rerank nor Cohere v2's /v2/rerank: every
        # endpoint here is its path under an origin's base URL (…/v1), and
        # the 404 of /rerank names /v1/rerank for it.
        Endpoint("rerank", "/rerank", "query"),
        # OpenAI's Responses API, proxied like chat. Never cached (see
        # dataplane.cache.policy) and never continued (dataplane.http.resume).
        # Its `input` may be left out for a stored prompt or a conversation.
        Endpoint("responses", "/responses", "model"),
    )
}


class Exchange:
    """One request's state, from arrival to settlement. Owned by its task.

    A plain slotted class, not a dataclass: its __init__ sets every field
    with a constant, where a dataclass's took each of its 48 fields as an
    argument with a default (some 8,100 instructions an Exchange against
    6,100, callgrind on a loop; one a request)."""

    __slots__ = (
        "_estimate",
        "admission",
        "answer",
        "attempts",
        "authenticated",
        "body",
        "cache",
        "cache_request",
        "candidates",
        "continuation_prompt",
        "continued",
        "counter",
        "detached",
        "endpoint",
        "first_chunk_at",
        "headers",
        "hedge_calls",
        "hedge_prompt",
        "hedged",
        "held",
        "held_status",
        "idle_timeout_own",
        "idle_timeout_s",
        "idle_timeout_shorter",
        "keyable",
        "limit_headers",
        "limit_lines",
        "max_tokens_added",
        "model",
        "origin",
        "origin_error",
        "origin_request_id",
        "pinned",
        "placement",
        "policy",
        "previous",
        "principal",
        "raw",
        "region",
        "remote",
        "request_id",
        "rewritten",
        "route",
        "routes",
        "sent",
        "stream",
        "stream_error",
        "tenant",
        "trace",
        "traceparent",
        "usage",
        "usage_added",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        headers: CIMultiDictProxy[str],
        remote: str | None,
        request_id: str,
        routes: Routes,
        policy: EdgePolicy,
    ) -> None:
        self.endpoint: Endpoint = endpoint
        self.headers: CIMultiDictProxy[str] = headers
        self.remote: str | None = remote
        self.request_id: str = request_id
        self.routes: Routes = routes
        self.policy: EdgePolicy = policy
        self.principal: Principal = OPEN_PRINCIPAL
        # The principal is known: the caller's, or the owner of an expired key it
        # presented (refused, but its requests are counted and logged as theirs).
        self.authenticated: bool = False
        # parse; from `forward` on, the bytes sent to the origin instead
        self.raw: bytes = b""
        self.body: dict[str, Any] = {}
        self.stream: bool = False
        # Few enough JSON values (fields.MAX_KEYED_VALUES), and little enough text
        # to normalise and few enough quotes in it (cache.keys.costly_to_normalise),
        # to cache-key.
        self.keyable: bool = True
        # assemble
        self.tenant: TenantRules | None = None
        self.model: str = ""
        self.rewritten: bool = False  # assembly changed the body: `raw` no longer matches it
        # The proxy put `max_tokens` into the body (the tenant's ceiling or
        # default; a chat request that named no limit): sent to each origin in
        # its own field.
        self.max_tokens_added: bool = False
        # A stream whose origin is asked for the usage chunk its client did not
        # ask for (--origin-stream-usage always): counted by the origin's usage,
        # which its client is not shown (dataplane.streaming.usage).
        self.usage_added: bool = False
        # A stream's idle timeout (the tenant's, else the proxy's): the longest
        # gap between chunks, the first included; None for no stream, or none set.
        self.idle_timeout_s: float | None = None
        self.idle_timeout_own: bool = False  # idle_timeout_s is the tenant's own setting
        # That setting is shorter than the proxy's: a stall past it is the
        # tenant's choice of bound, not held against the origin (resume.held_against).
        self.idle_timeout_shorter: bool = False
        # The message lists as the client sent them, kept when the tenant's system
        # prompt may shift their indexes (an origin's error then names the client's).
        self.sent: dict[str, Any] | None = None
        # admit; the prompt's estimate is made when first read (`estimate`)
        self._estimate: int = -1
        self.admission: Admission | None = None
        self.limit_headers: Sequence[tuple[str, str]] = ()
        # limit_headers as header lines (Admission.lines) when they were
        # made so: an admission's; None for a refusal's.
        self.limit_lines: bytes | None = b""
        # cache, answer
        self.cache: CachePlan | None = None
        self.cache_request: CacheRequest | None = None
        self.counter: UsageCounter | None = None  # a relayed stream's token count
        self.usage: Usage | None = None
        # route: why the first candidate was chosen, then (once an origin has
        # answered) why that origin answers
        self.route: str = ""
        # The key affinity placed it by (the access log's `placement`); None
        # with another mode, or nothing to stick to.
        self.placement: Key | None = None
        self.candidates: list[Target] = []
        # Prompt tokens of origin calls beyond the one answering: continuations
        # (counted in a summed usage when the stream has one) and hedges (never).
        self.continuation_prompt: int = 0
        self.hedge_prompt: int = 0  # the hedges' prompts, by the estimate
        # Cancelled hedges: sent the prompt of the call that answered, or of
        # the one under way beside them when the client left.
        self.hedge_calls: int = 0
        self.continued: int = 0  # continuations of a cut stream
        # A Responses follow-up of a response an origin stored for the caller
        # (`Pipeline.pin`): that origin, the only one it goes to, and the
        # previous id as the origin knows it and as the client sent it.
        self.pinned: Target | None = None
        self.previous: tuple[str, str] | None = None
        # What the access log and the GenAI metrics report (dataplane.http.accesslog)
        self.origin: str = ""  # the origin that answered, and its region
        self.region: str = ""
        # The x-request-id the answering origin gave it, when not ours (a hosted
        # API's own, which its support asks for): reply.ORIGIN_REQUEST_ID_HEADER to the client
        # (its error answers too) and the access log.
        self.origin_request_id: str | None = None
        # The code the origin's own error answer gave (errors.OriginError.code),
        # the access log's `error` for it ("" for none: the log says the status).
        self.origin_error: str = ""
        # Origin calls made (OriginAnswer.calls): failed ones, hedges (won or
        # lost) and continuation calls (failed ones too) included.
        self.attempts: int = 0
        self.hedged: bool = False
        self.first_chunk_at: float | None = None  # time.perf_counter() of a stream's first chunk
        # The answer, once its head went out (a whole one sent, a stream
        # prepared): a failure after that gets no second answer (boundary).
        self.answer: web.StreamResponse | None = None
        # A stream's head sent while its origin thought (dataplane.http.hold):
        # the answer goes on in it.
        self.held: web.StreamResponse | None = None
        # The status of the answer a held stream's error event stands for,
        # under the 200 its client had (reply.held_failed; 0: none): an
        # origin's error answer's, recorded as one unheld is (boundary._record).
        self.held_status: int = 0
        # How an answer that started as a success ended badly: a stream cut, or
        # a client gone before its answer ended (CLIENT_GONE: recorded as a 499).
        self.stream_error: str = ""
        # Its client left while its stream led a flight that has followers: the
        # flight's task relays on and settles this request once the origin's
        # stream ends (Pipeline.lead), not the request's handler.
        self.detached: bool = False
        # The request's spans; None when tracing is off (dataplane.telemetry).
        self.trace: RequestTrace | None = None
        # With no trace: the traceparent its origin calls carry (a root request
        # the sampler is known to drop; RequestTracer.unsampled_root).
        self.traceparent: str | None = None

    @property
    def estimate(self) -> int:
        """The prompt's estimated tokens (ratelimit.tokens.estimate_prompt_tokens
        of `body` as admitted: assembly and `pin` change it before admission,
        nothing after), made at the first read. Most requests never read it:
        a limit, a budget, a usage the proxy does not believe or counts
        itself, a hedge or a trace does (some 5,500 instructions a request)."""
        est = self._estimate
        if est < 0:
            est = self._estimate = estimate_prompt_tokens(self.endpoint.name, self.body)
        return est

    def response_headers(self, cache_outcome: str) -> list[tuple[str, str]]:
        """What every answer to this request carries besides the origin's headers:
        its id, the cache outcome (with the reason of a bypass or of a miss;
        the tier of a hit) and the route."""
        headers = [("x-request-id", self.request_id), *self.cache_headers(cache_outcome)]
        if self.route:
            headers.append((ROUTE_HEADER, self.route))
        return headers

    def cache_headers(self, outcome: str) -> list[tuple[str, str]]:
        """`x-ponto-cache`, and the reason of a bypass or of a miss (a
        verification, an entry without the usage asked for, an answer not
        kept, or for a stream one its key's last answer was not: its own is
        not known yet), or the tier of a hit."""
        plan = self.cache
        if outcome != "hit" and plan is not None and (reason := plan.header_reason):
            return [(CACHE_HEADER, outcome), (CACHE_REASON_HEADER, reason)]
        if outcome == "hit" and plan is not None and plan.tier:
            # Age: how long ago the answer was made, as any HTTP cache says.
            return [
                (CACHE_HEADER, outcome),
                (CACHE_TIER_HEADER, plan.tier),
                ("age", str(plan.age_s)),
            ]
        return [(CACHE_HEADER, outcome)]

    def chunk_sent(self) -> None:
        """Called as a stream's first chunk goes to the client (dataplane.http.reply)."""
        if self.first_chunk_at is None:
            self.first_chunk_at = time.perf_counter()


CACHE_HEADER = "x-ponto-cache"
CACHE_REASON_HEADER = "x-ponto-cache-reason"
# local: this proxy's memory; region: the region's Redis (dataplane.cache.regionstore).
CACHE_TIER_HEADER = "x-ponto-cache-tier"
ROUTE_HEADER = "x-ponto-route"

# How long a request may wait for a concurrency slot that the leader's next
# shares bring (RateLimiter.may_wait): after the refusal, the proxy's demand
# report, its replica's publication and two of the leader's rounds, a second
# each by default (2.5 s on average; the wait also ends as soon as a share
# says the fleet has no spare slots).
SLOT_WAIT_S = 4.0
_SLOT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SlotWait:
    """How `admit_when_slot_frees` waits: at most `wait_s`, looking every
    `poll_s`, by `clock` (the limiter's times: monotonic seconds) and
    `sleep`. Tests give a clock and a sleep of their own, so a wait's every
    step is theirs to order and no real time passes."""

    wait_s: float = SLOT_WAIT_S
    poll_s: float = _SLOT_POLL_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


SLOT_WAIT: Final = SlotWait()


def _relayed_or_let_go(
    task: asyncio.Task[web.StreamResponse], lead: reply.LeaderStream
) -> asyncio.Future[None]:
    """Done once the flight's task ends or its leader's client is let go
    (`lagged`): a client cut for falling behind its flight ends its request
    while the flight goes on. As `shield`'s, cancelling what it returns
    cancels neither."""
    # Not asyncio.wait((task, lead.let_go)), which every leader's request
    # paid for, followed or not: 2.4 us more than `shield` (review r4); two
    # callbacks cost what shield's do.
    woken: asyncio.Future[None] = task.get_loop().create_future()

    def wake(_: object) -> None:
        if not woken.done():
            woken.set_result(None)

    task.add_done_callback(wake)
    lead.let_go.add_done_callback(wake)
    return woken


class Pipeline:
    """The steps, bound to the proxy's parts. One per app."""

    def __init__(
        self,
        holder: TableHolder,
        limiter: RateLimiter,
        cache: EdgeCache,
        locator: ClientLocator,
        forwarder: Forwarder,
        metrics: Metrics,
        picker: Picker,
        *,
        max_body_bytes: int,
        session_header: str = SESSION_HEADER,
        stream_idle_timeout: float | None = None,
        stalls: Stalls | None = None,
        tracer: RequestTracer | None = None,
        origin_stream_usage: bool = True,
        draining: Draining | None = None,
        transcripts: TranscriptBudget | None = None,
        stream_hold_s: float | None = None,
        slot_wait: SlotWait = SLOT_WAIT,
        off_loop: OffLoop | None = None,
    ) -> None:
        self.holder = holder
        # The thread of a large body's parse (dataplane.offload), the cache's.
        self.off_loop = off_loop if off_loop is not None else OffLoop()
        self.limiter = limiter
        # A concurrency slot's wait (_admit_after_wait).
        self.slot_wait = slot_wait
        self.cache = cache
        self.locator = locator
        self.forwarder = forwarder
        self.metrics = metrics
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.session_header = session_header
        self.stream_idle_timeout = stream_idle_timeout
        # A stream's head is sent this long after its call when no event has
        # come (--stream-hold-seconds; None: held to the first event).
        self.stream_hold_s = stream_hold_s
        self.holds = Holds(stream_hold_s) if stream_hold_s is not None else None
        # Ask the origin for every chat and completions stream's usage
        # (--origin-stream-usage always), not only for those whose client asks.
        self.origin_stream_usage = origin_stream_usage
        # Streams stalled on an origin the table marks unhealthy end sooner.
        self.stalls = stalls or Stalls(None)
        self.tracer = tracer
        # The app's DRAINING (a new one, never active, when not given), read
        # by every whole answer sent early (sent_now).
        self.draining = draining if draining is not None else Draining()
        # What every stream's transcript holds, against --max-transcripts-mb.
        self.transcripts = transcripts if transcripts is not None else TranscriptBudget()
        # Flights' tasks whose leading client left (Pipeline.lead): kept until
        # they end, cancelled by `close`.
        self._detached: set[asyncio.Task[web.StreamResponse]] = set()
        # Per origin: an origin whose usage is not believed is told at most
        # once a minute (an origin that lies does so on every answer).
        self._unbelieved = ThrottledBy(log, every_s=60.0)

    async def close(self) -> None:
        """Stop the flights still relaying for followers after their leading
        client left (the app's clean-up, once its handlers, the followers
        among them, have ended or been cancelled): the origins' connections
        are closed, and each is settled."""
        for task in self._detached:
            task.cancel()
        if self._detached:
            await asyncio.wait(self._detached)

    # ------------------------------------------------------------ the path

    async def handle(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        """Answer one proxied request; raises ApiError for every refusal."""
        trace = ex.trace
        try:
            if trace is None:
                self.authenticate(ex)
            else:
                with trace.step("ponto.auth"):
                    self.authenticate(ex)
        except KeysPending as pending:
            await self.authenticate_after(ex, pending)
        try:
            # A plain call when the body came with its head (nearly always): a
            # coroutine that never waits costs some 1,000 instructions more.
            raw = read_body_now(request, self.max_body_bytes)
            if raw is None:
                raw = await read_body(request, self.max_body_bytes)
            # aiohttp's cached copy let go (the encoded one, for a gzip body):
            # the exchange holds the bytes alone, and `forward` swaps them for
            # those it sends.
            request._read_bytes = None
            ex.raw = raw
            if len(raw) > OFF_LOOP_ABOVE:
                self.assemble(ex, await self.parse_off_loop(ex, raw))
            else:
                # The parse step (`parsed`) by a plain call: not a method
                # that calls it, one frame more every request.
                ex.body, ex.stream, ex.keyable = parsed(ex.endpoint, raw)
                self.assemble(ex)
            if ex.endpoint.name == "responses":
                self.pin(ex)
        except ApiError:
            # Refused before admission (a bad body, an unknown model): the
            # caller's limits go with it as they stand, as OpenAI's refusals
            # carry them; nothing was taken from them.
            ex.limit_headers, ex.limit_lines = self.standing_limits(ex.principal), None
            raise
        if trace is None:
            if (waiting := self.admit_now(ex)) is not None:
                await waiting
        else:
            with trace.step("ponto.limits"):
                await self.admit(ex)
        try:
            return await self.answer(request, ex)
        finally:
            self.settle(ex)

    def begin(self, request: web.Request, endpoint: Endpoint) -> Exchange:
        """A new Exchange on the current table; 503 while the proxy has none."""
        holder = self.holder
        routes, policy = holder.routes, holder.policy
        if routes is None or policy is None:
            raise no_route_table()
        # The request's own dict: request[...] is a Python call; its headers'
        # field, as FixedRoutes reads it (aiohttp's property is one too).
        request_id = request._state[REQUEST_ID]
        return Exchange(endpoint, request._headers, request.remote, request_id, routes, policy)

    def authenticate(self, ex: Exchange) -> None:
        try:
            ex.principal = authenticate(ex.policy, sole_authorization(ex.headers))
        except (Unauthorized, AuthUnavailableError) as exc:
            # An expired key, or a JWT its tenant's config could not check:
            # its refusals are its owner's.
            if exc.owner is not None:
                ex.principal = exc.owner
                ex.authenticated = True
            raise
        ex.authenticated = True
        if ex.policy.suspended or ex.policy.suspended_keys:
            refuse_suspended(ex.policy, ex.principal)

    async def authenticate_after(self, ex: Exchange, pending: KeysPending) -> None:
        """authenticate, once the fetch of a JWKS that `pending` waits for has
        ended (or its wait has); a 503 auth_unavailable if the keys are still
        being fetched then."""
        await pending.wait()
        try:
            self.authenticate(ex)
        except KeysPending as again:
            error = AuthUnavailableError(AuthUnavailable(again.tenant))
            ex.principal, ex.authenticated = error.owner, True  # as authenticate's
            raise error from None

    def standing_limits(self, principal: Principal) -> list[tuple[str, str]]:
        """The `x-ratelimit-*` headers of `principal`'s limits as they stand, for
        an answer that was not admitted (a refusal of its request, the model
        list): it takes nothing from them."""
        return self.limiter.headers(principal.scopes, time.monotonic())

    async def parse_off_loop(self, ex: Exchange, raw: bytes) -> bool:
        """The parse step (`parsed`) of a large body, off the event loop
        (dataplane.offload), with the look for fields named twice that
        `assemble` reads (`names_twice`, which parses the body again when a
        name it rules is a key anywhere in it: 0.6 s of 10,000 tools of a
        `model` parameter each, on the loop); that look's answer."""
        names = ruled_fields(ex.endpoint.name, ex.policy.tenant(ex.principal.tenant).prompt)
        ex.body, ex.stream, ex.keyable, twice = await self.off_loop.run(
            parsed_named, ex.endpoint, raw, names
        )
        return twice

    def assemble(self, ex: Exchange, twice: bool | None = None) -> None:
        """Check that the caller may name the model, apply the tenant's prompt
        rules (aliases, system prompt, defaults) and check that the model is
        served. `twice` is `names_twice` of the body when the caller looked
        (`parse_off_loop`)."""
        ex.tenant = ex.policy.tenant(ex.principal.tenant)
        asked = ex.body["model"]
        policy = ex.policy
        if (ex.tenant.models is not None or policy.key_models) and (
            whose := policy.refusing_list(ex.principal, ex.tenant, asked)
        ):
            raise model_not_found(asked, refused_by=whose)
        if ex.tenant.prompt.system_prompt:
            ex.sent = {k: ex.body[k] for k in ("messages", "input") if k in ex.body}
        rules = ex.tenant.prompt
        done = assembled(ex.endpoint.name, ex.body, rules)
        ex.max_tokens_added = done.max_tokens_added
        if twice is None:
            twice = done.changed or names_twice(ex.raw, ruled_fields(ex.endpoint.name, rules))
        ex.rewritten = done.changed or twice
        if ex.endpoint.name == "rerank" and every_document(ex.body):
            ex.rewritten = True
        model = ex.body["model"]
        if not isinstance(model, str) or model not in ex.routes.groups:
            raise model_not_found(asked)
        ex.model = model
        if ex.stream:
            own = ex.tenant.streams.idle_timeout_s
            ex.idle_timeout_s = own or self.stream_idle_timeout
            ex.idle_timeout_own = bool(own)
            proxy_bound = self.stream_idle_timeout
            ex.idle_timeout_shorter = bool(own) and (proxy_bound is None or own < proxy_bound)
            # Responses streams always end with their usage.
            ex.usage_added = (
                self.origin_stream_usage
                and ex.endpoint.name in CONTINUABLE
                and not asks_usage(ex.body)
            )

    @staticmethod
    def pin(ex: Exchange) -> None:
        """A Responses request with a `previous_response_id`: pinned to the
        origin that stored it, which gets the id it made, when the id is one
        this gateway made for the caller's tenant (dataplane.upstream.
        responseids). Any other id (another tenant's, forged, made before ids
        were signed, or never through this gateway: an origin's own id, which
        an id of ours shows as its prefix) is a 400 previous_response_not_found
        with no origin called, as is an id whose origin is not one this
        request may use now (drained, removed, not serving the model): no
        other origin has the state. One the table marks unhealthy is a 503
        to retry (pinned_origin_unhealthy). Under a table without id keys
        (an older control plane's) nothing is pinned: the id goes on as it
        came, as before the ids were the proxy's."""
        sent = ex.body.get("previous_response_id")
        if sent is None:
            return
        keys = ex.routes.id_keys
        if keys is None:
            return
        assert ex.tenant is not None  # assembled
        signed_for, legacy = ex.tenant.signs_for(ex.principal.tenant)
        decoded = keys.verified(sent, signed_for, legacy) if isinstance(sent, str) else None
        if decoded is None:
            # The same words for an id of another tenant as for one that was
            # never made: the answer tells no one whose an id is.
            raise previous_response_not_found(
                sent if isinstance(sent, str) else "",
                "ids must be ones this gateway returned to you (an id made before its "
                "responses ids were signed, or by an origin directly, cannot be continued)",
            )
        target = ex.routes.stored_on.get(decoded.origin)
        if target is None or not ex.routes.serves(target, ex.model):
            if ex.model in ex.routes.unhealthy_stores.get(decoded.origin, ()):
                raise pinned_origin_unhealthy()
            if target is not None:
                # Serving, but not this model (a follow-up that switched
                # models): its store is there for a model the origin serves.
                raise previous_response_not_found(
                    sent,
                    f"it is stored on an origin that does not serve model '{ex.model}'; go "
                    "on with a model the conversation used, or start it again",
                )
            raise previous_response_not_found(
                sent,
                f"it is stored on an origin that is not serving model '{ex.model}' now "
                "(drained or removed); start the conversation again",
            )
        ex.body["previous_response_id"] = decoded.original
        ex.rewritten = True
        ex.pinned = target
        ex.previous = (decoded.original, sent)

    @staticmethod
    def shown_ids(ex: Exchange, origin: OriginAnswer, ids: list[str]) -> Rewriter:
        """What rewrites a Responses answer of `origin` for its client: the
        response's own id (the first of `ids`, when the answer names one and
        the table has id keys) as an id of ours, and the pinned previous id
        as the client sent it."""
        shown: dict[str, str] = {}
        keys = ex.routes.id_keys
        if ids and keys is not None and keys.encodable(own := ids[0]):
            tenant = ex.principal.tenant
            signed_for = ex.tenant.signs_for(tenant)[0] if ex.tenant is not None else tenant
            shown[own] = keys.encode(own, origin.target.id_tag, signed_for)
        if ex.previous is not None:
            shown[ex.previous[0]] = ex.previous[1]
        return Rewriter(shown)

    async def admit(self, ex: Exchange) -> None:
        """Take the request's place under its scopes' limits, or refuse it (429/400)."""
        waiting = self.admit_now(ex)
        if waiting is not None:
            await waiting

    def admit_now(self, ex: Exchange) -> Coroutine[Any, Any, None] | None:
        """`admit` without a coroutine when it need not wait (nearly always:
        a coroutine that never waits costs some 1,000 instructions more):
        None once the request is admitted (raises its refusal), else the
        wait for a concurrency slot (`admit_when_slot_frees`) to await."""
        limiter = self.limiter
        scopes = ex.principal.scopes
        # With no scope limited (the defaults) admission does not read the
        # estimate: it is not made for it.
        est = ex.estimate if limiter.limiting else 0
        # Only a budget's charge reads it. Not of a request whose prompt the
        # estimate cannot see whole (a Responses turn on stored state): the
        # completion expected also stands for that prompt (review).
        most, choices = None, 1
        if limiter.budgeted and not continues_stored(ex.endpoint.name, ex.body):
            choices = completion_choices(ex.endpoint.name, ex.body)
            most = completion_bound(ex.endpoint.name, ex.body, choices)
        now = time.monotonic()
        admission = limiter.admit(scopes, est, now, most=most, choices=choices)
        if admission.ok:
            # An admission's own headers read, not asked for: a call each request.
            ex.limit_headers, ex.limit_lines = admission.headers, admission.lines
            ex.admission = admission
            return None
        if admission.limit == "concurrency" and limiter.may_wait(scopes, now):
            return self._admit_after_wait(ex, est, now, most, choices)
        raise self._refused(ex, admission, now)

    async def _admit_after_wait(
        self, ex: Exchange, est: int, refused_at: float, most: int | None, choices: int
    ) -> None:
        """`admit_now`'s wait for a concurrency slot, refused at `refused_at`."""
        limiter, scopes = self.limiter, ex.principal.scopes
        try:
            admission = await admit_when_slot_frees(
                limiter, scopes, est, refused_at, most, choices, self.slot_wait
            )
        except asyncio.CancelledError:
            # The client left during the wait (a 499), or the proxy
            # stopped the request as it shut down: a wait all the same.
            self.metrics.slot_wait(ex.principal.tenant, "abandoned")
            raise
        now = self.slot_wait.clock()
        outcome = "admitted" if admission.ok else "refused"
        self.metrics.slot_wait(ex.principal.tenant, outcome)
        if not admission.ok:
            raise self._refused(ex, admission, now)
        ex.limit_headers, ex.limit_lines = admission.headers, admission.lines
        ex.admission = admission

    def _refused(self, ex: Exchange, admission: Admission, now: float) -> ApiError:
        """The refusal of `ex` by `admission`, with the limits' headers as of
        `now`, counted."""
        ex.limit_headers = self.limiter.headers(ex.principal.scopes, now, admission)
        ex.limit_lines = None
        limit = "tokens_over_limit" if admission.too_large else admission.limit or "requests"
        self.metrics.limit_refusal(ex.principal.tenant, limit)
        return refusal(admission, *batch_of(ex))

    async def answer(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        """From the cache, a flight, or an origin, as the cache step decides."""
        assert ex.tenant is not None
        # Positional (endpoint, body, tenant, stream, cache_control, headers,
        # keyable, size): keywords cost the call some 1,800 instructions more.
        creq = ex.cache_request = CacheRequest(
            ex.endpoint.name,
            ex.body,
            ex.tenant,
            ex.stream,
            ", ".join(ex.headers.getall("cache-control", ())),
            ex.headers,
            ex.keyable,
            len(ex.raw),
        )
        if ex.trace is None:
            planned = self.cache.plan_now(creq)
            if not isinstance(planned, CachePlan):
                planned = await planned
            plan = ex.cache = planned
        else:
            with ex.trace.cache_step(ex):
                plan = ex.cache = await self.cache.plan(creq)
        if plan.not_cached:
            ex.usage = Usage(0, 0)  # no origin was asked: the estimate back
            raise not_cached(plan.reason if plan.outcome == "bypass" else "")
        try:
            if plan.entry is not None:
                ex.usage = Usage(0, 0)  # no origin tokens were spent: the estimate back
                replayed = reply.replay(ex, plan.entry, plan.similarity)
                if (now := sent_now(request, ex, self.draining, replayed)) is not None:
                    return now
                return await sent(request, ex, replayed)
            # A follower whose leader's client left may follow a new flight
            # (EdgeCache.own_call): as often as leaders leave, one at a time.
            while plan.follower is not None:
                try:
                    followed = await reply.follow(request, ex, plan.follower, self.stream_hold_s)
                except BaseException:
                    # Its client left (a 499) while it followed: a coalesced
                    # hit all the same, as the access log says, and charged
                    # as one, 0: no origin was sent its prompt (`_settle`;
                    # trial 98: it kept the prompt's estimate).
                    self.cache.count_coalesced()
                    raise
                if followed is not None:
                    # Answered from the flight, whole or not: counted as the
                    # access log and the GenAI metrics have it, a hit.
                    self.cache.count_coalesced()
                    response, whole = followed
                    if not whole:  # the flight's stream was cut, and so was this copy
                        ex.stream_error = "stream_cut"
                    ex.usage = Usage(0, 0)
                    if (relayed := sent_now(request, ex, self.draining, response)) is not None:
                        return relayed
                    return await sent(request, ex, response)
                plan = ex.cache = await self.cache.own_call(creq, plan)
            if ex.stream and (hold_s := self.stream_hold_s) is not None:
                held = await self.forward_held(request, ex, plan, hold_s)
                if isinstance(held, web.StreamResponse):  # its error event was sent
                    return held
                origin = held
            else:
                origin = await self.forward(ex, self.hedge_for(ex))
            if ex.trace is not None:
                ex.trace.answered(origin)
            if origin.streamed and origin.status < 400 and plan.leader is not None:
                return await self.lead(request, ex, origin, plan)
            try:
                if origin.streamed and origin.status < 400:
                    return await self.relay(request, ex, origin, plan)
                responded = self.respond(request, ex, origin, plan)
                # Told by the coroutine's own type: isinstance of a response
                # (an ABC's subclass) is a Python frame (see sent_now), and so
                # is cast (some 650 instructions, callgrind on a loop).
                if type(responded) is CoroutineType:
                    responded = await responded
                if TYPE_CHECKING:
                    assert isinstance(responded, web.StreamResponse)
                return responded
            finally:
                origin.release()
        except BaseException as exc:
            if not ex.detached:  # else the flight's task reports the outcome
                plan.abandon(exc)
            raise

    async def forward_held(
        self, request: web.Request, ex: Exchange, plan: CachePlan, hold_s: float
    ) -> OriginAnswer | web.StreamResponse:
        """`forward` for a stream whose head goes out `hold_s` after its call
        when its origin's first event has not come (dataplane.http.hold;
        `ex.held` once it has, here or while the request followed a flight).
        A failure after the head is the stream's error event
        (reply.held_failed): the response is returned, ended."""
        # With a head sent (a flight it followed failed before an event), its
        # comments go on while its own call waits (review 314).
        held = HeldHead(
            hold_s,
            partial(reply.held_head, ex, plan.outcome),
            partial(reply.prepare_held, request, ex),
            sent=ex.held,
            holds=self.holds,
        )
        try:
            origin = await self.forward(ex, self.hedge_for(ex))
        except ApiError as exc:
            out = await held.stop()
            if out is None:
                raise
            # The client has the stream's head (a 200): the error is its
            # event, as a cut stream's is. A flight it leads fails as it
            # would have (its followers make their own calls).
            plan.abandon(exc)
            return await reply.held_failed(
                ex, out, exc.error(), exc.recorded or exc.code or "", exc.status
            )
        except asyncio.CancelledError:
            out = await held.stop()
            if out is not None:  # a stopping server's stream ends as a relay's does
                await reply.held_stopped(request, ex, out)
            raise
        except BaseException:
            held.abandon()
            raise
        try:
            ex.held = await held.stop()
        except BaseException:
            # Its client left (or the proxy stopped) while the comments
            # ended: nothing else holds the answer the forward opened, whose
            # connection and the tenant's place at its origin it keeps. The
            # call ends here, counted as one the relay's client left is.
            self.metrics.attempt(origin.target.name, "cancelled").inc()
            origin.release()
            raise
        return origin

    @staticmethod
    def hedge_for(ex: Exchange) -> HedgeSetting | None:
        """The tenant's hedge for this model, but never for a Responses request
        the origin stores (the default): a hedge would store it twice, on two
        origins, and the client would be told one id."""
        assert ex.tenant is not None
        if ex.endpoint.name == "responses" and ex.body.get("store", True) is not False:
            return None
        return ex.tenant.streams.hedge_for(ex.model)

    def placement_key_of(self, ex: Exchange) -> Key | None:
        """The key affinity places `ex` by (dataplane.placement.keys). Pure:
        safe on the off-loop thread."""
        assert ex.tenant is not None
        return placement_key(
            ex.endpoint.name,
            ex.body,
            ex.headers,
            ex.tenant.name,
            user_sessions=ex.tenant.routing.user_sessions,
            session_header=self.session_header,
        )

    async def forward(self, ex: Exchange, hedge: HedgeSetting | None = None) -> OriginAnswer:
        """Route (region by the client's home, the origin inside it by the
        tenant's policy), then call; with `hedge`, a slow first origin gets a
        hedge (`Forwarder.forward`)."""
        forwarder = self.forwarder
        if ex.pinned is not None:
            # The origin that stored the previous response, alone: another
            # lacks its state (no failover, and no hedge with one candidate).
            candidates = ex.candidates = [ex.pinned]
            ex.route = "pinned"
        else:
            home, point = self.locator.place(ex.routes, ex.remote, ex.headers)
            assert ex.tenant is not None
            mode = ex.tenant.routing.mode_for(ex.endpoint.name, ex.model)
            key: Key | None = None
            if mode == AFFINITY:
                # A large body's key is made off the loop: it reads a chat
                # request's tools whole (their repr: 0.15 s of 10,000 tools,
                # on the loop). Made only when it places: a large batch of
                # embeddings (least loaded) does not queue on the thread
                # behind another body's steps for it.
                if len(ex.raw) > OFF_LOOP_ABOVE:
                    key = await self.off_loop.run(self.placement_key_of, ex)
                else:
                    key = self.placement_key_of(ex)
                ex.placement = key
            candidates = ex.candidates = self.place(
                ex, home, forwarder.candidate_limit(), point, mode, key
            )
        if not candidates:
            ex.usage = Usage(0, 0)  # no origin was called: the estimate back
            raise ApiError(
                503,
                f"no healthy origin serves model '{ex.model}' now (drained or unhealthy)",
                type="server_error",
                code="no_healthy_origin",
                headers={"retry-after": "5"},
            )
        spliced = ex.usage_added and not ex.rewritten and "stream_options" not in ex.body
        if ex.usage_added:
            body = with_usage_asked(ex.body, None if ex.rewritten else ex.raw)
        else:
            body = jsonio.dumps(ex.body) if ex.rewritten else ex.raw
        # The bytes sent stand for the client's from here (only their size and
        # media markers are read after: `usage.ceilings`), so a body the proxy
        # changed (a stream asked for usage, a tenant's system prompt) is held
        # once as bytes, not twice: a 7.5 MB base64 image was 3 copies a
        # stream (the client's bytes, the parsed string, the spliced bytes).
        ex.raw = body
        headers, lines = forwarder.origin_headers(ex.headers, ex.request_id, ex.traceparent)
        sent = Sent()
        try:
            answer = await forwarder.forward(
                ex.endpoint.upstream_path,
                body,
                headers,
                candidates,
                hedge=hedge,
                stream=ex.stream,
                trace=ex.trace,
                spent_s=ex.cache.waited_s if ex.cache is not None else 0.0,
                sent=sent,
                first_chunk_within=ex.idle_timeout_s,
                tenants_own=ex.idle_timeout_own,
                tenant=ex.principal.tenant,
                model=ex.model,
                max_tokens_added=ex.max_tokens_added,
                plain_body=(
                    (lambda: without_usage_asked(body))
                    if spliced
                    else lambda: jsonio.dumps(ex.body)
                )
                if ex.usage_added
                else None,
                inputs=batch_of(ex)[0] if ex.endpoint.name in BATCHES else 0,
                lines=lines,
            )
        except ApiError as exc:
            ex.attempts = exc.attempts
            # No origin answered: none is charged for (billing trial 76: a
            # 502 after 500s charged the budgets the prompt's estimate that
            # the access log and ponto_tenant_tokens_total never saw).
            ex.usage = Usage(0, 0)
            if ex.pinned is not None:
                pinned_origin_failed(exc, ROUTE_HEADER)
            raise
        except asyncio.CancelledError:
            # Its client left (a 499) after calls were sent: they are in its record.
            ex.attempts = sent.calls
            if sent.open > 1:
                # A hedge under way beside the first call: each copy was sent
                # the prompt, and each is charged it (`_settle`).
                ex.hedge_calls = sent.open - 1
                ex.hedge_prompt = ex.estimate * ex.hedge_calls
            if sent.target is not None:
                ex.origin, ex.region = sent.target.name, sent.target.region
            raise
        ex.origin, ex.region = answer.target.name, answer.target.region
        ex.origin_request_id = origin_request_id(answer.headers, ex.request_id)
        ex.attempts = answer.calls
        if answer.extra_calls:
            # A cancelled hedge still cost its origin the prompt's prefill,
            # charged however the request ends from here.
            ex.hedge_prompt = ex.estimate * answer.extra_calls
            ex.hedge_calls = answer.extra_calls
        ex.hedged = answer.hedged
        if answer.hedged:
            ex.route = "hedge"  # the chosen origin was slower than the next one
        elif answer.target is not candidates[0]:
            ex.route = "failover"  # the chosen origin failed or is ejected
        self.metrics.routes.add(ex.route, ex.origin)
        return answer

    def place(
        self,
        ex: Exchange,
        home: str,
        limit: int,
        point: Point | None,
        mode: str,
        key: Key | None,
    ) -> list[Target]:
        """The candidates in the order to try them; sets why the first was chosen.
        `point`: where GeoIP placed the client (`Routes.groups_for`); `mode`:
        the tenant's for the request, and `key` its placement key under
        affinity (`placement_key_of`; None under another mode)."""
        assert ex.tenant is not None
        routes = ex.routes
        rules = ex.tenant.routing
        groups = routes.groups_for(ex.model, home, point)
        candidates, ex.route = self.picker.order(
            groups,
            mode,
            key,
            load_bound=rules.load_bound,
            limit=limit,
            passed_over=self.forwarder.outliers.passed_over,
        )
        if candidates and candidates[0].region != home and home in routes.known:
            # No origin of the client's own region lists the model (a model
            # served in one region only is not failing over, nor spilling,
            # from the others), or the region is past its spill threshold, or
            # has no usable origin for the model.
            if (home, ex.model) not in routes.served:
                ex.route = "remote"
            elif home in routes.hot:
                ex.route = "spill"
            else:
                ex.route = "failover"
        return candidates

    def respond(
        self, request: web.Request, ex: Exchange, origin: OriginAnswer, plan: CachePlan
    ) -> web.StreamResponse | Coroutine[Any, Any, web.StreamResponse]:
        """A non-streamed answer: sent as is (an error one allowlisted, see
        reply.origin_body), at once; then its JSON (parsed once: by the
        forwarder, or here after sending) gives the token count and the
        cache's entry. An error sent as a stream is answered from its first
        chunk.

        The response when nothing waited (most answers: written at once,
        nothing to store), else a coroutine that finishes it, which the
        caller awaits: a coroutine that never waits costs some 1,000
        instructions more (every whole answer)."""
        body = origin.body if origin.body is not None else origin.first
        assert ex.cache_request is not None
        # A 2xx whole body comes parsed, unless large (the forwarder refuses
        # one that is no JSON object); any other is parsed here, after sending.
        parsed = origin.parsed is not jsonio.NOT_PARSED
        obj: Any = origin.parsed if parsed else None
        shown: Rewriter | None = None
        if ex.endpoint.name == "responses" and 200 <= origin.status < 300:
            ids = ids_of(obj if parsed else jsonio.loads_or_none(body))
            shown = self.shown_ids(ex, origin, ids[:1])
            body = shown.whole(body)
        elif ex.previous is not None and origin.status >= 400:
            # The origin's error names the previous id as it knows it (vLLM:
            # "Response with id 'resp_...' not found"): the client's is shown.
            body = rewrite_words(body, dict((ex.previous,)))
            if origin.status == 404 and ex.previous[1].encode() in body:
                # That it holds no such response (a 404 for the model names
                # no id): told as OpenAI and the proxy's own refusals tell it,
                # from here on (the reply, the access line) a 400.
                origin.status = 400
                body = previous_response_gone(ex.previous[1]).body()
        # Known before the headers (x-ponto-cache-reason of an answer not
        # kept), unless the body is too large to parse before sending.
        entry = self.cache.whole_entry(ex.cache_request, plan, origin.status, body, obj)
        answer: web.Response | None = None
        if ex.stream and not parsed and ex.held is not None and origin.status < 300:
            # Its stream's head went out: a large whole answer (not parsed
            # before sending) is parsed now, to follow it as frames (review
            # 314: it was the stream's error event, and charged).
            obj = jsonio.loads_or_none(body)
            parsed = obj is not None
        if ex.stream and parsed:
            # Asked for a stream, answered whole (an origin that ignores
            # `stream`): the client gets the stream it asked for.
            frames: bytes | CachedResponse | None
            if ex.endpoint.name == "responses":
                frames = response_events(obj)
                if frames is not None and shown is not None:
                    frames = shown.whole(frames)
            else:
                frames = from_completion(body, now=0.0, store_truncated=True, parsed=obj)
            if frames is not None:
                answer = reply.origin_stream(ex, origin, plan.outcome, frames)
        if answer is None:
            answer = reply.origin_body(ex, origin, plan.outcome, body)
        if ex.held is None and (now := sent_now(request, ex, self.draining, answer)) is not None:
            if not parsed and len(body) > OFF_LOOP_ABOVE:
                return self._respond_later(
                    request, ex, origin, plan, answer, body, obj, parsed, entry, now
                )
            entry = self._answered(ex, origin, plan, body, obj, parsed, entry)
            if entry is None:  # nothing to keep: settle_body's steps, without its coroutine
                self.cache.finish_flight(plan, None)
                return now
            return self._settled(ex.cache_request, plan, entry, now)
        return self._respond_later(request, ex, origin, plan, answer, body, obj, parsed, entry)

    async def _respond_later(
        self,
        request: web.Request,
        ex: Exchange,
        origin: OriginAnswer,
        plan: CachePlan,
        answer: web.Response,
        body: bytes,
        obj: Any,
        parsed: bool,
        entry: CachedResponse | None,
        response: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """`respond`'s end for an answer that waits to be sent: into a
        stream's head that went out while the origin thought, or as the
        edge's writer allows; or that was sent (`response`) and waits for
        its parse."""
        assert ex.cache_request is not None
        if response is None and ex.held is not None:
            response = await reply.into_held(ex, ex.held, answer)
        if response is None:
            response = await sent(request, ex, answer)
        # A large answer not parsed before sending (a success's: an error's
        # is not read) is parsed off the loop (dataplane.offload): 15 MB of
        # embeddings held it over a second.
        read = jsonio.NOT_PARSED
        if not parsed and origin.status < 400 and len(body) > OFF_LOOP_ABOVE:
            read = await self._read_sent(body)
        entry = self._answered(ex, origin, plan, body, obj, parsed, entry, read)
        if entry is None:
            self.cache.finish_flight(plan, None)
        else:
            await self.cache.settle_body(ex.cache_request, plan, entry)
        return response

    async def _settled(
        self,
        creq: CacheRequest,
        plan: CachePlan,
        entry: CachedResponse,
        response: web.StreamResponse,
    ) -> web.StreamResponse:
        """`respond`'s end for a sent answer whose entry is kept."""
        await self.cache.settle_body(creq, plan, entry)
        return response

    async def _read_sent(self, body: bytes) -> Any:
        """`body`, an answer its client was sent whole, parsed off the loop
        (dataplane.offload). A cancellation meanwhile (the client left once
        it had the answer, as curl does at its end) waits for the parse and
        is undone: the answer was delivered, so it is charged what it says
        and kept as any other (a 200, not a 499), as `_lead` does for a
        stream delivered before its cancellation. The parse is bounded (one
        answer), so a stop waits no longer than the answer's write took."""
        parse = asyncio.ensure_future(self.off_loop.run(jsonio.loads_or_none, body))
        try:
            return await asyncio.shield(parse)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or not current.cancelling():
                raise
            # A second cancellation (a stop past its wait) ends it at once.
            await asyncio.wait((parse,))
            current.uncancel()
            return parse.result()

    def _answered(
        self,
        ex: Exchange,
        origin: OriginAnswer,
        plan: CachePlan,
        body: bytes,
        obj: Any,
        parsed: bool,
        entry: CachedResponse | None,
        read: Any = jsonio.NOT_PARSED,
    ) -> CachedResponse | None:
        """Once a whole answer is sent: its usage (`ex.usage`), and the
        cache's entry of it (`entry`, made before sending when its JSON was
        parsed then; else made now, of `body` parsed: `read`, when the
        caller parsed it after sending)."""
        assert ex.cache_request is not None
        if origin.status < 400 and (parsed or plan.key or b'"usage"' in body):
            if not parsed:
                obj = jsonio.loads_or_none(body) if read is jsonio.NOT_PARSED else read
            # A whole answer's completion estimate: about four bytes a token.
            read = rerank_usage_of if ex.endpoint.name == "rerank" else usage_of
            ex.usage = self.believe(ex, origin.target.name, read(obj), len(body), len(body) // 4)
        elif origin.status >= 400:
            # An error answer is no answer: nothing is charged, the prompt's
            # estimate is given back as for a cache hit, whatever an origin
            # may have spent before failing (a 5xx, or a 4xx after another
            # origin's 500: review 49 kept the estimate, which only the
            # budgets then charged; billing trial 76). What is charged is
            # what the access log and ponto_tenant_tokens_total show.
            ex.usage = Usage(0, 0)
        if not parsed:
            name = ex.endpoint.name
            if name in BATCHES:
                unlike = miscounted if name == "embeddings" else misranked
                if unlike(obj, batch_of(ex)[0]):
                    # Too large to be checked before it was sent (the forwarder
                    # fails a smaller one over): relayed, but never kept.
                    obj = None
            entry = self.cache.whole_entry(ex.cache_request, plan, origin.status, body, obj)
        return entry

    async def lead(
        self, request: web.Request, ex: Exchange, origin: OriginAnswer, plan: CachePlan
    ) -> web.StreamResponse:
        """A stream that leads a flight: relayed (`relay`) by a task of the
        flight's own, which this request awaits, and which releases the
        origin's answer and reports the flight's outcome.

        The client leaving cancels this request, not that task, while the
        flight has followers (docs/architecture.md, step 10): the origin's
        stream goes on feeding them and the cache's recorder to its end, or
        until the last follower leaves or the proxy stops (`close`); the
        stream's idle timeout still applies, as for any relay (`--deadline`
        bounds the wait for an answer to start, not a stream under way). The
        request is recorded at once as the 499 it is (its tokens: those
        counted until then), and settled by the task at its end, with every
        token the origin spent. Without followers the task is cancelled at
        once: an origin generating for nobody stops.

        Once followed, the relay does not wait for the client either
        (reply.LeaderStream queues its writes): the request ends once its
        client has taken the queue, after the relay's end. A client further
        behind than the flight's bound is cut (`_let_go`): it ends as a
        lagging follower's does, the flight's task going on, detached.
        """
        assert plan.leader is not None
        task: asyncio.Task[web.StreamResponse]

        def stop() -> None:
            task.cancel()

        lead = reply.LeaderStream(plan.leader, stop)
        task = asyncio.get_running_loop().create_task(self._led(request, ex, origin, plan, lead))
        try:
            return await self._lead(request, ex, task, lead)
        finally:
            lead.close()  # whatever is left queued for a client this request no longer has

    async def _lead(
        self,
        request: web.Request,
        ex: Exchange,
        task: asyncio.Task[web.StreamResponse],
        lead: reply.LeaderStream,
    ) -> web.StreamResponse:
        try:
            await _relayed_or_let_go(task, lead)
            if lead.lagged:
                await asyncio.wait((lead.let_go,))  # its ending written, or it left
                return await self._let_go(ex, task, lead)
            out = task.result()
            # Once followed, the relay only queued the client's last writes.
            await lead.drained()
            if lead.failed:
                raise ConnectionResetError("the client left during its stream")
            return out
        except asyncio.CancelledError:
            current = asyncio.current_task()
            cancelled = current is not None and current.cancelling() > 0
            if not cancelled:
                # Not this request but the task was stopped: its client had
                # gone (a failed write), then its last follower.
                raise ConnectionResetError("the client left during its stream") from None
            if task.done() and not task.cancelled() and lead.delivered:
                # The relay ended (at the stream's end, or at its client's
                # leaving, which a write saw first), and the client was
                # handed all of it, before this cancellation came: answered
                # as if the cancellation had come after.
                if current is not None:
                    current.uncancel()
                if lead.lagged:
                    return await self._let_go(ex, task, lead)
                return task.result()
            # A stopping server cancels every request, followers too: the
            # relay is not left running for them, and its client, still
            # there, is sent the stream's ending (reply.relay_origin), after
            # what was queued for it, within STOPPED_WRITE_S.
            if not task.done() and not stopping(request) and self._detach(ex, task, lead):
                raise
            task.cancel()
            # Its clean-up (the flight told, the origin's connection closed)
            # before this request settles.
            await asyncio.wait((task,))
            if not task.cancelled():
                task.exception()  # retrieved: this request's cancellation is what it reports
            if stopping(request) and not lead.gone:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOPPED_WRITE_S):
                        await lead.drained()
            raise

    async def _let_go(
        self, ex: Exchange, task: asyncio.Task[web.StreamResponse], lead: reply.LeaderStream
    ) -> web.StreamResponse:
        """The request of a leader whose client fell further behind its
        flight than the flight's bound, and was cut (reply.LeaderStream): it
        ends as a lagging follower's does, its stream cut, while the flight's
        task goes on for the followers (detached, as when a client leaves)."""
        if not task.done() and not self._detach(ex, task, lead):
            task.cancel()  # its followers left too: see `stop`
            await asyncio.wait((task,))
        if task.done() and not task.cancelled():
            task.result()  # a failure of the relay's is still reported
        if lead.failed:  # it left before it took its ending
            raise ConnectionResetError("the client left during its stream")
        ex.stream_error = "stream_cut"
        assert lead.out is not None
        return lead.out

    async def _led(
        self,
        request: web.Request,
        ex: Exchange,
        origin: OriginAnswer,
        plan: CachePlan,
        lead: reply.LeaderStream,
    ) -> web.StreamResponse:
        """The flight's task (`lead`)."""
        try:
            try:
                return await self.relay(request, ex, origin, plan, lead)
            finally:
                origin.release()
        except asyncio.CancelledError as exc:
            plan.abandon(exc)
            # The relay's frames hold this task (its IdleTimeout, `lead`'s
            # stop) and the request: kept by the cancellation, a cycle only a
            # full collection frees, with the request's body (edge.bare).
            raise bare(exc) from None
        except BaseException as exc:
            plan.abandon(exc)
            raise
        finally:
            if ex.detached:
                self._settle(ex)
                # The boundary let go of no answer when the client left (this
                # task still wrote to it): the stream holds its request until
                # its end is written, which a client gone never takes, and the
                # request holds this exchange, whose answer it is.
                ex.answer = ex.held = None
            del request, ex, origin, plan, lead  # nor this frame, which the exception holds

    def _detach(
        self,
        ex: Exchange,
        task: asyncio.Task[web.StreamResponse],
        lead: reply.LeaderStream,
    ) -> bool:
        """Leave the flight's task running without the request whose client
        left, if the flight has followers (see `lead`)."""
        if not lead.detach():
            return False
        ex.detached = True
        ex.usage = spent(ex)  # its record's: the tokens until its client left
        detached = self._detached
        detached.add(task)

        def ended(_: asyncio.Task[web.StreamResponse]) -> None:
            detached.discard(task)
            # No handler is left to surface a failure (shield marks it
            # retrieved): a bug is logged here, once.
            exc = None if task.cancelled() else task.exception()
            if exc is not None and not isinstance(exc, ConnectionError):
                log.error("a flight relayed for followers failed; %s", ex.request_id, exc_info=exc)

        task.add_done_callback(ended)
        return True

    async def relay(
        self,
        request: web.Request,
        ex: Exchange,
        origin: OriginAnswer,
        plan: CachePlan,
        lead: reply.LeaderStream | None = None,
    ) -> web.StreamResponse:
        """A stream: relayed as it comes, counted and recorded on the way."""
        assert ex.cache_request is not None and ex.tenant is not None
        trace = ex.trace
        rules = ex.tenant.streams
        continuable = ex.endpoint.name in CONTINUABLE
        counter = ex.counter = UsageCounter(
            [] if trace is not None and trace.recording else None,
            set() if continuable and counts_finishes(ex.body) else None,
        )
        resume = transcript = whole = None
        if continuable and not rules.continuation:
            whole = Finished(ex, counter, self.metrics, origin.target.name)
        elif continuable:
            transcript = Transcript(self.transcripts)
            resume = Continuations(
                ex,
                self.forwarder,
                self.metrics,
                transcript,
                origin,
                ex.candidates,
                rules.max_continuations,
            )
        shown = None
        if ex.endpoint.name == "responses" and origin.status < 300 and ex.routes.id_keys:
            # The response's id, from its response.created, however long
            # (it echoes the request's instructions and tools): its bytes
            # are held until it is whole, up to the bound of an event.
            shown = StreamIds(
                lambda ids: self.shown_ids(ex, origin, ids[:1]),
                self.forwarder.max_answer_bytes,
            )
        watch = self.stalls.watch(origin.target.name)
        try:
            out, end = await reply.relay_origin(
                request,
                ex,
                origin,
                plan,
                counter,
                idle_timeout=ex.idle_timeout_s,
                resume=resume,
                transcript=transcript,
                lead=lead,
                max_event_bytes=self.forwarder.max_answer_bytes,
                watch=watch,
                whole=whole,
                shown=shown,
                trim=counter.unasked if ex.usage_added else None,
                held=ex.held,
            )
        except asyncio.CancelledError:
            # The client left (or the proxy stopped) during the stream: the
            # origin's call ends here, counted as any call cut short so.
            current = resume.origin if resume is not None else origin.target.name
            self.metrics.attempt(current, "cancelled").inc()
            raise
        finally:
            if watch is not None:
                watch.close()
            if transcript is not None:
                transcript.release()  # a cut or cancelled stream's too
            if resume is not None:
                resume.close()
                ex.continuation_prompt = resume.extra_prompt
                ex.attempts += resume.calls
                ex.continued = resume.count
                if resume.count:
                    ex.origin, ex.region = resume.origin, resume.region
                    # The first origin's id would be read as the finisher's.
                    ex.origin_request_id = None
            # Before anything reads it (settlement, a leaving client's record).
            counter.usage = self.believe(
                ex,
                resume.origin if resume is not None else origin.target.name,
                counter.usage,
                counter.event_bytes,
                counter.content_events,
            )
        m = self.metrics
        name = resume.origin if resume is not None else origin.target.name
        if end.cut and resume is None:  # the hook counts the cuts it sees
            m.continuations.labels("refused").inc()  # off, or not continuable
            m.stream_cut(name)
            if not end.too_long and not counter.error_event and held_against(ex, end.cut):
                self.forwarder.stream_cut(name, end.cut)
            why = (
                "the tenant turned continuation off"
                if not rules.continuation
                else f"{ex.endpoint.name} streams are never continued"
            )
            log.warning(
                CUT_NOT_CONTINUED,
                name, end.cut, why, ex.request_id,
            )  # fmt: skip
        elif end.complete:
            m.upstream_attempts.add(name, "ok")
            self.forwarder.stream_answered(name)
            if resume is None or not resume.count:
                origin.ended()  # its body's end may still be on its way
        elif end.client_gone:
            m.attempt(name, "cancelled").inc()  # a write found the client gone
        if end.client_gone:
            ex.stream_error = gone_reason(request)
            # Counted when its request was cancelled; a cut is not a leaving.
            if not ex.detached and ex.stream_error == CLIENT_GONE:
                m.client_disconnects.inc()
        elif not end.complete:
            ex.stream_error = "stream_cut"
        await self.cache.settle_stream(ex.cache_request, plan, origin.status, end)
        return out

    def believe(
        self,
        ex: Exchange,
        origin: str,
        usage: Usage | None,
        answer_bytes: int,
        completion_estimate: int,
    ) -> Usage | None:
        """`usage`, from `origin`'s answer of `answer_bytes` to `ex`, as the
        proxy believes it (usage.believed): what settlement, budgets, metrics
        and the access log then read. One it does not believe is counted
        (ponto_origin_usage_rejected_total) and told, once a minute per origin."""
        if usage is None:
            return None
        bound = completion_bound(ex.endpoint.name, ex.body)
        if within_floors(usage, len(ex.raw), answer_bytes, bound):
            return usage
        found, why = believed(
            usage,
            # A continued stream's prompt holds what came before each cut
            # (the Splicer sums the calls': review, a 20k-token one was not
            # believed): that much more, of the answer's bytes.
            ceilings(ex.endpoint.name, ex.body, ex.raw, ex.estimate, answer_bytes * ex.continued),
            answer_bytes,
            ex.estimate,
            completion_estimate,
        )
        if why:
            self.metrics.usage_rejected.labels(origin, why).inc()
            self._unbelieved.log(
                origin,
                logging.WARNING,
                "origin %s answered with a usage the proxy does not believe (%s: "
                "prompt %s, completion %s); counted %d and %d instead; %s",
                origin, why, usage.prompt_tokens if not usage.rejected else "?",
                usage.completion_tokens if not usage.rejected else "?",
                found.prompt_tokens, found.completion_tokens, ex.request_id,
            )  # fmt: skip
        return found

    def settle(self, ex: Exchange) -> None:
        """Give back what admission took, with the tokens actually spent, and
        account them. Runs however the answer ended (cancellation included),
        but for a detached leader (`lead`), which its flight's task settles."""
        if not ex.detached:
            self._settle(ex)

    def _settle(self, ex: Exchange) -> None:
        # The answering call's own usage, before hedges' and continuations'
        # prompts are added: what its origin's prefix cache held is of it alone.
        own = ex.usage if ex.counter is None else ex.counter.usage
        usage = spent(ex)
        if usage is None and not ex.attempts:
            # No count, and no origin call began: its client left while it
            # waited for the cache, this proxy's flight or a region's.
            # Charged 0, the estimate back, as a follower and a hit are
            # (review 424: a region's follower kept it, shown nowhere).
            usage = Usage(0, 0)
        if ex.admission is not None:
            # None keeps the estimate (and the hedges' beside it), and teaches
            # the budgets nothing of the completions to expect (a count
            # would: one of 0 here).
            if usage is not None:
                ex.admission.release(usage.total, time.monotonic())
            else:
                ex.admission.release(None, time.monotonic(), ex.hedge_prompt)
        if usage is None:
            # No count, though an origin call began (a whole answer without
            # `usage`, or a client that left before any answer: a phone's
            # timeout and each of its SDK's retries; a call still waiting for
            # its connection is one, as the line's attempts count it): the
            # limits and budgets keep the estimate, so the metrics and the
            # access log show it, as the proxy's (trial 98: 3 timed-out
            # retries of a long prompt took 15,024 tokens of the day's budget
            # that neither saw; billing trial 76: what is charged is what
            # they show). So do its hedges' prompts: each copy was sent it.
            usage = Usage(ex.estimate + ex.hedge_prompt, 0, exact=False)
        ex.usage = usage
        self.metrics.account_tokens(ex.principal.tenant, ex.principal.key_id, usage)
        if own is not None and own.cached_tokens is not None and ex.origin and not ex.continued:
            # A continued stream's usage sums calls to several origins.
            self.metrics.account_prefix_cache(ex.origin, own)


# ---------------------------------------------------------------- the steps' parts


def spent(ex: Exchange) -> Usage | None:
    """The tokens `ex` cost so far (None: unknown): a relayed stream's count
    (with its continuations' prompts when the proxy counted), else its
    answer's usage; and the prompts of its hedges: each the winner's own
    count when the origin gave one (the same prompt was sent), else the
    estimate. `exact` is False when any part is the proxy's estimate (the
    access log's `tokens_estimated`). A new Usage each call."""
    usage = ex.usage
    extra = ex.hedge_prompt
    if ex.counter is not None:  # ex.usage holds an earlier call's result at most
        usage = ex.counter.result(ex.estimate)
        if not usage.exact:  # a summed usage already holds the continuations
            extra += ex.continuation_prompt
    if usage is None:
        return None
    exact = usage.exact
    if ex.hedge_calls and exact and not ex.continued:
        # Billing trial 76: the losers were charged the estimate (14) where
        # the winner's count (46) was known. A continued stream's count sums
        # several calls' prompts: not one call's.
        extra += usage.prompt_tokens * ex.hedge_calls - ex.hedge_prompt
    elif extra:
        exact = False
    return Usage(usage.prompt_tokens + extra, usage.completion_tokens, exact, usage.cached_tokens)


AnswerT = TypeVar("AnswerT", bound=web.StreamResponse)


async def sent(request: web.Request, ex: Exchange, response: AnswerT) -> AnswerT:
    """`response`, written now if it is a whole one (boundary.send_whole): what
    follows it in the handler is then not in the client's wait. A stream
    (prepared already) is returned as it is. On the edge `sent_now` does the
    same without a coroutine: callers try it first."""
    if isinstance(response, web.Response) and not response.prepared:
        ex.answer = response
        response.headers.setdefault(hdrs.SERVER, SERVER_NAME)
        if not await send_whole(request, response):
            ex.stream_error = gone_reason(request)  # a 499 (boundary.returned_status)
    return response


def sent_now(
    request: web.Request, ex: Exchange, draining: Draining, response: AnswerT
) -> AnswerT | None:
    """`sent` where it waits for nothing (on the edge, boundary.hand_over; or a
    stream), as a plain call: some 1,400 instructions a request fewer than
    two coroutines. None on aiohttp's own server (tests) for a whole answer,
    which the caller then awaits `sent` for. `draining`: the app's DRAINING."""
    # A WholeAnswer (nearly every proxied answer) is known by its type: a
    # web.Response is an abc's MutableMapping, and isinstance of a subclass of
    # it calls ABCMeta.__instancecheck__, a Python frame (some 1,900
    # instructions more, callgrind on a loop). The cast: mypy narrows no
    # `type(x) is` test of a TypeVar.
    # Not prepared, and its protocol: aiohttp's properties' fields read in
    # place (each property a Python call on 3.11, some 640 instructions).
    whole = type(response) is WholeAnswer
    if (
        (whole or isinstance(response, web.Response))
        and response._payload_writer is None
        and not response._eof_sent
    ):
        protocol = request._protocol
        if not isinstance(protocol, EdgeProtocol):
            return None
        ex.answer = response
        if not whole:  # a WholeAnswer's lines (or headers made) have it
            response.headers.setdefault(hdrs.SERVER, SERVER_NAME)
        if not hand_over(request, protocol, cast(web.Response, response), draining):
            ex.stream_error = gone_reason(request)  # a 499 (boundary.returned_status)
    return response


def sole_authorization(headers: CIMultiDictProxy[str]) -> str | None:
    """The request's Authorization header, None without one, or a 400 for two
    or more (errors.several_authorizations): which of them counts would be
    each reader's guess. The only credential header the proxy reads: others
    (Azure's `api-key`, Anthropic's `x-api-key`) are not read, and go to no
    origin unless --forward-headers names them."""
    values = headers.getall(hdrs.AUTHORIZATION, ())
    if len(values) > 1:
        raise several_authorizations(len(values))
    return values[0] if values else None


def refuse_suspended(policy: EdgePolicy, principal: Principal) -> None:
    """403 tenant_suspended for a caller of a tenant the table suspends, and
    403 api_key_suspended for one of a key it suspends, before anything else
    reads its request (nothing taken from its limits, nothing reaches an
    origin). The tenant's first: lifting a key's suspension does not serve
    a suspended tenant's callers."""
    if principal.tenant in policy.suspended:
        raise tenant_suspended()
    if principal.key_id in policy.suspended_keys:
        raise api_key_suspended()


def authenticate(policy: EdgePolicy, authorization: str | None) -> Principal:
    """The caller, or a 401 in OpenAI's words (Unauthorized), or a 503
    auth_unavailable for a JWT of a tenant whose JWT config the proxy could
    not load; KeysPending for a JWT whose keys are being fetched
    (`authenticate_waiting` waits for them)."""
    try:
        return policy.authenticator.authenticate(authorization, time.time())
    except AuthError as exc:
        raise Unauthorized(exc) from None
    except AuthUnavailable as exc:
        raise AuthUnavailableError(exc) from None


async def authenticate_waiting(policy: EdgePolicy, authorization: str | None) -> Principal:
    """authenticate, waiting (bounded) for keys being fetched, as a proxied
    request does (Pipeline.authenticate_after)."""
    try:
        return authenticate(policy, authorization)
    except KeysPending as pending:
        await pending.wait()
    try:
        return authenticate(policy, authorization)
    except KeysPending as again:
        raise AuthUnavailableError(AuthUnavailable(again.tenant)) from None


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's JSON body as bytes, its content coding undone: 415 for
    another type or coding, 413 past `limit`, 408 past the body deadline
    (dataplane.http.edge), 400 for a body its framing or coding breaks.

    Expects the body as sent: the listener must not decode it (EdgeRunner
    turns aiohttp's decoding off)."""
    raw = read_body_now(request, limit)
    if raw is not None:
        return raw
    if request._state.get(CONTINUE_PENDING):
        # The head passed every check: now the client may send the body.
        del request._state[CONTINUE_PENDING]
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's: the answer's size excludes it
    try:
        raw = await request.read()
    except _UNREAD as exc:
        raise _unread(exc, limit) from None
    return _decoded(request, raw, limit)


def read_body_now(request: web.Request, limit: int) -> bytes | None:
    """`read_body`'s answer (or refusal) without a wait, when the whole body
    is in: the usual case, a body that came with its head. None when it is
    still coming, or has no declared length: await `read_body` then."""
    # The usual header's value as sent is its media type: aiohttp's property
    # (a parse of the value, a copy of its parameters) is asked only for
    # another, which it lowercases and strips of parameters.
    headers = request._headers
    sent = headers.get(hdrs.CONTENT_TYPE)
    if sent != "application/json" and request.content_type != "application/json":
        if request.content is EMPTY_PAYLOAD:
            # No body at all (Content-Length: 0, or no framing: `curl -X POST`
            # sends no type either): the missing body is what to fix, not a
            # type the client had nothing to send under.
            raise empty_body(request)
        # aiohttp reports a missing header as application/octet-stream.
        shown = "missing" if sent is None else request.content_type
        raise ApiError(
            415,
            f"Content-Type must be application/json, not {shown}",
            code="unsupported_media_type",
        )
    # A declared length over the limit is refused before reading a byte;
    # chunked bodies are cut off by aiohttp's client_max_size while reading.
    # aiohttp's content_length property, read as it does (a Python call on
    # 3.11, some 640 instructions); its parser took only digits for the value.
    declared = headers.get(hdrs.CONTENT_LENGTH)
    length = None if declared is None else int(declared)
    if length is not None and length > limit:
        raise body_too_large(limit)
    content = request._payload
    if length is None or not content.is_eof() or request._read_bytes is not None:
        return None
    try:
        # Within the limit: taken as it is, without read()'s loop.
        raw = request._read_bytes = content.read_nowait()
    except _UNREAD as exc:
        raise _unread(exc, limit) from None
    return _decoded(request, raw, limit)


# What reading a body may raise, each answered by `_unread`.
_UNREAD: Final = (
    web.HTTPRequestEntityTooLarge,
    BodyTimeout,
    OverFramed,
    web.RequestPayloadError,
)


def _unread(exc: Exception, limit: int) -> ApiError:
    """The refusal of a body whose reading raised `exc` (one of _UNREAD)."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(limit)
    if isinstance(exc, OverFramed):
        # The rest of the body is not read: the connection closes after this.
        return ApiError(
            413,
            "request body's chunked framing is larger than the body itself: "
            "send it in bigger chunks",
            code="body_too_large",
            headers={"connection": "close"},
        )
    if isinstance(exc, BodyTimeout):
        return ApiError(
            408,
            f"request body not received within {exc.args[0]:g} s",
            code="body_timeout",
            headers={"connection": "close"},
        )
    # Bad chunked framing: the rest of the connection cannot be read.
    return ApiError(
        400,
        "request body is malformed (framing)",
        code="invalid_body",
        headers={"connection": "close"},
    )


def _decoded(request: web.Request, raw: bytes, limit: int) -> bytes:
    """A body read, its content coding undone; 400 when it is empty."""
    raw = decode_body(raw, request._headers.get("content-encoding"), limit)
    if not raw:
        raise empty_body(request)
    return raw


def empty_body(request: web.Request) -> ApiError:
    """The refusal of a request without a body (or one that decodes to
    nothing). A head with neither Content-Length nor Transfer-Encoding has no
    body in HTTP/1.1 (RFC 9112 6.3), so bytes its client sent after it would
    be read as the next request's head: the answer says so and closes the
    connection, which answers nothing for them."""
    headers = request.headers
    if hdrs.CONTENT_LENGTH in headers or hdrs.TRANSFER_ENCODING in headers:
        return bad_request("request body is empty; expected a JSON object", code="invalid_json")
    return ApiError(
        400,
        "request body is empty; expected a JSON object (the request has neither "
        "Content-Length nor Transfer-Encoding, so HTTP/1.1 reads no body after its head)",
        code="invalid_json",
        headers={"connection": "close"},
    )


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object nested at most MAX_DEPTH levels and holding
    at most MAX_CONTAINERS arrays and objects, or a 400."""
    brackets = brackets_of(raw)  # once, for both bounds
    check_containers(raw, brackets)
    try:
        body = jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson stops at 1024 levels
            raise too_deep() from None
        if str(exc).startswith("number is infinity"):
            path = jsonio.past_float_at(raw)
            if path is not None:
                # Its keys as sent: a 100 KB key was quoted whole, twice.
                path = path[:256]
                raise bad_request(
                    f"'{path}' is a number too large for a 64-bit float",
                    param=path,
                    code="number_out_of_range",
                ) from None
        raise bad_request(_not_json(raw, exc), code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    check_depth(raw, body, brackets)
    return body


def parsed(endpoint: Endpoint, raw: bytes) -> tuple[dict[str, Any], bool, bool]:
    """The parse step: the body read (`read_body`) parsed once
    (`parse_json`), its stream flag (`validate`: what every endpoint needs
    checked) and whether it may be cache-keyed; raises the refusal of a bad
    one. Pure: safe on any thread (dataplane.offload)."""
    body = parse_json(raw)
    stream = validate(endpoint, body)
    # Chat text is at most one character a byte: a small body is never costly.
    keyable = not too_many_values(raw) and not (
        len(raw) > COSTLY_ABOVE and costly_to_normalise(body)
    )
    return body, stream, keyable


def parsed_named(
    endpoint: Endpoint, raw: bytes, names: tuple[str, ...]
) -> tuple[dict[str, Any], bool, bool, bool]:
    """`parsed`, and whether the body names one of `names` twice
    (`names_twice`). Pure, as `parsed` is."""
    body, stream, keyable = parsed(endpoint, raw)
    return body, stream, keyable, names_twice(raw, names)


def _not_json(raw: bytes, exc: jsonio.JSONDecodeError) -> str:
    """What is wrong with a body the JSON parser refused. orjson reports bytes
    that are not UTF-8 as "surrogates not allowed" at the start of the body;
    the client is told where they are instead."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"request body is not valid UTF-8 (at byte {bad.start})"
    return f"request body is not valid JSON: {exc}"


def validate(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Check every field the endpoint documents (dataplane.http.fields), on the
    body as the client sent it; return the stream flag."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise invalid_type("stream", "a boolean", stream)
    check_fields(endpoint.name, body, stream)
    return stream


async def admit_when_slot_frees(
    limiter: RateLimiter,
    scopes: Sequence[str],
    estimate: int,
    refused_at: float,
    most: int | None = None,
    choices: int = 1,
    wait: SlotWait = SLOT_WAIT,
) -> Admission:
    """Admit once a slot is free here (a share brought one, or a request here
    ended); refuse once a share says the wait is pointless (no spare slots in
    the fleet) or after `wait.wait_s` (looking every `wait.poll_s`).

    Only when the slots are elsewhere (RateLimiter.may_wait): waiting admits
    nothing the fleet's limit does not allow, it waits for this proxy's part
    of it. The waiter is reported as demand for a slot, and its last attempt
    is not counted again; waiters per scope are capped by its limit.
    `refused_at`: the limiter's time of the refusal; a joining proxy's window
    is judged as of then (its closing does not end the wait), spare flags as
    of each poll (their lapsing, no leader having confirmed them, does).
    """
    clock = wait.clock
    deadline = clock() + wait.wait_s
    limiter.wait_begin(scopes)
    try:
        while clock() < deadline:
            await wait.sleep(wait.poll_s)
            # Ends the wait as a slot frees here too: no scope refuses then.
            if not limiter.may_wait(scopes, clock(), waiting=True, refused_at=refused_at):
                break
    finally:
        limiter.wait_end(scopes)
    return limiter.admit(scopes, estimate, clock(), again=True, most=most, choices=choices)


# The endpoints whose requests are batches of items an answer accounts for.
BATCHES: Final = frozenset({"embeddings", "rerank"})


def batch_of(ex: Exchange) -> tuple[int, str]:
    """A batch request's items and what they are, for `refusal`: an
    embeddings request's inputs, a rerank request's documents; (0, "") for
    any other request."""
    name = ex.endpoint.name
    if name == "embeddings":
        return embedding_inputs(ex.body.get("input")), "inputs"
    if name == "rerank":
        return len(ex.body["documents"]), "documents"
    return 0, ""


def refusal(admission: Admission, inputs: int = 0, items: str = "inputs") -> ApiError:
    """429 in OpenAI's words, or 400 for a request no wait could admit. The
    message says when to try again as the reset header does (`retry_in`);
    `Retry-After` is that wait in whole seconds, rounded up. `inputs`: a
    batch request's `items` (batch_of: an embeddings request's inputs, a
    rerank request's documents; 0: another endpoint's request), whose 400
    names them and what splitting them does."""
    if admission.too_large and inputs:
        # Trial 79: a RAG app's batch of 1,000 chunks was told to shorten
        # its prompt and that max_tokens did not count: it has neither, and
        # what it can change is how many inputs it sends at once.
        if items == "documents":
            split = (
                f"Rank its {inputs} documents in smaller batches (each is read with the query)"
                if inputs > 1
                else "Shorten the query or the document"
            )
            counted = "the query counted once per document"
        else:
            split = (
                f"Send its {inputs} inputs in smaller batches (the openai SDK sends the list "
                "it is given; LangChain's OpenAIEmbeddings sends chunk_size at once)"
                if inputs > 1
                else "Shorten the input"
            )
            counted = "token ids one each"
        return ApiError(
            400,
            f"Request too large for the {_WHOLE_LIMITS[admission.limit or 'tokens']}: "
            f"its input is estimated at {admission.est_tokens} tokens (text at 4 "
            f"characters a token, {counted}), and the limit is "
            f"{admission.tpm}, so no wait can admit it. {split}, or ask for a higher limit.",
            code="tokens_over_limit",
        )
    if admission.too_large:
        # Only the prompt's estimate is charged at admission (the completion
        # is settled after the answer), so max_tokens is not part of it and
        # lowering it cannot help. Its rules are named: an image or audio
        # part is charged a figure the client cannot see in its text.
        limit = _WHOLE_LIMITS[admission.limit or "tokens"]
        return ApiError(
            400,
            f"Request too large for the {limit}: its prompt is estimated at "
            f"{admission.est_tokens} tokens (text at 4 characters a token, an image at 765 "
            "or 85 with detail low, audio and files by their size), and the limit is "
            f"{admission.tpm}, so no wait can admit it. Shorten the prompt, or ask for a "
            "higher limit (max_tokens does not count here).",
            code="tokens_over_limit",
        )
    if admission.limit in BUDGETS and admission.exhausted:
        return _over_budget(admission)
    what = {
        "requests": "requests",
        "tokens": "tokens",
        "concurrency": "concurrent requests",
        # This proxy's share of a budget the fleet has not spent: the leader
        # moves it to where the requests are within a rebalance or two.
        "tokens_per_day": "tokens per day (TPD)",
        "tokens_per_month": "tokens per month",
    }[admission.limit or "requests"]
    if admission.limit in BUDGETS:
        # Not the budget's end (that is _over_budget): the leader moves share
        # here within a round or two, so the message must not read as final.
        what = f"this proxy's share of the {what} budget; the budget is not spent"
    else:
        # Whose: a key and its tenant may each have limits (trial 47: a key of
        # 30 RPM under a tenant of 60 was refused by either, said alike).
        what += _of_whom(admission.refused_scope)
    return ApiError(
        429,
        f"Rate limit reached for {what}. Please try again in {admission.retry_in()}.",
        type="requests" if admission.limit in ("requests", "concurrency") else "tokens",
        code="rate_limit_exceeded",
        headers={"retry-after": admission.retry_after_header()},
    )


# The limits a prompt's estimate alone can pass, as a 400 names them.
_WHOLE_LIMITS: Final = {
    "tokens": "tokens-per-minute limit",
    "tokens_per_day": "tokens-per-day budget",
    "tokens_per_month": "tokens-per-month budget",
}

# The budgets' refusals: (what the message names, type, code). Month: the
# code OpenAI gives an account out of its quota, which its SDKs and clients
# tell from a rate limit.
BUDGETS: Final = {
    "tokens_per_day": ("tokens per day (TPD)", "00:00 UTC", "tokens", "rate_limit_exceeded"),
    "tokens_per_month": (
        "tokens per month",
        "the 1st of next month, 00:00 UTC,",
        "insufficient_quota",
        "insufficient_quota",
    ),
}


def _over_budget(admission: Admission) -> ApiError:
    """429 for a day's or month's budget spent: nothing comes back before the
    period ends (00:00 UTC), so `Retry-After` says that, and `x-should-retry:
    false` keeps the openai SDKs from retrying at once (they retry a 429
    twice by default, each time refused again)."""
    what, when, kind, code = BUDGETS[admission.limit or "tokens_per_day"]
    return ApiError(
        429,
        f"Budget reached for {what}{_of_whom(admission.refused_scope)}: it is spent, or too "
        f"little is left for this request. It starts again at {when} in "
        f"{_days(admission.retry_after_s)}.",
        type=kind,
        code=code,
        headers={"retry-after": admission.retry_after_header(), "x-should-retry": "false"},
    )


def _of_whom(scope: str) -> str:
    """Whose limit or budget a refusal names, as OpenAI names the
    organization whose limit refused: a key and its tenant may each have one
    (trial 42: the client could not tell which had run out)."""
    kind, _, name = scope.partition("/")
    if kind == "k":
        return f" of API key {name}"
    if kind == "t":
        return f" of tenant {name}"
    return ""


def _days(seconds: float) -> str:
    """A wait as format_duration writes it (which stops at a day), whole
    days before it: "12d3h4m5s"."""
    days, rest = divmod(max(0.0, seconds), 86400.0)
    return f"{int(days)}d{format_duration(rest)}" if days else format_duration(rest)
