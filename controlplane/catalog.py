"""Typed operations on the fleet's state, over any StateStore.

Layout in the store (one JSON object per key):
  /ponto/state/regions/NAME     Region       compiled into route tables
  /ponto/state/origins/NAME     Origin       compiled into route tables
  /ponto/state/health/NAME      OriginHealth written by the leader's probes
  /ponto/state/tenants/NAME     Tenant       limits, prompt and cache policy
  /ponto/state/keys/ID          ApiKeyRecord the key's hash, never the key
  /ponto/state/purges/ID        Purge        cache purges, the newest MAX_PURGES kept
  /ponto/state/secrets/response-ids  {"keys": [hex, ...]}: the Responses ids'
                                MAC keys (RouteTable.response_id_keys), the
                                first signs; made once (ensure_response_id_key)
  /ponto/state/fleet-id         {"id": hex}: the fleet's identity (RouteTable.
                                fleet_id), made once (ensure_fleet_id), changed
                                only by `pontoctl fleet adopt` (adopt_fleet)
  /ponto/proxies/NAME           ProxyRecord  under a replica's lease; not compiled
  /ponto/replicas/ID            control-plane replicas, under their own leases
  /ponto/acks/ID                a replica's proxies' ACKed versions, one key per replica
  /ponto/audit/TIME-ID          admin actions (controlplane/audit.py)

Everything under STATE_PREFIX is read in one range read, so a route table is
compiled from one consistent revision. Read-modify-write operations (drain) use
compare-and-swap on the key's revision and retry on conflict.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

import orjson

from controlplane import apply as topology
from controlplane.beats import ReplicaBeats
from controlplane.budget import LEDGER_PREFIX, decode_ledger, month_before
from controlplane.errors import (
    AlreadyExists,
    ChangedSinceRead,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutcomeUnknown,
    Superseded,
    Unavailable,
)
from controlplane.model import (
    MODEL_RE,
    ApiKeyRecord,
    DrainKind,
    Limits,
    Origin,
    OriginEjected,
    OriginHealth,
    ProxyRecord,
    Purge,
    Region,
    State,
    Tenant,
    access_warnings,
    check_fleet_id,
    check_model_names,
    check_name,
    check_reason,
    decode_fleet_id,
    decode_health,
    decode_id_keys,
    decode_key,
    decode_origin,
    decode_proxy,
    decode_purge,
    decode_region,
    decode_tenant,
    drain_warnings,
    encode,
    encode_over,
    rtt_warnings,
    suspension_stamped,
    unserved_aliases,
    unserved_purge,
    unserved_settings,
)
from controlplane.store import (
    MAX_REQUEST_BYTES,
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    StateStore,
    StoreUnavailable,
    Write,
    txn_size,
)
from controlplane.store import (
    OutcomeUnknown as StoreOutcomeUnknown,
)
from ponto.apikeys import issue_key, key_expired
from ponto.logs import ThrottledBy
from ponto.quota_types import utc_day
from ponto.routetable import OPEN_TENANT
from ponto.times import utc

log = logging.getLogger(__name__)

ROOT = "/ponto/"
# Written by the election; read here for operators.
LEADER_KEY = ROOT + "leader"
STATE_PREFIX = ROOT + "state/"
REGIONS = STATE_PREFIX + "regions/"
ORIGINS = STATE_PREFIX + "origins/"
HEALTH = STATE_PREFIX + "health/"
TENANTS = STATE_PREFIX + "tenants/"
KEYS = STATE_PREFIX + "keys/"
PURGES = STATE_PREFIX + "purges/"
# The fleet's Responses id keys (dataplane/upstream/responseids.py): one value,
# made by the first replica that builds a table without them, and read with
# the rest of the state, so every replica compiles the same keys.
RESPONSE_ID_KEYS = STATE_PREFIX + "secrets/response-ids"
# Made once, empty: its create revision is where Responses ids began to be
# signed for a tenant's record rather than its name (RouteTable.
# response_id_owners_from).
RESPONSE_ID_OWNERS = STATE_PREFIX + "secrets/response-id-owners"
RESPONSE_ID_KEY_BYTES = 32
# The fleet's identity: made, like the Responses id keys, by the first replica
# that builds a table without it. An etcd that lost its data (or another
# etcd) has none, so the replica that reads it makes a new one, whose tables
# the proxies of the old one refuse (dataplane.sync.holder).
FLEET_ID = STATE_PREFIX + "fleet-id"
FLEET_ID_BYTES = 8
# Made once, empty, by the builder when a table first requires auth: removing
# the last JWT issuer (tenant delete, an apply without its jwt block) must not
# open a fleet, as revoking the last key does not (revoked keys stay stored).
AUTH_REQUIRED = STATE_PREFIX + "auth-required"
MAX_PURGES = 64
PROXIES = ROOT + "proxies/"
REPLICAS = ROOT + "replicas/"
ACKS = ROOT + "acks/"
TRAFFIC = ROOT + "traffic/"
# name -> the last process that lost that name to a later one elsewhere (another
# address, or host: two proxies given one --name): {"address", "refused_at"}.
CONFLICTS = ROOT + "conflicts/"
# How long after its last refusal such a process is named beside the holder:
# it asks again every 30 s while it runs (dataplane.sync.link).
CONFLICT_SHOWN_S = 75.0
# name -> the proxy process that deregistered it last (Departure), under a
# short lease of its own (controlplane.registry.DEPARTED_TTL): what tells the
# replica holding its session to drop it rather than write its key back, and
# a Register of that process still under way to give up.
DEPARTED = ROOT + "departed/"
CAS_ATTEMPTS = 8
# The latest key expiry taken (year 9999): later is a mistake, not a time.
MAX_EXPIRY = 253402300799.0
_PREFIX = {"region": REGIONS, "origin": ORIGINS, "tenant": TENANTS}

T = TypeVar("T")
R = TypeVar("R", Region, Origin, Tenant)


class CreatedKey(NamedTuple):
    """A key `create_key` stored: its record, the key itself (shown once),
    and the store's revision it was saved at (a table of that version or
    later holds it)."""

    record: ApiKeyRecord
    key: str
    revision: int


async def _guard(
    aw: Awaitable[T], unconfirmed: Callable[[StoreOutcomeUnknown], None] | None = None
) -> T:
    """`aw`, its store's failures raised as the catalog's; an unknown outcome
    logged by `unconfirmed` when given (Catalog._rewritten), else as a change."""
    try:
        return await aw
    except StoreOutcomeUnknown as exc:
        if unconfirmed is not None:
            unconfirmed(exc)
        else:
            # Said here, once: the caller is told, but a change that may be
            # applied later is the operator's to know of from the log too.
            log.warning("a change may have been made though etcd did not confirm it: %s", exc)
        raise OutcomeUnknown(str(exc)) from exc
    except StoreUnavailable as exc:
        raise Unavailable(f"state store unavailable: {exc}") from exc


class Departure(NamedTuple):
    """A proxy process that deregistered (Routing.Deregister): its session
    (empty when its Register was not answered) and its start (0: not said)."""

    session_id: str
    started_at: float

    def of(self, record: ProxyRecord) -> bool:
        """Whether `record` is a registration of this process: its session, or,
        with no session said, the process started at `started_at` (a start is
        the process's own, to the microsecond; 0 matches none)."""
        if self.session_id:
            return record.session_id == self.session_id
        return self.started_at > 0 and record.started_at == self.started_at

    def encode(self) -> bytes:
        return orjson.dumps({"session_id": self.session_id, "started_at": self.started_at})

    @classmethod
    def decode(cls, raw: bytes) -> Departure | None:
        """The departure a DEPARTED key holds; None if it does not decode."""
        try:
            value = orjson.loads(raw)
            return cls(str(value["session_id"]), float(value["started_at"]))
        except (ValueError, TypeError, KeyError):
            return None


class Catalog:
    """The control plane's view of desired state. Safe for concurrent use."""

    def __init__(
        self,
        store: StateStore,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._clock = clock
        # When each replica's key was last seen to change (list_replicas).
        self.replica_beats = ReplicaBeats(monotonic)
        # API keys as the last snapshot decoded them (decode_state).
        self._keys: DecodedKeys = {}
        # The writes of `_rewritten` not confirmed, told once a minute each.
        self._unconfirmed = ThrottledBy(log, clock=monotonic)

    def _rewritten(self, aw: Awaitable[T], what: str) -> Awaitable[T]:
        """`_guard` for a write this replica makes again each round (origins'
        health, its ACK summary, its proxies' traffic), `what` it writes. Its
        outcome unknown is said as such, once a minute, not as a change that
        may have been made: the next round writes it again, and no operator
        made one (trial 101: twelve such warnings in an outage of 36 s)."""

        def unconfirmed(exc: StoreOutcomeUnknown) -> None:
            self._unconfirmed.log(
                what,
                logging.WARNING,
                "etcd did not confirm a write of %s (%s); the next round writes it again",
                what,
                exc,
            )

        return _guard(aw, unconfirmed)

    # ------------------------------------------------------------ snapshot

    async def snapshot(self) -> State:
        """Regions and origins at one revision; undecodable keys are skipped and logged.

        Decoded in a worker thread: at 20,000 keys decoding took 0.6 s,
        which on the event loop held the election's keep-alives and every
        probe meanwhile (trial 83: both replicas lost leadership once)."""
        listing = await _guard(self.store.list(STATE_PREFIX))
        items = listing.items
        if len(items) < _DECODE_ON_LOOP:
            self._keys = {}  # a state that shrank keeps no keys of its larger past
            return decode_state(listing.revision, items)
        # The keys as last decoded: one key's change decodes that key alone
        # (at 20,000 keys, 0.6 s of decoding a change went to about 0.1 s).
        # Replaced whole, so a deleted key goes with the next read.
        decoded: DecodedKeys = {}
        state = await asyncio.to_thread(decode_state, listing.revision, items, self._keys, decoded)
        self._keys = decoded
        return state

    async def read(self, *prefixes: str) -> State:
        """A State of what is stored under `prefixes` alone (each a record
        prefix such as REGIONS or KEYS), the rest left empty: for reads that
        do not need every key (`get regions` read all 20,000 keys in trial
        83). Each prefix is read at its own revision, not all at one; the
        State's revision is the highest. API keys unchanged since the last
        snapshot are taken as it decoded them (`delete_tenant`, `key list`
        and a tenant's model warnings decoded all 20,000 keys each time:
        0.5-0.8 s on a busy machine)."""
        listings = await asyncio.gather(*(_guard(self.store.list(p)) for p in prefixes))
        items = tuple(kv for listing in listings for kv in listing.items)
        revision = max((listing.revision for listing in listings), default=0)
        return await _decoded(revision, items, self._keys)

    async def ensure_response_id_key(self) -> None:
        """Make the fleet's Responses id key unless one is stored: created
        only if absent, so replicas that race all end with the one that won
        (a Conflict is that). Called by the table builder when a snapshot
        has none; the write wakes every replica's builder."""
        value = orjson.dumps({"keys": [secrets.token_bytes(RESPONSE_ID_KEY_BYTES).hex()]})
        try:
            await _guard(self.store.put(RESPONSE_ID_KEYS, value, if_absent=True))
        except Conflict:
            return
        log.info("made the fleet's Responses id key (%s)", RESPONSE_ID_KEYS)

    async def ensure_fleet_id(self, id_keys: tuple[bytes, ...]) -> str:
        """Make the fleet's id unless one is stored (created only if absent:
        of replicas that race, one wins and the others read its id); return
        the id made, "" when another replica's was there. Called by the table
        builder when a snapshot has none, with the Responses id keys stored
        (made first).

        The id is derived from the oldest of those keys (fleet_id_of), not
        drawn anew: a store of a fleet older than fleet ids, and a restore of
        a snapshot taken before its fleet id was made, get the fleet id the
        proxies serve, and the proxies take their tables (docs/operations.md:
        a restore must just work). An etcd that lost its data lost the keys
        too, and its new key gives a new fleet id."""
        fleet_id = fleet_id_of(id_keys[-1]) if id_keys else secrets.token_hex(FLEET_ID_BYTES)
        try:
            await _guard(self.store.put(FLEET_ID, orjson.dumps({"id": fleet_id}), if_absent=True))
        except Conflict:
            return ""
        return fleet_id

    async def mark_auth_required(self) -> None:
        """Mark, once, that the fleet has required auth (AUTH_REQUIRED,
        created only if absent). Called by the builder."""
        try:
            await _guard(self.store.put(AUTH_REQUIRED, b"", if_absent=True))
        except Conflict:
            return
        log.info("marked that the fleet requires auth from now on (%s)", AUTH_REQUIRED)

    async def adopt_fleet(self, fleet_id: str) -> str:
        """Make the stored fleet id `fleet_id` (the one proxies serve, which
        they name when they refuse this store's tables); return the one it
        replaced ("" when none was stored). The builder's watch publishes the
        state again under it. Compare-and-swap, as a replica making the
        first id may race it."""
        value = orjson.dumps({"id": check_fleet_id(fleet_id)})
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(FLEET_ID))
            try:
                previous = decode_fleet_id(current.value) if current is not None else ""
            except (ValueError, InvalidArgument):
                # A value edited by hand, not JSON or not an id: replaced
                # (review 293: an id that was no id made adopt fail).
                previous = ""
            try:
                await _guard(
                    self.store.put(
                        FLEET_ID,
                        value,
                        if_mod_revision=current.mod_revision if current is not None else 0,
                    )
                )
            except Conflict:
                continue
            log.warning("the fleet id is %s now (was %s): adopted", fleet_id, previous or "none")
            return previous
        raise Unavailable("the fleet id kept changing; try again")

    async def ensure_response_id_owners(self) -> None:
        """Mark, once, the revision from which Responses ids are signed for a
        tenant's record (RESPONSE_ID_OWNERS, created only if absent)."""
        try:
            await _guard(self.store.put(RESPONSE_ID_OWNERS, b"", if_absent=True))
        except Conflict:
            return
        log.info("marked where Responses ids began to be signed for tenants' records")

    async def put_health(self, health: OriginHealth, *, fence: Fence | None = None) -> None:
        """Leader-only write; with a fence it raises Conflict once leadership is lost."""
        await _guard(self.store.put(HEALTH + health.origin, encode(health), fence=fence))

    async def put_healths(
        self, healths: Sequence[OriginHealth], *, fence: Fence | None = None
    ) -> None:
        """As put_health, for several origins in as few transactions as etcd
        takes (_commit_batched): one table is rebuilt for them, not one each."""
        writes = [Write(HEALTH + h.origin, encode(h)) for h in healths]
        await self._commit_batched(writes, fence, "origins' health")

    async def delete_healths(self, origins: Iterable[str], *, fence: Fence | None = None) -> None:
        """Delete the health records of `origins` (leader-only, batched as
        put_healths): records whose origin is gone. A probe round that read
        an origin just before it was deleted writes its health after
        delete_origin dropped it, and nothing else deletes that record."""
        writes = [Write(HEALTH + name, None) for name in origins]
        await self._commit_batched(writes, fence, "origins' health")

    async def _commit_batched(
        self, writes: Sequence[Write], fence: Fence | None, what: str
    ) -> None:
        """Commit `writes` in as few transactions as etcd takes (MAX_TXN_OPS
        less the fence, within txn_size's bound), each checking `fence` when
        one is given. A
        transaction is all or nothing; one that failed leaves those before
        it written."""
        checks = [fence] if fence is not None else []
        step = MAX_TXN_OPS - len(checks)
        for i in range(0, len(writes), step):
            await self._rewritten(self.store.commit(writes[i : i + step], checks), what)

    # ------------------------------------------------------------ regions

    async def put_region(
        self, region: Region, *, allow_update: bool, expected: Region | None = None
    ) -> Region:
        """As save_region, the region as saved alone."""
        saved, _ = await self.save_region(region, allow_update=allow_update, expected=expected)
        return saved

    async def save_region(
        self, region: Region, *, allow_update: bool, expected: Region | None = None
    ) -> tuple[Region, Region | None]:
        """Create region, or replace it when allow_update; with `expected`,
        only a region whose settings (all but the drain flag) are still those
        (ChangedSinceRead), as save_origin. The region as saved, and the one
        it replaced (None: created): PutRegion's audit entry says what changed."""
        region = region.validated()
        return await self._put(
            "region", REGIONS, region, decode_region, allow_update, expected, _region_settings
        )

    async def get_region(self, name: str) -> Region:
        kv = await _guard(self.store.get(REGIONS + check_name("region", name)))
        if kv is None:
            raise NotFound(f"region {name!r} not found")
        return decode_region(kv.value)

    async def list_regions(self) -> list[Region]:
        return list((await self.read(REGIONS)).regions)

    async def delete_region(self, name: str) -> None:
        check_name("region", name)
        users = [o.name for o in (await self.read(ORIGINS)).origins if o.region == name]
        if users:
            raise FailedPrecondition(
                f"region {name!r} still has origins: {', '.join(users)}; delete or move them first"
            )
        if not await _guard(self.store.delete(REGIONS + name)):
            raise NotFound(f"region {name!r} not found")

    async def set_region_drained(self, name: str, drained: bool) -> Region:
        return (await self.drain_region(name, drained))[0]

    async def drain_region(
        self, name: str, drained: bool, *, dry_run: bool = False
    ) -> tuple[Region, bool]:
        """Set region name's drain flag: the region, and whether the flag
        changed (False: it was so already, and nothing was written). With
        `dry_run`, nothing is written: the region as stored, and False."""
        return await self._update_if(
            REGIONS + check_name("region", name),
            decode_region,
            lambda r: None if dry_run or r.drained == drained else replace(r, drained=drained),
            f"region {name!r} not found",
        )

    async def drain_warnings(self, kind: DrainKind, name: str, drained: bool) -> tuple[str, ...]:
        """model.drain_warnings of a drain (drained) or undrain of region or
        origin name (kind), in the state stored now."""
        state = await self.read(REGIONS, ORIGINS)
        return drain_warnings(kind, name, drained, state.regions, state.origins)

    async def rtt_warnings(self) -> tuple[str, ...]:
        """model.rtt_warnings of the regions stored now."""
        regions = (await self.read(REGIONS)).regions
        return rtt_warnings({r.name: [other for other, _ in r.rtt_ms] for r in regions})

    async def continuing_kinds(self) -> list[tuple[str, str]]:
        """(name, server kind as last probed) of each origin with
        continuation on, in the state stored now: what
        fleetwarnings.origin_warnings judges. Reads the origins and their
        health only (every Admin write calls it, as fleet_warned)."""
        origins = await _guard(self.store.list(ORIGINS))
        health = await _guard(self.store.list(HEALTH))
        kinds: dict[str, str] = {}
        for kv in health.items:
            try:
                h = decode_health(kv.value)
            except (ValueError, TypeError, KeyError):
                continue  # logged where the table is compiled (snapshot)
            kinds[h.origin] = h.server_kind
        out = []
        for kv in origins.items:
            try:
                o = decode_origin(kv.value)
            except (ValueError, TypeError, KeyError):
                continue
            if o.continuation:
                out.append((o.name, kinds.get(o.name, "")))
        return out

    # ------------------------------------------------------------ origins

    async def put_origin(
        self, origin: Origin, *, allow_update: bool, expected: Origin | None = None
    ) -> Origin:
        """As save_origin, the origin as saved alone."""
        saved, _ = await self.save_origin(origin, allow_update=allow_update, expected=expected)
        return saved

    async def save_origin(
        self, origin: Origin, *, allow_update: bool, expected: Origin | None = None
    ) -> tuple[Origin, Origin | None]:
        """Create origin, or replace it when allow_update; with `expected`,
        only an origin whose settings (all but the drain flag) are still
        those: a change made after the caller read them is not undone
        (FailedPrecondition; note 28: `origin add --update` read, then wrote).
        The origin as saved, and the one it replaced (None: created), as
        set_key_suspended says what it replaced: PutOrigin's audit entry
        says what changed."""
        origin = origin.validated()
        if await _guard(self.store.get(REGIONS + origin.region)) is None:
            raise NotFound(
                f"region {origin.region!r} of origin {origin.name!r} not found; "
                "add the region first"
            )
        # `expected` as read: not validated (a record stored before a rule,
        # or by hand, is compared as it is; helper-188).
        return await self._put(
            "origin", ORIGINS, origin, decode_origin, allow_update, expected, _origin_settings
        )

    async def list_origins(self) -> list[Origin]:
        return list((await self.read(ORIGINS)).origins)

    async def delete_origin(self, name: str) -> None:
        if not await _guard(self.store.delete(ORIGINS + check_name("origin", name))):
            raise NotFound(f"origin {name!r} not found")
        await _guard(self.store.delete(HEALTH + name))

    async def set_origin_drained(self, name: str, drained: bool) -> Origin:
        return (await self.drain_origin(name, drained))[0]

    async def drain_origin(
        self, name: str, drained: bool, *, dry_run: bool = False
    ) -> tuple[Origin, bool]:
        """As drain_region, for origin name."""
        return await self._update_if(
            ORIGINS + check_name("origin", name),
            decode_origin,
            lambda o: None if dry_run or o.drained == drained else replace(o, drained=drained),
            f"origin {name!r} not found",
        )

    async def _put(
        self,
        kind: str,
        prefix: str,
        value: R,
        decode: Callable[[bytes], R],
        allow_update: bool,
        expected: R | None = None,
        settings: Callable[[R], object] = lambda value: value,
    ) -> tuple[R, R | None]:
        """Create value, or replace it when allow_update; an update keeps the
        drain flag, because draining is its own operation. A replacement
        whose record moved meanwhile reads it again (create_key rewrites its
        tenant's record unchanged: nothing to refuse the replacement for).
        With `expected` (the record as its caller read it), only a stored
        record whose `settings` are still expected's is replaced
        (ChangedSinceRead otherwise), and one not stored is NotFound. The
        value written, and the stored one it replaced (None: none was)."""
        was = settings(expected) if expected is not None else None
        key = prefix + value.name
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(key))
            written = value
            stored: R | None = None
            if current is None and expected is not None:
                raise NotFound(f"{kind} {value.name!r} was deleted since it was read")
            if current is not None:
                if not allow_update:
                    raise AlreadyExists(
                        f"{kind} {value.name!r} already exists (pontoctl {kind} add --update "
                        "changes it)"
                    )
                stored = decode(current.value)
                if expected is not None and settings(stored) != was:
                    raise ChangedSinceRead(f"{kind} {value.name!r}")
                if isinstance(value, Region | Origin):
                    written = replace(value, drained=stored.drained)
            if isinstance(written, Tenant):
                old = stored if isinstance(stored, Tenant) else None
                written = suspension_stamped(written, old, self._clock)
            try:
                await _guard(
                    self.store.put(
                        key,
                        encode_over(written, current.value if current else None),
                        if_mod_revision=current.mod_revision if current else 0,
                    )
                )
            except Conflict as exc:
                if not allow_update:
                    raise AlreadyExists(f"{kind} {value.name!r} was changed concurrently") from exc
                continue
            return written, stored
        raise Unavailable(f"{kind} {value.name!r} kept changing; try again")

    async def _update(
        self,
        key: str,
        decode: Callable[[bytes], T],
        change: Callable[[T], T],
        missing: str,
        absent: Callable[[], T] | None = None,
    ) -> T:
        return (await self._update_if(key, decode, change, missing, absent))[0]

    async def _update_if(
        self,
        key: str,
        decode: Callable[[bytes], T],
        change: Callable[[T], T | None],
        missing: str,
        absent: Callable[[], T] | None = None,
    ) -> tuple[T, bool]:
        """Write change(the stored value) if the value was not changed
        meanwhile (else read again); a change of None writes nothing. The
        value now, and whether it was written. A key not stored is NotFound
        (`missing`), or with `absent` the change of its value, written only
        if the key is still not stored."""
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(key))
            if current is not None:
                stored, revision = decode(current.value), current.mod_revision
            elif absent is not None:
                stored, revision = absent(), 0
            else:
                raise NotFound(missing)
            updated = change(stored)
            if updated is None:
                return stored, False
            value = encode_over(updated, current.value if current else None)
            try:
                await _guard(self.store.put(key, value, if_mod_revision=revision))
            except Conflict:
                continue
            return updated, True
        raise Unavailable(f"{key} kept changing; try again")

    # ------------------------------------------------------------ tenants

    async def put_tenant(self, tenant: Tenant, *, allow_update: bool) -> Tenant:
        """As save_tenant, the tenant as saved alone."""
        saved, _ = await self.save_tenant(tenant, allow_update=allow_update)
        return saved

    async def save_tenant(
        self, tenant: Tenant, *, allow_update: bool
    ) -> tuple[Tenant, Tenant | None]:
        """Create tenant, or replace it when allow_update. The tenant as
        saved, and the one it replaced (None: created): PutTenant's audit
        entry says what changed."""
        tenant = tenant.validated()
        await self._check_issuer_unique(tenant)
        return await self._put("tenant", TENANTS, tenant, decode_tenant, allow_update)

    async def update_tenant(self, name: str, change: Callable[[Tenant], Tenant]) -> Tenant:
        # The issuer is checked before anything is stored: a duplicate issuer
        # saved even briefly makes every proxy refuse the next table.
        issuers = {
            t.jwt.issuer: t.name
            for t in (await self.read(TENANTS)).tenants
            if t.jwt is not None and t.name != name
        }

        def apply(t: Tenant) -> Tenant:
            changed = change(t)
            # A prompt stored before a rule is not refused by a write that
            # leaves it as it was (review 200: it blocked every suspension).
            kept = changed.prompt.system_prompt == t.prompt.system_prompt
            updated = suspension_stamped(changed.validated(stored=kept), t, self._clock)
            if updated.jwt is not None and updated.jwt.issuer in issuers:
                raise AlreadyExists(
                    f"JWT issuer {updated.jwt.issuer!r} already belongs to tenant "
                    f"{issuers[updated.jwt.issuer]!r}"
                )
            return updated

        # The open fleet's tenant has the built-in policy before it has a
        # record: a change starts from that (trial 33: `tenant set default`
        # answered NOT_FOUND until `tenant add default`).
        absent = (lambda: Tenant(OPEN_TENANT)) if name == OPEN_TENANT else None
        return await self._update(
            TENANTS + check_name("tenant", name),
            decode_tenant,
            apply,
            f"tenant {name!r} not found",
            absent,
        )

    async def unserved_models(
        self,
        tenant: Tenant,
        *,
        aliases: bool = True,
        routing: bool = True,
        hedging: bool = True,
        models: bool = True,
    ) -> tuple[str, ...]:
        """model.unserved_aliases (with aliases) and model.unserved_settings
        of the per-model routing (with routing) and hedging (with hedging;
        with aliases alone, the settings the aliases make dead), and
        model.access_warnings (with aliases or models) of tenant against the
        origins stored now."""
        state = await self.read(ORIGINS, KEYS)
        origins = state.origins
        listed = [k for k in state.keys if k.tenant == tenant.name and k.models and not k.revoked]
        return (
            (access_warnings(tenant, origins, keys=listed) if aliases or models else ())
            + (unserved_aliases(tenant, origins) if aliases else ())
            + (
                unserved_settings(tenant, origins, "routing", unserved=routing)
                if aliases or routing
                else ()
            )
            + (
                unserved_settings(tenant, origins, "hedging", unserved=hedging)
                if aliases or hedging
                else ()
            )
        )

    async def get_tenant(self, name: str) -> Tenant:
        kv = await _guard(self.store.get(TENANTS + check_name("tenant", name)))
        if kv is None:
            raise NotFound(f"tenant {name!r} not found")
        return decode_tenant(kv.value)

    async def list_tenants(self) -> list[Tenant]:
        return sorted((await self.read(TENANTS)).tenants, key=lambda t: t.name)

    async def budgets_spent(
        self, prefix: str, now: float
    ) -> dict[str, tuple[int, float, float, int, float, int, float]]:
        """scope -> (today's UTC day, tokens spent today, this month, and of
        the closed periods: yesterday, its tokens, last month (YYYYMM), its
        tokens) of the budgeted scopes starting with `prefix` ("t/", "k/"),
        from the leader's ledgers (controlplane.budget; Ledger.closed_used);
        a ledger not counted since the day (month) turned spent nothing of
        it yet, and its closed periods are what it counted. Whole tokens (a
        proxy's counts are; older ones held fractions of an estimate). One
        unreadable is left out (the leader logs it)."""
        today = utc_day(now)
        listing = await _guard(self.store.list(LEDGER_PREFIX + prefix))
        out = {}
        for kv in listing.items:
            try:
                ledger = decode_ledger(kv.value)
            except (ValueError, TypeError, KeyError, IndexError):
                continue
            day_tokens, month_tokens = ledger.used()
            last_day, last_day_tokens, last_month, last_month_tokens = ledger.closed_used()
            if ledger.day // 100 != today // 100:
                # Not counted since the month turned: its count is last month's.
                if ledger.day // 100 == month_before(today // 100):
                    last_month, last_month_tokens = ledger.day // 100, month_tokens
                day_tokens = month_tokens = 0.0
            elif ledger.day != today:
                day_tokens = 0.0
            if ledger.day != today:
                last_day, last_day_tokens = (0, 0.0)
                if utc_day(now - 86400) == ledger.day:
                    last_day, last_day_tokens = ledger.day, ledger.used()[0]
            out[kv.key[len(LEDGER_PREFIX) :]] = (
                today,
                float(round(day_tokens)),
                float(round(month_tokens)),
                last_day,
                float(round(last_day_tokens)),
                last_month,
                float(round(last_month_tokens)),
            )
        return out

    async def delete_tenant(self, name: str) -> None:
        """Delete a tenant that has no active key. The deletion is conditional
        on the tenant's record as read before its keys were checked: a key
        created after that moved it (create_key), and the keys are looked at
        again."""
        key = TENANTS + check_name("tenant", name)
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(key))
            if current is None:
                raise NotFound(f"tenant {name!r} not found")
            keys = (await self.read(KEYS)).keys
            now = self._clock()
            active = [
                k.id + (" (expired)" if k.expires_at and k.expires_at <= now else "")
                for k in keys
                if k.tenant == name and not k.revoked
            ]
            if active:
                # An expired key counts: a new expiry brings it back (trial 30).
                raise FailedPrecondition(
                    f"tenant {name!r} still has keys that are not revoked: {', '.join(active)}; "
                    "revoke them first (an expired key too: `key expire --never` would revive it)"
                )
            try:
                await _guard(
                    self.store.commit(
                        [Write(key, None, if_mod_revision=current.mod_revision), self._purge(name)]
                    )
                )
            except Conflict:
                continue
            await self._trim_purges()
            return
        raise Unavailable(f"tenant {name!r} kept changing; try again")

    async def _check_issuer_unique(self, tenant: Tenant) -> None:
        if tenant.jwt is None:
            return
        for other in (await self.read(TENANTS)).tenants:
            if other.name != tenant.name and other.jwt and other.jwt.issuer == tenant.jwt.issuer:
                raise AlreadyExists(
                    f"JWT issuer {tenant.jwt.issuer!r} already belongs to tenant {other.name!r}"
                )

    # ------------------------------------------------------------ topology

    async def apply(self, doc: object, *, prune: bool, dry_run: bool) -> topology.Plan:
        """Make regions, origins and tenants match a topology document, all or nothing.

        The whole document is checked first (controlplane/apply.py), against
        the state of one revision; then every change is written in one store
        transaction, conditional on each written key and each region relied
        on being as read, retried from the read on a conflict. dry_run stops
        after the checks. Returns the plan written (or that would be, with
        its warnings). Raises ApplyError (INVALID_ARGUMENT) listing every
        error; nothing is written then.
        """
        wanted = topology.parse(doc)
        for _ in range(CAS_ATTEMPTS):
            listing = await _guard(self.store.list(STATE_PREFIX))
            revisions = {kv.key: kv.mod_revision for kv in listing.items}
            stored = {kv.key: kv.value for kv in listing.items}
            current = self._current(listing.items)
            plan = topology.plan(wanted, current, prune=prune)
            writes = []
            for change in plan.writes():
                key = _PREFIX[change.kind] + change.name
                written = change.value
                if isinstance(written, Tenant):  # the file says nothing of the time
                    was = stored.get(key)
                    old = decode_tenant(was) if was is not None else None
                    written = suspension_stamped(written, old, self._clock)
                value = None if written is None else encode_over(written, stored.get(key))
                writes.append(Write(key, value, if_mod_revision=revisions.get(key, 0)))
                if change.kind == "origin" and change.action == "deleted":
                    writes.append(Write(HEALTH + change.name, None))
                if change.kind == "tenant" and change.action == "deleted":
                    writes.append(self._purge(change.name))
            checks = [Fence(REGIONS + r, revisions[REGIONS + r]) for r in plan.relies_on]
            if txn_size(writes, checks) > MAX_TXN_OPS:
                # Checked in a dry run too: it is what the apply would meet.
                extra = len(writes) - len(plan.writes())
                raise InvalidArgument(
                    f"the topology changes {len(plan.writes())} objects"
                    + (f" ({extra} more writes: deleted origins' health, deleted tenants' "
                       "cache purges)" if extra else "")
                    + f" and relies on {len(checks)} regions it does not list, more than one "
                    f"transaction holds ({MAX_TXN_OPS} writes or conditions); apply it in parts"
                )  # fmt: skip
            if dry_run:
                return plan
            try:
                await _guard(self.store.commit(writes, checks))
            except Conflict:
                continue
            if any(c.kind == "tenant" and c.action == "deleted" for c in plan.writes()):
                await self._trim_purges()
            return plan
        raise Unavailable("the state kept changing while applying; try again")

    @staticmethod
    def _current(items: tuple[KeyValue, ...]) -> topology.Current:
        regions: dict[str, Region] = {}
        origins: dict[str, Origin] = {}
        tenants: dict[str, Tenant] = {}
        active: dict[str, list[str]] = {}
        listed: dict[str, list[ApiKeyRecord]] = {}
        for kv in items:
            # An undecodable value is treated as absent, as snapshot() does;
            # the document may then replace it.
            try:
                if kv.key.startswith(REGIONS):
                    regions[kv.key[len(REGIONS) :]] = decode_region(kv.value)
                elif kv.key.startswith(ORIGINS):
                    origins[kv.key[len(ORIGINS) :]] = decode_origin(kv.value)
                elif kv.key.startswith(TENANTS):
                    tenants[kv.key[len(TENANTS) :]] = decode_tenant(kv.value)
                elif kv.key.startswith(KEYS):
                    key = decode_key(kv.value)
                    if not key.revoked:
                        active.setdefault(key.tenant, []).append(key.id)
                        if key.models:
                            listed.setdefault(key.tenant, []).append(key)
            except (ValueError, TypeError, KeyError) as exc:
                log.error("ignoring undecodable key %s: %s", kv.key, exc)
        return topology.Current(regions, origins, tenants, active, listed)

    async def export(self) -> dict[str, list[dict[str, object]]]:
        """The whole topology as an apply document; keys and health are not part of it."""
        state = await self.read(REGIONS, ORIGINS, TENANTS)
        return topology.document(state.regions, state.origins, state.tenants)

    # ------------------------------------------------------------ keys

    async def create_key(
        self,
        tenant: str,
        *,
        description: str = "",
        limits: Limits | None = None,
        expires_at: float = 0.0,
        expires_in: float = 0.0,
        models: Iterable[str] = (),
    ) -> CreatedKey:
        """Store a new key's hash and return its record, the key and the
        revision it was saved at. The key is not kept.

        From `expires_at` (Unix seconds, in the future) or `expires_in` seconds
        from now (this replica's clock) on, proxies refuse the key; with
        neither it does not expire. With `models`, its callers may name those
        only (within its tenant's)."""
        limits = limits or Limits()
        if len(description) > 256:
            raise InvalidArgument("key description is longer than 256 characters")
        limits = limits.validated("the key")
        names = check_model_names(models, "models of the key")
        now = self._clock()
        expires_at = self._expiry(expires_at, expires_in, "the key", now)
        owner = TENANTS + check_name("tenant", tenant)
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(owner))
            if current is None:
                raise NotFound(f"tenant {tenant!r} not found")
            issued = issue_key()
            record = ApiKeyRecord(
                id=issued.key_id,
                hash=issued.key_hash,
                tenant=tenant,
                description=description,
                limits=limits,
                created_at=now,
                expires_at=expires_at,
                models=names,
            )
            writes = [
                Write(KEYS + record.id, encode(record), if_mod_revision=0),
                # The tenant's record again, unchanged, as read: its revision
                # moves, so that a deletion decided before this key existed
                # (delete_tenant, apply --prune: a tenant with active keys is
                # kept) fails its conditional write and looks again; and a
                # tenant deleted meanwhile gets no orphan key.
                Write(owner, current.value, if_mod_revision=current.mod_revision),
            ]
            try:
                revision = await _guard(self.store.commit(writes))
            except Conflict:
                continue  # the tenant changed (or, astronomically rarely, the id collided)
            return CreatedKey(record, issued.key, revision)
        raise Unavailable(f"tenant {tenant!r} kept changing; try again")

    async def list_keys(
        self, tenant: str = "", *, include_revoked: bool = False
    ) -> list[ApiKeyRecord]:
        keys = (await self.read(KEYS)).keys
        return sorted(
            (
                k
                for k in keys
                if (not tenant or k.tenant == tenant) and (include_revoked or not k.revoked)
            ),
            key=lambda k: (k.tenant, k.created_at, k.id),
        )

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        now = self._clock()
        return await self._update(
            KEYS + _key_id(key_id),
            decode_key,
            lambda k: k if k.revoked else replace(k, revoked=True, revoked_at=now),
            f"key {key_id!r} not found",
        )

    async def set_key_limits(
        self,
        key_id: str,
        limits: Limits,
        *,
        seen: Callable[[ApiKeyRecord], None] | None = None,
        expected: Limits | None = None,
    ) -> ApiKeyRecord:
        """Give a key new limits. A revoked key is refused (FailedPrecondition):
        it serves nothing, and the success would read as if it did. `seen` is
        given the record as it was before (the last read, if a write raced).
        With `expected`, only a key whose limits are still those
        (ChangedSinceRead otherwise)."""
        limits = limits.validated(f"key {key_id!r}")

        def check(k: ApiKeyRecord) -> None:
            if seen is not None:
                seen(k)
            if expected is not None and k.limits != expected and not k.revoked:
                raise ChangedSinceRead(f"the limits of key {key_id!r}")

        return await self._change_live_key(
            key_id, "its limits cannot change", seen=check, limits=limits
        )

    async def set_key_models(
        self,
        key_id: str,
        models: Iterable[str],
        *,
        seen: Callable[[ApiKeyRecord], None] | None = None,
    ) -> ApiKeyRecord:
        """Replace the models a key's callers may name (none: its tenant's).
        A revoked key is refused, as by set_key_limits; `seen` as there."""
        names = check_model_names(models, f"models of key {key_id!r}")
        return await self._change_live_key(
            key_id, "its models cannot change", seen=seen, models=names
        )

    async def set_key_suspended(
        self, key_id: str, suspended: bool, reason: str | None = None
    ) -> tuple[ApiKeyRecord, ApiKeyRecord | None]:
        """Suspend key `key_id` (proxies refuse its callers, 403
        api_key_suspended) or resume it, keeping all else it has (its limits,
        what its budgets spent, models, expiry): what `key revoke` cannot
        undo, for a key suspected leaked or a caller to stop for a while. The
        key now, and as it was before this call wrote it (None: not written,
        it already was what was asked). A revoked key is refused
        (FailedPrecondition), an unknown one NotFound.

        A suspension keeps `reason` (model.check_reason: one short printable line,
        else InvalidArgument) and this replica's time; suspending a suspended
        key with another reason replaces the reason only (one of none, "",
        clears it: trial 72 could only write over a reason given by mistake),
        and without one (None) changes nothing. Resuming clears both
        (`reason` is then the audit entry's alone)."""
        if reason is not None:
            reason = check_reason("a suspension's reason", reason.strip())
        read: list[ApiKeyRecord] = []  # the key as the last attempt read it

        def change(k: ApiKeyRecord) -> ApiKeyRecord | None:
            read[:] = [k]
            if k.revoked:
                raise FailedPrecondition(
                    f"key {key_id!r} is revoked: its callers are refused for good, "
                    "it cannot be suspended or resumed"
                )
            if not suspended:
                return (
                    replace(k, suspended=False, suspended_reason="", suspended_at=0.0)
                    if (k.suspended)
                    else None
                )
            if not k.suspended:
                return replace(
                    k, suspended=True, suspended_reason=reason or "", suspended_at=self._clock()
                )
            if reason is not None and reason != k.suspended_reason:
                return replace(k, suspended_reason=reason)
            return None

        now, written = await self._update_if(
            KEYS + _key_id(key_id), decode_key, change, f"key {key_id!r} not found"
        )
        return now, read[0] if written else None

    async def key_model_warnings(self, key: ApiKeyRecord) -> tuple[str, ...]:
        """model.access_warnings of key against its tenant and the origins
        stored now."""
        state = await self.read(TENANTS, ORIGINS)
        tenant = next((t for t in state.tenants if t.name == key.tenant), None)
        return access_warnings(tenant, state.origins, key) if tenant is not None else ()

    async def set_key_expiry(
        self, key_id: str, expires_at: float = 0.0, expires_in: float = 0.0
    ) -> ApiKeyRecord:
        """Make a key expire at `expires_at` (Unix seconds, in the future) or
        `expires_in` seconds from now, or never (neither). An expired key may
        be given a new expiry (or none), and is served again; a revoked key
        stays revoked: it is refused."""
        expires_at = self._expiry(expires_at, expires_in, f"key {key_id!r}", self._clock())
        return await self._change_live_key(key_id, "it cannot expire", expires_at=expires_at)

    async def _change_live_key(
        self,
        key_id: str,
        refused: str,
        *,
        seen: Callable[[ApiKeyRecord], None] | None = None,
        **fields: Any,
    ) -> ApiKeyRecord:
        """Key `key_id` with `fields` replaced; a revoked key is refused
        (FailedPrecondition, "... is revoked; `refused`"), an unknown one NotFound.
        `seen` is given each record read before it is changed."""

        def change(k: ApiKeyRecord) -> ApiKeyRecord:
            if seen is not None:
                seen(k)
            if k.revoked:
                raise FailedPrecondition(f"key {key_id!r} is revoked; {refused}")
            return replace(k, **fields)

        return await self._update(
            KEYS + _key_id(key_id), decode_key, change, f"key {key_id!r} not found"
        )

    @staticmethod
    def _expiry(expires_at: float, expires_in: float, what: str, now: float) -> float:
        """The expiry asked for at `now` (Unix seconds; 0: never), checked."""
        if expires_at and expires_in:
            raise InvalidArgument(f"{what}: give an expiry time or a duration, not both")
        if expires_in:
            if not math.isfinite(expires_in) or expires_in < 0:
                raise InvalidArgument(f"{what}: expiry duration {expires_in!r} is not a duration")
            expires_at = now + expires_in
        if expires_at == 0:
            return 0.0
        if not math.isfinite(expires_at) or expires_at > MAX_EXPIRY:
            raise InvalidArgument(f"{what}: expiry {expires_at!r} is not a time")
        if key_expired(expires_at, now):  # it would be refused from the start
            raise InvalidArgument(
                f"{what}: expiry {utc(expires_at)} is in the past; revoke the key instead"
            )
        return expires_at

    # ------------------------------------------------------------ cache purges

    async def purge_cache(self, tenant: str = "", model: str = "") -> Purge:
        """Record a purge; proxies run it when the next table reaches them.
        An unknown tenant is NOT_FOUND (a misspelt name would purge nothing),
        except `default`, whose answers an open fleet caches without a record."""
        if tenant:
            check_name("tenant", tenant)
            if tenant != OPEN_TENANT:
                await self.get_tenant(tenant)
        if model and not MODEL_RE.match(model):
            raise InvalidArgument(f"model name {model!r} is invalid")
        write = self._purge(tenant, model)
        revision = await _guard(self.store.commit([write]))
        await self._trim_purges()
        return Purge(revision, tenant, model)

    def _purge(self, tenant: str, model: str = "") -> Write:
        """The write that records a purge of tenant's (and model's) answers.
        A deleted tenant's are purged with it (trial 46: a tenant created
        again under the name, perhaps another customer's, was answered from
        the first one's cache, on every tier)."""
        key = PURGES + f"{int(self._clock() * 1000):015d}-{uuid.uuid4().hex[:8]}"
        return Write(key, encode(Purge(0, tenant, model)), if_mod_revision=0)

    async def _trim_purges(self) -> None:
        listing = await _guard(self.store.list(PURGES))
        # Oldest by store revision, not by the (wall-clock) key name: a replica
        # whose clock is behind must not trim the purge it just wrote.
        for old in sorted(listing.items, key=lambda kv: kv.mod_revision)[:-MAX_PURGES]:
            await _guard(self.store.delete(old.key))

    async def unserved_purge(self, tenant: str, model: str) -> tuple[str, ...]:
        """model.unserved_purge against the origins and tenants stored now."""
        state = await self.read(ORIGINS, TENANTS)
        return unserved_purge(model, tenant, state.origins, state.tenants)

    # ------------------------------------------------------------ proxies

    async def register_proxy(self, record: ProxyRecord, lease: int) -> int:
        """Write `record` over its name's registration unless that one is of a
        process started after `record`'s (Superseded); the store revision
        written at. A start time of 0 is unknown (a proxy that does not say
        it) and supersedes or is superseded by nothing. Checked and written
        at one revision, so that of two registrations of a name at once (on
        two replicas) the older process's cannot overwrite the one its check
        missed."""

        def takes(current: ProxyRecord | None) -> bool:
            if current is not None and current.started_at > record.started_at > 0:
                raise Superseded(
                    f"proxy {record.name} is registered by a process started after this one",
                    holder_address=current.address,
                    holder_host=current.host,
                )
            return True

        return await self._put_proxy_if(record, lease, takes)

    async def restore_proxy(self, record: ProxyRecord, lease: int) -> int:
        """Write `record` again (its key went with a lost lease) unless its
        name registered anew meanwhile, here or on another replica, by a
        process not started before `record`'s; the store revision written at,
        or 0 (the newer registration stays).

        After an etcd outage that lost every replica's lease, the replicas
        write back what they held in no set order: a worker's successor put
        back after the worker (whose stream another replica had not ended
        yet) takes its name back, as at its registration, and the worker's
        replica drops the worker's session when its watch sees the write."""

        def takes(current: ProxyRecord | None) -> bool:
            return (
                current is None
                or current.session_id == record.session_id
                or 0 < current.started_at < record.started_at
            )

        return await self._put_proxy_if(record, lease, takes)

    async def _put_proxy_if(
        self, record: ProxyRecord, lease: int, takes: Callable[[ProxyRecord | None], bool]
    ) -> int:
        """The revision `record` was written at; 0 if `takes` refused the
        registration it would replace."""
        key = PROXIES + record.name
        for _ in range(CAS_ATTEMPTS):
            kv = await _guard(self.store.get(key))
            current = None if kv is None else decode_proxy(kv.value)
            if not takes(current):
                return 0
            revision = 0 if kv is None else kv.mod_revision
            try:
                # encode, not encode_over: a registration is a new session's
                # whole record, and what a newer replica wrote of the last
                # session is not this one's.
                return await _guard(
                    self.store.put(key, encode(record), lease=lease, if_mod_revision=revision)
                )
            except Conflict:
                continue
        raise Unavailable(f"proxy {record.name} kept registering again; try again")

    async def note_conflict(self, record: ProxyRecord, where: str, lease: int) -> None:
        """Note that `record`'s process, `where` (its address, and its host
        if the holder has that address too), was refused its name, which a
        later process holds: listed beside that one's registration
        (ProxyRecord.conflict) for CONFLICT_SHOWN_S."""
        note = {"address": where, "refused_at": time.time()}
        await _guard(self.store.put(CONFLICTS + record.name, orjson.dumps(note), lease=lease))

    async def get_proxy(self, name: str) -> ProxyRecord | None:
        kv = await _guard(self.store.get(PROXIES + name))
        return None if kv is None else decode_proxy(kv.value)

    async def remove_proxy(self, name: str, session_id: str) -> bool:
        """Remove the registration only if it is still this session's; whether it was."""
        kv = await _guard(self.store.get(PROXIES + name))
        if kv is None or decode_proxy(kv.value).session_id != session_id:
            return False
        # A conflict means it re-registered meanwhile: the new session owns the key.
        return await self.remove_key(kv)

    async def note_departure(self, name: str, departure: Departure, ttl: int) -> None:
        """Note that proxy `name`'s process `departure` deregistered, for `ttl`
        seconds (a lease of the note's own: a replica that holds none of its
        sessions never reads it, and nothing else removes it)."""
        lease = await _guard(self.store.grant_lease(ttl))
        await _guard(self.store.put(DEPARTED + name, departure.encode(), lease=lease))

    async def departures(self) -> dict[str, Departure]:
        """The departures noted and not expired: proxy name -> its departure."""
        listing = await _guard(self.store.list(DEPARTED))
        out = {}
        for kv in listing.items:
            departure = Departure.decode(kv.value)
            if departure is not None:
                out[kv.key[len(DEPARTED) :]] = departure
        return out

    async def departure(self, name: str) -> Departure | None:
        kv = await _guard(self.store.get(DEPARTED + name))
        return None if kv is None else Departure.decode(kv.value)

    async def departed_key(self, name: str, departure: Departure) -> KeyValue | None:
        """Proxy `name`'s key, if it holds a registration of `departure`'s
        process (Departure.of); else None."""
        kv = await _guard(self.store.get(PROXIES + name))
        if kv is None:
            return None
        try:
            record = decode_proxy(kv.value)
        except (ValueError, TypeError, KeyError):
            return None
        return kv if departure.of(record) else None

    async def remove_key(self, kv: KeyValue) -> bool:
        """Delete `kv`'s key unless it was written since `kv` was read (then
        it holds another registration, which stays); whether it was."""
        try:
            return await _guard(self.store.delete(kv.key, if_mod_revision=kv.mod_revision))
        except Conflict:
            return False

    async def list_replicas(self) -> tuple[list[dict[str, object]], str]:
        """Live replicas and the leader's id ("" during an election)."""
        listing = await _guard(self.store.list(REPLICAS))
        self.replica_beats.observe(
            {kv.key[len(REPLICAS) :]: kv.mod_revision for kv in listing.items}
        )
        replicas = []
        for kv in listing.items:
            with contextlib.suppress(ValueError, TypeError):
                value = orjson.loads(kv.value)
                if isinstance(value, dict):
                    replicas.append(value)
        leader = await _guard(self.store.get(LEADER_KEY))
        return replicas, leader.value.decode() if leader else ""

    async def proxy_keys(self) -> dict[str, KeyValue]:
        """Registered proxies' keys by name, not decoded (a fleet's thousands
        of registrations are read often, and only a few of them decoded:
        controlplane.registry.record_of)."""
        listing = await _guard(self.store.list(PROXIES))
        return {kv.key[len(PROXIES) :]: kv for kv in listing.items}

    async def proxy_names(self) -> list[str]:
        """Names of registered proxies (no decoding)."""
        listing = await _guard(self.store.list(PROXIES))
        return [kv.key[len(PROXIES) :] for kv in listing.items]

    async def put_acks(
        self,
        replica: str,
        acks: dict[str, tuple[int, str]],
        lease: int,
        *,
        version: int = 0,
        etag: str = "",
        warnings: dict[str, list[str]] | None = None,
    ) -> None:
        """Write a replica's ACK summary with the version it serves now, and
        the warnings of the proxies that last reported some (name -> warnings;
        a key of their own in the summary, which a replica from before them
        ignores). Each distinct warning is written once, however many proxies
        report it (a table's problem is every proxy's), and at most
        MAX_SUMMARY_WARNINGS of them: the summary stays far below etcd's
        request size whatever the fleet's size."""
        payload: dict[str, object] = {"replica_version": version, "acks": acks}
        if etag:  # of the table of `version` (a replica from before it writes none)
            payload["replica_etag"] = etag
        if warnings:
            payload["warnings"] = _shared_warnings(warnings)
        value = orjson.dumps(payload)
        await self._rewritten(self.store.put(ACKS + replica, value, lease=lease), "the ACK summary")

    async def put_traffic(self, replica: str, traffic: dict[str, Traffic], lease: int) -> None:
        """Write a replica's proxies' last traffic reports, a key of their own
        so that the ACK summary is rewritten only when an ACK changes. Past
        TRAFFIC_BYTES (a wide outage: many proxies each naming many ejected
        origins), their ejections' failures are left out, then their
        ejections: the counts the status page's rates need are kept."""
        value = orjson.dumps(traffic)
        if len(value) > TRAFFIC_BYTES:
            value = orjson.dumps(_without_failures(traffic))
        if len(value) > TRAFFIC_BYTES:
            value = orjson.dumps({name: (*t[:6], {}) for name, t in traffic.items()})
        await self._rewritten(
            self.store.put(TRAFFIC + replica, value, lease=lease), "proxies' traffic"
        )

    async def list_proxies(self, *, traffic: bool = True) -> list[ProxyRecord]:
        """Registered proxies with the ACK state their own replica last wrote,
        and (with `traffic`) their replicas' last traffic reports; the reads
        run at once.

        A proxy's ACK is read from the summary of the replica it is registered
        with (a stale summary of a replica it left cannot override it); the
        summaries of other replicas are a fallback while its own has not been
        written yet.
        """
        if traffic:
            by_replica, records, conflicts, reports = await asyncio.gather(
                self._acks_by_replica(),
                self._proxy_records(),
                self._conflicts(),
                self._traffic_reports(),
            )
            return [
                _with_traffic(_with_conflicts(_with_acks(p, by_replica), conflicts), reports)
                for p in records
            ]
        by_replica, records, conflicts = await asyncio.gather(
            self._acks_by_replica(), self._proxy_records(), self._conflicts()
        )
        return [_with_conflicts(_with_acks(p, by_replica), conflicts) for p in records]

    async def _conflicts(self) -> dict[str, str]:
        """name -> the address of a process refused it in the last
        CONFLICT_SHOWN_S (note_conflict)."""
        shown_since = time.time() - CONFLICT_SHOWN_S
        out = {}
        for kv in (await _guard(self.store.list(CONFLICTS))).items:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                note = orjson.loads(kv.value)
                if float(note["refused_at"]) >= shown_since:
                    out[kv.key[len(CONFLICTS) :]] = str(note["address"])
        return out

    async def _acks_by_replica(self) -> dict[str, _Summary]:
        by_replica: dict[str, _Summary] = {}
        for kv in (await _guard(self.store.list(ACKS))).items:
            replica = kv.key[len(ACKS) :]
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                raw = orjson.loads(kv.value)
                warned: dict[str, object] = {}
                etag = ""
                if isinstance(raw, dict) and isinstance(raw.get("acks"), dict):
                    version, entries = int(raw.get("replica_version", 0)), raw["acks"]
                    etag = str(raw.get("replica_etag", ""))
                    if isinstance(raw.get("warnings"), dict):
                        warned = raw["warnings"]
                else:  # the summary of a replica from before replica_version
                    version, entries = 0, raw
                by_proxy = _warnings_by_proxy(warned)
                acks = {
                    str(n): (int(v), str(e), by_proxy.get(str(n), ()))
                    for n, (v, e) in entries.items()
                }
                by_replica[replica] = (version, acks, etag)
        return by_replica

    async def _traffic_reports(self) -> dict[str, dict[str, Traffic]]:
        reports: dict[str, dict[str, Traffic]] = {}
        for kv in (await _guard(self.store.list(TRAFFIC))).items:
            with contextlib.suppress(ValueError):
                reports[kv.key[len(TRAFFIC) :]] = _traffic_of(orjson.loads(kv.value))
        return reports

    async def _proxy_records(self) -> list[ProxyRecord]:
        listing = await _guard(self.store.list(PROXIES))
        out = []
        for kv in listing.items:
            try:
                out.append(decode_proxy(kv.value))
            except (ValueError, TypeError) as exc:
                log.error("ignoring undecodable key %s: %s", kv.key, exc)
        return out


