"""OpenAI-style errors. Each knows its status; only these reach clients.

Anything not raised as an ApiError is a bug: the boundary
(dataplane.http.boundary) logs it and the client gets a generic 500 in the
same shape, never a traceback.

The allowlist for origin failures: a client learns the status, a type and
code, a fixed message and its request id; which origin failed, its URL and
the exception text go to the log only (dataplane.upstream.forwarder logs
them at WARNING with the request id). An origin's own 4xx answer is passed
on only when it is an OpenAI-style JSON error about the client's request,
rebuilt from its four fields (`origin_error`); anything else (a text or
HTML page, a stack trace, a word on the operator's account) becomes a fixed
error of the same status, and a refusal of the proxy's own credential or
account (401, 403, 407, 402) a 502.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

from aiohttp import web

from dataplane import jsonio
from dataplane.auth.authenticator import AuthError, AuthUnavailable, Principal
from dataplane.ratelimit.limiter import retry_after_header


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        logged: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        # Its cause was already logged where it happened (an origin failure):
        # the boundary does not log it again as a refusal.
        self.logged = logged
        # Origin calls made before it was raised (dataplane.upstream.forwarder).
        self.attempts = 0
        # False when no origin can have spent work on the request (none was
        # called, or each refused it unread): its prompt's tokens are given
        # back (Pipeline.forward).
        self.spent = True
        # For the log line only, after the message: what the client is not
        # told (which model list refused its model).
        self.note = ""
        # What the metrics' error_type and the access log's `error` call it,
        # when not its code: a code an origin chose (upstream_error_answer)
        # would make label values without bound.
        self.recorded: str | None = None

    def error(self) -> dict[str, str | None]:
        """Its error object, in OpenAI's shape (the member `error` of its body)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> bytes:
        """Its JSON, in OpenAI's shape."""
        return jsonio.dumps({"error": self.error()})

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        if self.attempts:  # as a successful answer says how many origin calls it took
            headers["x-ponto-attempts"] = str(self.attempts)
        response = web.Response(
            status=self.status,
            body=self.body(),
            content_type="application/json",
            headers=headers,
        )
        if headers.get("connection") == "close":
            # As the header says: aiohttp keeps a connection whose request's
            # body was read whole (pipeline.empty_body's) unless told.
            response.force_close()
        return response


class Unauthorized(ApiError):
    """A 401. `owner`: whose key it was, when a key matched but was refused
    (expired), so that the access log, the refusal log and the tenant's
    metrics name it; the client is told nothing more."""

    def __init__(self, exc: AuthError) -> None:
        super().__init__(
            401, exc.message, code=exc.code, headers={"www-authenticate": exc.www_authenticate}
        )
        self.owner = exc.principal


class AuthUnavailableError(ApiError):
    """503 for a JWT of a tenant whose JWT config this proxy could not load
    (or whose keys are still being fetched). Its cause is logged once, when
    the table is applied (dataplane.sync.holder); the refusal itself is
    logged as every refusal is (rate-limited), naming the tenant.

    `owner`: that tenant, as the token's issuer names it (no key: the token
    was not checked), so that the access log, the refusal log and the
    tenant's metrics name it, as an expired key's owner; the client is told
    nothing more. Trial 48: the refusal went unlogged, with tenant null.
    The issuer is not checked, but only a tenant whose config cannot be used
    (or whose keys are still being fetched, at start) has refusals of this
    kind to be counted for it: a caller cannot add to a working tenant's
    counts so."""

    def __init__(self, exc: AuthUnavailable) -> None:
        super().__init__(
            503,
            exc.message,
            type="server_error",
            code=exc.code,
            # As the message says, the client may retry: keys being fetched
            # come within seconds (a config to fix, later).
            headers={"retry-after": "5"},
        )
        self.owner = Principal(exc.tenant, "", (f"t/{exc.tenant}",))
        self.note = f"tenant {exc.tenant}"


