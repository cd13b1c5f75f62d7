"""EtcdStore and the control plane reach a real etcd through IPv6 literals.

One etcd listens on [::1] and 127.0.0.1 (the same port). Cases: an
`[::1]:PORT` endpoint alone (an `ipv6:` target), IPv4 beside IPv6 (IPv4
written IPv4-mapped in that target) with only one of the two answering, so
each family is shown reachable through the mixed target, TLS to an etcd whose
certificate lists ::1, and a control plane started with `--etcd
http://[::1]:PORT` that pontoctl writes through. Skipped only where this
machine has no IPv6 loopback.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.cli import main as pontoctl
from controlplane.store.etcd import EtcdStore, EtcdTls
from ponto.devenv import Etcd, EtcdServerTls, free_port, python_entry, spawn, start_etcd
from ponto.pki import Bundle, make_bundle
from tests.integration.test_etcd_names import roundtrip as names_roundtrip

pytestmark = pytest.mark.integration

P = "/ipv6-test/"


def ipv6_loopback_problem() -> str:
    """Why ::1 cannot be listened on here, or "" when it can."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        return f"this machine has no IPv6 loopback (binding ::1 failed: {exc})"
    return ""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    problem = ipv6_loopback_problem()
    if problem:
        pytest.skip(problem)
    path = Path(tempfile.mkdtemp(prefix="ponto-etcd-ipv6-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # data dirs are ~120 MB each


@pytest.fixture(scope="module")
def etcd(workdir: Path) -> Iterator[Etcd]:
    """Plaintext etcd on [::1] first (advertised) and 127.0.0.1."""
    server = start_etcd(workdir, name="v6", hosts=("::1", "127.0.0.1"))
    try:
        yield server
    finally:
        server.stop()


@dataclass
class TlsV6:
    etcd: Etcd
    pki: Bundle


@pytest.fixture(scope="module")
def tls_etcd(workdir: Path) -> Iterator[TlsV6]:
    """etcd over TLS on [::1] only; its certificate lists the IP address ::1."""
    pki = make_bundle(workdir / "pki", server_names=("::1",))
    tls = EtcdServerTls(Path(pki.path("server.crt")), Path(pki.path("server.key")))
    server = start_etcd(workdir, name="v6-tls", hosts=("::1",), tls=tls)
    try:
        yield TlsV6(server, pki)
    finally:
        server.stop()


async def roundtrip(store: EtcdStore) -> None:
    """Connect, then test_etcd_names' round trip of every kind of call."""
    await store.connect()
    try:
        await names_roundtrip(store, P)
    finally:
        await store.close()


async def test_store_reaches_etcd_on_ipv6_loopback(etcd: Etcd) -> None:
    port = etcd.client_port
    store = EtcdStore([f"http://[::1]:{port}"], timeout=2.0)
    assert store.target == f"ipv6:[::1]:{port}"
    await roundtrip(store)


@pytest.mark.parametrize("answering", ["ipv4", "ipv6"])
async def test_a_mixed_target_reaches_either_family(etcd: Etcd, answering: str) -> None:
    """One endpoint per family, one of them where nothing listens: the calls
    reach etcd through the other, whichever family it is."""
    live, dead = etcd.client_port, free_port()
    v4, v6 = (live, dead) if answering == "ipv4" else (dead, live)
    store = EtcdStore([f"127.0.0.1:{v4}", f"[::1]:{v6}"], timeout=3.0)
    assert store.target == f"ipv6:[::ffff:127.0.0.1]:{v4},[::1]:{v6}"
    await roundtrip(store)


async def test_store_reaches_etcd_on_ipv6_over_tls(tls_etcd: TlsV6) -> None:
    """The certificate is checked for the endpoint's host, the IP address ::1."""
    ca = Path(tls_etcd.pki.ca).read_bytes()
    store = EtcdStore([f"https://[::1]:{tls_etcd.etcd.client_port}"], timeout=2.0, tls=EtcdTls(ca))
    await roundtrip(store)


def test_control_plane_runs_on_etcd_at_an_ipv6_literal(
    etcd: Etcd, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = workdir / "control.addr"
    argv = [*python_entry("controlplane"), "--etcd", f"http://[::1]:{etcd.client_port}",
            "--listen", "127.0.0.1:0", "--id", "ipv6", "--ready-file", str(ready)]  # fmt: skip
    control = spawn("control", argv, workdir, ready_file=ready)
    flags = ["--control-plane", control.address]
    try:
        assert pontoctl([*flags, "region", "add", "v6", "--lat", "1", "--lon", "2"]) == 0, (
            capsys.readouterr(),
            control.log_tail(),
        )
        capsys.readouterr()
        assert pontoctl([*flags, "get", "regions", "-o", "json"]) == 0
        assert [r["name"] for r in json.loads(capsys.readouterr().out)["regions"]] == ["v6"]
        assert pontoctl([*flags, "region", "delete", "v6"]) == 0
    finally:
        control.stop()
    assert f"etcd at ipv6:[::1]:{etcd.client_port}" in control.log_path.read_text()
