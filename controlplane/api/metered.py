"""Counting of Admin API calls by method and the status code they ended with.

An interceptor, so that every call is counted once, those the TokenGuard
refuses included, without touching the servicer: it must come first in the
server's interceptors, wrapping what the others return.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from controlplane.api.guard import ADMIN_PREFIX, handler_behaviour, handler_factory
from controlplane.metrics import ControlMetrics


def final_code(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> str:
    """The status a call ends with: the one set on its context (an abort sets
    it), else CANCELLED for a cancelled call, UNKNOWN for an exception that
    escaped (what gRPC answers then) and OK for a return."""
    code: object = context.code()  # None until set, whatever the stubs say
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name if error is not None else grpc.StatusCode.OK.name


class AdminCalls(grpc.aio.ServerInterceptor):
    """Counts each Admin call in `metrics.admin_calls` once it ends."""

    def __init__(self, metrics: ControlMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(ADMIN_PREFIX):
            return handler
        return self._counted(handler, method.removeprefix(ADMIN_PREFIX))

    def _counted(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behaviour = handler_behaviour(handler)
        count = self._metrics.admin_call

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                reply = await behaviour(request, context)
            except BaseException as exc:
                count(method, final_code(context, exc))
                raise
            count(method, final_code(context, None))
            return reply

        return handler_factory(handler)(  # type: ignore[no-any-return]
            call,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
