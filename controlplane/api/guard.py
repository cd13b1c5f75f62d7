"""Call authentication: which bearer token, and which certificate role, each
service requires.

The Routing service (proxies) takes the bootstrap token; the Admin service
(operators) takes the admin token. Health checking and reflection need no token
(grpcurl and probes work with just the mutual-TLS certificate); kubelet probes,
which cannot present a certificate, use the plaintext health-only port
(--health-listen). A token that is not
configured is not required (a laptop without security); the demo and the Helm
chart configure both.

Under mutual TLS (`--tls-client-ca`) the client certificate must also state the
role of the service it calls: a token alone does not make an admin's
certificate a proxy's, or the other way round. The role is read from the
certificate (`peer_role`):

- a URI subject alternative name `spiffe://ponto/role/proxy` or
  `spiffe://ponto/role/admin` (what `ponto.pki` issues; an operator's own PKI
  adds the same URI);
- failing that, the subject's common name `ponto-proxy` or `ponto-admin` (what
  the Helm chart's certificates carry: Helm's certificate functions can set the
  common name but no URI name), or `ponto-control-plane`, the chart's own
  control-plane certificate, as admin (see ponto.roles).

The names are ponto.roles'. A certificate that states no role, or two different
ones, is refused on the Routing and Admin services with PERMISSION_DENIED and a
message that says how to reissue it. Health and reflection stay open to any
certificate the CA signed.

Each refusal is logged with the caller's address and, for Register, the proxy
name it gave; a caller refused again and again (a proxy retrying with a wrong
token) gets one line per REFUSAL_LOG_EVERY_S, which says how many were not
logged. Refusals on the Routing service are counted through `on_refused`
(`ponto_control_routing_refusals_total`); the Admin service's are counted with
its calls (controlplane.api.metered). The Admin service logs the calls its
core refuses with the same RefusalLog (controlplane.api.errors.grpc_errors).
"""

from __future__ import annotations

import inspect
import logging
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from ponto import roles
from ponto.grpcconn import accepted_tokens, token_among
from ponto.logs import Throttled
from ponto.peers import client_of
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)

ROUTING_PREFIX = "/ponto.v1.Routing/"
ADMIN_PREFIX = "/ponto.v1.Admin/"

Refusal = tuple[grpc.StatusCode, str]

# A proxy retries Register every few seconds while refused: a line a minute
# per caller shows it without flooding the log.
REFUSAL_LOG_EVERY_S = 60.0
# Callers whose repeats are tracked; the least recently refused is forgotten
# first (it is then logged again at its next refusal).
MAX_TRACKED_CALLERS = 1024


def peer_text(peer: str) -> str:
    """grpc's `context.peer()` as log lines and the audit trail's source show
    it: grpc escapes an IPv6 address's brackets ("ipv6:%5B::1%5D:41234"),
    which read "ipv6:[::1]:41234" here, as they do in the addresses given to
    every command line (trial 78)."""
    return urllib.parse.unquote(peer)


def peer_host(peer: str) -> str:
    """The address part of grpc's `context.peer()` ("ipv4:10.0.0.5:41234" ->
    "10.0.0.5", "ipv6:%5B::1%5D:41234" -> "[::1]"); other forms are returned whole.

    A proxy that reconnects comes from a new port: its refusals are one caller's.
    """
    kind, sep, rest = peer_text(peer).partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        return peer
    host, colon, _port = rest.rpartition(":")
    return host if colon else rest


def proxy_name(request: Any) -> str:
    """The proxy name a Register or Deregister request gave ("" for any other
    request)."""
    if isinstance(request, pb.RegisterRequest):
        return request.proxy.name
    return request.name if isinstance(request, pb.DeregisterRequest) else ""


# A proxy name in a log line: a Register request is read before its token is
# checked, so its name is anyone's, up to the server's message size.
MAX_LOGGED_NAME = 64


