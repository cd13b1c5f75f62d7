"""Logging set-up shared by every Ponto process: one line per record, to stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Per-request access lines cost more than the proxying itself.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
