"""A new operator's mutual-TLS mistakes, each said in one line naming what to fix:
a key not its certificate's, a CA file that is no PEM, a certificate out of its
dates or for the other end of the connection (ponto-control, ponto-proxy and
pontoctl refuse at start, exit code 2), a
server certificate out of its dates (pontoctl and the proxy say so rather than
blame the CA), and the proxy's link failures with the advice pontoctl gives,
logged once per cause."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from controlplane.api.guard import ROUTING_PREFIX, TokenGuard
from controlplane.cli import main as pontoctl
from controlplane.settings import parse as control_parse
from dataplane.settings import parse as proxy_parse
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto import linkadvice
from ponto.devenv import free_port
from ponto.grpcconn import ClientOptions, ServerSecurity
from ponto.pki import Bundle, add_client, add_server, make_bundle
from ponto.v1 import routing_pb2 as pb

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)
EXPIRED = (NOW - 3 * DAY, NOW - DAY)
FUTURE = (NOW + DAY, NOW + 3 * DAY)


@pytest.fixture(scope="module")
def b(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    bundle = make_bundle(tmp_path_factory.mktemp("pki"))
    add_client(bundle, "old-admin", role="admin", valid=EXPIRED)
    add_client(bundle, "future-admin", role="admin", valid=FUTURE)
    add_client(bundle, "old-proxy", role="proxy", valid=EXPIRED)
    add_server(bundle, "old-server", valid=EXPIRED)
    add_server(bundle, "future-server", valid=FUTURE)
    (bundle.directory / "not-pem.crt").write_text("hello\n")
    encrypted = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (bundle.directory / "encrypted.key").write_bytes(encrypted)
    return bundle


def proxy_args(b: Bundle, cert: str, key: str) -> list[str]:
    return [
        "--control-plane", "127.0.0.1:1", "--region", "east", "--tls-ca", b.ca,
        "--tls-cert", b.path(cert), "--tls-key", b.path(key),
    ]  # fmt: skip


def control_args(b: Bundle, cert: str, key: str, client_ca: str = "") -> list[str]:
    return [
        "--tls-cert", b.path(cert), "--tls-key", b.path(key),
        "--tls-client-ca", client_ca or b.ca,
    ]  # fmt: skip


def refused_at_start(capsys: pytest.CaptureFixture[str], parse: object, argv: list[str]) -> str:
    """parse(argv)'s one-line refusal (exit code 2), without the usage lines."""
    with pytest.raises(SystemExit) as exited:
        parse(argv)  # type: ignore[operator]
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.count("error:") == 1
    return line


# ---------------------------------------------------------------- M1: a key not the certificate's


