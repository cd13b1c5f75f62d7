"""Whether what the store says of a proxy's table can be believed (pure).

A proxy's ACK reaches the store through its replica's ACK summary, compared
with that replica's own latest table (versions are each replica's etcd
revision). A replica that hangs (SIGSTOP, a stalled VM) or was killed keeps
its keys until its lease ends, so its proxies read `current` at the table
they had, for seconds, while the fleet moved on (trial: a drain through
another replica). Such a proxy is shown with why its state is not known
instead: the status page's `latest` is false and `pontoctl get proxies`
says `unknown: ...`, so "every row current" still means the fleet converged.
"""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.distribute import Snapshot
from controlplane.model import ProxyRecord
from controlplane.registry import replica_silence

# How long another replica may take to serve the table this one published:
# its watch, debounce, compile, push, its proxies' ACKs and its summary's
# flush, each well under a second.
TABLE_GRACE_S = 5.0


def replica_silent_s(
    p: ProxyRecord,
    replicas: Mapping[str, Mapping[str, object]],
    silences: Mapping[str, float],
) -> float | None:
    """Seconds proxy `p`'s replica has not renewed its lease for, when that
    is longer than it should (replica_silence; `replicas` and `silences` as
    table_state takes them); None while it renews. A replica ends a
    proxy's registration when its route stream ends, so a listed proxy's
    stream is open unless its replica is silent (hung or dead: its keys
    stay until its lease ends). Limits, each bounded: a registration waits
    up to registry.STREAM_GRACE for its stream; one whose delete failed
    (etcd away) stays until the replica's next self-check; a dead peer's
    stream ends at gRPC's keepalive (grpcconn); and a replica restarted
    under the same --id (the chart's pod name) renews while its last
    process's keys wait out that one's lease."""
    # A replica not listed is not judged by it: its proxies' keys are under
    # its lease, so one whose lease ended has none listed either.
    replica = replicas.get(p.control_plane_id)
    seen = silences.get(p.control_plane_id)
    return None if replica is None or seen is None else replica_silence(replica, seen)


def table_state(
    p: ProxyRecord,
    replicas: Mapping[str, Mapping[str, object]],
    latest: Snapshot | None,
    latest_age_s: float,
    silences: Mapping[str, float],
) -> tuple[str, bool]:
    """Why proxy `p`'s table state is not known ("": it is), and whether
    its replica is silent (its route stream may be gone), of one reading of
    that silence (a status row's `unknown` and `stale`). Not known when its
    replica (in `replicas`, id -> its decoded key) has not renewed its
    lease for longer than it should (replica_silent_s, by `silences`: id ->
    seconds since the reader saw its key change, ReplicaBeats.silences), or
    still serves a table whose content differs from and is older than
    `latest`, this replica's, published `latest_age_s` seconds ago, past
    TABLE_GRACE_S."""
    replica_id = p.control_plane_id
    silent = replica_silent_s(p, replicas, silences)
    if silent is not None:
        return f"its replica {replica_id} has not renewed for {silent:.0f} s", True
    if (
        latest is not None
        and p.replica_etag
        and p.replica_etag != latest.etag
        and p.replica_version < latest.version
        and latest_age_s > TABLE_GRACE_S
    ):
        return (
            f"its replica {replica_id} has not taken the latest table "
            f"(published {latest_age_s:.0f} s ago)"
        ), False
    return "", False
