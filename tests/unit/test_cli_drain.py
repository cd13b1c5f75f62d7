"""`pontoctl drain|undrain region|origin NAME` against fake stubs: one already in
that state is said to be and left alone; the control plane's warnings (a model
left with no origin) are gathered for main to print."""

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


@pytest.mark.parametrize(
    ("verb", "drained", "said"),
    [("drain", True, "is already drained"), ("undrain", False, "is not drained")],
)
@pytest.mark.parametrize(("kind", "name"), [("region", "us"), ("origin", "o1")])
def test_one_already_in_that_state_is_said_to_be_and_left_alone(
    verb: str, drained: bool, said: str, kind: str, name: str
) -> None:
    stub = Stub(drained=drained, warnings=[WARNING])
    assert pontoctl(stub, verb, kind, name) == (f"{kind} {name} {said}: nothing changed", [])
    assert stub.DrainRegion.requests == stub.DrainOrigin.requests == []


def test_an_unknown_name_goes_to_the_control_plane_to_be_refused() -> None:
    stub = Stub(drained=False, warnings=[])
    assert pontoctl(stub, "undrain", "region", "mars")[0] == "region mars undrained"
    assert stub.DrainRegion.requests == [apb.DrainRequest(name="mars", drained=False)]