# Fewer records than this are decoded on the event loop: a worker thread's
# hand-off costs more than they do.
_DECODE_ON_LOOP = 500


async def _decoded(
    revision: int,
    items: tuple[KeyValue, ...],
    known: Mapping[str, tuple[bytes, ApiKeyRecord]] | None = None,
) -> State:
    """decode_state, in a worker thread unless items are few. `known` is
    read, never changed: Catalog.snapshot replaces its keys whole."""
    if len(items) < _DECODE_ON_LOOP:
        return decode_state(revision, items, known)
    return await asyncio.to_thread(decode_state, revision, items, known)


# An API key's record as decoded, by its etcd key, with the value it was
# decoded from.
DecodedKeys = dict[str, tuple[bytes, ApiKeyRecord]]


def decode_state(
    revision: int,
    items: Iterable[KeyValue],
    known: Mapping[str, tuple[bytes, ApiKeyRecord]] | None = None,
    decoded: DecodedKeys | None = None,
) -> State:
    """The State of records `items` (keys under STATE_PREFIX) read at
    `revision`; undecodable ones are skipped and logged. An API key whose
    value is the one `known` holds for it is taken from there, not decoded
    again (a key's record depends on its value alone); each key decoded is
    put in `decoded`, so that it holds the keys of `items` alone. Pure but
    for `decoded`: safe in a worker thread."""
    regions: list[Region] = []
    origins: list[Origin] = []
    health: dict[str, OriginHealth] = {}
    tenants: list[Tenant] = []
    keys: list[ApiKeyRecord] = []
    purges: list[Purge] = []
    created: dict[str, int] = {}
    id_keys: tuple[bytes, ...] = ()
    owners_from = 0
    fleet_id = ""
    fleet_id_invalid = ""
    auth_ever = False
    for kv in items:
        try:
            if kv.key.startswith(REGIONS):
                regions.append(decode_region(kv.value))
            elif kv.key.startswith(ORIGINS):
                origins.append(decode_origin(kv.value))
            elif kv.key.startswith(HEALTH):
                h = decode_health(kv.value)
                health[h.origin] = h
            elif kv.key.startswith(TENANTS):
                # Validated again: a value edited by hand must not break
                # compiling the table for everyone. As stored: one written
                # before a rule was added stays (model.PromptPolicy.validated).
                tenants.append(decode_tenant(kv.value).validated(stored=True))
                created[tenants[-1].name] = kv.create_revision
            elif kv.key.startswith(KEYS):
                had = known.get(kv.key) if known is not None else None
                if had is not None and had[0] == kv.value:
                    key = had[1]
                else:
                    key = decode_key(kv.value)
                    key.limits.validated(f"key {key.id!r}")
                keys.append(key)
                if decoded is not None:
                    decoded[kv.key] = (kv.value, key)
            elif kv.key.startswith(PURGES):
                purges.append(decode_purge(kv.value, kv.mod_revision))
            elif kv.key == RESPONSE_ID_KEYS:
                id_keys = decode_id_keys(kv.value)
            elif kv.key == RESPONSE_ID_OWNERS:
                owners_from = kv.create_revision
            elif kv.key == FLEET_ID:
                try:
                    fleet_id = decode_fleet_id(kv.value)
                except (ValueError, InvalidArgument) as exc:
                    # Not skipped as undecodable: told (once, FleetWatch)
                    # as the fleet's guard being off, not as no id.
                    fleet_id_invalid = str(exc)
            elif kv.key == AUTH_REQUIRED:
                auth_ever = True
        except (ValueError, TypeError, KeyError, AttributeError, InvalidArgument) as exc:
            # AttributeError: a field of the wrong JSON type met a method
            # (a tenant's "prompt": [1]; review: it stopped the builder).
            log.error("ignoring undecodable key %s: %s", kv.key, exc)
    purges.sort(key=lambda p: p.revision)
    return State(
        revision,
        tuple(regions),
        tuple(origins),
        health,
        tuple(tenants),
        tuple(keys),
        tuple(purges),
        created,
        id_keys,
        owners_from,
        fleet_id,
        auth_ever,
        fleet_id_invalid,
    )