def test_control_plane_with_a_key_not_its_certificates_says_so(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused_at_start(capsys, control_parse, control_args(b, "server.crt", "admin.key"))
    assert line == (
        f"ponto-control: error: the TLS key {b.path('admin.key')} is not the key of "
        f"certificate {b.path('server.crt')}"
    )


@pytest.mark.parametrize(
    ("cert", "key", "client_ca", "says"),
    [
        ("server.crt", "server.key", "not-pem.crt", "cannot read TLS client CA {}: it holds no "
                                                    "PEM certificate"),
        ("not-pem.crt", "server.key", "", "cannot read TLS certificate {}: it holds no PEM"),
        ("server.crt", "not-pem.crt", "", "cannot read TLS key {}: it holds no PEM private key"),
        ("server.crt", "encrypted.key", "", "cannot read TLS key {}: it is encrypted"),
    ],
)  # fmt: skip
def test_control_plane_tls_files_that_are_not_pem_are_named(
    b: Bundle, capsys: pytest.CaptureFixture[str], cert: str, key: str, client_ca: str, says: str
) -> None:
    bad = client_ca or (cert if "certificate" in says else key)
    argv = control_args(b, cert, key, b.path(client_ca) if client_ca else "")
    line = refused_at_start(capsys, control_parse, argv)
    assert says.format(b.path(bad)) in line, line


def test_proxy_with_a_key_not_its_certificates_is_refused_at_start(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused_at_start(capsys, proxy_parse, proxy_args(b, "proxy.crt", "admin.key"))
    assert line.startswith("ponto-proxy: error: the TLS key ")
    assert f"is not the key of certificate {b.path('proxy.crt')}" in line


def test_pontoctl_with_a_key_not_its_certificates_exits_2_before_any_call(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--control-plane", f"127.0.0.1:{free_port()}", "--tls-ca", b.ca,
        "--tls-cert", b.path("admin.crt"), "--tls-key", b.path("proxy.key"), "get", "regions",
    ]  # fmt: skip
    assert pontoctl(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: the TLS key {b.path('proxy.key')} is not the key of certificate "
        f"{b.path('admin.crt')}\n"
    )


def test_files_that_fit_pass_the_checks(b: Bundle) -> None:
    # Now, not NOW: the module's bundle is made when its first test runs,
    # minutes after the module was imported in a long run.
    now = datetime.datetime.now(datetime.UTC)
    ServerSecurity(b.path("server.crt"), b.path("server.key"), b.ca).check_files(now)
    ClientOptions(b.ca, b.path("proxy.crt"), b.path("proxy.key")).check_files(now)
    ClientOptions(b.ca).check_files(now)
    ClientOptions().check_files(now)  # plaintext: nothing to read


# ---------------------------------------------------------------- M2: validity dates


def _date(when: datetime.datetime) -> str:
    # As the certificate holds it: whole seconds.
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("old-admin", f"expired on {_date(EXPIRED[1])}"),
        ("future-admin", f"is not valid before {_date(FUTURE[0])}"),
    ],
    # Not the dates: each pytest-xdist worker imports this module at its own
    # second, and the workers' test ids must be the same.
    ids=["old-admin", "future-admin"],
)
def test_pontoctl_names_its_own_certificate_out_of_its_dates(
    b: Bundle, capsys: pytest.CaptureFixture[str], name: str, says: str
) -> None:
    argv = [
        "--control-plane", f"127.0.0.1:{free_port()}", "--tls-ca", b.ca,
        "--tls-cert", b.path(f"{name}.crt"), "--tls-key", b.path(f"{name}.key"), "get", "regions",
    ]  # fmt: skip
    assert pontoctl(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the client certificate {b.path(name + '.crt')} {says}"), err
    assert len(err.splitlines()) == 1 and "CA" not in err


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("old-server", f"expired on {_date(EXPIRED[1])}"),
        ("future-server", f"is not valid before {_date(FUTURE[0])}"),
    ],
    # Not the dates: each pytest-xdist worker imports this module at its own
    # second, and the workers' test ids must be the same.
    ids=["old-server", "future-server"],
)
def test_control_plane_refuses_its_own_certificate_out_of_its_dates(
    b: Bundle, capsys: pytest.CaptureFixture[str], name: str, says: str
) -> None:
    argv = control_args(b, f"{name}.crt", f"{name}.key")
    line = refused_at_start(capsys, control_parse, argv)
    assert line == f"ponto-control: error: the TLS certificate {b.path(name + '.crt')} " + (
        says if "expired" in says else f"{says} (if it was just issued, check this machine's clock)"
    )


