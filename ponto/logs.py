"""Logging set-up shared by every Ponto process: one line per record, to stderr,
each starting with its date and time in UTC (ISO 8601, milliseconds)."""

from __future__ import annotations

import logging
import sys
import time


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
