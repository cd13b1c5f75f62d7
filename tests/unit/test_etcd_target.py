"""How etcd endpoints become a gRPC target and TLS settings (IP literals, names, flags).

Real look-ups through the system resolver, with names only a private hosts
file knows, are in tests/integration/test_etcd_names.py.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest

from controlplane.settings import parse
from controlplane.store.etcd import (
    EtcdStore,
    EtcdTls,
    grpc_target,
    names_to_resolve,
    resolve_names,
    split_endpoint,
    tls_server_name,
)
from ponto.pki import make_bundle


def test_ipv4_literals_keep_the_clients_own_target() -> None:
    assert grpc_target(["127.0.0.1:2379", "10.0.0.2:2379"]) is None
    assert grpc_target(["localhost:2379"]) is None  # etcd3aio makes it 127.0.0.1
    assert names_to_resolve(["127.0.0.1:2379", "localhost:2380"]) == ()


def test_ipv6_literals_become_an_ipv6_target() -> None:
    # etcd3aio would write `ipv4:[::1]:2379`, which gRPC refuses as a target.
    assert grpc_target(["[::1]:2379"]) == "ipv6:[::1]:2379"
    assert grpc_target(["[fd00::1]:2379", "[fd00::2]:2380"]) == (
        "ipv6:[fd00::1]:2379,[fd00::2]:2380"
    )
    assert names_to_resolve(["[fd00::1]:2379", "[fd00::2]:2379"]) == ()


def test_ipv4_beside_ipv6_is_written_ipv4_mapped() -> None:
    """gRPC's ipv4: and ipv6: schemes each take one family only."""
    assert grpc_target(["10.0.0.1:2379", "[fd00::2]:2379", "localhost:2380"]) == (
        "ipv6:[::ffff:10.0.0.1]:2379,[fd00::2]:2379,[::ffff:127.0.0.1]:2380"
    )
    # Names looked up beside an IPv6 literal: their IPv4 addresses, mapped.
    endpoints = ["etcd-0.etcd:2379", "[fd00::2]:2379"]
    assert names_to_resolve(endpoints) == ("etcd-0.etcd",)
    assert grpc_target(endpoints, {"etcd-0.etcd": ["10.0.0.1"]}) == (
        "ipv6:[::ffff:10.0.0.1]:2379,[fd00::2]:2379"
    )
    assert grpc_target(endpoints, {}) == "ipv6:[fd00::2]:2379"


@pytest.mark.parametrize(
    ("endpoint", "split"),
    [
        ("etcd:2379", ("etcd", 2379)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("[::1]:2379", ("::1", 2379)),
        ("[fd00::1]:65535", ("fd00::1", 65535)),
        ("[::ffff:10.0.0.1]:2379", ("::ffff:10.0.0.1", 2379)),
    ],
)
def test_endpoints_split_into_host_and_port(endpoint: str, split: tuple[str, int]) -> None:
    assert split_endpoint(endpoint) == split


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("::1:2379", "IPv6 address without brackets"),
        ("fd00::1", "IPv6 address without brackets"),
        ("[fd00::1]", "is not [http[s]://]HOST:PORT"),
        ("[fd00::1]:", "is not [http[s]://]HOST:PORT"),
        ("[fd00::1]:65536", "is not [http[s]://]HOST:PORT"),
        ("[10.0.0.1]:2379", "brackets around something other than an IPv6 address"),
        ("[etcd]:2379", "brackets around something other than an IPv6 address"),
        ("[]:2379", "brackets around something other than an IPv6 address"),
        ("[fd00::1:2379", "brackets around something other than an IPv6 address"),
        ("[fe80::1%eth0]:2379", "IPv6 zone"),
    ],
)
def test_malformed_endpoints_say_what_is_wrong(endpoint: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        split_endpoint(endpoint)


def test_one_dns_name_is_left_to_grpc() -> None:
    assert names_to_resolve(["etcd.ponto.svc:2379"]) == ()
    assert grpc_target(["etcd.ponto.svc:2379"]) == "dns:///etcd.ponto.svc:2379"


def test_several_names_become_the_addresses_they_resolved_to() -> None:
    endpoints = ["etcd-0.etcd:2379", "etcd-1.etcd:2379", "10.0.0.9:2379", "localhost:2380"]
    assert names_to_resolve(endpoints) == ("etcd-0.etcd", "etcd-1.etcd")
    found = {"etcd-0.etcd": ["10.0.0.1"], "etcd-1.etcd": ["10.0.0.2", "10.0.0.1"]}
    assert grpc_target(endpoints, found) == (
        "ipv4:10.0.0.1:2379,10.0.0.2:2379,10.0.0.9:2379,127.0.0.1:2380"
    )


def test_names_that_do_not_resolve_are_left_out_and_none_falls_back_to_dns() -> None:
    endpoints = ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]
    assert grpc_target(endpoints, {"etcd-1.etcd": ["10.0.0.2"]}) == "ipv4:10.0.0.2:2379"
    assert grpc_target(endpoints, {}) == "dns:///etcd-0.etcd:2379"


