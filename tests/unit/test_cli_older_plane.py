"""pontoctl against a control plane older or newer than itself (trial 69, a
rolling upgrade): a write says what the control plane's answer holds, and
each field asked that the answer lacks is `NOT SAVED` with exit code 1; a
call the control plane lacks says it is older than the command; fields
pontoctl does not know (a newer control plane's) survive its read-then-write
commands; and today's control plane saves every setting today's pontoctl
asks for (no false NOT SAVED)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from controlplane.cli import Shown, _command, _parser, _refused, finish, run
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import CallDefaults, ClientOptions
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_audit import Clock, admin_server
from tests.unit.test_cli_errors import Refusal

# The fields of today's records a control plane of 371271b (two days older)
# did not know, as Message.field: it parsed them as unknown fields, built its
# records from those it knew, and answered without them.
BEFORE_371271B = frozenset(
    {
        "Limits.tokens_per_day",
        "Limits.tokens_per_month",
        "Origin.probe_path",
        "Origin.not_probed",
        "Origin.model_names",
        "Tenant.models",
        "Tenant.suspended",
        "ApiKeyInfo.models",
        "ApiKeyInfo.suspended",
    }
)


def known(message: Any, dropped: frozenset[str]) -> Any:
    """message as a control plane without the `dropped` fields keeps it."""
    kept = type(message)()
    kept.CopyFrom(message)
    _drop(kept, dropped)
    return kept


def _drop(message: Any, dropped: frozenset[str]) -> None:
    for field, value in message.ListFields():
        if f"{message.DESCRIPTOR.name}.{field.name}" in dropped:
            message.ClearField(field.name)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else [value]:
                _drop(item, dropped)
    message.DiscardUnknownFields()


class OlderPlane:
    """The Admin calls of pontoctl's writes, answered as a control plane
    without the `dropped` fields answers them: it stores and returns records
    without them. It has no SetKeyModels (UNIMPLEMENTED)."""

    def __init__(self, dropped: frozenset[str] = BEFORE_371271B) -> None:
        self.dropped = dropped
        self.regions: dict[str, pb.Region] = {}
        self.origins: dict[str, pb.Origin] = {}
        self.tenants: dict[str, pb.Tenant] = {"beta": pb.Tenant(name="beta")}
        self.keys: dict[str, apb.ApiKeyInfo] = {}

    def ListRegions(self, req: apb.ListRequest) -> apb.ListRegionsResponse:
        return apb.ListRegionsResponse(regions=self.regions.values())

    def PutRegion(self, req: apb.PutRegionRequest) -> pb.Region:
        s = req.region
        region = pb.Region(
            name=s.name,
            latitude=s.latitude,
            longitude=s.longitude,
            rtt_ms=s.rtt_ms,
            spill_threshold=s.spill_threshold,
        )
        self.regions[s.name] = known(region, self.dropped)
        return self.regions[s.name]

    def ListOrigins(self, req: apb.ListRequest) -> apb.ListOriginsResponse:
        return apb.ListOriginsResponse(origins=self.origins.values())

    def PutOrigin(self, req: apb.PutOriginRequest) -> pb.Origin:
        s = req.origin
        origin = pb.Origin(
            name=s.name,
            base_url=s.base_url,
            region=s.region,
            models=s.models,
            weight=s.weight or 100,
            capacity=s.capacity,
            credential_env=s.credential_env,
            credential_file=s.credential_file,
            no_continuation=s.continuation == "off",
            probe_path=s.probe_path,
            not_probed=s.probe == "off",
            model_names=s.model_names,
            max_tokens_field=s.max_tokens_field,
            healthy=True,
        )
        self.origins[s.name] = known(origin, self.dropped)
        return self.origins[s.name]

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=self.tenants.values())

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        tenant = pb.Tenant()
        tenant.CopyFrom(self.tenants.get(req.name, pb.Tenant(name=req.name)))
        for part in ("limits", "cache", "prompt", "routing", "streams", "models", "jwt"):
            if req.HasField(part):
                getattr(tenant, part).CopyFrom(getattr(req, part))
        if req.HasField("suspended"):
            tenant.suspended = req.suspended
        self.tenants[req.name] = known(tenant, self.dropped)
        return self.tenants[req.name]

    def CreateKey(self, req: apb.CreateKeyRequest) -> apb.CreateKeyResponse:
        at = 1_900_000_000.0 + req.expires_in_s if req.expires_in_s else 0.0
        key = apb.ApiKeyInfo(
            id="abcdefghij",
            tenant=req.tenant,
            description=req.description,
            limits=req.limits,
            models=req.models,
            expires_at=at,
        )
        self.keys[key.id] = known(key, self.dropped)
        return apb.CreateKeyResponse(key=self.keys[key.id], secret="sk-ponto-abcdefghij-SECRET")

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=self.keys.values())

    def SetKeyLimits(self, req: apb.SetKeyLimitsRequest) -> apb.ApiKeyInfo:
        self.keys[req.id].limits.CopyFrom(known(req.limits, self.dropped))
        return self.keys[req.id]

    def SetKeyModels(self, req: apb.SetKeyModelsRequest) -> apb.ApiKeyInfo:
        raise Refusal(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    def ListProxies(self, req: apb.ListRequest) -> apb.ListProxiesResponse:
        return apb.ListProxiesResponse()


def pontoctl(stub: Any, *argv: str) -> Shown:
    shown = run(_parser().parse_args(list(argv)), stub)
    assert isinstance(shown, Shown), shown  # every write's output says what was not saved
    return shown


def test_limit_set_says_what_was_saved_and_that_a_budget_was_not() -> None:
    """Trial 69: `limits of tenant beta set: tokens_per_day=1000`, exit 0,
    and nothing stored."""
    plane = OlderPlane()
    said = pontoctl(plane, "limit", "set", "--tenant", "beta", "--tokens-per-day", "1000")
    assert said == "limits of tenant beta unchanged: no limits"
    assert said.not_saved == ("tokens_per_day",)
    said = pontoctl(
        plane, "limit", "set", "--tenant", "beta", "--rpm", "60", "--tokens-per-month", "9"
    )
    assert said == "limits of tenant beta set: rpm=60 (were: no limits)"
    assert said.not_saved == ("tokens_per_month",)
    # A limit the control plane knows, alone: saved, and nothing said of budgets.
    assert pontoctl(plane, "limit", "set", "--tenant", "beta", "--tpm", "5").not_saved == ()
    # Removing a budget it never had: nothing was lost.
    said = pontoctl(plane, "limit", "set", "--tenant", "beta", "--tokens-per-day", "0")
    assert said.not_saved == ()


def test_limit_set_of_a_key_and_key_create_say_what_was_not_saved() -> None:
    plane = OlderPlane()
    created = pontoctl(
        plane, "key", "create", "--tenant", "beta", "--rpm", "5", "--tokens-per-day", "7",
        "--models", "a", "--expires-in", "1h",
    )  # fmt: skip
    assert created.not_saved == ("limits.tokens_per_day", "models")
    # The older control plane knows expiry: saved, and said as saved.
    assert ", expiring 2030" in created.splitlines()[0]
    assert created.splitlines()[-1] == "sk-ponto-abcdefghij-SECRET"  # still last
    said = pontoctl(plane, "limit", "set", "--key", "abcdefghij", "--tokens-per-month", "9")
    assert said == "limits of key abcdefghij unchanged: rpm=5"
    assert said.not_saved == ("tokens_per_month",)


def test_a_key_created_without_an_expiry_the_plane_lacks_is_not_saved() -> None:
    created = pontoctl(
        OlderPlane(BEFORE_371271B | {"ApiKeyInfo.expires_at"}),
        "key", "create", "--tenant", "beta", "--expires-in", "1h",
    )  # fmt: skip
    assert "WITHOUT AN EXPIRY" in created.splitlines()[0]  # as before
    assert created.not_saved == ("expires_in",)


def test_origin_add_says_which_settings_were_not_saved() -> None:
    """Trial 69: `origin add org-y --update --probe off` said `unchanged`,
    exit 0, and the origin was still probed."""
    plane = OlderPlane()
    plane.regions["eu"] = pb.Region(name="eu")
    added = pontoctl(
        plane, "origin", "add", "org-y", "--url", "http://y:8000", "--region", "eu",
        "--models", "m", "--probe-path", "/ping", "--model-name", "m=own-m",
    )  # fmt: skip
    assert added.startswith("origin org-y in eu saved (m; weight 100)")
    assert added.not_saved == ("probe_path", "model_names")
    updated = pontoctl(plane, "origin", "add", "org-y", "--update", "--probe", "off")
    assert updated.endswith("; unchanged")
    assert updated.not_saved == ("probe",)
    kept = pontoctl(plane, "origin", "add", "org-y", "--update", "--weight", "5")
    assert kept.endswith("changed: weight 100 -> 5") and kept.not_saved == ()


def test_region_add_says_which_settings_were_not_saved() -> None:
    plane = OlderPlane(frozenset({"Region.spill_threshold"}))
    added = pontoctl(
        plane, "region", "add", "eu", "--lat", "50", "--lon", "8", "--spill-threshold", "0.5"
    )
    assert added == "region eu (50, 8) saved" and added.not_saved == ("spill_threshold",)
    updated = pontoctl(plane, "region", "add", "eu", "--update", "--rtt", "us=80")
    assert updated.not_saved == () and "changed: rtt - -> us=80" in updated


def test_tenant_set_says_which_settings_were_not_saved_and_keeps_its_wording() -> None:
    plane = OlderPlane(BEFORE_371271B | {"StreamPolicy.hedge_models"})
    said = pontoctl(
        plane, "tenant", "set", "beta", "--models", "a", "--suspended", "on",
        "--model-hedge-ms", "a=300", "--cache", "off",
    )  # fmt: skip
    assert "WITHOUT A MODEL LIST" in said and "NOT SUSPENDED" in said  # as before
    assert said.not_saved == ("streams.hedge_models", "models.names", "suspended")
    assert "changed: cache.mode" in said  # what was saved, as saved


def test_not_saved_is_an_error_line_each_and_exit_code_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert finish(Shown("limits of tenant beta unchanged: no limits", ["tokens_per_day"])) == 1
    out, err = capsys.readouterr()
    assert out == "limits of tenant beta unchanged: no limits\n"
    assert err == (
        "error: NOT SAVED: tokens_per_day (the control plane does not support it; "
        "upgrade every replica)\n"
    )
    assert finish(Shown("saved")) == 0
    assert capsys.readouterr().err == ""


def test_a_call_the_control_plane_lacks_says_it_is_older_than_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Trial 69: `key models` said `error: Method not found! [UNIMPLEMENTED]`."""
    args = _parser().parse_args(["key", "models", "abcdefghij", "sim-small"])
    with pytest.raises(grpc.RpcError) as refused:
        run(args, OlderPlane())
    code = _refused(refused.value, "cp:7000", ClientOptions(), command=_command(args))
    assert code == 1  # as every refusal that is no bad value
    assert capsys.readouterr().err == (
        "error: the control plane at cp:7000 is older than `pontoctl key models` "
        "(Method not found!): upgrade every replica to use it [UNIMPLEMENTED]\n"
    )
    assert _command(_parser().parse_args(["get", "audit", "--action", "PutRegion"])) == "get audit"


