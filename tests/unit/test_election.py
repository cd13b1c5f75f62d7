"""controlplane.election over MemoryStore."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any

import pytest

from controlplane.catalog import LEADER_KEY
from controlplane.election import Leadership
from controlplane.store import (
    Fence,
    KeyValue,
    Listing,
    OutcomeUnknown,
    StateStore,
    StoreUnavailable,
    Write,
)
from controlplane.store.memory import MemoryStore

TTL = 2
# Bounds for "eventually", not timings under test: generous so a loaded CI
# machine cannot fail them; the ordering of events is what is asserted.
MARGIN = 8.0


async def wait_until(predicate: Callable[[], bool], timeout: float) -> float:
    """Poll until predicate holds; return the seconds it took. Fails after timeout."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)
    return loop.time() - start


async def stop(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


class Journal:
    """Records when each replica's lead() starts and is cancelled."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def lead_for(self, name: str) -> Callable[[], Coroutine[Any, Any, None]]:
        async def lead() -> None:
            self.events.append(("start", name))
            try:
                await asyncio.Event().wait()  # leader loops run until cancelled
            except asyncio.CancelledError:
                self.events.append(("cancelled", name))
                raise

        return lead

    def started(self) -> list[str]:
        return [name for kind, name in self.events if kind == "start"]

    def cancelled(self) -> list[str]:
        return [name for kind, name in self.events if kind == "cancelled"]


class Partitioned:
    """One replica's view of a shared MemoryStore that can be cut off alone.

    MemoryStore.available is global to the store; this simulates a network
    partition (or a hung process) of a single replica.
    """

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.cut = False
        # While cut, a lease renewal hangs this long before failing, as a
        # keepalive does against a blackholed network until the client's
        # per-call timeout (EtcdStore's default is 3 s). 0: fail at once.
        self.renew_hangs = 0.0

    def _check(self) -> None:
        if self.cut:
            raise StoreUnavailable("partitioned")

    async def get(self, key: str) -> KeyValue | None:
        self._check()
        return await self._inner.get(key)

    async def list(self, prefix: str) -> Listing:
        self._check()
        return await self._inner.list(prefix)

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        self._check()
        return await self._inner.scan(start, end, limit=limit)

    async def count(self, start: str, end: str) -> int:
        self._check()
        return await self._inner.count(start, end)

    async def delete_range(self, start: str, end: str) -> int:
        self._check()
        return await self._inner.delete_range(start, end)

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        lease: int = 0,
        if_absent: bool = False,
        if_mod_revision: int | None = None,
        fence: Fence | None = None,
    ) -> int:
        self._check()
        return await self._inner.put(
            key,
            value,
            lease=lease,
            if_absent=if_absent,
            if_mod_revision=if_mod_revision,
            fence=fence,
        )

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        self._check()
        return await self._inner.commit(writes, checks)

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        self._check()
        return await self._inner.delete(key, if_mod_revision=if_mod_revision)

    async def grant_lease(self, ttl: int) -> int:
        self._check()
        return await self._inner.grant_lease(ttl)

    async def refresh_lease(self, lease_id: int) -> int:
        if self.cut and self.renew_hangs:
            await asyncio.sleep(self.renew_hangs)
        self._check()
        return await self._inner.refresh_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        self._check()
        await self._inner.revoke_lease(lease_id)

    async def compact(self, revision: int) -> None:
        self._check()
        await self._inner.compact(revision)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        self._check()
        async for revision in self._inner.watch(prefix, start_revision):
            yield revision

    async def close(self) -> None:
        return None


async def leader_name(store: MemoryStore) -> str | None:
    kv = await store.get(LEADER_KEY)
    return kv.value.decode() if kv else None


# ---------------------------------------------------------------- election


def campaign(
    views: Mapping[str, StateStore], journal: Journal
) -> tuple[dict[str, Leadership], dict[str, asyncio.Task[None]]]:
    """One Leadership per named view of the store, all campaigning."""
    replicas = {n: Leadership(v, n, ttl=TTL) for n, v in views.items()}
    tasks = {n: asyncio.create_task(r.run(journal.lead_for(n))) for n, r in replicas.items()}
    return replicas, tasks


async def test_exactly_one_of_two_leads() -> None:
    store = MemoryStore()
    journal = Journal()
    a, b = Leadership(store, "a", ttl=TTL), Leadership(store, "b", ttl=TTL)
    tasks = [
        asyncio.create_task(a.run(journal.lead_for("a"))),
        asyncio.create_task(b.run(journal.lead_for("b"))),
    ]
    try:
        await wait_until(lambda: bool(journal.started()), TTL + MARGIN)
        # Several campaign and renew intervals later there is still one leader.
        await asyncio.sleep(TTL * 0.75)
        assert len(journal.started()) == 1
        (winner,) = journal.started()
        assert journal.cancelled() == []
        assert [a.is_leader, b.is_leader].count(True) == 1
        leader, follower = (a, b) if a.is_leader else (b, a)
        assert leader.replica_id == winner
        assert (leader.terms, follower.terms) == (1, 0)
        assert await leader_name(store) == winner
    finally:
        await stop(*tasks)
    assert not a.is_leader
    assert not b.is_leader


async def test_follower_takes_over_when_leader_task_is_cancelled() -> None:
    store = MemoryStore()
    journal = Journal()
    replicas, tasks = campaign({"a": store, "b": store}, journal)
    try:
        await wait_until(lambda: bool(journal.started()), TTL + MARGIN)
        (old,) = journal.started()
        new = "b" if old == "a" else "a"
        await stop(tasks[old])  # run() revokes its lease on the way out
        assert journal.cancelled() == [old]  # lead() is cancelled with it
        assert not replicas[old].is_leader
        await wait_until(lambda: replicas[new].is_leader, TTL + MARGIN)
        assert journal.started() == [old, new]
        assert await leader_name(store) == new
        assert (replicas[old].terms, replicas[new].terms) == (1, 1)
    finally:
        await stop(*tasks.values())


async def test_follower_takes_over_from_a_partitioned_leader() -> None:
    """A leader cut off from the store cannot revoke: the lease must expire."""
    store = MemoryStore()
    journal = Journal()
    views = {"a": Partitioned(store), "b": Partitioned(store)}
    replicas, tasks = campaign(views, journal)
    try:
        await wait_until(lambda: bool(journal.started()), TTL + MARGIN)
        (old,) = journal.started()
        new = "b" if old == "a" else "a"
        views[old].cut = True

        await wait_until(lambda: not replicas[old].is_leader, TTL + MARGIN)
        assert journal.cancelled() == [old]
        await wait_until(lambda: replicas[new].is_leader, TTL + MARGIN)
        # The old leader's loops stopped before the new one's started: no overlap.
        assert journal.events == [("start", old), ("cancelled", old), ("start", new)]
        assert await leader_name(store) == new

        # Healed, the old leader stays a follower while the new one renews.
        views[old].cut = False
        await asyncio.sleep(TTL)
        assert not replicas[old].is_leader
        assert replicas[new].is_leader
        assert (replicas[old].terms, replicas[new].terms) == (1, 1)
    finally:
        await stop(*tasks.values())


async def test_hung_renewal_does_not_outlive_the_lease() -> None:
    """The old leader must step down before its lease can expire, even if a
    renewal call hangs until the store client's timeout (3 s for EtcdStore,
    more than the smallest allowed --leader-ttl of 2 s)."""
    store = MemoryStore()
    journal = Journal()
    views = {"a": Partitioned(store), "b": Partitioned(store)}
    replicas, tasks = campaign(views, journal)
    try:
        await wait_until(lambda: bool(journal.started()), TTL + MARGIN)
        (old,) = journal.started()
        new = "b" if old == "a" else "a"
        views[old].renew_hangs = 3.0
        views[old].cut = True
        await wait_until(lambda: replicas[new].is_leader, TTL + MARGIN)
        # When the new leader's loops start, the old leader's must be gone.
        assert not replicas[old].is_leader, "two leaders at once"
        assert journal.events == [("start", old), ("cancelled", old), ("start", new)]
    finally:
        await stop(*tasks.values())


async def test_store_outage_ends_leadership_and_it_is_regained() -> None:
    store = MemoryStore()
    journal = Journal()
    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(journal.lead_for("a")))
    try:
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        store.available = False
        await wait_until(lambda: not replica.is_leader, TTL + MARGIN)
        assert journal.cancelled() == ["a"]
        await asyncio.sleep(0.5)
        assert not replica.is_leader  # cannot campaign during the outage
        assert replica.terms == 1
        store.available = True
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        assert replica.terms == 2
        assert journal.started() == ["a", "a"]
    finally:
        await stop(task)


async def test_a_leader_key_etcd_kept_after_its_outage_is_removed_at_once() -> None:
    """Trial 17: after an outage of etcd the leader key of the term it ended
    stayed for a whole TTL more (etcd gives every lease its TTL again when it
    comes back), so no replica led for 17 s, and `pontoctl get controlplanes`
    named as leader the replica that had stepped down. Its replica removes
    it as soon as the store is back. (The store's clock stands still here:
    its leases live until revoked, as a TTL renewed by etcd's restart.)"""
    store = MemoryStore(clock=lambda: 0.0)
    journal = Journal()
    a = Leadership(store, "a", ttl=TTL)
    b = Leadership(store, "b", ttl=TTL)
    tasks = [asyncio.create_task(a.run(journal.lead_for("a")))]
    try:
        await wait_until(lambda: a.is_leader, TTL + MARGIN)
        tasks.append(asyncio.create_task(b.run(journal.lead_for("b"))))
        store.available = False
        await wait_until(lambda: not a.is_leader, TTL + MARGIN)
        store.available = True
        await wait_until(lambda: a.is_leader or b.is_leader, TTL + MARGIN)
        leader = await store.get(LEADER_KEY)
        assert leader is not None
        assert leader.value == (b"a" if a.is_leader else b"b")
        assert a.terms + b.terms == 2
    finally:
        await stop(*tasks)


async def test_lost_lease_ends_the_term_and_a_new_one_starts() -> None:
    store = MemoryStore()
    journal = Journal()
    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(journal.lead_for("a")))
    try:
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        kv = await store.get(LEADER_KEY)
        assert kv is not None
        assert kv.lease
        await store.revoke_lease(kv.lease)  # the lease vanished server-side
        await wait_until(lambda: replica.terms == 2, TTL + MARGIN)
        assert journal.events == [("start", "a"), ("cancelled", "a"), ("start", "a")]
        assert replica.is_leader
        renewed = await store.get(LEADER_KEY)
        assert renewed is not None
        assert renewed.lease != kv.lease
    finally:
        await stop(task)