def test_proxy_refuses_its_own_certificate_out_of_its_dates(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused_at_start(capsys, proxy_parse, proxy_args(b, "old-proxy.crt", "old-proxy.key"))
    assert line == (
        f"ponto-proxy: error: the client certificate {b.path('old-proxy.crt')} expired on "
        f"{_date(EXPIRED[1])}"
    )


# What gRPC 1.85 says when the control plane's certificate is out of its dates.
_FAILED = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7000: "
_VERIFY = (
    "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
)
SERVER_EXPIRED = _FAILED + _VERIFY + "certificate has expired: OK"
SERVER_NOT_YET = _FAILED + _VERIFY + "certificate is not yet valid: OK"
BAD_SIGNATURE = _FAILED + (
    "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA "
    "routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature failure: OK"
)
SOCKET_CLOSED = (
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7000: "
    "Socket closed"
)
WRONG_NAME = _FAILED + (
    "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification "
    "Check failed."
)
MUTUAL = ClientOptions("ca.crt", "proxy.crt", "proxy.key")
CA_ONLY = ClientOptions("ca.crt")


@pytest.mark.parametrize(
    ("detail", "says"),
    [
        (SERVER_EXPIRED, "its certificate has expired"),
        (SERVER_NOT_YET, "its certificate is not yet valid"),
    ],
)
def test_a_server_certificate_out_of_its_dates_is_not_blamed_on_the_ca(
    detail: str, says: str
) -> None:
    for flags in (linkadvice.PONTOCTL, linkadvice.PROXY):
        text = linkadvice.unreachable(detail, "127.0.0.1:7000", MUTUAL, flags)
        assert f"TLS handshake with the control plane at 127.0.0.1:7000 failed: {says}" in text
        assert "not trusted" not in text and "--tls-ca" not in text, text
        assert detail in text


@pytest.mark.parametrize("name", ["old-server", "future-server"])
def test_pontoctl_against_a_server_certificate_out_of_its_dates_does_not_blame_the_ca(
    b: Bundle, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    # A server started before its certificate expired (ponto-control refuses
    # one at start): the handshake fails before any call, so no service is needed.
    server = grpc.server(futures.ThreadPoolExecutor(1))
    credentials = ServerSecurity(b.path(f"{name}.crt"), b.path(f"{name}.key")).server_credentials()
    assert credentials is not None
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        argv = ["--control-plane", f"127.0.0.1:{port}", *b.admin_args(), "get", "regions"]
        assert pontoctl(argv) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    says = "has expired" if name == "old-server" else "is not yet valid"
    assert f"failed: its certificate {says}" in err and "--tls-ca" not in err, err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("detail", "options", "says"),
    [
        (SOCKET_CLOSED, CA_ONLY, "requires one: give --tls-cert and --tls-key"),
        (SOCKET_CLOSED, ClientOptions(), "if it requires TLS, give --tls-ca, --tls-cert and "
                                         "--tls-key"),
        (SOCKET_CLOSED, MUTUAL, "check that proxy.crt is signed by its client CA"),
        (BAD_SIGNATURE, MUTUAL, "is not trusted by the CA in ca.crt"),
        (WRONG_NAME, MUTUAL, "give --control-plane one it lists"),
    ],
)  # fmt: skip
def test_the_proxy_gets_pontoctls_advice_naming_its_own_flags(
    detail: str, options: ClientOptions, says: str
) -> None:
    line = linkadvice.proxy_refused("UNAVAILABLE", detail, "127.0.0.1:7000", options)
    assert says in line and line.endswith(" [UNAVAILABLE]"), line
    assert "PONTO_TLS" not in line  # the proxy has no such variables
    assert detail in line


# ---------------------------------------------------------------- L6: a wrong bootstrap token

BOOTSTRAP = "the-bootstrap-token"


def test_a_wrong_bootstrap_token_is_told_apart_from_none() -> None:
    guard = TokenGuard(bootstrap_token=BOOTSTRAP, admin_token="admin")
    method = ROUTING_PREFIX + "Register"
    none = guard.check(method, "")
    wrong = guard.check(method, "stale-token")
    assert none is not None and wrong is not None
    assert none[0] == wrong[0] == grpc.StatusCode.UNAUTHENTICATED
    assert "must present the bootstrap token" in none[1]
    assert wrong[1] == "the bootstrap token given is not this control plane's bootstrap token"
    assert BOOTSTRAP not in wrong[1] and "stale-token" not in wrong[1]


def test_the_proxy_is_sent_to_its_token_file(b: Bundle) -> None:
    argv = [
        "--control-plane",
        "127.0.0.1:1",
        "--region",
        "east",
        "--bootstrap-token-file",
        b.bootstrap_token_file,
    ]
    options = proxy_parse(argv).credentials
    wrong = linkadvice.proxy_refused(
        "UNAUTHENTICATED",
        "the bootstrap token given is not this control plane's bootstrap token",
        "cp:7000",
        options,
    )
    assert wrong.endswith(
        f"; check the bootstrap token in the file {b.bootstrap_token_file} "
        "(--bootstrap-token-file) [UNAUTHENTICATED]"
    )
    missing = linkadvice.proxy_refused(
        "UNAUTHENTICATED", "proxies must present the bootstrap token", "cp:7000", ClientOptions()
    )
    assert missing.endswith("; give the bootstrap token with --bootstrap-token-file "
                            "[UNAUTHENTICATED]")  # fmt: skip
    assert options.token not in wrong
    # A stream ended as its certificate expired: no word of the token.
    expired = linkadvice.proxy_refused(
        "UNAUTHENTICATED",
        "the proxy's client certificate expired at 2026-12-04T09:16:16Z: give it a valid one",
        "cp:7000",
        options,
    )
    assert expired.endswith("give it a valid one (--tls-cert and --tls-key) [UNAUTHENTICATED]")


# ---------------------------------------------------------------- M3: the proxy's link


def link(address: str, options: ClientOptions, **kwargs: object) -> ControlPlaneClient:
    return ControlPlaneClient(
        TableHolder("east", None),
        [address],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        credentials=options,
        backoff_min=0.01,
        backoff_max=0.02,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_a_proxy_without_a_client_certificate_is_told_once_while_it_retries(
    b: Bundle, caplog: pytest.LogCaptureFixture
) -> None:
    # A real control plane's transport: mutual TLS, so the handshake of a
    # proxy that gives only --tls-ca is closed ("Socket closed").
    server = grpc.aio.server()
    security = ServerSecurity(b.path("server.crt"), b.path("server.key"), b.ca)
    credentials = security.server_credentials()
    assert credentials is not None
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    caplog.set_level(logging.DEBUG, logger="dataplane.sync.link")
    client = link(f"127.0.0.1:{port}", ClientOptions(b.ca))
    task = asyncio.create_task(client.run())

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "no client certificate was given" in r.getMessage()]

    try:
        async with asyncio.timeout(30):
            while len(failures()) < 3:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)
    said = failures()
    assert [r.levelno for r in said[:3]] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "give --tls-cert and --tls-key" in said[0].getMessage()
    assert said[0].getMessage().endswith("; retrying")


