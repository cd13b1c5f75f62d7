"""The error boundary of every route: errors in the OpenAI shape, every answer
counted (and, with --access-log on, logged), every answer with its request id."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.typedefs import Middleware
from aiohttp.web_urldispatcher import PlainResource

from dataplane.geo.clientip import TrustedProxies, client_ip
from dataplane.http import accesslog
from dataplane.http.dispatch import FixedInfo
from dataplane.http.edge import EdgeProtocol
from dataplane.http.errors import (
    MODEL_NOT_FOUND_CODE,
    NOT_SERVER_ERRORS,
    PROXY_STOPPING_CODE,
    ApiError,
    AuthUnavailableError,
    Unauthorized,
    proxy_stopping,
)
from dataplane.http.refusals import redact_credentials, refusals
from dataplane.http.state import (
    ACCESS_LOG,
    CONTINUE_PENDING,
    DRAINING,
    EXCHANGE,
    METRICS,
    ORIGIN_CALL,
    PRINCIPAL,
    REQUEST_ID,
    REQUEST_IDS,
    SERVER_NAME,
    Draining,
    stopping,
)
from dataplane.metrics import GENAI_OPERATIONS, Metrics

if TYPE_CHECKING:
    from dataplane.auth.authenticator import Principal
    from dataplane.http.accesslog import AccessLog
    from dataplane.http.pipeline import Exchange
    from dataplane.http.requestid import RequestIds

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLIENT_CLOSED = 499
CLIENT_GONE = "client_disconnected"  # the error code of a 499 whose client left
SEND_TIMEOUT = "send_timeout"  # of a 499 the edge cut: its client stopped reading
STOPPED = "cancelled"  # of a 499 the stopping server cut (cancel_reason)


def error_boundary(
    m: Metrics, draining: Draining, ids: RequestIds, access: AccessLog | None = None
) -> Middleware:
    """The error boundary of every route of an app whose metrics, DRAINING,
    REQUEST_IDS and (with --access-log on) ACCESS_LOG are these: one per app,
    made with it (its state holds the same objects under those keys, for
    whatever else reads them). Each request finds them here, not through
    request.app and its state (a property of a property, then a Python call a
    key: some 3,000 instructions a request).

    Every failure becomes an OpenAI-style error, and every answer is counted
    and carries `x-request-id`. The request is held in
    ponto_requests_in_flight (Metrics.in_flight) while it runs, unless it is
    one of the proxy's own probes or scrapes (accesslog.PROBES), which would
    count themselves.

    The request's id (the client's own when acceptable, see
    dataplane.http.requestid; new ones from `ids`) is set in
    request[REQUEST_ID] before the handler runs. An ApiError is answered
    with its status and logged once in the refusal log (unless its cause was
    logged where it happened); the caller's rate-limit headers come from the
    request's Exchange when it has one. Anything else is a bug: logged once
    with its traceback, answered with a generic 500 in the same shape, unless
    the request's answer began already (a whole one sent first, send_whole;
    a stream): then no second answer follows it (_after_answer).

    A proxied request (one with an Exchange) is recorded once here in the
    GenAI metrics, and every answer gets its access-log line here, once the
    handler has returned: after a stream's last byte, after settlement. A
    handler cancelled because its client left (or stopped reading, or the
    server stopped it) is recorded the same way, as status 499
    (`cancel_reason`), and the cancellation goes on.
    """
    in_flight = m.in_flight.requests

    @web.middleware
    async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
        # All in this one frame: each frame in the request's chain of awaits
        # costs some 900 instructions a wait.
        info = request._match_info  # set by now: FixedRoutes or the router
        assert info is not None
        # A fixed route's name as FixedRoutes read it once (FixedInfo).
        name = info.route_name if type(info) is FixedInfo else info.route.name
        endpoint = name or "other"
        counted = endpoint not in accesslog.PROBES
        if counted:
            key = id(request)
            in_flight[key] = request
        started = time.perf_counter()
        # aiohttp's dict behind request[...] and request.get: each of those is
        # a Python call or two (some 800 instructions), for one dict operation.
        state = request._state
        request_id = state[REQUEST_ID] = ids.of(request._headers.get("x-request-id"))
        if draining.active:
            # Any answer, streams included (they are prepared inside the handler),
            # says `Connection: close`: the client opens its next request elsewhere.
            request._message = request._message._replace(should_close=True)
        failed = False
        error = ""
        ex: Exchange | None
        try:
            try:
                response = await handler(request)
                ex = state.get(EXCHANGE)
                status = returned_status(ex, response)
            except asyncio.CancelledError:
                # The client left (production runs with handler_cancellation) or the
                # server stopped the handler as it shut down: nobody gets an answer,
                # but the request is still counted and logged, as nginx's 499.
                error = cancel_reason(request)
                if error == CLIENT_GONE:
                    m.client_disconnects.inc()
                ex = state.get(EXCHANGE)
                status = CLIENT_CLOSED
                if (ex is None or ex.answer is None) and stopping(request):
                    # The stopping server's grace ran out before this answer began:
                    # the client is told so (a 503 it may retry elsewhere), not cut,
                    # and it is counted and logged as what the client got.
                    told = _stopped_answer(request, request_id, ex)
                    if told is not None:
                        status, error = told.status, told.code or error
                _record_or_log(access, m, request, request_id, endpoint, ex, status, error, started)
                if ex is not None and not ex.detached:
                    # A stream whose end was never written holds its request
                    # (aiohttp lets go of it at write_eof), which holds this
                    # exchange: a cycle only a full collection frees, and the
                    # request's body with it. A detached flight's task still
                    # writes to it.
                    ex.answer = ex.held = None
                raise
            except Exception as exc:
                ex = state.get(EXCHANGE)
                if (
                    ex is not None
                    and ex.answer is not None
                    and not isinstance(exc, ConnectionResetError)
                ):
                    response, error = _after_answer(request, ex.answer)
                else:
                    response, error = _error_response(request, exc)
                    failed = True
                status = response.status
            if draining.active:
                # Draining began while this request ran: close after its answer too
                # (a stream already sent its head; its connection still ends with it),
                # or a kept-alive client would hold the drain to its deadline.
                response.force_close()
            # Not prepared (a stream sent its headers itself): aiohttp's
            # property's test in place, a Python call fewer.
            if response._payload_writer is None and not response._eof_sent:
                response.headers.setdefault("x-request-id", request_id)
                response.headers.setdefault(hdrs.SERVER, SERVER_NAME)
            if failed and ex is not None:
                _error_headers(response, ex)
            _record_or_log(access, m, request, request_id, endpoint, ex, status, error, started)
            return response
        finally:
            if counted:
                del in_flight[key]

    return errors_and_metrics


def stream_open(request: web.BaseRequest) -> bool:
    """Whether `request` (one in flight) is a stream whose first chunk went out:
    ponto_streams_open (Metrics.in_flight.is_stream)."""
    ex = request.get(EXCHANGE)
    return ex is not None and ex.stream and ex.first_chunk_at is not None


def chunk_gap(ex: Exchange, finished: float, error: str) -> float | None:
    """The mean time between a stream's output chunks after the first
    (ponto_stream_mean_chunk_interval_seconds; not the per-chunk gaps of
    gen_ai.client.operation.time_per_output_chunk), computed once per stream
    from what the relay counted anyway: from its first chunk sent to its end
    (`finished`), over its text chunks less one. Streams an origin answered
    whole only (no error, not a cache hit's replay, which goes out at once);
    None for others and for those of fewer than two text chunks. The span
    includes the stream's tail after its last text chunk (usage chunk,
    [DONE]), which comes at once."""
    counter, first = ex.counter, ex.first_chunk_at
    if error or not ex.stream or not ex.origin or counter is None or first is None:
        return None
    chunks = counter.content_events
    if chunks < 2:
        return None
    return max(0.0, finished - first) / (chunks - 1)


def _error_headers(response: web.StreamResponse, ex: Exchange) -> None:
    """What an error answer to a proxied request carries besides its id: the
    caller's limits, and what the cache step decided if it ran."""
    for name, value in ex.limit_headers:
        response.headers.setdefault(name, value)
    if ex.cache is not None:
        for name, value in ex.cache_headers(ex.cache.outcome):
            response.headers.setdefault(name, value)


