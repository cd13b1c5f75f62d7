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

While the fleet is in question (in_question: proxies refuse this replica's
tables as another fleet's, or, as their registrations say, another
replica's; or it replaced the fleet id a moment ago), the
routing service sends no table to a proxy that holds none (a new pod, a
scale-up, a rolled pod with an emptyDir state): one that took the new
fleet's table would serve its callers with no key, refuse the fleet's tables
once the operator adopts the old id, and advise adopting its own. It gets its
table once the question is settled (settled()).

Fed by the table builder (made, published) and the routing service (answered,
ended); read by /metrics and /api/status. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from controlplane.catalog import FLEET_ID
from controlplane.model import ProxyRecord

log = logging.getLogger(__name__)

# How a proxy's NACK of a table of another fleet begins (dataplane.sync.
# holder.refusal; tests/unit/test_fleet_withheld.py holds the two together),
# as a registration keeps it (ProxyRecord.last_error).
ANOTHER_FLEET_NACK = "another fleet's table"
# And of one that would open it (a closed proxy, a table requiring no key).
WOULD_OPEN_NACK = "table would open this proxy"

# How long after this replica replaced the fleet id a proxy that holds no
# table waits for one though no proxy refuses (yet): the proxies that hold the
# old fleet's tables reconnect and refuse within seconds. After it, with none
# refusing (every proxy lost its state too), the tables flow: there is no
# other fleet left to keep.
REPLACED_GRACE_S = 60.0


class FleetWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # The fleet id of the latest table this replica published ("" before
        # one that carries it).
        self.fleet_id = ""
        # The fleet id this replica published before it made a new one (the
        # store lost its state), until it publishes that one again (adopted).
        self.replaced = ""
        self._replaced_at = 0.0
        # Proxies that hold no table and are sent none until the fleet is
        # no longer in question (the routing service's streams).
        self.waiting: set[str] = set()
        # Set (and dropped) when what in_question reads changes: settled()
        # waits on it.
        self._change: asyncio.Event | None = None
        # Proxy name -> the fleet id it serves, for this replica's proxies
        # whose last answer refused its table as another fleet's.
        self.refusing: dict[str, str] = {}
        self._told: set[str] = set()
        # Proxies whose registration (any replica's, as last read: seen)
        # says they refused a table as another fleet's: a replica none of
        # whose own proxies refuse still knows the fleet is in question.
        self.stored_refusing = 0
        # Proxies that take this replica's tables (their last answer an
        # ACK), and the registrations whose last answer was an ACK: proxies
        # that refuse are a question only when they outnumber these, so that
        # one stray proxy of another fleet pointed here does not keep every
        # new proxy of this one waiting.
        self.taking: set[str] = set()
        # This replica's proxies whose last answer refused its table as
        # opening them (the fleet's keys lost with etcd, adopted before they
        # were made again): a proxy that holds no table would take that open
        # table, so they count as refusing, in the stored registrations too.
        self.opening: set[str] = set()
        self.stored_taking = 0
        # Whether seen() gave the stored counts yet (until then: this
        # replica's counts alone decide, _refusals_prevail).
        self._stored_seen = False
        # Why the stored fleet id is no fleet id ("" when it is one, or none
        # is stored): this replica's tables carry none, so the proxies judge
        # them by auth alone, until `pontoctl fleet adopt` replaces it.
        self.invalid = ""

    def stored(self, invalid: str) -> None:
        """The table builder read the store: `invalid` says why its fleet id
        is no fleet id ("" when it is one or none is stored). Logged at
        ERROR when it becomes so, not at every build."""
        if invalid and invalid != self.invalid:
            log.error(
                "the stored fleet id (%s) is not one: %s. Route tables go out without a "
                "fleet id, and the proxies' guard judges them by auth alone; `pontoctl "
                "fleet adopt ID` with the id the proxies serve (their ponto_fleet_info) "
                "replaces it",
                FLEET_ID,
                invalid,
            )
        elif self.invalid and not invalid:
            log.info("the stored fleet id is one again")
        self.invalid = invalid

    def made(self, fleet_id: str, before: str) -> None:
        """This replica made fleet id `fleet_id` for a store that had none;
        `before` is the fleet id of the table it published last ("" if none)."""
        if not before or before == fleet_id:
            # The same, derived from the store's Responses id key: a store
            # older than fleet ids, or restored from a snapshot that was.
            log.info("made the fleet id %s (the store had none)", fleet_id)
            return
        self.replaced = before
        self._replaced_at = self._clock()
        self._changed()
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
            self._changed()

    def answered(self, proxy: str, served: str, *, refused: bool, opening: bool = False) -> None:
        """Proxy `proxy`, serving fleet `served` ("" if it does not say: an
        older proxy's), ACKed (refused False) or NACKed a table of this
        replica's (`opening`: as one that would open it)."""
        if opening:
            self.opening.add(proxy)
        else:
            self.opening.discard(proxy)
        if refused and served and self.fleet_id and served != self.fleet_id:
            self.taking.discard(proxy)
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
            if refused:
                self.taking.discard(proxy)
            else:
                self.taking.add(proxy)
            self._settle(proxy)
        self._changed()

    def ended(self, proxy: str) -> None:
        """Proxy `proxy`'s stream with this replica ended."""
        self.taking.discard(proxy)
        self.opening.discard(proxy)
        self._settle(proxy)
        self._changed()

    def _settle(self, proxy: str) -> None:
        """Proxy `proxy` refuses this replica's tables no more."""
        if self.refusing.pop(proxy, None) is not None and not self.refusing:
            self._told.clear()  # a next loss is news again

    def seen(self, proxies: Iterable[ProxyRecord]) -> None:
        """The proxies' registrations as stored, every replica's (read by
        the status page's sampling, StatusWeb.sample, a few times a
        minute): count those whose last answer refused a table as another
        fleet's, and those whose last answer took one."""
        refusing = taking = 0
        for p in proxies:
            if p.last_error.startswith((ANOTHER_FLEET_NACK, WOULD_OPEN_NACK)):
                refusing += 1
            elif not p.last_error and p.acked_version:
                taking += 1
        self.stored_refusing, self.stored_taking = refusing, taking
        self._stored_seen = True
        self._changed()

    def _refusals_prevail(self) -> bool:
        """More proxies refuse the tables as another fleet's (or as opening
        them) than take them: fleet-wide once the stored registrations were
        read (each count the larger of this replica's, newer, and the
        stored, every replica's), among this replica's before. Review 295:
        this replica's alone decided too, so one stray proxy of another
        fleet on a replica few proxies use kept every new one there waiting,
        however many took the tables elsewhere."""
        refusing = len(self.refusing) + len(self.opening - self.refusing.keys())
        taking = len(self.taking)
        if self._stored_seen:
            refusing = max(refusing, self.stored_refusing)
            taking = max(taking, self.stored_taking)
        return refusing > taking

    def in_question(self) -> bool:
        """Whether a proxy that holds no table must wait for one: more
        proxies refuse the tables as another fleet's than take them, or this
        replica replaced the fleet id less than REPLACED_GRACE_S ago. Not for
        a fresh install (no id replaced, none refusing), nor a scale-up, nor
        a whole fleet restarted without its state (none refusing), nor a
        stray proxy of another fleet among this one's (outnumbered)."""
        if self._refusals_prevail():
            return True
        return bool(self.replaced) and self._clock() - self._replaced_at < REPLACED_GRACE_S

    async def settled(self) -> None:
        """Return once the fleet is not in question: adopted (this
        replica's tables are the refusing proxies' fleet's again, and they
        take them), the refusing proxies gone, or the grace after a
        replacement over with none refusing. Called by the routing service
        for each stream of a proxy that holds no table."""
        while self.in_question():
            if self._change is None:
                self._change = asyncio.Event()
            change = self._change
            left = None
            if not self._refusals_prevail():
                left = max(0.0, REPLACED_GRACE_S - (self._clock() - self._replaced_at))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await change.wait()

    def _changed(self) -> None:
        if self._change is not None:
            self._change.set()
            self._change = None

    def problem(self) -> str:
        """A sentence for the status page ("" when the fleet is whole). It
        names the fleet id most refusing proxies serve, the one to adopt,
        and says when they disagree (proxies of two fleets on one control
        plane: adopting one id leaves the others refusing)."""
        parts = []
        if self.invalid:
            parts.append(
                f"the stored fleet id is not one ({self.invalid}): route tables go out "
                "without a fleet id, and the proxies judge them by auth alone"
            )
        if self.replaced:
            parts.append(
                f"this replica made fleet id {self.fleet_id} for a store without one, "
                f"after serving fleet {self.replaced}: etcd lost its data or is another"
            )
        adopt = "ID"
        if self.refusing:
            counts = Counter(self.refusing.values())
            # Most proxies first; ties by id, so the sentence is stable.
            ranked = sorted(counts.items(), key=lambda c: (-c[1], c[0]))
            adopt = ranked[0][0]
            said = (
                f"{len(self.refusing)} proxies refuse its route tables as another fleet's "
                f"and keep theirs (they serve fleet {adopt})"
            )
            if len(ranked) > 1:
                said = (
                    f"{len(self.refusing)} proxies refuse its route tables as another fleet's "
                    f"and keep theirs, and they disagree: "
                    + ", ".join(f"{n} serve fleet {fleet}" for fleet, n in ranked)
                    + f"; adopting {adopt} leaves the others refusing"
                )
            parts.append(said)
        elif self.stored_refusing:
            parts.append(
                f"{self.stored_refusing} proxies (of other replicas) refuse route tables as "
                "another fleet's and keep theirs: their replicas' pages name the fleet they serve"
            )
        if self.opening:
            parts.append(
                f"{len(self.opening)} proxies refuse its route tables as opening them (the "
                "store holds no API key or JWT issuer, and theirs require one): make the "
                "keys again"
            )
        if not self.refusing and self.replaced:
            adopt = self.replaced
        if self.waiting:
            parts.append(
                f"{len(self.waiting)} proxies that hold no table (started since) are sent "
                "none until this is settled, and serve nothing"
            )
        if not parts:
            return ""
        return "; ".join(parts) + (
            f": restore etcd from a snapshot, or `pontoctl fleet adopt {adopt}` once the "
            'store holds what the fleet should serve (docs/operations.md, "etcd came back empty")'
        )
