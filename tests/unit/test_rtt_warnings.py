"""The RTT matrix's mistakes, warned of (a user trial: `region add us-east
--update --rtt eu-wst=75` exited 0 without a word, and RTTs on some regions
only switched RTT ordering off for the whole fleet unseen): by model.rtt_warnings,
with every region write's reply (PutRegion, DeleteRegion, DrainRegion, an
apply that changes regions), on pontoctl's stderr, and as notes below
`pontoctl get regions`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from controlplane.cli import main as pontoctl
from controlplane.model import rtt_warnings
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from tests.unit.test_alias_warnings import admin, warned
from tests.unit.test_audit import Clock, admin_server

OFF = "RTT ordering is off: proxies order every region by great-circle distance"


def test_an_rtt_to_a_region_that_does_not_exist_is_warned_of() -> None:
    [warning, partial] = rtt_warnings({"us-east": ["eu-wst"], "eu-west": ["us-east"]})
    assert partial.endswith("no RTT from us-east to eu-west")
    assert warning.startswith("region us-east's RTTs name regions that do not exist: eu-wst")
    assert "proxies ignore those entries" in warning


def test_rtts_on_some_regions_only_say_rtt_ordering_is_off() -> None:
    [warning] = rtt_warnings({"us-east": ["eu-west"], "eu-west": [], "ap": []})
    assert warning.startswith(OFF) and warning.endswith("none on region(s) ap, eu-west")


def test_missing_entries_name_the_regions_each_lacks() -> None:
    [warning] = rtt_warnings({"a": ["b"], "b": ["a"], "c": ["a"]})
    assert "RTT ordering is partial" in warning
    assert warning.endswith("no RTT from a to c; b to c; c to b")


def test_a_whole_matrix_none_at_all_or_one_region_is_no_mistake() -> None:
    assert rtt_warnings({"a": ["b"], "b": ["a"]}) == ()
    assert rtt_warnings({"a": [], "b": []}) == ()
    assert rtt_warnings({"a": []}) == ()
    assert rtt_warnings({}) == ()


def spec(name: str, **rtt_ms: float) -> apb.PutRegionRequest:
    return apb.PutRegionRequest(region=apb.RegionSpec(name=name, rtt_ms=rtt_ms), allow_update=True)


async def test_every_region_write_warns_while_the_matrix_is_incomplete() -> None:
    async with admin(MemoryStore()) as stub:
        assert await warned(stub.PutRegion(spec("us-east"))) == []
        # A misspelt peer: saved, and warned of; and the matrix is not whole.
        warnings = await warned(stub.PutRegion(spec("us-east", **{"eu-wst": 75})))
        assert warnings == [
            "region us-east's RTTs name regions that do not exist: eu-wst (misspelt, or not "
            "added yet): proxies ignore those entries"
        ]
        regions = (await stub.ListRegions(apb.ListRequest())).regions
        assert dict(regions[0].rtt_ms) == {"eu-wst": 75}
        [unknown, off] = await warned(stub.PutRegion(spec("eu-west")))
        assert "eu-wst" in unknown and off.startswith(OFF) and off.endswith("eu-west")
        # Fixed on both sides: nothing more to say.
        [off] = await warned(stub.PutRegion(spec("us-east", **{"eu-west": 75})))
        assert off.startswith(OFF)
        assert await warned(stub.PutRegion(spec("eu-west", **{"us-east": 75}))) == []
        assert await warned(stub.DrainRegion(apb.DrainRequest(name="eu-west", drained=True))) == []
        # A third region without RTTs switches it off again: said by the add,
        # and by a drain or delete of another region while it lasts.
        [off] = await warned(stub.PutRegion(spec("ap")))
        assert off.endswith("none on region(s) ap")
        drain = apb.DrainRequest(name="eu-west", drained=False)
        assert await warned(stub.DrainRegion(drain)) == [off]
        # Deleting it leaves the matrix whole again.
        assert await warned(stub.DeleteRegion(apb.DeleteRequest(name="ap"))) == []


async def test_an_apply_that_changes_regions_warns_of_the_matrix() -> None:
    doc = {
        "regions": [
            {"name": "us-east", "lat": 1, "lon": 1, "rtt_ms": {"eu-west": 75}},
            {"name": "eu-west", "lat": 2, "lon": 2},
        ]
    }
    async with admin(MemoryStore()) as stub:
        request = apb.ApplyRequest(document=json.dumps(doc))
        [off] = await warned(stub.Apply(request))
        assert off.startswith(OFF) and off.endswith("none on region(s) eu-west")
        # Nothing changed: nothing written, nothing warned of.
        assert await warned(stub.Apply(request)) == []


async def test_pontoctl_warns_on_stderr_and_notes_it_under_get_regions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await stub.PutRegion(spec("us-east"))
        await stub.PutRegion(spec("eu-west"))

        def ctl(*argv: str) -> Any:
            return asyncio.to_thread(pontoctl, ["--control-plane", stub.address, *argv])

        capsys.readouterr()
        assert await ctl("region", "add", "us-east", "--update", "--rtt", "eu-wst=75") == 0
        out = capsys.readouterr()
        lines = out.err.splitlines()
        assert len(lines) == 2 and all(line.startswith("warning: ") for line in lines)
        assert "do not exist: eu-wst" in lines[0] and OFF in lines[1]
        assert await ctl("get", "regions") == 0
        out = capsys.readouterr()
        notes = [line for line in out.out.splitlines() if line.startswith("note: ")]
        assert [n.removeprefix("note: ") for n in notes] == [
            w.removeprefix("warning: ") for w in lines
        ]