def _stopped_answer(request: web.Request, request_id: str, ex: Exchange | None) -> ApiError | None:
    """Hand a 503 `proxy_stopping` to the transport, without a wait (the
    handler is being cancelled); the connection closes after it. The error
    handed over; None if it was not."""
    protocol = request.protocol
    if not isinstance(protocol, EdgeProtocol):  # aiohttp's own server (tests): no such path
        return None
    stopped = proxy_stopping()
    response = stopped.response()
    response.headers["x-request-id"] = request_id
    if ex is not None:
        _error_headers(response, ex)
    response.force_close()
    return stopped if protocol.send_whole(request, response) else None


def _record_or_log(
    access: AccessLog | None,
    m: Metrics,
    request: web.Request,
    request_id: str,
    endpoint: str,
    ex: Exchange | None,
    status: int,
    error: str,
    started: float,
) -> None:
    """`_record`, where a bug in the counting must not undo what it counts: the
    answer stands (it may be out already) and a cancellation goes on. Logged
    once, with its traceback."""
    try:
        _record(access, m, request, request_id, endpoint, ex, status, error, started)
    except Exception:
        request.app.logger.exception("unhandled error recording %s", _logged(request))


async def send_whole(request: web.Request, response: web.Response) -> bool:
    """Write a handler's whole answer now instead of once the handler returns,
    so that the work the handler does after it (keeping it in the cache,
    giving back its admission, counting its tokens; then this boundary's
    metrics and access log) is not in the client's wait.

    On the edge the answer is handed to the transport without a wait
    (`hand_over`, which the pipeline calls there without this coroutine): a
    client that reads slowly or leaves neither holds nor cuts short that
    work, which waits on nothing either, so it is done before the loop
    serves anything else. While draining, the answer closes its connection,
    as `errors_and_metrics` would decide after the handler.

    False when its client was gone, so that nothing was handed over (counted
    as a client disconnect here); the caller records the request as a 499.
    """
    protocol = request.protocol
    draining = request.app[DRAINING]
    if isinstance(protocol, EdgeProtocol):
        return hand_over(request, protocol, response, draining)
    if draining.active:
        response.force_close()
    try:  # aiohttp's own server (tests)
        await response.prepare(request)
        await response.write_eof()
        return True
    except ConnectionError:
        pass
    return _client_gone(request)