async def test_a_certificate_rotated_into_a_mismatch_is_said_before_any_handshake(
    b: Bundle, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 23: a proxy reads its TLS files at each connection; a pair that
    no longer fits (rotated in place, half done) went to gRPC, which logged
    tens of handshake lines a second and said nothing of the files."""
    cert, key = tmp_path / "proxy.crt", tmp_path / "proxy.key"
    cert.write_bytes(Path(b.path("proxy.crt")).read_bytes())
    key.write_bytes(Path(b.path("admin.key")).read_bytes())  # the rotation's first half
    caplog.set_level(logging.DEBUG, logger="dataplane.sync.link")
    client = link("127.0.0.1:9", ClientOptions(b.ca, str(cert), str(key)))
    task = asyncio.create_task(client.run())

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "dataplane.sync.link"]

    try:
        async with asyncio.timeout(10):
            while len(said()) < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert said()[0].startswith(
        f"control plane at 127.0.0.1:9: the TLS key {key} is not the key of certificate {cert}"
    )
    assert client.connects == 0


def test_a_stream_ended_at_an_expiry_with_a_renewed_certificate_on_disk_is_routine(
    b: Bundle,
) -> None:
    """Review 41: a certificate renewed in place ends the stream at the old
    one's expiry all the same; with a valid one on disk that is no failure."""

    def ended(details: str) -> grpc.aio.AioRpcError:
        empty = grpc.aio.Metadata()
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, empty, empty, details)

    expiry = ended("the proxy's client certificate expired at 2026-12-04T09:16:16Z: give it ...")
    renewed = link("cp:7000", ClientOptions(b.ca, b.path("proxy.crt"), b.path("proxy.key")))
    assert renewed._renewed(expiry)
    assert not renewed._renewed(ended("proxies must present the bootstrap token"))
    stale = link("cp:7000", ClientOptions(b.ca, b.path("old-proxy.crt"), b.path("old-proxy.key")))
    assert not stale._renewed(expiry)


