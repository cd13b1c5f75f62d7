"""The credential the proxy presents to an origin on the client's behalf.

Each origin may name its upstream credential in config, by environment
variable (`credential_env`) or file (`credential_file`, e.g. a mounted
Kubernetes Secret); the value itself is never in etcd or in the route table.
The proxy sends it as ``Authorization: Bearer <credential>`` in place of the
client's header (the client's key is never forwarded).

Files are re-read when their mtime, size or inode change, checked at most once
per `recheck_s` (a second), so a rotated secret is picked up without a restart
and without a stat per request. Rotate by atomic replace (write, then rename;
what Kubernetes does): a reader that catches a half-written file fails for up
to a second rather than sending a truncated credential.

The value is never logged, never put in an exception and never shown by
``repr``. Values must be visible ASCII without spaces (a header must not be
splittable by what is in a file).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

__all__ = ["CredentialError", "OriginCredentials"]


class CredentialError(Exception):
    """An origin's configured credential cannot be had (variable unset, file
    missing or unreadable, value unusable). The proxy answers 502.

    ``str(error)`` names the origin and the variable or path, never the value;
    it is meant for logs. `client_message` is what a client may see (no paths
    or variable names).
    """

    def __init__(self, origin: str, message: str) -> None:
        super().__init__(message)
        self.origin = origin

    @property
    def client_message(self) -> str:
        return f"The proxy has no usable credential for origin {self.origin!r}."


def _read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


class OriginCredentials:
    """One origin's upstream credential, resolved on use.

    `authorization()` returns the ``Authorization`` header value to send, or
    None when the origin has no credential configured. Call it per upstream
    request, from the event loop thread: with a file it may ``stat`` and read
    the file (small, local, at most once a second), otherwise it does no I/O.
    Not thread-safe (one event loop).
    """

    __slots__ = (
        "_checked_at",
        "_clock",
        "_env",
        "_environ",
        "_error",
        "_file",
        "_file_sig",
        "_header",
        "_read_file",
        "_recheck_s",
        "_stat",
        "_value",
        "origin",
    )

    def __init__(
        self,
        origin: str,
        *,
        credential_env: str | None = None,
        credential_file: str | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        stat: Callable[[str], os.stat_result] = os.stat,
        read_file: Callable[[str], bytes] = _read_bytes,
        recheck_s: float = 1.0,
    ) -> None:
        """No I/O here. Raises ValueError if both sources are named, or a name is
        empty (a config error, to be refused with the config)."""
        if credential_env is not None and credential_file is not None:
            raise ValueError(f"origin {origin!r}: set credential_env or credential_file, not both")
        if credential_env == "" or credential_file == "":
            raise ValueError(f"origin {origin!r}: an empty credential_env/credential_file")
        self.origin = origin
        self._env = credential_env
        self._file = credential_file
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._stat = stat
        self._read_file = read_file
        self._recheck_s = recheck_s
        self._value: str | None = None  # raw value behind _header (env source)
        self._header: str | None = None
        self._file_sig: tuple[int, int, int] | None = None
        self._checked_at: float | None = None
        self._error: str | None = None  # why the last file check failed

    @property
    def configured(self) -> bool:
        return self._env is not None or self._file is not None

    @property
    def source(self) -> str:
        """``env:<NAME>``, ``file:<path>`` or ``none``: safe to log."""
        if self._env is not None:
            return f"env:{self._env}"
        if self._file is not None:
            return f"file:{self._file}"
        return "none"

    def __repr__(self) -> str:
        return (
            f"OriginCredentials(origin={self.origin!r}, source={self.source!r}, value=<redacted>)"
        )

    def authorization(self) -> str | None:
        """``Bearer <credential>``, None if none is configured, or CredentialError."""
        if self._env is not None:
            return self._from_env(self._env)
        if self._file is not None:
            return self._from_file(self._file)
        return None

    def _from_env(self, name: str) -> str:
        value = self._environ.get(name)
        if value is None:
            raise CredentialError(
                self.origin, f"origin {self.origin!r}: credential variable {name!r} is not set"
            )
        if value is self._value and self._header is not None:
            return self._header  # the usual case: same object as last time
        header = self._to_header(value.strip(), f"credential variable {name!r}")
        self._value = value
        self._header = header
        return header

    def _from_file(self, path: str) -> str:
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < self._recheck_s:
            if self._error is not None:
                raise CredentialError(self.origin, self._error)
            assert self._header is not None
            return self._header
        self._checked_at = now
        try:
            st = self._stat(path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig == self._file_sig and self._header is not None:
                return self._header
            raw = self._read_file(path)
        except OSError as e:
            self._fail(
                f"origin {self.origin!r}: cannot read credential file {path!r}: {e.strerror}"
            )
        try:
            value = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            self._fail(f"origin {self.origin!r}: credential file {path!r} is not ASCII")
        try:
            header = self._to_header(value, f"credential file {path!r}")
        except CredentialError as e:
            self._fail(str(e))
        self._file_sig = sig
        self._header = header
        self._error = None
        return header

    def _fail(self, message: str) -> NoReturn:
        # Forget the last good value: the configured source is the truth, and a
        # deleted or emptied file means "stop using it". Retried after recheck_s.
        self._header = None
        self._file_sig = None
        self._error = message
        raise CredentialError(self.origin, message)

    def _to_header(self, value: str, what: str) -> str:
        if not value:
            raise CredentialError(self.origin, f"origin {self.origin!r}: {what} is empty")
        if value[:7].lower() == "bearer ":
            raise CredentialError(
                self.origin,
                f"origin {self.origin!r}: {what} must hold the bare credential, without 'Bearer '",
            )
        if not (value.isascii() and value.isprintable()) or " " in value:
            raise CredentialError(
                self.origin,
                f"origin {self.origin!r}: {what} must be visible ASCII without spaces",
            )
        return f"Bearer {value}"
