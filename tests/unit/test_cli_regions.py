"""`pontoctl get regions`' table: every setting of a region in a column."""

from __future__ import annotations

from controlplane.cli import _region_notes, _rows_regions, _table
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
    # 0 is the proxies' default, said with the value in force (a user trial).
    assert [row[spill] for row in rows] == ["0.9", "0.8 (default)"]
    assert all(len(line) <= 100 for line in _table(header, rows).splitlines())


def origin(name: str, region: str, *, drained: bool = False, healthy: bool = True) -> pb.Origin:
    return pb.Origin(name=name, region=region, drained=drained, healthy=healthy)


def test_get_regions_says_which_have_no_origin_serving() -> None:
    """A user trial: a region whose origins were all drained or unhealthy
    showed nothing of it."""
    regions = [
        pb.Region(name="us-east"),
        pb.Region(name="eu-west"),
        pb.Region(name="ap", drained=True),
        pb.Region(name="empty"),
    ]
    origins = [
        origin("o-us-1", "us-east"),
        origin("o-us-2", "us-east", healthy=False),
        origin("o-eu-1", "eu-west", drained=True),
        origin("o-eu-2", "eu-west", healthy=False),
        origin("o-ap", "ap"),
    ]
    header, rows = _rows_regions(apb.ListRegionsResponse(regions=regions), origins)
    serving = header.index("SERVING")
    assert [row[serving] for row in rows] == ["1/2", "0/2", "0/1", "0/0"]
    # A drained region says so in DRAINED; one with no origins, in SERVING.
    assert _region_notes(regions, origins) == [
        "note: region eu-west has no origin serving (drained: o-eu-1; unhealthy: o-eu-2): "
        "its proxies send requests to other regions' origins"
    ]