async def test_a_proxy_whose_certificate_expired_since_it_started_says_so(b: Bundle) -> None:
    options = ClientOptions(b.ca, b.path("proxy.crt"), b.path("proxy.key"))
    later = NOW + 365 * DAY
    client = link("cp:7000", options, clock=lambda: later)
    line = client._problem("cp:7000", "UNAVAILABLE", SOCKET_CLOSED)
    assert line.startswith(
        f"control plane at cp:7000 is unreachable: the client certificate {b.path('proxy.crt')} "
        "expired on "
    )
    assert "--tls-cert and --tls-key" in line
    # While it is valid, the control plane's CA is what to check.
    now = link("cp:7000", options)._problem("cp:7000", "UNAVAILABLE", SOCKET_CLOSED)
    assert "is signed by its client CA" in now


def test_the_same_failure_again_is_logged_at_debug_and_a_new_one_as_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="dataplane.sync.link")
    client = link("cp:7000", ClientOptions())
    for problem in ("a", "a", "b", "a"):
        client._say("cp:7000", problem)
    client._say("cp:7001", "a")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "a; retrying"),
        (logging.DEBUG, "a (again)"),
        (logging.WARNING, "b; retrying"),
        (logging.WARNING, "a; retrying"),
        (logging.WARNING, "a; retrying"),
    ]


def test_a_certificate_valid_in_a_few_seconds_is_not_refused(tmp_path: Path) -> None:
    # Helm issues the chart's certificates from its own clock, not backdated:
    # a node a few seconds behind must not exit 2 in a crash loop (review 16).
    bundle = make_bundle(tmp_path)
    now = datetime.datetime.now(datetime.UTC)
    soon = (now + datetime.timedelta(seconds=5), now + datetime.timedelta(days=365))
    add_server(bundle, "skewed", valid=soon)
    security = ServerSecurity(
        tls_cert=bundle.path("skewed.crt"),
        tls_key=bundle.path("skewed.key"),
        tls_client_ca=bundle.ca,
    )
    security.check_files(datetime.datetime.now(datetime.UTC))


def test_a_session_cut_under_way_is_not_blamed_on_the_client_certificate() -> None:
    # What a proxy's RouteStream says when its control plane dies mid-session
    # (grpcio 1.85): no certificate advice during an incident (review 16).
    options = ClientOptions(tls_ca="/ca.crt", tls_cert="/proxy.crt", tls_key="/proxy.key")
    line = linkadvice.proxy_refused(
        "UNAVAILABLE", "Stream removed (Socket closed)", "cp:50051", options
    )
    assert (
        line
        == "control plane at cp:50051 is unreachable (Stream removed (Socket closed)) [UNAVAILABLE]"
    )


# A TLS channel to a port that answers garbage: gRPC core's handshake failure.
FAILED_HANDSHAKE = """
import socket, sys, threading
import {module}
import grpc
server = socket.create_server(("127.0.0.1", 0))
def garbage():
    while True:
        peer, _ = server.accept()
        peer.sendall(b"not tls\\r\\n" * 10)
        peer.close()
threading.Thread(target=garbage, daemon=True).start()
credentials = grpc.ssl_channel_credentials(open({ca!r}, "rb").read())
channel = grpc.secure_channel(f"127.0.0.1:{{server.getsockname()[1]}}", credentials)
try:
    grpc.channel_ready_future(channel).result(timeout=1)
except grpc.FutureTimeoutError:
    pass
"""


@pytest.mark.parametrize("module", ["dataplane.run", "controlplane.__main__"])
def test_grpc_cores_own_handshake_lines_stay_off_stderr(b: Bundle, module: str) -> None:
    """ponto-proxy retrying a control plane it cannot trust says why once per
    cause (its log format); gRPC core would add a line of its own per attempt,
    and ponto-control one per refused caller. A user's GRPC_VERBOSITY is kept."""
    script = FAILED_HANDSHAKE.format(module=module, ca=b.ca)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}

    def stderr(**extra: str) -> str:
        run = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return run.stderr

    assert "Handshake failed" not in stderr()
    assert "Handshake failed" in stderr(GRPC_VERBOSITY="INFO")


