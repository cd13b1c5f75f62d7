"""The server's own dispatch of fixed paths (dataplane.http.dispatch)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from aiohttp.typedefs import Middleware

from dataplane.http.dispatch import FixedRoutes, for_routes, with_direct

Seen = list[tuple[str, str]]


def boundary_into(seen: Seen, label: str = "middleware") -> Middleware:
    """A middleware that records, under `label`, the route name of what
    passed it."""

    @web.middleware
    async def boundary(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        seen.append((label, request.match_info.route.name or ""))
        return await handler(request)

    return boundary


def app_with(seen: Seen) -> web.Application:
    """An app whose one middleware and handlers record what reached them."""

    async def chat(request: web.Request) -> web.Response:
        assert request.app is app
        seen.append(("chat", request.method))
        return web.Response(text="chat")

    async def model(request: web.Request) -> web.Response:
        seen.append(("model", request.match_info["model"]))
        return web.Response(text="model")

    app = web.Application(middlewares=[boundary_into(seen)])
    app.router.add_post("/v1/chat/completions", chat, name="chat.completions")
    app.router.add_get("/v1/models/{model}", model, name="models.retrieve")
    app.router.add_get("/healthz", chat, name="healthz")
    app.freeze()
    return app


def fallback_into(seen: Seen) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    async def fallback(request: web.BaseRequest) -> web.StreamResponse:
        seen.append(("fallback", request.path))
        return web.Response(text="router")

    return fallback


async def test_a_fixed_path_reaches_its_handler_through_the_apps_middlewares() -> None:
    seen: Seen = []
    app = app_with(seen)
    fixed = FixedRoutes(app, fallback_into(seen))
    assert len(fixed) == 3  # POST chat; GET and HEAD healthz; not the path with a variable
    for path in ("/v1/chat/completions", "/v1/chat/completions?api-version=1"):
        response = await fixed(make_mocked_request("POST", path, app=app))
        assert isinstance(response, web.Response) and response.text == "chat"
    assert seen == [("middleware", "chat.completions"), ("chat", "POST")] * 2
    seen.clear()
    await fixed(make_mocked_request("HEAD", "/healthz", app=app))  # aiohttp adds HEAD to GET
    assert seen == [("middleware", "healthz"), ("chat", "HEAD")]


async def test_everything_else_takes_the_routers_path() -> None:
    seen: Seen = []
    app = app_with(seen)
    fixed = FixedRoutes(app, fallback_into(seen))
    requests = [
        make_mocked_request("GET", "/v1/models/m1", app=app),  # a variable part
        make_mocked_request("GET", "/v1/chat/completions", app=app),  # another method: 405
        make_mocked_request("POST", "/v1/nothing", app=app),  # unknown: 404
        make_mocked_request("POST", "/v1/chat%2Fcompletions", app=app),  # matched only decoded
        make_mocked_request("GET", "/healthz/", app=app),  # a trailing slash
        make_mocked_request("GET", "/HEALTHZ", app=app),  # another case
        make_mocked_request(
            "POST", "/v1/chat/completions", headers={"Expect": "100-continue"}, app=app
        ),
    ]
    for request in requests:
        response = await fixed(request)
        assert isinstance(response, web.Response) and response.text == "router"
    assert [s for s in seen if s[0] != "fallback"] == []
    assert len(seen) == len(requests)


async def test_an_app_with_sub_applications_is_left_to_the_router() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response()

    sub = web.Application()
    sub.router.add_get("/x", ok)
    parent = web.Application()
    parent.router.add_post("/v1/chat/completions", ok)
    parent.add_subapp("/sub", sub)
    parent.freeze()
    assert len(FixedRoutes(parent, fallback_into([]))) == 0


async def test_a_handler_with_a_direct_function_is_called_through_it() -> None:
    """FixedRoutes calls a route's `direct` function (with_direct) in its
    handler's place, through the middlewares; aiohttp's router still calls
    the handler."""
    seen: Seen = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(("handler", request.method))
        return web.Response(text="handler")

    def direct(request: web.Request) -> Awaitable[web.StreamResponse]:
        seen.append(("direct", request.method))
        return handle(request)

    app = web.Application(middlewares=[boundary_into(seen)])
    app.router.add_post("/v1/chat/completions", with_direct(handle, direct), name="chat")
    app.freeze()
    fixed = FixedRoutes(app, fallback_into(seen))
    response = await fixed(make_mocked_request("POST", "/v1/chat/completions", app=app))
    assert isinstance(response, web.Response) and response.text == "handler"
    assert seen == [("middleware", "chat"), ("direct", "POST"), ("handler", "POST")]


async def test_a_middleware_for_some_routes_is_in_their_chains_alone() -> None:
    """A middleware marked with for_routes wraps the routes it names, not the
    others (each of which it would only pass on, a frame more a request);
    an unmarked one wraps every route, as before, and both stay in order."""
    seen: Seen = []
    app = web.Application(middlewares=[boundary_into(seen)])

    async def ok(request: web.Request) -> web.Response:
        seen.append(("handler", request.match_info.route.name or ""))
        return web.Response(text="ok")

    app.middlewares.append(for_routes(boundary_into(seen, "views"), ("metrics",)))
    app.router.add_post("/v1/chat/completions", ok, name="chat.completions")
    app.router.add_get("/metrics", ok, name="metrics")
    app.freeze()
    fixed = FixedRoutes(app, fallback_into(seen))
    await fixed(make_mocked_request("POST", "/v1/chat/completions", app=app))
    assert seen == [("middleware", "chat.completions"), ("handler", "chat.completions")]
    seen.clear()
    await fixed(make_mocked_request("GET", "/metrics", app=app))
    assert seen == [("middleware", "metrics"), ("views", "metrics"), ("handler", "metrics")]
