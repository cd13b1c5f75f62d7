"""Rules of the route table that both planes share (owned by neither).

The control plane stamps each table with content_etag(); the proxy recomputes
it on receipt, so a table damaged anywhere between compile and apply is
refused instead of served.
"""

from __future__ import annotations

import hashlib

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
