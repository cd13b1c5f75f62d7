"""HTTP handlers: parse and check the request, pick candidates, forward.

Handlers stay thin: every refusal is an ApiError (OpenAI error shape, right
status), raised before anything reaches an origin.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dataplane import jsonio
from dataplane.assemble import assemble
from dataplane.auth.authenticator import AuthError, Principal
from dataplane.edgecache import CacheRequest
from dataplane.errors import ApiError, bad_request
from dataplane.policy import EdgePolicy
from dataplane.ratelimit.limiter import Admission, RateLimiter
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from dataplane.state import (
    CACHE,
    CLIENT,
    DRAINING,
    FORWARDER,
    HOLDER,
    LIMITER,
    LOCATOR,
    METRICS,
    QUOTA,
    SETTINGS,
)
from dataplane.upstream import StreamTap
from dataplane.usage import Usage, UsageTap, usage_of_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Per endpoint: upstream path and the field that must be present.
ENDPOINTS = {
    "chat.completions": ("/chat/completions", "messages"),
    "completions": ("/completions", "prompt"),
    "embeddings": ("/embeddings", "input"),
}


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"request body is larger than the limit of {limit} bytes", code="body_too_large"
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, not {request.content_type or 'missing'}",
            code="unsupported_media_type",
        )
    limit = request.app[SETTINGS].max_body_bytes
    # A declared length over the limit is refused before reading a byte;
    # chunked bodies are cut off by aiohttp's client_max_size while reading.
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(limit) from exc
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    request["raw_body"] = raw
    return body


def _no_table() -> ApiError:
    return ApiError(
        503,
        "the proxy has no route table yet; retry shortly",
        type="server_error",
        code="no_route_table",
        headers={"retry-after": "1"},
    )


# How long a request may wait for a concurrency slot when this proxy holds none:
# about two rebalances of the leader, which is how long a proxy that has just
# joined (a rolling upgrade, a scale-up) waits for slots freed by the others.
SLOT_WAIT_S = 2.5
_SLOT_POLL_S = 0.05


async def _admit_after_next_share(
    limiter: RateLimiter, scopes: Sequence[str], estimate: int
) -> Admission:
    """Admit once a share brings a slot, or refuse after SLOT_WAIT_S.

    Only for a proxy that holds no slot yet (RateLimiter.slotless): waiting
    admits nothing the fleet's limit does not allow, it waits for this proxy's
    part of it. A share that still brings no slot is not tried (so waiting adds
    no demand beyond the first refusal); waiters per scope are capped by its
    limit.
    """
    deadline = time.monotonic() + SLOT_WAIT_S
    seen = limiter.share_version
    limiter.wait_begin(scopes)
    try:
        while True:
            await asyncio.sleep(_SLOT_POLL_S)
            now = time.monotonic()
            if now >= deadline:
                break
            if limiter.share_version == seen:
                continue
            seen = limiter.share_version
            if limiter.slots_free(scopes):
                break
    finally:
        limiter.wait_end(scopes)
    return limiter.admit(scopes, estimate, time.monotonic())


def _refusal(admission: Admission, headers: list[tuple[str, str]]) -> ApiError:
    """429 in OpenAI's words, or 400 for a request no wait could admit."""
    if admission.too_large:
        return ApiError(
            400,
            "this request needs more tokens than the per-minute limit allows; "
            "shorten it or lower max_tokens",
            code="tokens_over_limit",
        )
    what = {"requests": "requests", "tokens": "tokens", "concurrency": "concurrent requests"}[
        admission.limit or "requests"
    ]
    err = ApiError(
        429,
        f"Rate limit reached for {what}. Please try again in {admission.retry_after_s:.2f}s.",
        type="requests" if admission.limit != "tokens" else "tokens",
        code="rate_limit_exceeded",
        headers={"retry-after": admission.retry_after_header()},
    )
    err.headers.update(headers)
    return err


