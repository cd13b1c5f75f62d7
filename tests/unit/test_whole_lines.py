"""A WholeAnswer's header lines (dataplane.http.reply._lines) are what
aiohttp serialises for the headers a web.Response would carry: the origin's,
ours set in turn, the limits' (made as lines by the limiter), then Server.
Headers they could not stand for exactly leave the answer a web.Response
(None)."""

from __future__ import annotations

import pytest
from aiohttp import hdrs, web
from aiohttp.http_writer import _serialize_headers
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from dataplane.http import reply
from dataplane.http.edge import WholeAnswer

OURS = [
    ("x-ponto-origin", "o1"),
    ("x-ponto-region", "eu"),
    ("x-ponto-attempts", "2"),
    ("x-request-id", "7ad6aac716e7e2f8"),
    ("x-ponto-cache", "miss"),
    ("x-ponto-cache-reason", "truncated"),
]
LIMITS = [("x-ratelimit-limit-requests", "100"), ("x-ratelimit-remaining-requests", "99")]
LIMIT_LINES = b"x-ratelimit-limit-requests: 100\r\nx-ratelimit-remaining-requests: 99\r\n"
# LIMITS[:n]'s lines, by n
LIMIT_LINES_OF = (b"", LIMIT_LINES[: LIMIT_LINES.index(b"\n") + 1], LIMIT_LINES)


def as_aiohttp(origin: list[tuple[str, str]], ours: list[tuple[str, str]]) -> bytes:
    """The header lines aiohttp writes for `origin` with `ours` set and a Server."""
    headers = CIMultiDict(origin)
    for name, value in ours:
        headers[name] = value
    headers.setdefault(hdrs.SERVER, "ponto")
    return _serialize_headers("S", headers)[len("S\r\n") : -2]


@pytest.mark.parametrize(
    "origin",
    [
        [],
        [("Content-Type", "application/json")],
        [("content-type", "application/json"), ("openai-processing-ms", "12"), ("x-a", "1")],
        [("x-a", "1"), ("X-A", "2")],
    ],
)
def test_lines_are_what_aiohttp_writes(origin: list[tuple[str, str]]) -> None:
    for _ in range(2):  # made, then remembered
        lines = reply._lines(CIMultiDict(origin), OURS, LIMIT_LINES)
        assert lines == as_aiohttp(origin, OURS + LIMITS)


@pytest.mark.parametrize(
    ("origin", "ours"),
    [
        # An origin's header of one of our names: ours takes its place.
        ([("X-Request-Id", "theirs"), ("x-a", "1")], OURS),
        ([("Age", "3")], OURS),
        # One aiohttp's prepare would not add again (the origin's are dropped).
        ([("Date", "Mon, 07 Dec 2026 04:25:38 GMT")], OURS),
        ([("server", "nginx")], OURS),
        # Not printable ASCII: aiohttp writes UTF-8, or refuses a control character.
        ([("x-a", "café")], OURS),
        ([("x-a", "a\tb")], OURS),
        ([], [*OURS, ("x-ponto-route", "a\x01b")]),
        ([], [("x-ponto-origin", "o\u00e9")]),
    ],
)
def test_lines_it_cannot_stand_for_leave_a_response(
    origin: list[tuple[str, str]], ours: list[tuple[str, str]]
) -> None:
    assert reply._lines(CIMultiDict(origin), ours, LIMIT_LINES) is None


def test_request_ids_are_not_remembered() -> None:
    reply._OUR_LINES.clear()
    reply._lines(CIMultiDict(), OURS, b"")
    assert ("x-request-id", "7ad6aac716e7e2f8") not in reply._OUR_LINES
    assert ("x-ponto-origin", "o1") in reply._OUR_LINES


def test_headers_read_are_made_whole_and_the_lines_dropped() -> None:
    origin = CIMultiDict([("Content-Type", "application/json")])
    lines = reply._lines(origin, OURS, b"")
    assert lines is not None
    answer = WholeAnswer(200, b"{}", lines, True, origin, list(OURS))
    before = answer.lines
    assert answer.headers["x-ponto-region"] == "eu"
    assert answer.headers[hdrs.SERVER] == "ponto"
    assert next(iter(answer.headers)) == "Content-Type"
    assert (before, answer.lines) == (lines, None)
    assert answer.status == 200 and answer.reason == "OK" and answer.body == b"{}"


def test_it_holds_what_aiohttp_s_own_init_sets() -> None:
    """WholeAnswer.__init__ stands for web.Response's (not called): every
    attribute aiohttp's sets is set, the headers made when read."""
    origin: CIMultiDict[str] = CIMultiDict()
    answer = WholeAnswer(200, b"x", b"", False, origin, [])
    own = {"lines", "typed", "_made", "_origin", "_ours"}
    assert set(vars(web.Response(body=b"x"))) == set(vars(answer)) - own | {"_headers"}


# An origin's names as the forwarder passes them (never Server, Date or the
# framing: forwarder.DROP_RESPONSE_HEADERS), some of them ours or a limit's.
_ORIGIN_NAMES = st.sampled_from(
    [
        "Content-Type",
        "content-type",
        "x-a",
        "X-A",
        "Age",
        "x-request-id",
        "X-RateLimit-Limit-Requests",
    ]
)
_OUR_NAMES = st.sampled_from([name for name, _ in OURS] + ["age", "x-ponto-route"])
# Mostly printable ASCII, so that most examples have lines to compare.
_VALUES = st.sampled_from(["1", "", "a b", "x:y", "v", "0", "w=1", "é", "a\tb"])


@settings(max_examples=1000, deadline=None, database=None)
@given(
    origin=st.lists(st.tuples(_ORIGIN_NAMES, _VALUES), max_size=5),
    ours=st.lists(st.tuples(_OUR_NAMES, _VALUES), max_size=6, unique_by=lambda pair: pair[0]),
    limits=st.sampled_from([0, 1, 2]),
)
def test_any_lines_are_what_aiohttp_writes(
    origin: list[tuple[str, str]], ours: list[tuple[str, str]], limits: int
) -> None:
    """Differential (review 324): whatever the headers, lines made (twice:
    made, then remembered) are aiohttp's bytes for them."""
    for _ in range(2):
        lines = reply._lines(CIMultiDict(origin), ours, LIMIT_LINES_OF[limits])
        assert lines is None or lines == as_aiohttp(origin, ours + LIMITS[:limits])
