"""Security between the planes: which token each gRPC service needs (TokenGuard),
the client and server credential options, and the throwaway PKI of the demo."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import ponto.pki
from controlplane.api.admin import AdminService
from controlplane.api.guard import (
    MAX_LOGGED_REASON,
    MAX_TRACKED_CALLERS,
    RefusalLog,
    TokenGuard,
    peer_host,
    peer_role,
)
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.metrics import ControlMetrics
from controlplane.model import Tenant
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import (
    ClientOptions,
    CredentialError,
    ServerSecurity,
    admin_channel,
    read_secret,
    read_secrets,
)
from ponto.pki import Bundle, add_client, make_bundle
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc, routing_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from ponto.writefile import write_atomic

T = TypeVar("T")

BOOTSTRAP = "bootstrap-token-0123456789"
ADMIN = "admin-token-9876543210"

ADMIN_METHOD = "/ponto.v1.Admin/ListTenants"
ROUTING_METHOD = "/ponto.v1.Routing/RouteStream"
HEALTH_METHOD = "/grpc.health.v1.Health/Check"
REFLECTION_METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

# ---------------------------------------------------------------- TokenGuard.check

GUARD = TokenGuard(bootstrap_token=BOOTSTRAP, admin_token=ADMIN)


def test_admin_api_needs_the_admin_token() -> None:
    assert GUARD.check(ADMIN_METHOD, ADMIN) is None
    assert GUARD.check("/ponto.v1.Admin/DrainRegion", ADMIN) is None


def test_bootstrap_token_is_denied_on_the_admin_api() -> None:
    refusal = GUARD.check(ADMIN_METHOD, BOOTSTRAP)
    assert refusal is not None
    code, message = refusal
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "admin token" in message
    assert BOOTSTRAP not in message


@pytest.mark.parametrize("token", ["", "wrong", ADMIN + "x", ADMIN[:-1], BOOTSTRAP + "x"])
def test_missing_or_wrong_admin_token_is_unauthenticated(token: str) -> None:
    refusal = GUARD.check(ADMIN_METHOD, token)
    assert refusal is not None
    assert refusal[0] == grpc.StatusCode.UNAUTHENTICATED
    assert ADMIN not in refusal[1]
    # A wrong token is told apart from none, so its holder checks the file.
    wrong = "not this control plane's" in refusal[1]
    assert wrong == bool(token)


def test_routing_needs_the_bootstrap_token() -> None:
    assert GUARD.check(ROUTING_METHOD, BOOTSTRAP) is None
    assert GUARD.check("/ponto.v1.Routing/Register", BOOTSTRAP) is None
    for token in ("", "wrong", ADMIN):
        refusal = GUARD.check(ROUTING_METHOD, token)
        assert refusal is not None
        assert refusal[0] == grpc.StatusCode.UNAUTHENTICATED
        assert BOOTSTRAP not in refusal[1]


@pytest.mark.parametrize(
    "method", [HEALTH_METHOD, "/grpc.health.v1.Health/Watch", REFLECTION_METHOD]
)
@pytest.mark.parametrize("token", ["", "wrong", BOOTSTRAP, ADMIN])
def test_health_and_reflection_are_open(method: str, token: str) -> None:
    assert GUARD.check(method, token) is None


@pytest.mark.parametrize("method", [ADMIN_METHOD, ROUTING_METHOD, HEALTH_METHOD])
def test_nothing_is_required_when_no_token_is_configured(method: str) -> None:
    guard = TokenGuard(bootstrap_token="", admin_token="")
    assert guard.check(method, "") is None
    assert guard.check(method, "anything") is None


def test_every_token_of_a_rotation_is_accepted_for_its_service_only() -> None:
    """Trial 34: a token file held one token, so rotating one was a flag day
    (proxies and operators holding the other refused until all moved)."""
    old_boot, new_boot = BOOTSTRAP, "bootstrap-token-new-0123456789"
    old_admin, new_admin = ADMIN, "admin-token-new-9876543210"
    guard = TokenGuard(bootstrap_token=(new_boot, old_boot), admin_token=(new_admin, old_admin))
    for token in (old_boot, new_boot):
        assert guard.check(ROUTING_METHOD, token) is None
        refused = guard.check(ADMIN_METHOD, token)
        assert refused is not None and refused[0] is grpc.StatusCode.PERMISSION_DENIED
    for token in (old_admin, new_admin):
        assert guard.check(ADMIN_METHOD, token) is None
        refused = guard.check(ROUTING_METHOD, token)
        assert refused is not None and refused[0] is grpc.StatusCode.UNAUTHENTICATED
    wrong = guard.check(ADMIN_METHOD, "admin-token-of-someone-else")
    assert wrong is not None and wrong[0] is grpc.StatusCode.UNAUTHENTICATED


def test_a_token_file_of_several_lines_gives_every_token(tmp_path: Path) -> None:
    path = tmp_path / "bootstrap.token"
    path.write_text("new-token-0123456789\n\n  old-token-0123456789  \n")
    assert read_secrets(str(path), "bootstrap token") == (
        "new-token-0123456789",
        "old-token-0123456789",
    )
    assert read_secret(str(path), "bootstrap token") == "new-token-0123456789"  # what is sent
    path.write_text("new-token-0123456789\nold token\twith a tab\n")
    with pytest.raises(CredentialError, match="line 2"):
        read_secrets(str(path), "bootstrap token")
    # A note beside a token is no token (review 50: it was accepted as one).
    path.write_text("# new since May\nnew-token-0123456789\n# take out after May\nold-token-0\n")
    assert read_secrets(str(path), "bootstrap token") == ("new-token-0123456789", "old-token-0")
    assert read_secret(str(path), "bootstrap token") == "new-token-0123456789"


def test_no_token_may_be_both_a_bootstrap_and_an_admin_token() -> None:
    with pytest.raises(CredentialError, match="must differ"):
        ServerSecurity(
            bootstrap_token=BOOTSTRAP,
            admin_token=ADMIN,
            other_admin_tokens=(BOOTSTRAP,),
        )


def test_each_token_is_required_only_when_configured() -> None:
    admin_only = TokenGuard(bootstrap_token="", admin_token=ADMIN)
    assert admin_only.check(ROUTING_METHOD, "") is None
    refusal = admin_only.check(ADMIN_METHOD, "")
    assert refusal is not None and refusal[0] == grpc.StatusCode.UNAUTHENTICATED

    bootstrap_only = TokenGuard(bootstrap_token=BOOTSTRAP, admin_token="")
    assert bootstrap_only.check(ADMIN_METHOD, "") is None
    refusal = bootstrap_only.check(ROUTING_METHOD, "")
    assert refusal is not None and refusal[0] == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------- certificate roles


def auth_context(
    *, uris: tuple[str, ...] = (), dns: tuple[str, ...] = (), cn: str = ""
) -> dict[str, list[bytes]]:
    """What grpc's ServicerContext.auth_context() holds for such a certificate."""
    context: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}
    if cn:
        context["x509_common_name"] = [cn.encode()]
    if uris or dns:
        context["x509_subject_alternative_name"] = [n.encode() for n in (*uris, *dns)]
    if uris:
        context["peer_uri"] = [u.encode() for u in uris]
    return context


