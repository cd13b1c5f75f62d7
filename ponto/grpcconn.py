"""How clients and servers of the control plane's gRPC API authenticate.

Two layers, both optional so a laptop can run without them, both on in the
demo and the Helm chart:

- Transport: TLS with mutual authentication. The control plane presents a
  server certificate and requires a client certificate signed by its client CA;
  clients verify the server against their CA. Certificates come from files.
- Call: a bearer token in the `authorization` metadata. Proxies send the
  bootstrap token (Routing service); operators send the admin token (Admin
  service). The tokens differ, so a proxy's credentials cannot steer the fleet.

Token values are read from files (or, for pontoctl, also an environment
variable) and never logged: `ClientOptions.__repr__` leaves them out.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hmac
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ponto import tlsfiles

# The route stream's liveness, on both ends (the proxy's link, the control
# plane's server): an HTTP/2 ping every 4 s, a peer that has not answered one
# in 3 s is gone. gRPC times a keepalive ping out by grpc.http2.ping_timeout_ms
# (60 s unless set), not by keepalive_timeout_ms: without it, a replica that
# hung (SIGSTOP, a stalled VM, a half-open connection) held its proxies for
# 60-70 s, serving a table that a drain made meanwhile did not reach (trial 17).
# A hung replica's proxies must leave it (at most 7 s) before its lease, and
# their registrations with it, lapse (--lease-ttl, 10 s by default): at 10 s
# and 5 s they were missing from the fleet for up to 5 s, their shares of the
# limits given to the others while they served on (trial 34).
KEEPALIVE_TIME_MS = 4_000
KEEPALIVE_TIMEOUT_MS = 3_000
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
# What a server lets a client ping at, at most: below KEEPALIVE_TIME_MS, so
# that a ping a little early is no strike (gRPC closes a connection that
# pings too often with GOAWAY too_many_pings).
MIN_PING_INTERVAL_MS = 2_000

ENV_TLS_CA = "PONTO_TLS_CA"
ENV_TLS_CERT = "PONTO_TLS_CERT"
ENV_TLS_KEY = "PONTO_TLS_KEY"
ENV_ADMIN_TOKEN = "PONTO_ADMIN_TOKEN"  # noqa: S105 (a variable name)
ENV_ADMIN_TOKEN_FILE = "PONTO_ADMIN_TOKEN_FILE"  # noqa: S105


class CredentialError(Exception):
    """A credential file is missing, unreadable or inconsistent."""


# A token goes in gRPC metadata (`authorization: Bearer TOKEN`), which takes
# printable ASCII and spaces alone, within the peer's limit for all metadata
# (8 KB by default), which the call's other headers share.
MAX_TOKEN_CHARS = 7000


def token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as a bearer token, or None; never echoes it."""
    if len(token) > MAX_TOKEN_CHARS:
        return f"is {len(token)} characters long, over {MAX_TOKEN_CHARS}"
    for at, char in enumerate(token, 1):
        if not " " <= char <= "~":
            return (
                f"holds a character a token cannot (character {at}: only printable "
                "ASCII and spaces travel in gRPC metadata)"
            )
    return None


def read_secret(path: str, what: str) -> str:
    """The first line of a secret file that holds a token (not blank, not a
    `#` comment), stripped, when it can be sent as a token (`token_problem`);
    never echoes the content. A token of other
    characters was taken at start and failed every call after: a traceback
    a second from a proxy, `Invalid metadata [INTERNAL]` from pontoctl, an
    Admin API no one could use (trial 23)."""
    return _file_tokens(path, what, every=False)[0]


def read_secrets(path: str, what: str) -> tuple[str, ...]:
    """Every token of a secret file, one a line (blank lines skipped), each
    checked as `read_secret` checks the first. A control plane accepts them
    all, so that a token is rotated without a moment when proxies or
    operators holding the old one or the new one are refused: the new one
    added to the file, then given to the clients, then the old one taken out
    (trial 34). A client sends the first (`read_secret`)."""
    return _file_tokens(path, what, every=True)


def _file_tokens(path: str, what: str, *, every: bool) -> tuple[str, ...]:
    """The file's tokens (`every`), or its first, each checked; the file read once."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialError(f"cannot read {what} file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise CredentialError(f"{what} file {path} is not UTF-8 text") from None
    lines = _token_lines(text)
    if not lines:
        raise CredentialError(f"{what} file {path} is empty")
    tokens = []
    for index, (at, token) in enumerate(lines if every else lines[:1]):
        problem = token_problem(token)
        if problem is not None:
            where = f"{path}, line {at}," if index else path  # the first, as always said
            raise CredentialError(f"{what} file {where} {problem}")
        tokens.append(token)
    return tuple(tokens)


def _token_lines(text: str) -> list[tuple[int, str]]:
    """(line number, token) of a secret file's lines that hold one: neither
    blank nor a comment (`#`), which a file of several tokens may carry (a
    note of when to take one out) and no one must be able to send as a
    token (review 50)."""
    found = []
    for at, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if token and not token.startswith("#"):
            found.append((at, token))
    return found


def accepted_tokens(given: str | Sequence[str]) -> tuple[str, ...]:
    """A server's accepted tokens: one (a str, "" for none) or several (a
    rotation's old and new), the empty ones left out."""
    if isinstance(given, str):
        return (given,) if given else ()
    return tuple(t for t in given if t)


