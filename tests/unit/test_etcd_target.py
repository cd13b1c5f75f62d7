"""How etcd endpoints become a gRPC target (IP literals, one DNS name, several)."""

from __future__ import annotations

from controlplane.store.etcd import grpc_target


def test_ip_literals_keep_the_clients_own_target() -> None:
    assert grpc_target(["127.0.0.1:2379", "10.0.0.2:2379"]) is None
    assert grpc_target(["[::1]:2379"]) is None


def test_one_dns_name_is_re_resolved_by_grpc() -> None:
    assert grpc_target(["etcd.ponto.svc:2379"]) == "dns:///etcd.ponto.svc:2379"


def test_several_names_are_resolved_once() -> None:
    assert grpc_target(["localhost:2379", "localhost:2380"]) == "ipv4:127.0.0.1:2379,127.0.0.1:2380"
