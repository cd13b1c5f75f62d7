"""A throwaway certificate authority for the demo and the tests.

`make demo` and the security tests run the planes with mutual TLS like
production; this makes the files they need: a CA, a server certificate for the
control plane and client certificates for proxies and operators, each stating
its role as the URI name `spiffe://ponto/role/proxy` or `.../admin` (ponto.roles;
the control plane checks it), plus the bootstrap and admin tokens. Production
certificates come from the operator's PKI (the Helm chart generates its own or
takes existing secrets).

    python -m ponto.pki DIR     # writes DIR/{ca,server,proxy,admin}.{crt,key} and tokens
    python -m ponto.pki --force DIR   # replaces them (a fleet using them breaks)
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ponto.roles import ROLES, role_uri
from ponto.writefile import write_atomic

VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class Bundle:
    """Paths of everything a secured local fleet needs."""

    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    @property
    def ca(self) -> str:
        return self.path("ca.crt")

    @property
    def bootstrap_token_file(self) -> str:
        return self.path("bootstrap.token")

    @property
    def admin_token_file(self) -> str:
        return self.path("admin.token")

    def control_args(self) -> list[str]:
        return [
            "--tls-cert", self.path("server.crt"), "--tls-key", self.path("server.key"),
            "--tls-client-ca", self.ca,
            "--bootstrap-token-file", self.bootstrap_token_file,
            "--admin-token-file", self.admin_token_file,
        ]  # fmt: skip

    def proxy_args(self) -> list[str]:
        return [
            "--tls-ca", self.ca, "--tls-cert", self.path("proxy.crt"),
            "--tls-key", self.path("proxy.key"),
            "--bootstrap-token-file", self.bootstrap_token_file,
        ]  # fmt: skip

    def admin_args(self) -> list[str]:
        return [
            "--tls-ca", self.ca, "--tls-cert", self.path("admin.crt"),
            "--tls-key", self.path("admin.key"),
            "--admin-token-file", self.admin_token_file,
        ]  # fmt: skip

    def admin_env(self) -> dict[str, str]:
        return {
            "PONTO_TLS_CA": self.ca,
            "PONTO_TLS_CERT": self.path("admin.crt"),
            "PONTO_TLS_KEY": self.path("admin.key"),
            "PONTO_ADMIN_TOKEN_FILE": self.admin_token_file,
        }


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Ponto (throwaway)"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server_names: tuple[str, ...] = (),
    role: str | None = None,
    valid: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> x509.Certificate:
    """A certificate; `role` makes it a client's ("": one that states no role).
    `valid`: (not before, not after), by default from five minutes ago for
    VALIDITY."""
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = valid or (now - datetime.timedelta(minutes=5), now + VALIDITY)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        # Key identifiers: a verifier given the old CA and the new one while
        # certificates are rotated finds each certificate's issuer by its key,
        # not by a name two CAs may share (trial 34: BAD_SIGNATURE).
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    alt: list[x509.GeneralName] = []
    for n in server_names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    if role:
        # The control plane reads a client's role here (controlplane.api.guard).
        alt.append(x509.UniformResourceIdentifier(role_uri(role)))
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    usages = []
    if server_names:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if role is not None:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_bundle(
    directory: Path, server_names: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
) -> Bundle:
    """Write a CA, certificates and tokens into directory (mode 0600 keys)."""
    # Keys and tokens are never readable by others, not even for a moment.
    old_umask = os.umask(0o077)
    try:
        return _make_bundle(directory, server_names)
    finally:
        os.umask(old_umask)


def _save(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    write_atomic(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    write_atomic(directory / f"{name}.key", _pem_key(key))
    (directory / f"{name}.key").chmod(0o600)


def add_client(
    bundle: Bundle,
    name: str,
    *,
    role: str,
    common_name: str = "",
    valid: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> Bundle:
    """Issue a client certificate from the bundle's CA as `name`.{crt,key}.

    `role` is one of ponto.roles.ROLES, stated as a URI name; "" states none (as
    certificates made before roles did, unless their common name is
    `ponto-<role>`). `common_name` defaults to `ponto-<name>`. `valid`: (not
    before, not after), for tests of expired or not yet valid certificates.
    """
    return _issue(bundle, name, common_name or f"ponto-{name}", role=role, valid=valid)


def add_server(
    bundle: Bundle,
    name: str,
    server_names: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
    *,
    valid: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> Bundle:
    """Issue a control-plane certificate from the bundle's CA as `name`.{crt,key}
    (as `server` is), e.g. one already expired (`valid`)."""
    return _issue(bundle, name, "ponto-control", server_names=server_names, valid=valid)


def _issue(
    bundle: Bundle,
    name: str,
    common_name: str,
    *,
    role: str | None = None,
    server_names: tuple[str, ...] = (),
    valid: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> Bundle:
    directory = bundle.directory
    ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    old_umask = os.umask(0o077)
    try:
        key = _key()
        cert = _cert(
            common_name,
            key,
            (ca.subject, ca_key),
            role=role,
            server_names=server_names,
            valid=valid,
        )
        _save(directory, name, cert, key)
    finally:
        os.umask(old_umask)
    return bundle


def bundle_files() -> tuple[str, ...]:
    """Names of the files make_bundle writes into its directory."""
    certified = ("ca", "server", *ROLES)
    return (
        *(f"{name}.{ext}" for name in certified for ext in ("crt", "key")),
        "bootstrap.token",
        "admin.token",
    )


def _make_bundle(directory: Path, server_names: tuple[str, ...]) -> Bundle:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    # A name of its own: CAs made apart are told apart in a bundle of both.
    ca = _cert(f"ponto-demo-ca {secrets.token_hex(4)}", ca_key, None, ca=True)
    _save(directory, "ca", ca, ca_key)
    server_key = _key()
    server = _cert("ponto-control", server_key, (ca.subject, ca_key), server_names=server_names)
    _save(directory, "server", server, server_key)
    bundle = Bundle(directory)
    for role in ROLES:
        add_client(bundle, role, role=role)
    for token in ("bootstrap", "admin"):
        path = directory / f"{token}.token"
        write_atomic(path, (secrets.token_urlsafe(32) + "\n").encode())
        path.chmod(0o600)
    return bundle


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ponto.pki",
        description="Write a throwaway CA, certificates for the control plane, proxies "
        "and operators, and the bootstrap and admin tokens, for a local secured fleet.",
    )
    parser.add_argument("directory", type=Path, help="where to write them (made if missing)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace files already there (a fleet using the old CA or tokens "
        "stops connecting at its next restart)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 once written; 2 on bad arguments or files already there.

    Without --force nothing is written when any of the files exists: replacing
    the CA or a token silently would break every process still using them.
    """
    args = _parser().parse_args(argv)
    directory: Path = args.directory
    existing = [name for name in bundle_files() if (directory / name).exists()]
    if existing and not args.force:
        print(  # noqa: T201
            f"ponto.pki: {directory} already holds {', '.join(existing)}; "
            "pass --force to replace them",
            file=sys.stderr,
        )
        return 2
    bundle = make_bundle(directory)
    print(f"wrote a throwaway CA, certificates and tokens to {bundle.directory}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
