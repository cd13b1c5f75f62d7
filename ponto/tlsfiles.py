"""Checks of TLS files before gRPC is given them.

gRPC core takes whatever bytes it is handed and fails later, and far from the
cause: a server whose key is not its certificate's cannot bind ("Failed to bind
to address", read as a port in use), a client's channel cannot be made ("Failed
to create security handshaker", retried forever), and an expired certificate of
our own shows up as the peer closing the connection. These checks say what is
wrong with which file, in one line, before any of that.

They use OpenSSL through the standard `ssl` module, which asyncio has loaded
already, and read the validity dates, the key's algorithm and the extended key
usages from the certificate's DER themselves:
`cryptography` would cost every proxy worker some 9 MB of memory (the proxy
imports it only for a tenant's JWT issuer, dataplane.auth.authenticator).

The callers read the files and the clock (ponto.grpcconn); `check_pair` has
OpenSSL read the certificate and key again by path, as the `ssl` module takes
no private key from memory.
"""

from __future__ import annotations

import binascii
import datetime
import re
import ssl
from base64 import b64decode
from dataclasses import dataclass

# A PEM block: its label and its base64 body (RFC 7468).
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)


# "X509 CERTIFICATE" is the old name, which OpenSSL (gRPC's BoringSSL too) and
# cryptography read as a certificate.
_CERTIFICATE_LABELS = frozenset((b"CERTIFICATE", b"X509 CERTIFICATE"))

# OpenSSL's reasons for a readable key that is not the certificate's: another
# key of its type, or (NO_CERTIFICATE_ASSIGNED) a key of another type, which
# OpenSSL files apart from the certificate rather than comparing it.
_NOT_THE_KEY = frozenset(("KEY_VALUES_MISMATCH", "KEY_TYPE_MISMATCH", "NO_CERTIFICATE_ASSIGNED"))


# Keys OpenSSL reads but gRPC's TLS (BoringSSL) cannot use, by their SPKI
# algorithm OID: it offers no EdDSA signature algorithm (every handshake of a
# process given one would fail, its peer told only that the handshake did),
# and it does not parse RSASSA-PSS public keys at all (the server fails to
# bind, which reads as an address in use: "Invalid cert chain file" only on
# gRPC's stderr). An RSA key whose certificate is signed with PSS is an
# ordinary rsaEncryption key here, and works.
_NO_TLS_KEYS = {
    bytes.fromhex("2b6570"): ("Ed25519", "no common signature algorithm"),  # 1.3.101.112
    bytes.fromhex("2b6571"): ("Ed448", "no common signature algorithm"),  # 1.3.101.113
    # 1.2.840.113549.1.1.10, id-RSASSA-PSS
    bytes.fromhex("2a864886f70d01010a"): ("RSA-PSS", "it cannot read an RSA-PSS key"),
}


