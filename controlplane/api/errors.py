"""Mapping of core errors to gRPC statuses for every servicer."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import grpc

from controlplane.api.guard import Refusal
from controlplane.errors import ControlPlaneError

log = logging.getLogger(__name__)
R = TypeVar("R")


@runtime_checkable
class Refusing(Protocol):
    """A servicer that logs the calls its core refuses (the Admin service)."""

    def refused(
        self,
        method: str,
        refusal: Refusal,
        request: Any,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Log that a call of `method` (the servicer's method name, "ListKeys")
        was refused with `refusal` (status, message); throttled by the servicer."""


def grpc_errors(
    fn: Callable[..., Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """Abort with the error's own status; hide unexpected errors behind INTERNAL.

    A refusal (a ControlPlaneError) is logged through the servicer when it is
    `Refusing`, unless a line already holds it (`ControlPlaneError.logged`:
    an audited write's entry); an unexpected error with its traceback."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> R:
        try:
            return await fn(self, request, context)
        except ControlPlaneError as exc:
            if isinstance(self, Refusing) and not exc.logged:
                self.refused(fn.__name__, (exc.status, str(exc)), request, context)
            await context.abort(exc.status, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see control plane logs")
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper
