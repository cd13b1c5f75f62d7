"""The `--redis` URL's check, apart from redis-py: a proxy without a regional
cache never imports it (about 10 MB of memory and 17,000 objects for the
garbage collector to walk)."""

from __future__ import annotations

import inspect
import logging
import os
import re
import stat
from pathlib import Path
from urllib.parse import SplitResult, parse_qs, parse_qsl, urlencode, urlsplit

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")


class RegionURLError(ValueError):
    """A --redis value that cannot name a Redis server."""


def check_url(url: str) -> str:
    """The URL as given when it names a Redis server as redis-py reads one
    (redis://HOST:PORT/DB, rediss://..., unix:///PATH) and its query options
    are ones redis-py's connections take; RegionURLError (one line, the URL
    redacted) if not. The message never holds the URL parser's own text: it
    quotes the part it could not read, which is a password holding a `/`
    (base64 does) or a `?` (review finding 1)."""
    problem = _problem(url)
    if problem is not None:
        raise RegionURLError(f"--redis {redact(url)!r}: {problem}")
    return url


def _problem(url: str) -> str | None:
    """What is wrong with `url` as a --redis value, None when nothing."""
    parts = _split(url)
    if parts is None:
        return f"{EXPECTED}; {ENCODE}"
    if parts.scheme not in SCHEMES:
        return EXPECTED
    if parts.scheme == "unix":
        if not parts.path:
            return EXPECTED
    else:
        db = parts.path.strip("/")  # redis-py takes /0/ as /0
        if not parts.hostname or (db and not db.isdigit()) or parts.port == 0:
            return f"{EXPECTED}{'; ' + ENCODE if '@' in parts.netloc else ''}"
    return _option_problem(parts.scheme, parts.query)


EXPECTED = "expected redis://HOST:PORT/DB (or rediss://, unix://)"
ENCODE = (
    "a password holding /, ?, #, @, & or % must be percent-encoded (%2F, %3F, %23, %40, %26, "
    "%25), or given in --redis-password-file"
)
# Options the proxy sets itself, from its deadlines and pool sizes: in the
# URL they would win (redis-py lets the URL's options override the keyword
# arguments), and `decode_responses` would turn the cache's bytes into str
# (review of 7042a7c).
PROXY_SET: frozenset[str] = frozenset(
    {
        "decode_responses",
        "driver_info",
        "encoding",
        "encoding_errors",
        "health_check_interval",
        "max_connections",
        "retry",
        "retry_on_error",
        "retry_on_timeout",
        "socket_connect_timeout",
        "socket_timeout",
        "timeout",
    }
)
# A query option's name as redis-py takes them (socket_timeout, ssl_ca_certs).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _split(url: str) -> SplitResult | None:
    """urlsplit(url) when it splits cleanly, else None: the parser refused it
    (a port that is not a number), or a `@` or `#` is left past the host (a
    password holding `/`, `?` or `#` that was not percent-encoded ends the
    host early; a Redis URL has no fragment), or a query option is not a name.
    Only a URL that splits cleanly is shown, redacted (see `redact`)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError when not a number in range
    except ValueError:
        return None
    if parts.fragment or "#" in url or "@" in parts.path:
        return None
    names = [name for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
    if not all(_NAME.fullmatch(name) for name in names):
        return None
    return parts


def _option_problem(scheme: str, query: str) -> str | None:
    """Why the URL's query options would fail every connection, None when
    they would not. redis-py passes an option it does not know to the
    connection's constructor, which then raises TypeError at every connect
    (review finding 4: `?socket_timout=1` looked like an outage, retried for
    good); it checks the values of some options (`socket_timeout=abc`)."""
    if not query:
        return None
    # Imported here: only a proxy with --redis gets this far (module docstring).
    from redis.asyncio.connection import parse_url  # noqa: PLC0415

    pairs = parse_qsl(query, keep_blank_values=True)
    # What follows a password option may be the rest of a password holding
    # `&` that was not percent-encoded: never named (review: "unknown query
    # option Xyz9" showed part of ?password=Abc&Xyz9).
    cut = next((i for i, (name, _) in enumerate(pairs) if name.lower() == "password"), len(pairs))
    taken = _option_names(scheme)
    if any(name not in taken for name, _ in pairs[cut + 1 :]):
        return f"an unknown query option follows password=; {ENCODE}"
    unknown = sorted({name for name, _ in pairs[: cut + 1]} - taken)  # its name may show
    if unknown:
        return (
            f"unknown query option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)} (redis-py takes lower-case ones, e.g. ssl_ca_certs, "
            "client_name, password)"
        )
    set_here = sorted({name for name, _ in pairs} & PROXY_SET)
    if set_here:
        return (
            f"query option{'s' if len(set_here) > 1 else ''} {', '.join(set_here)} "
            "set by the proxy itself (from its deadlines and pool): leave "
            f"{'them' if len(set_here) > 1 else 'it'} out"
        )
    try:
        parse_url(f"redis://h?{query}")
    except ValueError as exc:  # redis-py's text names the option, not its value
        return str(exc)
    return None


def _option_names(scheme: str) -> frozenset[str]:
    """The query options redis-py takes in a URL of `scheme`: its pool's and
    its connection class's keyword arguments, read from their signatures (so
    they follow the installed redis-py)."""
    from redis.asyncio import connection as rc  # noqa: PLC0415

    cls: type = {"unix": rc.UnixDomainSocketConnection, "rediss": rc.SSLConnection}.get(
        scheme, rc.Connection
    )
    names: set[str] = set()
    for owner in (*cls.__mro__, *rc.BlockingConnectionPool.__mro__):
        init = vars(owner).get("__init__")
        if init is None or owner is object:
            continue
        for param in inspect.signature(init).parameters.values():
            if param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                names.add(param.name)
    names.discard("self")
    return frozenset(names)


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
    option), for logs and error messages. The user part is everything up to
    the last `@` of the host part, and a URL that does not split cleanly
    (`_split`) is shown as its scheme and `…` alone: a password holding a `?`,
    `#` or `/` that was not percent-encoded was shown whole when the URL was
    cut at its first `?` before its `@` was looked for (review finding 1)."""
    parts = _split(url)
    if parts is None:
        scheme, sep, _ = url.partition("://")
        return f"{scheme}://…" if sep and _NAME.fullmatch(scheme) else "…"
    _, at, host = parts.netloc.rpartition("@")
    query = ""
    if parts.query:
        options = parse_qsl(parts.query, keep_blank_values=True)
        cut = next((i for i, (k, _) in enumerate(options) if k.lower() == "password"), -1)
        more = ""
        if cut >= 0:
            # What follows may be the password's rest, cut at an `&` that was
            # not percent-encoded: hidden with it (review of 7042a7c).
            more = "&…" if cut + 1 < len(options) else ""
            options = [*options[:cut], (options[cut][0], "***")]
        query = "?" + urlencode(options, safe="*/:") + more
    return f"{parts.scheme}://{'***@' if at else ''}{host}{parts.path}{query}"


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
