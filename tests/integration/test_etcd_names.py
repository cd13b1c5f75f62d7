"""EtcdStore reaches a real etcd through host names, in plaintext and over mutual TLS.

The names (tests/hostsns.py) exist only in a private /etc/hosts of a
subprocess, which runs `main` below: the system resolver finds them, nothing
else does, and `localhost` plays no part. Cases: one name (a `dns:` target
gRPC resolves), several names (looked up by EtcdStore; with TLS the
certificate is checked for the first), names that move while the store runs,
and TLS refusals (a name the certificate does not list, no client
certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controlplane.store import StoreUnavailable
from controlplane.store.etcd import EtcdStore, EtcdTls
from tests.conftest import EtcdEndpoint, TlsEtcd
from tests.hostsns import NAME_A, NAME_B, PrivateHosts

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
P = "/names-test/"
NOWHERE = "127.0.0.3"  # loopback where nothing listens


# ---------------------------------------------------------------- in the namespace


async def exercise(params: dict[str, Any]) -> str:
    """Run in the subprocess: one store, put/get/list/watch; return its target."""
    tls = None
    if params.get("ca"):
        tls = EtcdTls(
            Path(params["ca"]).read_bytes(),
            Path(params["cert"]).read_bytes() if params.get("cert") else None,
            Path(params["key"]).read_bytes() if params.get("key") else None,
        )
    store = EtcdStore(params["etcd"], timeout=2.0, tls=tls)
    await store.connect()
    try:
        if params.get("refused"):
            with contextlib.suppress(StoreUnavailable):
                await store.get(P + "k")
                raise AssertionError("etcd answered; it should not have")
            return store.target
        if "move_to" in params:
            await follow_move(store, Path(params["hosts"]), params["move_to"])
        await roundtrip(store)
        return store.target
    finally:
        await store.close()


async def follow_move(store: EtcdStore, hosts: Path, move_to: dict[str, str]) -> None:
    """Names point nowhere; a watch waits; the names move to etcd: calls and the
    watch (opened on the channel that is replaced) both reach etcd."""
    before = store.target
    early = store.watch(P + "early/", 0)
    woken = asyncio.ensure_future(anext(early))
    try:
        with contextlib.suppress(StoreUnavailable):
            await store.get(P + "k")
            raise AssertionError("etcd answered before the names moved to it")
        PrivateHosts(hosts, move_to)
        deadline = time.monotonic() + 30
        while True:
            try:
                await store.get(P + "k")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "names moved, store never followed"
                await asyncio.sleep(0.2)
        assert store.target != before
        # The watch watches "from now on" once it is connected again: write until it sees one.
        while not woken.done():
            assert time.monotonic() < deadline, "the watch never followed the move"
            await store.put(P + "early/k", b"1")
            await asyncio.wait([woken], timeout=0.5)
        woken.result()
    finally:
        woken.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await woken
        await early.aclose()  # type: ignore[attr-defined]


async def roundtrip(store: EtcdStore, prefix: str = P) -> None:
    """put, get, list, a watch that sees the put, delete: every kind of call,
    under `prefix`."""
    start = await store.put(prefix + "before", b"0")
    revisions = store.watch(prefix + "w/", start)
    try:
        written = await store.put(prefix + "w/k", b"v")
        kv = await store.get(prefix + "w/k")
        assert kv is not None and kv.value == b"v"
        listing = await store.list(prefix + "w/")
        assert [i.key for i in listing.items] == [prefix + "w/k"]
        seen = await asyncio.wait_for(anext(revisions), 10)
        assert seen >= written
        assert await store.delete(prefix + "w/k")
    finally:
        await revisions.aclose()  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    print(asyncio.run(exercise(json.loads(argv[0]))))
    return 0


# ---------------------------------------------------------------- in the test


def run_with_names(hosts: PrivateHosts, names: dict[str, str], **params: Any) -> str:
    """Run `main` with these names in /etc/hosts; return the store's target."""
    hosts.write(names)
    code = (
        "import sys; from tests.integration.test_etcd_names import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        hosts.argv([sys.executable, "-c", code, json.dumps({**params, "hosts": str(hosts.path)})]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_names_resolve_only_in_the_namespace() -> None:
    for name in (NAME_A, NAME_B):
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo(name, 2379)


@pytest.fixture
def etcd_ip(request: pytest.FixtureRequest) -> tuple[str, int]:
    """IPv4 address and port of the session etcd."""
    etcd: EtcdEndpoint = request.getfixturevalue("etcd_server")
    host, _, port = etcd.endpoint.rpartition(":")
    return socket.gethostbyname(host), int(port)


def test_one_name_is_resolved_by_grpc(
    private_hosts: PrivateHosts, etcd_ip: tuple[str, int]
) -> None:
    ip, port = etcd_ip
    target = run_with_names(private_hosts, {NAME_A: ip}, etcd=[f"http://{NAME_A}:{port}"])
    assert target == f"dns:///{NAME_A}:{port}"


def test_several_names_are_resolved_by_the_store(
    private_hosts: PrivateHosts, etcd_ip: tuple[str, int]
) -> None:
    ip, port = etcd_ip
    etcd = [f"http://{NAME_A}:{port}", f"http://{NAME_B}:{port}"]
    target = run_with_names(private_hosts, {NAME_A: ip, NAME_B: ip}, etcd=etcd)
    assert target == f"ipv4:{ip}:{port}"


def test_names_that_move_are_followed(
    private_hosts: PrivateHosts, etcd_ip: tuple[str, int]
) -> None:
    """Both names point nowhere at first; once they move to etcd, the store follows."""
    ip, port = etcd_ip
    etcd = [f"http://{NAME_A}:{port}", f"http://{NAME_B}:{port}"]
    nowhere = {NAME_A: NOWHERE, NAME_B: NOWHERE}
    target = run_with_names(private_hosts, nowhere, etcd=etcd, move_to={NAME_A: ip, NAME_B: ip})
    assert target == f"ipv4:{ip}:{port}"


# ---------------------------------------------------------------- TLS


def tls_params(tls_etcd: TlsEtcd, *hosts: str, client_cert: bool = True) -> dict[str, Any]:
    cert, key = tls_etcd.client_cert if client_cert else ("", "")
    return {"etcd": tls_etcd.urls(*hosts), "ca": tls_etcd.pki.ca, "cert": cert, "key": key}


def test_tls_with_one_name(private_hosts: PrivateHosts, tls_etcd: TlsEtcd) -> None:
    target = run_with_names(private_hosts, {NAME_A: "127.0.0.1"}, **tls_params(tls_etcd, NAME_A))
    assert target.startswith("dns:///")


def test_tls_with_several_names_checks_the_first(
    private_hosts: PrivateHosts, tls_etcd: TlsEtcd
) -> None:
    port = tls_etcd.etcd.client_port
    names = {NAME_A: "127.0.0.1", NAME_B: "127.0.0.2"}
    target = run_with_names(private_hosts, names, **tls_params(tls_etcd, NAME_A, NAME_B))
    assert target == f"ipv4:127.0.0.1:{port},127.0.0.2:{port}"


@pytest.mark.parametrize(
    ("name", "client_cert"),
    [("etcd-c.ponto.test", True), (NAME_A, False)],
    ids=["name-not-in-certificate", "no-client-certificate"],
)
def test_tls_refusals(
    private_hosts: PrivateHosts, tls_etcd: TlsEtcd, name: str, client_cert: bool
) -> None:
    params = tls_params(tls_etcd, name, client_cert=client_cert)
    run_with_names(private_hosts, {name: "127.0.0.1"}, refused=True, **params)
