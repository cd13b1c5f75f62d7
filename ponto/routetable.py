"""Rules of the route table that both planes share (owned by neither).

The control plane stamps each table with content_etag(); the proxy recomputes
it on receipt, so a table damaged anywhere between compile and apply is
refused instead of served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ponto.v1 import routing_pb2 as pb

# The tenant of every request in an open fleet (no keys, no JWT issuers), and of
# rules a table gives under that name: it needs no tenant record.
OPEN_TENANT = "default"


def content_etag(table: pb.RouteTable) -> str:
    """SHA-256 of the table without version and etag, serialised deterministically."""
    bare = pb.RouteTable()
    bare.CopyFrom(table)
    bare.version = 0
    bare.etag = ""
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()


def counts_for_spill(origin: pb.Origin) -> bool:
    """Whether an origin's load and capacity count for its region's, which
    spilling reads: healthy, not drained, with a capacity, and with load
    figures its server exports (not `inflight_unknown`: trial 66, a
    llama.cpp origin's unread 0 held its busy region back from spilling)."""
    return (
        origin.healthy
        and not origin.drained
        and origin.capacity > 0
        and not origin.inflight_unknown
    )


def region_load(origins: Iterable[tuple[int, float | None]]) -> float | None:
    """A region's load (0..1) from (capacity, requests running and waiting)
    of each of its origins that `counts_for_spill`, requests None for one the
    leader's latest loads lack: such an origin counts for neither the load
    nor the capacity (its peers' load stands for the region's), and each
    counts for its own capacity at most (trial 33: one replica of four with a
    queue spilled the whole region abroad, and every session lost its KV
    cache; placement inside the region moves work off it). None when no
    capacity counts: nothing says the region is full."""
    held = capacity = 0.0
    for cap, requests in origins:
        if requests is not None:
            held += min(requests, cap)
            capacity += cap
    return held / capacity if capacity else None


def is_hot(load: float | None, threshold: float) -> bool:
    """Whether a region of `load` (region_load) is past its table's spill
    `threshold` (0: it never spills; the control plane writes its default
    in every table): its new requests go to other regions first."""
    return threshold > 0 and load is not None and load >= threshold
