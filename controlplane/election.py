"""Leader election over the state store: one key, held under a lease.

Every replica serves proxies and admin reads; only the leader runs the loops
that write observed state (health probes, load scraping). A replica that
cannot renew its lease within the TTL stops its leader loops at once, so two
leaders overlap for at most the time it takes the old one to notice (the
renew interval), and the new one is elected within the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from controlplane.catalog import LEADER_KEY
from controlplane.store import (
    Conflict,
    Fence,
    LeaseExpired,
    OutcomeUnknown,
    StateStore,
    StoreUnavailable,
)

log = logging.getLogger(__name__)


class Leadership:
    def __init__(self, store: StateStore, replica_id: str, *, ttl: int = 5) -> None:
        self._store = store
        self.replica_id = replica_id
        self._ttl = ttl
        self.is_leader = False
        self.terms = 0
        # The leader key's revision while this replica leads: leader-only
        # writes carry it, so they fail once another replica has taken over.
        self.fence: Fence | None = None
        # The revision of the leader key of a term that ended while the store
        # was away (its lease not revoked): removed as soon as the store is back.
        self._stale = 0

    async def run(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Campaign forever; run `lead()` while leader, cancel it when leadership ends."""
        while True:
            lease, revision = await self._campaign()
            self._stale = revision
            self.fence = Fence(LEADER_KEY, revision)
            self.is_leader = True
            self.terms += 1
            log.info("%s is the leader (lease %x)", self.replica_id, lease)
            leader_task = asyncio.create_task(lead(), name="leader-loops")
            try:
                await self._hold(lease, leader_task)
                # As it steps down: the loops' last writes and the lease's
                # revocation come after, and with etcd away they take seconds
                # (trial 43: said 3 s after the term had ended).
                log.warning("%s lost leadership", self.replica_id)
            finally:
                self.is_leader = False
                self.fence = None
                stopped, failed = await self._ended(leader_task)
                with contextlib.suppress(StoreUnavailable):
                    await self._store.revoke_lease(lease)
                if stopped:
                    # Cancelled while the term ended (a shutdown as the loops
                    # wrote their last): the loops ended, the lease went, and
                    # this replica does not campaign again.
                    raise asyncio.CancelledError
            if failed:
                # Not at once: a replica whose loops fail at once (its origin
                # CA unreadable) led and failed in a tight loop, and another,
                # which may not fail, had no time to campaign.
                await asyncio.sleep(self._ttl / 3)

    async def _ended(self, leader_task: asyncio.Task[None]) -> tuple[bool, bool]:
        """Cancel the term's loops and wait until they have ended, however long
        their last writes take (each is bounded, and fenced by the term): the
        lease is revoked only after. Whether this task was itself cancelled
        meanwhile, which is put off until then rather than lost (under a
        shutdown that came as a term ended on its own, the replica revoked its
        lease and campaigned again, and the shutdown waited for ever); and
        whether the loops failed."""
        leader_task.cancel()
        cancelled = False
        while not leader_task.done():
            try:
                await asyncio.wait({leader_task})
            except asyncio.CancelledError:
                cancelled = True
        if leader_task.cancelled():
            return cancelled, False
        failed = leader_task.exception()
        if failed is not None:
            # A failure of the leader's loops ends the term: said once, with its
            # cause, or the replica would lead and step down in a loop with
            # nothing in its log.
            log.error("%s: the leader's loops failed", self.replica_id, exc_info=failed)
        return cancelled, failed is not None

    async def _campaign(self) -> tuple[int, int]:
        unknown = 0  # the lease of a leader-key write that got no answer
        while True:
            try:
                current = await self._store.get(LEADER_KEY)
                if unknown:
                    # Forgotten only once settled: a failed renewal or
                    # revocation here is tried again by the next look.
                    lease = unknown
                    if current is not None and current.lease == lease:
                        # The write was applied: this replica leads, on the
                        # lease it granted (review 222: it took the key for
                        # another's, and nobody led until the lease's TTL
                        # ended). Renewed first: its TTL has run since the
                        # grant, and _hold counts from now.
                        await self._store.refresh_lease(lease)
                        return lease, current.mod_revision
                    # Not applied: the lease holds nothing; not left to its TTL.
                    await self._store.revoke_lease(lease)
                    unknown = 0
                if current is not None and (
                    current.mod_revision == self._stale or self._predecessors(current.value)
                ):
                    # This replica's own key, of the term that ended when the
                    # store went away: its lease was not revoked, and etcd
                    # gives every lease its whole TTL again when it comes back,
                    # so nobody would lead for that long (trial 17: 17 s). Or
                    # the key of the process this one replaces under the same
                    # id, which died leading: until its lease ended, nobody led
                    # and `get controlplanes` named this process the leader
                    # (trial 27).
                    with contextlib.suppress(Conflict):
                        await self._store.delete(LEADER_KEY, if_mod_revision=current.mod_revision)
                    await self._store.revoke_lease(current.lease)
                    current = None
                self._stale = 0
                if current is None:
                    lease = await self._store.grant_lease(self._ttl)
                    try:
                        revision = await self._store.put(
                            LEADER_KEY, self.replica_id.encode(), lease=lease, if_absent=True
                        )
                        return lease, revision
                    except Conflict:
                        await self._store.revoke_lease(lease)
                    except OutcomeUnknown:
                        unknown = lease  # the next look at the key says which
                        raise
            except (StoreUnavailable, LeaseExpired) as exc:
                log.debug("campaign: %s", exc)
            await asyncio.sleep(min(1.0, self._ttl / 5))

    def _predecessors(self, holder: bytes) -> bool:
        """Whether a leader key naming `holder` is a previous process's of this
        replica id: it names this id, and this process has never led. A
        replica id is one process's at a time: a second live process given
        the id of the leader takes the lead from it once, as it starts; the
        first steps down within a third of the TTL, and the fence keeps its
        writes from landing meanwhile."""
        return self.terms == 0 and holder == self.replica_id.encode()

    async def _hold(self, lease: int, leader_task: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        # Past this point the lease may be gone on the server and another
        # replica may lead: step down before it, whatever a renewal is doing.
        step_down_after = self._ttl * 2 / 3
        renewed = loop.time()
        while not leader_task.done():
            # Woken as the loops end too: a term whose loops failed ends now,
            # not at the next renewal.
            await asyncio.wait({leader_task}, timeout=self._ttl / 3)
            if leader_task.done():
                return
            budget = renewed + step_down_after - loop.time()
            if budget <= 0:
                return
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses
                # a cancellation that lands as the renewal completes, and this
                # replica would then campaign on after being told to stop.
                async with asyncio.timeout(budget):
                    await self._store.refresh_lease(lease)
                renewed = loop.time()
            except LeaseExpired:
                return
            except (StoreUnavailable, TimeoutError):
                if loop.time() - renewed >= step_down_after:
                    return