def test_an_address_without_the_admin_api_is_not_called_an_older_control_plane(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: pontoctl aimed at etcd's port said the control plane there was
    older than the command."""
    refusal = Refusal(grpc.StatusCode.UNIMPLEMENTED, "unknown service ponto.v1.Admin")
    assert _refused(refusal, "127.0.0.1:2379", ClientOptions(), command="get proxies") == 1
    said = capsys.readouterr().err
    assert said.startswith(
        "error: 127.0.0.1:2379 does not serve Ponto's Admin API (unknown service "
        "ponto.v1.Admin): is it the control plane's gRPC port"
    )
    assert "older" not in said


# ------------------------------------------------ fields pontoctl does not know


# Field 99 (a number none of these messages has), varint, value 7: the bytes
# of a field a newer control plane's message has.
UNKNOWN = b"\x98\x06\x07"


def with_unknown(message: Any) -> Any:
    """message with a field its type lacks (a newer control plane's), as
    parsing a newer one's bytes gives it: an unknown field."""
    parsed = type(message)()
    parsed.ParseFromString(message.SerializeToString() + UNKNOWN)
    return parsed


def holds_unknown(message: Any) -> bool:
    return UNKNOWN in message.SerializeToString()


class Recording:
    """A control plane newer than pontoctl: its records hold a field
    pontoctl does not know; the writes are recorded, not applied."""

    def __init__(self) -> None:
        limits = with_unknown(pb.Limits(rpm=5))
        cache = with_unknown(pb.CachePolicy(mode="exact"))
        self.tenant = pb.Tenant(name="beta", limits=limits, cache=cache)
        self.key = apb.ApiKeyInfo(id="abcdefghij", tenant="beta", limits=limits)
        self.sent: list[Any] = []

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[self.tenant])

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=[self.key])

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        self.sent.append(req)
        return self.tenant

    def SetKeyLimits(self, req: apb.SetKeyLimitsRequest) -> apb.ApiKeyInfo:
        self.sent.append(req)
        return self.key