def several_authorizations(count: int) -> ApiError:
    """400 for a request with `count` (2 or more) Authorization headers. Refused
    rather than read: a load balancer or WAF in front of the proxy may read
    another of them than the proxy would, and bill or allow another caller."""
    return ApiError(
        400,
        f"Send one Authorization header: this request has {count}, and proxies on "
        "the way may each read a different one.",
        code="multiple_authorization_headers",
    )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def body_too_large(limit: int) -> ApiError:
    """413 for a body past `limit` bytes (--max-body-bytes), declared or read."""
    return ApiError(
        413, f"request body is larger than the limit of {limit} bytes", code="body_too_large"
    )


def tenant_suspended() -> ApiError:
    """403 for a caller whose tenant the operator suspended: its credential
    is good, its account is not (OpenAI answers a deactivated account with
    its own code; the SDKs raise PermissionDeniedError and do not retry)."""
    return ApiError(
        403,
        "This account is suspended: its requests are refused. Contact the operator of this "
        "gateway.",
        code="tenant_suspended",
    )


def api_key_suspended() -> ApiError:
    """403 for a caller whose API key the operator suspended (`pontoctl key
    suspend`): the key is known and good, and refused until it is resumed.
    403 rather than 401, as for a suspended tenant: the SDKs raise
    PermissionDeniedError and do not retry, and the caller is told the key
    is not wrong, only stopped."""
    return ApiError(
        403,
        "This API key is suspended: its requests are refused until it is resumed. Contact the "
        "operator of this gateway.",
        code="api_key_suspended",
    )


def model_not_found(name: str, refused_by: str = "") -> ApiError:
    """404 for a model the caller may not name, in OpenAI's words; the name as
    the client sent it, cut to 256 characters. `refused_by` is whose model
    list refused it ("tenant NAME", "key ID"), for the log only: the client
    is not told that the model exists."""
    error = ApiError(
        404,
        f"The model '{name[:256]}' does not exist or you do not have access to it.",
        param="model",
        code=MODEL_NOT_FOUND_CODE,
    )
    if refused_by:
        error.note = f"not on the model list of {refused_by}"
    return error


def endpoint_not_served(model: str, path: str, said: str = "") -> ApiError:
    """400 for a request every origin tried answered 501 Not Implemented: its
    model is not served at that endpoint (a chat model asked for embeddings:
    llama.cpp without --embeddings, Ollama), or a feature it asks is not
    (vLLM's NotImplementedError). The client's to fix, and no retry changes
    it: a 5xx would be retried by the SDKs in vain. `said`: the last 501's
    message, which says which (as a 4xx's is passed on), in place of a guess."""
    if said:
        return ApiError(
            400,
            f"The model '{model[:256]}' does not serve this request at /v1{path}: its servers "
            f"answered 501 Not Implemented: {said}",
            param="model",
            code="model_not_supported",
        )
    return ApiError(
        400,
        f"The model '{model[:256]}' does not serve /v1{path}: its servers answered 501 Not "
        "Implemented (a chat model asked for embeddings, say). Use a model that serves this "
        "endpoint.",
        param="model",
        code="model_not_supported",
    )


