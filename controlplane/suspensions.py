"""Pure: what is suspended, as the status page lists it. No I/O, no clock.

The table builder (controlplane/builder.py) derives a `Suspensions` from each
state it compiles a table from, so that the page reads it from memory as it
reads the table: a build of /api/status reads no state from etcd. The route
table could not serve instead: it carries a key's `suspended` flag but not
the operator's reason or since when, which proxies have no use for (and the
reason, free text, should not travel to every proxy's disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.model import State
from ponto.apikeys import key_expired

# Rows of each kind /api/status lists at most (the most recent keys first,
# tenants by name); the rest are counted. `pontoctl key list` and `get
# tenants` list every one.
LISTED = 50


@dataclass(frozen=True, slots=True)
class SuspendedTenant:
    name: str
    # The operator's words ("" when none were given; never shown to callers).
    reason: str
    # Unix seconds of the suspension; 0: not known (made by a control plane
    # older than the time).
    since: float = 0.0


@dataclass(frozen=True, slots=True)
class SuspendedKey:
    id: str
    tenant: str
    # Unix seconds of the suspension, this replica's clock when it was made;
    # 0: not known (suspended by a control plane older than reasons).
    since: float
    # The operator's words, free text (never shown to the key's callers).
    reason: str
    # As stored: 0 never expires (ponto.apikeys.key_expired says when it has).
    expires_at: float
    # Its tenant is suspended too: resuming the key alone serves nothing.
    tenant_suspended: bool


@dataclass(frozen=True, slots=True)
class Suspensions:
    """The suspended tenants and keys of one state. Immutable: shared by
    every page build that reads it while the builder replaces it whole."""

    # By name.
    tenants: tuple[SuspendedTenant, ...] = ()
    # Unrevoked keys of existing tenants (those the route table carries), the
    # most recently suspended first, those of unknown time last.
    keys: tuple[SuspendedKey, ...] = ()


def of_state(state: State) -> Suspensions:
    """The suspensions of `state`. Called once per table build, O(keys):
    a page build then only slices the result."""
    tenants = {t.name for t in state.tenants}
    suspended = {t.name: t for t in state.tenants if t.suspended}
    keys = [
        SuspendedKey(
            id=k.id,
            tenant=k.tenant,
            since=k.suspended_at,
            reason=k.suspended_reason,
            expires_at=k.expires_at,
            tenant_suspended=k.tenant in suspended,
        )
        # As compile_table ships them: a revoked key or one whose tenant is
        # gone is refused anyway, and is no suspension to undo.
        for k in state.keys
        if k.suspended and not k.revoked and k.tenant in tenants
    ]
    keys.sort(key=lambda k: (-k.since, k.id))
    by_name = tuple(
        SuspendedTenant(name, t.suspended_reason, t.suspended_at)
        for name, t in sorted(suspended.items())
    )
    return Suspensions(by_name, tuple(keys))


def status_rows(s: Suspensions | None, now: float, limit: int = LISTED) -> dict[str, Any]:
    """/api/status's `suspended` at `now` (Unix time): at most `limit` of
    each kind and how many more there are. `s` None: no table built yet."""
    s = s or Suspensions()
    return {
        "tenants": [
            {"name": t.name, "reason": t.reason, "since": t.since or None}
            for t in s.tenants[:limit]
        ],
        "more_tenants": max(0, len(s.tenants) - limit),
        "keys": [
            {
                "id": k.id,
                "tenant": k.tenant,
                "tenant_suspended": k.tenant_suspended,
                "since": k.since or None,
                "reason": k.reason,
                "expired": key_expired(k.expires_at, now),
            }
            for k in s.keys[:limit]
        ],
        "more_keys": max(0, len(s.keys) - limit),
    }