def test_the_unknown_field_helper_makes_a_field_the_message_lacks() -> None:
    assert holds_unknown(with_unknown(pb.Limits(rpm=5)))
    assert not holds_unknown(pb.Limits(rpm=5))


@pytest.mark.parametrize("owner", [("--tenant", "beta"), ("--key", "abcdefghij")])
def test_limit_set_sends_back_the_fields_it_does_not_know(owner: tuple[str, str]) -> None:
    """A newer control plane's limit (an unknown field here) is sent as read,
    beside the one changed: an older pontoctl's rebuilt limits wiped the
    budgets it did not know (trial 69)."""
    plane = Recording()
    run(_parser().parse_args(["limit", "set", *owner, "--rpm", "6"]), plane)
    [sent] = plane.sent
    assert sent.limits.rpm == 6
    assert holds_unknown(sent.limits) and holds_unknown(sent.expected)


def test_tenant_set_sends_back_the_fields_it_does_not_know() -> None:
    plane = Recording()
    run(_parser().parse_args(["tenant", "set", "beta", "--cache", "off"]), plane)
    [sent] = plane.sent
    assert sent.cache.mode == "off" and holds_unknown(sent.cache)
    assert holds_unknown(sent.expected.limits)


# ------------------------------------------------- today's control plane


def ctl(address: str, *argv: str) -> Shown:
    with grpc.insecure_channel(address) as channel:
        stub: Any = CallDefaults(admin_pb2_grpc.AdminStub(channel), timeout=5)
        return pontoctl(stub, *argv)


