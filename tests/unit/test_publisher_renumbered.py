"""A table of the content already published is published again once the
store's numbering was raised above it (etcd went back): its proxies refused
the first as older than what they held (a 3-member etcd restored under a
running replica, docs/operations.md)."""

from __future__ import annotations

from controlplane.distribute import Publisher
from ponto.v1 import routing_pb2 as pb


def test_the_same_content_is_published_again_after_a_renumbering() -> None:
    publisher = Publisher("cp-1", clock=lambda: 0.0)
    assert publisher.publish(pb.RouteTable(version=5, etag="kept")) is not None
    # Compiled again, unchanged: not pushed again.
    assert publisher.publish(pb.RouteTable(version=6, etag="kept")) is None
    publisher.renumbered(11)  # a proxy held 11: numbering raised above it
    again = publisher.publish(pb.RouteTable(version=1012, etag="kept"))
    assert again is not None and again.version == 1012
    # Numbered above the renumbering: the usual rule again.
    assert publisher.publish(pb.RouteTable(version=1013, etag="kept")) is None


def test_a_table_numbered_below_the_latest_is_not_published() -> None:
    """Compiled from a restored etcd before the replica saw its revision go
    back, a table came out numbered below the one the proxies held: each
    refused it (an ERROR, a NACK) until the table after the raise came."""
    publisher = Publisher("cp-1", clock=lambda: 0.0)
    assert publisher.publish(pb.RouteTable(version=50, etag="before")) is not None
    assert publisher.publish(pb.RouteTable(version=7, etag="snapshot")) is None
    latest = publisher.latest
    assert latest is not None and latest.version == 50
    publisher.renumbered(50)
    again = publisher.publish(pb.RouteTable(version=1008, etag="snapshot"))
    assert again is not None and again.version == 1008