@pytest.mark.parametrize(
    ("context", "role"),
    [
        (auth_context(uris=("spiffe://ponto/role/proxy",)), "proxy"),
        (auth_context(uris=("spiffe://ponto/role/admin",), cn="ponto-proxy"), "admin"),
        (auth_context(uris=("spiffe://other/role/admin",), dns=("a.example",)), None),
        (auth_context(cn="ponto-admin"), "admin"),  # the Helm chart's certificates
        (auth_context(cn="ponto-proxy", dns=("p.example",)), "proxy"),
        (auth_context(cn="ponto-control-plane", dns=("cp.example",)), "admin"),
        (auth_context(cn="someone"), None),
        (auth_context(uris=("spiffe://ponto/role/root",)), None),
        (auth_context(uris=("spiffe://ponto/role/proxy", "spiffe://ponto/role/admin")), None),
        ({}, None),
    ],
    ids=[
        "uri-proxy",
        "uri-over-cn",
        "foreign-uri",
        "cn-admin",
        "cn-proxy",
        "cn-chart-control-plane",
        "no-role",
        "unknown-role",
        "two-roles",
        "no-certificate",
    ],
)
def test_peer_role(context: dict[str, list[bytes]], role: str | None) -> None:
    assert peer_role(context) == role


MTLS_GUARD = TokenGuard(bootstrap_token=BOOTSTRAP, admin_token=ADMIN, require_roles=True)


