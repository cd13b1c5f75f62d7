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
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc

from ponto import roles

log = logging.getLogger(__name__)

ROUTING_PREFIX = "/ponto.v1.Routing/"
ADMIN_PREFIX = "/ponto.v1.Admin/"

Refusal = tuple[grpc.StatusCode, str]


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


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


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
        self, *, bootstrap_token: str, admin_token: str, require_roles: bool = False
    ) -> None:
        self._bootstrap = bootstrap_token
        self._admin = admin_token
        self._require_roles = require_roles

    def check(self, method: str, token: str) -> Refusal | None:
        """None when the call's token lets it proceed, else the status to refuse it with."""
        if method.startswith(ADMIN_PREFIX) and self._admin:
            if _same(token, self._admin):
                return None
            if self._bootstrap and _same(token, self._bootstrap):
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
            if _same(token, self._bootstrap):
                return None
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "proxies must present the bootstrap token (authorization: Bearer ...)",
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
            return _denied(handler, method, refusal)
        if self._require_roles and _needed_role(method) is not None:
            # The peer's certificate is known to the call's context only.
            return _role_checked(handler, method, self.check_role)
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


def _refuse(method: str, refusal: Refusal) -> None:
    code, message = refusal
    log.warning("refused %s: %s (%s)", method, code.name, message)


def _denied(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, refusal: Refusal
) -> grpc.RpcMethodHandler[Any, Any]:
    _refuse(method, refusal)

    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
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
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler`, run only once the caller's certificate has the method's role."""
    behaviour = handler_behaviour(handler)

    async def admit(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        refusal = check_role(method, peer_role(context.auth_context()))
        if refusal is not None:
            _refuse(method, refusal)
            await context.abort(*refusal)

    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behaviour):

        async def stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await admit(context)
            async for reply in behaviour(request, context):
                yield reply

        wrapped = stream
    else:

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(context)
            return await behaviour(request, context)

        wrapped = call
    return handler_factory(handler)(  # type: ignore[no-any-return]
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
