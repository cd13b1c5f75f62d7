"""When each replica last renewed its lease, as this process saw it.

A replica rewrites its key (/ponto/replicas/ID) at every beat of its lease's
keepalive, so the key's mod_revision changes every beat while it renews.
Freshness is judged by when the reader saw that revision change, on the
reader's own monotonic clock: the writer's wall clock (`renewed_at`) is not
compared with the reader's (a writer behind by seconds had every proxy of it
`unknown` for good; one ahead hid a hung replica).

Limit: a replica already silent when this process first read its key is
judged from that read (its silence is not known from before it), so it is
flagged that much later; every replica reads the keys every beat
(ControlPlane) to keep this short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


class ReplicaBeats:
    """Replica id -> (its key's last mod_revision seen, when it was first
    seen at it). Fed by every listing of the replicas' keys (Catalog); not
    thread-safe, used from one event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, revisions: Mapping[str, int]) -> None:
        """A listing of every replica key: replica id -> its mod_revision.
        Replicas not in it are forgotten (their key went with their lease)."""
        now = self._clock()
        seen = {}
        for replica, revision in revisions.items():
            last = self._seen.get(replica)
            seen[replica] = last if last is not None and last[0] == revision else (revision, now)
        self._seen = seen

    def silences(self) -> dict[str, float]:
        """Replica id -> seconds since its key was seen to change."""
        now = self._clock()
        return {replica: now - at for replica, (_, at) in self._seen.items()}
