"""What one replica knows of the fleet's identity, said loudly when it is lost.

The fleet id (catalog.FLEET_ID, RouteTable.fleet_id) is made once, by the
first replica that builds a table from a store without one. A replica that
makes one after it published a table of another fleet id read a store that
lost its state (etcd emptied, its volume gone) or another store (a wrong
--etcd): the proxies refuse its tables and keep theirs (dataplane.sync.holder),
and an operator must choose between restoring etcd from a backup and adopting
the proxies' fleet id (`pontoctl fleet adopt`, docs/operations.md). Proxies
that refuse this replica's tables as another fleet's (their NACK names the
fleet they serve) say the same from their side, whichever replica made the id.

Fed by the table builder (made, published) and the routing service (answered,
ended); read by /metrics and /api/status. Not thread-safe: one event loop.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class FleetWatch:
    def __init__(self) -> None:
        # The fleet id of the latest table this replica published ("" before
        # one that carries it).
        self.fleet_id = ""
        # The fleet id this replica published before it made a new one (the
        # store lost its state), until it publishes that one again (adopted).
        self.replaced = ""
        # Proxy name -> the fleet id it serves, for this replica's proxies
        # whose last answer refused its table as another fleet's.
        self.refusing: dict[str, str] = {}
        self._told: set[str] = set()

    def made(self, fleet_id: str, before: str) -> None:
        """This replica made fleet id `fleet_id` for a store that had none;
        `before` is the fleet id of the table it published last ("" if none)."""
        if not before or before == fleet_id:
            # The same, derived from the store's Responses id key: a store
            # older than fleet ids, or restored from a snapshot that was.
            log.info("made the fleet id %s (the store had none)", fleet_id)
            return
        self.replaced = before
        log.error(
            "the state store holds no fleet id, though this replica served fleet %s: "
            "etcd lost its data (or this is another etcd). Made fleet %s; proxies of "
            "fleet %s refuse its tables and keep serving theirs. Restore etcd from a "
            "snapshot if there is one; else apply the configuration and make keys "
            'again, then `pontoctl fleet adopt %s` (docs/operations.md, "etcd came '
            'back empty")',
            before,
            fleet_id,
            before,
            before,
        )

    def published(self, fleet_id: str) -> None:
        """This replica published a table of `fleet_id`."""
        if fleet_id == self.fleet_id:
            return
        if self.fleet_id:
            log.warning("route tables are of fleet %s now (were of %s)", fleet_id, self.fleet_id)
        self.fleet_id = fleet_id
        if fleet_id == self.replaced:
            self.replaced = ""

    def answered(self, proxy: str, served: str, *, refused: bool) -> None:
        """Proxy `proxy`, serving fleet `served` ("" if it does not say: an
        older proxy's), ACKed (refused False) or NACKed a table of this
        replica's."""
        if refused and served and self.fleet_id and served != self.fleet_id:
            self.refusing[proxy] = served
            if served not in self._told:
                self._told.add(served)
                log.error(
                    "proxy %s serves fleet %s and refuses this replica's tables (fleet %s): "
                    "etcd lost its state, or is not that fleet's. It keeps serving its "
                    "table; restore etcd, or `pontoctl fleet adopt %s` "
                    '(docs/operations.md, "etcd came back empty")',
                    proxy,
                    served,
                    self.fleet_id,
                    served,
                )
        else:
            self.refusing.pop(proxy, None)
            if not self.refusing:
                self._told.clear()

    def ended(self, proxy: str) -> None:
        """Proxy `proxy`'s stream with this replica ended."""
        self.refusing.pop(proxy, None)

    def problem(self) -> str:
        """A sentence for the status page ("" when the fleet is whole)."""
        parts = []
        if self.replaced:
            parts.append(
                f"this replica made fleet id {self.fleet_id} for a store without one, "
                f"after serving fleet {self.replaced}: etcd lost its data or is another"
            )
        if self.refusing:
            served = sorted(set(self.refusing.values()))
            parts.append(
                f"{len(self.refusing)} proxies refuse its route tables as another fleet's "
                f"and keep theirs (they serve fleet {', '.join(served)})"
            )
        if not parts:
            return ""
        return "; ".join(parts) + (
            ": restore etcd from a snapshot, or `pontoctl fleet adopt ID` once the "
            'store holds what the fleet should serve (docs/operations.md, "etcd came back empty")'
        )