def fleet_id_of(id_key: bytes) -> str:
    """The fleet id of a store first made with Responses id key `id_key`:
    one-way (the key is the fleet's secret; its id is shown to anyone who
    reads a proxy's metrics)."""
    return hashlib.sha256(b"ponto fleet id\0" + id_key).hexdigest()[: 2 * FLEET_ID_BYTES]


def _region_settings(r: Region) -> Region:
    """What a region update compares: all but the drain flag, its RTTs in
    one order (as read back from a map, or as stored)."""
    return replace(r, drained=False, rtt_ms=tuple(sorted(r.rtt_ms)))


def _origin_settings(o: Origin) -> Origin:
    """What an origin update compares: all but the drain flag."""
    return replace(o, drained=False)


# A proxy's ACK as its replica's summary holds it: acked version, last NACK's
# error, the warnings it last reported (with an ACK or a report).
_Ack = tuple[int, str, tuple[str, ...]]
# A replica's ACK summary: the version it serves, its proxies' ACKs, the
# etag of the table it serves ("": a replica from before it wrote one).
_Summary = tuple[int, dict[str, _Ack], str]


# Distinct proxy warnings an ACK summary keeps (each at most MAX_WARNING
# characters, controlplane.api.routing): some 32 KB at most.
MAX_SUMMARY_WARNINGS = 64