def test_each_service_needs_a_certificate_of_its_role() -> None:
    assert MTLS_GUARD.check_role(ROUTING_METHOD, "proxy") is None
    assert MTLS_GUARD.check_role(ADMIN_METHOD, "admin") is None
    for method, role in ((ROUTING_METHOD, "admin"), (ADMIN_METHOD, "proxy")):
        refusal = MTLS_GUARD.check_role(method, role)
        assert refusal is not None and refusal[0] == grpc.StatusCode.PERMISSION_DENIED
        assert f"role {role} cannot call" in refusal[1]
    refusal = MTLS_GUARD.check_role(ADMIN_METHOD, None)
    assert refusal is not None and refusal[0] == grpc.StatusCode.PERMISSION_DENIED
    assert "states no role" in refusal[1] and "spiffe://ponto/role/admin" in refusal[1]
    for method in (HEALTH_METHOD, REFLECTION_METHOD):
        assert MTLS_GUARD.check_role(method, None) is None
    # Without mutual TLS there is no certificate to ask.
    assert GUARD.check_role(ADMIN_METHOD, None) is None


# ---------------------------------------------------------------- in-process server


@contextlib.asynccontextmanager
async def control_server(
    *,
    bootstrap_token: str = BOOTSTRAP,
    admin_token: str = ADMIN,
    credentials: grpc.ServerCredentials | None = None,
    require_roles: bool = False,
    on_refused: Callable[[str, str], None] = lambda method, code: None,
    clock: Callable[[], float] = lambda: 0.0,
) -> AsyncIterator[tuple[str, Catalog]]:
    """The Admin and Health services behind TokenGuard, wired as controlplane.app does,
    and a fake Routing service (see FakeRouting)."""
    catalog = Catalog(MemoryStore())
    guard = TokenGuard(
        bootstrap_token=bootstrap_token,
        admin_token=admin_token,
        require_roles=require_roles,
        on_refused=on_refused,
        clock=clock,
    )
    server = grpc.aio.server(interceptors=[guard])
    service = AdminService(
        catalog,
        Publisher("cp-test"),
        AuditLog(catalog.store, replica="cp-test"),
        token_required=bool(admin_token),
    )
    admin_pb2_grpc.add_AdminServicer_to_server(service, server)
    server.add_generic_rpc_handlers((FakeRouting().handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    assert port
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}", catalog
    finally:
        await server.stop(None)


class FakeRouting:
    """The Routing service's two call shapes: Register (a coroutine) and
    RouteStream (here an async generator; the real one writes to its context)."""

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "ponto.v1.Routing",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self.register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.RegisterResponse.SerializeToString,
                ),
                "RouteStream": grpc.stream_stream_rpc_method_handler(
                    self.route_stream,
                    request_deserializer=pb.RouteRequest.FromString,
                    response_serializer=pb.RouteTable.SerializeToString,
                ),
            },
        )

    async def register(self, request: pb.RegisterRequest, context: object) -> pb.RegisterResponse:
        return pb.RegisterResponse(session_id="s-" + request.proxy.name)

    async def route_stream(
        self, requests: AsyncIterator[pb.RouteRequest], context: object
    ) -> AsyncIterator[pb.RouteTable]:
        yield pb.RouteTable(version=7)


def with_admin(
    address: str, options: ClientOptions, call: Callable[[admin_pb2_grpc.AdminStub], T]
) -> T:
    """Run `call` on a sync admin channel (from a worker thread: the server shares our loop)."""
    with admin_channel(address, options) as channel:
        return call(admin_pb2_grpc.AdminStub(channel))


def status_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def list_tenants(stub: admin_pb2_grpc.AdminStub) -> list[str]:
    return [t.name for t in stub.ListTenants(apb.ListRequest(), timeout=5).tenants]


def put_tenant_status(stub: admin_pb2_grpc.AdminStub) -> grpc.StatusCode:
    request = apb.PutTenantRequest(tenant=pb.Tenant(name="intruder"))
    return status_of(lambda: stub.PutTenant(request, timeout=5))


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        return int(reply.status)


async def test_admin_calls_with_the_right_token_work() -> None:
    async with control_server() as (address, catalog):
        await catalog.put_tenant(Tenant("acme"), allow_update=False)
        names = await asyncio.to_thread(
            with_admin, address, ClientOptions(token=ADMIN), list_tenants
        )
        assert names == ["acme"]


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        (BOOTSTRAP, grpc.StatusCode.PERMISSION_DENIED),
    ],
    ids=["none", "wrong", "bootstrap"],
)
async def test_admin_calls_without_the_admin_token_are_refused(
    token: str, code: grpc.StatusCode
) -> None:
    async with control_server() as (address, catalog):
        options = ClientOptions(token=token)
        listed = await asyncio.to_thread(
            with_admin, address, options, lambda stub: status_of(lambda: list_tenants(stub))
        )
        assert listed == code
        written = await asyncio.to_thread(with_admin, address, options, put_tenant_status)
        assert written == code
        # A refused write changes nothing.
        assert await catalog.list_tenants() == []


