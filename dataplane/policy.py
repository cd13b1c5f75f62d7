"""Per-table edge policy: who may call, which limits apply, how requests are shaped.

Compiled once per route table (like Routes), so the hot path only does dict
lookups. Compiling reads JWKS and secret files named by tenants; a tenant whose
files are missing or broken keeps only its JWTs from working (they are answered
503 auth_unavailable; see dataplane.auth.authenticator), the rest of the table
is used, and the problem is in `EdgePolicy.authenticator.problems`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from dataplane.assemble import NO_RULES, PromptRules
from dataplane.auth.authenticator import (
    DEFAULT_JWT_MAX_LIFETIME_S,
    AuthConfigError,
    Authenticator,
    JwtConfig,
    KeyRecord,
    Principal,
)
from dataplane.auth.remote import KeySets
from dataplane.cache.policy import CacheMode, TenantCachePolicy
from dataplane.placement.picker import DEFAULT_LOAD_BOUND, MODES, RoutingRules
from dataplane.routes import TableError
from dataplane.upstream.hedge import AUTO, HedgeSetting
from dataplane.upstream.responseids import owner
from ponto.quota_types import ScopeLimits, key_scope, scope_limits, tenant_scope
from ponto.routetable import OPEN_TENANT
from ponto.v1 import routing_pb2 as pb

DEFAULT_TENANT = OPEN_TENANT
# Chosen from the evaluation in bench/cache_eval.py (docs/semantic-cache.md).
DEFAULT_SEMANTIC_THRESHOLD = 0.9
# The largest answer kept (--cache-max-entry-kb): a stream is recorded up to
# this, so it also bounds what each stream in flight holds for the cache.
DEFAULT_MAX_ENTRY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class CacheDefaults:
    """The proxy's own defaults for what a tenant leaves at 0."""

    ttl_s: float = 3600.0
    semantic_threshold: float = DEFAULT_SEMANTIC_THRESHOLD
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES


DEFAULT_MAX_CONTINUATIONS = 2


@dataclass(frozen=True, slots=True)
class StreamRules:
    """A tenant's rules for broken and slow streams (docs/streams.md)."""

    continuation: bool = True
    max_continuations: int = DEFAULT_MAX_CONTINUATIONS
    idle_timeout_s: float = 0.0  # 0: the proxy's --stream-idle-timeout
    hedge: HedgeSetting | None = None  # None: no hedging
    hedge_models: Mapping[str, HedgeSetting | None] = field(default_factory=dict)

    def hedge_for(self, model: str) -> HedgeSetting | None:
        if model in self.hedge_models:
            return self.hedge_models[model]
        return self.hedge


def _hedge(ms: str) -> HedgeSetting | None:
    if ms == AUTO:
        return AUTO
    return int(ms) / 1000 if int(ms) else None


@dataclass(frozen=True, slots=True)
class TenantRules:
    name: str
    prompt: PromptRules
    cache: TenantCachePolicy
    routing: RoutingRules = field(default_factory=RoutingRules)
    streams: StreamRules = field(default_factory=StreamRules)
    # The models its callers may name, as they send them; None: every model.
    models: frozenset[str] | None = None
    # Who its Responses ids are signed for (responseids.owner: its name and
    # its record's birth), and whether ids signed for its name alone are
    # its own too: its record was born before ids were signed for records
    # (RouteTable.response_id_owners_from), so they were made for it.
    id_owner: str = field(default="", compare=False)
    id_legacy: bool = field(default=True, compare=False)

    def signs_for(self, tenant: str) -> tuple[str, str | None]:
        """The owner and legacy owner (IdKeys.verified) of tenant `tenant`'s
        ids, these being its rules (or the default's, which stand for a
        tenant without rules of its own)."""
        if self.name != tenant or not self.id_owner:
            return tenant, None
        legacy = self.id_legacy and self.id_owner != tenant
        return self.id_owner, (tenant if legacy else None)


@dataclass(frozen=True, slots=True)
class EdgePolicy:
    authenticator: Authenticator
    tenants: Mapping[str, TenantRules]
    limits: Mapping[str, ScopeLimits]
    # (revision, tenant, model) of cache purges, oldest first.
    purges: tuple[tuple[int, str, str], ...] = ()
    default: TenantRules = field(
        default_factory=lambda: TenantRules(DEFAULT_TENANT, NO_RULES, TenantCachePolicy())
    )
    # Key id -> the models its callers may name (within its tenant's), for
    # the keys that have a list.
    key_models: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # The tenants whose callers are refused (403 tenant_suspended).
    suspended: frozenset[str] = frozenset()
    # The ids of the keys whose callers are refused (403 api_key_suspended).
    suspended_keys: frozenset[str] = frozenset()

    def tenant(self, name: str) -> TenantRules:
        rules = self.tenants.get(name)
        return rules if rules is not None else self.default

    def refusing_list(self, principal: Principal, tenant: TenantRules, model: str) -> str:
        """Whose model list refuses principal, of tenant, the model it names
        (as the request names it, before the tenant's aliases): "tenant NAME"
        or "key ID"; "" when it may name it (within the tenant's list and its
        key's, where they have one)."""
        if tenant.models is not None and model not in tenant.models:
            return f"tenant {tenant.name}"
        own = self.key_models.get(principal.key_id)
        return f"key {principal.key_id}" if own is not None and model not in own else ""


