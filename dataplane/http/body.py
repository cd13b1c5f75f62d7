"""Request bodies: their read deadline, and their `Content-Encoding` decoded within
the body limit.

aiohttp's own request decoding is turned off (dataplane.http.edge passes
`auto_decompress=False`): it answered a corrupt gzip body with a 500 and
`br`/`zstd` with a text/plain "Please install Brotli". Here `identity`, `gzip`
and `deflate` are accepted, since the standard library decodes them with a
bound on the output, so a zip bomb stops at `limit` bytes of output;
every other coding is a 415 and a body that does not decode is a 400.

decode_body is pure: bytes in, bytes or an ApiError out.
"""

from __future__ import annotations

import zlib
from typing import Final

from dataplane.http.errors import ApiError

__all__ = ["BodyTimeout", "decode_body"]

_GZIP: Final = 16 + zlib.MAX_WBITS
_ZLIB: Final = zlib.MAX_WBITS
_RAW_DEFLATE: Final = -zlib.MAX_WBITS
# gzip allows members one after another (RFC 1952 2.2, what `cat a.gz b.gz`
# makes); clients send one. zlib hands back the input left after each member
# as a copy, so a body of many empty members (20 bytes each) would cost time
# quadratic in its size, on the event loop: 50,000 of them (1 MB) took 1 s.
MAX_GZIP_MEMBERS: Final = 16
# Codings one body may name: a client applies one. Each undone coding may
# decode up to the body limit, so the 2,700 that fit in a header line could
# cost that many times the limit.
MAX_CODINGS: Final = 4


class BodyTimeout(TimeoutError):
    """A request body did not arrive within the body deadline.

    Set on the request's payload by dataplane.http.edge, so the handler's read
    raises it.
    """


class OverFramed(Exception):
    """A chunked request body's framing passed the edge's bound
    (dataplane.http.edge.EdgeProtocol._over_framed): the rest is not read.

    Set on the request's payload by dataplane.http.edge, so the handler's read
    raises it.
    """


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """`raw` with its content codings undone, at most `limit` bytes.

    Codings are undone last first (RFC 9110 8.4). Raises ApiError: 415 for a
    coding other than identity, gzip (x-gzip) or deflate, or for more than
    MAX_CODINGS of them; 400 for a body that is not what its coding says;
    413 when the decoded body passes `limit`.
    """
    if not content_encoding:
        return raw
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    if len(codings) > MAX_CODINGS:
        raise ApiError(
            415,
            f"Content-Encoding names {len(codings)} codings; at most {MAX_CODINGS} are supported",
            code="unsupported_content_encoding",
        )
    for coding in reversed(codings):
        if coding in ("identity", ""):
            continue
        if coding in ("gzip", "x-gzip"):
            raw = _inflate(raw, _GZIP, coding, limit)
        elif coding == "deflate":
            # RFC 9110 says zlib-wrapped; some clients send raw deflate.
            raw = _inflate(raw, _ZLIB if _zlib_header(raw) else _RAW_DEFLATE, coding, limit)
        else:
            raise ApiError(
                415,
                f"Content-Encoding '{coding[:40]}' is not supported; "
                "send the body as identity, gzip or deflate",
                code="unsupported_content_encoding",
            )
    return raw


def _zlib_header(data: bytes) -> bool:
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def _inflate(data: bytes, wbits: int, coding: str, limit: int) -> bytes:
    """Every member of a gzip (at most MAX_GZIP_MEMBERS), or the one deflate
    stream, decoded to at most `limit`."""
    out = bytearray()
    for _ in range(MAX_GZIP_MEMBERS):
        d = zlib.decompressobj(wbits)
        try:
            out += d.decompress(data, limit + 1 - len(out))
        except zlib.error:
            raise _corrupt(coding) from None
        if len(out) > limit or d.unconsumed_tail:
            raise ApiError(
                413,
                f"request body is larger than the limit of {limit} bytes once decoded",
                code="body_too_large",
            )
        if not d.eof:
            raise _corrupt(coding)  # truncated
        data = d.unused_data
        if not data:
            return bytes(out)
        if wbits != _GZIP:
            raise _corrupt(coding)  # bytes after the one deflate stream
    raise ApiError(
        400,
        f"request body has more than {MAX_GZIP_MEMBERS} gzip members",
        code="invalid_content_encoding",
    )


def _corrupt(coding: str) -> ApiError:
    return ApiError(
        400,
        f"request body is not valid {coding} data (Content-Encoding: {coding})",
        code="invalid_content_encoding",
    )
