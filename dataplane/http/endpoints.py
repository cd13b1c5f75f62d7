"""The proxy's own endpoints: the models, health, readiness and metrics."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dataplane import jsonio
from dataplane.http.errors import (
    ApiError,
    AuthUnavailableError,
    Unauthorized,
    model_not_found,
    no_route_table,
)
from dataplane.http.pipeline import authenticate_waiting, refuse_suspended, sole_authorization
from dataplane.http.scrape import scrape_answer
from dataplane.http.state import CLIENT, DRAINING, HOLDER, METRICS, PIPELINE, PRINCIPAL, QUOTA
from dataplane.metrics import exposition


async def _callable_models(request: web.Request) -> list[str]:
    """The models the caller may name: what origins serve, plus its tenant's
    aliases of those, within its tenant's and its key's model lists.
    Authenticates the caller (401) when the table has a policy. Without a
    route table yet, after the wait for a first one, the 503 `no_route_table`
    a chat call gets (trials 17 and 18: an empty list, which a client reads
    as "this gateway serves no model", and a 404 for any model, which the
    openai SDK never retries)."""
    holder = request.app[HOLDER]
    if not await holder.wait_first():
        raise no_route_table()
    routes, policy = holder.routes, holder.policy
    models: list[str] = list(routes.models) if routes else []
    if policy is not None:
        try:
            principal = await authenticate_waiting(policy, sole_authorization(request.headers))
        except (Unauthorized, AuthUnavailableError) as exc:
            # An expired key, or a JWT its tenant's config could not check:
            # counted for its owner.
            if exc.owner is not None:
                request[PRINCIPAL] = exc.owner
            raise
        request[PRINCIPAL] = principal
        refuse_suspended(policy, principal)
        served = set(models)
        tenant = policy.tenant(principal.tenant)
        aliases = tenant.prompt.aliases
        models += sorted(a for a, target in aliases.items() if target in served and a not in served)
        models = [m for m in models if not policy.refusing_list(principal, tenant, m)]
    return models


def _refusing_list(request: web.Request, name: str) -> str:
    """Whose model list refuses the caller `name`, as for a chat call; "" when
    none does (nobody serves it, or there is no policy)."""
    principal, policy = request.get(PRINCIPAL), request.app[HOLDER].policy
    if principal is None or policy is None:
        return ""
    return policy.refusing_list(principal, policy.tenant(principal.tenant), name)


def _standing_limits(request: web.Request) -> list[tuple[str, str]]:
    """The caller's `x-ratelimit-*` headers, as every answer to a limited
    caller carries them; a model list takes nothing from its limits."""
    principal = request.get(PRINCIPAL)
    if principal is None:  # no policy: nobody is limited
        return []
    return request.app[PIPELINE].standing_limits(principal)


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ponto"}


async def list_models(request: web.Request) -> web.Response:
    """The models the caller may name, in OpenAI's list shape."""
    data = [_model(m) for m in await _callable_models(request)]
    return web.json_response(
        {"object": "list", "data": data}, dumps=_dumps_str, headers=_standing_limits(request)
    )


async def retrieve_model(request: web.Request) -> web.Response:
    """One model the caller may name (OpenAI's `GET /v1/models/{model}`), else 404."""
    name = request.match_info["model"]
    models = await _callable_models(request)
    limits = _standing_limits(request)
    if name not in models:
        error = model_not_found(name, refused_by=_refusing_list(request, name))
        error.headers.update(limits)
        raise error
    return web.json_response(_model(name), dumps=_dumps_str, headers=limits)


async def healthz(request: web.Request) -> web.Response:
    """Liveness on the public port: the process answers (`/healthz`, and
    `/health`, which tools such as guidellm check), `{"status": "ok"}` and
    nothing else. Anyone who reaches the port may ask, so it names none of
    the proxy's internals (its fleet, its table's version and etag, its
    control-plane link): those are `health_details`', on the metrics port.
    Readiness (a table to serve) is /readyz."""
    return web.json_response({"status": "ok"})


async def health_details(request: web.Request) -> web.Response:
    """Liveness and state, for operators: /healthz and /health on the metrics
    port (--metrics-listen), which only they should reach.

    The rate-limit shares held are named by their generation and where they
    came from (`quota_source`: none, disk or control-plane), as the table is.

    The table is named by its version and its etag. Each control-plane
    replica numbers a table by the store revision it read it at, so two
    replicas may give the same content different versions: the etag (a hash
    of the content) is what to compare with the control plane's table."""
    holder = request.app[HOLDER]
    routes = holder.routes
    client, quota = request.app[CLIENT], request.app[QUOTA]
    return web.json_response(
        {
            "status": "ok",
            "route_table_version": routes.version if routes else 0,
            "route_table_etag": routes.etag if routes else "",
            "route_table_source": holder.source,
            # The fleet of the tables served, which `pontoctl fleet adopt`
            # takes, and the tables the guard refused (dataplane.sync.holder).
            "fleet_id": holder.fleet_id,
            "route_tables_refused": dict(holder.refused),
            "control_plane_connected": client.connected,
            # The rate-limit shares held: a saved copy's until the leader's come.
            "quota_generation": quota.generation,
            "quota_source": quota.source,
        },
        dumps=_dumps_str,
    )


async def readyz(request: web.Request) -> web.Response:
    """Ready: not draining, a route table to serve, the first fetch of each JWKS
    URL it names ended (well or not: an identity provider that is down delays
    readiness by one fetch's timeout at most), and its rate-limit shares if it
    has limits. A draining proxy answers 503 so that a load balancer stops
    sending it connections while it finishes the requests it holds. A worker
    leaving its group in a reload answers for the group, which stays ready
    (a probe on a connection kept alive to it would see 503 otherwise)."""
    draining = request.app[DRAINING]
    if draining.active and not draining.leaving:
        raise ApiError(503, "this proxy is stopping", type="server_error", code="draining")
    if request.app[HOLDER].routes is None:
        raise ApiError(503, "no route table yet", type="server_error", code="no_route_table")
    if not request.app[HOLDER].key_sets_ready:
        raise ApiError(
            503,
            "waiting for the first fetch of a tenant's JWKS URL",
            type="server_error",
            code="no_jwks_yet",
        )
    if not request.app[QUOTA].ready:
        raise ApiError(
            503,
            "waiting for this proxy's share of the rate limits",
            type="server_error",
            code="no_quota_shares",
        )
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    return scrape_answer(request, exposition(request.app[METRICS].registry))


def _dumps_str(value: Any) -> str:
    return jsonio.dumps(value).decode()
