"""Mapping of core errors to gRPC statuses for every servicer."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from controlplane.errors import ControlPlaneError

log = logging.getLogger(__name__)
R = TypeVar("R")


def grpc_errors(
    fn: Callable[..., Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """Abort with the error's own status; hide unexpected errors behind INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> R:
        try:
            return await fn(self, request, context)
        except ControlPlaneError as exc:
            await context.abort(exc.status, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see control plane logs")
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper
