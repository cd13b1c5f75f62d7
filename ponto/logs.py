"""Logging set-up shared by every Ponto process: one line per record, to stderr,
each starting with its date and time in UTC (ISO 8601, milliseconds); and
`Throttled`, for a line that may repeat without end."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable


class UtcFormatter(logging.Formatter):
    """`%(asctime)s` as ``2026-12-01T01:02:03.456Z``: a line read days later, or
    next to another machine's, says when it happened without a time zone guess."""

    converter = staticmethod(time.gmtime)
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"


LINE_FORMAT = "%(asctime)s {tag}%(levelname)s %(name)s: %(message)s"


def formatter(tag: str = "") -> logging.Formatter:
    """The format of every Ponto log line; `tag` (e.g. "w1") follows the time."""
    return UtcFormatter(LINE_FORMAT.format(tag=f"{tag} " if tag else ""))


def setup_logging(level: str, tag: str = "") -> None:
    """Log at `level` to stderr; `tag` (e.g. a proxy worker's "w1") follows the
    time on every line, for processes that share one stream."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(tag))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Per-request access lines cost more than the proxying itself (the proxy's
    # own, --access-log, are written apart: dataplane/http/accesslog.py).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class Every:
    """The rate of a throttled line: `due()` admits at most one line per
    `every_s`, counts the ones it refuses in `unlogged`, and hands that count
    back (reset) with the next it admits, for the line to say. Not
    thread-safe (its owner guards it); the clock is injected."""

    __slots__ = ("_clock", "_every", "_last", "unlogged")

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every_s
        self._clock = clock
        self._last = -float("inf")
        self.unlogged = 0  # lines not written since the last one

    def due(self) -> int | None:
        """The lines refused since the last one admitted, if a line is
        admitted now; None (and one more refused) if not."""
        now = self._clock()
        if now - self._last < self._every:
            self.unlogged += 1
            return None
        self._last = now
        unlogged, self.unlogged = self.unlogged, 0
        return unlogged


class Throttled(Every):
    """One kind of log line, written at most once per `every_s`; the ones not
    written are counted, and the next line written says how many.

    For a condition that can repeat at any rate (a malformed message in a
    stream, a failing background task) and must neither flood the log nor go
    unseen. One per kind of line: two kinds sharing one would hide each other.
    Not thread-safe (one event loop's, or guarded by its owner); the clock is
    injected.
    """

    __slots__ = ("_log",)

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(every_s, clock)
        self._log = logger

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Write `msg % args` at `level` (with the traceback being handled when
        `exc_info`) unless a line was written less than `every_s` ago; True if written."""
        unlogged = self.due()
        if unlogged is None:
            return False
        if unlogged:
            msg, args = f"{msg} (%d more not logged)", (*args, unlogged)
        # None, not False, without one: a record's exc_info as a plain log
        # call leaves it (what tests and handlers check for "no traceback").
        self._log.log(level, msg, *args, exc_info=exc_info or None)
        return True


class ThrottledBy:
    """A Throttled line per key (an origin, say): each key's lines at most once
    per `every_s`, one key's never hiding another's. At most `max_keys` keys
    are kept: past them, the one whose line came longest ago is forgotten (its
    next line is written at once, and its count of lines not written is
    lost), so keys made from what requests do (the origins one tried) cannot
    grow without end over a process's life."""

    __slots__ = ("_clock", "_every_s", "_keys", "_log", "_max_keys")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 60.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self._every_s, self._clock = logger, every_s, clock
        self._max_keys = max_keys
        # In the order of their last line, written or not: the first is forgotten.
        self._keys: dict[str, Throttled] = {}

    def log(self, key: str, level: int, msg: str, *args: object) -> bool:
        """Throttled.log of `key`'s line; True if written."""
        keys = self._keys
        told = keys.pop(key, None)
        if told is None:
            if len(keys) >= self._max_keys:
                del keys[next(iter(keys))]
            told = Throttled(self._log, every_s=self._every_s, clock=self._clock)
        keys[key] = told
        return told.log(level, msg, *args)
