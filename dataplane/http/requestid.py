"""Request ids: the one every answer carries in `x-request-id`.

A client may bring its own id (to find its request in our logs and the
origin's); it is kept only when it is short and plain, since it is echoed
to the client, sent to origins and written to logs. Anything else is
replaced by a new id, and the client's is neither echoed nor forwarded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

__all__ = ["MAX_CLIENT_ID", "RequestIds", "accepted_client_id", "origin_request_id"]

MAX_CLIENT_ID: Final = 128
# New ids drawn per system call (RequestIds): 2 KB of os.urandom.
BATCH: Final = 256


def accepted_client_id(value: str | None) -> str | None:
    """The client's own id when at most MAX_CLIENT_ID characters of printable
    ASCII without spaces; None otherwise (absent, empty, too long, or holding
    a space, a control or a non-ASCII character)."""
    if not value or len(value) > MAX_CLIENT_ID:
        return None
    # In ASCII, printable is " " to "~": without the space, "!" to "~" (in C,
    # where a per-character loop in Python costs 20 times more).
    if not (value.isascii() and value.isprintable()) or " " in value:
        return None
    return value


def origin_request_id(headers: Mapping[str, str], ours: str) -> str | None:
    """The x-request-id an origin answered with, when it is its own (not
    `ours`, which it may echo) and would be taken from a client
    (accepted_client_id): an origin's control character would fail the
    client's answer, a lone surrogate its access line. None otherwise."""
    theirs = headers.get("x-request-id")
    return accepted_client_id(theirs) if theirs != ours else None


class RequestIds:
    """New ids: 32 hex digits, unique across processes and restarts, that
    say nothing of the proxy's traffic.

    A random 64-bit prefix per instance, then 64 random bits per id, drawn
    from os.urandom BATCH ids at a time: one system call per BATCH requests
    (one per id would cost each request one), two proxies, workers or
    restarts share a prefix with probability 2**-64, and an instance's ids
    collide with probability n**2 / 2**65 after n of them. A counter as the
    id's tail let any client, a key or none, read how many requests of every
    tenant a proxy had answered between two of its own (trial 62); random
    tails say nothing of it. (A keyed BLAKE2b of a counter did the same at
    some 6,000 instructions an id, 0.8 % of a proxied request's:
    bench/instructions.py.) One instance per app: a module global would be
    copied into every worker started from this process.
    """

    __slots__ = ("_made", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._made: list[str] = []  # ids drawn and not handed out yet

    def next(self) -> str:
        made = self._made
        if not made:
            made = self._made = self._draw()
        return made.pop()

    def _draw(self) -> list[str]:
        tails = os.urandom(8 * BATCH).hex()
        prefix = self._prefix
        return [prefix + tails[i : i + 16] for i in range(0, 16 * BATCH, 16)]

    def of(self, client_id: str | None) -> str:
        """The id of a request that came with `client_id` (the header's value)."""
        if client_id is None:  # most requests: no call to check it, nor next's
            made = self._made
            if not made:
                made = self._made = self._draw()
            return made.pop()
        return accepted_client_id(client_id) or self.next()