async def test_health_needs_no_token() -> None:
    async with control_server() as (address, _):
        serving = await asyncio.to_thread(health_status, address)
        assert serving == health_pb2.HealthCheckResponse.SERVING


async def test_without_configured_tokens_the_admin_api_is_open() -> None:
    async with control_server(bootstrap_token="", admin_token="") as (address, catalog):
        await catalog.put_tenant(Tenant("acme"), allow_update=False)
        names = await asyncio.to_thread(with_admin, address, ClientOptions(), list_tenants)
        assert names == ["acme"]


# ---------------------------------------------------------------- ClientOptions


def test_client_options_validation() -> None:
    with pytest.raises(CredentialError, match="both"):
        ClientOptions(tls_ca="/ca.crt", tls_cert="/c.crt")
    with pytest.raises(CredentialError, match="both"):
        ClientOptions(tls_ca="/ca.crt", tls_key="/c.key")
    with pytest.raises(CredentialError, match="tls-ca"):
        ClientOptions(tls_cert="/c.crt", tls_key="/c.key")
    assert ClientOptions(tls_ca="/ca.crt").secure
    assert ClientOptions(tls_ca="/ca.crt", tls_cert="/c.crt", tls_key="/c.key").secure
    assert not ClientOptions(token="t").secure


def test_client_options_metadata_and_repr() -> None:
    assert ClientOptions().metadata == ()
    options = ClientOptions(tls_ca="/etc/ca.crt", token="s3cret-token")
    assert options.metadata == (("authorization", "Bearer s3cret-token"),)
    assert "s3cret-token" not in repr(options)
    assert "s3cret-token" not in str(options)
    assert "/etc/ca.crt" in repr(options)


def test_client_options_credentials_name_an_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing-ca.crt"
    with pytest.raises(CredentialError, match=str(missing)):
        ClientOptions(tls_ca=str(missing)).channel_credentials()


# ---------------------------------------------------------------- ServerSecurity


def test_server_security_validation() -> None:
    with pytest.raises(CredentialError, match="differ"):
        ServerSecurity(bootstrap_token="same", admin_token="same")
    with pytest.raises(CredentialError):
        ServerSecurity(tls_cert="/s.crt")
    with pytest.raises(CredentialError):
        ServerSecurity(tls_key="/s.key")
    with pytest.raises(CredentialError):
        ServerSecurity(tls_client_ca="/ca.crt")
    assert ServerSecurity().server_credentials() is None
    assert ServerSecurity(bootstrap_token="", admin_token="").bootstrap_token == ""
    security = ServerSecurity(bootstrap_token="boot-secret", admin_token="admin-secret")
    assert "boot-secret" not in repr(security)
    assert "admin-secret" not in repr(security)


# ---------------------------------------------------------------- read_secret


def test_read_secret_takes_the_first_line_stripped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  the-token  \nsecond line\n")
    assert read_secret(str(path), "admin token") == "the-token"


def test_read_secret_errors_name_the_file_not_the_content(tmp_path: Path) -> None:
    missing = tmp_path / "nope.token"
    with pytest.raises(CredentialError) as caught:
        read_secret(str(missing), "admin token")
    assert str(missing) in str(caught.value)
    assert "admin token" in str(caught.value)

    blank = tmp_path / "blank.token"
    blank.write_text("   \n\n")
    with pytest.raises(CredentialError, match="empty") as caught:
        read_secret(str(blank), "bootstrap token")
    assert str(blank) in str(caught.value)

    with pytest.raises(CredentialError) as caught:
        read_secret(str(tmp_path), "admin token")  # a directory
    assert str(tmp_path) in str(caught.value)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("tökén", "character 2"),
        ("ab\tcd", "character 3"),
        ("ab\x01cd", "character 3"),
        ("x" * 8000, "8000 characters long, over 7000"),
    ],
)
def test_a_token_that_cannot_travel_in_grpc_metadata_is_refused_at_start(
    tmp_path: Path, content: str, why: str
) -> None:
    """Trial 23: taken at start, it failed every call after (a proxy's
    traceback a second, pontoctl's `Invalid metadata [INTERNAL]`)."""
    path = tmp_path / "token"
    path.write_text(content + "\n")
    with pytest.raises(CredentialError) as caught:
        read_secret(str(path), "bootstrap token")
    said = str(caught.value)
    assert said.startswith(f"bootstrap token file {path} ") and why in said
    assert content not in said


