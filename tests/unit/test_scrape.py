"""dataplane.http.scrape: which Accept-Encoding values get a gzip scrape."""

from __future__ import annotations

import pytest

from dataplane.http.scrape import accepts_gzip

# A scrape's headers as Prometheus 3 sends them (its default Accept: the
# text format and OpenMetrics, by weight).
PROMETHEUS = {
    "Accept": (
        "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
        "application/openmetrics-text;version=0.0.1;q=0.5,"
        "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
        "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
    ),
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/3.0.1",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}


@pytest.mark.parametrize(
    ("accept_encoding", "gzip"),
    [
        ("gzip", True),  # Prometheus
        ("gzip, deflate, br, zstd", True),  # a browser
        ("X-GZIP", True),
        ("deflate, gzip;q=0.5", True),
        ("gzip; q=1.0", True),
        ("gzip;q=oops", True),  # a weight that does not parse is 1
        ("*", True),
        ("", False),
        ("identity", False),
        ("br, zstd", False),
        ("gzip;q=0", False),
        ("gzip;q=0.000", False),
        ("*;q=0", False),
        ("gzip;q=0, *", False),  # named, gzip is refused whatever `*` says
        ("*, gzip;q=0", False),
        ("gzipped", False),
    ],
)
def test_gzip_is_sent_only_where_accepted(accept_encoding: str, gzip: bool) -> None:
    assert accepts_gzip(accept_encoding) is gzip