def hand_over(
    request: web.Request, protocol: EdgeProtocol, response: web.Response, draining: Draining
) -> bool:
    """`send_whole` on the edge, where it waits for nothing: a plain call, not
    a coroutine (some 700 instructions fewer a request). `protocol` is the
    request's, `draining` its app's DRAINING (the pipeline holds it: reading
    it through request.app costs some 1,900 instructions)."""
    if draining.active:
        response.force_close()
    if protocol.send_whole(request, response):
        return True
    transport = request.transport
    if transport is not None and not transport.is_closing():
        return True  # not one it sends early: written once the handler returns
    return _client_gone(request)


def _client_gone(request: web.Request) -> bool:
    """False, having counted the client disconnect (not a cut for stalling,
    which is counted as such)."""
    if not cut_for_stalling(request):
        request.app[METRICS].client_disconnects.inc()
    return False


def returned_status(ex: Exchange | None, response: web.StreamResponse) -> int:
    """The status a handler's returned answer is recorded with: its own, or 499
    when its client left, or was cut, before it ended though the handler ran
    on (a whole answer `send_whole` could not hand over, a stream whose write
    found the connection gone: `gone_reason`), as when the client's leaving
    cancels the handler first."""
    if ex is not None and ex.stream_error in (CLIENT_GONE, SEND_TIMEOUT):
        return CLIENT_CLOSED
    return response._status  # aiohttp's status property's: a Python call on 3.11


def cut_for_stalling(request: web.Request) -> bool:
    """The edge closed the connection: its client took no byte of the
    answer for the send timeout (EdgeProtocol)."""
    protocol = request.protocol
    return isinstance(protocol, EdgeProtocol) and protocol.send_stalled


def gone_reason(request: web.Request) -> str:
    """The error code of an answer whose write found the connection gone:
    the edge cut it for stalling (trial 36: the write can fail before the
    cut cancels the handler, and the cut was logged as the client's
    leaving), or else its client left."""
    return SEND_TIMEOUT if cut_for_stalling(request) else CLIENT_GONE


def cancel_reason(request: web.Request) -> str:
    """The error code of a request whose handler was cancelled: its client
    took no byte of the answer for the edge's send timeout (EdgeProtocol), the
    server stopped it (the app is draining or shutting down, see Draining), or
    else its client left."""
    if cut_for_stalling(request):
        return SEND_TIMEOUT
    return STOPPED if request.app[DRAINING].active else CLIENT_GONE