def _shared_warnings(warnings: dict[str, list[str]]) -> dict[str, object]:
    """{"texts": the distinct warnings, "by_proxy": name -> their indexes}."""
    texts: dict[str, int] = {}
    by_proxy: dict[str, list[int]] = {}
    for name, listed in warnings.items():
        for text in listed:
            index = texts.get(text)
            if index is None:
                if len(texts) >= MAX_SUMMARY_WARNINGS:
                    continue
                index = texts[text] = len(texts)
            by_proxy.setdefault(name, []).append(index)
    return {"texts": list(texts), "by_proxy": by_proxy}


def _warnings_by_proxy(raw: object) -> dict[str, tuple[str, ...]]:
    """The proxies' warnings of a summary's `warnings` (_shared_warnings)."""
    if not isinstance(raw, dict):
        return {}
    texts, by_proxy = raw.get("texts"), raw.get("by_proxy")
    if not isinstance(texts, list) or not isinstance(by_proxy, dict):
        return {}
    out = {}
    for name, indexes in by_proxy.items():
        if isinstance(indexes, list):
            out[str(name)] = tuple(
                str(texts[i]) for i in indexes if isinstance(i, int) and 0 <= i < len(texts)
            )
    return out


def _with_acks(p: ProxyRecord, by_replica: dict[str, _Summary]) -> ProxyRecord:
    own = by_replica.get(p.control_plane_id)
    if own is not None and p.name in own[1]:
        acked, error, warnings = own[1][p.name]
        return replace(
            p,
            acked_version=acked,
            last_error=error,
            warnings=warnings,
            replica_version=own[0],
            replica_etag=own[2],
        )
    for _replica, (_version, acks, _etag) in sorted(by_replica.items()):
        if p.name in acks:
            acked, error, warnings = acks[p.name]
            p = replace(p, acked_version=acked, last_error=error, warnings=warnings)
    return replace(p, replica_version=own[0], replica_etag=own[2]) if own is not None else p


