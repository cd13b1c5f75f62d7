"""The error boundary of every route: errors in the OpenAI shape, every answer counted."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from dataplane.http.errors import ApiError
from dataplane.http.state import DRAINING, EXCHANGE, METRICS, PRINCIPAL

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The error boundary: every failure becomes an OpenAI-style error, and every
    answer is counted.

    An ApiError is answered with its status; its request id and the caller's
    rate-limit headers come from the request's Exchange when it has one.
    Anything else is a bug: logged once with its traceback, answered with a
    generic 500 in the same shape.
    """
    started = time.perf_counter()
    app = request.app
    route = request.match_info.route
    endpoint = route.name or "other"
    m = app[METRICS]
    if app[DRAINING].active:
        # Any answer, streams included (they are prepared inside the handler),
        # says `Connection: close`: the client opens its next request elsewhere.
        request._message = request._message._replace(should_close=True)
    try:
        response = await handler(request)
    except ApiError as exc:
        ex = request.get(EXCHANGE)
        if ex is None:
            response = exc.response()
        else:
            response = exc.response({"x-request-id": ex.request_id})
            for name, value in ex.limit_headers:
                response.headers.setdefault(name, value)
    except web.HTTPException as exc:
        # Router errors (unknown path, wrong method) in the same shape.
        if exc.status < 400:
            raise
        response = ApiError(
            exc.status,
            f"{request.method} {request.path}: {exc.reason}",
            code=exc.reason.lower().replace(" ", "_"),
        ).response()
        response.headers.extend((k, v) for k, v in exc.headers.items() if k.lower() == "allow")
    except Exception:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        response = ApiError(
            500, "internal error in the proxy", type="server_error", code="internal_error"
        ).response()
    ex = request.get(EXCHANGE)
    principal = ex.principal if ex is not None and ex.authenticated else request.get(PRINCIPAL)
    if principal is not None:
        m.account_request(principal.tenant, principal.key_id, response.status)
    m.child(m.requests, endpoint, str(response.status)).inc()
    m.child(m.duration, endpoint).observe(time.perf_counter() - started)
    return response
