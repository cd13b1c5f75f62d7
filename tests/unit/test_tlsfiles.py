"""ponto.tlsfiles against cryptography's reading of the same files: the dates
it reads from the DER itself, the certificates it finds in a PEM file, the
key checks; and the memory it saves (a proxy with TLS on loads no
`cryptography`)."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ponto import tlsfiles
from ponto.pki import make_bundle

UTC = datetime.UTC
ROOT = Path(__file__).resolve().parents[2]


Key = (
    ec.EllipticCurvePrivateKey
    | rsa.RSAPrivateKey
    | ed25519.Ed25519PrivateKey
    | ed448.Ed448PrivateKey
)


def certificate(
    key: Key,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    *extensions: tuple[x509.ExtensionType, bool],
) -> x509.Certificate:
    """Self-signed, with `extensions` (each with whether it is critical):
    EdDSA keys sign without a separate hash."""
    eddsa = isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tlsfiles-test")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(key, None if eddsa else hashes.SHA256())


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


EC_KEY = ec.generate_private_key(ec.SECP256R1())
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER_EC_KEY = ec.generate_private_key(ec.SECP256R1())


@pytest.mark.parametrize(
    ("not_before", "not_after"),
    [
        # UTCTime on both sides, a 19xx year among them (RFC 5280: 50-99 are 19xx).
        (datetime.datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC),
         datetime.datetime(2026, 12, 2, 5, 0, 1, tzinfo=UTC)),
        # The last UTCTime year, then GeneralizedTime from 2050 on.
        (datetime.datetime(2049, 12, 31, 0, 0, tzinfo=UTC),
         datetime.datetime(2050, 1, 1, 0, 0, tzinfo=UTC)),
        (datetime.datetime(1970, 1, 1, tzinfo=UTC),
         datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("key", [EC_KEY, RSA_KEY], ids=["ec", "rsa"])
def test_the_dates_read_from_the_der_are_cryptographys(
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> None:
    cert = certificate(key, not_before, not_after)
    (found,) = tlsfiles.certificates(pem(cert), "c.crt", "TLS certificate")
    assert found.der == cert.public_bytes(serialization.Encoding.DER)
    assert found.not_valid_before == cert.not_valid_before_utc == not_before
    assert found.not_valid_after == cert.not_valid_after_utc == not_after


def test_a_chain_is_read_in_file_order_among_other_blocks() -> None:
    now = datetime.datetime(2026, 12, 2, tzinfo=UTC)
    leaf = certificate(EC_KEY, now, now + datetime.timedelta(days=1))
    ca = certificate(RSA_KEY, now, now + datetime.timedelta(days=2))
    key = EC_KEY.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    found = tlsfiles.certificates(key + pem(leaf) + b"\n" + pem(ca), "chain.pem", "TLS CA")
    assert [c.not_valid_after for c in found] == [
        now + datetime.timedelta(days=1),
        now + datetime.timedelta(days=2),
    ]


@pytest.mark.parametrize(
    "content",
    [
        b"hello\n",
        b"",
        # a key alone
        EC_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        # a block that is no certificate, then one that is: the file is refused whole
        b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"
        + pem(certificate(EC_KEY, datetime.datetime(2026, 1, 1, tzinfo=UTC),
                          datetime.datetime(2027, 1, 1, tzinfo=UTC))),
        # not base64
        b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
    ],
    ids=["text", "empty", "key-only", "garbage-block", "not-base64"],
)  # fmt: skip
def test_a_file_without_readable_certificates_is_named(content: bytes) -> None:
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.certificates(content, "/etc/ponto/ca.crt", "TLS CA")
    assert str(caught.value) == "cannot read TLS CA /etc/ponto/ca.crt: it holds no PEM certificate"


def write_pair(
    tmp_path: Path,
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
    key_bytes: bytes | None = None,
) -> tuple[bytes, str, bytes, str]:
    now = datetime.datetime.now(UTC)
    cert_pem = pem(certificate(key, now, now + datetime.timedelta(days=1)))
    if key_bytes is None:
        key_bytes = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    (tmp_path / "tls.crt").write_bytes(cert_pem)
    (tmp_path / "tls.key").write_bytes(key_bytes)
    return cert_pem, str(tmp_path / "tls.crt"), key_bytes, str(tmp_path / "tls.key")


@pytest.mark.parametrize("key", [EC_KEY, RSA_KEY], ids=["ec", "rsa"])
def test_a_key_and_its_certificate_pass(
    tmp_path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
) -> None:
    cert_pem, cert_path, key_pem, key_path = write_pair(tmp_path, key)
    leaf = tlsfiles.check_pair(cert_pem, cert_path, key_pem, key_path)
    assert leaf.der == x509.load_pem_x509_certificate(cert_pem).public_bytes(
        serialization.Encoding.DER
    )


@pytest.mark.parametrize(
    ("cert_key", "key"),
    [(EC_KEY, OTHER_EC_KEY), (RSA_KEY, EC_KEY), (EC_KEY, RSA_KEY)],
    ids=["same-type", "rsa-cert", "ec-cert"],
)
def test_a_key_not_the_certificates_is_named_whatever_its_type(
    tmp_path: Path,
    cert_key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
) -> None:
    """Another key of the certificate's type is a mismatch to OpenSSL; one of
    another type is no mismatch but a slot without a certificate
    (NO_CERTIFICATE_ASSIGNED). Either way the key is readable: the wrong one."""
    other = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    args = write_pair(tmp_path, cert_key, other)
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.check_pair(*args)
    assert str(caught.value) == (f"the TLS key {args[3]} is not the key of certificate {args[1]}")


def test_a_small_rsa_key_that_grpc_takes_passes(tmp_path: Path) -> None:
    """gRPC's TLS (BoringSSL) has no security levels: an RSA-1024 pair works
    with it, and cryptography passed it. OpenSSL's default level refuses it
    (EE_KEY_TOO_SMALL), which must not stop the process at start, least of
    all blaming the key file."""
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    cert_pem, cert_path, key_pem, key_path = write_pair(tmp_path, small)
    leaf = tlsfiles.check_pair(cert_pem, cert_path, key_pem, key_path)
    assert leaf.der == x509.load_pem_x509_certificate(cert_pem).public_bytes(
        serialization.Encoding.DER
    )


def test_the_old_x509_certificate_label_is_read() -> None:
    """'X509 CERTIFICATE' is OpenSSL's (and cryptography's) old name for a
    certificate block; gRPC reads it."""
    now = datetime.datetime(2026, 12, 2, tzinfo=UTC)
    old = pem(certificate(EC_KEY, now, now + datetime.timedelta(days=1))).replace(
        b"CERTIFICATE-----", b"X509 CERTIFICATE-----"
    )
    [found] = tlsfiles.certificates(old, "old.pem", "TLS CA")
    assert found.not_valid_after == now + datetime.timedelta(days=1)


@pytest.mark.parametrize(
    "format_",
    [serialization.PrivateFormat.PKCS8, serialization.PrivateFormat.TraditionalOpenSSL],
    ids=["pkcs8", "traditional"],
)
def test_an_encrypted_key_is_named_without_asking_for_a_password(
    tmp_path: Path, format_: serialization.PrivateFormat
) -> None:
    encrypted = EC_KEY.private_bytes(
        serialization.Encoding.PEM, format_, serialization.BestAvailableEncryption(b"secret")
    )
    args = write_pair(tmp_path, EC_KEY, encrypted)
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.check_pair(*args)
    assert str(caught.value) == (
        f"cannot read TLS key {args[3]}: it is encrypted; give it unencrypted"
    )


@pytest.mark.parametrize(
    "content",
    [b"hello\n", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"],
    ids=["text", "garbage-key"],
)
def test_a_key_file_without_a_readable_key_is_named(tmp_path: Path, content: bytes) -> None:
    args = write_pair(tmp_path, EC_KEY, content)
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.check_pair(*args)
    assert str(caught.value) == f"cannot read TLS key {args[3]}: it holds no PEM private key"


def test_dates_are_checked_with_leeway_before_and_none_after() -> None:
    start = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    end = datetime.datetime(2027, 12, 2, 12, 0, tzinfo=UTC)
    cert = tlsfiles.Certificate(b"", start, end)
    leeway = tlsfiles.NOT_YET_VALID_LEEWAY
    tlsfiles.check_validity(cert, "c.crt", "TLS certificate", start - leeway)
    tlsfiles.check_validity(cert, "c.crt", "TLS certificate", end)
    with pytest.raises(tlsfiles.TlsFileError, match="is not valid before 2026-12-02 12:00:00 UTC"):
        tlsfiles.check_validity(
            cert, "c.crt", "TLS certificate", start - leeway - datetime.timedelta(seconds=1)
        )
    with pytest.raises(tlsfiles.TlsFileError, match="expired on 2027-12-02 12:00:00 UTC"):
        tlsfiles.check_validity(
            cert, "c.crt", "TLS certificate", end + datetime.timedelta(seconds=1)
        )


def test_a_proxy_with_tls_on_does_not_load_cryptography(tmp_path: Path) -> None:
    """cryptography costs a worker some 9 MB of RSS; a proxy loads it only for
    a tenant's JWT issuer. Checking its TLS files at start must not load it."""
    bundle = make_bundle(tmp_path / "pki")
    script = textwrap.dedent(
        f"""
        import datetime, sys
        import dataplane.run
        from ponto.grpcconn import ClientOptions
        ClientOptions(
            tls_ca={bundle.path("ca.crt")!r},
            tls_cert={bundle.path("proxy.crt")!r},
            tls_key={bundle.path("proxy.key")!r},
        ).check_files(datetime.datetime.now(datetime.UTC))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("cryptography", "jwt")))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("make", "name"),
    [(ed25519.Ed25519PrivateKey.generate, "Ed25519"), (ed448.Ed448PrivateKey.generate, "Ed448")],
)
def test_an_eddsa_certificate_gRPC_cannot_use_is_refused(
    tmp_path: Path, make: Callable[[], ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey], name: str
) -> None:
    """OpenSSL reads the pair, but every handshake of a process given it would
    fail (trial 7: NO_COMMON_SIGNATURE_ALGORITHMS, blamed on the peer)."""
    key = make()
    now = datetime.datetime.now(UTC)
    cert = certificate(key, now, now + datetime.timedelta(days=1))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ed.crt").write_bytes(pem(cert))
    (tmp_path / "ed.key").write_bytes(key_pem)
    cert_path = str(tmp_path / "ed.crt")
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.check_pair(pem(cert), cert_path, key_pem, str(tmp_path / "ed.key"))
    assert str(caught.value) == (
        f"the TLS certificate {cert_path} is for an {name} key, which gRPC's TLS cannot use "
        "(no common signature algorithm): issue it for an ECDSA (P-256, P-384) or RSA key"
    )
    # As a CA it is only read: what it signed is for gRPC to check.
    (found,) = tlsfiles.certificates(pem(cert), cert_path, "TLS CA")
    assert found.key_algorithm == bytes.fromhex("2b6570" if name == "Ed25519" else "2b6571")


def test_an_rsa_pss_certificate_gRPC_cannot_read_is_refused(tmp_path: Path) -> None:
    """BoringSSL does not parse id-RSASSA-PSS public keys: a server given one
    fails to bind ('Invalid cert chain file' on gRPC's stderr, 'Failed to bind
    to address' raised), as if its address were taken. cryptography cannot
    make such a key: OpenSSL's command line does."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    cert_path, key_path = str(tmp_path / "pss.crt"), str(tmp_path / "pss.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa-pss", "-pkeyopt", "rsa_keygen_bits:2048",
         "-nodes", "-keyout", key_path, "-out", cert_path, "-subj", "/CN=pss", "-days", "2"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    cert_pem, key_pem = Path(cert_path).read_bytes(), Path(key_path).read_bytes()
    with pytest.raises(tlsfiles.TlsFileError) as caught:
        tlsfiles.check_pair(cert_pem, cert_path, key_pem, key_path)
    assert str(caught.value) == (
        f"the TLS certificate {cert_path} is for an RSA-PSS key, which gRPC's TLS cannot use "
        "(it cannot read an RSA-PSS key): issue it for an ECDSA (P-256, P-384) or RSA key"
    )


def with_extensions(*extensions: tuple[x509.ExtensionType, bool]) -> x509.Certificate:
    now = datetime.datetime.now(UTC)
    return certificate(EC_KEY, now, now + datetime.timedelta(days=1), *extensions)


SAN = x509.SubjectAlternativeName([x509.DNSName("localhost")])
BASIC = x509.BasicConstraints(ca=False, path_length=None)


def eku(*usages: x509.ObjectIdentifier) -> x509.ExtendedKeyUsage:
    return x509.ExtendedKeyUsage(list(usages))


@pytest.mark.parametrize(
    "extensions",
    [
        (),
        ((BASIC, True), (SAN, False)),
        ((eku(ExtendedKeyUsageOID.SERVER_AUTH), False),),
        ((BASIC, True), (eku(ExtendedKeyUsageOID.CLIENT_AUTH), True), (SAN, False)),
        ((eku(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH), False),),
        ((eku(ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE), False),),
        ((eku(ExtendedKeyUsageOID.CODE_SIGNING, ExtendedKeyUsageOID.OCSP_SIGNING), False),),
    ],
    ids=["none", "others", "server", "critical-client", "both", "any", "neither"],
)
def test_the_extended_key_usages_read_from_the_der_are_cryptographys(
    extensions: tuple[tuple[x509.ExtensionType, bool], ...],
) -> None:
    cert = with_extensions(*extensions)
    [read] = tlsfiles.certificates(pem(cert), "c.crt", "TLS certificate")
    try:
        theirs = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        assert read.usages is None
    else:
        assert read.usages == frozenset(_oid_der(oid) for oid in theirs)


def _oid_der(oid: x509.ObjectIdentifier) -> bytes:
    """The DER content of an OID, as tlsfiles keeps it."""
    first, second, *rest = (int(arc) for arc in oid.dotted_string.split("."))
    out = bytearray([40 * first + second])
    for arc in rest:
        chunk, left = [arc & 0x7F], arc >> 7
        while left:
            chunk.append(0x80 | (left & 0x7F))
            left >>= 7
        out += bytes(reversed(chunk))
    return bytes(out)


SERVER_ONLY = "its extended key usage is serverAuth, not clientAuth; issue it with clientAuth"
CLIENT_ONLY = "its extended key usage is clientAuth, not serverAuth; issue it with serverAuth"
NEITHER = "its extended key usage states neither serverAuth nor clientAuth; issue it with {}"
ANY = (
    "its extended key usage is anyExtendedKeyUsage, which gRPC's TLS does not take; "
    "issue it with {}"
)


@pytest.mark.parametrize(
    ("usages", "as_server", "as_client"),
    [
        (None, "", ""),
        ((ExtendedKeyUsageOID.SERVER_AUTH,), "", SERVER_ONLY),
        ((ExtendedKeyUsageOID.CLIENT_AUTH,), CLIENT_ONLY, ""),
        ((ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH), "", ""),
        (
            (ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE,),
            ANY.format("serverAuth"),
            ANY.format("clientAuth"),
        ),
        (
            (ExtendedKeyUsageOID.CODE_SIGNING,),
            NEITHER.format("serverAuth"),
            NEITHER.format("clientAuth"),
        ),
    ],
)
def test_a_certificate_is_refused_only_for_a_purpose_its_usages_exclude(
    usages: tuple[x509.ObjectIdentifier, ...] | None, as_server: str, as_client: str
) -> None:
    """gRPC takes such a certificate and fails every handshake with it."""
    cert = with_extensions(*(() if usages is None else ((eku(*usages), False),)))
    [read] = tlsfiles.certificates(pem(cert), "c.crt", "TLS certificate")
    for usage, says, role in (
        (tlsfiles.SERVER_AUTH, as_server, "server"),
        (tlsfiles.CLIENT_AUTH, as_client, "client"),
    ):
        if not says:
            tlsfiles.check_purpose(read, "c.crt", "TLS certificate", usage)
            continue
        with pytest.raises(tlsfiles.TlsFileError) as refused:
            tlsfiles.check_purpose(read, "c.crt", "TLS certificate", usage)
        assert str(refused.value) == f"the TLS certificate c.crt is not for a TLS {role}: {says}"
    if usages == (ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE,):
        # Go's TLS takes it, and etcd is Go's: its client certificate passes.
        tlsfiles.check_purpose(
            read, "c.crt", "TLS certificate", tlsfiles.CLIENT_AUTH, any_usage=True
        )
