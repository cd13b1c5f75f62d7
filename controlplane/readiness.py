"""What a replica tells health checkers (grpc.health.v1), and when.

The same statuses are served on the main port and on the plaintext
--health-listen port that kubelet probes use:

- READINESS ("", the name a probe asks for by default) and the Routing
  service: NOT_SERVING until this replica has built a route table from the
  store, so no proxy is sent to a replica with nothing to serve (one pointed at
  something that is not etcd, say). SERVING from then on, also while the store
  is away: the replica keeps serving the table it has (static stability).
- LIVENESS ("liveness"): SERVING while the process runs. A replica that cannot
  reach etcd is not broken; restarting it would not bring etcd back.
- STORE ("ponto.store"): SERVING while the store answers a read, NOT_SERVING
  while it does not and until it first does. For dashboards and alerts; a
  probe on it would take every replica out during an etcd outage.

At shutdown every name goes NOT_SERVING (the servicer's graceful shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

from controlplane.api.routing import SERVICE as ROUTING_SERVICE
from controlplane.catalog import ROOT
from controlplane.distribute import Publisher
from controlplane.store import StateStore, StoreError

log = logging.getLogger(__name__)

READINESS = ""
LIVENESS = "liveness"
STORE = "ponto.store"

# A key that is never written: reading it costs etcd a quorum read and nothing else.
PROBE_KEY = ROOT + "probe"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class Condition:
    """What the replica knows about itself."""

    has_table: bool = False  # a route table built from the store was published
    store_ok: bool = False  # the store answered the latest probe


def statuses(condition: Condition) -> dict[str, health_pb2.HealthCheckResponse.ServingStatus]:
    """Health status per service name; pure."""
    ready = SERVING if condition.has_table else NOT_SERVING
    return {
        READINESS: ready,
        ROUTING_SERVICE: ready,
        LIVENESS: SERVING,
        STORE: SERVING if condition.store_ok else NOT_SERVING,
    }


class ReplicaHealth:
    """Keeps a health servicer in step with the replica's Condition.

    Owned by the ControlPlane, on its event loop: publish() before the servers
    start (the servicer starts with "" SERVING), then run() as a task until
    cancelled. It learns of the first table from the publisher and of the
    store by reading PROBE_KEY every `interval` seconds; a read fails within
    the store's own call timeout.
    """

    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        store: StateStore,
        publisher: Publisher,
        *,
        interval: float = 1.0,
    ) -> None:
        self._servicer = servicer
        self._store = store
        self._publisher = publisher
        self._interval = interval
        self.condition = Condition()
        # Setting a status may wait for the servicer's watchers; without the
        # lock an older publish could finish after a newer one.
        self._publishing = asyncio.Lock()

    async def publish(self) -> None:
        """Set every service's status from the current condition."""
        async with self._publishing:
            for service, status in statuses(self.condition).items():
                await self._servicer.set(service, status)

    async def _update(self, condition: Condition, error: str = "") -> None:
        before, self.condition = self.condition, condition
        if condition.has_table and not before.has_table:
            log.info("route table built from the store: ready for proxies")
        if condition.store_ok != before.store_ok:
            if condition.store_ok:
                log.info("state store reachable")
            else:
                log.warning(
                    "state store unreachable (%s); proxies keep the current route table", error
                )
        await self.publish()

    async def run(self) -> None:
        """Run until cancelled."""
        await asyncio.gather(self._await_table(), self._probe_store())

    async def _await_table(self) -> None:
        await self._publisher.next_after(None)
        await self._update(Condition(has_table=True, store_ok=self.condition.store_ok))

    async def _probe_store(self) -> None:
        while True:
            error = ""
            try:
                await self._store.get(PROBE_KEY)
            except StoreError as exc:
                error = str(exc) or type(exc).__name__
            except Exception as exc:  # a bug here must not freeze the statuses
                log.exception("state store probe failed")
                error = repr(exc)
            ok = not error
            if ok != self.condition.store_ok:
                await self._update(Condition(self.condition.has_table, store_ok=ok), error)
            await asyncio.sleep(self._interval)
