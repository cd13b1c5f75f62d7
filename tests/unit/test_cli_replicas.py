"""`pontoctl --control-plane A,B`: the first replica that connects serves the command."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane import cli
from controlplane.cli import main
from controlplane.readiness import STORE
from ponto import grpcconn as conn
from ponto.devenv import free_port
from ponto.pki import Bundle, make_bundle
from ponto.v1 import admin_pb2 as apb


class Replica:
    """An Admin service that answers `get controlplanes` with its own id (and
    nothing else); counts the calls it got."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.calls = 0

    def list_control_planes(
        self, request: apb.ListRequest, context: grpc.ServicerContext
    ) -> apb.ListControlPlanesResponse:
        self.calls += 1
        return apb.ListControlPlanesResponse(
            replicas=[apb.ControlPlaneInfo(id=self.replica_id, address="x")],
            leader=self.replica_id,
        )

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "ponto.v1.Admin",
            {
                "ListControlPlanes": grpc.unary_unary_rpc_method_handler(
                    self.list_control_planes,
                    request_deserializer=apb.ListRequest.FromString,
                    response_serializer=apb.ListControlPlanesResponse.SerializeToString,
                )
            },
        )


def serve(
    replica: Replica, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((replica.handler(),))
    address = f"127.0.0.1:{free_port()}"
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    server.start()
    return server, address


@pytest.fixture
def replicas() -> Iterator[list[tuple[Replica, str]]]:
    started = []
    for name in ("cp-a", "cp-b"):
        replica = Replica(name)
        server, address = serve(replica)
        started.append((server, replica, address))
    yield [(replica, address) for _, replica, address in started]
    for server, _, _ in started:
        server.stop(None)


def get(capsys: pytest.CaptureFixture[str], addresses: str, *flags: str) -> tuple[int, str, str]:
    code = main(["--control-plane", addresses, *flags, "get", "controlplanes", "-o", "json"])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_first_replica_that_answers_serves_every_call(
    capsys: pytest.CaptureFixture[str], replicas: list[tuple[Replica, str]]
) -> None:
    (a, at_a), (b, at_b) = replicas
    code, out, err = get(capsys, f"{at_a}, {at_b}")
    assert (code, err) == (0, "")
    assert '"cp-a"' in out and (a.calls, b.calls) == (1, 0)


def test_a_replica_that_refuses_connections_is_passed_over(
    capsys: pytest.CaptureFixture[str], replicas: list[tuple[Replica, str]]
) -> None:
    (a, _), (b, at_b) = replicas
    down = f"127.0.0.1:{free_port()}"
    code, out, err = get(capsys, f"{down},{at_b}")
    assert code == 0 and '"cp-b"' in out and (a.calls, b.calls) == (0, 1)
    [warning] = err.splitlines()
    assert warning.startswith(f"warning: cannot use the control plane at {down}: UNAVAILABLE")
    assert "Connection refused" in warning and warning.endswith("; trying the next")


def test_when_none_answers_the_last_ones_failure_is_the_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, last = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    code, out, err = get(capsys, f"{first},{last}")
    assert code == 1 and out == ""
    *warnings, error = err.splitlines()
    assert len(warnings) == 1 and first in warnings[0]
    assert error.startswith(f"error: control plane at {last} is unreachable")


def server_credentials(bundle: Bundle) -> grpc.ServerCredentials:
    """A control plane's TLS (no client certificate asked) with `bundle`'s server pair."""
    pair = (
        Path(bundle.path("server.key")).read_bytes(),
        Path(bundle.path("server.crt")).read_bytes(),
    )
    return grpc.ssl_server_credentials([pair])


def test_a_replica_whose_tls_handshake_fails_is_passed_over(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bundle: Bundle = make_bundle(tmp_path / "pki")
    plain, secured = Replica("plain"), Replica("secured")
    plain_server, at_plain = serve(plain)
    secured_server, at_secured = serve(secured, server_credentials(bundle))
    try:
        code, out, err = get(capsys, f"{at_plain},{at_secured}", "--tls-ca", bundle.ca)
    finally:
        plain_server.stop(None)
        secured_server.stop(None)
    assert code == 0 and '"secured"' in out and plain.calls == 0
    assert at_plain in err


@pytest.mark.parametrize("addresses", [",", " , "])
def test_a_list_naming_no_address_is_refused(
    capsys: pytest.CaptureFixture[str], addresses: str
) -> None:
    code, out, err = get(capsys, addresses)
    assert code == 2 and out == ""
    assert (
        err.startswith("error: pontoctl: argument --control-plane:") and "names no HOST:PORT" in err
    )
    assert len(err.splitlines()) == 1


def test_a_replica_whose_certificate_the_ca_did_not_sign_is_skipped_with_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The first address presents a certificate from another CA (a
    misconfigured replica, or someone in between): pontoctl moves on to the
    next replica, and its warning says the certificate failed (review 15: it
    said "no connection within 3 s")."""
    ours: Bundle = make_bundle(tmp_path / "ours")
    theirs: Bundle = make_bundle(tmp_path / "theirs")

    impostor, real = Replica("impostor"), Replica("real")
    impostor_server, at_impostor = serve(impostor, server_credentials(theirs))
    real_server, at_real = serve(real, server_credentials(ours))
    try:
        code, out, err = get(capsys, f"{at_impostor},{at_real}", "--tls-ca", ours.ca)
    finally:
        impostor_server.stop(None)
        real_server.stop(None)
    assert code == 0 and '"real"' in out and impostor.calls == 0
    assert "within 3 s" not in err and any(w in err.lower() for w in ("tls", "certificate")), err


def test_the_probe_of_a_replica_passed_over_carries_no_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The health check that learns why a replica failed goes without the admin
    # token (review 16: the admin channel's interceptor added it).
    seen: list[tuple[tuple[str, str | bytes], ...]] = []

    def check(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(tuple(context.invocation_metadata()))
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
    )
    server.add_generic_rpc_handlers((handler,))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    # The replica failed once, then answers the probe.
    monkeypatch.setattr(cli, "_connects", lambda *_: grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    try:
        options = conn.ClientOptions(token="admin-secret-value")
        chosen, channel, _ = cli.connect([address, "127.0.0.1:1"], options)
        channel.close()
    finally:
        server.stop(None)
    assert chosen == "127.0.0.1:1"
    [metadata] = seen
    assert all(key != "authorization" for key, _ in metadata), metadata


def test_a_replica_cut_off_from_etcd_is_passed_over(
    capsys: pytest.CaptureFixture[str], replicas: list[tuple[Replica, str]]
) -> None:
    """Trial 17: the first replica connected, and answered every call with
    "state store unavailable", though the next one could serve the command."""
    _, (b, at_b) = replicas
    cut_off = Replica("cp-cut")
    server, at_cut = serve(cut_off)
    said = health.HealthServicer()
    said.set(STORE, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(said, server)
    try:
        code, out, err = get(capsys, f"{at_cut},{at_b}")
        assert code == 0 and '"cp-b"' in out and (cut_off.calls, b.calls) == (0, 1)
        assert err.splitlines() == [
            f"warning: cannot use the control plane at {at_cut}: it cannot reach its state "
            "store (etcd); trying the next"
        ]
        # The last one stopped as well: the error says where the cause may be
        # (trial 43: it named only the stopped replica's address).
        stopped = f"127.0.0.1:{free_port()}"
        code, out, err = get(capsys, f"{at_cut},{stopped}")
        assert code == 1 and out == ""
        last = err.splitlines()[-1]
        assert last.startswith(f"error: control plane at {stopped} is unreachable")
        assert last.endswith(
            f"; and the replicas before it ({at_cut}) cannot reach their state store: "
            "is etcd down? [UNAVAILABLE]"
        )
        # Serving again, it serves the command.
        said.set(STORE, health_pb2.HealthCheckResponse.SERVING)
        code, out, err = get(capsys, f"{at_cut},{at_b}")
        assert (code, err) == (0, "") and '"cp-cut"' in out
    finally:
        server.stop(None)