def test_tls_checks_the_first_endpoints_host() -> None:
    assert tls_server_name(["etcd-0.etcd:2379", "etcd-1.etcd:2379"]) == "etcd-0.etcd"
    assert tls_server_name(["[::1]:2379"]) == "::1"


def test_https_without_a_ca_is_refused() -> None:
    with pytest.raises(ValueError, match="--etcd-ca"):
        EtcdStore(["https://etcd:2379"])
    with pytest.raises(ValueError, match="key"):
        EtcdTls(b"ca", cert_chain=b"cert")
    assert "secret" not in repr(EtcdTls(b"ca", b"cert", b"secret"))


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    """A CA and a client certificate and key it signed: the files are checked
    at start (trial 23), so no placeholder passes."""
    bundle = make_bundle(tmp_path / "pki")
    return {"ca": bundle.ca, "cert": bundle.path("admin.crt"), "key": bundle.path("admin.key")}


def read(path: str) -> bytes:
    return Path(path).read_bytes()


def test_flags_give_tls_with_a_client_certificate(pem: dict[str, str]) -> None:
    s = parse(
        ["--etcd", "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379", "--etcd-ca", pem["ca"],
         "--etcd-cert", pem["cert"], "--etcd-key", pem["key"]]
    )  # fmt: skip
    assert s.etcd == ("https://etcd-0.etcd:2379", "https://etcd-1.etcd:2379")
    assert s.etcd_tls == EtcdTls(read(pem["ca"]), read(pem["cert"]), read(pem["key"]))
    bare = parse(["--etcd", "etcd:2379", "--etcd-ca", pem["ca"]])
    assert bare.etcd_tls == EtcdTls(read(pem["ca"]))
    assert parse(["--etcd", "http://etcd:2379"]).etcd_tls is None


def test_flags_take_bracketed_ipv6_literals(pem: dict[str, str]) -> None:
    endpoints = ("http://[::1]:2379", "[fd00::2]:2379", "10.0.0.3:2379")
    assert parse(["--etcd", ",".join(endpoints)]).etcd == endpoints
    over_tls = parse(["--etcd", "https://[fd00::1]:2379", "--etcd-ca", pem["ca"]])
    assert over_tls.etcd_tls == EtcdTls(read(pem["ca"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--etcd", "https://etcd:2379"], "need --etcd-ca"),
        (["--etcd", "http://etcd:2379", "--etcd-ca", "{ca}"], "write https://"),
        (["--etcd", "http://a:2379,https://b:2379", "--etcd-ca", "{ca}"], "mixes"),
        (["--etcd", "unix://etcd.sock:1"], "must be http://"),
        (["--etcd", "http://etcd"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "etcd:x"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "etcd:99999"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "etcd:0"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "etcd:\u00b2"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "http://fd00::1:2379"], "IPv6 address without brackets; write [ADDRESS]"),
        (["--etcd", "[fd00::1]"], "is not [http[s]://]HOST:PORT"),
        (["--etcd", "e:2379,[10.0.0.1]:2379"], "brackets around something other than an IPv6"),
        (["--etcd", "https://e:2379", "--etcd-ca", "{ca}", "--etcd-cert", "{cert}"], "both"),
        (["--etcd", "e:2379", "--etcd-cert", "{cert}", "--etcd-key", "{key}"], "needs --etcd-ca"),
        (["--etcd", "https://e:2379", "--etcd-ca", "/nonexistent/ca.pem"], "cannot read"),
    ],
)
def test_flags_that_disagree_are_refused(
    pem: dict[str, str], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        parse([a.format(**pem) for a in args])
    assert message in capsys.readouterr().err


async def test_a_name_resolves_to_its_ipv4_addresses_or_else_its_ipv6_ones() -> None:
    records = {
        "dual": [(socket.AF_INET6, "fd00::1"), (socket.AF_INET, "10.0.0.1")],
        "v6only": [(socket.AF_INET6, "fd00::2"), (socket.AF_INET6, "fe80::2%eth0")],
        "v4only": [(socket.AF_INET, "10.0.0.3"), (socket.AF_INET, "10.0.0.3")],
    }

    async def getaddrinfo(name: str, port: object, **_: object) -> list[tuple[Any, ...]]:
        if name not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (family, socket.SOCK_STREAM, 6, "", (address, 0)) for family, address in records[name]
        ]

    found = await resolve_names(["dual", "v6only", "v4only", "nowhere"], getaddrinfo)
    assert found == {"dual": ("10.0.0.1",), "v6only": ("fd00::2",), "v4only": ("10.0.0.3",)}
    # An IPv6-only name's addresses make an ipv6: target.
    assert grpc_target(["v6only:2379", "v4only:2379"], found) == (
        "ipv6:[fd00::2]:2379,[::ffff:10.0.0.3]:2379"
    )