def refused_here(ex: Exchange, status: int, error: str) -> bool:
    """The proxy refused the request itself, calling no origin, for the
    client's own doing: a 4xx (bad input, authentication, a rate limit, a
    model not served, a client that left before any answer) or a 5xx that is
    the client's (NOT_SERVER_ERRORS: only-if-cached with no entry). Its
    region's origins failed nothing, so the status page leaves it out of
    what the region served (`Metrics.refused`). Not an answer of the
    cache's that its client left, or the stopping proxy cut, once it began:
    that was served (`excused_here`)."""
    if ex.attempts or cut_after_it_began(ex, error):
        return False
    return 400 <= status < 500 or error in NOT_SERVER_ERRORS


def cut_after_it_began(ex: Exchange, error: str) -> bool:
    """Its client left or stopped reading, or the stopping proxy cut it,
    once its answer had begun."""
    return error in (CLIENT_GONE, SEND_TIMEOUT, STOPPED) and ex.answer is not None


# An origin's 4xx that says its region failed, not the request: it timed out
# or is overloaded.
_ORIGINS_FAILURES: Final = frozenset({408, 429})


def excused_here(ex: Exchange, status: int, error: str) -> bool:
    """The request was served, or its origins called, and it failed for
    no fault of its region's: its client left or stopped reading once its
    answer had begun, from an origin or the cache (a 499; one that left
    waiting for an origin that never answered is the region's failure); an
    origin refused it as a bad request (a 4xx other than 408 and 429, not the
    proxy's own model_not_found once every origin lacked the model: a wrong
    own name set for one); or this proxy, stopping, cut it off (its grace
    ran out: 503 proxy_stopping, or a 499 `cancelled` once its answer had
    begun or an origin was called). The status page
    counts it served but not among the region's errors (`Metrics.excused`;
    review: every 400 an origin gave a malformed prompt, and every client
    that closed a stream, read as the region failing; a rolling restart of
    proxies read as their regions failing)."""
    if cut_after_it_began(ex, error) or error == PROXY_STOPPING_CODE:
        # The stopping proxy's 503 whether an origin was called or not: a
        # request waiting on a cache flight's leader, a concurrency slot or
        # a JWKS is cut as one waiting on an origin is (review).
        return True
    if ex.attempts == 0 or not error or error in (CLIENT_GONE, SEND_TIMEOUT):
        return False
    if error == MODEL_NOT_FOUND_CODE:  # errors.model_not_found, from the forwarder
        return False
    return 400 <= status < 500 and status not in _ORIGINS_FAILURES


def _record(
    access: AccessLog | None,
    m: Metrics,
    request: web.BaseRequest,
    request_id: str,
    endpoint: str,
    ex: Exchange | None,
    status: int,
    error: str,
    started: float,
    *,
    unparsed: bool = False,
) -> None:
    """Count the answer (ponto_requests_total, the GenAI metrics of a proxied
    request) and give it its access-log line. Once per request. `unparsed`:
    a message the HTTP parser refused, whose request is aiohttp's stand-in.
    `m` and `access`: the app's METRICS and ACCESS_LOG (None when off), which
    the caller has."""
    answered = status  # what excused_here judges: an origin's own, for a held stream
    held = 0
    if not error and ex is not None:
        error = ex.stream_error
        if not error:
            # A stream whose head went out before its origin's answer, which
            # became its error event (reply.into_held): a failure whatever
            # that answer's status (a 2xx no stream could be made of too),
            # and that status is the origin's, not the 200 its client had, so
            # a 400 an origin gave a held stream's bad prompt is excused as
            # any other's is, and a held stream refused with a code per
            # request makes no duration histogram per request.
            held = ex.held_status
            if held:
                answered = held
    logged = error
    if not error and (held or answered >= 400):
        # An origin's own error answer: the metrics' error type is its status
        # (an origin's codes are its own to choose, and would make label
        # values without bound), the access line its code when it gave one.
        error = str(answered)
        logged = _origin_error(request, ex) or error
    principal = _caller(request, ex)
    if principal is not None:
        m.account_request(principal.tenant, principal.key_id, status)
    if error in NOT_SERVER_ERRORS:
        m.not_cached.labels(endpoint).inc()
    finished = time.perf_counter()
    m.answered(endpoint, status, finished - started)
    if ex is not None:
        m.operation(
            GENAI_OPERATIONS.get(ex.endpoint.name, ex.endpoint.name),
            ex.model,
            error,
            ex.region or ex.routes.region,
            ex.cache.outcome if ex.cache is not None else "",
            finished - started,
            ex.first_chunk_at - started if ex.stream and ex.first_chunk_at is not None else None,
            ex.usage if ex.origin else None,
            # Only a stream has a chunk gap, and a request with no error (a
            # status under 400) was neither refused nor excused: three calls
            # fewer on the usual request.
            chunk_gap(ex, finished, error) if ex.stream else None,
            refused=bool(error) and refused_here(ex, status, error),
            excused=bool(error) and excused_here(ex, answered, error),
        )
    if access is not None and access.sampled(logged, endpoint):
        _access_line(
            access,
            request,
            request_id,
            endpoint,
            principal,
            ex,
            status,
            logged,
            started,
            finished,
            unparsed=unparsed,
        )


