"""Errors of the control plane core; each knows its gRPC status.

Their messages are written for operators and may be shown to API callers;
anything else (a bug, a library error) is logged and answered as INTERNAL
without detail.
"""

from __future__ import annotations

import grpc


class ControlPlaneError(Exception):
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ControlPlaneError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ControlPlaneError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ControlPlaneError):
    status = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ControlPlaneError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ControlPlaneError):
    status = grpc.StatusCode.UNAVAILABLE
