"""The route stream's keepalive against the registrations' lease: a hung
replica's proxies must leave it before its lease lapses (trial 34)."""

from __future__ import annotations

from controlplane.settings import parse
from ponto.grpcconn import (
    KEEPALIVE_OPTIONS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    MIN_PING_INTERVAL_MS,
)


def test_a_hung_replicas_proxies_leave_it_before_its_lease_lapses() -> None:
    # The longest a proxy takes to see its replica hung: a ping just answered
    # before the hang, the next one sent KEEPALIVE_TIME_MS later, and left
    # unanswered KEEPALIVE_TIMEOUT_MS. Its registration goes with the lease.
    noticed_ms = KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS
    lease_ms = parse([]).lease_ttl * 1000
    assert noticed_ms < lease_ms, (noticed_ms, lease_ms)


def test_the_server_lets_clients_ping_as_often_as_they_do() -> None:
    # A ping sooner than the server allows is a strike; two, and gRPC ends the
    # connection with GOAWAY too_many_pings.
    assert MIN_PING_INTERVAL_MS < KEEPALIVE_TIME_MS
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    # gRPC times a ping out by this one, not keepalive_timeout_ms (trial 17).
    assert options["grpc.http2.ping_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
