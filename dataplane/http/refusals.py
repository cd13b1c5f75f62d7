"""The log of refused requests: each refusal once, at INFO, never a traceback,
and never more lines than the log can bear.

A refusal is the client's fault (a bad body, a wrong key, a broken HTTP
message, a connection held open too long): the operator wants to see that it
happened and why, not a stack. A flood of them (a fuzzer, a broken client in a
loop) must not flood the log, so lines are rate-limited (dataplane.linebudget):
past `per_second` (with bursts of `burst`), refusals are counted but not
written, and the next line written says how many were skipped.

Pure but for the logger it writes to; the clock is injected.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from dataplane.linebudget import BURST, PER_SECOND, LineBudget
from ponto.apikeys import redact_keys

__all__ = ["RefusalLog", "printable", "redact_credentials", "refusals", "unmapped"]


class RefusalLog:
    """Writes one INFO line per refusal, at most `per_second` lines a second."""

    __slots__ = ("_budget", "_log")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        per_second: float = PER_SECOND,
        burst: float = BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._budget = LineBudget(per_second=per_second, burst=burst, clock=clock)

    @property
    def skipped(self) -> int:
        """Refusals not written since the last line."""
        return self._budget.skipped

    def reset(self) -> None:
        """Back to a full burst, as at start (for tests that share the process's log)."""
        self._budget.reset()

    def refused(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        request_id: str = "-",
        remote: str | None = None,
        what: str = "-",
        about: str = "",
    ) -> bool:
        """Record one refusal; True if a line was written.

        `what` names the request (``POST /v1/chat/completions``); `message` is
        the reason as the client was told it. Both are the client's text in
        part (a path, a quoted value): each is cut to 200 characters so a huge
        bad value cannot make a huge line, and its control characters are
        escaped so that it cannot end the line and forge others (trial 36),
        and a credential in it is redacted (a key or a token pasted where a
        model or a path goes; `redact_credentials`).
        `request_id` (the client's own, when it sent one the proxy kept) is
        escaped as they are, not cut.
        `about` (whose request it was, what the client is not told) follows
        the message, after its cut, so that a long message cannot cut it off.
        """
        skipped = self._budget.take()
        if skipped is None:
            return False
        self._log.info(
            "refused %s %s from %s: %s %s: %s%s%s",
            # A client's own id is printable ASCII (requestid), a backslash
            # allowed: escaped too, or its `\n` would read as the log's.
            printable(request_id),
            printable(redact_credentials(what[:200])),
            unmapped(remote) if remote else "-",
            status,
            code or "-",
            printable(redact_credentials(message[:200])),
            f" {printable(redact_credentials(about[:200]))}" if about else "",
            f" ({skipped} more {'refusal' if skipped == 1 else 'refusals'} not logged)"
            if skipped
            else "",
        )
        return True


def unmapped(remote: str) -> str:
    """A peer's address as the access log names its client: an IPv4 one that
    a dual-stack socket ("::", ponto.listening) gives as ``::ffff:a.b.c.d`` is
    ``a.b.c.d``, so that one client's refusals and answers are found under one
    address (review 323); any other as it is."""
    if remote.startswith("::ffff:") and "." in remote and ":" not in remote[7:]:
        return remote[7:]
    return remote


# A JWT's three base64url parts; the signature is what makes it a credential.
# Not inside a word ("keyJohn.smith.example" is no token): a token starts
# a path's segment, a value or a line, or follows a percent-escape, as the
# logs quote a path as sent ("/v1/models/Bearer%20eyJ...": the 0 ends "%20").
_JWT_IN_TEXT = re.compile(
    r"(?:(?<![A-Za-z0-9_-])|(?<=%[0-9A-Fa-f]{2}))"
    r"(eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*\.)[A-Za-z0-9_-]+"
)


def redact_credentials(text: str) -> str:
    """`text` with every credential a client may send written so that it no
    longer is one: an API key as ``sk-ponto-<id>-***`` (ponto.apikeys.redact_keys)
    and a JWT with its signature as ``***`` (its header and claims kept, which
    name the issuer and the subject).

    For the logs' quotes of a client's text (a path, a model name): a client
    that pastes its key or token there must not have it written where
    operators and log pipelines read it. Text that holds neither prefix is
    returned as it is, told in C."""
    if "eyJ" in text:
        text = _JWT_IN_TEXT.sub(r"\1***", text)
    return redact_keys(text)


def printable(text: str) -> str:
    """`text` with each character str.isprintable refuses (controls such as
    LF, CR, ESC and NUL; line and paragraph separators) written as its
    Python escape (`\\n`, `\\x1b`, `\\u2028`), a backslash doubled, and
    every other as it is. The backslash too, so that an escape in a line is
    always this function's: with it kept, a model named ``x\\nERROR ...``
    (a backslash and an n) was logged as a real line end would be, and the
    line could not tell which the client sent (trial 99)."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


refusals = RefusalLog(logging.getLogger("ponto.refusals"))
"""The process's refusal log; the HTTP boundary and the protocol layer share it."""
