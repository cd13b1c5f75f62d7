"""The Admin service: operators' reads and writes of the desired state."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import grpc
import orjson

from controlplane.api import auditing
from controlplane.api.auditing import audited
from controlplane.api.errors import grpc_errors
from controlplane.api.guard import ADMIN_PREFIX, Refusal, RefusalLog
from controlplane.apply import (
    limit_changes,
    model_changes,
    origin_changes,
    region_changes,
    tenant_changes,
)
from controlplane.audit import AuditEntry, AuditLog
from controlplane.catalog import HEALTH, ORIGINS, Catalog
from controlplane.compile import limits_pb, tenant_pb
from controlplane.distribute import Publisher
from controlplane.ejections import fleet_ejections
from controlplane.errors import ChangedSinceRead, InvalidArgument, Unavailable
from controlplane.fleetstate import table_state
from controlplane.fleetwarnings import fleet_warnings, origin_warnings, proxy_warnings
from controlplane.keypages import page_of, spent_of
from controlplane.messages import (
    cache_of,
    jwt_of,
    limits_of,
    models_of,
    origin_of,
    prompt_of,
    region_of,
    routing_of,
    streams_of,
    tenant_of,
)
from controlplane.model import (
    ApiKeyRecord,
    DrainKind,
    Origin,
    OriginHealth,
    ProxyRecord,
    Region,
    Tenant,
    check_note,
    url_warnings,
)
from ponto.features import KEY_SUSPENSION
from ponto.grpcconn import WARNING_METADATA
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)

# How long a write's warnings may take to read after the write is saved: past
# it the reply goes without them (pontoctl's deadline is 10 s, and etcd's
# calls time out at 3 s each).
WARNINGS_READ_S = 1.0

Ctx = grpc.aio.ServicerContext[Any, Any]
R = TypeVar("R")

# Metadata past gRPC's default limit (8 KiB) would fail a call whose write has
# succeeded, at the client: the warnings of one reply stay well under it.
WARNINGS_BYTES = 4096


def warnings_metadata(
    warnings: Sequence[str], then: Sequence[str] = ()
) -> tuple[tuple[str, str], ...]:
    """Trailing metadata carrying warnings (WARNING_METADATA, one value each),
    then the warnings `then`, which go first into the budget: past
    WARNINGS_BYTES (less what `then` takes) the rest of `warnings` are counted
    in one value (and so are those of `then` past the whole budget)."""
    last = warnings_metadata(then) if then else ()
    sent: list[tuple[str, str]] = []
    size = sum(len(value) for _, value in last)
    for i, warning in enumerate(warnings):
        size += len(warning)
        if size > WARNINGS_BYTES:
            sent.append((WARNING_METADATA, f"and {len(warnings) - i} more warnings like these"))
            break
        sent.append((WARNING_METADATA, warning))
    return (*sent, *last)


# A write's own warnings while fleet_warned collects them (None outside it).
_OWN_WARNINGS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "own_warnings", default=None
)


def warn(context: Ctx, warnings: Sequence[str]) -> None:
    """Send a write's own warnings with its reply: through fleet_warned, which
    adds the fleet's, or (a call without it) in the trailing metadata now."""
    if not warnings:
        return
    own = _OWN_WARNINGS.get()
    if own is not None:
        own.extend(warnings)
    else:
        context.set_trailing_metadata(warnings_metadata(warnings))


async def checked(warnings: Awaitable[Sequence[str]], unchecked: str) -> Sequence[str]:
    """The warnings a write's reply carries, read after the write; () if etcd
    fails to answer the read they need, or takes more than WARNINGS_READ_S
    (`unchecked` is logged, without a traceback), rather than report a write
    that succeeded as failed, or past the caller's deadline."""
    try:
        return await asyncio.wait_for(warnings, WARNINGS_READ_S)
    except (Unavailable, TimeoutError) as exc:
        # A timeout says nothing (str(TimeoutError()) is ""), and an exception
        # is never false: its text is what may be empty.
        log.warning("%s: %s", unchecked, str(exc) or f"no answer within {WARNINGS_READ_S:g} s")
        return ()


