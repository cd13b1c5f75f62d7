"""A stored response's routes: retrieve, delete, cancel, list its input items.

    GET    /v1/responses/{id}               responses.retrieve (?stream=true streams)
    DELETE /v1/responses/{id}               responses.delete
    POST   /v1/responses/{id}/cancel        responses.cancel
    GET    /v1/responses/{id}/input_items   responses.input_items

Each goes to the one origin that stored the response, which its id names
(dataplane.upstream.responseids): another replica has no such response. The
caller is authenticated and refused as for a chat call (401, 403 for a
suspended tenant), and counted as one request, with no tokens, against its
limits (a refusal is the usual 429). An id that is not one this gateway made
for the caller's tenant is a 404 `not_found`, in the same words whoever's it
is; one no path may carry (any character but letters, digits, '_' and '-')
a 400; neither reaches an origin; so is every id under a table without id
keys (an older control plane's: no id can be checked); an origin that serves
no requests now (drained, removed) is a 404 too, as its responses are gone
for the client; one the table marks unhealthy a 503 to retry, as a probe's
verdict may pass with its store intact. The call has
the origin's credential and the proxy's timeouts, and its answer is relayed as
any origin's: a 2xx with the response's ids shown as the client knows them, an
error through the allowlist (dataplane.http.errors.origin_error), a 5xx
or no answer as the fixed 502 (no other origin is tried).

No Exchange: these calls are no inference (no GenAI metrics, no cache, no
placement); the error boundary counts and logs them under their route's name,
for the caller noted in PRINCIPAL, with the origin call noted in ORIGIN_CALL
(the access line's origin, region, origin_request_id, attempts and an
error answer's code, as a proxied request's). An answer names its origin as
a proxied one does (`x-ponto-origin`, `x-ponto-region`; none on an error),
carries `x-ponto-origin-request-id` for the origin's own request id (an
error too), and its `x-request-id` is the proxy's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiohttp import hdrs, web
from multidict import CIMultiDict

from dataplane.http.accesslog import OriginCall
from dataplane.http.errors import (
    ApiError,
    AuthUnavailableError,
    Unauthorized,
    invalid_response_id,
    no_route_table,
    origin_error,
    response_not_found,
    responses_broken_event,
    stored_origin_unhealthy,
)
from dataplane.http.pipeline import (
    authenticate_waiting,
    refusal,
    refuse_suspended,
    sole_authorization,
)
from dataplane.http.reply import ORIGIN_REQUEST_ID_HEADER, Rewritten
from dataplane.http.requestid import origin_request_id
from dataplane.http.state import DRAINING, ORIGIN_CALL, PRINCIPAL, REQUEST_ID, SERVER_NAME
from dataplane.streaming.relay import next_sequence_number, relay
from dataplane.streaming.sse import Event
from dataplane.upstream.forwarder import OriginAnswer, Sent
from dataplane.upstream.responseids import (
    MAX_ID_CHARS,
    Decoded,
    IdKeys,
    Rewriter,
    StreamIds,
    ids_of,
    rewrite_words,
    safe_id,
)
from dataplane.upstream.wire import media_type

if TYPE_CHECKING:
    from dataplane.http.pipeline import Pipeline
    from dataplane.routes import Target

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Action:
    name: str  # the route's name: the metrics' and access log's endpoint label
    method: str
    suffix: str  # after the id, in the client's path and the origin's


ACTIONS: Final = (
    Action("responses.retrieve", "GET", ""),
    Action("responses.delete", "DELETE", ""),
    Action("responses.cancel", "POST", "/cancel"),
    Action("responses.input_items", "GET", "/input_items"),
)


def add_routes(router: web.UrlDispatcher, pipeline: Callable[[], Pipeline | None]) -> None:
    """The four routes, on `router`; `pipeline` gives the app's (built by its
    start step, before it serves)."""
    for action in ACTIONS:
        router.add_route(
            action.method,
            "/v1/responses/{response_id}" + action.suffix,
            handler(action, pipeline),
            name=action.name,
        )


def handler(action: Action, pipeline: Callable[[], Pipeline | None]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        p = pipeline()
        assert p is not None
        return await answer(p, action, request)

    handle.__name__ = f"handle_{action.name.replace('.', '_')}"
    return handle


async def answer(pipeline: Pipeline, action: Action, request: web.Request) -> web.StreamResponse:
    """One call of `action`, answered (see the module's docstring)."""
    holder = pipeline.holder
    if not await holder.wait_first():
        raise no_route_table()
    routes, policy = holder.routes, holder.policy
    if routes is None or policy is None:
        raise no_route_table()
    try:
        principal = await authenticate_waiting(policy, sole_authorization(request.headers))
    except (Unauthorized, AuthUnavailableError) as exc:
        if exc.owner is not None:  # an expired key: counted for its owner
            request[PRINCIPAL] = exc.owner
        raise
    request[PRINCIPAL] = principal
    refuse_suspended(policy, principal)
    sent = request.match_info["response_id"]
    if not safe_id(sent):
        raise invalid_response_id(sent, MAX_ID_CHARS)
    keys = routes.id_keys
    signed_for, legacy = policy.tenant(principal.tenant).signs_for(principal.tenant)
    decoded = keys.verified(sent, signed_for, legacy) if keys is not None else None
    if keys is None or decoded is None:
        raise response_not_found(sent)
    target = routes.stored_on.get(decoded.origin)
    if target is None:
        if decoded.origin in routes.unhealthy_stores:
            raise stored_origin_unhealthy(sent)
        raise response_not_found(sent, "it was stored on an origin that is not serving now")
    limiter = pipeline.limiter
    scopes = principal.scopes
    admission = limiter.admit(scopes, 0, time.monotonic())
    limits = limiter.headers(scopes, time.monotonic(), None if admission.ok else admission)
    if not admission.ok:
        pipeline.metrics.limit_refusal(principal.tenant, admission.limit or "requests")
        error = refusal(admission)
        error.headers.update(limits)
        raise error
    try:
        return await _call(
            pipeline,
            action,
            request,
            principal.tenant,
            (keys, signed_for),
            decoded,
            sent,
            target,
            limits,
        )
    finally:
        # No tokens: the estimate (0) stands, and the completions expected
        # are not taught a zero (Admission.release).
        admission.release(None, time.monotonic())


async def _call(
    pipeline: Pipeline,
    action: Action,
    request: web.Request,
    tenant: str,
    signer: tuple[IdKeys, str],
    decoded: Decoded,
    sent: str,
    target: Target,
    limits: list[tuple[str, str]],
) -> web.StreamResponse:
    """`tenant`: the caller's, whose share of the origin's connections the
    call takes; `signer`: the table's keys and the owner (the tenant's
    record) the ids the answer names are shown for."""
    forwarder = pipeline.forwarder
    stream = action.name == "responses.retrieve" and request.query.get("stream") == "true"
    path = f"/responses/{decoded.original}{action.suffix}"
    query = request.rel_url.raw_query_string
    if query:
        path += "?" + query
    ours = request[REQUEST_ID]
    headers = forwarder.request_headers(request.headers, ours)
    headers.popall("content-type", None)  # no body
    idle = pipeline.stream_idle_timeout if stream else None
    called = request[ORIGIN_CALL] = OriginCall()
    made = Sent()
    try:
        origin = await forwarder.forward(
            path,
            b"",
            headers,
            [target],
            stream=stream,
            first_chunk_within=idle,
            method=action.method,
            tenant=tenant,
            sent=made,
        )
    except ApiError as exc:
        # As a proxied request's (Pipeline.forward): an error of the proxy's own
        # (no origin answered) names no origin.
        called.attempts = exc.attempts
        exc.headers.update(limits)
        raise
    except asyncio.CancelledError:
        called.attempts = made.calls  # its client left after the call was sent
        if made.target is not None:
            called.origin, called.region = made.target.name, made.target.region
        raise
    called.origin, called.region = origin.target.name, origin.target.region
    called.attempts = origin.calls
    called.origin_request_id = origin_request_id(origin.headers, ours)
    try:
        tag = target.id_tag
        if origin.streamed and origin.status < 300:
            learned = StreamIds(
                lambda ids: _shown(decoded, sent, signer, tag, ids),
                forwarder.max_answer_bytes,
            )
            return await _relay(pipeline, request, origin, called, learned, limits, idle)
        body = origin.body if origin.body is not None else origin.first
        out_headers = _headers(origin, called, limits, error=origin.status >= 400)
        if origin.status >= 400:
            shown = origin_error(origin.status, media_type(origin.headers), body)
            called.origin_error = shown.code
            # The origin's message names its own id: the client's is shown.
            body = rewrite_words(shown.body, {decoded.original: sent})
            return web.Response(
                status=origin.status,
                body=body,
                content_type="application/json",
                headers=out_headers,
            )
        body = _shown(decoded, sent, signer, tag, ids_of(origin.parsed)).whole(body)
        return web.Response(status=origin.status, body=body, headers=out_headers)
    finally:
        origin.release()


def _shown(
    decoded: Decoded, sent: str, signer: tuple[IdKeys, str], tag: str, ids: list[str]
) -> Rewriter:
    """The ids a stored response's answer shows: its own as the client sent
    it, and every other response id it names (its previous one) as an id of
    the same origin and tenant."""
    keys, tenant = signer
    shown = {i: keys.encode(i, tag, tenant) for i in ids if keys.encodable(i)}
    shown[decoded.original] = sent
    return Rewriter(shown)


def _headers(
    origin: OriginAnswer, called: OriginCall, limits: list[tuple[str, str]], *, error: bool
) -> CIMultiDict[str]:
    """As reply's for a proxied answer: the origin's (none on an error) but
    its x-request-id, then where it came from (not on an error) and the
    origin's own request id, the attempts and the caller's limits. The answer's x-request-id is
    the proxy's: the boundary's, or _relay's."""
    headers: CIMultiDict[str] = CIMultiDict() if error else origin.headers
    headers.popall("x-request-id", None)
    if not error:  # an error answer names no origin (issue 15's allowlist)
        headers["x-ponto-origin"] = origin.target.name
        headers["x-ponto-region"] = origin.target.region
    if called.origin_request_id is not None:
        headers[ORIGIN_REQUEST_ID_HEADER] = called.origin_request_id
    headers["x-ponto-attempts"] = str(origin.attempt)
    for name, value in limits:
        headers[name] = value
    return headers


async def _relay(
    pipeline: Pipeline,
    request: web.Request,
    origin: OriginAnswer,
    called: OriginCall,
    shown: StreamIds,
    limits: list[tuple[str, str]],
    idle: float | None,
) -> web.StreamResponse:
    """A stored response streamed again (`?stream=true`), relayed as a
    Responses stream is: cut, it ends with a numbered error event."""
    headers = _headers(origin, called, limits, error=False)
    out = web.StreamResponse(status=origin.status, headers=headers)
    out.headers["cache-control"] = "no-cache"
    out.headers[hdrs.SERVER] = SERVER_NAME
    out.headers["x-request-id"] = request[REQUEST_ID]
    if request.app[DRAINING].active:
        out.force_close()
    await out.prepare(request)
    end = await relay(
        shown.feed(origin.first),
        Rewritten(origin.content, shown),
        out,
        error_event=_broken,
        idle_timeout=idle,
        max_event_bytes=pipeline.forwarder.max_answer_bytes,
    )
    forwarder = pipeline.forwarder
    if end.complete:
        origin.ended()
        forwarder.stream_answered(origin.target.name)
    elif end.cut and not end.too_long:
        forwarder.stream_cut(origin.target.name, end.cut)
    return out


def _broken(last: Event | None, too_long: int) -> bytes:
    return responses_broken_event(next_sequence_number(last), too_long)