class TlsFileError(ValueError):
    """A TLS file that cannot be used; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class Certificate:
    """A parsed certificate: its DER and its validity, aware UTC datetimes."""

    der: bytes
    not_valid_before: datetime.datetime
    not_valid_after: datetime.datetime
    # The OID of its public key's algorithm (subjectPublicKeyInfo), DER content.
    key_algorithm: bytes = b""
    # Its extended key usages (OIDs, DER content); None without the extension,
    # which allows every purpose (RFC 5280 4.2.1.12).
    usages: frozenset[bytes] | None = None


def certificates(pem: bytes, path: str, what: str) -> list[Certificate]:
    """The certificates of a PEM file (a leaf and its chain, or CAs), in file
    order; TlsFileError when it holds none or one that does not parse."""
    found: list[Certificate] = []
    for label, body in _PEM_BLOCK.findall(pem):
        if label not in _CERTIFICATE_LABELS:
            continue
        try:
            der = b64decode(re.sub(rb"\s+", b"", body), validate=True)
            # OpenSSL's parse, the one gRPC's will make of the same bytes.
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=der)
            found.append(Certificate(der, *_fields(der)))
        except (binascii.Error, ssl.SSLError, ValueError):
            found = []
            break
    if not found:
        raise TlsFileError(f"cannot read {what} {path}: it holds no PEM certificate")
    return found


def check_pair(cert_pem: bytes, cert_path: str, key_pem: bytes, key_path: str) -> Certificate:
    """The leaf certificate of `cert_pem`, checked to be the certificate of the
    private key in `key_pem`; TlsFileError naming the file at fault. OpenSSL
    reads both files again at their paths for the match (see the module)."""
    leaf = certificates(cert_pem, cert_path, "TLS certificate")[0]
    unusable = _NO_TLS_KEYS.get(leaf.key_algorithm)
    if unusable:
        kind, why = unusable
        raise TlsFileError(
            f"the TLS certificate {cert_path} is for an {kind} key, which gRPC's TLS "
            f"cannot use ({why}): issue it for an ECDSA (P-256, P-384) or RSA key"
        )
    labels = [label for label, _ in _PEM_BLOCK.findall(key_pem) if label.endswith(b"PRIVATE KEY")]
    if not labels:
        raise TlsFileError(f"cannot read TLS key {key_path}: it holds no PEM private key")
    if labels[0] == b"ENCRYPTED PRIVATE KEY" or b"Proc-Type: 4,ENCRYPTED" in key_pem:
        raise TlsFileError(f"cannot read TLS key {key_path}: it is encrypted; give it unencrypted")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # Security level 0: gRPC's TLS (BoringSSL) has no levels and takes, say,
    # an RSA-1024 key that OpenSSL's default level refuses (EE_KEY_TOO_SMALL,
    # CA_KEY_TOO_SMALL). This context only reads the files, never connects.
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        # A password callback, so OpenSSL never asks a terminal for one.
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except ssl.SSLError as exc:
        if exc.reason in _NOT_THE_KEY:
            raise TlsFileError(
                f"the TLS key {key_path} is not the key of certificate {cert_path}"
            ) from None
        raise TlsFileError(f"cannot read TLS key {key_path}: it holds no PEM private key") from None
    except OSError as exc:  # the file went away since the caller read it
        raise TlsFileError(f"cannot read TLS key {key_path}: {exc.strerror}") from None
    return leaf


def _no_password() -> bytes:
    return b""


# A certificate whose start is this close ahead is not refused: certificates
# issued moments ago on a machine whose clock runs ahead (Helm's, which cannot
# backdate them) would turn seconds of skew into a crash loop, where the
# process would otherwise start and its peers' handshakes work once the time
# comes (ponto.pki backdates its own by as much).
NOT_YET_VALID_LEEWAY = datetime.timedelta(minutes=5)


def check_validity(cert: Certificate, path: str, what: str, now: datetime.datetime) -> None:
    """TlsFileError when `cert` has expired, or is not valid for more than
    NOT_YET_VALID_LEEWAY still, at `now` (aware)."""
    if now > cert.not_valid_after:
        raise TlsFileError(f"the {what} {path} expired on {_date(cert.not_valid_after)}")
    if now + NOT_YET_VALID_LEEWAY < cert.not_valid_before:
        raise TlsFileError(
            f"the {what} {path} is not valid before {_date(cert.not_valid_before)} "
            "(if it was just issued, check this machine's clock)"
        )


# Extended key usages (RFC 5280 4.2.1.12), DER content of their OIDs.
SERVER_AUTH = bytes.fromhex("2b06010505070301")  # 1.3.6.1.5.5.7.3.1
CLIENT_AUTH = bytes.fromhex("2b06010505070302")  # 1.3.6.1.5.5.7.3.2
_ANY_USAGE = bytes.fromhex("551d2500")  # 2.5.29.37.0, anyExtendedKeyUsage
_PURPOSES = {SERVER_AUTH: ("server", "serverAuth"), CLIENT_AUTH: ("client", "clientAuth")}


def check_purpose(
    cert: Certificate, path: str, what: str, usage: bytes, *, any_usage: bool = False
) -> None:
    """TlsFileError when `cert` states extended key usages and `usage`
    (SERVER_AUTH, CLIENT_AUTH) is not among them. gRPC's TLS takes such a
    certificate and fails every handshake: a control plane serving a client's
    certificate, its clients told "unsupported certificate purpose"; a client
    presenting a server's, the server closing the socket unexplained. gRPC's
    TLS (BoringSSL) does not take anyExtendedKeyUsage for either (review 43:
    "unsupported certificate purpose"); Go's does, and etcd's peers are
    Go's: `any_usage` lets it pass there."""
    if cert.usages is None or usage in cert.usages:
        return
    if any_usage and _ANY_USAGE in cert.usages:
        return
    role, name = _PURPOSES[usage]
    others = [other for u, (_, other) in _PURPOSES.items() if u in cert.usages]
    if others:
        stated = f"is {others[0]}, not {name}"
    elif _ANY_USAGE in cert.usages:
        stated = "is anyExtendedKeyUsage, which gRPC's TLS does not take"
    else:
        stated = "states neither serverAuth nor clientAuth"
    raise TlsFileError(
        f"the {what} {path} is not for a TLS {role}: its extended key usage {stated}; "
        f"issue it with {name}"
    )


