"""An origin call's header lines made as its headers are set
(Forwarder.origin_headers) are the bytes aiohttp's serialisation makes of
those headers, and a request head with them (wire.request_head) is the head
without them. Headers they could not stand for exactly get no lines."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.http_writer import _serialize_headers
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from yarl import URL

from dataplane.metrics import Metrics
from dataplane.upstream.forwarder import Forwarder, UpstreamSettings
from dataplane.upstream.wire import _Endpoint, request_head

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def forwarder(*configured: str) -> Forwarder:
    return Forwarder(Metrics(), UpstreamSettings(forward_headers=configured))


def serialised(headers: CIMultiDict[str]) -> bytes:
    return _serialize_headers("L", headers)[len("L\r\n") : -2]


@pytest.mark.parametrize(
    ("incoming", "traceparent"),
    [
        ({}, None),
        ({"user-agent": "OpenAI/Python 1.40.0", "accept": "application/json"}, None),
        ({"user-agent": "sdk", "x-hint": "blue"}, TRACE),
        ({"traceparent": TRACE, "tracestate": "a=1", "accept": "*/*"}, None),
        ({"user-agent": "é" * 600}, None),  # cut to MAX_FORWARDED_VALUE bytes
    ],
)
def test_the_lines_are_aiohttps_bytes_of_the_headers(
    incoming: dict[str, str], traceparent: str | None
) -> None:
    fw = forwarder("X-Hint")
    headers, lines = fw.origin_headers(CIMultiDict(incoming), "7ad6aac716e7e2f8", traceparent)
    assert headers == fw.request_headers(CIMultiDict(incoming), "7ad6aac716e7e2f8", traceparent)
    if "é" in incoming.get("user-agent", ""):
        assert lines is None  # not ASCII: aiohttp writes its UTF-8
    else:
        assert lines == serialised(headers)


@pytest.mark.parametrize(
    ("incoming", "request_id", "traceparent"),
    [
        # A client's trace context that the proxy's replaces (in its place)
        # and whose state it takes out.
        ({"traceparent": TRACE, "tracestate": "a=1"}, "r1", TRACE),
        ({"tracestate": "a=1"}, "r1", TRACE),
        ({"user-agent": "a\tb"}, "r1", None),
        ({}, "r\x01", None),
    ],
)
def test_headers_the_lines_cannot_stand_for_get_none(
    incoming: dict[str, str], request_id: str, traceparent: str | None
) -> None:
    assert forwarder().origin_headers(CIMultiDict(incoming), request_id, traceparent)[1] is None


async def test_a_head_with_the_lines_is_the_head_without_them() -> None:
    fw = forwarder()
    headers, lines = fw.origin_headers(CIMultiDict({"user-agent": "sdk"}), "r1", TRACE)
    assert lines is not None
    loop = asyncio.get_running_loop()
    for url in ("http://o1:8000/v1/chat/completions", "http://[::1]/v1/embeddings?x=%20"):
        endpoint = _Endpoint(URL(url), loop)
        plain = request_head(endpoint, endpoint.line, headers, 12)
        assert request_head(endpoint, endpoint.line, headers, 12, lines) == plain
        assert plain.startswith(f"{endpoint.line}\r\ncontent-type: application/json\r\n".encode())


def test_a_header_configured_twice_is_one_line() -> None:
    """--forward-headers x-hint,X-Hint: the origin gets one x-hint line,
    as the headers hold one (review 324: the lines held two)."""
    fw = forwarder("x-hint", "X-Hint")
    headers, lines = fw.origin_headers(CIMultiDict({"x-hint": "blue"}), "r1")
    assert headers.getall("x-hint") == ["blue"]
    assert lines == serialised(headers)
    assert lines is not None and lines.count(b"x-hint") == 1


_NAMES = st.sampled_from(
    ["x-hint", "X-Hint", "x-b", "accept", "user-agent", "traceparent", "tracestate", "x-request-id"]
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    configured=st.lists(_NAMES, max_size=4),
    incoming=st.dictionaries(
        _NAMES.map(str.lower), st.text(st.sampled_from(list("ab 1\t\x01é=")), max_size=5)
    ),
    traceparent=st.sampled_from([None, TRACE]),
)
def test_any_lines_are_aiohttps_bytes(
    configured: list[str], incoming: dict[str, str], traceparent: str | None
) -> None:
    """Differential: whatever is configured and sent, lines made are the
    serialisation of the headers they stand for."""
    headers, lines = forwarder(*configured).origin_headers(CIMultiDict(incoming), "r1", traceparent)
    assert lines is None or lines == serialised(headers)
