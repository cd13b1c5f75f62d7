"""pontoctl and warnings: the ones replies carry are gathered (and printed by
main, tests/e2e/test_pontoctl.py), and `get tenants` marks the models no
origin serves that tenants name (aliases' targets, per-model routing and hedge
delays). Against fake stubs."""

from __future__ import annotations

from typing import Any

from controlplane.cli import ALIAS_NOTE, UNSERVED_NOTE, _parser, run
from ponto.grpcconn import WARNING_METADATA, CallDefaults
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

WARNING = (
    "no origin serves model 'sim-huge' now; requests for alias 'big' of tenant 'acme' "
    "will get 404 until one does"
)


def prompt(**aliases: str) -> pb.PromptPolicy:
    return pb.PromptPolicy(aliases=aliases)


class Done:
    """What a sync gRPC call gives besides its response."""

    def __init__(self, warnings: list[str]) -> None:
        self._trailing = [(WARNING_METADATA, w) for w in warnings] + [("other", "x")]

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self._trailing


class Method:
    def __init__(self, response: Any, warnings: list[str]) -> None:
        self.response, self.warnings = response, warnings

    def with_call(self, request: Any, timeout: float) -> tuple[Any, Done]:
        return self.response, Done(self.warnings)


class Stub:
    """The Admin calls of `tenant set` and `get tenants`; UpdateTenant warns."""

    def __init__(self, tenants: list[pb.Tenant], models: list[str], warnings: list[str]) -> None:
        origins = [pb.Origin(name="o1", models=models)]
        self.ListTenants = Method(apb.ListTenantsResponse(tenants=tenants), [])
        self.ListOrigins = Method(apb.ListOriginsResponse(origins=origins), [])
        self.UpdateTenant = Method(tenants[0], warnings)


def pontoctl(stub: Stub, *argv: str) -> tuple[str, list[str]]:
    calls = CallDefaults(stub, timeout=5)
    return run(_parser().parse_args(list(argv)), calls), calls.warnings


def test_pontoctl_gathers_the_warnings_of_its_calls() -> None:
    stub = Stub([pb.Tenant(name="acme")], ["sim-small"], [WARNING])
    out, warnings = pontoctl(stub, "tenant", "set", "acme", "--alias", "big=sim-huge")
    assert out.startswith("tenant acme saved")
    assert warnings == [WARNING]


def test_get_tenants_marks_aliases_no_origin_serves() -> None:
    tenants = [
        pb.Tenant(name="acme", prompt=prompt(big="sim-huge", small="sim-small")),
        pb.Tenant(name="plain"),
    ]
    out, _ = pontoctl(Stub(tenants, ["sim-small"], []), "get", "tenants")
    lines = out.splitlines()
    assert "big->sim-huge(unserved),small->sim-small  " in lines[1]  # then the JWT column
    assert lines[-1] == UNSERVED_NOTE
    served, _ = pontoctl(Stub(tenants, ["sim-small", "sim-huge"], []), "get", "tenants")
    assert "(unserved)" not in served and UNSERVED_NOTE not in served


def test_get_tenants_marks_routed_and_hedged_models_no_origin_serves() -> None:
    acme = pb.Tenant(
        name="acme",
        routing=pb.RoutingPolicy(models={"lama": "weighted", "sim-small": "affinity"}),
        streams=pb.StreamPolicy(hedge_models={"lama": "800", "sim-small": "auto"}),
    )
    out, _ = pontoctl(Stub([acme], ["sim-small"], []), "get", "tenants")
    row = out.splitlines()[1]
    assert "default,lama(unserved)=weighted,sim-small=affinity " in row
    assert "continue,hedge[lama(unserved)]=800,hedge[sim-small]=auto " in row
    assert out.splitlines()[-1] == UNSERVED_NOTE
    served, _ = pontoctl(Stub([acme], ["sim-small", "lama"], []), "get", "tenants")
    assert "(unserved)" not in served and UNSERVED_NOTE not in served


def test_get_tenants_marks_a_setting_for_an_alias_as_one_that_never_applies() -> None:
    """Trial: a policy for alias `fast` was shown `fast(unserved)=weighted`, its
    note saying requests for an alias to it get 404; they work (the alias
    names a served model), but the policy never applies: the model is to set."""
    acme = pb.Tenant(
        name="acme",
        prompt=prompt(fast="sim-small"),
        routing=pb.RoutingPolicy(models={"fast": "weighted"}),
        streams=pb.StreamPolicy(hedge_models={"fast": "800"}),
    )
    out, _ = pontoctl(Stub([acme], ["sim-small"], []), "get", "tenants")
    lines = out.splitlines()
    assert "default,fast(alias)=weighted " in lines[1]
    assert "continue,hedge[fast(alias)]=800 " in lines[1]
    assert "(unserved)" not in out and UNSERVED_NOTE not in out
    assert lines[-1] == ALIAS_NOTE + "acme: fast -> sim-small"
    assert "set it for that model instead" in ALIAS_NOTE and "404" not in ALIAS_NOTE
    # With an alias to a model no origin lists as well: both notes, each for its own.
    acme.prompt.aliases["big"] = "sim-huge"
    out, _ = pontoctl(Stub([acme], ["sim-small"], []), "get", "tenants")
    assert "big->sim-huge(unserved),fast->sim-small " in out
    assert out.splitlines()[-2:] == [UNSERVED_NOTE, ALIAS_NOTE + "acme: fast -> sim-small"]
