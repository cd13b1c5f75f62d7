"""Call authentication: which bearer token each service requires.

The Routing service (proxies) takes the bootstrap token; the Admin service
(operators) takes the admin token. Health checking and reflection need no token
(grpcurl and probes work with just the mutual-TLS certificate); kubelet probes,
which cannot present a certificate, use the plaintext health-only port
(--health-listen). A token that is not
configured is not required (a laptop without security); the demo and the Helm
chart configure both.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

ROUTING_PREFIX = "/ponto.v1.Routing/"
ADMIN_PREFIX = "/ponto.v1.Admin/"


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class TokenGuard(grpc.aio.ServerInterceptor):
    """Refuses calls without the token their service requires."""

    def __init__(self, *, bootstrap_token: str, admin_token: str) -> None:
        self._bootstrap = bootstrap_token
        self._admin = admin_token

    def check(self, method: str, token: str) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else the status to refuse it with."""
        if method.startswith(ADMIN_PREFIX) and self._admin:
            if _same(token, self._admin):
                return None
            if self._bootstrap and _same(token, self._bootstrap):
                return (
                    grpc.StatusCode.PERMISSION_DENIED,
                    "a proxy credential cannot call the Admin API; use the admin token",
                )
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "the Admin API needs the admin token (authorization: Bearer ...)",
            )
        if method.startswith(ROUTING_PREFIX) and self._bootstrap:
            if _same(token, self._bootstrap):
                return None
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "proxies must present the bootstrap token (authorization: Bearer ...)",
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        refusal = self.check(method, _bearer(handler_call_details.invocation_metadata))
        if refusal is None or handler is None:
            return handler
        code, message = refusal
        log.warning("refused %s: %s", method, code.name)

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(code, message)

        if handler.request_streaming and handler.response_streaming:
            factory: Any = grpc.stream_stream_rpc_method_handler
        elif handler.request_streaming:
            factory = grpc.stream_unary_rpc_method_handler
        elif handler.response_streaming:
            factory = grpc.unary_stream_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        return factory(  # type: ignore[no-any-return]
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