def _validate(endpoint: str, body: dict[str, Any], required: str) -> bool:
    """Check the fields every endpoint needs; return the stream flag."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", param="model")
    if required not in body:
        raise bad_request(f"'{required}' is required", param=required)
    if required == "messages":
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"'messages[{i}]' must be an object with a string 'role'",
                    param=f"messages[{i}]",
                )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    return stream


def make_proxy_handler(endpoint: str) -> Handler:
    path, required = ENDPOINTS[endpoint]

    async def handle(request: web.Request) -> web.StreamResponse:
        app = request.app
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        request["request_id"] = request_id
        holder = app[HOLDER]
        routes, policy = holder.routes, holder.policy
        if routes is None or policy is None:
            raise _no_table()
        # Who is calling is settled before the body is read: a caller without
        # a valid credential costs the proxy no more than its headers.
        principal = _authenticate(request, policy)
        request["principal"] = principal
        body = await read_json(request)
        stream = _validate(endpoint, body, required)
        tenant = policy.tenant(principal.tenant)
        public_model = body["model"]
        assembled = assemble(endpoint, body, tenant.prompt)
        model = body["model"]
        if not isinstance(model, str) or model not in routes.groups:
            raise ApiError(
                404,
                f"The model '{public_model}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        limiter = app[LIMITER]
        estimate = estimate_prompt_tokens(endpoint, body)
        now = time.monotonic()
        admission = limiter.admit(principal.scopes, estimate, now)
        if (
            not admission.ok
            and admission.limit == "concurrency"
            and limiter.slotless(principal.scopes, now)
        ):
            admission = await _admit_after_next_share(limiter, principal.scopes, estimate)
            now = time.monotonic()
        limit_headers = limiter.headers(principal.scopes, now)
        request["limit_headers"] = limit_headers
        if not admission.ok:
            raise _refusal(admission, limit_headers)
        usage: Usage | None = None
        try:
            raw = jsonio.dumps(body) if assembled else request["raw_body"]

            async def call_origin(
                tap: StreamTap | None, extra: Sequence[tuple[str, str]]
            ) -> web.StreamResponse:
                home = app[LOCATOR].home(routes, request.remote, request.headers)
                forwarder = app[FORWARDER]
                candidates = routes.candidates(model, home, limit=forwarder.candidate_limit())
                if not candidates:
                    raise ApiError(
                        503,
                        f"no healthy origin serves model '{model}' now (drained or unhealthy)",
                        type="server_error",
                        code="no_healthy_origin",
                        headers={"retry-after": "5"},
                    )
                return await forwarder.forward(
                    request,
                    path,
                    raw,
                    candidates,
                    request_id,
                    extra_headers=[*limit_headers, *extra],
                    tap=tap,
                )

            usage_tap = UsageTap() if stream else None
            cached = CacheRequest(endpoint, body, tenant, stream)
            response = await app[CACHE].respond(request, cached, call_origin, usage_tap)
            if response.headers.get("x-ponto-cache") == "hit":
                usage = Usage(0, 0)  # no origin tokens were spent: give the estimate back
            elif usage_tap is not None:
                usage = usage_tap.result(estimate)
            elif isinstance(response, web.Response) and response.status < 400:
                usage = usage_of_body(response.body) if isinstance(response.body, bytes) else None
            return response
        finally:
            admission.release(usage.total if usage is not None else None, time.monotonic())
            if usage is not None:
                app[METRICS].account_tokens(principal.tenant, principal.key_id, usage)

    handle.__name__ = f"handle_{endpoint.replace('.', '_')}"
    return handle


def _authenticate(request: web.Request, policy: EdgePolicy) -> Principal:
    try:
        return policy.authenticator.authenticate(request.headers.get("authorization"), time.time())
    except AuthError as exc:
        raise ApiError(
            401, exc.message, code=exc.code, headers={"www-authenticate": exc.www_authenticate}
        ) from None


async def list_models(request: web.Request) -> web.Response:
    """The models the caller may name: what origins serve, plus its tenant's aliases."""
    holder = request.app[HOLDER]
    routes, policy = holder.routes, holder.policy
    models: list[str] = list(routes.models) if routes else []
    if policy is not None:
        principal = _authenticate(request, policy)
        request["principal"] = principal
        served = set(models)
        aliases = policy.tenant(principal.tenant).prompt.aliases
        models += sorted(a for a, target in aliases.items() if target in served and a not in served)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "ponto"} for m in models]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps_str)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers. Readiness (a table to serve) is /readyz."""
    holder = request.app[HOLDER]
    routes = holder.routes
    return web.json_response(
        {
            "status": "ok",
            "route_table_version": routes.version if routes else 0,
            "route_table_source": holder.source,
            "control_plane_connected": request.app[CLIENT].connected,
            "quota_generation": request.app[CLIENT].quota_generation,
        },
        dumps=_dumps_str,
    )


async def readyz(request: web.Request) -> web.Response:
    """Ready: a route table to serve, and its rate-limit shares if it has limits."""
    if request.app[HOLDER].routes is None:
        raise ApiError(503, "no route table yet", type="server_error", code="no_route_table")
    if not request.app[QUOTA].ready:
        raise ApiError(
            503,
            "waiting for this proxy's share of the rate limits",
            type="server_error",
            code="no_quota_shares",
        )
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS].registry)
    return web.Response(body=data, headers={"content-type": CONTENT_TYPE_LATEST})


def _dumps_str(value: Any) -> str:
    return jsonio.dumps(value).decode()


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI-style error and count every answer."""
    started = time.perf_counter()
    route = request.match_info.route
    endpoint = route.name or "other"
    m = request.app[METRICS]
    if request.app[DRAINING].active:
        # Any answer, streams included (they are prepared inside the handler),
        # says `Connection: close`: the client opens its next request elsewhere.
        request._message = request._message._replace(should_close=True)
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response(
            {"x-request-id": request.get("request_id", "")} if "request_id" in request else None
        )
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
        request.app.logger.exception("unhandled error on %s %s", request.method, request.path)
        response = ApiError(
            500, "internal error in the proxy", type="server_error", code="internal_error"
        ).response()
    principal = request.get("principal")
    if principal is not None:
        m.account_request(principal.tenant, principal.key_id, response.status)
    limit_headers = request.get("limit_headers")
    if limit_headers and not response.prepared:
        for name, value in limit_headers:
            response.headers.setdefault(name, value)
    m.child(m.requests, endpoint, str(response.status)).inc()
    m.child(m.duration, endpoint).observe(time.perf_counter() - started)
    return response
