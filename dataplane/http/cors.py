"""Calls from web pages of other origins (CORS), for `--cors-origins`.

A page served from https://app.example that calls the proxy with fetch() (or
the openai SDK in a browser, with a user's JWT rather than a secret key) is
let by the browser only if the proxy says so: it first asks with a preflight
(`OPTIONS` with `Origin` and `Access-Control-Request-Method`), since the call
carries `Authorization` and JSON, then reads the answer only if it names the
page's origin in `Access-Control-Allow-Origin`.

With `--cors-origins` the proxy answers preflights of its API paths for the
origins listed (or any, `*`) and marks every answer to such a page's calls as
readable, its headers too (`x-request-id`, the `x-ratelimit-*` and `x-ponto-*`
headers). Without it, none of this happens: no answer carries CORS headers, an
`OPTIONS` is a 405, and answers keep the edge's fast path (an
`on_response_prepare` hook turns it off; see dataplane.http.edge).

Credentials in the CORS sense (cookies) are never allowed: callers present a
bearer token, which needs none. That also makes the wildcard answers valid.
A call from an origin not listed is served as any other, without the headers:
the browser withholds the answer from the page (and a page can only send one
without a preflight that does not carry a token or JSON). A preflight from an
origin not listed is answered 403 `cors_origin_not_allowed`, which the
browser reports as a CORS failure and an operator with curl can read.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from dataplane.http.errors import ApiError

__all__ = ["API_PREFIX", "CorsPolicy", "preflight_handler"]

# The paths whose answers pages may read: the OpenAI API's (not /metrics,
# /healthz or /readyz, which no page needs).
API_PREFIX = "/v1/"

# How long a browser may keep a preflight's answer (Chromium keeps at most 2 h).
MAX_AGE_S = 600
# The request headers a preflight may ask for, echoed when they are all
# header names (the openai SDK asks for a dozen x-stainless-* ones).
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
MAX_ASKED_HEADERS = 2048


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The web origins whose pages may call the proxy; `any_origin`: all."""

    origins: frozenset[str] = frozenset()
    any_origin: bool = False

    @classmethod
    def parse(cls, text: str) -> CorsPolicy | None:
        """`--cors-origins`: `*`, or origins (`https://app.example`,
        `http://localhost:3000`) separated by commas; None for "". Raises
        ValueError naming what is not an origin."""
        if not text.strip():
            return None
        items = [item.strip() for item in text.split(",")]
        if "*" in items:
            if len(items) > 1:
                raise ValueError("--cors-origins: give '*' alone, or origins")
            return cls(any_origin=True)
        for item in items:
            if not item or origin_of(item) != item:
                raise ValueError(f"--cors-origins: {item!r} is not an origin: {_why_not(item)}")
        return cls(frozenset(items))

    def allowed(self, origin: str) -> str | None:
        """The `Access-Control-Allow-Origin` of a call from `origin`; None if
        its pages may not call."""
        if self.any_origin:
            return "*"
        return origin if origin in self.origins else None

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """An `on_response_prepare` hook: mark the answer to a listed origin's
        page as readable, headers and all; only the API's (review 46: with
        `*`, any page could read `/metrics` on the public port)."""
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is None or request.method == hdrs.METH_OPTIONS:
            return  # not a page's call, or a preflight, answered whole
        if not request.path.startswith(API_PREFIX):
            return
        allow = self.allowed(origin)
        if allow is None:
            return
        headers = response.headers
        headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = allow
        headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = "*"
        if allow != "*":
            headers.add(hdrs.VARY, hdrs.ORIGIN)


def origin_of(url: str) -> str:
    """The origin (scheme://host[:port], as a browser sends it) of an http(s)
    URL; "" for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ""
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        return ""
    if port == _DEFAULT_PORTS[parts.scheme] or not _HOST.fullmatch(parts.hostname):
        return ""  # a browser sends neither: the default port left out, a host as punycode
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


# Ports a browser leaves out of an origin.
_DEFAULT_PORTS = {"http": 80, "https": 443}
# A host as a browser sends it: a lower-case name (punycode), an IPv4 or an
# IPv6 address (without its brackets here).
_HOST = re.compile(r"[a-z0-9.-]+|[0-9a-f:.]+")


def _why_not(item: str) -> str:
    """What to fix in `item`, which origin_of refused (trial 29: a wildcard,
    an empty item or a default port were told "give scheme://host[:port]")."""
    if not item:
        return "an empty item between commas"
    if "*" in item:
        return "no wildcards: list each origin, or give '*' alone for any"
    if item.endswith(("://", "/")) or "/" in item.partition("://")[2]:
        return "an origin has no path, not even '/' (e.g. https://app.example)"
    for scheme, port in _DEFAULT_PORTS.items():
        if item.startswith(f"{scheme}://") and item.endswith(f":{port}"):
            return f"leave the default port :{port} out, as browsers do"
    return "give scheme://host[:port], lower-case, as a browser sends it (e.g. https://app.example)"


def preflight_handler(
    policy: CorsPolicy, methods: str
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The `OPTIONS` handler of one API path, whose methods are `methods`
    ("POST", "GET")."""

    async def preflight(request: web.Request) -> web.StreamResponse:
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is None or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers:
            # Not a browser's preflight: say what the path takes.
            return web.Response(status=204, headers={hdrs.ALLOW: f"{methods}, OPTIONS"})
        allow = policy.allowed(origin)
        if allow is None:
            raise ApiError(
                403,
                f"Pages of {origin[:256]} may not call this API (the proxy's --cors-origins "
                "does not list it).",
                type="invalid_request_error",
                code="cors_origin_not_allowed",
            )
        asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "")
        names = [name.strip() for name in asked.split(",") if name.strip()]
        if len(asked) > MAX_ASKED_HEADERS or not all(_TOKEN.match(n) for n in names):
            raise ApiError(
                400,
                "Access-Control-Request-Headers is not a list of header names.",
                code="invalid_preflight",
            )
        headers = {
            hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: allow,
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: methods,
            hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S),
            hdrs.VARY: "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        if names:
            headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = ", ".join(names)
        return web.Response(status=204, headers=headers)

    return preflight
