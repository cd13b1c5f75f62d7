"""Times as people read them in messages, lists and the audit trail."""

from __future__ import annotations

import datetime
import time


def utc(t: float) -> str:
    """Unix seconds as RFC 3339 UTC to the second (2027-01-31T12:00:00Z); the
    number itself for a value that is no time (a refused request's nonsense)."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return repr(t)


def utc_ms(t: float) -> str:
    """Unix seconds as RFC 3339 UTC to the millisecond
    (2026-12-04T11:02:08.421Z), as the access log writes its times and
    `pontoctl get audit -o json` and the audit trail's log lines theirs."""
    when = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