def previous_response_not_found(sent: str, why: str) -> ApiError:
    """400 for a `previous_response_id` of ours (dataplane.upstream.responseids)
    that no origin this request may use holds for the caller: `why` says why,
    in the client's words. No origin is called (another one lacks the state)."""
    return ApiError(
        400,
        f"Previous response with id '{sent[:256]}' not found: {why}.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def previous_response_gone(sent: str) -> ApiError:
    """previous_response_not_found for a follow-up whose origin, the one that
    stored its previous response, answered that it holds no such response:
    deleted, made with `store: false`, or lost as the origin restarted (each
    vLLM replica keeps its store in memory). vLLM says so with a 404
    (`Response with id '...' not found`, `param: response_id`), which an SDK
    raises as NotFoundError, as for a wrong URL or model; OpenAI, and the
    proxy for an id whose origin has left, answer this 400, so a client
    knows one error for one fault (trial 80)."""
    return previous_response_not_found(
        sent,
        "the origin that stored it no longer holds it (deleted, made with 'store': false, "
        "or lost as the origin restarted); start the conversation again",
    )


def response_not_found(sent: str, why: str = "") -> ApiError:
    """404 for a stored response's route whose id is not ours, or not the
    caller's tenant's, or whose origin serves no requests now (`why`)."""
    return ApiError(
        404,
        f"No response found with id '{sent[:256]}'{f': {why}' if why else ''}.",
        param="response_id",
        code="not_found",
    )


def invalid_response_id(sent: str, max_chars: int) -> ApiError:
    """400 for a response id in a path that no origin may be sent: too long,
    or with characters a path segment does not carry as they are."""
    return ApiError(
        400,
        f"Invalid 'response_id': '{sent[:64]}{'...' if len(sent) > 64 else ''}': an id is at "
        f"most {max_chars} letters, digits, '_' or '-'.",
        param="response_id",
        code="invalid_value",
    )


# Fixed messages: what clients see of an origin failure, whatever the cause.
UPSTREAM_UNAVAILABLE = "The model's servers could not be reached; retry shortly."
# When every origin tried answered, with a server error (trial 31: "could not
# be reached" read as a network fault while the origins answered 500).
UPSTREAM_FAILED = "The model's servers answered with an error; retry shortly."
# When every origin tried was reached but sent nothing in time (a stream's
# first chunk past its bound, a whole answer past --read-timeout; trial 32).
UPSTREAM_SLOW = "The model's servers did not start answering in time; retry shortly."
# When every origin tried was reached, and they failed in different ways (one
# answered 500, another sent nothing in time).
UPSTREAM_UNANSWERED = "The model's servers were reached but did not answer; retry shortly."
# When every origin tried refused the proxy's own credential (CREDENTIAL_REFUSED)
# or its account (402, dataplane.upstream.forwarder.PAYMENT_REQUIRED):
# they did answer, and the fault is the gateway's configuration, which the
# client cannot fix (trial 51: said "reached but did not answer").
UPSTREAM_GATEWAY_REFUSED = (
    "The model's servers refused this gateway's credentials (or its account with them): a "
    "problem of the gateway's configuration, not of your request; contact its operator."
)
UPSTREAM_TIMEOUT = "The model's servers did not answer in time; retry shortly."
UPSTREAM_STREAM_BROKEN = "The model's servers stopped answering mid-stream; retry the request."
UPSTREAM_REFUSED = "The model's servers refused the request."
UPSTREAM_BUSY = "The model's servers are busy; retry shortly."
# A request still running when a stopping proxy's grace ran out (its
# --drain-seconds and the server's 60 s): a retry goes to another proxy.
PROXY_STOPPING = (
    "This proxy stopped before the answer was complete (it is being restarted or "
    "scaled down); retry the request."
)
PROXY_STOPPING_CODE: Final = "proxy_stopping"
MODEL_NOT_FOUND_CODE: Final = "model_not_found"
# Origin statuses whose OpenAI-style message is about the client's request
# (its content, size or model) and useful to it. Others may describe the
# operator's account with the origin (401, 403: its credential; a 429, which
# is failed over, names its organisation): a fixed message instead.
PASSED_ORIGIN_STATUSES = frozenset({400, 404, 409, 413, 415, 422})
# The messages passed on also include a 424's, which reaches a client only as
# the second origin's to one request (dataplane.upstream.forwarder): the
# model backend's failure on that request (TGI: a JSON schema its grammar
# library cannot build), whose reason the client can act on. (Not a status
# whose embedded error is the request's: error_blame.)
PASSED_MESSAGE_STATUSES = PASSED_ORIGIN_STATUSES | {424}
# An origin that refuses the proxy's own credential: the client's request
# was fine, so the next origin is tried (dataplane.upstream.forwarder), and
# with none left the client gets a 502, not the origin's 401.
CREDENTIAL_REFUSED = frozenset({401, 403, 407})
# Past this an origin's error message is not passed on: a client error
# message is a sentence or two, anything longer is a dump.
MAX_ORIGIN_MESSAGE = 1024
# Its type, param and code are names (a param a path in the body): past this,
# one is dropped (the type becomes invalid_request_error).
MAX_ORIGIN_NAME = 256
# An origin's error body past this is not parsed (it becomes the fixed error):
# a message of MAX_ORIGIN_MESSAGE characters and three names make a few KB;
# a larger body would be parsed on the event loop for nothing passed on.
MAX_ORIGIN_ERROR_BYTES = 64 * 1024
# What the access log's `error` takes of an origin's own error code (or type):
# a name, in characters a log search or a shell reads as they are. Anything
# else (longer, a space, a quote, not ASCII) leaves the answer's status there.
LOGGED_ORIGIN_CODE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def upstream_unavailable(message: str = UPSTREAM_UNAVAILABLE) -> ApiError:
    """502: no origin committed to an answer (connect errors, 5xx, timeouts,
    cuts, refusals of the proxy's credential). The message says what every
    origin tried did, when they all did the same (UPSTREAM_FAILED,
    UPSTREAM_SLOW, UPSTREAM_GATEWAY_REFUSED); the code is the same."""
    return ApiError(
        502,
        message,
        type="upstream_error",
        code="upstream_unavailable",
        logged=True,
    )


# A Responses follow-up's previous response lives on the one origin that
# stored it (dataplane.http.pipeline.Pipeline.pin): when that origin cannot be
# reached, no other can answer, and "retry shortly" alone would have a client
# retry for ever an origin that is gone (trial 64).
PINNED_UNREACHABLE = (
    "The earlier response this request continues ('previous_response_id') is stored on one "
    "origin, which cannot be reached now: retrying helps only if that origin comes back. To go "
    "on without it, send the conversation again in 'input' without 'previous_response_id'; "
    "any other origin can answer that."
)

# The same, when the route table marks that origin unhealthy: no call is made.
PINNED_UNHEALTHY = (
    "The earlier response this request continues ('previous_response_id') is stored on one "
    "origin, which is unhealthy now: retrying helps only once that origin recovers. To go on "
    "without it, send the conversation again in 'input' without 'previous_response_id'; any "
    "other origin can answer that."
)


def pinned_origin_unhealthy() -> ApiError:
    """503 for a Responses follow-up whose previous response is stored on an
    origin the table marks unhealthy (not drained): no origin is called, as
    for a model with none healthy (`no_healthy_origin`, `Retry-After`). Not
    the 400 previous_response_not_found of an origin drained or removed: a
    probe's verdict may pass with the origin's store intact, and that 400
    tells the client to start again (trial 80: a follow-up got the 502 of an
    origin that cannot be reached, retryable, until the probes marked it,
    then the 400)."""
    return ApiError(
        503,
        PINNED_UNHEALTHY,
        type="server_error",
        code="no_healthy_origin",
        param="previous_response_id",
        headers={"retry-after": "5"},
    )


def stored_origin_unhealthy(sent: str) -> ApiError:
    """503 for a stored response's route whose response is on an origin the
    table marks unhealthy (pinned_origin_unhealthy's reasons)."""
    return ApiError(
        503,
        f"The response with id '{sent[:256]}' is stored on one origin, which is unhealthy now: "
        "retry once that origin recovers.",
        type="server_error",
        code="no_healthy_origin",
        param="response_id",
        headers={"retry-after": "5"},
    )


def pinned_origin_failed(error: ApiError, route_header: str) -> ApiError:
    """`error`, an origin failure of a Responses follow-up that went only to
    the origin storing its previous response (Pipeline.forward), told so:
    `route_header: pinned`, and, when that origin could not be reached (an
    `upstream_unavailable` saying UPSTREAM_UNAVAILABLE), PINNED_UNREACHABLE
    naming `previous_response_id`. Its status stays: a 502, since the
    request's one origin failed (503 here says no origin was called, or all
    are busy), and its code, which alerts on origin failures count. Other
    failures (a 500 answered, a timeout, busy) keep their own message, which
    says what that origin did. Changes and returns `error`."""
    error.headers[route_header] = "pinned"
    if error.code == "upstream_unavailable" and error.message == UPSTREAM_UNAVAILABLE:
        error.message = PINNED_UNREACHABLE
        error.args = (PINNED_UNREACHABLE,)
        error.param = "previous_response_id"
    return error


def upstream_error_answer(error: dict[str, str | None]) -> ApiError:
    """502 for a request whose origins answered 2xx with an error and no
    answer (`{"error": {...}}` without `choices`, as some hosted APIs do;
    dataplane.upstream.forwarder), none answering otherwise: the error one of
    them gave, as origin_error_of rebuilt it. Its status is no 4xx, since
    nothing tells the client's fault from the origin's."""
    answer = ApiError(
        502,
        error["message"] or UPSTREAM_FAILED,
        type=error["type"] or "upstream_error",
        param=error["param"],
        code=error["code"],
        logged=True,
    )
    answer.recorded = "upstream_error"  # the origin's code is the client's only
    return answer


def upstream_busy(retry_after_s: float) -> ApiError:
    """429: every origin tried answered 429 (too busy, or its account over its
    quota) or failed; the client may come back after `retry_after_s` (the
    soonest wait of those origins, forwarder.busy_wait_s), in whole seconds,
    at least 1."""
    return ApiError(
        429,
        UPSTREAM_BUSY,
        type="upstream_error",
        code="upstream_busy",
        headers={"retry-after": retry_after_header(retry_after_s)},
        logged=True,
    )


# The connections this proxy may hold to the origins of a model were all in
# use (--max-origin-connections), or the caller's tenant held its share of
# them (--max-origin-connections-per-tenant): nothing was sent.
ORIGIN_BUSY = (
    "This gateway's connections to the model's servers that your requests may use are all "
    "in use; retry shortly."
)
# The wait ORIGIN_BUSY asks for: a connection comes free as any answer ends.
ORIGIN_BUSY_RETRY_S = 1.0


def origin_busy() -> ApiError:
    """503: no origin tried had a connection for the request (its pool at
    --max-origin-connections past --origin-queue-timeout, or the tenant's
    share of it taken); no origin was sent it. The client may come back
    after ORIGIN_BUSY_RETRY_S."""
    return ApiError(
        503,
        ORIGIN_BUSY,
        type="server_error",
        code="origin_busy",
        headers={"retry-after": retry_after_header(ORIGIN_BUSY_RETRY_S)},
        logged=True,
    )


def upstream_too_large(limit: int) -> ApiError:
    """502: the origin's whole answer was longer than the proxy holds
    (--max-answer-bytes, `limit`); no other origin was tried after it (a hedge
    already sent may have failed otherwise), since the same request would
    make as long an answer."""
    return ApiError(
        502,
        f"The model's answer was larger than this proxy accepts ({limit} bytes): "
        "ask for less in one request (fewer inputs or choices), stream it, or for "
        "embeddings ask for encoding_format base64.",
        type="upstream_error",
        code="upstream_answer_too_large",
        logged=True,
    )


# Error codes answered with a 5xx status that are no failure of the proxy's
# or an origin's: not counted as server errors (the control plane's reports,
# ponto_requests_total's alert and dashboards, a trace's status).
NOT_SERVER_ERRORS = frozenset({"not_cached"})


def not_cached(bypass: str = "") -> ApiError:
    """504: the request said `Cache-Control: only-if-cached` and no entry
    answers it (RFC 9111 5.2.1.7); no origin was called. `bypass` is why the
    cache could not serve it at all (dataplane.cache.policy.Reason), if so.

    RFC 9111 makes it a 504, but the client's own directive is its cause and
    asking again gives the same answer until an entry is stored: its type is
    invalid_request_error (as OpenAI's for a request it will not serve as
    made), it says `x-should-retry: false` (OpenAI's SDKs retry a 5xx twice
    otherwise, each try spending a rate-limit request) and it is not a server
    error (NOT_SERVER_ERRORS)."""
    why = f" (the cache does not serve this request: {bypass})" if bypass else ""
    error = ApiError(
        504,
        f"no cached answer for this request, and Cache-Control: only-if-cached forbids "
        f"asking an origin{why}",
        type="invalid_request_error",
        code="not_cached",
        headers={"x-should-retry": "false"},
    )
    error.spent = False
    return error


def upstream_timeout() -> ApiError:
    """504: the request's deadline passed before any origin committed."""
    return ApiError(
        504, UPSTREAM_TIMEOUT, type="upstream_error", code="upstream_timeout", logged=True
    )


def stream_broken_event(too_long: int = 0) -> bytes:
    """The SSE bytes that end a chat or completions stream an origin broke: an
    event whose data is an `error` object, then `data: [DONE]`. The openai SDK
    raises an APIError for an event whose data has an `error` object.

    With `too_long`, the stream was cut by the proxy's bound on one event
    (--max-answer-bytes, `too_long` bytes), not broken off: the error says
    so, since retrying the same request would be cut again."""
    return _chat_error_event(_event_too_large(too_long)) if too_long else _STREAM_BROKEN


def stream_stopped_event() -> bytes:
    """The SSE bytes that end a chat or completions stream the stopping
    proxy cancelled (code `proxy_stopping`), as stream_broken_event's."""
    return _STREAM_STOPPED


def responses_stopped_event(sequence_number: int | None) -> bytes:
    """A Responses stream's `error` event for the same, numbered as
    responses_broken_event's."""
    return _responses_error_event(sequence_number, _STOPPING)


def responses_broken_event(sequence_number: int | None, too_long: int = 0) -> bytes:
    """The SSE bytes that end a Responses stream an origin broke (or, with
    `too_long`, that the bound on one event cut, as for stream_broken_event).
    It has no `[DONE]`: it ends in OpenAI's `error` event (`event: error`,
    data of type "error" with its code and message), which also holds the
    `error` object the SDK raises for, as in chat streams.

    Every event of a Responses stream carries a `sequence_number`, one more
    than the event before it: this one `sequence_number`
    (dataplane.streaming.relay.next_sequence_number), left out when None (an
    origin whose events carry none)."""
    return _responses_error_event(
        sequence_number, _event_too_large(too_long) if too_long else _BROKEN
    )


def _responses_error_event(sequence_number: int | None, error: dict[str, str | None]) -> bytes:
    numbered = {} if sequence_number is None else {"sequence_number": sequence_number}
    return (
        b"event: error\ndata: "
        + jsonio.dumps(
            {
                "type": "error",
                "code": error["code"],
                "message": error["message"],
                "param": None,
                **numbered,
                "error": error,
            }
        )
        + b"\n\n"
    )


def _event_too_large(limit: int) -> dict[str, str | None]:
    return {
        "message": f"The model's answer held one event larger than this proxy accepts "
        f"({limit} bytes), so the stream was cut there; the same request would be cut "
        "again: ask for a shorter answer (fewer choices, or smaller tool arguments).",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_event_too_large",
    }


_BROKEN = {
    "message": UPSTREAM_STREAM_BROKEN,
    "type": "upstream_error",
    "param": None,
    "code": "upstream_stream_broken",
}
_STOPPING = {
    "message": PROXY_STOPPING,
    "type": "server_error",
    "param": None,
    "code": PROXY_STOPPING_CODE,
}


def no_route_table() -> ApiError:
    """503 for a request the proxy cannot place: it has no route table yet
    (a first one is a round trip to the control plane away)."""
    return ApiError(
        503,
        "the proxy has no route table yet; retry shortly",
        type="server_error",
        code="no_route_table",
        headers={"retry-after": "1"},
    )


def proxy_stopping() -> ApiError:
    """503 for a request whose answer had not begun when the stopping
    proxy cancelled it (see _STOPPING)."""
    return ApiError(503, PROXY_STOPPING, type="server_error", code=PROXY_STOPPING_CODE)


def _chat_error_event(error: dict[str, str | None]) -> bytes:
    return b"data: " + jsonio.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n"


def chat_error_event(error: dict[str, Any]) -> bytes:
    """A chat or completions stream's error event for `error` (an OpenAI
    error object) and its `[DONE]`: what a stream ends with when its head
    was sent before its origin failed (dataplane.http.hold)."""
    return _chat_error_event(error)


def responses_error_event(sequence_number: int | None, error: dict[str, Any]) -> bytes:
    """A Responses stream's `error` event for `error`, as chat_error_event's."""
    return _responses_error_event(sequence_number, error)


_STREAM_BROKEN = _chat_error_event(_BROKEN)
_STREAM_STOPPED = _chat_error_event(_STOPPING)


class OriginError(NamedTuple):
    """An origin's error answer (status 400 and up) as the proxy relays it."""

    body: bytes  # what the client gets: see origin_error
    # What the access log's `error` says of it: the origin's own error code
    # when a name (LOGGED_ORIGIN_CODE), else its type when a name (vLLM's code
    # is a number; a code of any other shape too); "" otherwise (the log then
    # says the status).
    code: str


def origin_error(
    status: int,
    content_type: str,
    body: bytes,
    reindex: Callable[[str], str] | None = None,
) -> OriginError:
    """What a client gets of an origin's error answer, and what the log does.

    With a status in PASSED_MESSAGE_STATUSES, an OpenAI-style JSON error
    (`{"error": {"message": ...}}`, vLLM's flat `{"object": "error",
    "message": ...}`, TGI's `{"error": "...", "error_type": ...}`, or TEI's
    `{"message": ..., "code": STATUS, "type": ...}`) is
    rebuilt from its message (at most MAX_ORIGIN_MESSAGE characters), type,
    param and code (strings of at most MAX_ORIGIN_NAME, or null); other
    members are dropped. Anything else becomes a
    fixed error of the same status. (A 5xx or 429 never gets here: the
    forwarder tries the next origin.) `reindex` rewrites
    the passed message and param (the client's own message indexes). The
    body is parsed once, for both, and only when JSON of at most
    MAX_ORIGIN_ERROR_BYTES: the log's code is read of any status (its
    message is not passed on, a code is a name). Pure.
    """
    fields = _origin_error_fields(content_type, body)
    err = None
    if fields is not None and status in PASSED_MESSAGE_STATUSES:
        err = _rebuilt(fields)
    if err is not None and reindex is not None:
        err = {k: reindex(v) if k in ("message", "param") and v else v for k, v in err.items()}
    if err is None:
        err = {
            "message": UPSTREAM_REFUSED,
            "type": "invalid_request_error" if status < 500 else "upstream_error",
            "param": None,
            "code": "upstream_error",
        }
    return OriginError(jsonio.dumps({"error": err}), _logged_code(fields))


def _origin_error_fields(content_type: str, body: bytes) -> Mapping[str, object] | None:
    if content_type != "application/json" or len(body) > MAX_ORIGIN_ERROR_BYTES:
        return None
    try:
        obj = jsonio.loads(body)
    except jsonio.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return _error_fields(obj)


def _logged_code(fields: Mapping[str, object] | None) -> str:
    if fields is None:
        return ""
    for name in ("code", "type"):
        value = fields.get(name)
        # (vLLM's code is the status, a number: its type, BadRequestError, says more.)
        if isinstance(value, str) and LOGGED_ORIGIN_CODE.fullmatch(value):
            return value
    return ""


def origin_error_of(
    obj: dict[str, object], default_type: str = "invalid_request_error"
) -> dict[str, str | None] | None:
    """The error an origin's parsed JSON object holds, rebuilt as
    origin_error does (the type `default_type` when it gives none);
    None when it holds none that may be passed on. Pure."""
    fields = _error_fields(obj)
    return None if fields is None else _rebuilt(fields, default_type)


def _error_fields(obj: dict[str, object]) -> Mapping[str, object] | None:
    """The members of the error an origin's JSON object holds, in any of
    the shapes origin_error reads; None when it holds none."""
    inner = obj.get("error")
    if isinstance(inner, dict):
        return inner
    if obj.get("object") == "error":
        return obj
    if isinstance(inner, str):
        # TGI's shape: `{"error": "Input validation error: ...", "error_type":
        # "validation"}` (trial 51: replaced by the fixed message).
        return {"message": inner, "type": obj.get("error_type")}
    if inner is None and type(obj.get("code")) is int and isinstance(obj.get("type"), str):
        # TEI's OpenAI-compatible shape: `{"message": "batch size 64 > maximum
        # allowed batch size 32", "code": 413, "type": "validation"}`, its code
        # the status (trial 79: the fixed message left a RAG app to guess
        # that its batches had to be smaller).
        return {"message": obj.get("message"), "type": obj["type"]}
    return None


def _rebuilt(
    err: Mapping[str, object], default_type: str = "invalid_request_error"
) -> dict[str, str | None] | None:
    message = err.get("message")
    if not isinstance(message, str) or not message or len(message) > MAX_ORIGIN_MESSAGE:
        return None
    return {
        "message": message,
        "type": _str_or_none(err.get("type")) or default_type,
        "param": _str_or_none(err.get("param")),
        "code": _str_or_none(err.get("code")),
    }


# Whose fault a 2xx answer's embedded error is (error_blame), by its code,
# status or type: an account's (the gateway's credential, its billing), an
# origin too busy, the request's, the origin's own, or unknown.
ACCOUNT_WORDS: Final = ("api_key", "auth", "permission", "billing", "quota", "credit", "payment")
BUSY_WORDS: Final = ("rate_limit", "overloaded", "too_many_requests")
REQUEST_WORDS: Final = (
    "invalid",
    "validation",
    "bad_request",
    "badrequest",
    "not_found",
    "notfound",
    "too_long",
    "context_length",
    "unsupported",
)
ORIGIN_WORDS: Final = ("server_error", "internal", "engine", "unavailable", "timeout")
ACCOUNT_STATUSES: Final = frozenset({401, 402, 403, 407})


def error_blame(obj: dict[str, object]) -> str:
    """ "account", "busy", "request", "origin" or "unknown": whose fault the
    error an origin's 2xx JSON body holds is (`{"error": {...}}` with no
    answer; reviews 201 and 205), an account's words first (an
    `insufficient_quota` with code 400 is the account's). Only a request's
    error is shown to the client: an account's says things of the operator's
    account (its credit, its key) no client should read. Only the origin's
    own (a 5xx, an engine error) and an account's count against the origin:
    one no rule knows is failed over, neither shown nor counted, so that a
    client cannot eject origins with requests they answer so."""
    inner = obj.get("error")
    err = inner if isinstance(inner, dict) else obj
    words = []
    numbers = []
    for key in ("type", "code", "status"):
        value = err.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int):
            numbers.append(value)
        elif isinstance(value, str):
            words.append(value.lower())
    if isinstance(inner, str) and isinstance(obj.get("error_type"), str):
        words.append(str(obj["error_type"]).lower())

    def said(these: tuple[str, ...]) -> bool:
        return any(w in word for word in words for w in these)

    if said(ACCOUNT_WORDS) or ACCOUNT_STATUSES.intersection(numbers):
        return "account"
    if said(BUSY_WORDS) or 429 in numbers or 529 in numbers:
        return "busy"
    if said(REQUEST_WORDS) or PASSED_ORIGIN_STATUSES.intersection(numbers):
        return "request"
    if said(ORIGIN_WORDS) or any(500 <= n < 600 for n in numbers):
        return "origin"
    return "unknown"


def _str_or_none(value: object) -> str | None:
    """A string member of an origin's error, None when of another type or
    longer than a name is (then it is no name, but a dump)."""
    return value if isinstance(value, str) and len(value) <= MAX_ORIGIN_NAME else None