def test_a_token_with_inner_spaces_still_reads(tmp_path: Path) -> None:
    """Review 41: gRPC metadata carries spaces, and such tokens worked."""
    path = tmp_path / "token"
    path.write_text("  a token of words  \n")
    assert read_secret(str(path), "admin token") == "a token of words"


def test_read_secret_of_a_binary_file_is_a_credential_error(tmp_path: Path) -> None:
    # Say --admin-token-file was pointed at a DER key by mistake: the settings
    # turn CredentialError into a usage message; anything else is a traceback.
    binary = tmp_path / "key.der"
    binary.write_bytes(b"\x30\x82\x04\xa4\x02\x01\x00\xff\xfe secret-bytes")
    with pytest.raises(CredentialError) as caught:
        read_secret(str(binary), "admin token")
    assert str(binary) in str(caught.value)
    assert "secret-bytes" not in str(caught.value)


# ---------------------------------------------------------------- PKI

KEYS = ("ca.key", "server.key", "proxy.key", "admin.key")
CERTS = ("ca.crt", "server.crt", "proxy.crt", "admin.crt")
TOKENS = ("bootstrap.token", "admin.token")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return make_bundle(tmp_path_factory.mktemp("pki"))


def cert(bundle: Bundle, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(bundle.path(name)).read_bytes())


def eku(c: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_bundle_files_exist_and_secrets_are_private(bundle: Bundle) -> None:
    for name in (*KEYS, *CERTS, *TOKENS):
        assert Path(bundle.path(name)).is_file(), name
    for name in (*KEYS, *TOKENS):
        mode = stat.S_IMODE(os.stat(bundle.path(name)).st_mode)
        assert mode == 0o600, f"{name}: {mode:o}"
    assert Path(bundle.ca) == bundle.directory / "ca.crt"
    assert not list(bundle.directory.glob(".*.tmp"))


def test_bundle_tokens_differ_and_are_readable(bundle: Bundle) -> None:
    bootstrap = read_secret(bundle.bootstrap_token_file, "bootstrap token")
    admin = read_secret(bundle.admin_token_file, "admin token")
    assert len(bootstrap) >= 32
    assert len(admin) >= 32
    assert bootstrap != admin
    ServerSecurity(bootstrap_token=bootstrap, admin_token=admin)  # accepted


def test_server_certificate_names_and_usage(bundle: Bundle) -> None:
    ca = cert(bundle, "ca.crt")
    server = cert(bundle, "server.crt")
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert eku(server) == {ExtendedKeyUsageOID.SERVER_AUTH}
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


@pytest.mark.parametrize("role", ["proxy", "admin"])
def test_client_certificates_are_for_client_auth_and_state_their_role(
    bundle: Bundle, role: str
) -> None:
    ca = cert(bundle, "ca.crt")
    client = cert(bundle, f"{role}.crt")
    client.verify_directly_issued_by(ca)
    assert eku(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert client.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    san = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://ponto/role/{role}"
    ]
    assert san.get_values_for_type(x509.DNSName) == []


def test_ca_certificate_and_keys_match(bundle: Bundle) -> None:
    ca = cert(bundle, "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    ca.verify_directly_issued_by(ca)  # self-signed
    for name in ("ca", "server", "proxy", "admin"):
        key = serialization.load_pem_private_key(
            Path(bundle.path(f"{name}.key")).read_bytes(), password=None
        )
        public = cert(bundle, f"{name}.crt").public_key()
        assert key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) == public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )


def test_bundle_arguments_name_its_files(bundle: Bundle) -> None:
    assert bundle.path("server.crt") in bundle.control_args()
    assert bundle.bootstrap_token_file in bundle.proxy_args()
    assert bundle.admin_token_file in bundle.admin_args()
    assert bundle.admin_env()["PONTO_TLS_CA"] == bundle.ca