# ---------------------------------------------------------------- the control plane's etcd files


@pytest.mark.parametrize(
    ("ca", "cert", "key", "says"),
    [
        ("admin.key", "", "", "cannot read etcd CA {ca}: it holds no PEM certificate"),
        ("ca.crt", "admin.crt", "proxy.key", "the TLS key {key} is not the key of certificate"),
        ("ca.crt", "old-admin.crt", "old-admin.key", "the etcd client certificate {cert} expired"),
        ("ca.crt", "not-pem.crt", "admin.key", "cannot read TLS certificate {cert}: it holds no"),
    ],
)
def test_control_plane_refuses_etcd_tls_files_that_cannot_work_at_start(
    b: Bundle, capsys: pytest.CaptureFixture[str], ca: str, cert: str, key: str, says: str
) -> None:
    """Trial 23: it started, said it served, and retried etcd for good with
    gRPC's handshake errors ("Could not load any root certificate")."""
    argv = ["--etcd", "https://127.0.0.1:2379", "--etcd-ca", b.path(ca)]
    if cert:
        argv += ["--etcd-cert", b.path(cert), "--etcd-key", b.path(key)]
    line = refused_at_start(capsys, control_parse, argv)
    paths = {"ca": b.path(ca), "cert": b.path(cert or "x"), "key": b.path(key or "x")}
    assert says.format(**paths) in line, line


def test_etcd_tls_files_that_fit_pass(b: Bundle) -> None:
    argv = ["--etcd", "https://127.0.0.1:2379", "--etcd-ca", b.ca]
    argv += ["--etcd-cert", b.path("admin.crt"), "--etcd-key", b.path("admin.key")]
    assert control_parse(argv).etcd_tls is not None


# ---------------------------------------------------------------- a certificate for the other end


def test_control_plane_serving_a_client_certificate_is_refused_at_start(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started, and every client's handshake failed ("unsupported
    certificate purpose", in gRPC's log of each client)."""
    line = refused_at_start(capsys, control_parse, control_args(b, "admin.crt", "admin.key"))
    assert line == (
        f"ponto-control: error: the TLS certificate {b.path('admin.crt')} is not for a TLS "
        "server: its extended key usage is clientAuth, not serverAuth; issue it with serverAuth"
    )


def test_proxy_presenting_a_server_certificate_is_refused_at_start(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started, and the control plane closed each of its connections
    during the handshake, which the proxy saw as "Socket closed"."""
    line = refused_at_start(capsys, proxy_parse, proxy_args(b, "server.crt", "server.key"))
    assert line == (
        f"ponto-proxy: error: the client certificate {b.path('server.crt')} is not for a TLS "
        "client: its extended key usage is serverAuth, not clientAuth; issue it with clientAuth"
    )


def test_pontoctl_presenting_a_server_certificate_exits_2_before_any_call(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--control-plane", f"127.0.0.1:{free_port()}", "--tls-ca", b.ca,
        "--tls-cert", b.path("server.crt"), "--tls-key", b.path("server.key"), "get", "regions",
    ]  # fmt: skip
    assert pontoctl(argv) == 2
    assert capsys.readouterr().err == (
        f"error: the client certificate {b.path('server.crt')} is not for a TLS client: its "
        "extended key usage is serverAuth, not clientAuth; issue it with clientAuth\n"
    )


def test_control_plane_with_a_server_certificate_for_etcd_is_refused_at_start(
    b: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--etcd", "https://127.0.0.1:2379", "--etcd-ca", b.ca]
    argv += ["--etcd-cert", b.path("server.crt"), "--etcd-key", b.path("server.key")]
    line = refused_at_start(capsys, control_parse, argv)
    assert line == (
        f"ponto-control: error: the etcd client certificate {b.path('server.crt')} is not for "
        "a TLS client: its extended key usage is serverAuth, not clientAuth; issue it with "
        "clientAuth"
    )