def _date(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


# DER tags (X.509 uses only one-byte tags).
_SEQUENCE = 0x30
_UTC_TIME = 0x17
_GENERALIZED_TIME = 0x18
_VERSION = 0xA0  # [0] EXPLICIT, before the serial number when present
_OID = 0x06


def _fields(
    der: bytes,
) -> tuple[datetime.datetime, datetime.datetime, bytes, frozenset[bytes] | None]:
    """notBefore, notAfter, the public key's algorithm OID and the extended key
    usages of an X.509 certificate's DER (RFC 5280 4.1): Certificate ::=
    SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber,
    signature, issuer, validity SEQUENCE { notBefore, notAfter }, subject,
    subjectPublicKeyInfo SEQUENCE { algorithm SEQUENCE { OID, ... }, ... },
    [1] issuerUniqueID OPTIONAL, [2] subjectUniqueID OPTIONAL,
    [3] extensions OPTIONAL } ... }. ValueError when the bytes are not that shape."""
    at, end = 0, len(der)
    for what in ("Certificate", "tbsCertificate"):
        at, end = _expect(der, at, end, _SEQUENCE, what)
    tag, _, next_at = _tlv(der, at, end)
    if tag == _VERSION:
        at = next_at
    for _field in ("serialNumber", "signature", "issuer"):
        _, _, at = _tlv(der, at, end)
    at, validity_end = _expect(der, at, end, _SEQUENCE, "validity")
    before_tag, before_at, before_end = _tlv(der, at, validity_end)
    after_tag, after_at, after_end = _tlv(der, before_end, validity_end)
    _, _, at = _tlv(der, validity_end, end)  # subject
    spki_at, spki_end = _expect(der, at, end, _SEQUENCE, "subjectPublicKeyInfo")
    at, algorithm_end = _expect(der, spki_at, spki_end, _SEQUENCE, "key algorithm")
    oid_at, oid_end = _expect(der, at, algorithm_end, _OID, "key algorithm OID")
    try:
        usages = _usages(der, spki_end, end)
    except ValueError:  # extensions OpenSSL took and this reading cannot follow
        usages = None  # leaves the purpose to the handshake, as before this check
    return (
        _time(before_tag, der[before_at:before_end]),
        _time(after_tag, der[after_at:after_end]),
        der[oid_at:oid_end],
        usages,
    )


_EXTENSIONS = 0xA3  # [3] EXPLICIT
_BOOLEAN = 0x01
_OCTET_STRING = 0x04
_EXTENDED_KEY_USAGE = bytes.fromhex("551d25")  # 2.5.29.37


def _usages(der: bytes, at: int, end: int) -> frozenset[bytes] | None:
    """The extended key usages in the tbsCertificate's fields after its
    subjectPublicKeyInfo (at..end), or None without the extension: past the
    unique IDs, [3] EXPLICIT Extensions ::= SEQUENCE OF Extension { OID,
    critical BOOLEAN DEFAULT FALSE, OCTET STRING holding, for extKeyUsage,
    a SEQUENCE OF OID }."""
    while at < end:
        tag, content_at, at = _tlv(der, at, end)
        if tag == _EXTENSIONS:  # else an issuer or subject unique ID
            at, end = _expect(der, content_at, at, _SEQUENCE, "extensions")
            break
    else:
        return None
    while at < end:
        extension_at, at = _expect(der, at, end, _SEQUENCE, "extension")
        oid_at, oid_end = _expect(der, extension_at, at, _OID, "extension OID")
        if der[oid_at:oid_end] != _EXTENDED_KEY_USAGE:
            continue
        tag, value_at, value_end = _tlv(der, oid_end, at)
        if tag == _BOOLEAN:  # critical
            tag, value_at, value_end = _tlv(der, value_end, at)
        if tag != _OCTET_STRING:
            raise ValueError("no extension value")
        at, end = _expect(der, value_at, value_end, _SEQUENCE, "extended key usages")
        usages = set()
        while at < end:
            oid_at, at = _expect(der, at, end, _OID, "extended key usage OID")
            usages.add(der[oid_at:at])
        return frozenset(usages)
    return None


def _expect(der: bytes, at: int, end: int, tag: int, what: str) -> tuple[int, int]:
    """(where its content starts, where it ends) of the element at `at`,
    which must have `tag`; ValueError naming `what` otherwise."""
    found, content_at, content_end = _tlv(der, at, end)
    if found != tag:
        raise ValueError(f"no {what}")
    return content_at, content_end


def _tlv(der: bytes, at: int, end: int) -> tuple[int, int, int]:
    """(tag, where its content starts, where it ends) of the element at `at`."""
    if at + 2 > end:
        raise ValueError("truncated")
    tag, length = der[at], der[at + 1]
    at += 2
    if length & 0x80:
        count = length & 0x7F
        if not 1 <= count <= 4 or at + count > end:
            raise ValueError("bad length")
        length = int.from_bytes(der[at : at + count], "big")
        at += count
    if at + length > end:
        raise ValueError("truncated")
    return tag, at, at + length


def _time(tag: int, value: bytes) -> datetime.datetime:
    """A UTCTime (YYMMDDHHMMSSZ; years 50-99 are 19xx) or GeneralizedTime
    (YYYYMMDDHHMMSSZ), the two forms RFC 5280 allows."""
    text = value.decode("ascii")
    if tag == _UTC_TIME and len(text) == 13:
        year = int(text[:2])
        text = ("19" if year >= 50 else "20") + text
    elif tag != _GENERALIZED_TIME or len(text) != 15:
        raise ValueError("not an RFC 5280 time")
    parsed = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ")
    return parsed.replace(tzinfo=datetime.UTC)
