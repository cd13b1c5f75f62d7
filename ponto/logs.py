"""Logging set-up shared by every Ponto process: one line per record, to stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, tag: str = "") -> None:
    """Log at `level` to stderr; `tag` (e.g. a proxy worker's "w1") starts every
    line, for processes that share one stream."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"{tag} " if tag else ""
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Per-request access lines cost more than the proxying itself.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
