"""The models a tenant's and a key's callers may name, in the control plane:
the model values and their storage, apply documents, the Admin API (a real
gRPC server on loopback over an in-memory store: warnings, the route table,
the audit trail) and pontoctl's flags and tables. The proxy's side is in
tests/functional/test_model_access.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from controlplane.api.admin import WARNINGS_BYTES, warnings_metadata
from controlplane.apply import Current, document, parse, plan
from controlplane.catalog import Catalog
from controlplane.cli import UNSERVED_NOTE, _parser, _rows_keys, _rows_tenants, run
from controlplane.compile import compile_table
from controlplane.errors import InvalidArgument
from controlplane.model import (
    MAX_ACCESS_MODELS,
    ApiKeyRecord,
    ModelAccess,
    Origin,
    PromptPolicy,
    Tenant,
    access_warnings,
    decode_key,
    decode_tenant,
    encode,
)
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import admin, warned

ORIGINS = [Origin("o1", "http://h/v1", "us", ("llama-8b", "llama-70b"))]


def acme(*names: str, **aliases: str) -> Tenant:
    return Tenant(
        "acme",
        prompt=PromptPolicy(aliases=tuple(sorted(aliases.items()))),
        models=ModelAccess(names),
    )


# ---------------------------------------------------------------- values


def test_a_list_is_kept_sorted_once_each_and_checked() -> None:
    assert acme("b", "a", "b").validated().models == ModelAccess(("a", "b"))
    with pytest.raises(InvalidArgument, match="models of tenant 'acme': model name ' x' is"):
        acme(" x").validated()
    with pytest.raises(InvalidArgument) as too_many:
        acme(*(f"m{i}" for i in range(MAX_ACCESS_MODELS + 1))).validated()
    assert too_many.value.field == "models"
    assert ModelAccess().allows("anything") and not ModelAccess(("a",)).allows("b")


def test_lists_are_stored_and_records_from_before_them_read_as_none() -> None:
    tenant = acme("llama-8b").validated()
    assert decode_tenant(encode(tenant)) == tenant
    key = ApiKeyRecord("abcdefghij", "0" * 64, "acme", models=("llama-8b",))
    assert decode_key(encode(key)) == key
    older = orjson.dumps({"name": "acme", "limits": {}})
    assert decode_tenant(older).models == ModelAccess()
    assert decode_key(orjson.dumps({"id": "k", "hash": "h", "tenant": "acme"})).models == ()


def test_names_nothing_answers_and_aliases_off_the_list_are_warned_of() -> None:
    tenant = acme("fast", "llama-8b", "lama-70b", fast="llama-70b", big="llama-70b")
    # What refuses requests first, what nothing serves after (trial 29).
    assert access_warnings(tenant, ORIGINS) == (
        "alias 'big' of tenant 'acme' is not among the models it may name: requests for it get 404",
        "no origin serves model 'lama-70b', which tenant 'acme' may name, and it is no alias "
        "of tenant 'acme': requests for it get 404 until one does",
    )
    assert access_warnings(acme(big="nothing"), ORIGINS) == ()  # no list: nothing to say
    key = ApiKeyRecord("abcdefghij", "", "acme", models=("fast", "llama-70b", "nope"))
    assert access_warnings(tenant, ORIGINS, key) == (
        "key 'abcdefghij' may name model 'llama-70b', which its tenant 'acme' may not: "
        "requests for it get 404",
        "key 'abcdefghij' may name model 'nope', which its tenant 'acme' may not: "
        "requests for it get 404",
    )
    assert [w.split(",")[0] for w in access_warnings(acme(), ORIGINS, key)] == [
        "no origin serves model 'fast'",
        "no origin serves model 'nope'",
    ]


# ---------------------------------------------------------------- apply


def test_apply_reads_writes_and_compares_a_tenants_models() -> None:
    doc = {"tenants": [{"name": "acme", "models": ["llama-8b", "fast"]}]}
    [tenant] = parse(doc).tenants
    assert tenant.models == ModelAccess(("fast", "llama-8b"))
    saved = tenant.validated()
    assert document(tenants=[saved])["tenants"] == [
        {"name": "acme", "cache": {"mode": "exact"}, "models": ["fast", "llama-8b"]}
    ]
    # The same list in another order changes nothing; a shorter one is an update.
    have = Current(tenants={"acme": saved})
    [same] = plan(parse(doc), have, prune=False).changes
    assert same.action == "unchanged"
    fewer = {"tenants": [{"name": "acme", "models": ["fast"]}]}
    [change] = plan(parse(fewer), have, prune=False).changes
    assert (change.action, change.fields) == ("updated", ("models",))
    # A document whose list names nothing that answers is warned of.
    warnings = plan(parse(doc), have, prune=False).warnings
    assert any("'fast', which tenant 'acme' may name" in w for w in warnings)


@pytest.mark.parametrize(
    ("models", "error"),
    [
        ("llama-8b", "tenants[0].models: expected a list"),
        ([1], "tenants[0].models[0]: expected a string"),
        # Review 45: it reads as "none", and would give every model.
        ([], "tenants[0].models: no names; leave `models` out for every model"),
        (None, "tenants[0].models: no names; leave `models` out for every model"),
    ],
)
def test_apply_names_the_field_of_a_list_of_the_wrong_shape(models: Any, error: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse({"tenants": [{"name": "acme", "models": models}]})
    assert error in str(refused.value)


# ---------------------------------------------------------------- the Admin API


async def test_the_admin_api_saves_lists_warns_and_compiles_them() -> None:
    store = MemoryStore()
    async with admin(store) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="us")))
        spec = apb.OriginSpec(name="o1", base_url="http://h/v1", region="us", models=["llama-8b"])
        await stub.PutOrigin(apb.PutOriginRequest(origin=spec))
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        update = apb.UpdateTenantRequest(
            name="acme", models=pb.ModelAccess(names=["llama-8b", "llama-70b"])
        )
        [warning] = await warned(stub.UpdateTenant(update))
        assert warning.startswith("no origin serves model 'llama-70b', which tenant 'acme'")
        created = await stub.CreateKey(
            apb.CreateKeyRequest(tenant="acme", models=["llama-8b", "other"])
        )
        assert list(created.key.models) == ["llama-8b", "other"]
        key_id = created.key.id
        narrowed = stub.SetKeyModels(apb.SetKeyModelsRequest(id=key_id, models=["llama-70b"]))
        [warning] = await warned(narrowed)  # on its tenant's list, but served by none
        assert warning.startswith(f"no origin serves model 'llama-70b', which key '{key_id}'")
        table = compile_table(await Catalog(store).snapshot())
        [tenant] = table.tenants
        assert list(tenant.models.names) == ["llama-70b", "llama-8b"]
        [key] = table.keys
        assert list(key.models) == ["llama-70b"]
        # An update without the field keeps the list; an empty one clears it.
        await stub.UpdateTenant(apb.UpdateTenantRequest(name="acme", limits=pb.Limits(rpm=5)))
        [kept] = (await stub.ListTenants(apb.ListRequest())).tenants
        assert list(kept.models.names) == ["llama-70b", "llama-8b"]
        cleared = apb.UpdateTenantRequest(name="acme", models=pb.ModelAccess())
        assert list((await stub.UpdateTenant(cleared)).models.names) == []
        await stub.SetKeyModels(apb.SetKeyModelsRequest(id=key_id))
        [listed] = (await stub.ListKeys(apb.ListKeysRequest())).keys
        assert list(listed.models) == []
        audit = (await stub.ListAudit(apb.ListAuditRequest(action="SetKeyModels"))).entries
        assert [e.detail["changes"] for e in audit] == [
            'models ["llama-70b"] -> removed',
            'models ["llama-8b","other"] -> ["llama-70b"]',
        ]
        assert [e.detail["models"] for e in audit] == ["[]", '["llama-70b"]']


def test_a_tenants_list_narrowed_under_its_keys_lists_is_warned_of() -> None:
    """Review 45: a key whose names its tenant's new list leaves out got 404
    for them, and nothing said so."""
    keys = [
        ApiKeyRecord("k1", "", "acme", models=("a",)),
        ApiKeyRecord("k2", "", "acme", models=("a", "b")),
    ]
    assert access_warnings(
        acme("b"), [Origin("o", "http://h/v1", "us", ("a", "b"))], keys=keys
    ) == (
        "key 'k1' of tenant 'acme' lists a, which the tenant may not name: requests for it "
        "get 404; the key may name no model at all (`pontoctl key models k1 ...`)",
        "key 'k2' of tenant 'acme' lists a, which the tenant may not name: requests for it "
        "get 404 (`pontoctl key models k2 ...`)",
    )
    doc = {"tenants": [{"name": "acme", "models": ["b"]}]}
    have = Current(tenants={"acme": acme("a", "b")}, listed_keys={"acme": keys})
    assert len([w for w in plan(parse(doc), have, prune=False).warnings if "key 'k" in w]) == 2


async def test_the_admin_api_warns_of_the_keys_a_tenants_new_list_cuts_off() -> None:
    async with admin(MemoryStore()) as stub:
        names = pb.ModelAccess(names=["a", "b"])
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme", models=names)))
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", models=["a"]))
        revoked = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", models=["a"]))
        await stub.RevokeKey(apb.KeyRequest(id=revoked.key.id))
        update = apb.UpdateTenantRequest(name="acme", models=pb.ModelAccess(names=["b"]))
        cut = [w for w in await warned(stub.UpdateTenant(update)) if w.startswith("key ")]
    assert cut == [
        f"key '{created.key.id}' of tenant 'acme' lists a, which the tenant may not name: "
        f"requests for it get 404; the key may name no model at all (`pontoctl key models "
        f"{created.key.id} ...`)"
    ]


async def test_a_long_lists_unserved_names_hide_neither_a_cut_key_nor_the_fleets_warnings() -> None:
    """Trial 29: 35 names nothing served filled the reply's warnings, and the
    keys the list cut off, then the proxies' own warnings (cut a second time),
    were only counted."""
    async with admin(MemoryStore()) as stub:
        names = pb.ModelAccess(names=["a", "b"])
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme", models=names)))
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", models=["a"]))
        typos = [f"typo-model-{i:02d}" for i in range(35)]
        update = apb.UpdateTenantRequest(name="acme", models=pb.ModelAccess(names=typos))
        warnings = await warned(stub.UpdateTenant(update))
    assert warnings[0].startswith(f"key '{created.key.id}' of tenant 'acme' lists a, ")
    assert warnings[-1].endswith("more warnings like these")
    assert sum(map(len, warnings)) <= WARNINGS_BYTES + 100
    fleet = ["proxies p1, p2 report: JWT config of tenant 'idp': ..."]
    sent = [value for _, value in warnings_metadata(warnings * 3, then=fleet)]
    assert sent[-1] == fleet[0] and sent[-2].endswith("more warnings like these")


async def test_a_bad_name_or_a_revoked_key_is_refused() -> None:
    async with admin(MemoryStore()) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        with pytest.raises(Exception, match="model name 'a b' is invalid"):
            await stub.CreateKey(apb.CreateKeyRequest(tenant="acme", models=["a b"]))
        with pytest.raises(Exception, match="models of tenant 'acme': model name '' is"):
            await stub.UpdateTenant(
                apb.UpdateTenantRequest(name="acme", models=pb.ModelAccess(names=[""]))
            )
        created = await stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))
        await stub.RevokeKey(apb.KeyRequest(id=created.key.id))
        with pytest.raises(Exception, match="is revoked; its models cannot change"):
            await stub.SetKeyModels(apb.SetKeyModelsRequest(id=created.key.id, models=["m"]))


# ---------------------------------------------------------------- pontoctl


class Stub:
    """The Admin calls of `tenant set` and `key`; keeps what was sent."""

    def __init__(self) -> None:
        self.current = pb.Tenant(name="acme", models=pb.ModelAccess(names=["a"]))
        self.sent: list[Any] = []
        self.served: list[str] = []  # the models its one origin lists
        self.keys: list[apb.ApiKeyInfo] = []

    def ListTenants(self, req: apb.ListRequest) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(tenants=[self.current])

    def ListOrigins(self, req: apb.ListRequest) -> apb.ListOriginsResponse:
        return apb.ListOriginsResponse(origins=[pb.Origin(name="o1", models=self.served)])

    def ListKeys(self, req: apb.ListKeysRequest) -> apb.ListKeysResponse:
        return apb.ListKeysResponse(keys=self.keys)

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        self.sent.append(req)
        if req.HasField("models"):
            self.current.models.CopyFrom(req.models)
        return self.current

    def CreateKey(self, req: apb.CreateKeyRequest) -> apb.CreateKeyResponse:
        self.sent.append(req)
        key = apb.ApiKeyInfo(id="abcdefghij", tenant=req.tenant, models=req.models)
        return apb.CreateKeyResponse(key=key, secret="sk-ponto-abcdefghij-SECRET")

    def SetKeyModels(self, req: apb.SetKeyModelsRequest) -> apb.ApiKeyInfo:
        self.sent.append(req)
        return apb.ApiKeyInfo(id=req.id, tenant="acme", models=req.models)


def pontoctl(stub: Stub, *argv: str) -> str:
    return run(_parser().parse_args(list(argv)), stub)


def test_tenant_set_replaces_or_clears_the_list() -> None:
    stub = Stub()
    out = pontoctl(stub, "tenant", "set", "acme", "--models", "llama-8b, fast")
    assert out.splitlines() == [
        "tenant acme saved (cache ; routing default; models fast,llama-8b)",
        '  changed: models ["a"] -> ["fast","llama-8b"]',
    ]
    assert list(stub.sent[-1].models.names) == ["fast", "llama-8b"]
    out = pontoctl(stub, "tenant", "set", "acme", "--any-model")
    assert out.splitlines()[0].endswith("; models any)")
    assert stub.sent[-1].HasField("models") and not stub.sent[-1].models.names
    # The same list again sends nothing.
    assert "unchanged" in pontoctl(stub, "tenant", "set", "acme", "--any-model")
    assert len(stub.sent) == 2


def test_keys_are_given_lists_at_creation_and_after() -> None:
    stub = Stub()
    created = pontoctl(stub, "key", "create", "--tenant", "acme", "--models", "b,a")
    assert list(stub.sent[-1].models) == ["a", "b"]
    assert created.splitlines()[0].startswith(
        "key abcdefghij created for tenant acme, naming only a, b; "
    )
    assert created.splitlines()[-1] == "sk-ponto-abcdefghij-SECRET"
    out = pontoctl(stub, "key", "models", "abcdefghij", "a")
    assert out == "key abcdefghij of tenant acme may name models: a"
    out = pontoctl(stub, "key", "models", "abcdefghij", "--any")
    assert out == "key abcdefghij of tenant acme may name models: those of tenant acme"
    assert list(stub.sent[-1].models) == []


class OldStub(Stub):
    """A control plane from before model lists: it drops the fields."""

    def UpdateTenant(self, req: apb.UpdateTenantRequest) -> pb.Tenant:
        self.sent.append(req)
        return pb.Tenant(name="acme")

    def CreateKey(self, req: apb.CreateKeyRequest) -> apb.CreateKeyResponse:
        self.sent.append(req)
        key = apb.ApiKeyInfo(id="abcdefghij", tenant=req.tenant)
        return apb.CreateKeyResponse(key=key, secret="sk-ponto-abcdefghij-SECRET")


def test_a_control_plane_that_drops_the_lists_is_called_out() -> None:
    """Review 45: `key create --models` against an older control plane said
    nothing, and the key could name every model."""
    created = pontoctl(OldStub(), "key", "create", "--tenant", "acme", "--models", "a")
    assert "WITHOUT A MODEL LIST" in created.splitlines()[0]
    assert "pontoctl key models abcdefghij" in created
    assert created.splitlines()[-1] == "sk-ponto-abcdefghij-SECRET"
    plain = pontoctl(OldStub(), "key", "create", "--tenant", "acme")
    assert "MODEL LIST" not in plain and "naming" not in plain
    tenant = OldStub()
    tenant.current = pb.Tenant(name="acme")
    assert "WITHOUT A MODEL LIST" in pontoctl(tenant, "tenant", "set", "acme", "--models", "a")


@pytest.mark.parametrize(
    "argv",
    [
        ("tenant", "set", "acme", "--models", "a,,b"),
        ("tenant", "set", "acme", "--models", "a b"),
        ("tenant", "set", "acme", "--models", "a", "--any-model"),
        ("key", "models", "abcdefghij"),
        ("key", "models", "abcdefghij", "a", "--any"),
    ],
)
def test_a_list_that_is_not_one_is_refused_before_any_call(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(list(argv))
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_the_tables_show_the_lists() -> None:
    tenants = apb.ListTenantsResponse(
        tenants=[pb.Tenant(name="acme", models=pb.ModelAccess(names=["a", "b"])), pb.Tenant()]
    )
    tenants.tenants.add(name="big", models=pb.ModelAccess(names=[f"m{i}" for i in range(8)]))
    header, rows = _rows_tenants(tenants)
    column = header.index("MODELS")
    assert [row[column] for row in rows] == ["a,b", "any", "m0,m1,m2,m3,m4,…(+3)"]
    keys = apb.ListKeysResponse(
        keys=[apb.ApiKeyInfo(id="k1", tenant="acme", models=["a"]), apb.ApiKeyInfo(id="k2")]
    )
    header, rows = _rows_keys(keys)
    column = header.index("MODELS")
    assert [row[column] for row in rows] == ["a", "tenant's"]


def test_the_tables_mark_listed_names_no_origin_serves() -> None:
    """Trial 29: a typo on a list (`gpt4o`) was shown as any other name; it is
    marked as ALIASES marks an alias's unserved target, with the note that
    says why. An alias on a list is listed by its own name: not marked."""
    acme = pb.Tenant(
        name="acme",
        prompt=pb.PromptPolicy(aliases={"fast": "sim-small"}),
        models=pb.ModelAccess(names=["sim-small", "gpt4o", "fast"]),
    )
    big = pb.Tenant(name="big", models=pb.ModelAccess(names=[f"m{i}" for i in range(8)]))
    served = frozenset({"sim-small", "m0", "m1", "m2", "m3", "m4", "m6"})
    header, rows = _rows_tenants(apb.ListTenantsResponse(tenants=[acme, big]), served)
    column = header.index("MODELS")
    assert [row[column] for row in rows] == [
        "sim-small,gpt4o(unserved),fast",
        "m0,m1,m2,m3,m4,…(+3, 2 marked)",
    ]
    keys = apb.ListKeysResponse(
        keys=[
            apb.ApiKeyInfo(id="k1", tenant="acme", models=["fast", "gpt4o"]),
            apb.ApiKeyInfo(id="k2", tenant="gone", models=["fast"]),
        ]
    )
    header, rows = _rows_keys(keys, {"acme": acme}, served)
    column = header.index("MODELS")
    assert [row[column] for row in rows] == ["fast,gpt4o(unserved)", "fast(unserved)"]
    # Without what origins serve, nothing is marked.
    _, rows = _rows_keys(keys, {"acme": acme})
    assert [row[column] for row in rows] == ["fast,gpt4o", "fast"]


def test_get_tenants_and_key_list_say_what_an_unserved_name_means() -> None:
    stub = Stub()
    stub.current = pb.Tenant(name="acme", models=pb.ModelAccess(names=["sim-small", "gpt4o"]))
    stub.served = ["sim-small"]
    out = pontoctl(stub, "get", "tenants")
    assert "gpt4o(unserved)" in out and out.splitlines()[-1] == UNSERVED_NOTE
    assert "requests for it or an alias to it get 404" in UNSERVED_NOTE
    stub.keys = [apb.ApiKeyInfo(id="abcdefghij", tenant="acme", models=["gpt4o"])]
    out = pontoctl(stub, "key", "list")
    assert "gpt4o(unserved)" in out and out.splitlines()[-1] == UNSERVED_NOTE
    stub.served = ["sim-small", "gpt4o"]
    for argv in (("get", "tenants"), ("key", "list")):
        out = pontoctl(stub, *argv)
        assert "(unserved)" not in out and UNSERVED_NOTE not in out


@pytest.mark.parametrize(
    ("argv", "listed"),
    [
        (("key", "models", "abcdefghij", "a", "b"), "a,b"),
        (("tenant", "set", "acme", "--models", "a", "b", "--cache", "off"), "a,b"),
        (("key", "create", "--tenant", "acme", "--models", "b,a", "c"), "a,b,c"),
    ],
)
def test_a_list_given_as_several_arguments_is_refused_with_the_comma_form(
    argv: tuple[str, ...], listed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial 29: argparse only called the second name an unrecognized argument."""
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(list(argv))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"names separated by commas with no spaces: {listed} " in err
    assert err.count("\n") == 1


def test_a_stray_argument_elsewhere_gets_no_model_list_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["tenant", "set", "acme", "--models", "a", "--cache", "off", "x"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: x" in err and "commas" not in err


def test_key_list_marks_a_key_model_its_tenants_list_lacks() -> None:
    """Trial 32: the write warned that the key may name a model its tenant may
    not (every request for it a 404), but `key list` showed it plain."""
    stub = Stub()
    stub.current = pb.Tenant(name="acme", models=pb.ModelAccess(names=["sim-small"]))
    stub.served = ["sim-small", "sim-large"]
    stub.keys = [apb.ApiKeyInfo(id="abcdefghij", tenant="acme", models=["sim-large", "sim-small"])]
    out = pontoctl(stub, "key", "list")
    assert "sim-large(not tenant's),sim-small " in out
    assert out.splitlines()[-1].startswith("(not tenant's): the key's tenant may not name")
    assert UNSERVED_NOTE not in out
