"""Errors of the control plane core; each knows its gRPC status.

Their messages are written for operators and may be shown to API callers;
anything else (a bug, a library error) is logged and answered as INTERNAL
without detail.
"""

from __future__ import annotations

import grpc


class ControlPlaneError(Exception):
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # Set once a log line holds this refusal (the audit trail's entry, which
    # controlplane.audit writes to the log too), so that it is logged once.
    logged: bool = False


class InvalidArgument(ControlPlaneError):
    """A value is refused. `field` is where, in the apply document's names relative
    to the object checked ("limits.rpm"), when the check knows; "" otherwise."""

    status = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str = "", *, field: str = "") -> None:
        super().__init__(message)
        self.field = field

    def within(self, part: str) -> None:
        """Put this error's field under part, the block that holds it (re-raise it then)."""
        self.field = f"{part}.{self.field}" if self.field else part


class NotFound(ControlPlaneError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ControlPlaneError):
    status = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ControlPlaneError):
    status = grpc.StatusCode.FAILED_PRECONDITION


# What a write refused for a change made since its caller read the record
# says (FAILED_PRECONDITION): pontoctl reads and writes again on it.
CHANGED_SINCE_READ = "was changed since it was read"


class ChangedSinceRead(FailedPrecondition):
    """A write sent with the record as its caller read it (`expected`) found
    the record changed: nothing was written."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} {CHANGED_SINCE_READ}; nothing was saved")


class Departed(FailedPrecondition):
    """A Register of a proxy process that has deregistered since it was sent
    (Routing.Deregister): the process is stopping, and nothing of the
    registration is kept."""


class Unavailable(ControlPlaneError):
    status = grpc.StatusCode.UNAVAILABLE


# What a change whose write got no answer from the state store says (pontoctl
# finds it in DEADLINE_EXCEEDED's details, and names the `get` to run).
MAY_HAVE_BEEN_MADE = "the change may have been made"
CHECK_FIRST = "check with `pontoctl get` before running it again"


class OutcomeUnknown(Unavailable):
    """A change was sent to the state store, but its answer did not come: it
    may have been made, or may be made later (a stalled etcd member applies
    it when it runs again). DEADLINE_EXCEEDED, not UNAVAILABLE, which tells
    a client that nothing was done and the call may simply be sent again.
    An Unavailable all the same to the control plane's own loops (an ACK
    flush, a probe round), which write again or wait out the store as for
    any failure (review: one ended the ACK flush task for good)."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, why: str) -> None:
        super().__init__(
            f"state store did not confirm the change ({why}): {MAY_HAVE_BEEN_MADE}; {CHECK_FIRST}"
        )


class Superseded(ControlPlaneError):
    """A proxy's name is registered by a process started after this one's
    (at `holder_address`, registered from `holder_host`)."""

    status = grpc.StatusCode.ABORTED

    def __init__(self, message: str, *, holder_address: str = "", holder_host: str = "") -> None:
        super().__init__(message)
        self.holder_address = holder_address
        self.holder_host = holder_host
