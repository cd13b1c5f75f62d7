"""What https origins are verified against: the system's trust store, and a CA
bundle the operator names (`--origin-ca` of ponto-proxy and ponto-control).

An origin behind a private CA (an inference cluster's own, a service mesh's)
is refused as `ClientConnectorCertificateError` until both processes trust
that CA: the proxy to call the origin, the control plane to probe it and
scrape its load. Without the flag each uses the system's store, which
OpenSSL's `SSL_CERT_FILE` and `SSL_CERT_DIR` may replace as a whole.
"""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

from ponto.tlsfiles import TlsFileError, certificates

__all__ = ["TlsFileError", "origin_ca_flag", "origin_ssl_context"]


def origin_ssl_context(path: str) -> ssl.SSLContext | None:
    """None for "" (the HTTP client's default: the system's store); else a
    verifying client context trusting the system's store and the
    certificates of the PEM file at `path`. TlsFileError, naming the file, when
    it cannot be read or holds no certificate."""
    if not path:
        return None
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read origin CA {path}: {exc.strerror or exc}") from exc
    certificates(pem, path, "origin CA")
    context = ssl.create_default_context()
    context.load_verify_locations(cafile=path)
    return context


def origin_ca_flag(parser: argparse.ArgumentParser, path: str) -> ssl.SSLContext | None:
    """`origin_ssl_context` of the --origin-ca flag, read once, when the flags
    are; a file that cannot be used ends the process in one line (argparse's
    error() would put the whole usage before it)."""
    try:
        return origin_ssl_context(path)
    except TlsFileError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc} (--origin-ca)\n")