def _with_conflicts(p: ProxyRecord, conflicts: dict[str, str]) -> ProxyRecord:
    other = conflicts.get(p.name)
    return p if other is None or other == p.address else replace(p, conflict=other)


# A proxy's last report as its replica keeps it: requests, 5xx, 4xx, heard
# at, region -> (requests, errors) of the proxied requests each served,
# tenant -> (requests refused by a rate limit, requests that waited for a
# slot), and origin -> (since, ejections, last failure, failed at, until) of
# the origins it ejected (Unix times; OriginEjected).
Served = dict[str, tuple[int, int]]
Limited = dict[str, tuple[int, int]]
Ejections = dict[str, tuple[float, int, str, float, float]]
Traffic = tuple[int, int, int, float, Served, Limited, Ejections]


def _traffic_of(raw: object) -> dict[str, Traffic]:
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Traffic] = {}
    for name, entry in raw.items():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            # A replica from before `served` wrote four values, one from
            # before `limited` five, and one from before `ejected` six.
            requests, server, client, heard, *rest = entry
            served, limited = (_pairs(rest[i]) if len(rest) > i else {} for i in (0, 1))
            ejected = _ejections(rest[2]) if len(rest) > 2 else {}
            counts = (int(requests), int(server), int(client), float(heard))
            out[str(name)] = (*counts, served, limited, ejected)
    return out


