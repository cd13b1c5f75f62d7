"""The forwarder's refusals of an origin's status and the comparison that
gates them on the hot path."""

from __future__ import annotations

from typing import cast

from multidict import CIMultiDict, CIMultiDictProxy

from dataplane.upstream.forwarder import MIN_REFUSED_STATUS, _refuse, _Retryable
from dataplane.upstream.wire import OriginResponse


class Answer:
    """What `_refuse` reads of an origin's answer: its status and headers."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.headers = CIMultiDictProxy(CIMultiDict({"location": "https://elsewhere/"}))


def refused(status: int) -> bool:
    try:
        # No tries: a 424 is refused too, the most `_refuse` refuses.
        _refuse(cast("OriginResponse", Answer(status)), None)
    except _Retryable:
        return True
    return False


def test_every_status_refused_is_at_least_the_gate_s() -> None:
    """The forwarder calls `_refuse` only for a status of MIN_REFUSED_STATUS
    or more: a refusal added under it would be skipped without a word."""
    statuses = [s for s in range(100, 600) if refused(s)]
    assert statuses and min(statuses) >= MIN_REFUSED_STATUS
    # And it is the least refusal, as its comment says (one under it would
    # call `_refuse` for answers that it passes).
    assert min(statuses) == MIN_REFUSED_STATUS
