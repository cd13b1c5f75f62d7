"""Readiness that tells the truth, with a real replica and a real etcd.

A replica pointed at something that is not etcd is alive but not ready, on the
main port and on the kubelet's --health-listen port alike; once a real etcd
answers there it becomes ready; when etcd dies it stays ready (it serves the
table it has) and says the store is away on "ponto.store".
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.api.routing import SERVICE as ROUTING_SERVICE
from controlplane.readiness import LIVENESS, READINESS, STORE
from ponto.devenv import Managed, free_port, python_entry, spawn, start_etcd

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class NotEtcd:
    """A TCP port that answers every connection as a web server would, then hangs up."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_server(("127.0.0.1", port))
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.connections += 1
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self._sock.close()
        self._thread.join(5)


class Health:
    """grpc.health.v1 checks on a replica's main port and its --health-listen port."""

    def __init__(self, *addresses: str) -> None:
        self._channels = [grpc.insecure_channel(a) for a in addresses]

    def status(self, service: str) -> set[int]:
        stubs = (health_pb2_grpc.HealthStub(c) for c in self._channels)
        return {
            s.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status for s in stubs
        }

    def wait(self, service: str, status: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.status(service)) != {status}:
            assert time.monotonic() < deadline, f"{service!r} is {now}, not {status}"
            time.sleep(0.05)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def wait_for_log(control: Managed, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in control.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{control.log_tail()}"
        time.sleep(0.05)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Removed afterwards: an etcd data dir is ~120 MB."""
    path = Path(tempfile.mkdtemp(prefix="ponto-health-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_readiness_needs_a_table_from_etcd_and_survives_etcd(workdir: Path) -> None:
    etcd_port, health_port = free_port(), free_port()
    not_etcd = NotEtcd(etcd_port)
    ready = workdir / "control.addr"
    # Its calls to etcd time out in 1 s rather than 3 s: each phase below
    # that waits for the store to be found away waits one of them (3.6 s and
    # 4.0 s of the test's 10 at 3 s). etcd on loopback answers in milliseconds.
    control = spawn(
        "control",
        [*python_entry("controlplane"), "--etcd", f"http://127.0.0.1:{etcd_port}",
         "--listen", "127.0.0.1:0", "--health-listen", f"127.0.0.1:{health_port}",
         "--id", "truthful", "--ready-file", str(ready), "--etcd-timeout-ms", "1000"],
        workdir,
        ready_file=ready,
    )  # fmt: skip
    health = Health(control.address, f"127.0.0.1:{health_port}")
    etcd = None
    try:
        # It tried the store, and failed, and is still not ready.
        wait_for_log(control, "cannot build the route table yet")
        assert not_etcd.connections > 0
        assert health.status(READINESS) == {NOT_SERVING}
        assert health.status(ROUTING_SERVICE) == {NOT_SERVING}
        assert health.status(STORE) == {NOT_SERVING}
        assert health.status(LIVENESS) == {SERVING}

        not_etcd.close()
        etcd = start_etcd(workdir, client_port=etcd_port)
        health.wait(READINESS, SERVING)
        health.wait(STORE, SERVING)
        assert health.status(ROUTING_SERVICE) == {SERVING}

        etcd.kill()
        health.wait(STORE, NOT_SERVING)
        wait_for_log(control, "state store unreachable")
        assert health.status(READINESS) == {SERVING}  # it still has a table to serve
        assert health.status(LIVENESS) == {SERVING}
    finally:
        health.close()
        control.stop()
        not_etcd.close()
        if etcd is not None:
            etcd.stop()