def test_private_keys_are_never_readable_by_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key written with the default mode and restricted afterwards can be
    # opened by another local user in between (and read later through that
    # descriptor).
    seen: dict[str, int] = {}

    def spying_write(path: Path, data: bytes) -> None:
        write_atomic(path, data)
        seen[path.name] = stat.S_IMODE(os.stat(path).st_mode)

    monkeypatch.setattr(ponto.pki, "write_atomic", spying_write)
    old_umask = os.umask(0o022)
    try:
        make_bundle(tmp_path / "pki")
    finally:
        os.umask(old_umask)
    for name in (*KEYS, *TOKENS):
        assert seen[name] & 0o077 == 0, f"{name} was written with mode {seen[name]:o}"


def mutual_tls(bundle: Bundle, bootstrap_token: str = "", admin_token: str = "") -> ServerSecurity:
    """The control plane's security with `bundle`'s server pair and client CA."""
    return ServerSecurity(
        tls_cert=bundle.path("server.crt"),
        tls_key=bundle.path("server.key"),
        tls_client_ca=bundle.ca,
        bootstrap_token=bootstrap_token,
        admin_token=admin_token,
    )


async def test_bundle_serves_mutual_tls(bundle: Bundle) -> None:
    admin_token = read_secret(bundle.admin_token_file, "admin token")
    security = mutual_tls(
        bundle,
        bootstrap_token=read_secret(bundle.bootstrap_token_file, "bootstrap token"),
        admin_token=admin_token,
    )
    credentials = security.server_credentials()
    assert credentials is not None
    async with control_server(
        bootstrap_token=security.bootstrap_token,
        admin_token=admin_token,
        credentials=credentials,
    ) as (address, catalog):
        await catalog.put_tenant(Tenant("acme"), allow_update=False)
        admin = ClientOptions(
            bundle.ca, bundle.path("admin.crt"), bundle.path("admin.key"), token=admin_token
        )
        assert await asyncio.to_thread(with_admin, address, admin, list_tenants) == ["acme"]

        # Without a client certificate the handshake fails, whatever the token.
        no_cert = ClientOptions(bundle.ca, token=admin_token)
        code = await asyncio.to_thread(
            with_admin, address, no_cert, lambda stub: status_of(lambda: list_tenants(stub))
        )
        assert code == grpc.StatusCode.UNAVAILABLE


def outcomes(address: str, options: ClientOptions) -> dict[str, grpc.StatusCode]:
    """The status of one call of each kind with these credentials."""
    with admin_channel(address, options) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        routing = routing_pb2_grpc.RoutingStub(channel)
        info = pb.ProxyInfo(name="p1", region="us-east", address="10.0.0.1:8080")

        def stream() -> object:
            # admin_channel adds the token to unary calls only.
            replies = routing.RouteStream(
                iter([pb.RouteRequest()]), timeout=5, metadata=options.metadata
            )
            return next(iter(replies))

        def check() -> object:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )

        return {
            "admin": status_of(lambda: list_tenants(admin)),
            "register": status_of(
                lambda: routing.Register(pb.RegisterRequest(proxy=info), timeout=5)
            ),
            "stream": status_of(stream),
            "health": status_of(check),
        }


async def test_a_certificate_serves_only_its_role(bundle: Bundle) -> None:
    add_client(bundle, "old", role="", common_name="ops-laptop")
    bootstrap = read_secret(bundle.bootstrap_token_file, "bootstrap token")
    admin_token = read_secret(bundle.admin_token_file, "admin token")
    security = mutual_tls(bundle, bootstrap_token=bootstrap, admin_token=admin_token)

    def options(name: str, token: str) -> ClientOptions:
        return ClientOptions(
            bundle.ca, bundle.path(f"{name}.crt"), bundle.path(f"{name}.key"), token=token
        )

    ok, denied = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    async with control_server(
        bootstrap_token=bootstrap,
        admin_token=admin_token,
        credentials=security.server_credentials(),
        require_roles=True,
    ) as (address, _):

        async def seen(name: str, token: str) -> dict[str, grpc.StatusCode]:
            return await asyncio.to_thread(outcomes, address, options(name, token))

        assert await seen("proxy", bootstrap) == {
            "admin": denied,  # the bootstrap token is not the admin's
            "register": ok,
            "stream": ok,
            "health": ok,
        }
        assert await seen("admin", admin_token) == {
            "admin": ok,
            "register": unauthenticated,
            "stream": unauthenticated,
            "health": ok,
        }
        # The right token on a certificate of the other role.
        assert await seen("admin", bootstrap) == {
            "admin": denied,
            "register": denied,
            "stream": denied,
            "health": ok,
        }
        assert await seen("proxy", admin_token) == {
            "admin": denied,
            "register": unauthenticated,
            "stream": unauthenticated,
            "health": ok,
        }
        # A certificate without a role (made before roles) serves neither.
        for token in (bootstrap, admin_token):
            seen_old = await seen("old", token)
            assert seen_old["health"] == ok
            assert ok not in (seen_old["admin"], seen_old["register"], seen_old["stream"])
        with (
            admin_channel(address, options("old", admin_token)) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            await asyncio.to_thread(list_tenants, admin_pb2_grpc.AdminStub(channel))
        assert refused.value.code() == denied
        assert "states no role" in str(refused.value.details())


# ---------------------------------------------------------------- refusals: logged and counted


class Clock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "controlplane.api.guard" and r.getMessage().startswith("refused ")
    ]


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv6:[::1]:41234", "[::1]"),
        ("ipv6:%5B::1%5D:41234", "[::1]"),  # as grpc writes it
        ("unix:/run/ponto.sock", "unix:/run/ponto.sock"),
        ("", ""),
    ],
)
def test_peer_host_drops_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def register(name: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(proxy=pb.ProxyInfo(name=name, region="us-east"))


UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, "proxies must present the bootstrap token")


