"""The answer to a scrape of /metrics: the text exposition, gzip-compressed
when the scraper accepts it.

Prometheus asks with `Accept-Encoding: gzip`; a proxy's exposition with a key
label is some 12,000 lines, 1.4 MB of text that gzip brings to some 50 kB.
aiohttp compresses the body as it sends it, in its executor for a body this
large (past `MAX_SYNC_CHUNK_SIZE`), so the event loop goes on serving.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.web_response import ContentCoding
from prometheus_client import CONTENT_TYPE_LATEST


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding value accepts gzip (RFC 9110 12.5.3):
    `gzip` or `x-gzip` with a weight above 0, or else `*` with one. A
    weight that does not parse counts as 1, as a value without one."""
    star = False
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 1.0
        if coding == "*":
            star = weight > 0
        else:
            return weight > 0
    return star


def scrape_answer(request: web.BaseRequest, exposition: bytes) -> web.Response:
    """A 200 of `exposition` (text format 0.0.4), gzip-compressed when
    `request` accepts gzip; `Vary: Accept-Encoding` either way."""
    answer = web.Response(
        body=exposition,
        headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST, hdrs.VARY: hdrs.ACCEPT_ENCODING},
    )
    if accepts_gzip(request.headers.get(hdrs.ACCEPT_ENCODING, "")):
        answer.enable_compression(ContentCoding.gzip)
    return answer
