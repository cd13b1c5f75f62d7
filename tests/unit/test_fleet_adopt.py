"""`pontoctl fleet adopt` (Admin AdoptFleet): the store's fleet id made the
one the proxies serve, audited; a fleet id that is not one is refused. What
the control plane says when its fleet id was lost: FleetWatch and its
metrics. And no table of the control plane's opens a fleet that required
auth, which proxies would refuse."""

from __future__ import annotations

import logging

import grpc
import pytest
from prometheus_client import generate_latest

from controlplane.builder import TableBuilder
from controlplane.catalog import FLEET_ID, Catalog
from controlplane.cli import _parser, run
from controlplane.distribute import Publisher
from controlplane.fleetid import FleetWatch
from controlplane.metrics import ControlMetrics
from controlplane.model import JwtIssuer, Tenant
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from tests.unit.test_audit import Clock, admin_server

SERVED = "0123456789abcdef"


async def test_adopt_sets_the_stored_fleet_id_and_is_audited() -> None:
    store, clock = MemoryStore(), Clock()
    clock.step = 0.001  # an entry per reading, in the order of the calls
    await Catalog(store).ensure_fleet_id(())
    made = (await Catalog(store).snapshot()).fleet_id
    async with admin_server(store, clock) as stub:
        answer = await stub.AdoptFleet(apb.AdoptFleetRequest(fleet_id=SERVED))
        assert (answer.fleet_id, answer.previous) == (SERVED, made)
        assert (await Catalog(store).snapshot()).fleet_id == SERVED
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.AdoptFleet(apb.AdoptFleetRequest(fleet_id="not a fleet"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a fleet id" in (refused.value.details() or "")
        entries = (await stub.ListAudit(apb.ListAuditRequest())).entries
    assert (await Catalog(store).snapshot()).fleet_id == SERVED
    refusal, adoption = entries  # newest first
    assert (adoption.action, adoption.target, adoption.result) == (
        "AdoptFleet",
        f"fleet/{SERVED}",
        "ok",
    )
    assert dict(adoption.detail) == {"previous": made}
    assert refusal.result == "INVALID_ARGUMENT"


async def test_adopt_over_a_store_without_a_fleet_id_creates_it() -> None:
    store = MemoryStore()
    assert await Catalog(store).adopt_fleet(SERVED) == ""
    stored = await store.get(FLEET_ID)
    assert stored is not None and SERVED in stored.value.decode()
    # A replica's first build now finds it, and makes none.
    assert await Catalog(store).ensure_fleet_id(()) == ""


class Stub:
    def __init__(self) -> None:
        self.requests: list[apb.AdoptFleetRequest] = []

    def AdoptFleet(self, req: apb.AdoptFleetRequest) -> apb.AdoptFleetResponse:
        self.requests.append(req)
        return apb.AdoptFleetResponse(fleet_id=req.fleet_id, previous="fedcba9876543210")


def test_pontoctl_fleet_adopt_says_what_it_replaced() -> None:
    stub = Stub()
    out = run(_parser().parse_args(["fleet", "adopt", SERVED]), stub)
    assert stub.requests == [apb.AdoptFleetRequest(fleet_id=SERVED)]
    assert str(out).startswith(f"the fleet id is {SERVED} now (was fedcba9876543210)")


def test_a_replica_that_made_a_new_fleet_id_after_serving_another_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = FleetWatch()
    metrics = ControlMetrics()
    metrics.bind(table=lambda: None, acked_versions=tuple, is_leader=lambda: False, fleet=watch)
    watch.made("aaaaaaaaaaaaaaaa", "")  # the fleet's first: no alarm
    watch.published("aaaaaaaaaaaaaaaa")
    assert watch.problem() == ""
    with caplog.at_level(logging.INFO, logger="controlplane.fleetid"):
        watch.made("bbbbbbbbbbbbbbbb", "aaaaaaaaaaaaaaaa")
        watch.published("bbbbbbbbbbbbbbbb")
        for _ in range(3):  # every push refused: one ERROR
            watch.answered("p1", "aaaaaaaaaaaaaaaa", refused=True)
        watch.answered("p2", "aaaaaaaaaaaaaaaa", refused=True)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "pontoctl fleet adopt aaaaaaaaaaaaaaaa" in errors[0]
    assert errors[1].startswith("proxy p1 serves fleet aaaaaaaaaaaaaaaa and refuses")
    assert "2 proxies refuse its route tables" in watch.problem()
    text = generate_latest(metrics.registry).decode()
    assert "ponto_control_fleet_replaced 1.0" in text
    assert 'ponto_control_proxies_other_fleet{fleet_id="aaaaaaaaaaaaaaaa"} 2.0' in text
    assert "ponto_control_proxies_withheld 0.0" in text
    watch.waiting.add("p-new")  # as the routing service notes one it sends no table (review 295)
    assert "ponto_control_proxies_withheld 1.0" in generate_latest(metrics.registry).decode()
    watch.waiting.discard("p-new")
    # An older proxy says no fleet; a NACK for another reason is no refusal of the fleet.
    watch.answered("p3", "", refused=True)
    assert set(watch.refusing) == {"p1", "p2"}
    # Adopted: the tables are the proxies' fleet's again, and they take them.
    watch.published("aaaaaaaaaaaaaaaa")
    watch.answered("p1", "aaaaaaaaaaaaaaaa", refused=False)
    watch.ended("p2")
    assert watch.problem() == "" and watch.refusing == {}
    text = generate_latest(metrics.registry).decode()
    assert "ponto_control_fleet_replaced 0.0" in text
    assert "ponto_control_proxies_other_fleet{" not in text


async def test_a_fleet_that_had_a_jwt_issuer_stays_closed_once_it_is_gone() -> None:
    """The one path by which a table that required auth could stop requiring
    it (revoked keys stay stored; an issuer does not): the proxies would now
    refuse that table, so the control plane keeps it closed."""
    store = MemoryStore()
    catalog = Catalog(store)
    pub = Publisher("cp-a")
    builder = TableBuilder(catalog, pub)
    jwt = JwtIssuer(
        issuer="https://idp.example", algorithms=("HS256",), hs256_secret_env="PONTO_TEST_SECRET"
    )
    await catalog.put_tenant(Tenant("acme", jwt=jwt), allow_update=False)
    await builder.build_once()
    assert pub.latest is not None and pub.latest.table.auth_required
    await catalog.put_tenant(Tenant("acme"), allow_update=True)
    await builder.build_once()
    assert (await catalog.snapshot()).auth_ever
    assert pub.latest.table.auth_required
    await catalog.delete_tenant("acme")
    await builder.build_once()
    assert pub.latest.table.auth_required and not pub.latest.table.tenants


@pytest.mark.parametrize("stored", [b'{"id": "not a fleet id"}', b"not json"])
async def test_adopt_replaces_a_stored_fleet_id_that_is_none(stored: bytes) -> None:
    """Review 293: a stored id that decodes as JSON but is no fleet id made
    adopt fail with INVALID_ARGUMENT, leaving no way to mend it."""
    store = MemoryStore()
    await store.put(FLEET_ID, stored)
    assert (await Catalog(store).snapshot()).fleet_id_invalid
    assert await Catalog(store).adopt_fleet(SERVED) == ""
    state = await Catalog(store).snapshot()
    assert (state.fleet_id, state.fleet_id_invalid) == (SERVED, "")


async def test_a_stored_fleet_id_that_is_none_is_a_problem_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not "no id": the guard is off (tables go out without one), which the
    status page and an ERROR say, once, until adopt replaces it."""
    store = MemoryStore()
    catalog = Catalog(store)
    await store.put(FLEET_ID, b'{"id": "XYZ"}')
    pub = Publisher("cp-a")
    builder = TableBuilder(catalog, pub)
    with caplog.at_level(logging.INFO, logger="controlplane.fleetid"):
        await builder.build_once()
        builder.wake()
        await builder.build_once()
    assert pub.latest is not None and pub.latest.table.fleet_id == ""
    # Left as it is for adopt to replace, not taken for a store without one.
    stored = await store.get(FLEET_ID)
    assert stored is not None and stored.value == b'{"id": "XYZ"}'
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "is not one" in errors[0] and FLEET_ID in errors[0]
    assert builder.fleet.problem().startswith("the stored fleet id is not one ('XYZ' is not")
    await catalog.adopt_fleet(SERVED)
    await builder.build_once()
    assert pub.latest.table.fleet_id == SERVED
    assert builder.fleet.problem() == ""


def test_the_problem_names_the_fleet_most_refusing_proxies_serve() -> None:
    watch = FleetWatch()
    watch.published("bbbbbbbbbbbbbbbb")
    watch.answered("p1", "aaaaaaaaaaaaaaaa", refused=True)
    assert "pontoctl fleet adopt aaaaaaaaaaaaaaaa`" in watch.problem()
    assert "disagree" not in watch.problem()
    watch.answered("p2", "cccccccccccccccc", refused=True)
    watch.answered("p3", "cccccccccccccccc", refused=True)
    problem = watch.problem()
    assert "pontoctl fleet adopt cccccccccccccccc`" in problem
    assert (
        "they disagree: 2 serve fleet cccccccccccccccc, 1 serve fleet aaaaaaaaaaaaaaaa; "
        "adopting cccccccccccccccc leaves the others refusing"
    ) in problem


def test_a_replica_that_replaced_the_id_names_the_one_it_served() -> None:
    watch = FleetWatch()
    watch.published("aaaaaaaaaaaaaaaa")
    watch.made("bbbbbbbbbbbbbbbb", "aaaaaaaaaaaaaaaa")
    watch.published("bbbbbbbbbbbbbbbb")
    assert "pontoctl fleet adopt aaaaaaaaaaaaaaaa`" in watch.problem()
