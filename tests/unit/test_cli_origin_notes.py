"""`pontoctl get origins`' notes: replicas sized by capacity but shared by weight."""

from __future__ import annotations

from controlplane.cli import _origin_notes
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_cli_older_plane import OlderPlane, pontoctl


def origin(name: str, capacity: int, weight: int = 100, **kw: object) -> pb.Origin:
    fields: dict[str, object] = {"region": "us-east", "models": ["llama"], **kw}
    return pb.Origin(name=name, capacity=capacity, weight=weight, **fields)  # type: ignore[arg-type]


def test_capacities_at_equal_weights_are_noted() -> None:
    """Trial 95: replicas of capacity 8 and 2 at weight 100 each; under load
    the capacity-2 one queued while a capacity-8 one had room, and nothing
    said that weights, not capacities, share a full region."""
    notes = _origin_notes([origin("r1", 8), origin("r5", 2), origin("r3", 4)])
    assert notes == [
        "note: region us-east: capacities per unit of weight differ "
        "(r1 8/100, r3 4/100, r5 2/100): a full region is shared by weight, not "
        "capacity, so the smaller replicas queue while larger ones have room; give "
        'weights in proportion to capacities (docs/routing.md, "The load bound")'
    ]


def test_weights_in_proportion_or_unsized_origins_are_not_noted() -> None:
    assert _origin_notes([origin("r1", 8, 400), origin("r5", 2, 100), origin("r3", 5, 200)]) == []
    # No capacity stated, drained, another region or another model: not compared.
    assert _origin_notes([origin("r1", 8), origin("r2", 0)]) == []
    assert _origin_notes([origin("r1", 8), origin("r2", 2, drained=True)]) == []
    assert _origin_notes([origin("r1", 8), origin("r2", 2, region="eu-west")]) == []
    assert _origin_notes([origin("r1", 8), origin("r2", 2, models=["embed"])]) == []


def test_one_note_per_region_for_origins_that_serve_several_models() -> None:
    both = ["llama", "embed"]
    notes = _origin_notes([origin("r1", 8, models=both), origin("r2", 2, models=both)])
    assert len(notes) == 1 and "(r1 8/100, r2 2/100)" in notes[0]


def test_origin_add_says_the_capacity_it_saved() -> None:
    """Trial 95: `origin add r6 ... --capacity 4` answered `saved (llama;
    weight 100)`, as one added with none."""
    plane = OlderPlane(frozenset())
    plane.regions["eu"] = pb.Region(name="eu")
    add = ("origin", "add", "o", "--url", "http://h:8000/v1", "--region", "eu", "--models", "m")
    assert (
        pontoctl(plane, *add, "--capacity", "4")
        == "origin o in eu saved (m; weight 100; capacity 4)"
    )
    assert pontoctl(plane, "origin", "add", "p", *add[3:]) == "origin p in eu saved (m; weight 100)"
