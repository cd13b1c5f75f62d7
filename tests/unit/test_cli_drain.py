"""`pontoctl drain|undrain region|origin NAME` against fake stubs: one already in
that state is said to be and left alone (an undrain is still asked for its
warnings, as a dry run); the control plane's warnings (a model left with no origin, an
origin its drained region keeps idle) are gathered for main to print."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from controlplane.cli import _parser, run
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import CallDefaults
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_admin_warnings import seed
from tests.unit.test_audit import Clock, admin_server
from tests.unit.test_cli_alias_warnings import Method

WARNING = (
    "no undrained origin serves model 'mistral' now (region 'us' was the last): proxies "
    "answer requests for it 503 no_healthy_origin until one is undrained"
)


class Recorded(Method):
    """A method that remembers its requests."""

    def __init__(self, response: Any, warnings: list[str]) -> None:
        super().__init__(response, warnings)
        self.requests: list[Any] = []

    def with_call(self, request: Any, timeout: float) -> Any:
        self.requests.append(request)
        return super().with_call(request, timeout)


class Stub:
    """Region us (drained as given) with origin o1; the drains warn."""

    def __init__(self, *, drained: bool, warnings: list[str]) -> None:
        regions = [pb.Region(name="us", drained=drained)]
        origins = [pb.Origin(name="o1", region="us", drained=drained)]
        self.ListRegions = Method(apb.ListRegionsResponse(regions=regions), [])
        self.ListOrigins = Method(apb.ListOriginsResponse(origins=origins), [])
        self.DrainRegion = Recorded(regions[0], warnings)
        self.DrainOrigin = Recorded(origins[0], warnings)


def pontoctl(stub: Stub, *argv: str) -> tuple[str, list[str]]:
    calls = CallDefaults(stub, timeout=5)
    return run(_parser().parse_args(list(argv)), calls), calls.warnings


@pytest.mark.parametrize(("kind", "name"), [("region", "us"), ("origin", "o1")])
def test_a_drain_that_strands_a_model_is_done_with_the_warning(kind: str, name: str) -> None:
    stub = Stub(drained=False, warnings=[WARNING])
    assert pontoctl(stub, "drain", kind, name) == (f"{kind} {name} drained", [WARNING])
    method = stub.DrainRegion if kind == "region" else stub.DrainOrigin
    assert method.requests == [apb.DrainRequest(name=name, drained=True)]


@pytest.mark.parametrize(("kind", "name"), [("region", "us"), ("origin", "o1")])
def test_a_drained_one_is_said_to_be_and_left_alone(kind: str, name: str) -> None:
    stub = Stub(drained=True, warnings=[WARNING])
    said = f"{kind} {name} is already drained: nothing changed"
    assert pontoctl(stub, "drain", kind, name) == (said, [])
    assert stub.DrainRegion.requests == stub.DrainOrigin.requests == []


UNROUTED = (
    "origin o1 is undrained, but its region us is drained: it gets no traffic until "
    "`pontoctl undrain region us`"
)


@pytest.mark.parametrize(("kind", "name"), [("region", "us"), ("origin", "o1")])
def test_an_undrained_one_is_said_to_be_with_what_keeps_it_idle(kind: str, name: str) -> None:
    # The undrain is asked as a dry run (the control plane writes nothing, so
    # a drain made since the listing stands): its warnings say why it may
    # still get no traffic.
    stub = Stub(drained=False, warnings=[UNROUTED])
    said = f"{kind} {name} is not drained: nothing changed"
    assert pontoctl(stub, "undrain", kind, name) == (said, [UNROUTED])
    method = stub.DrainRegion if kind == "region" else stub.DrainOrigin
    assert method.requests == [apb.DrainRequest(name=name, drained=False, dry_run=True)]


def test_an_unknown_name_goes_to_the_control_plane_to_be_refused() -> None:
    stub = Stub(drained=False, warnings=[])
    assert pontoctl(stub, "undrain", "region", "mars")[0] == "region mars undrained"
    assert stub.DrainRegion.requests == [apb.DrainRequest(name="mars", drained=False)]


class Racing:
    """A real Admin stub whose `listing` method answers, then another
    operator's call (`meanwhile`, given the real stub and the listing's
    answer) comes before pontoctl's next call: after each listing, or after
    the first `times` of them."""

    def __init__(
        self,
        stub: Any,
        listing: str,
        meanwhile: Callable[[Any, Any], None],
        times: int | None = None,
    ) -> None:
        self._stub = stub
        self._listing = listing
        self._meanwhile = meanwhile
        self.left = times

    def __getattr__(self, name: str) -> Any:
        stub = self._stub
        real = getattr(stub, name)
        if name != self._listing:
            return real
        racing = self

        class Listing:
            def with_call(self, request: Any, timeout: float) -> Any:
                answer = real.with_call(request, timeout=timeout)
                if racing.left is None or racing.left > 0:
                    racing._meanwhile(stub, answer[0])
                    racing.left = None if racing.left is None else racing.left - 1
                return answer

        return Listing()


def drain_us(stub: Any, _: Any) -> None:
    stub.DrainRegion.with_call(apb.DrainRequest(name="us", drained=True), timeout=5)


async def test_an_undrain_that_changes_nothing_leaves_a_drain_made_meanwhile() -> None:
    # pontoctl lists us as undrained, then asks for its warnings: that must
    # not undo another operator's drain made between the two calls, nor be
    # in the audit trail as an undrain.
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)

        def undrain() -> str:
            with grpc.insecure_channel(stub.address) as channel:
                racing = Racing(admin_pb2_grpc.AdminStub(channel), "ListRegions", drain_us)
                calls = CallDefaults(racing, timeout=5)
                return run(_parser().parse_args(["undrain", "region", "us"]), calls)

        said = await asyncio.to_thread(undrain)
        regions = {r.name: r.drained for r in (await stub.ListRegions(apb.ListRequest())).regions}
        audit = (await stub.ListAudit(apb.ListAuditRequest(limit=10))).entries
    assert said == "region us is not drained: nothing changed"
    assert regions["us"] is True, "the no-op undrain undid the drain made meanwhile"
    drains = [e.action for e in audit if e.target == "region/us" and "Drain" in e.action]
    assert drains == ["DrainRegion"]  # the other operator's; the dry run is not recorded


def set_capacity(stub: Any, listed: apb.ListOriginsResponse) -> None:
    [o] = [o for o in listed.origins if o.name == "o-us"]
    spec = apb.OriginSpec(
        name=o.name, base_url=o.base_url, region=o.region, models=o.models, capacity=8
    )
    stub.PutOrigin.with_call(apb.PutOriginRequest(origin=spec, allow_update=True), timeout=5)


async def test_an_origin_update_does_not_undo_a_change_made_since_it_read_the_origin() -> None:
    """Note 28: `origin add --update` read the origin, then wrote it whole
    with the settings it was not given as it had read them: another
    operator's change saved between the two calls was undone. The write is
    refused, and pontoctl reads and writes again: both changes are kept."""
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await seed(stub)

        def update() -> str:
            with grpc.insecure_channel(stub.address) as channel:
                real = admin_pb2_grpc.AdminStub(channel)
                calls = CallDefaults(Racing(real, "ListOrigins", set_capacity, 1), timeout=5)
                args = _parser().parse_args(["origin", "add", "o-us", "--update", "--weight", "7"])
                return run(args, calls)

        said = await asyncio.to_thread(update)
        [o] = [o for o in (await stub.ListOrigins(apb.ListRequest())).origins if o.name == "o-us"]
        assert (o.capacity, o.weight) == (8, 7), "the update undid the change made meanwhile"
        # What it changed of what it last read: the weight alone.
        assert said.endswith("changed: weight 100 -> 7"), said