def token_among(token: str, accepted: Sequence[str]) -> bool:
    """Whether `token` is one of `accepted`, each compared in constant time
    (the gRPC guard and the status page's writes)."""
    found = False
    for candidate in accepted:
        found |= hmac.compare_digest(token.encode(), candidate.encode())
    return found


def read_bytes(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CredentialError(f"cannot read {what} {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class ClientOptions:
    """TLS material and a bearer token for calls to the control plane."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)
    # Where the token came from, for a refusal's advice (a flag, or a variable).
    token_source: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialError("give both a TLS certificate and its key, or neither")
        if self.tls_cert and not self.tls_ca:
            raise CredentialError("a client certificate needs --tls-ca to verify the server")

    @property
    def secure(self) -> bool:
        return bool(self.tls_ca)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def check_files(self, now: datetime.datetime) -> None:
        """Read the TLS files and check them as gRPC cannot say clearly: the CA
        holds certificates, the key is the certificate's, and the certificate
        is valid at `now` and for a TLS client. CredentialError naming the
        file; nothing without TLS."""
        if not self.secure:
            return
        try:
            tlsfiles.certificates(read_bytes(self.tls_ca, "TLS CA"), self.tls_ca, "TLS CA")
            if self.tls_cert:
                _check_own(
                    self.tls_cert, self.tls_key, "client certificate", now, tlsfiles.CLIENT_AUTH
                )
        except tlsfiles.TlsFileError as exc:
            raise CredentialError(str(exc)) from None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_bytes(self.tls_ca, "TLS CA"),
            private_key=read_bytes(self.tls_key, "TLS key") if self.tls_key else None,
            certificate_chain=read_bytes(self.tls_cert, "TLS certificate")
            if self.tls_cert
            else None,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientOptions:
        """From `add_arguments` flags: pontoctl's admin credential."""
        token = source = ""
        if args.admin_token_file:
            token = read_secret(args.admin_token_file, "admin token")
            source = f"the file {args.admin_token_file}"
        elif os.environ.get(ENV_ADMIN_TOKEN):
            token = os.environ[ENV_ADMIN_TOKEN].strip()
            source = ENV_ADMIN_TOKEN
            problem = token_problem(token)
            if problem is not None:
                raise CredentialError(f"{ENV_ADMIN_TOKEN} {problem}")
        return cls(args.tls_ca, args.tls_cert, args.tls_key, token, source)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """pontoctl's connection flags, with environment defaults."""
    env = os.environ.get
    parser.add_argument(
        "--tls-ca",
        default=env(ENV_TLS_CA, ""),
        help=f"CA that signed the server (env {ENV_TLS_CA})",
    )
    parser.add_argument(
        "--tls-cert", default=env(ENV_TLS_CERT, ""), help=f"client certificate (env {ENV_TLS_CERT})"
    )
    parser.add_argument(
        "--tls-key", default=env(ENV_TLS_KEY, ""), help=f"client key (env {ENV_TLS_KEY})"
    )
    parser.add_argument(
        "--admin-token-file",
        default=env(ENV_ADMIN_TOKEN_FILE, ""),
        help=f"file holding the admin token (env {ENV_ADMIN_TOKEN_FILE}, or the token "
        f"itself in {ENV_ADMIN_TOKEN})",
    )


# gRPC's name schemes: a target written with one is gRPC's to read.
_TARGET_SCHEME = re.compile(r"^(?:[a-z][a-z0-9+.-]*:///|(?:unix|unix-abstract|ipv4|ipv6|vsock):)")


def port_missing(address: str) -> str:
    """Why `address` (a --control-plane entry) names no port, "" when it
    does: gRPC takes HOST alone as HOST:443, where no control plane listens
    by default (trial 17: `--control-plane 127.0.0.1` tried port 443). A
    gRPC target with a scheme (dns:///, unix:, ipv4:) is taken as it is."""
    if _TARGET_SCHEME.match(address):
        return ""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or (":" in host and not host.endswith("]")):
        return f"{address!r} is not HOST:PORT (an IPv6 address as [ADDR]:PORT)"
    return ""


def target_of(address: str) -> str:
    """A gRPC target: 'dns:///name:port' stays, 'host:port' stays."""
    return address


class _AddMetadata(grpc.UnaryUnaryClientInterceptor):
    """Adds the bearer token to every unary call of a sync channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        merged = (*(details.metadata or ()), *self._metadata)
        new = _Details(
            details.method,
            details.timeout,
            merged,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )
        return continuation(new, request)


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """The documented way to change a call's metadata in a client interceptor."""


# The largest Admin answer pontoctl takes. gRPC's default of 4 MiB refused
# `key list` and `get table` of a large fleet (trial 83: 20,000 keys with
# notes of 200 characters are about 5 MB of ListKeys) after the control plane
# had read and sent it; the control plane sends answers of any size.
MAX_ADMIN_ANSWER_BYTES = 1024 * 1024 * 1024


def admin_channel(address: str, options: ClientOptions) -> grpc.Channel:
    """A sync channel whose calls carry the admin credential, taking answers
    of up to MAX_ADMIN_ANSWER_BYTES."""
    sizes = [("grpc.max_receive_message_length", MAX_ADMIN_ANSWER_BYTES)]
    if options.secure:
        channel = grpc.secure_channel(
            target_of(address), options.channel_credentials(), options=sizes
        )
    else:
        channel = grpc.insecure_channel(target_of(address), options=sizes)
    if options.metadata:
        return grpc.intercept_channel(channel, _AddMetadata(options.metadata))
    return channel


def aio_channel(
    address: str, options: ClientOptions, channel_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    if options.secure:
        return grpc.aio.secure_channel(
            target_of(address), options.channel_credentials(), options=channel_options
        )
    return grpc.aio.insecure_channel(target_of(address), options=channel_options)


# Trailing metadata of a successful Admin reply: one value per warning, text
# for people (what the call allowed but its caller should know), in the manner
# of Kubernetes' API warnings. A client that does not look loses nothing else.
WARNING_METADATA = "ponto-warning"


class CallDefaults:
    """Wraps a sync stub so every call has a timeout; the warnings replies
    carried (WARNING_METADATA) are gathered in `warnings`, in call order."""

    def __init__(self, stub: object, timeout: float) -> None:
        self._stub = stub
        self._timeout = timeout
        self.warnings: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def call(request: Any) -> Any:
            response, done = method.with_call(request, timeout=self._timeout)
            self.warnings += [
                str(value)
                for key, value in done.trailing_metadata() or ()
                if key == WARNING_METADATA
            ]
            return response

        return call


# ---------------------------------------------------------------- server side


@dataclass(frozen=True)
class ServerSecurity:
    """What the control plane requires of its callers."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    bootstrap_token: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)
    # Also accepted, while a token is rotated: the token files' other lines.
    other_bootstrap_tokens: tuple[str, ...] = field(default=(), repr=False)
    other_admin_tokens: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialError("give both --tls-cert and --tls-key, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise CredentialError("--tls-client-ca needs --tls-cert and --tls-key")
        if set(self.bootstrap_tokens) & set(self.admin_tokens):
            raise CredentialError("the admin token must differ from the bootstrap token")

    @property
    def bootstrap_tokens(self) -> tuple[str, ...]:
        """Every bootstrap token accepted (none: proxies need none)."""
        return (self.bootstrap_token, *self.other_bootstrap_tokens) if self.bootstrap_token else ()

    @property
    def admin_tokens(self) -> tuple[str, ...]:
        """Every admin token accepted (none: the Admin API needs none)."""
        return (self.admin_token, *self.other_admin_tokens) if self.admin_token else ()

    def check_files(self, now: datetime.datetime) -> None:
        """As ClientOptions.check_files, for the server's certificate, key and
        client CA; a server given a key not its certificate's would otherwise
        fail to bind, which reads as a port in use."""
        if not self.tls_cert:
            return
        try:
            _check_own(self.tls_cert, self.tls_key, "TLS certificate", now, tlsfiles.SERVER_AUTH)
            if self.tls_client_ca:
                pem = read_bytes(self.tls_client_ca, "TLS client CA")
                tlsfiles.certificates(pem, self.tls_client_ca, "TLS client CA")
        except tlsfiles.TlsFileError as exc:
            raise CredentialError(str(exc)) from None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        pair = (read_bytes(self.tls_key, "TLS key"), read_bytes(self.tls_cert, "TLS certificate"))
        if self.tls_client_ca:
            return grpc.ssl_server_credentials(
                [pair],
                root_certificates=read_bytes(self.tls_client_ca, "TLS client CA"),
                require_client_auth=True,
            )
        return grpc.ssl_server_credentials([pair])


def _check_own(
    cert_path: str, key_path: str, what: str, now: datetime.datetime, usage: bytes
) -> None:
    """TlsFileError unless the key at key_path is the certificate's at
    cert_path and that certificate (`what`, in the message) is valid at `now`
    for `usage` (tlsfiles.check_purpose)."""
    cert = tlsfiles.check_pair(
        read_bytes(cert_path, "TLS certificate"),
        cert_path,
        read_bytes(key_path, "TLS key"),
        key_path,
    )
    tlsfiles.check_validity(cert, cert_path, what, now)
    tlsfiles.check_purpose(cert, cert_path, what, usage)