async def test_today_s_control_plane_saves_every_setting_pontoctl_asks_for() -> None:
    """No false NOT SAVED: every flag that a normal form could turn empty,
    against the real Admin API."""
    async with admin_server(MemoryStore(), Clock(), admin_token="") as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="beta")))
        commands = [
            ("region", "add", "eu", "--lat", "50", "--lon", "8", "--spill-threshold", "0.5",
             "--rtt", "eu=1"),
            ("region", "add", "eu", "--update", "--lat", "0", "--rtt", ""),
            ("origin", "add", "o", "--url", "http://o:8000", "--region", "eu", "--models",
             "m,n", "--probe-path", "/ping", "--model-name", "m=own-m", "--weight", "3",
             "--capacity", "4", "--credential-env", "KEY", "--continuation", "off",
             "--max-tokens-field", "max_completion_tokens"),
            ("origin", "add", "o", "--update", "--probe", "off", "--model-name", "m=",
             "--max-tokens-field", "max_tokens"),
            ("origin", "add", "o", "--update", "--probe", "on", "--continuation", "on"),
            ("tenant", "set", "beta", "--cache", "semantic", "--semantic-threshold", "0.9",
             "--semantic-max-error", "0.01", "--cache-ttl", "60", "--cache-nondeterministic",
             "on", "--system-prompt", "be brief", "--enforce-system-prompt", "on",
             "--max-tokens", "100", "--default", "temperature=0.2", "--alias", "fast=m",
             "--routing", "least-loaded", "--model-routing", "m=weighted", "--user-sessions",
             "on", "--load-bound", "1.5", "--continuation", "off", "--max-continuations", "2",
             "--stream-idle-timeout", "30", "--hedge-ms", "200", "--model-hedge-ms", "m=auto",
             "--models", "m,fast", "--suspended", "on"),
            ("tenant", "set", "beta", "--hedge-ms", "auto", "--any-model", "--suspended", "off"),
            ("limit", "set", "--tenant", "beta", "--rpm", "1", "--tpm", "2", "--concurrency",
             "3", "--tokens-per-day", "4", "--tokens-per-month", "5"),
            ("key", "create", "--tenant", "beta", "--description", "ci", "--rpm", "1",
             "--tokens-per-day", "4", "--models", "m", "--expires-in", "1h"),
        ]  # fmt: skip
        for argv in commands:
            said = await asyncio.to_thread(ctl, stub.address, *argv)
            assert said.not_saved == (), (argv, said)