def caller(peer: str, name: str) -> str:
    """Who made a call, for a log line: its peer address, and the proxy name
    it gave if any (its first MAX_LOGGED_NAME characters)."""
    where = peer_text(peer) or "an unknown peer"
    if len(name) > MAX_LOGGED_NAME:
        name = name[:MAX_LOGGED_NAME] + "..."
    return f"{where} (proxy {name!r})" if name else where


# A refusal's reason in a log line and its throttle's key: an Admin call's
# may quote what the caller sent (a name, a page token), of any length.
MAX_LOGGED_REASON = 512


class RefusalLog:
    """Logs refused calls at WARNING, one line per REFUSAL_LOG_EVERY_S for each
    caller's address, method, status and reason (the line names the proxy the
    call gave, cut to MAX_LOGGED_NAME: a name is the caller's choice, so a
    throttle by name would let one address log a line per call). A wrong
    token after a missing one, or a certificate of no role after one of the
    wrong role, had waited behind the first line's minute (trial 23). The
    guard's refusals and the Admin service's (controlplane.api.errors) alike;
    a reason is cut to MAX_LOGGED_REASON. Not thread-safe: the server's event
    loop is its only caller."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lines: OrderedDict[tuple[str, ...], Throttled] = OrderedDict()

    def refused(self, method: str, refusal: Refusal, peer: str, request: Any) -> None:
        code, message = refusal
        if len(message) > MAX_LOGGED_REASON:
            message = message[:MAX_LOGGED_REASON] + "..."
        name = proxy_name(request)
        # An IPv6 caller by its /64 (client_of), from any address of which
        # it may call: by address, one rotating through it logged a line each.
        key = (client_of(peer_host(peer).strip("[]")), method, code.name, message)
        line = self._lines.pop(key, None) or Throttled(
            log, every_s=REFUSAL_LOG_EVERY_S, clock=self._clock
        )
        self._lines[key] = line
        while len(self._lines) > MAX_TRACKED_CALLERS:
            self._lines.popitem(last=False)
        line.log(
            logging.WARNING,
            "refused %s from %s: %s (%s)",
            method,
            caller(peer, name),
            code.name,
            message,
        )


def peer_role(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """The role a verified client certificate states, or None (none, or two).

    `auth_context` is grpc's `ServicerContext.auth_context()`: the peer's
    subject alternative names, URIs and common name, as bytes.
    """
    uris = {
        name.decode(errors="replace")
        for key in ("peer_uri", "x509_subject_alternative_name")
        for name in auth_context.get(key, ())
    }
    stated = {u.removeprefix(roles.URI_PREFIX) for u in uris if u.startswith(roles.URI_PREFIX)}
    if not stated:
        stated = {
            role
            for cn in auth_context.get("x509_common_name", ())
            if (role := roles.COMMON_NAMES.get(cn.decode(errors="replace"))) is not None
        }
    if len(stated) != 1:
        return None
    (role,) = stated
    return role if role in roles.ROLES else None


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _needed_role(method: str) -> str | None:
    if method.startswith(ROUTING_PREFIX):
        return roles.PROXY
    if method.startswith(ADMIN_PREFIX):
        return roles.ADMIN
    return None


class TokenGuard(grpc.aio.ServerInterceptor):
    """Refuses calls without the token their service requires and, when
    `require_roles` (the server asks for client certificates), without a
    certificate of the service's role."""

    def __init__(
        self,
        *,
        bootstrap_token: str | Sequence[str],
        admin_token: str | Sequence[str],
        require_roles: bool = False,
        on_refused: Callable[[str, str], None] = lambda method, code: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_refused(method, code)` is called for each refused Routing call,
        with the method's name without its service ("Register") and the
        status code's name."""
        # Each a token, or every token accepted (a rotation's old and new).
        self._bootstrap = accepted_tokens(bootstrap_token)
        self._admin = accepted_tokens(admin_token)
        self._require_roles = require_roles
        self._on_refused = on_refused
        self._log = RefusalLog(clock)

    def _refuse(
        self,
        method: str,
        refusal: Refusal,
        request: Any,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        self._log.refused(method, refusal, context.peer() or "", request)
        if method.startswith(ROUTING_PREFIX):
            self._on_refused(method.removeprefix(ROUTING_PREFIX), refusal[0].name)

    def check(self, method: str, token: str) -> Refusal | None:
        """None when the call's token lets it proceed, else the status to refuse it with."""
        if method.startswith(ADMIN_PREFIX) and self._admin:
            if token_among(token, self._admin):
                return None
            if token_among(token, self._bootstrap):
                return (
                    grpc.StatusCode.PERMISSION_DENIED,
                    "a proxy credential cannot call the Admin API; use the admin token",
                )
            if not token:
                return (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "the Admin API needs the admin token (authorization: Bearer ...)",
                )
            # Said apart from a missing token: an operator whose file holds an
            # old or wrong token must not be told to give one.
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "the admin token given is not this control plane's admin token",
            )
        if method.startswith(ROUTING_PREFIX) and self._bootstrap:
            if token_among(token, self._bootstrap):
                return None
            if not token:
                return (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "proxies must present the bootstrap token (authorization: Bearer ...)",
                )
            # As for the admin token: a proxy whose file holds a wrong token
            # is sent to that file, not told to give one.
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "the bootstrap token given is not this control plane's bootstrap token",
            )
        return None

    def check_role(self, method: str, role: str | None) -> Refusal | None:
        """None when a certificate of `role` (None: it states none) may call
        `method`, else the status to refuse it with."""
        needed = _needed_role(method)
        if not self._require_roles or needed is None or role == needed:
            return None
        service = "the Routing API (proxies)" if needed == roles.PROXY else "the Admin API"
        if role is None:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{service} needs a client certificate of role {needed}: this one states "
                f"no role; reissue it with the URI name {roles.role_uri(needed)}",
            )
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"a certificate of role {role} cannot call {service}; "
            f"use a certificate of role {needed}",
        )

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return None
        refusal = self.check(method, _bearer(handler_call_details.invocation_metadata))
        if refusal is not None:
            return _denied(handler, method, refusal, self._refuse)
        if self._require_roles and _needed_role(method) is not None:
            # The peer's certificate is known to the call's context only.
            return _role_checked(handler, method, self.check_role, self._refuse)
        return handler


def handler_factory(handler: grpc.RpcMethodHandler[Any, Any]) -> Any:
    """grpc's constructor of handlers of the same kind (unary or streaming, each
    way) as handler: what an interceptor rebuilds a wrapped handler with."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler
    return grpc.unary_unary_rpc_method_handler


def handler_behaviour(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    """The servicer method handler runs, whatever its kind."""
    behaviour = (
        handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
    )
    assert behaviour is not None
    return behaviour


# How a refusal is reported (TokenGuard._refuse): method, refusal, the request
# (a request iterator when the client streams), the call's context.
Report = Callable[[str, Refusal, Any, grpc.aio.ServicerContext[Any, Any]], None]


def _denied(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, refusal: Refusal, report: Report
) -> grpc.RpcMethodHandler[Any, Any]:
    # Reported from the call, whose context knows the peer and whose request
    # (Register's) names the proxy.
    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        report(method, refusal, request, context)
        await context.abort(*refusal)

    return handler_factory(handler)(  # type: ignore[no-any-return]
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _role_checked(
    handler: grpc.RpcMethodHandler[Any, Any],
    method: str,
    check_role: Callable[[str, str | None], Refusal | None],
    report: Report,
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler`, run only once the caller's certificate has the method's role."""
    behaviour = handler_behaviour(handler)

    async def admit(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        refusal = check_role(method, peer_role(context.auth_context()))
        if refusal is not None:
            report(method, refusal, request, context)
            await context.abort(*refusal)

    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behaviour):

        async def stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await admit(request, context)
            async for reply in behaviour(request, context):
                yield reply

        wrapped = stream
    else:

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(request, context)
            return await behaviour(request, context)

        wrapped = call
    return handler_factory(handler)(  # type: ignore[no-any-return]
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
