"""Checks of TLS files before gRPC is given them.

gRPC core takes whatever bytes it is handed and fails later, and far from the
cause: a server whose key is not its certificate's cannot bind ("Failed to bind
to address", read as a port in use), a client's channel cannot be made ("Failed
to create security handshaker", retried forever), and an expired certificate of
our own shows up as the peer closing the connection. These checks say what is
wrong with which file, in one line, before any of that.

Pure: the callers read the files and the clock (ponto.grpcconn).
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization


class TlsFileError(ValueError):
    """A TLS file that cannot be used; the message names the file and why."""


def certificates(pem: bytes, path: str, what: str) -> list[x509.Certificate]:
    """The certificates of a PEM file (a leaf and its chain, or CAs), in file
    order; TlsFileError when it holds none or one that does not parse."""
    try:
        found = x509.load_pem_x509_certificates(pem)
    except ValueError:
        found = []
    if not found:
        raise TlsFileError(f"cannot read {what} {path}: it holds no PEM certificate")
    return found


def check_pair(cert_pem: bytes, cert_path: str, key_pem: bytes, key_path: str) -> x509.Certificate:
    """The leaf certificate of `cert_pem`, checked to be the certificate of the
    private key in `key_pem`; TlsFileError naming the file at fault."""
    leaf = certificates(cert_pem, cert_path, "TLS certificate")[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:  # cryptography's word for an encrypted key given no password
        raise TlsFileError(
            f"cannot read TLS key {key_path}: it is encrypted; give it unencrypted"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsFileError(f"cannot read TLS key {key_path}: it holds no PEM private key") from None
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*raw) != leaf.public_key().public_bytes(*raw):
        raise TlsFileError(
            f"cannot read TLS key {key_path}: the key in {key_path} is not the key of "
            f"certificate {cert_path}"
        )
    return leaf


# A certificate whose start is this close ahead is not refused: certificates
# issued moments ago on a machine whose clock runs ahead (Helm's, which cannot
# backdate them) would turn seconds of skew into a crash loop, where the
# process would otherwise start and its peers' handshakes work once the time
# comes (ponto.pki backdates its own by as much).
NOT_YET_VALID_LEEWAY = datetime.timedelta(minutes=5)


def check_validity(cert: x509.Certificate, path: str, what: str, now: datetime.datetime) -> None:
    """TlsFileError when `cert` has expired, or is not valid for more than
    NOT_YET_VALID_LEEWAY still, at `now` (aware)."""
    if now > cert.not_valid_after_utc:
        raise TlsFileError(f"the {what} {path} expired on {_date(cert.not_valid_after_utc)}")
    if now + NOT_YET_VALID_LEEWAY < cert.not_valid_before_utc:
        raise TlsFileError(
            f"the {what} {path} is not valid before {_date(cert.not_valid_before_utc)} "
            "(if it was just issued, check this machine's clock)"
        )


def _date(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")
