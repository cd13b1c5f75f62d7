"""The server's own dispatch: a request for one of the app's fixed paths goes
straight to its handler, through the app's middlewares, without aiohttp's
per-request routing.

`web.Application._handle` resolves every request against the router (a new
match-info object, `add_app`, `freeze`), checks for `Expect`, and wraps the
handler in the middleware chain and aiohttp's `_fix_request_current_app`
(which only matters for sub-applications). For the proxy's routes, whose paths
have no variable parts, all of that is the same for every request:
`FixedRoutes` does it once per route when the server is made, and per request
looks up (method, path) in a dict.

Anything else takes the application's own path (`fallback`): a path with
variable parts (`/v1/models/{model}`), one the router does not know (404) or
knows for other methods (405), a request with `Expect: 100-continue` (the
route's expect handler answers it), and every request of an application with
sub-applications or old-style middlewares, which this does not flatten. A
path is looked up as sent (`rel_url.raw_path`, without the query): one the
router would match only after decoding falls back too.

A route's handler may come with a plain function (`with_direct`) that
returns the same awaitable as the handler's call, for the handler's usual
case: FixedRoutes calls that one instead, so that the request's chain of
awaits has no frame of the handler's own (aiohttp's router takes only
coroutine functions).

A middleware that acts on a few routes only may say which (`for_routes`):
FixedRoutes leaves it out of every other route's chain, where it would add
a frame to each request's chain of awaits (some 900 instructions a wait)
only to pass the request on. It must still pass on any other route's
request itself: the application's own path runs every middleware.

A request with any other expectation is refused here, on every path, with a
417 through the app's middlewares (an OpenAI-style error with the house
headers, logged and counted): aiohttp's expect handler raises its plain-text
417 outside them. A proxied route that defers its `100 Continue`
(CONTINUE_PENDING) and then refuses without the body gets its connection
closed after the answer: the client sends no body after a final answer, and
aiohttp would wait for one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import TypeVar

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import PlainResource, UrlMappingMatchInfo

from dataplane.http.errors import ApiError
from dataplane.http.state import CONTINUE_PENDING

__all__ = ["FixedInfo", "FixedRoutes", "for_routes", "with_direct"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=Callable[..., Awaitable[web.StreamResponse]])

# The attribute of a route's handler that holds its plain function.
_DIRECT = "direct"
# The attribute of a middleware that names the only routes it acts on.
_ROUTES = "routes"


def with_direct(handler: Handler, direct: Handler) -> Handler:
    """`handler`, carrying `direct`: a plain function of the same request that
    returns what `handler(request)` would (the awaitable of its usual case's
    last step, or `handler(request)` itself), for FixedRoutes."""
    setattr(handler, _DIRECT, direct)
    return handler


def for_routes(middleware: M, names: Iterable[str]) -> M:
    """`middleware`, marked as acting on the routes named `names` alone (it
    passes any other request straight to its handler): FixedRoutes leaves it
    out of the other routes' chains."""
    setattr(middleware, _ROUTES, frozenset(names))
    return middleware


class FixedInfo(UrlMappingMatchInfo):
    """A fixed route's match info, which carries its route's name as read
    once (`route_name`): `match_info.route.name` is three properties, each a
    Python call on 3.11 (some 640 instructions), and the error boundary
    reads it every request."""

    def __init__(self, route: web.AbstractRoute) -> None:
        super().__init__({}, route)
        self.route_name = route.name


class FixedRoutes:
    """(method, path) -> the handler already wrapped in `app`'s middlewares and
    the shared, frozen match info the router would have built. Build it once
    the app is frozen (its routes and middlewares are final). Every request of
    a route shares its match info: handlers read it, never write to it (it is
    a dict; freezing only stops `add_app`)."""

    def __init__(self, app: web.Application, fallback: Handler) -> None:
        self._app = app
        self._fallback = fallback
        self._routes: dict[tuple[str, str], tuple[Handler, FixedInfo]] = {}
        self._refuse: Handler | None = None
        if any(isinstance(r, web.PrefixedSubAppResource) for r in app.router.resources()) or any(
            getattr(m, "__middleware_version__", None) != 1 for m in app.middlewares
        ):
            return  # sub-applications or old-style middlewares: the router's path only
        for resource in app.router.resources():
            if not isinstance(resource, PlainResource):
                continue
            for route in resource:
                info = FixedInfo(route)
                info.add_app(app)
                info.freeze()
                handler: Handler = getattr(route.handler, _DIRECT, route.handler)
                for middleware in reversed(app.middlewares):
                    routes = getattr(middleware, _ROUTES, None)
                    if routes is None or route.name in routes:
                        handler = partial(middleware, handler=handler)
                # The first of two routes for one (method, path) wins, as in the router.
                self._routes.setdefault((route.method, resource.canonical), (handler, info))
        refuse: Handler = _expectation_failed
        for middleware in reversed(app.middlewares):
            refuse = partial(middleware, handler=refuse)
        self._refuse = refuse

    def __len__(self) -> int:
        return len(self._routes)

    def __call__(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        """The route's handler's awaitable (or the application's own), not a
        coroutine of this call's: the request's chain of awaits has no frame
        here (each frame an await passes through costs some 900 instructions
        a wait: bench/instructions.py)."""
        assert isinstance(request, web.Request)  # made by the application's factory
        # The fields behind aiohttp's method, rel_url and headers: each
        # property is a Python call on its first read (reify), some 450
        # instructions; the edge and the pipeline read these fields too.
        found = self._routes.get((request._method, request._rel_url.raw_path))
        if hdrs.EXPECT in request._headers and self._refuse is not None:
            return self._expecting(request, self._refuse)
        if found is None:
            return self._fallback(request)
        handler, info = found
        request._match_info = info
        return handler(request)

    async def _expecting(self, request: web.Request, refuse: Handler) -> web.StreamResponse:
        """A request with `Expect`: a 417 unless it is `100-continue`, else the
        router's path, closing after an answer given in place of the 100."""
        if request.headers[hdrs.EXPECT].lower() != "100-continue":
            info = await self._app.router.resolve(request)
            info.add_app(self._app)
            info.freeze()
            request._match_info = info  # the endpoint it is counted under
            return await refuse(request)
        response = await self._fallback(request)
        if request.get(CONTINUE_PENDING) and not request.content.total_bytes:
            # Refused before the 100 (a 401, 413, 415): the client sends no
            # body now. Marked as read, aiohttp closes the connection after the
            # answer instead of waiting (lingering) for it. A body already on
            # its way (a client that did not wait) is read and dropped as
            # usual: closing with unread bytes would reset the connection.
            request.content.feed_eof()
            response.force_close()
        return response


async def _expectation_failed(request: web.Request) -> web.StreamResponse:
    raise ApiError(417, "Expect: only 100-continue is supported", code="expectation_failed")
