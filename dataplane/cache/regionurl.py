"""The `--redis` URL's check, apart from redis-py: a proxy without a regional
cache never imports it (about 10 MB of memory and 17,000 objects for the
garbage collector to walk)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")


class RegionURLError(ValueError):
    """A --redis value that cannot name a Redis server."""


def check_url(url: str) -> str:
    """The URL as given when it names a Redis server as redis-py reads one
    (redis://HOST:PORT/DB, rediss://..., unix:///PATH); RegionURLError (one
    line) if not."""
    expected = f"--redis {redact(url)!r}: expected redis://HOST:PORT/DB (or rediss://, unix://)"
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


def url_password(url: str) -> str | None:
    """The password the URL gives redis-py, or None: in its user part
    (`redis://:PW@HOST`), or as a `password=` query option, which redis-py
    reads too and which then overrides a password passed apart (the file's)."""
    try:
        parts = urlsplit(url)
        in_user = parts.password
    except ValueError:
        return None
    if in_user:
        return in_user
    for name, values in parse_qs(parts.query).items():
        if name.lower() == "password" and values and values[0]:
            return values[0]
    return None


def redact(url: str) -> str:
    """The URL without a password (in its user part or a `password=` query
    option), for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, q, query = rest.partition("?")
    _, at, host = rest.rpartition("@")
    if q:
        options = [
            (k, "***" if k.lower() == "password" else v)
            for k, v in parse_qsl(query, keep_blank_values=True)
        ]
        query = urlencode(options, safe="*/:")
    return f"{scheme}{sep}{'***@' if at else ''}{host}{q}{query}"


def read_password(path: Path, *, warn: bool = True) -> str:
    """The Redis password in the file at `path` (--redis-password-file): its
    content less a UTF-8 byte order mark (an editor on Windows writes one) and
    trailing line breaks, kept otherwise as it is (a password may hold spaces
    or a `#`). ValueError (one line, never the content) when the file cannot
    be read, is not UTF-8, is empty or holds more than one line. A file that
    group or others may read is used, with one WARNING (as ssh does for a key,
    but not refused: a Kubernetes Secret volume is 0644 unless told otherwise);
    `warn` False leaves it out (a worker, whose supervisor warned). The group
    is named only when the proxy owns the file: one another user owns (a
    Kubernetes Secret mounted 0440 with the pod's fsGroup, as the chart does)
    is read through its group, which must then be allowed to."""
    try:
        st = path.stat()
        mode, owner = st.st_mode, st.st_uid
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ValueError(f"--redis-password-file {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--redis-password-file {path} is not UTF-8 text") from None
    if warn and (who := _readers(mode, owned=owner == os.geteuid())):
        log.warning(
            "--redis-password-file %s may be read by %s (mode %o): chmod 600 it",
            path,
            who,
            stat.S_IMODE(mode),
        )
    password = text.rstrip("\r\n")
    if not password:
        raise ValueError(f"--redis-password-file {path} is empty")
    if "\n" in password or "\r" in password:
        raise ValueError(
            f"--redis-password-file {path} holds more than one line: "
            "it must hold the password alone"
        )
    return password


def _readers(mode: int, *, owned: bool) -> str:
    """Who besides the file's owner may read a file of `mode` (see
    read_password), "" when no one."""
    group = owned and bool(mode & stat.S_IRGRP)
    others = bool(mode & stat.S_IROTH)
    return " and ".join(w for w, may in (("group", group), ("others", others)) if may)
