"""The leader's compaction of etcd's history.

etcd keeps every revision of every key until it is compacted, and its
defaults compact nothing: its database grows until its quota (2 GiB by
default), and then refuses every write (NOSPACE), so that drains, key
revocations and suspensions fail while proxies go on with their last table.
A fleet writes every second (origin loads, rate-limit demand, replicas'
beats, traffic reports): trial 68 measured 4.5 MB of history an hour for 4
proxies and 3 origins, with nothing ever freed on an etcd of the operator's
own. The Helm chart's etcd compacts itself (--auto-compaction-retention);
another might not.

So the leader compacts, as kube-apiserver does (--etcd-compaction-interval,
5 minutes by default): every `interval` it compacts to the revision it read
one interval before, keeping that much history for watches that resume (one
from before it is told so, and re-lists). Compaction frees space inside etcd's
database for reuse; the file itself shrinks only by `etcdctl defrag`
(docs/operations.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from controlplane.catalog import LEADER_KEY
from controlplane.store import StateStore, StoreError

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 300.0


class Compactor:
    """Compacts `store` every `interval` seconds, to the revision read one
    interval before. Run by the leader only (one compaction a fleet, not one
    a replica), for its term: `run` returns only when cancelled. A failed
    read or compaction is logged and tried again at the next interval."""

    def __init__(
        self,
        store: StateStore,
        interval: float = DEFAULT_INTERVAL_S,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.interval = interval
        self._sleep = sleep
        self._previous = 0  # the revision read at the last interval
        self.compacted = 0  # the last revision compacted to

    async def once(self) -> None:
        """Compact to the revision read last time, then keep the revision
        read now for next time. It is kept even when the compaction fails:
        one that cannot be made (a revision etcd no longer has, after a
        restore) is not tried again and again."""
        try:
            # A read of one key, for the store's revision now.
            now = (await self.store.list(LEADER_KEY)).revision
        except StoreError as exc:
            self._failed(exc)
            return
        target, self._previous = self._previous, now
        if not target or target <= self.compacted:
            return  # nothing read before, or nothing written since
        try:
            await self.store.compact(target)
        except StoreError as exc:
            self._failed(exc)
            return
        self.compacted = target
        # INFO: one line an interval (5 minutes), which operators look for.
        log.info("etcd history compacted to revision %d", target)

    def _failed(self, exc: StoreError) -> None:
        log.warning("etcd history not compacted (tried again in %g s): %s", self.interval, exc)

    async def run(self) -> None:
        # A term of its own: what was read in an earlier term (leadership
        # lost and won back within seconds) would be compacted to at once,
        # far less than one interval back (review).
        self._previous = 0
        while True:
            await self.once()
            await self._sleep(self.interval)
