"""Latest-snapshot fan-out of route tables to proxy streams.

"What to serve" (the latest Snapshot) is kept apart from "how to stream it"
(api/routing.py). A snapshot is serialised once when published; every stream
sends the same bytes. Streams never queue: a slow stream that wakes up sends
only the newest snapshot, so intermediate versions coalesce.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An internally consistent, immutable route table ready to send."""

    table: pb.RouteTable
    nonce: str
    payload: bytes  # serialised RouteUpdate(table, nonce)
    published_at: float  # the Publisher's clock; push latency counts from it

    @property
    def version(self) -> int:
        return self.table.version

    @property
    def etag(self) -> str:
        return self.table.etag


class Publisher:
    """Holds the latest snapshot; publish() wakes every waiting stream.

    Single event loop only. Publishing is O(1) in the number of streams.
    `clock` (monotonic seconds) stamps each snapshot's published_at.
    """

    def __init__(self, replica_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._replica_id = replica_id
        self._clock = clock
        self._latest: Snapshot | None = None
        self._changed = asyncio.Event()
        self._pushes = itertools.count(1)
        # Tables up to this version were numbered below what proxies hold
        # (etcd went back; renumbered): one of the same content is published
        # again, with its new number.
        self._renumbered_upto = 0

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def publish(self, table: pb.RouteTable) -> Snapshot | None:
        """Publish table unless its content equals the latest (and that one
        was not numbered before a renumbering); return the new snapshot."""
        latest = self._latest
        if latest is not None and table.version < latest.version:
            # Numbered before the store's numbering was raised past a restore
            # (the replica compiled the snapshot's state before it saw etcd's
            # revision go back): every proxy would refuse it as older, an
            # ERROR each; the build after the raise publishes it renumbered.
            log.debug("not publishing version %d below %d", table.version, latest.version)
            return None
        if (
            latest is not None
            and latest.etag == table.etag
            and latest.version > self._renumbered_upto
        ):
            return None
        nonce = f"{self._replica_id}-{next(self._pushes)}"
        payload = pb.RouteUpdate(table=table, nonce=nonce).SerializeToString()
        self._latest = Snapshot(table, nonce, payload, self._clock())
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._latest

    def renumbered(self, upto: int) -> None:
        """Versions up to `upto` were handed out before the store's numbering
        was raised above them (RebasedStore.ensure_above): the next table is
        published even if its content equals the latest's. A 3-member etcd
        restored under a running replica (docs/operations.md) had it compile
        the snapshot's state before it noticed the revision going back; the
        proxy refused that table as older, and the same content, numbered
        again after the raise, was never published: the proxy kept the
        table of before the restore."""
        self._renumbered_upto = max(self._renumbered_upto, upto)

    async def next_after(self, sent: Snapshot | None) -> Snapshot:
        """Return the latest snapshot once it differs from `sent`."""
        while self._latest is None or self._latest is sent:
            await self._changed.wait()
        return self._latest
