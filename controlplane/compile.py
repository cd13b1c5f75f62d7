"""Pure: desired state -> route table. No I/O, no clock.

The etag is a hash of the table's content without its version, so replicas
that compile the same state agree, and a change of revision that does not
change what proxies see (a proxy registering, say) is not pushed.

No load goes in a table: origins' loads reach the proxies apart, about twice
a second (controlplane.loadsync), and each proxy spills a region by them with
the capacities, health and thresholds a table gives (dataplane.routes,
Routes.spilled). A table carrying load was rebuilt, pushed, applied and saved
by every proxy every few seconds under traffic, for no change an operator or
a probe made.
"""

from __future__ import annotations

from dataclasses import replace

from controlplane.model import Limits, State, Tenant
from ponto.routetable import OPEN_TENANT, content_etag
from ponto.v1 import routing_pb2 as pb

DEFAULT_SPILL_THRESHOLD = 0.8


def compile_table(state: State) -> pb.RouteTable:
    """Build the table proxies serve from state read at state.revision.

    Origins whose region does not exist (deleted between validation and
    compile) are left out rather than shipped as a table proxies would refuse.
    """
    table = pb.RouteTable(version=state.revision)
    known = {r.name for r in state.regions}
    for origin in sorted(state.origins, key=lambda o: o.name):
        if origin.region not in known:
            continue
        health = state.health.get(origin.name)
        # An origin not probed is healthy from the moment probing is turned
        # off, whatever an earlier probe of it said: no later probe would
        # lift that verdict. The proxies' passive health judges it alone.
        verdict = health if origin.probe else None
        healthy = verdict.healthy if verdict else True
        # Nor are its load figures read: an origin not probed says nothing
        # of them (review: a probe's record of before stood for ever). One
        # whose figures are not read counts for neither its region's load nor
        # its capacity (ponto.routetable.counts_for_spill).
        unmeasured = verdict.inflight_unknown if verdict else not origin.probe
        table.origins.append(
            pb.Origin(
                name=origin.name,
                base_url=origin.base_url,
                region=origin.region,
                models=sorted(origin.models),
                weight=origin.weight,
                drained=origin.drained,
                healthy=healthy,
                capacity=origin.capacity,
                health_detail=verdict.detail if verdict else "",
                credential_env=origin.credential_env,
                credential_file=origin.credential_file,
                no_continuation=not origin.continuation,
                server_kind=verdict.server_kind if verdict else "",
                inflight_unknown=unmeasured,
                probe_path=origin.probe_path,
                not_probed=not origin.probe,
                model_names=dict(origin.model_names),
                max_tokens_field=origin.table_token_field,
            )
        )
    for region in sorted(state.regions, key=lambda r: r.name):
        table.regions.append(
            pb.Region(
                name=region.name,
                latitude=region.latitude,
                longitude=region.longitude,
                drained=region.drained,
                rtt_ms=dict(region.rtt_ms),
                spill_threshold=region.spill_threshold or DEFAULT_SPILL_THRESHOLD,
            )
        )
    tenants = {t.name for t in state.tenants}
    # The operators' reason and time are not the proxies': a table changes
    # with what they enforce.
    table.tenants.extend(
        tenant_pb(replace(t, suspended_reason="", suspended_at=0.0))
        for t in sorted(state.tenants, key=lambda t: t.name)
    )
    table.keys.extend(
        pb.ApiKey(
            id=k.id,
            hash=k.hash,
            tenant=k.tenant,
            limits=limits_pb(k.limits),
            expires_at=k.expires_at,
            models=k.models,
            suspended=k.suspended,
        )
        for k in sorted(state.keys, key=lambda k: k.id)
        if not k.revoked and k.tenant in tenants
    )
    # Revoked keys stay stored (keys are never deleted); an issuer does not,
    # so the store marks that one was there (state.auth_ever): a proxy whose
    # table requires auth refuses one that does not (dataplane.sync.holder).
    table.auth_required = (
        bool(state.keys) or any(t.jwt is not None for t in state.tenants) or state.auth_ever
    )
    # A tenant's birth is a purge of its name at its record's create revision:
    # a tenant made again under a deleted one's name is answered from nothing
    # the first one left (in a proxy's store, the region's Redis, the semantic
    # feed), even once the deletion's own purge is trimmed from the newest
    # MAX_PURGES (review of trial 46). A proxy runs each purge once and the
    # regions' epochs only grow, so a birth purges once; at the upgrade that
    # brought births, the tenants made since the last purge that covered them
    # lost their cached answers once. Not the built-in tenant's: requests
    # without a key were its own before it had a record, and its first
    # `tenant set default` purged every cached answer of an open fleet, in
    # each proxy and the regions' Redis (trial 61).
    purges = [
        pb.CachePurge(revision=p.revision, tenant=p.tenant, model=p.model) for p in state.purges
    ]
    purges.extend(
        pb.CachePurge(revision=rev, tenant=t.name, birth=True)
        for t in state.tenants
        if (rev := state.created.get(t.name, 0)) and t.name != OPEN_TENANT
    )
    table.purges.extend(sorted(purges, key=lambda p: p.revision))
    table.response_id_keys.extend(state.response_id_keys)
    table.response_id_owners_from = state.response_id_owners_from
    table.fleet_id = state.fleet_id
    table.etag = content_etag(table)
    return table


