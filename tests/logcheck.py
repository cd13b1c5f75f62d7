"""Log records as a failed assertion should show them: `assert not
errors(caplog.records)` lists each ERROR's logger, message and exception,
where a list of LogRecords showed only the logger and the start of the format
(an asyncio callback's ERROR named neither the callback nor what it raised)."""

from __future__ import annotations

import logging
from collections.abc import Iterable


def errors(records: Iterable[logging.LogRecord], *, tracebacks: bool = False) -> list[str]:
    """The records at ERROR or above (and, with `tracebacks`, any carrying an
    exception), each as "LEVEL logger: message [exception, and its cause]"."""
    lines = []
    for r in records:
        if r.levelno < logging.ERROR and not (tracebacks and r.exc_info):
            continue
        line = f"{r.levelname} {r.name}: {r.getMessage()}"
        if r.exc_info and r.exc_info[1] is not None:
            exc = r.exc_info[1]
            line += f" [{exc!r}" + (f" from {exc.__cause__!r}]" if exc.__cause__ else "]")
        lines.append(line)
    return lines