async def test_lead_returning_ends_the_term() -> None:
    store = MemoryStore()
    runs = 0

    async def lead() -> None:
        nonlocal runs
        runs += 1

    replica = Leadership(store, "a", ttl=1)
    task = asyncio.create_task(replica.run(lead))
    try:
        await wait_until(lambda: replica.terms >= 3, 5)
        assert runs >= 2
        assert runs in (replica.terms, replica.terms - 1)
    finally:
        await stop(task)


async def test_a_failing_leader_loop_ends_the_term_and_is_logged_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def lead() -> None:
        raise OSError("cannot read origin CA /etc/ponto/origin-ca/ca.crt")

    replica = Leadership(MemoryStore(), "a", ttl=1)
    task = asyncio.create_task(replica.run(lead))
    try:
        await wait_until(lambda: replica.terms >= 2, 5)
    finally:
        await stop(task)
    failed = [r for r in caplog.records if "the leader's loops failed" in r.getMessage()]
    assert failed and failed[0].getMessage() == "a: the leader's loops failed"
    assert failed[0].exc_info is not None and "origin CA" in str(failed[0].exc_info[1])


async def test_nobody_leads_while_the_store_is_down() -> None:
    store = MemoryStore()
    store.available = False
    journal = Journal()
    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(journal.lead_for("a")))
    try:
        await asyncio.sleep(1.0)
        assert not replica.is_leader
        assert journal.events == []
        store.available = True
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        assert replica.terms == 1
    finally:
        await stop(task)