def _ejections(raw: object) -> Ejections:
    """A stored entry's ejections; one that cannot be read is left out, not
    the entry's counts with it (review 199)."""
    out: Ejections = {}
    if not isinstance(raw, dict):
        return out
    for origin, e in raw.items():
        with contextlib.suppress(ValueError, TypeError):
            since, n, failure, failed_at, until, *_ = e
            out[str(origin)] = (float(since), int(n), str(failure), float(failed_at), float(until))
    return out


# A replica's traffic value at most (put_traffic): well inside etcd's request.
TRAFFIC_BYTES = MAX_REQUEST_BYTES // 2


def _without_failures(traffic: dict[str, Traffic]) -> dict[str, Traffic]:
    """traffic with each ejection's last failure left out (its longest part)."""
    out = {}
    for name, (requests, server, client, heard, served, limited, ejected) in traffic.items():
        bare = {o: (since, n, "", at, until) for o, (since, n, _, at, until) in ejected.items()}
        out[name] = (requests, server, client, heard, served, limited, bare)
    return out


def _pairs(raw: dict[str, list[int]]) -> dict[str, tuple[int, int]]:
    return {str(k): (int(a), int(b)) for k, (a, b) in raw.items()}


def _with_traffic(p: ProxyRecord, traffic: dict[str, dict[str, Traffic]]) -> ProxyRecord:
    """The traffic its own replica reported: another replica's entry is a
    previous session's, which a restart may have left behind."""
    entry = traffic.get(p.control_plane_id, {}).get(p.name)
    if entry is None:
        return p
    requests, server, client, heard, served, limited, ejected = entry
    return replace(
        p,
        requests=requests,
        server_errors=server,
        client_errors=client,
        heard_at=heard,
        served=tuple((region, n, e) for region, (n, e) in sorted(served.items())),
        limited=tuple((tenant, n, w) for tenant, (n, w) in sorted(limited.items())),
        ejected=tuple(OriginEjected(origin, *e) for origin, e in sorted(ejected.items())),
    )


KEY_ID_RE = re.compile(r"^[a-z0-9]{1,32}\Z")


def _key_id(key_id: str) -> str:
    if not KEY_ID_RE.match(key_id):
        raise InvalidArgument(f"key id {key_id!r} is invalid")
    return key_id
