"""/metrics as Prometheus scrapes it: gzip when asked, on the proxy's own
listener (EdgeRunner, whose whole-answer write leaves compression to aiohttp).

Prometheus asks with `Accept-Encoding: gzip`; a proxy's exposition with a key
label is some 12,000 lines (1.4 MB) of text, which it sent uncompressed."""

from __future__ import annotations

import gzip
from pathlib import Path

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from dataplane.http.state import METRICS
from tests.functional.edgestack import serve_on_edge
from tests.unit.test_scrape import PROMETHEUS


def requests(text: bytes) -> dict[str, float]:
    """ponto_requests_total of the test's endpoints by endpoint (the scrapes
    count themselves, and ages and process_* move between two reads)."""
    return {
        s.labels["endpoint"]: s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "ponto_requests_total" and s.labels["endpoint"].startswith("e")
    }


async def test_a_prometheus_scrape_is_answered_gzip_and_others_as_they_ask(
    tmp_path: Path,
) -> None:
    served = await serve_on_edge(tmp_path, "http://127.0.0.1:9/v1")
    try:
        metrics = served.app[METRICS]
        for i in range(2000):  # some 2,000 lines of series
            metrics.requests.labels(f"e{i}", "200").inc()
        url = f"http://127.0.0.1:{served.port}/metrics"
        async with aiohttp.ClientSession(
            auto_decompress=False, skip_auto_headers=["Accept-Encoding"]
        ) as s:
            async with s.get(url, headers=PROMETHEUS) as r:
                assert r.status == 200
                assert r.headers["Content-Encoding"] == "gzip"
                assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST  # as before
                assert r.headers["Vary"] == "Accept-Encoding"
                wire = await r.read()
            async with s.get(url) as r:  # no Accept-Encoding: the text as it is
                assert "Content-Encoding" not in r.headers
                plain = await r.read()
            async with s.get(url, headers={"Accept-Encoding": "gzip;q=0, deflate"}) as r:
                assert "Content-Encoding" not in r.headers  # gzip refused, deflate not offered
                refused = await r.read()
        text = gzip.decompress(wire)
        assert len(wire) * 10 < len(text)
        assert requests(text) == requests(plain) == requests(refused)
        assert requests(text) == {f"e{i}": 1.0 for i in range(2000)}
    finally:
        await served.runner.cleanup()