def test_a_caller_refused_on_every_retry_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    refusals = RefusalLog(clock)
    method = "/ponto.v1.Routing/Register"
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        for port in range(3):  # a proxy retrying, reconnected from a new port each time
            refusals.refused(
                method, UNAUTHENTICATED, f"ipv4:10.0.0.5:{4000 + port}", register("p1")
            )
            clock.now += 5
        # Another proxy on the same machine is throttled with it (a name is
        # the caller's choice); one elsewhere is a line of its own.
        refusals.refused(method, UNAUTHENTICATED, "ipv4:10.0.0.5:5000", register("p2"))
        refusals.refused(method, UNAUTHENTICATED, "ipv4:10.0.0.6:4000", register("p1"))
        clock.now += 60
        refusals.refused(method, UNAUTHENTICATED, "ipv4:10.0.0.5:4009", register("p2"))
    assert refusal_lines(caplog) == [
        f"refused {method} from ipv4:10.0.0.5:4000 (proxy 'p1'): UNAUTHENTICATED "
        "(proxies must present the bootstrap token)",
        f"refused {method} from ipv4:10.0.0.6:4000 (proxy 'p1'): UNAUTHENTICATED "
        "(proxies must present the bootstrap token)",
        f"refused {method} from ipv4:10.0.0.5:4009 (proxy 'p2'): UNAUTHENTICATED "
        "(proxies must present the bootstrap token) (3 more not logged)",
    ]


def test_an_ipv6_callers_refusal_names_it_with_brackets(caplog: pytest.LogCaptureFixture) -> None:
    # Trial 78: grpc's escaped "ipv6:%5B2001:db8::5%5D:4000" reached the line.
    # Review 323: a caller is throttled by its /64, from any address of which
    # it may call (one rotating through it logged a line for each).
    method = "/ponto.v1.Routing/Register"
    refusals = RefusalLog(Clock())
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        for peer in ("2001:db8::5", "2001:db8::6", "2001:db8:0:1::5"):
            refusals.refused(method, UNAUTHENTICATED, f"ipv6:%5B{peer}%5D:4000", register("p1"))
    assert refusal_lines(caplog) == [
        f"refused {method} from ipv6:[{peer}]:4000 (proxy 'p1'): UNAUTHENTICATED "
        "(proxies must present the bootstrap token)"
        for peer in ("2001:db8::5", "2001:db8:0:1::5")
    ]