def limits_pb(limits: Limits) -> pb.Limits:
    return pb.Limits(
        rpm=limits.rpm,
        tpm=limits.tpm,
        concurrency=limits.concurrency,
        tokens_per_day=limits.tokens_per_day,
        tokens_per_month=limits.tokens_per_month,
    )


def tenant_pb(t: Tenant) -> pb.Tenant:
    out = pb.Tenant(
        name=t.name,
        limits=limits_pb(t.limits),
        prompt=pb.PromptPolicy(
            system_prompt=t.prompt.system_prompt,
            enforce_system_prompt=t.prompt.enforce_system_prompt,
            defaults=dict(t.prompt.defaults),
            max_tokens_ceiling=t.prompt.max_tokens_ceiling,
            aliases=dict(t.prompt.aliases),
        ),
        cache=pb.CachePolicy(
            mode=t.cache.mode,
            semantic_threshold=t.cache.semantic_threshold,
            ttl_s=t.cache.ttl_s,
            cache_nondeterministic=t.cache.cache_nondeterministic,
            store_truncated=t.cache.store_truncated,
            semantic_max_error=t.cache.semantic_max_error,
        ),
        routing=pb.RoutingPolicy(
            mode=t.routing.mode,
            models=dict(t.routing.models),
            user_sessions=t.routing.user_sessions,
            load_bound=t.routing.load_bound,
        ),
        streams=pb.StreamPolicy(
            continuation=t.streams.continuation,
            max_continuations=t.streams.max_continuations,
            stream_idle_timeout_s=t.streams.stream_idle_timeout_s,
            hedge_ms=t.streams.hedge_ms,
            hedge_auto=t.streams.hedge_auto,
            hedge_models=dict(t.streams.hedge_models),
        ),
        models=pb.ModelAccess(names=t.models.names),
        suspended=t.suspended,
        suspended_reason=t.suspended_reason,
        suspended_at=t.suspended_at,
    )
    if t.jwt is not None:
        out.jwt.CopyFrom(
            pb.JwtIssuer(
                issuer=t.jwt.issuer,
                audiences=list(t.jwt.audiences),
                algorithms=list(t.jwt.algorithms),
                jwks_file=t.jwt.jwks_file,
                jwks_url=t.jwt.jwks_url,
                hs256_secret_file=t.jwt.hs256_secret_file,
                hs256_secret_env=t.jwt.hs256_secret_env,
                leeway_s=t.jwt.leeway_s,
                max_lifetime_s=t.jwt.max_lifetime_s,
            )
        )
    return out
