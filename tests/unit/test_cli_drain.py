"""`pontoctl drain|undrain region|origin NAME` against fake stubs: one already in
that state is said to be and left alone (an undrain is still sent, for its
warnings); the control plane's warnings (a model left with no origin, an
origin its drained region keeps idle) are gathered for main to print."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.cli import _parser, run
from ponto.grpcconn import CallDefaults
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
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
    # The undrain is sent all the same (the control plane writes nothing): its
    # warnings say why it may still get no traffic.
    stub = Stub(drained=False, warnings=[UNROUTED])
    said = f"{kind} {name} is not drained: nothing changed"
    assert pontoctl(stub, "undrain", kind, name) == (said, [UNROUTED])
    method = stub.DrainRegion if kind == "region" else stub.DrainOrigin
    assert method.requests == [apb.DrainRequest(name=name, drained=False)]


def test_an_unknown_name_goes_to_the_control_plane_to_be_refused() -> None:
    stub = Stub(drained=False, warnings=[])
    assert pontoctl(stub, "undrain", "region", "mars")[0] == "region mars undrained"
    assert stub.DrainRegion.requests == [apb.DrainRequest(name="mars", drained=False)]
