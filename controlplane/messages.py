"""Admin API messages to model values: one conversion for the servicer and pontoctl.

pontoctl converts what it is about to send and validates it with the model's
own `validated()`, so a bad flag is refused before anything is written with
the message the control plane would give.
"""

from __future__ import annotations

from controlplane.errors import InvalidArgument
from controlplane.model import (
    JWT_DEFAULT_MAX_LIFETIME_S,
    CachePolicy,
    JwtIssuer,
    Limits,
    ModelAccess,
    Origin,
    PromptPolicy,
    Region,
    RoutingPolicy,
    StreamPolicy,
    Tenant,
)
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def region_of(spec: apb.RegionSpec) -> Region:
    return Region(
        spec.name,
        spec.latitude,
        spec.longitude,
        rtt_ms=tuple(spec.rtt_ms.items()),
        spill_threshold=spec.spill_threshold,
    )


def origin_of(spec: apb.OriginSpec) -> Origin:
    return Origin(
        spec.name,
        spec.base_url,
        spec.region,
        tuple(spec.models),
        spec.weight,
        capacity=spec.capacity,
        credential_env=spec.credential_env,
        credential_file=spec.credential_file,
        continuation=_on_off(spec.continuation, "continuation"),
        probe_path=spec.probe_path,
        probe=_on_off(spec.probe, "probe"),
        model_names=tuple(spec.model_names.items()),
        max_tokens_field=spec.max_tokens_field or "max_tokens",
    )


def limits_of(m: pb.Limits) -> Limits:
    return Limits(
        rpm=m.rpm,
        tpm=m.tpm,
        concurrency=m.concurrency,
        tokens_per_day=m.tokens_per_day,
        tokens_per_month=m.tokens_per_month,
    )


def prompt_of(m: pb.PromptPolicy) -> PromptPolicy:
    return PromptPolicy(
        system_prompt=m.system_prompt,
        enforce_system_prompt=m.enforce_system_prompt,
        defaults=tuple(m.defaults.items()),
        max_tokens_ceiling=m.max_tokens_ceiling,
        aliases=tuple(m.aliases.items()),
    )


def cache_of(m: pb.CachePolicy) -> CachePolicy:
    return CachePolicy(
        mode=m.mode,
        semantic_threshold=m.semantic_threshold,
        ttl_s=m.ttl_s,
        cache_nondeterministic=m.cache_nondeterministic,
        store_truncated=m.store_truncated,
        semantic_max_error=m.semantic_max_error,
    )


def routing_of(m: pb.RoutingPolicy) -> RoutingPolicy:
    return RoutingPolicy(
        mode=m.mode,
        models=tuple(m.models.items()),
        user_sessions=m.user_sessions,
        load_bound=m.load_bound,
    )


def streams_of(m: pb.StreamPolicy) -> StreamPolicy:
    return StreamPolicy(
        continuation=m.continuation,
        max_continuations=m.max_continuations,
        stream_idle_timeout_s=m.stream_idle_timeout_s,
        hedge_ms=m.hedge_ms,
        hedge_auto=m.hedge_auto,
        hedge_models=tuple(m.hedge_models.items()),
    )


def models_of(m: pb.ModelAccess) -> ModelAccess:
    return ModelAccess(tuple(m.names))


def _on_off(value: str, name: str) -> bool:
    if value not in ("", "on", "off"):
        raise InvalidArgument(f"{name} must be on or off, not {value!r}")
    return value != "off"


def jwt_of(m: pb.JwtIssuer) -> JwtIssuer:
    return JwtIssuer(
        issuer=m.issuer,
        audiences=tuple(m.audiences),
        algorithms=tuple(m.algorithms),
        jwks_file=m.jwks_file,
        jwks_url=m.jwks_url,
        hs256_secret_file=m.hs256_secret_file,
        hs256_secret_env=m.hs256_secret_env,
        leeway_s=m.leeway_s if m.leeway_s else 30.0,
        max_lifetime_s=m.max_lifetime_s or JWT_DEFAULT_MAX_LIFETIME_S,
    )


def tenant_of(m: pb.Tenant) -> Tenant:
    return Tenant(
        name=m.name,
        limits=limits_of(m.limits),
        prompt=prompt_of(m.prompt),
        cache=cache_of(m.cache),
        jwt=jwt_of(m.jwt) if m.HasField("jwt") else None,
        routing=routing_of(m.routing),
        streams=streams_of(m.streams),
        models=models_of(m.models),
        suspended=m.suspended,
        suspended_reason=m.suspended_reason,
        suspended_at=m.suspended_at,
    )
