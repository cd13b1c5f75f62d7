"""One member of three stalled (SIGSTOP): the store goes on with the other two.

SRE trial: a stopped member accepts connections and answers nothing, so gRPC's
round robin kept sending it every third call, and each of those used up its
whole timeout: a third of all calls failed, and leadership came in 5 s stints.
Here a real three-member cluster runs on loopback; the store (and each
replica's, for the election) starts on the member that is stalled, the worst
case: a write already sent to it is the one call that may fail, and says its
outcome is unknown. Failures are counted, not timed; the cluster is continued,
stopped and its data removed whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.election import Leadership
from controlplane.store import OutcomeUnknown, StoreError
from controlplane.store.etcd import EtcdStore
from tests.etcdcluster import Cluster, Member, start_cluster

pytestmark = pytest.mark.integration

P = "/stall/"
TIMEOUT = 3.0  # the store's call timeout, the control plane's default
CALLS = 10
TTL = 5  # the leader lease's, the control plane's default
STALL_S = 12.0  # how long the replicas' election runs with the member stalled


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = start_cluster(tmp_path)
    try:
        yield running
    finally:
        running.stop()  # continues a stalled member first; removes the data dirs


@contextlib.asynccontextmanager
async def store_on(cluster: Cluster, member: Member) -> AsyncIterator[EtcdStore]:
    """A store of the whole cluster whose calls go to `member` first."""
    store = EtcdStore(cluster.endpoints, timeout=TIMEOUT)
    members = getattr(store, "_members", None)  # none before a store had a member each
    if members is not None:
        store._pin = next(i for i, m in enumerate(members) if m.target.endswith(member.endpoint))
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def victim(cluster: Cluster, which: str) -> Member:
    leader = cluster.leader()
    return leader if which == "leader" else next(m for m in cluster.members if m is not leader)


@pytest.mark.parametrize("which", ["follower", "leader"])
async def test_reads_and_writes_go_on_with_one_member_stalled(cluster: Cluster, which: str) -> None:
    stalled = victim(cluster, which)
    async with store_on(cluster, stalled) as store:
        await store.put(P + "k", b"0")
        cluster.stall(stalled)
        try:
            failed: list[StoreError] = []
            for i in range(CALLS):
                try:
                    if i % 2 == 0:  # a write first: one already sent may be lost
                        await store.put(P + "k", str(i).encode())
                    else:
                        assert (await store.list(P)).items
                except StoreError as exc:
                    failed.append(exc)
        finally:
            cluster.resume(stalled)
    assert len(failed) <= 1, [str(e) for e in failed]
    # A write sent to the stalled member is not said to be refused: it may
    # be applied when the member runs again.
    assert all(isinstance(e, OutcomeUnknown) for e in failed), [str(e) for e in failed]


@pytest.mark.parametrize("which", ["follower", "leader"])
async def test_leadership_holds_with_one_member_stalled(cluster: Cluster, which: str) -> None:
    """Two replicas campaign; with a member stalled under both, the one that
    leads goes on leading (its lease renewals reach the other members)."""
    stalled = victim(cluster, which)

    async def lead() -> None:
        await asyncio.Event().wait()

    async with store_on(cluster, stalled) as a, store_on(cluster, stalled) as b:
        replicas = [Leadership(a, "cp-a", ttl=TTL), Leadership(b, "cp-b", ttl=TTL)]
        tasks = [asyncio.create_task(r.run(lead)) for r in replicas]
        try:
            async with asyncio.timeout(10 * TTL):
                while not any(r.is_leader for r in replicas):
                    await asyncio.sleep(0.05)
            terms = sum(r.terms for r in replicas)
            cluster.stall(stalled)
            try:
                await asyncio.sleep(STALL_S)
                new_terms = sum(r.terms for r in replicas) - terms
                leaders = [r.replica_id for r in replicas if r.is_leader]
            finally:
                cluster.resume(stalled)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert new_terms == 0 and len(leaders) == 1, (new_terms, leaders)
