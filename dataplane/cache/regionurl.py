"""The `--redis` URL's check, apart from redis-py: a proxy without a regional
cache never imports it (about 10 MB of memory and 17,000 objects for the
garbage collector to walk)."""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "unix")


class RegionURLError(ValueError):
    """A --redis value that cannot name a Redis server."""


def check_url(url: str) -> str:
    """The URL as given when it names a Redis server as redis-py reads one
    (redis://HOST:PORT/DB, rediss://..., unix:///PATH); RegionURLError (one
    line) if not."""
    expected = f"--redis {url!r}: expected redis://HOST:PORT/DB (or rediss://, unix://)"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when not a number in range
    except ValueError as exc:
        raise RegionURLError(f"{expected}: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise RegionURLError(expected)
    if parts.scheme == "unix":
        if not parts.path:
            raise RegionURLError(expected)
        return url
    db = parts.path.lstrip("/")
    if not parts.hostname or (db and not db.isdigit()) or port == 0:
        raise RegionURLError(expected)
    return url
