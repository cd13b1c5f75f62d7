"""The `--redis` URL's check, apart from redis-py: a proxy without a regional
cache never imports it (about 10 MB of memory and 17,000 objects for the
garbage collector to walk)."""

from __future__ import annotations

from pathlib import Path
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


def read_password(path: Path) -> str:
    """The Redis password in the file at `path` (--redis-password-file): its
    content less trailing line breaks, kept otherwise as it is (a password may
    hold spaces or a `#`). ValueError (one line, never the content) when the
    file cannot be read, is not UTF-8, is empty or holds more than one line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--redis-password-file {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--redis-password-file {path} is not UTF-8 text") from None
    password = text.rstrip("\r\n")
    if not password:
        raise ValueError(f"--redis-password-file {path} is empty")
    if "\n" in password or "\r" in password:
        raise ValueError(
            f"--redis-password-file {path} holds more than one line: "
            "it must hold the password alone"
        )
    return password