def test_a_refusal_for_another_reason_is_not_held_behind_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trial 23: a wrong token after a missing one, from one address within
    the minute, was never logged: the throttle took no account of why."""
    refusals = RefusalLog(Clock())
    method = "/ponto.v1.Admin/ListRegions"
    missing = (grpc.StatusCode.UNAUTHENTICATED, "admin calls must present the admin token")
    wrong = (grpc.StatusCode.UNAUTHENTICATED, "the admin token presented is not this one")
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        for refusal in (missing, wrong, missing, wrong):
            refusals.refused(method, refusal, "ipv4:10.0.0.5:4000", iter(()))
    assert [line.rsplit("(", 1)[1] for line in refusal_lines(caplog)] == [
        "admin calls must present the admin token)",
        "the admin token presented is not this one)",
    ]


def test_a_name_the_caller_chooses_neither_grows_the_log_nor_escapes_the_throttle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Register is read before its token is checked: its name is anyone's, up
    # to the server's 4 MiB message size (review 15).
    refusals = RefusalLog(Clock())
    method = "/ponto.v1.Routing/Register"
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        for i in range(200):  # a new name and port each time, within a second
            refusals.refused(
                method, UNAUTHENTICATED, f"ipv4:10.9.9.9:{i}", register(f"{i}" * 2**16)
            )
    [line] = refusal_lines(caplog)
    assert len(line) < 300
    assert sum(len(part) for key in refusals._lines for part in key) < 1024


def test_a_reason_quoting_what_the_caller_sent_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    # An Admin call's refusal may quote its request (a name, a page token),
    # up to the server's 4 MiB message size.
    refusals = RefusalLog(Clock())
    method = "/ponto.v1.Admin/DrainRegion"
    reason = (grpc.StatusCode.NOT_FOUND, "region " + "x" * 2**20 + " not found")
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        refusals.refused(method, reason, "ipv4:10.0.0.5:4000", iter(()))
    [line] = refusal_lines(caplog)
    assert len(line) < MAX_LOGGED_REASON + 100 and line.endswith("xxx...)")
    assert sum(len(part) for key in refusals._lines for part in key) < MAX_LOGGED_REASON + 100


def test_the_callers_tracked_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    refusals = RefusalLog(Clock())
    method = "/ponto.v1.Routing/RouteStream"
    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        for i in range(MAX_TRACKED_CALLERS + 1):
            refusals.refused(method, UNAUTHENTICATED, f"ipv4:10.1.{i // 256}.{i % 256}:1", iter(()))
        # The first caller was forgotten: it is logged again, the latest is not.
        refusals.refused(method, UNAUTHENTICATED, "ipv4:10.1.0.0:2", iter(()))
        refusals.refused(method, UNAUTHENTICATED, "ipv4:10.1.4.0:2", iter(()))
    lines = refusal_lines(caplog)
    assert len(lines) == MAX_TRACKED_CALLERS + 2
    assert lines[-1] == (
        f"refused {method} from ipv4:10.1.0.0:2: UNAUTHENTICATED "
        "(proxies must present the bootstrap token)"
    )


async def test_refused_registrations_name_the_caller_and_are_counted(
    bundle: Bundle, caplog: pytest.LogCaptureFixture
) -> None:
    bootstrap = read_secret(bundle.bootstrap_token_file, "bootstrap token")
    admin_token = read_secret(bundle.admin_token_file, "admin token")
    security = mutual_tls(bundle)
    metrics = ControlMetrics()
    clock = Clock()

    def options(name: str, token: str) -> ClientOptions:
        return ClientOptions(
            bundle.ca, bundle.path(f"{name}.crt"), bundle.path(f"{name}.key"), token=token
        )

    with caplog.at_level(logging.WARNING, "controlplane.api.guard"):
        async with control_server(
            bootstrap_token=bootstrap,
            admin_token=admin_token,
            credentials=security.server_credentials(),
            require_roles=True,
            on_refused=metrics.routing_refused,
            clock=clock,
        ) as (address, _):
            # A wrong bootstrap token, twice (a retry); a certificate of the wrong role.
            for _ in range(2):
                await asyncio.to_thread(outcomes, address, options("proxy", "wrong"))
            await asyncio.to_thread(outcomes, address, options("admin", bootstrap))
            clock.now += 60
            await asyncio.to_thread(outcomes, address, options("proxy", "wrong"))

    def count(method: str, code: str) -> float | None:
        return metrics.registry.get_sample_value(
            "ponto_control_routing_refusals_total", {"method": method, "code": code}
        )

    assert count("Register", "UNAUTHENTICATED") == 3
    assert count("RouteStream", "UNAUTHENTICATED") == 3
    assert count("Register", "PERMISSION_DENIED") == 1
    assert count("RouteStream", "PERMISSION_DENIED") == 1
    # Admin refusals are counted with the Admin calls, not here.
    assert count("ListTenants", "PERMISSION_DENIED") is None
    registers = [line for line in refusal_lines(caplog) if "Routing/Register" in line]
    assert len(registers) == 3, registers
    wrong_token, wrong_role, again = registers
    assert wrong_token.startswith("refused /ponto.v1.Routing/Register from ipv4:127.0.0.1:")
    assert "(proxy 'p1'): UNAUTHENTICATED" in wrong_token
    assert "(proxy 'p1'): PERMISSION_DENIED (a certificate of role admin" in wrong_role
    assert again.endswith("(1 more not logged)")