async def drain_warned(
    catalog: Catalog, kind: DrainKind, name: str, drained: bool, changed: bool
) -> Sequence[str]:
    """The warnings of a drain (drained) or undrain of region or origin name
    (kind; model.drain_warnings, `checked`). A drain that changed nothing has
    none, since what it leaves is then not its doing; an undrain's are given
    whether it changed anything or not, since they say what still keeps the
    region or origin from traffic (an operator undraining an idle origin
    again wants to know why it is idle). For the Admin API and the status
    page alike."""
    if drained and not changed:
        return ()
    if drained:
        unchecked = f"{kind} {name} drained; the models it leaves unserved were not checked"
    elif kind == "origin":
        unchecked = f"origin {name} undrained; whether its region is drained was not checked"
    else:
        unchecked = f"region {name} undrained; whether its origins are all drained was not checked"
    return await checked(catalog.drain_warnings(kind, name, drained), unchecked)


async def _fleet_warnings(catalog: Catalog) -> Sequence[str]:
    return (
        *fleet_warnings(await catalog.list_proxies(traffic=False)),
        *origin_warnings(await catalog.continuing_kinds()),
    )


def fleet_warned(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Add to a write's warnings (after its own, in the same trailing
    metadata) those of controlplane.fleetwarnings: proxies refusing the route
    table, which the write will not reach either, what proxies cannot use
    of it, and origins with continuation on that cannot continue. Read after
    the write succeeded, `checked`."""

    @functools.wraps(fn)
    async def call(self: AdminService, request: Any, context: Ctx) -> R:
        own: list[str] = []
        collecting = _OWN_WARNINGS.set(own)
        try:
            response = await fn(self, request, context)
        finally:
            _OWN_WARNINGS.reset(collecting)
        unchecked = "write saved; could not read whether proxies refuse the route table"
        found = await checked(_fleet_warnings(self._catalog), unchecked)
        # The fleet's are few (one per reason) and what the write may not
        # reach: never cut for the write's own, however many (trial 29: 35
        # unserved names hid them, and a second cut counted them apart).
        if own or found:
            context.set_trailing_metadata(warnings_metadata(own, then=found))
        return response

    return call


def region_pb(r: Region) -> pb.Region:
    return pb.Region(
        name=r.name,
        latitude=r.latitude,
        longitude=r.longitude,
        drained=r.drained,
        rtt_ms=dict(r.rtt_ms),
        spill_threshold=r.spill_threshold,
    )


def origin_pb(o: Origin, health: OriginHealth | None = None) -> pb.Origin:
    return pb.Origin(
        name=o.name,
        base_url=o.base_url,
        region=o.region,
        models=list(o.models),
        weight=o.weight,
        drained=o.drained,
        # As in the table (controlplane.compile): an origin not probed is
        # healthy whatever an earlier probe of it said.
        healthy=health.healthy if health and o.probe else True,
        capacity=o.capacity,
        # Nor its server: no probe reads it (review: a probe's of before
        # stood for ever). Its load is the leader's scrape's (ListOrigins).
        health_detail=health.detail if health and o.probe else "",
        credential_env=o.credential_env,
        credential_file=o.credential_file,
        no_continuation=not o.continuation,
        server_kind=health.server_kind if health and o.probe else "",
        inflight_unknown=health.inflight_unknown if health and o.probe else not o.probe,
        probe_path=o.probe_path,
        not_probed=not o.probe,
        model_names=dict(o.model_names),
        max_tokens_field=o.table_token_field,
    )


def key_pb(k: ApiKeyRecord) -> apb.ApiKeyInfo:
    return apb.ApiKeyInfo(
        id=k.id,
        tenant=k.tenant,
        description=k.description,
        limits=limits_pb(k.limits),
        created_at=k.created_at,
        revoked=k.revoked,
        revoked_at=k.revoked_at,
        expires_at=k.expires_at,
        models=k.models,
        suspended=k.suspended,
        suspended_reason=k.suspended_reason,
        suspended_at=k.suspended_at,
    )


def proxy_pb(p: ProxyRecord, unknown: str = "") -> apb.ProxyStatus:
    return apb.ProxyStatus(
        info=pb.ProxyInfo(
            name=p.name,
            region=p.region,
            address=p.address,
            version=p.version,
            features=p.features,
        ),
        session_id=p.session_id,
        acked_version=p.acked_version,
        last_error=p.last_error,
        warnings=proxy_warnings(p),
        control_plane_id=p.control_plane_id,
        connected_at=p.connected_at,
        replica_version=p.replica_version,
        unknown=unknown,
    )


def audit_entry_pb(e: AuditEntry) -> apb.AuditEntry:
    return apb.AuditEntry(
        time=e.time,
        actor=e.actor,
        action=e.action,
        target=e.target,
        source=e.source,
        result=e.result,
        message=e.message,
        detail=dict(e.detail),
        replica=e.replica,
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    """The Admin API. Mutating calls are recorded in `audit` (controlplane/api/auditing.py);
    token_required: the guard requires the admin token (it names the actor then)."""

    def __init__(
        self,
        catalog: Catalog,
        publisher: Publisher,
        audit: AuditLog,
        *,
        token_required: bool,
        clock: Callable[[], float] = time.monotonic,
        loads: Callable[[], pb.OriginLoads | None] = lambda: None,
    ) -> None:
        """`clock` paces the log lines of refused calls (`refused`); `loads`
        gives the leader's latest scrape of the origins' load while fresh
        (LoadHub.fresh: None once no leader scrapes), which ListOrigins
        reports in flight where it has an origin's."""
        self._catalog = catalog
        self._publisher = publisher
        self.audit = audit
        self.token_required = token_required
        self._refusals = RefusalLog(clock)
        self._loads = loads

    def refused(self, method: str, refusal: Refusal, request: Any, context: Ctx) -> None:
        """Log a call the core refused (grpc_errors) as the guard logs the
        calls it refuses: one WARNING line a minute per caller, method,
        status and message, the next saying how many were not logged (a
        script repeating a refused call cannot flood the log; one whose
        message quotes what it sent, a name changing each call, gets a line
        a call: only holders of the admin token reach this)."""
        self._refusals.refused(ADMIN_PREFIX + method, refusal, context.peer() or "", request)

    @grpc_errors
    @audited(auditing.put_region)
    @fleet_warned
    async def PutRegion(self, request: apb.PutRegionRequest, context: Ctx) -> pb.Region:
        if not request.HasField("region"):
            raise InvalidArgument("region is required")
        region = region_of(request.region)
        expected = region_of(request.expected) if request.HasField("expected") else None
        saved, before = await self._catalog.save_region(
            region, allow_update=request.allow_update, expected=expected
        )
        if before is not None:  # replaced: the trail says what the values were
            auditing.note(changes=region_changes(before, saved) or "nothing")
        await self._warn_rtts(context, f"region {saved.name} saved")
        return region_pb(saved)

    @grpc_errors
    @audited(auditing.named("region"))
    @fleet_warned
    async def DeleteRegion(self, request: apb.DeleteRequest, context: Ctx) -> apb.DeleteResponse:
        await self._catalog.delete_region(request.name)
        await self._warn_rtts(context, f"region {request.name} deleted")
        return apb.DeleteResponse()

    @grpc_errors
    async def ListRegions(self, request: apb.ListRequest, context: Ctx) -> apb.ListRegionsResponse:
        regions = await self._catalog.list_regions()
        return apb.ListRegionsResponse(regions=[region_pb(r) for r in regions])

    @grpc_errors
    @audited(auditing.drain("region"), auditing.drain_action("Region"))
    @fleet_warned
    async def DrainRegion(self, request: apb.DrainRequest, context: Ctx) -> pb.Region:
        region, changed = await self._catalog.drain_region(
            request.name, request.drained, dry_run=request.dry_run
        )
        auditing.note(changes=auditing.drain_changes(request.drained, changed))
        warnings = await drain_warned(
            self._catalog, "region", region.name, request.drained, changed
        )
        warn(context, warnings)
        done = "drained" if request.drained else "undrained"
        await self._warn_rtts(context, f"region {region.name} {done}")
        return region_pb(region)

    @grpc_errors
    @audited(auditing.put_origin)
    @fleet_warned
    async def PutOrigin(self, request: apb.PutOriginRequest, context: Ctx) -> pb.Origin:
        if not request.HasField("origin"):
            raise InvalidArgument("origin is required")
        origin = origin_of(request.origin)
        expected = origin_of(request.expected) if request.HasField("expected") else None
        saved, before = await self._catalog.save_origin(
            origin, allow_update=request.allow_update, expected=expected
        )
        if before is not None:  # replaced: the trail says what the values were
            auditing.note(changes=origin_changes(before, saved) or "nothing")
        warnings = url_warnings(saved)
        warn(context, warnings)
        return origin_pb(saved)

    @grpc_errors
    @audited(auditing.named("origin"))
    @fleet_warned
    async def DeleteOrigin(self, request: apb.DeleteRequest, context: Ctx) -> apb.DeleteResponse:
        await self._catalog.delete_origin(request.name)
        return apb.DeleteResponse()

    @grpc_errors
    async def ListOrigins(self, request: apb.ListRequest, context: Ctx) -> apb.ListOriginsResponse:
        state, proxies = await asyncio.gather(
            self._catalog.read(ORIGINS, HEALTH), self._catalog.list_proxies()
        )
        now = time.time()
        known = {o.name for o in state.origins}
        ejections = fleet_ejections(proxies, now)
        origins = [origin_pb(o, state.health.get(o.name)) for o in state.origins]
        # The leader's scrape's requests, as the status page shows them (the
        # health record's figure is not kept current: trial 94, an origin of
        # 64 that went from 1 request to none read 1/64 for good). Unknown
        # without one: a 0 there looks measured (trial 66).
        scraped = self._loads()
        live = {load.origin: load for load in scraped.loads} if scraped else {}
        for origin in origins:
            if (load := live.get(origin.name)) is not None and not origin.not_probed:
                origin.inflight = load.running + load.waiting
                origin.inflight_unknown = False
            else:
                origin.inflight_unknown = True
        return apb.ListOriginsResponse(
            origins=origins,
            ejections=[
                apb.OriginEjections(
                    origin=e.origin,
                    proxies=e.proxies,
                    last_failure=e.last_failure,
                    for_s=now - e.since,
                    ejected_now=e.ejected_now,
                    failed_s=now - e.failed_at,
                )
                for e in ejections.values()
                if e.origin in known
            ],
        )

    @grpc_errors
    @audited(auditing.drain("origin"), auditing.drain_action("Origin"))
    @fleet_warned
    async def DrainOrigin(self, request: apb.DrainRequest, context: Ctx) -> pb.Origin:
        origin, changed = await self._catalog.drain_origin(
            request.name, request.drained, dry_run=request.dry_run
        )
        auditing.note(changes=auditing.drain_changes(request.drained, changed))
        warnings = await drain_warned(
            self._catalog, "origin", origin.name, request.drained, changed
        )
        warn(context, warnings)
        return origin_pb(origin)

    @grpc_errors
    @audited(auditing.put_tenant)
    @fleet_warned
    async def PutTenant(self, request: apb.PutTenantRequest, context: Ctx) -> pb.Tenant:
        if not request.HasField("tenant"):
            raise InvalidArgument("tenant is required")
        tenant = tenant_of(request.tenant)
        saved, before = await self._catalog.save_tenant(tenant, allow_update=request.allow_update)
        if before is not None:  # replaced: the trail says what the values were
            auditing.note(changes=tenant_changes(before, saved) or "nothing")
        await self._warn_unserved(saved, context)
        return tenant_pb(saved)

    @grpc_errors
    @audited(auditing.update_tenant)
    @fleet_warned
    async def UpdateTenant(self, request: apb.UpdateTenantRequest, context: Ctx) -> pb.Tenant:
        if request.clear_jwt and request.HasField("jwt"):
            raise InvalidArgument("give jwt or clear_jwt, not both")

        before: list[Tenant] = []
        expected = request.expected if request.HasField("expected") else None

        def change(t: Tenant) -> Tenant:
            before[:] = [t]
            if expected is not None and not _as_read(t, expected):
                raise ChangedSinceRead(f"tenant {request.name!r}")
            if request.HasField("limits"):
                t = replace(t, limits=limits_of(request.limits))
            if request.HasField("cache"):
                t = replace(t, cache=cache_of(request.cache))
            if request.HasField("prompt"):
                t = replace(t, prompt=prompt_of(request.prompt))
            if request.HasField("routing"):
                t = replace(t, routing=routing_of(request.routing))
            if request.HasField("streams"):
                t = replace(t, streams=streams_of(request.streams))
            if request.HasField("models"):
                t = replace(t, models=models_of(request.models))
            if request.HasField("suspended"):
                t = replace(t, suspended=request.suspended)
                if not request.suspended:  # the reason goes with the suspension
                    t = replace(t, suspended_reason="")
            if request.HasField("suspended_reason"):
                t = replace(t, suspended_reason=request.suspended_reason)
            if request.HasField("jwt"):
                t = replace(t, jwt=jwt_of(request.jwt))
            if request.clear_jwt:
                t = replace(t, jwt=None)
            return t

        saved = await self._catalog.update_tenant(request.name, change)
        # The trail says what the values were, as it does of an Apply's.
        auditing.note(changes=tenant_changes(before[0], saved) or "nothing")
        # Of what was written, say what no origin serves (an update of the
        # limits alone does not repeat the aliases' warnings).
        aliases, routing = request.HasField("prompt"), request.HasField("routing")
        hedging, models = request.HasField("streams"), request.HasField("models")
        if aliases or routing or hedging or models:
            await self._warn_unserved(
                saved, context, aliases=aliases, routing=routing, hedging=hedging, models=models
            )
        return tenant_pb(saved)

    async def _warn_unserved(
        self,
        tenant: Tenant,
        context: Ctx,
        *,
        aliases: bool = True,
        routing: bool = True,
        hedging: bool = True,
        models: bool = True,
    ) -> None:
        """Warn, with the reply, of the models tenant's aliases (with aliases),
        per-model routing (with routing), per-model hedging (with hedging)
        and model list (with models or aliases) name that nothing serves
        (model.unserved_aliases, model.unserved_settings,
        model.access_warnings)."""
        await self._warn(
            context,
            self._catalog.unserved_models(
                tenant, aliases=aliases, routing=routing, hedging=hedging, models=models
            ),
            f"tenant {tenant.name} saved; its per-model settings and aliases were not checked",
        )

    async def _warn_rtts(self, context: Ctx, done: str) -> None:
        """Send what the RTT matrix warns of (model.rtt_warnings) with a
        region write's reply: while it is incomplete, whatever the write
        changed, since until then the RTTs given order nothing."""
        await self._warn(
            context, self._catalog.rtt_warnings(), f"{done}; the RTT matrix was not checked"
        )

    @staticmethod
    async def _warn(context: Ctx, warnings: Awaitable[Sequence[str]], unchecked: str) -> None:
        """Send the warnings (`checked`), with the reply, in its trailing metadata."""
        found = await checked(warnings, unchecked)
        warn(context, found)

    @grpc_errors
    @audited(auditing.named("tenant"))
    @fleet_warned
    async def DeleteTenant(self, request: apb.DeleteRequest, context: Ctx) -> apb.DeleteResponse:
        await self._catalog.delete_tenant(request.name)
        return apb.DeleteResponse()

    @grpc_errors
    async def ListTenants(self, request: apb.ListRequest, context: Ctx) -> apb.ListTenantsResponse:
        return apb.ListTenantsResponse(
            tenants=[tenant_pb(t) for t in await self._catalog.list_tenants()],
            spent=await self._spent("t/"),
        )

    async def _spent(self, prefix: str) -> list[apb.BudgetSpent]:
        spent = await self._catalog.budgets_spent(prefix, time.time())
        return [
            apb.BudgetSpent(
                scope=scope,
                day=day,
                day_tokens=d,
                month_tokens=m,
                last_day=last_day,
                last_day_tokens=ld,
                last_month=last_month,
                last_month_tokens=lm,
            )
            for scope, (day, d, m, last_day, ld, last_month, lm) in sorted(spent.items())
        ]

    @grpc_errors
    @audited(auditing.create_key)
    @fleet_warned
    async def CreateKey(self, request: apb.CreateKeyRequest, context: Ctx) -> apb.CreateKeyResponse:
        # Shown in `pontoctl key list`'s rows: one line of text, never escapes
        # for the terminal of whoever lists the keys.
        check_note("key description", request.description)
        record, secret, revision = await self._catalog.create_key(
            request.tenant,
            description=request.description,
            limits=limits_of(request.limits),
            expires_at=request.expires_at,
            expires_in=request.expires_in_s,
            models=request.models,
        )
        if record.models:
            await self._warn_key_models(record, context)
        return apb.CreateKeyResponse(key=key_pb(record), secret=secret, revision=revision)

    @grpc_errors
    async def ListKeys(self, request: apb.ListKeysRequest, context: Ctx) -> apb.ListKeysResponse:
        keys = await self._catalog.list_keys(
            request.tenant, include_revoked=request.include_revoked
        )
        page = page_of(
            keys,
            request.page_size,
            request.page_token,
            tenant=request.tenant,
            include_revoked=request.include_revoked,
        )
        spent = await self._spent("k/")
        if request.page_size or request.page_token:  # a page: its keys' spend alone
            spent = spent_of((k.id for k in page.keys), spent)
        return apb.ListKeysResponse(
            keys=[key_pb(k) for k in page.keys], spent=spent, next_page_token=page.next_token
        )

    @grpc_errors
    @audited(auditing.revoke_key)
    @fleet_warned
    async def RevokeKey(self, request: apb.KeyRequest, context: Ctx) -> apb.ApiKeyInfo:
        return key_pb(await self._catalog.revoke_key(request.id))

    @grpc_errors
    @audited(auditing.set_key_limits)
    @fleet_warned
    async def SetKeyLimits(self, request: apb.SetKeyLimitsRequest, context: Ctx) -> apb.ApiKeyInfo:
        before: list[ApiKeyRecord] = []
        expected = limits_of(request.expected) if request.HasField("expected") else None
        saved = await self._catalog.set_key_limits(
            request.id, limits_of(request.limits), seen=before.append, expected=expected
        )
        auditing.note(changes=limit_changes(before[-1].limits, saved.limits) or "nothing")
        return key_pb(saved)

    @grpc_errors
    @audited(auditing.set_key_models)
    @fleet_warned
    async def SetKeyModels(self, request: apb.SetKeyModelsRequest, context: Ctx) -> apb.ApiKeyInfo:
        before: list[ApiKeyRecord] = []
        saved = await self._catalog.set_key_models(request.id, request.models, seen=before.append)
        auditing.note(changes=model_changes(before[-1].models, saved.models) or "nothing")
        await self._warn_key_models(saved, context)
        return key_pb(saved)

    async def _warn_key_models(self, key: ApiKeyRecord, context: Ctx) -> None:
        """Warn, with the reply, of the models key may name that nothing
        serves or its tenant may not name (model.access_warnings)."""
        await self._warn(
            context,
            self._catalog.key_model_warnings(key),
            f"key {key.id} saved; its models were not checked",
        )

    @grpc_errors
    @audited(auditing.set_key_suspended, auditing.key_suspension_action)
    @fleet_warned
    async def SetKeySuspended(
        self, request: apb.SetKeySuspendedRequest, context: Ctx
    ) -> apb.ApiKeyInfo:
        saved, before = await self._catalog.set_key_suspended(
            request.id, request.suspended, request.reason if request.HasField("reason") else None
        )
        auditing.note(changes=auditing.suspension_changes(before, saved))
        if before is not None and not before.suspended and saved.suspended:
            await self._warn(
                context,
                self._lacking(KEY_SUSPENSION, "serve the key's callers"),
                f"key {saved.id} suspended; could not read which processes enforce it",
            )
        return key_pb(saved)

    async def _lacking(self, feature: str, meanwhile: str) -> list[str]:
        """Warnings naming the processes that do not list `feature`
        (ponto/features.py), for a write that saved a setting it gates: the
        proxies (which `meanwhile` until upgraded) and the control-plane
        replicas (a table compiled while one leads lacks the setting: every
        proxy then does as those do). Trial 69: a suspended tenant's and
        key's callers were served behind one older component, unsaid."""
        proxies, (replicas, _) = await asyncio.gather(
            self._catalog.list_proxies(traffic=False), self._catalog.list_replicas()
        )
        found = []
        old_proxies = sorted(p.name for p in proxies if feature not in p.features)
        if old_proxies:
            found.append(
                f"proxies {', '.join(old_proxies)} are of a build without {feature}, or "
                f"registered through a replica of one (pontoctl get proxies, VERSION): "
                f"they {meanwhile} until upgraded"
            )
        old_replicas = sorted(
            str(r.get("id", "?"))
            for r in replicas
            if not (isinstance(listed := r.get("features"), list) and feature in listed)
        )
        if old_replicas:
            found.append(
                f"control-plane replicas {', '.join(old_replicas)} are of a build without "
                f"{feature} (pontoctl get controlplanes, VERSION): while one of them leads, "
                f"the tables lack it and every proxy does the same"
            )
        return found

    @grpc_errors
    @audited(auditing.set_key_expiry)
    @fleet_warned
    async def SetKeyExpiry(self, request: apb.SetKeyExpiryRequest, context: Ctx) -> apb.ApiKeyInfo:
        return key_pb(
            await self._catalog.set_key_expiry(request.id, request.expires_at, request.expires_in_s)
        )

    @grpc_errors
    @audited(auditing.purge_cache)
    @fleet_warned
    async def PurgeCache(
        self, request: apb.PurgeCacheRequest, context: Ctx
    ) -> apb.PurgeCacheResponse:
        purge = await self._catalog.purge_cache(request.tenant, request.model)
        if purge.model:
            await self._warn(
                context,
                self._catalog.unserved_purge(purge.tenant, purge.model),
                f"cache purge {purge.revision} sent; its model was not checked",
            )
        return apb.PurgeCacheResponse(
            purge=pb.CachePurge(revision=purge.revision, tenant=purge.tenant, model=purge.model)
        )

    @grpc_errors
    async def ListProxies(self, request: apb.ListRequest, context: Ctx) -> apb.ListProxiesResponse:
        (proxies, (replicas, _)) = await asyncio.gather(
            self._catalog.list_proxies(), self._catalog.list_replicas()
        )
        by_id = {str(r.get("id", "")): r for r in replicas}
        latest = self._publisher.latest
        age = time.monotonic() - latest.published_at if latest else 0.0
        silences = self._catalog.replica_beats.silences()
        return apb.ListProxiesResponse(
            proxies=[
                proxy_pb(p, table_state(p, by_id, latest, age, silences)[0])
                for p in sorted(proxies, key=lambda p: p.name)
            ],
            current_version=latest.version if latest else 0,
        )

    @grpc_errors
    async def ListControlPlanes(
        self, request: apb.ListRequest, context: Ctx
    ) -> apb.ListControlPlanesResponse:
        replicas, leader = await self._catalog.list_replicas()
        return apb.ListControlPlanesResponse(
            leader=leader,
            replicas=[
                apb.ControlPlaneInfo(
                    id=str(r.get("id", "")),
                    address=str(r.get("address", "")),
                    started_at=float(r.get("started_at", 0.0)),  # type: ignore[arg-type]
                    leader=r.get("id") == leader,
                    version=str(r.get("version", "")),
                    features=[str(f) for f in listed]
                    if isinstance(listed := r.get("features"), list)
                    else [],
                )
                for r in sorted(replicas, key=lambda r: str(r.get("id", "")))
            ],
        )

    @grpc_errors
    @audited(auditing.apply)
    @fleet_warned
    async def Apply(self, request: apb.ApplyRequest, context: Ctx) -> apb.ApplyResponse:
        try:
            doc = orjson.loads(request.document or "{}")
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the document is not valid JSON: {exc}") from exc
        plan = await self._catalog.apply(doc, prune=request.prune, dry_run=request.dry_run)
        warn(context, plan.warnings)
        return apb.ApplyResponse(
            changes=[
                apb.Change(
                    kind=c.kind,
                    name=c.name,
                    action=c.action,
                    fields=list(c.fields),
                    changes=[
                        apb.FieldChange(path=f.path, before=f.before, after=f.after)
                        for f in c.changes
                    ],
                )
                for c in plan.changes
            ],
            dry_run=request.dry_run,
        )

    @grpc_errors
    async def Export(self, request: apb.ListRequest, context: Ctx) -> apb.ExportResponse:
        doc = await self._catalog.export()
        return apb.ExportResponse(document=orjson.dumps(doc).decode())

    @grpc_errors
    async def GetRouteTable(
        self, request: apb.ListRequest, context: Ctx
    ) -> apb.GetRouteTableResponse:
        latest = self._publisher.latest
        if latest is None:
            return apb.GetRouteTableResponse()
        # The Responses id keys are the fleet's secret, for proxies only: an
        # operator's view shows them as their count of empty values.
        table = pb.RouteTable()
        table.CopyFrom(latest.table)
        del table.response_id_keys[:]
        table.response_id_keys.extend(b"" for _ in latest.table.response_id_keys)
        return apb.GetRouteTableResponse(table=table)

    @grpc_errors
    @audited(auditing.adopt_fleet)
    async def AdoptFleet(
        self, request: apb.AdoptFleetRequest, context: Ctx
    ) -> apb.AdoptFleetResponse:
        previous = await self._catalog.adopt_fleet(request.fleet_id)
        auditing.note(previous=previous or "none")
        return apb.AdoptFleetResponse(fleet_id=request.fleet_id, previous=previous)

    @grpc_errors
    async def ListAudit(self, request: apb.ListAuditRequest, context: Ctx) -> apb.ListAuditResponse:
        if not math.isfinite(request.since) or request.since < 0:
            raise InvalidArgument("since must be a time (Unix seconds), or 0")
        entries = await self.audit.read(
            limit=request.limit or 100,
            action=request.action,
            actor=request.actor,
            since=request.since,
        )
        return apb.ListAuditResponse(entries=[audit_entry_pb(e) for e in entries])


def _as_read(stored: Tenant, expected: pb.Tenant) -> bool:
    """Whether tenant `stored` (as decoded) is still as a caller read it: its
    ListTenants entry, which is the record in its normal form (validated as
    stored: aliases sorted, a cache mode filled in), or its name alone when
    ListTenants had none: the open tenant before it has a record, or a record
    that cannot be listed (review 200: one stored out of order, by hand or
    by another version, never compared equal, and every write was refused
    as changed)."""
    try:
        listed: pb.Tenant | None = tenant_pb(stored.validated(stored=True))
    except InvalidArgument:
        listed = None
    if listed is not None and listed == expected:
        return True
    unlisted = listed is None or stored == Tenant(stored.name)
    return unlisted and expected == pb.Tenant(name=stored.name)
