"""Times as people read them in messages, lists and the audit trail."""

from __future__ import annotations

import time


def utc(t: float) -> str:
    """Unix seconds as RFC 3339 UTC to the second (2027-01-31T12:00:00Z); the
    number itself for a value that is no time (a refused request's nonsense)."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return repr(t)
