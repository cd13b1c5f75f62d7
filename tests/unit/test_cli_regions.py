"""`pontoctl get regions`' table: every setting of a region in a column."""

from __future__ import annotations

from controlplane.cli import _rows_regions, _table
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def test_get_regions_shows_the_spill_threshold() -> None:
    """Trial: only `-o yaml` showed a region's spill threshold."""
    resp = apb.ListRegionsResponse(
        regions=[
            pb.Region(name="us-east", latitude=38.9, longitude=-77.4, spill_threshold=0.9,
                      rtt_ms={"eu-west": 75.0}),
            pb.Region(name="eu-west", latitude=53.3, longitude=-6.3),
        ]
    )  # fmt: skip
    header, rows = _rows_regions(resp)
    spill = header.index("SPILL")
    assert [row[spill] for row in rows] == ["0.9", "default"]  # 0: the proxies' 0.8
    assert all(len(line) <= 100 for line in _table(header, rows).splitlines())