async def test_key_held_by_another_replica_is_respected() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(60)
    await store.put(LEADER_KEY, b"someone-else", lease=lease, if_absent=True)
    journal = Journal()
    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(journal.lead_for("a")))
    try:
        await asyncio.sleep(1.0)
        assert not replica.is_leader
        await store.revoke_lease(lease)
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        assert await leader_name(store) == "a"
    finally:
        await stop(task)


async def test_a_replica_restarted_under_its_id_takes_its_predecessors_lead_at_once() -> None:
    """Trial 27: the leader killed and restarted under its id waited out its
    predecessor's lease (the store's clock stands still here: forever) before
    leading, and meanwhile `get controlplanes` named it the leader."""
    store = MemoryStore(clock=lambda: 0.0)
    lease = await store.grant_lease(TTL)
    await store.put(LEADER_KEY, b"a", lease=lease, if_absent=True)
    journal = Journal()
    restarted = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(restarted.run(journal.lead_for("a")))
    try:
        await wait_until(lambda: restarted.is_leader, MARGIN)
        current = await store.get(LEADER_KEY)
        assert current is not None and current.lease != lease
        assert restarted.terms == 1
    finally:
        await stop(task)


class AnswerLost(Partitioned):
    """A view whose next leader-key write gets OutcomeUnknown: applied
    (etcd applied it; the answer was lost on the way) or not."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.lose_next: bool | None = None  # None: answer; else whether it is applied
        self.lost: list[int] = []  # the leases of the writes that got no answer
        self.revoked: list[int] = []
        self.refresh_fails = 0  # renewals to fail (the store away again)

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        lease: int = 0,
        if_absent: bool = False,
        if_mod_revision: int | None = None,
        fence: Fence | None = None,
    ) -> int:
        applied, self.lose_next = self.lose_next, None
        if applied is None or key != LEADER_KEY:
            self.lose_next = applied
            return await super().put(
                key,
                value,
                lease=lease,
                if_absent=if_absent,
                if_mod_revision=if_mod_revision,
                fence=fence,
            )
        if applied:
            await super().put(key, value, lease=lease, if_absent=if_absent)
        self.lost.append(lease)
        raise OutcomeUnknown("etcd put got no answer")

    async def refresh_lease(self, lease_id: int) -> int:
        if self.refresh_fails:
            self.refresh_fails -= 1
            raise StoreUnavailable("etcd lease keepalive failed")
        return await super().refresh_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        self.revoked.append(lease_id)
        await super().revoke_lease(lease_id)


@pytest.mark.parametrize(("applied", "refresh_fails"), [(True, 0), (False, 0), (True, 1)])
async def test_a_campaign_write_of_unknown_outcome_is_settled_by_the_next_look(
    applied: bool, refresh_fails: int
) -> None:
    """Review 222: a replica that had led before and whose leader-key write
    was applied but got no answer took the key for another replica's, and
    nobody led until its lease's TTL ended (the store's clock stands still
    here: forever). It leads on that lease, also when its first renewal of
    it fails (a review of the fix: the write was forgotten before it was
    settled). A write that was not applied has its lease revoked, not left
    to hold nothing until its TTL."""
    store = MemoryStore(clock=lambda: 0.0)
    view = AnswerLost(store)
    journal = Journal()
    replica = Leadership(view, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(journal.lead_for("a")))
    try:
        await wait_until(lambda: replica.is_leader, MARGIN)
        view.cut = True  # the term ends; its key stays (its lease not revoked)
        await wait_until(lambda: not replica.is_leader, TTL + MARGIN)
        view.lose_next = applied
        view.refresh_fails = refresh_fails
        view.cut = False
        await wait_until(lambda: replica.terms == 2, TTL + MARGIN)
        [lost] = view.lost
        current = await store.get(LEADER_KEY)
        assert current is not None and replica.fence is not None
        assert (current.value, current.mod_revision) == (b"a", replica.fence.mod_revision)
        assert (current.lease == lost) is applied
        assert (lost in view.revoked) is not applied
    finally:
        await stop(task)


async def test_a_shutdown_as_a_term_ends_waits_for_the_loops_and_does_not_campaign_again() -> None:
    """The term ends on its own (the lease gone) and its loops write their
    last (cancellation takes a while); the replica is stopped meanwhile. The
    cancellation reached the loops, which absorbed it, and was lost: the
    replica revoked its lease, campaigned and led again, and the shutdown
    waited for ever."""
    store = MemoryStore()
    events: list[str] = []
    writing = asyncio.Event()

    async def lead() -> None:
        events.append("start")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            writing.set()
            await asyncio.sleep(0.3)  # the last writes, bounded
            events.append("ended")
            raise

    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(lead))
    await wait_until(lambda: replica.is_leader, TTL + MARGIN)
    kv = await store.get(LEADER_KEY)
    assert kv is not None
    await store.revoke_lease(kv.lease)  # the term ends at the next renewal
    await asyncio.wait_for(writing.wait(), TTL + MARGIN)
    task.cancel()  # SIGTERM, while the loops write their last
    done, _ = await asyncio.wait({task}, timeout=MARGIN)
    assert done == {task} and task.cancelled()
    assert events == ["start", "ended"] and replica.terms == 1 and not replica.is_leader
    assert await store.get(LEADER_KEY) is None


async def test_a_term_whose_loops_failed_ends_then_and_another_replica_may_lead() -> None:
    """With a TTL of 30 s the next renewal was 10 s on: the replica led that
    long with no loops running (no probes, no shares). Ended at once, it
    waits before it campaigns again, so a replica whose loops do not fail
    takes the lead rather than one that fails at once winning each time."""
    store = MemoryStore()
    journal = Journal()

    async def failing() -> None:
        raise OSError("cannot read origin CA /etc/ponto/origin-ca/ca.crt")

    a = Leadership(store, "a", ttl=30)
    b = Leadership(store, "b", ttl=30)
    tasks = [asyncio.create_task(a.run(failing))]
    try:
        await wait_until(lambda: a.terms == 1, MARGIN)
        tasks.append(asyncio.create_task(b.run(journal.lead_for("b"))))
        await wait_until(lambda: b.is_leader, 5)  # well inside the 10 s
        assert a.terms == 1 and journal.started() == ["b"]
    finally:
        await stop(*tasks)


async def test_lost_leadership_is_said_as_the_replica_steps_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not once the loops' last writes and the lease's revocation are done:
    with etcd away those take seconds (trial 43: said 3 s late)."""
    store = MemoryStore()
    said_by_then: list[bool] = []

    async def lead() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            said_by_then.append("a lost leadership" in caplog.text)
            raise

    replica = Leadership(store, "a", ttl=TTL)
    task = asyncio.create_task(replica.run(lead))
    try:
        await wait_until(lambda: replica.is_leader, TTL + MARGIN)
        kv = await store.get(LEADER_KEY)
        assert kv is not None
        await store.revoke_lease(kv.lease)
        await wait_until(lambda: bool(said_by_then), TTL + MARGIN)
    finally:
        await stop(task)
    assert said_by_then[0]