def _origin_error(request: web.BaseRequest, ex: Exchange | None) -> str:
    """The code an origin's own error answer gave ("" for none): noted on the
    Exchange, or for a request without one in its ORIGIN_CALL."""
    if ex is not None:
        return ex.origin_error
    call = request.get(ORIGIN_CALL)
    return call.origin_error if call is not None else ""


def _caller(request: web.BaseRequest, ex: Exchange | None) -> Principal | None:
    """Whose request it is, once its credential is checked (None before):
    the exchange's caller for a proxied request, the one the endpoint noted
    (PRINCIPAL) for the proxy's own."""
    return ex.principal if ex is not None and ex.authenticated else request.get(PRINCIPAL)


def _access_line(
    access: AccessLog,
    request: web.BaseRequest,
    request_id: str,
    endpoint: str,
    principal: Principal | None,
    ex: Exchange | None,
    status: int,
    error: str,
    started: float,
    finished: float,
    *,
    unparsed: bool = False,
) -> None:
    """Write the answer's access-log line (the caller has sampled it). A
    request without an Exchange that called an origin noted it in ORIGIN_CALL.

    No line for a request over a unix socket: a sibling worker asking for this
    one's /metrics or /readyz (dataplane.workers), not a client."""
    sock = request.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return
    access.write(
        accesslog.record(
            ended=access.clock(),
            request_id=request_id,
            # An unparsed message's request is aiohttp's stand-in ("UNKNOWN /").
            method=request.method,
            path="" if unparsed else request.path,
            endpoint=endpoint,
            client=_client(request, access.trusted),
            principal=principal,
            ex=ex,
            region=access.region,
            status=status,
            error=error,
            started=started,
            finished=finished,
            call=request.get(ORIGIN_CALL) if ex is None else None,
        )
    )


def _after_answer(
    request: web.Request, answer: web.StreamResponse
) -> tuple[web.StreamResponse, str]:
    """A failure once the answer's head went out (a bug in what follows it): no
    second answer, which the client would read as its next request's. An
    answer that ended (a whole one, a stream after its last chunk) leaves the
    connection serving; a stream that stopped part-way is cut with its
    connection, without the chunked end that would make it look whole.
    Logged once, with its traceback; counted with the status the client got."""
    request.app.logger.exception("unhandled error on %s after its answer began", _logged(request))
    if answer.prepared and not answer._eof_sent:  # aiohttp's: its end was not written
        answer.force_close()
        _reset(request.transport)
    return answer, "internal_error"