def _cache(m: pb.CachePolicy, defaults: CacheDefaults) -> TenantCachePolicy:
    return TenantCachePolicy(
        mode=CacheMode(m.mode or "exact"),
        ttl_s=float(m.ttl_s) or defaults.ttl_s,
        semantic_threshold=m.semantic_threshold or defaults.semantic_threshold,
        semantic_max_error=m.semantic_max_error,
        cache_nondeterministic=m.cache_nondeterministic,
        store_truncated=m.store_truncated,
        max_entry_bytes=defaults.max_entry_bytes,
    )


def _routing(m: pb.RoutingPolicy, tenant: str) -> RoutingRules:
    for mode in (m.mode, *m.models.values()):
        if mode and mode not in MODES:
            raise TableError(f"tenant {tenant!r}: unknown routing mode {mode!r}")
    bound = m.load_bound or DEFAULT_LOAD_BOUND
    if not math.isfinite(bound) or bound < 1.0:
        raise TableError(f"tenant {tenant!r}: load bound {bound} is not a number >= 1")
    return RoutingRules(m.mode, dict(m.models), m.user_sessions, bound)


def _streams(m: pb.StreamPolicy, tenant: str) -> StreamRules:
    try:
        models = {model: _hedge(ms) for model, ms in m.hedge_models.items()}
    except ValueError as exc:
        raise TableError(f"tenant {tenant!r}: a per-model hedge delay is not a number") from exc
    idle = m.stream_idle_timeout_s
    if not math.isfinite(idle) or idle < 0:
        raise TableError(f"tenant {tenant!r}: stream idle timeout {idle} is not a duration")
    return StreamRules(
        continuation=m.continuation != "off",
        max_continuations=m.max_continuations or DEFAULT_MAX_CONTINUATIONS,
        idle_timeout_s=idle,
        hedge=AUTO if m.hedge_auto else (m.hedge_ms / 1000 if m.hedge_ms else None),
        hedge_models=models,
    )


def _prompt(m: pb.PromptPolicy, tenant: str) -> PromptRules:
    defaults = {}
    for name, text in m.defaults.items():
        try:
            defaults[name] = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise TableError(f"tenant {tenant!r}: default of {name!r} is not JSON") from exc
    return PromptRules(
        system_prompt=m.system_prompt,
        enforce_system_prompt=m.enforce_system_prompt,
        defaults=defaults,
        max_tokens_ceiling=m.max_tokens_ceiling,
        aliases=dict(m.aliases),
    )


def build_policy(
    table: pb.RouteTable,
    defaults: CacheDefaults | None = None,
    key_sets: KeySets | None = None,
) -> EdgePolicy:
    """Compile a table's tenants, keys and purges; raise TableError if unusable.
    JWKS URLs take their keys from `key_sets` (see Authenticator.build)."""
    defaults = defaults or CacheDefaults()
    tenants: dict[str, TenantRules] = {}
    limits: dict[str, ScopeLimits] = {}
    jwts: list[JwtConfig] = []
    births = {p.tenant: p.revision for p in table.purges if p.birth}
    owners_from = table.response_id_owners_from
    for t in table.tenants:
        if t.name in tenants:
            raise TableError(f"tenant {t.name!r} is listed twice")
        try:
            cache = _cache(t.cache, defaults)
        except ValueError as exc:
            raise TableError(f"tenant {t.name!r}: {exc}") from exc
        tenants[t.name] = TenantRules(
            t.name,
            _prompt(t.prompt, t.name),
            cache,
            _routing(t.routing, t.name),
            _streams(t.streams, t.name),
            frozenset(t.models.names) or None,
            owner(t.name, births.get(t.name, 0)),
            not owners_from or births.get(t.name, 0) < owners_from,
        )
        lim = scope_limits(t.limits)
        if not lim.unlimited:
            limits[tenant_scope(t.name)] = lim
        if t.HasField("jwt"):
            j = t.jwt
            jwts.append(
                JwtConfig(
                    tenant=t.name,
                    issuer=j.issuer,
                    audiences=tuple(j.audiences),
                    algorithms=tuple(j.algorithms),
                    jwks_file=j.jwks_file or None,
                    jwks_url=j.jwks_url or None,
                    hs256_secret_file=j.hs256_secret_file or None,
                    hs256_secret_env=j.hs256_secret_env or None,
                    leeway_s=j.leeway_s if math.isfinite(j.leeway_s) else 0.0,
                    # 0: a control plane older than the field; its default.
                    max_lifetime_s=j.max_lifetime_s or DEFAULT_JWT_MAX_LIFETIME_S,
                )
            )
    keys = []
    key_models = {}
    for k in table.keys:
        if k.tenant not in tenants:
            raise TableError(f"key {k.id!r} belongs to unknown tenant {k.tenant!r}")
        keys.append(KeyRecord(k.id, k.hash, k.tenant, k.expires_at))
        if k.models:
            key_models[k.id] = frozenset(k.models)
        lim = scope_limits(k.limits)
        if not lim.unlimited:
            limits[key_scope(k.id)] = lim
    try:
        authenticator = Authenticator.build(
            keys, jwts, closed=table.auth_required, key_sets=key_sets
        )
    except AuthConfigError as exc:
        raise TableError(str(exc)) from exc
    default = tenants.get(DEFAULT_TENANT) or TenantRules(
        DEFAULT_TENANT,
        NO_RULES,
        _cache(pb.CachePolicy(), defaults),
    )
    purges = tuple((p.revision, p.tenant, p.model) for p in table.purges)
    suspended = frozenset(t.name for t in table.tenants if t.suspended)
    # A table from a control plane older than key suspension has none.
    suspended_keys = frozenset(k.id for k in table.keys if k.suspended)
    return EdgePolicy(
        authenticator, tenants, limits, purges, default, key_models, suspended, suspended_keys
    )
