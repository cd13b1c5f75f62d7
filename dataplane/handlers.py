"""HTTP handlers: parse and check the request, pick candidates, forward.

Handlers stay thin: every refusal is an ApiError (OpenAI error shape, right
status), raised before anything reaches an origin.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dataplane import jsonio
from dataplane.errors import ApiError, bad_request
from dataplane.state import CLIENT, FORWARDER, HOLDER, LOCATOR, METRICS, SETTINGS

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


def make_proxy_handler(endpoint: str) -> Handler:
    path, required = ENDPOINTS[endpoint]

    async def handle(request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request["request_id"] = request_id
        body = await read_json(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required and must be a non-empty string", param="model")
        if required not in body:
            raise bad_request(f"'{required}' is required", param=required)
        if required == "messages" and (
            not isinstance(body["messages"], list) or not body["messages"]
        ):
            raise bad_request("'messages' must be a non-empty array", param="messages")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", param="stream")
        routes = request.app[HOLDER].routes
        if routes is None:
            raise ApiError(
                503,
                "the proxy has no route table yet; retry shortly",
                type="server_error",
                code="no_route_table",
                headers={"retry-after": "1"},
            )
        home = request.app[LOCATOR].home(routes, request.remote, request.headers)
        forwarder = request.app[FORWARDER]
        candidates = routes.candidates(model, home, limit=forwarder.candidate_limit())
        if not candidates:
            if model not in routes.groups:
                raise ApiError(
                    404,
                    f"The model '{model}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            raise ApiError(
                503,
                f"no healthy origin serves model '{model}' now (drained or unhealthy)",
                type="server_error",
                code="no_healthy_origin",
                headers={"retry-after": "5"},
            )
        return await forwarder.forward(request, path, request["raw_body"], candidates, request_id)

    handle.__name__ = f"handle_{endpoint.replace('.', '_')}"
    return handle


async def list_models(request: web.Request) -> web.Response:
    routes = request.app[HOLDER].routes
    models = routes.models if routes else ()
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
        },
        dumps=_dumps_str,
    )


async def readyz(request: web.Request) -> web.Response:
    if request.app[HOLDER].routes is None:
        raise ApiError(503, "no route table yet", type="server_error", code="no_route_table")
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
    m.requests.labels(endpoint, str(response.status)).inc()
    m.duration.labels(endpoint).observe(time.perf_counter() - started)
    return response
