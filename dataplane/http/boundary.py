"""The error boundary of every route: errors in the OpenAI shape, every answer
counted, every answer with its request id."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from dataplane.http.errors import ApiError
from dataplane.http.refusals import refusals
from dataplane.http.state import (
    DRAINING,
    EXCHANGE,
    METRICS,
    PRINCIPAL,
    REQUEST_ID,
    REQUEST_IDS,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLIENT_CLOSED = 499


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The error boundary: every failure becomes an OpenAI-style error, and every
    answer is counted and carries `x-request-id`.

    The request's id (the client's own when acceptable, see
    dataplane.http.requestid; new ones from the app's REQUEST_IDS) is set in
    request[REQUEST_ID] before the handler runs. An ApiError is answered
    with its status and logged once in the refusal log (unless its cause was
    logged where it happened); the caller's rate-limit headers come from the
    request's Exchange when it has one. Anything else is a bug: logged once
    with its traceback, answered with a generic 500 in the same shape.
    """
    started = time.perf_counter()
    app = request.app
    request_id = request[REQUEST_ID] = app[REQUEST_IDS].of(request.headers.get("x-request-id"))
    route = request.match_info.route
    endpoint = route.name or "other"
    m = app[METRICS]
    if app[DRAINING].active:
        # Any answer, streams included (they are prepared inside the handler),
        # says `Connection: close`: the client opens its next request elsewhere.
        request._message = request._message._replace(should_close=True)
    failed = False
    try:
        response = await handler(request)
    except Exception as exc:
        response = _error_response(request, exc)
        failed = True
    ex = request.get(EXCHANGE)
    if not response.prepared:  # a stream sent its headers itself
        response.headers.setdefault("x-request-id", request_id)
    if failed and ex is not None:
        # An error answer to a proxied request: the caller's limits.
        for name, value in ex.limit_headers:
            response.headers.setdefault(name, value)
    principal = ex.principal if ex is not None and ex.authenticated else request.get(PRINCIPAL)
    if principal is not None:
        m.account_request(principal.tenant, principal.key_id, response.status)
    m.child(m.requests, endpoint, str(response.status)).inc()
    m.child(m.duration, endpoint).observe(time.perf_counter() - started)
    return response


def _error_response(request: web.Request, exc: Exception) -> web.Response:
    """The answer to a failure (an unprepared response); a redirect is re-raised."""
    if isinstance(exc, ApiError):
        if not exc.logged:
            _refused(request, exc.status, exc.code, exc.message)
        return exc.response()
    if isinstance(exc, web.HTTPException):
        # Router errors (unknown path, wrong method) in the same shape.
        if exc.status < 400:
            raise exc
        error = ApiError(
            exc.status,
            f"{_what(request)}: {exc.reason}",
            code=exc.reason.lower().replace(" ", "_"),
        )
        _refused(request, error.status, error.code, error.message)
        response = error.response()
        response.headers.extend((k, v) for k, v in exc.headers.items() if k.lower() == "allow")
        return response
    if isinstance(exc, ConnectionResetError):
        # The client went away while its answer was being written (a replay, a
        # followed flight): nobody to answer, nothing to log. Counted as
        # nginx's 499, "client closed request".
        request.app[METRICS].client_disconnects.inc()
        return web.Response(status=CLIENT_CLOSED)
    request.app.logger.exception("unhandled error on %s %s", request.method, request.path)
    return ApiError(
        500, "internal error in the proxy", type="server_error", code="internal_error"
    ).response()


def _refused(request: web.Request, status: int, code: str | None, message: str) -> None:
    refusals.refused(
        status,
        code,
        message,
        request_id=request[REQUEST_ID],
        remote=request.remote,
        what=_what(request),
    )


def _what(request: web.Request) -> str:
    """The request line's method and path, the path cut so that a huge one
    makes neither a huge log line nor a huge error message."""
    path = request.path
    return f"{request.method} {path if len(path) <= 200 else path[:200] + '...'}"


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The proxied routes' `Expect` handler: `100-continue` is answered as
    aiohttp does; any other expectation gets a 417 in the OpenAI shape (aiohttp
    answers one in plain text, before any middleware runs)."""
    expect = request.headers.get("expect", "")
    if expect.lower() == "100-continue":
        await _default_expect_handler(request)
        return None
    request_id = request.app[REQUEST_IDS].of(request.headers.get("x-request-id"))
    error = ApiError(
        417,
        "Expect: only 100-continue is supported",
        code="expectation_failed",
        headers={"x-request-id": request_id},
    )
    refusals.refused(
        error.status,
        error.code,
        error.message,
        request_id=request_id,
        remote=request.remote,
        what=f"{request.method} {request.path}",
    )
    return error.response()
