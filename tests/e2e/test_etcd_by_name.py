"""`ponto-control --etcd http://NAME:PORT`: a replica that finds etcd by host name.

The replica runs with a private /etc/hosts (tests/hostsns.py), the only place
the name resolves; pontoctl talks to it from outside over loopback. Once
plaintext against the session etcd, once over mutual TLS with --etcd-ca,
--etcd-cert and --etcd-key against an etcd whose certificate lists the name.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from controlplane.cli import main as pontoctl
from ponto.devenv import Managed, python_entry, spawn
from tests.conftest import EtcdEndpoint, TlsEtcd
from tests.hostsns import NAME_A, PrivateHosts

pytestmark = pytest.mark.e2e


def start_control(workdir: Path, hosts: PrivateHosts, etcd_flags: list[str]) -> Managed:
    ready = workdir / "control.addr"
    argv = [*python_entry("controlplane"), *etcd_flags, "--listen", "127.0.0.1:0",
            "--id", "by-name", "--ready-file", str(ready)]  # fmt: skip
    return spawn("control", hosts.argv(argv), workdir, ready_file=ready)


def add_and_list_a_region(
    control: Managed, region: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--control-plane", control.address]
    try:
        assert pontoctl([*flags, "region", "add", region, "--lat", "60", "--lon", "10"]) == 0, (
            capsys.readouterr(),
            control.log_tail(),
        )
        capsys.readouterr()
        assert pontoctl([*flags, "get", "regions", "-o", "json"]) == 0
        regions = json.loads(capsys.readouterr().out)["regions"]
        assert region in [r["name"] for r in regions]
        assert pontoctl([*flags, "region", "delete", region]) == 0
    finally:
        control.stop()


def test_control_plane_reaches_etcd_by_name(
    private_hosts: PrivateHosts,
    etcd_server: EtcdEndpoint,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    host, _, port = etcd_server.endpoint.rpartition(":")
    private_hosts.write({NAME_A: socket.gethostbyname(host)})
    control = start_control(tmp_path, private_hosts, ["--etcd", f"http://{NAME_A}:{port}"])
    add_and_list_a_region(control, "by-name", capsys)


def test_control_plane_reaches_etcd_by_name_over_mutual_tls(
    private_hosts: PrivateHosts,
    tls_etcd: TlsEtcd,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    private_hosts.write({NAME_A: "127.0.0.1"})
    cert, key = tls_etcd.client_cert
    flags = ["--etcd", *tls_etcd.urls(NAME_A), "--etcd-ca", tls_etcd.pki.ca,
             "--etcd-cert", cert, "--etcd-key", key]  # fmt: skip
    control = start_control(tmp_path, private_hosts, flags)
    add_and_list_a_region(control, "by-name-tls", capsys)