def _reset(transport: asyncio.Transport | None) -> None:
    """Cut a connection with a reset, so that an answer cut short cannot pass
    for whole: a stream over HTTP/1.0 ends with its connection, and an
    orderly close would be that end."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _error_response(request: web.Request, exc: Exception) -> tuple[web.Response, str]:
    """The answer to a failure (an unprepared response) and its error code; a
    redirect is re-raised."""
    if isinstance(exc, ApiError):
        if not exc.logged:
            about = []
            # Whose request it was, once known (trial 30: a 429's line named
            # neither; the access log, when on, did). An expired key is its
            # owner's; a JWT its tenant's config could not check, its tenant's.
            caller = exc.owner if isinstance(exc, Unauthorized | AuthUnavailableError) else None
            caller = caller or _caller(request, request.get(EXCHANGE))
            if caller is not None and caller.key_id:
                about.append(f"[key {caller.key_id} of tenant {caller.tenant}]")
            if exc.note:
                about.append(f"[{exc.note}]")
            _refused(request, exc.status, exc.code, exc.message, " ".join(about))
        return exc.response(), exc.recorded or exc.code or str(exc.status)
    if isinstance(exc, web.HTTPException):
        # Router errors (unknown path, wrong method) in the same shape.
        if exc.status < 400:
            raise exc
        error = ApiError(
            exc.status,
            f"{_what(request)}: {exc.reason}{_path_hint(request) if exc.status == 404 else ''}",
            code=exc.reason.lower().replace(" ", "_"),
        )
        _refused(request, error.status, error.code, error.message)
        response = error.response()
        response.headers.extend((k, v) for k, v in exc.headers.items() if k.lower() == "allow")
        return response, error.code or str(error.status)
    if isinstance(exc, ConnectionResetError):
        # The client went away while its answer was being written (a followed
        # flight's stream): nobody to answer, nothing to log. Counted as
        # nginx's 499, "client closed request".
        request.app[METRICS].client_disconnects.inc()
        return web.Response(status=CLIENT_CLOSED), CLIENT_GONE
    request.app.logger.exception("unhandled error on %s", _logged(request))
    error = ApiError(500, "internal error in the proxy", type="server_error", code="internal_error")
    return error.response(), "internal_error"


def _path_hint(request: web.Request) -> str:
    """For a 404 on the metrics listener: that it is that port, and its
    paths. Else, the proxy's path the client likely meant, when its path is
    one of them (a parameter's too: /v1/models/{model}) without the /v1
    prefix, with it twice, under /v2 (Cohere v2's /v2/rerank), or with a
    trailing slash (trial 51: an SDK's
    base_url without /v1 got a bare "Not Found"); else, under /health/, the
    proxy's probes; else, for a path of a
    gateway's admin API (`_management_path`), that keys, limits and spend are
    pontoctl's, and the API paths it serves (those without a parameter); else,
    under /v1/ and for an endpoint none of whose paths the gateway has, that
    it does not serve it and those paths; else "".
    Only 404s pay for it."""
    path = request.path
    if request.method == hdrs.METH_CONNECT:
        # A tunnel asked of a forward proxy (its target, host:port, is no path).
        return (
            "; this gateway is not a forward proxy: send its own paths to it, as an OpenAI SDK does"
        )
    resources = [r for r in request.app.router.resources() if r.canonical.startswith("/v1/")]
    if not resources:
        # The metrics listener (--metrics-listen), which has no API path: an
        # SDK or a probe sent to it is told which port it reached (trial 99:
        # /v1/models there was "does not serve that endpoint (it serves )").
        own = ", ".join(sorted(r.canonical for r in request.app.router.resources()))
        return f"; this is the proxy's metrics port, which serves {own} only"
    meant = path.rstrip("/")
    if meant.startswith("/v1/v1/"):
        meant = meant[3:]
    elif meant.startswith("/v2/"):
        # Cohere v2's /v2/rerank, which vLLM serves as its /v1/rerank (the
        # Cohere SDK's ClientV2 calls it): the same API here at /v1/rerank.
        meant = "/v1" + meant[3:]
    elif not meant.startswith("/v1/"):
        meant = "/v1" + meant
    if meant != path:
        for r in resources:
            info = r.get_info()
            pattern = info.get("pattern")
            if info.get("path") == meant or (pattern is not None and pattern.fullmatch(meant)):
                return f"; did you mean {meant}? (an OpenAI SDK's base_url ends with /v1)"
    if path.startswith("/health/"):
        # LiteLLM's probes (/health/liveliness, /health/readiness), kept in a
        # Deployment's manifest when its image changes.
        return "; the proxy's probes are /healthz (liveness) and /readyz (readiness)"
    served = ", ".join(sorted(r.canonical for r in resources if isinstance(r, PlainResource)))
    if _management_path(path):
        # A team moving from LiteLLM's proxy calls its admin API on the proxy
        # (trial 81: /key/generate answered a bare "Not Found", read as a
        # wrong URL): say where that work is done here.
        return (
            "; the proxy has no management API: keys, limits, budgets and spend"
            " are managed with pontoctl on the control plane (the proxy serves " + served + ")"
        )
    endpoint = path[4:].partition("/")[0]
    if path.startswith("/v1/") and all(
        r.canonical[4:].partition("/")[0] != endpoint for r in resources
    ):
        # An OpenAI endpoint the gateway does not proxy (moderations, audio,
        # images, files, batches...): a bare "Not Found" read as a typo (a
        # new user's trial). A wrong path under one it serves
        # (/v1/responses/ID/input_item) is only not found. The status stays
        # OpenAI's for an unknown path.
        return "; this gateway does not serve that endpoint (it serves " + served + ")"
    return ""


# The first segments of LiteLLM's proxy admin API (virtual keys, teams, users,
# spend, budgets, model management), under / or /v1/ as it serves them.
_MANAGEMENT: Final = frozenset(
    {"key", "team", "user", "spend", "model", "global", "budget", "customer", "organization"}
)


def _management_path(path: str) -> bool:
    """Whether `path` is one of a gateway admin API's (LiteLLM's /key/generate,
    /model/info, /spend/logs, with or without /v1), which a proxy never
    serves."""
    rest = path[3:] if path.startswith("/v1/") else path
    return rest.startswith("/") and rest[1:].partition("/")[0] in _MANAGEMENT


def _client(request: web.BaseRequest, trusted: TrustedProxies) -> str | None:
    """The client's address as the geo step finds it (forwarding headers of
    trusted proxies believed), or the socket's peer."""
    ip = client_ip(request.remote, request.headers, trusted)
    return str(ip) if ip is not None else request.remote


