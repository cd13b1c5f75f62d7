"""Typed keys of the proxy's app and request state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from dataplane.auth.authenticator import Principal
from dataplane.http.accesslog import AccessLog, OriginCall
from dataplane.http.requestid import RequestIds
from dataplane.metrics import Metrics
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from dataplane.sync.quota import QuotaState

if TYPE_CHECKING:
    from dataplane.http.pipeline import Exchange, Pipeline


class Draining:
    """Set once the proxy is stopping: at SIGTERM with --drain-seconds (the
    entry point), and in any case when the app shuts down (its on_shutdown
    step, before the runner cancels the handlers still running). From then on
    answers carry `Connection: close`, and a cancelled handler is recorded as
    `cancelled`, not as a client that left.

    One per app, read by the error boundary; the event loop is the only
    thread touching it.
    """

    __slots__ = ("active", "leaving")

    def __init__(self) -> None:
        self.active = False
        # A worker leaving its group to a successor (a reload): the group,
        # whose port the successor listens on, stays ready.
        self.leaving = False


# Every answer's Server header: the product, not the versions of Python and
# aiohttp beneath it (trial 36), as Envoy's `envoy` and nginx's `nginx`.
SERVER_NAME = "ponto"

HOLDER = web.AppKey("holder", TableHolder)
CLIENT = web.AppKey("control_plane_client", ControlPlaneClient)
METRICS = web.AppKey("metrics", Metrics)
QUOTA = web.AppKey("quota", QuotaState)
DRAINING = web.AppKey("draining", Draining)


def stopping(request: web.Request) -> bool:
    """Whether a cancellation of `request`'s handler is the server's, which
    stops (its connection still open), not its client's leaving."""
    transport = request.transport
    return request.app[DRAINING].active and transport is not None and not transport.is_closing()


PIPELINE: web.AppKey[Pipeline] = web.AppKey("pipeline")
REQUEST_IDS = web.AppKey("request_ids", RequestIds)
# Set only with --access-log on.
ACCESS_LOG = web.AppKey("access_log", AccessLog)
# Counts and logs a message the HTTP parser refused (dataplane.http.edge), which
# no handler or middleware sees: (request, request id, status, error code).
UNPARSED: web.AppKey[Callable[[web.BaseRequest, str, int, str], None]] = web.AppKey("unparsed")
# Looks for origins that became slow or recovered and logs each change
# (Proxy.tell_slow_origins): once a second on its own; a test calls it to look
# now rather than sleep through a second.
SLOW_LOOK: web.AppKey[Callable[[], None]] = web.AppKey("slow_look")

# Every request's id, set by the error boundary before any handler runs.
REQUEST_ID = web.RequestKey("request_id", str)

# The proxied request's state, for the error boundary.
EXCHANGE: web.RequestKey[Exchange] = web.RequestKey("exchange")
# The caller of an endpoint outside the pipeline (GET /v1/models), for accounting.
PRINCIPAL = web.RequestKey("principal", Principal)
# The origin call of a request outside the pipeline (a stored response's
# route), for its access line.
ORIGIN_CALL = web.RequestKey("origin_call", OriginCall)
# Set by a proxied route's Expect handler on a `100-continue` it has not
# answered yet: the pipeline sends the 100 when it reads the body, after the
# refusals the head alone decides (auth, type, declared length); cleared then.
CONTINUE_PENDING = web.RequestKey("continue_pending", bool)