def _refused(
    request: web.Request, status: int, code: str | None, message: str, about: str = ""
) -> None:
    refusals.refused(
        status,
        code,
        message,
        request_id=request[REQUEST_ID],
        remote=request.remote,
        what=_what(request),
        about=about,
    )


def _what(request: web.Request) -> str:
    """The request line's method and path, the path cut so that a huge one
    makes neither a huge log line nor a huge error message. The path as sent
    (``%2F`` kept): the decoded one hides why the router did not match it;
    a CONNECT's target (host:port, no path) as sent."""
    path = request.rel_url.raw_path or request.raw_path
    return f"{request.method} {path if len(path) <= 200 else path[:200] + '...'}"


def _logged(request: web.Request) -> str:
    """`_what` as a log line other than a refusal's writes it: a key or token
    the client put in its path redacted (refusals.redact_credentials), as the
    refusal line and the access log have it; the client's own answers quote
    `_what` whole."""
    return redact_credentials(_what(request))


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The proxied routes' `Expect` handler. A `100-continue` is not answered
    here: it is marked CONTINUE_PENDING and the pipeline sends the 100 when it
    reads the body (`send_continue`), so the refusals the head alone decides
    (401, 415, 413 for a declared length) come first, as the final answer,
    and the client never sends the body. On the edge FixedRoutes closes the
    connection after such an answer, and refuses other expectations before
    this runs; this 417, in the same shape, is for a plain aiohttp server:
    logged and counted here, since no middleware runs for an answer given in
    place of the handler's."""
    started = time.perf_counter()
    expect = request.headers.get("expect", "")
    if expect.lower() == "100-continue":
        if request.version == HttpVersion11:  # RFC 9110: ignored from HTTP/1.0
            request[CONTINUE_PENDING] = True
        return None
    error = ApiError(417, "Expect: only 100-continue is supported", code="expectation_failed")
    request_id = request.app[REQUEST_IDS].of(request.headers.get("x-request-id"))
    error.headers["x-request-id"] = request_id
    error.headers[hdrs.SERVER] = SERVER_NAME
    refusals.refused(
        error.status,
        error.code,
        error.message,
        request_id=request_id,
        remote=request.remote,
        what=f"{request.method} {request.path}",
    )
    name = request.match_info.route.name or "other"
    app = request.app
    _record(
        app.get(ACCESS_LOG),
        app[METRICS],
        request,
        request_id,
        name,
        None,
        error.status,
        error.code or "",
        started,
    )
    return error.response()


def record_unparsed(
    app: web.Application, request: web.BaseRequest, request_id: str, status: int, error: str
) -> None:
    """Count a message the HTTP parser refused (dataplane.http.edge answers and
    logs it) and give it its access-log line: endpoint `other`, method
    `UNKNOWN`, no path (the parser gave neither) and no tenant."""
    _record(
        app.get(ACCESS_LOG),
        app[METRICS],
        request,
        request_id,
        "other",
        None,
        status,
        error,
        time.perf_counter(),
        unparsed=True,
    )
