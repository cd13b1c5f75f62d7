"""The audit trail of admin actions: who did what to what, when, from where,
and how it ended.

Every mutating Admin call (controlplane/api/auditing.py) and the status page's
drain buttons record an entry; `pontoctl get audit` (the ListAudit call) reads
them, newest first. Layout in the store:

  /ponto/audit/<10^16 - microseconds since the epoch, 16 digits>-<8 hex>   one JSON entry

so keys sort newest first: etcd reads a limited range in key order without
reading the rest, while to sort it descending it would read the whole range
(an entry written at 2026-12-01T00:00:00Z has the key
/ponto/audit/8203916800000000-...; times up to 2286-11-20 fit). Whichever replica served the
call writes its entry (no leader needed); the random suffix keeps entries of
two replicas in the same microsecond apart, and replicas' clocks only need to
agree as well as the order of entries matters to a reader. The prefix lies
outside /ponto/state/, so an entry never rebuilds a route table. The leader
bounds the trail (`run_trim`): entries older than the retention go, then the
oldest beyond the count. Both are deletes of the far end of the range that depend
only on what the store holds, so two replicas trimming at once during a leader
handover delete no more than one would.

Every entry is also written to the control plane's log, before the store:
one INFO line of logger `ponto.audit` (LINES), its fields those of `pontoctl
get audit -o json` (time in RFC 3339 UTC to the millisecond), as cut for the
store. The trail lives in etcd alone otherwise, and a restore from a snapshot
takes back every entry written since, with the revocations and suspensions
they record (trial 73: an SRE could not tell which leaked keys to revoke
again); logs shipped off the machine survive that. An entry holds no secret
(a key's secret is in CreateKey's answer only; an origin's URL is redacted),
so neither does its line. `ponto-control` keeps the logger at INFO whatever
its --log-level.

When an entry cannot be written, the call's answer stands and a WARNING says
so (the line of `ponto.audit` before it holds the entry). The entry is written
after the change, which cannot be taken back by then: failing the call would
tell the operator that a change that was made was not, and the retry would
make it twice. The trail shares etcd with the state it audits, so while etcd
is down the change itself fails; an entry is missing from the trail only when
etcd fails between a change and its entry, and the control plane's log holds
it then.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Final

import orjson
from etcd3aio import prefix_range_end

from controlplane.errors import Unavailable
from controlplane.rounds import Defects
from controlplane.store import StateStore, StoreError, StoreUnavailable
from ponto.times import utc_ms

log = logging.getLogger(__name__)
# Each entry, one line (see the module docstring).
LINES: Final = logging.getLogger("ponto.audit")

PREFIX: Final = "/ponto/audit/"
_END: Final = prefix_range_end(PREFIX).decode()
RETENTION_DAYS: Final = 90
MAX_ENTRIES: Final = 100_000
TRIM_INTERVAL: Final = 60.0
# Entries read per store call when filtering: a page is at most PAGE times
# MAX_ENTRY_BYTES.
PAGE: Final = 1000
MAX_LIMIT: Final = 1000
# What one entry may hold. MAX_ENTRY_BYTES bounds its JSON (its protobuf in a
# ListAudit answer is about as large, or smaller where JSON escapes), so a page of
# MAX_LIMIT entries, about 3 MB, fits gRPC's default 4 MiB message.
MAX_ENTRY_BYTES: Final = 3000
MAX_FIELD: Final = 256
MAX_MESSAGE: Final = 512
MAX_DETAIL_KEYS: Final = 16
# The time keys count down from here (see the module docstring).
_NEVER: Final = 10**16


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One admin action.

    time: Unix seconds. actor: the client certificate's identity, "admin-token"
    or "anonymous". source: the caller's address ("ipv4:10.0.0.5:51234",
    "http:10.0.0.5"). result: "ok", or the gRPC status code the call was
    refused with, or OUTCOME_UNKNOWN (the state store did not confirm the
    write: it may have been made), its message in message. replica: the control-plane replica
    that served the call.
    """

    time: float
    actor: str
    action: str
    target: str
    source: str
    result: str = "ok"
    message: str = ""
    detail: Mapping[str, str] = field(default_factory=dict)
    replica: str = ""


_FIELDS = frozenset(f.name for f in fields(AuditEntry))


def _clip(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def _time_key(t: float) -> str:
    """The start of the keys of entries written at t (Unix seconds): newer times sort
    first."""
    return _key(_NEVER - min(max(1, int(t * 1_000_000)), _NEVER - 1))


def _key(number: int) -> str:
    return f"{PREFIX}{number:016d}"


def _number(key: str) -> int:
    return int(key[len(PREFIX) : len(PREFIX) + 16])


def _after(key: str) -> str:
    """The first key past every key that starts with key."""
    return prefix_range_end(key).decode()


def _bounded(entry: AuditEntry) -> bytes:
    """The entry's JSON, at most MAX_ENTRY_BYTES: values are cut to MAX_FIELD
    (message: MAX_MESSAGE) characters and detail to its first MAX_DETAIL_KEYS keys,
    and all of these by half again until the JSON fits: at full length the fields
    could hold about 10,000 characters, each up to 6 bytes of JSON."""
    most, keys = MAX_FIELD, MAX_DETAIL_KEYS
    while True:
        cut = replace(
            entry,
            actor=_clip(entry.actor, most),
            action=_clip(entry.action, most),
            target=_clip(entry.target, most),
            source=_clip(entry.source, most),
            result=_clip(entry.result, most),
            message=_clip(entry.message, most * MAX_MESSAGE // MAX_FIELD),
            detail={_clip(k, most): _clip(v, most) for k, v in list(entry.detail.items())[:keys]},
            replica=_clip(entry.replica, most),
        )
        value = orjson.dumps(asdict(cut))
        if len(value) <= MAX_ENTRY_BYTES:
            return value
        most, keys = max(1, most // 2), keys // 2


def _line(value: bytes) -> str:
    """An entry's log line: its stored JSON (`value`, as _bounded cut it),
    its time as `get audit -o json` writes it."""
    raw = orjson.loads(value)
    raw["time"] = utc_ms(raw["time"])
    return orjson.dumps(raw).decode()


def _decode(value: bytes) -> AuditEntry:
    raw = orjson.loads(value)
    if not isinstance(raw, dict):
        raise TypeError("an audit entry is not a JSON object")
    detail = {str(k): str(v) for k, v in dict(raw.pop("detail", {})).items()}
    # Fields a later version adds are left out rather than making the entry unreadable.
    known = {k: v for k, v in raw.items() if k in _FIELDS}
    return AuditEntry(**known, detail=detail)


class AuditLog:
    """Writes and reads the audit trail in a StateStore; safe for concurrent use.

    `clock` gives the entries' times and the retention's "now" (Unix seconds).
    """

    def __init__(
        self,
        store: StateStore,
        *,
        replica: str,
        clock: Callable[[], float] = time.time,
        retention_days: float = RETENTION_DAYS,
        max_entries: int = MAX_ENTRIES,
        trim_interval: float = TRIM_INTERVAL,
    ) -> None:
        self._store = store
        self._replica = replica
        self._clock = clock
        self._retention = retention_days * 86400
        self._max_entries = max_entries
        self._trim_interval = trim_interval

    async def record(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        detail: dict[str, str] | None = None,
        source: str,
        result: str = "ok",
        message: str = "",
    ) -> None:
        """Append an entry; never raises for the store (see the module docstring).

        Long values are cut so the entry fits MAX_ENTRY_BYTES (see _bounded).
        """
        entry = AuditEntry(
            time=self._clock(),
            actor=actor,
            action=action,
            target=target,
            source=source,
            result=result,
            message=message,
            detail=dict(detail or {}),
            replica=self._replica,
        )
        value = _bounded(entry)
        LINES.info("%s", _line(value))
        key = f"{_time_key(entry.time)}-{uuid.uuid4().hex[:8]}"
        try:
            await self._store.put(key, value)
        except StoreError as exc:
            log.warning(
                "audit entry not stored (%s); the control plane's log holds it "
                "(ponto.audit): %s %s at %s",
                exc,
                entry.action,
                entry.target,
                utc_ms(entry.time),
            )

    async def read(
        self, *, limit: int = 100, action: str = "", actor: str = "", since: float = 0.0
    ) -> list[AuditEntry]:
        """Up to limit (1..MAX_LIMIT) entries, newest first, of this action and
        actor (when given) at or after since (Unix seconds; 0: all).

        Raises Unavailable. Unfiltered, this is one store read of at most limit
        entries; with an action or actor it reads pages, newest first, until it has
        limit entries or has read every entry since `since`.
        """
        try:
            return await self._read(limit, action, actor, since)
        except StoreUnavailable as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc

    async def _read(self, limit: int, action: str, actor: str, since: float) -> list[AuditEntry]:
        limit = max(1, min(limit, MAX_LIMIT))
        start, end = PREFIX, _after(_time_key(since)) if since > 0 else _END
        if not action and not actor:
            listing = await self._store.scan(start, end, limit=limit)
            return [e for kv in listing.items if (e := self._entry(kv.key, kv.value))]
        found: list[AuditEntry] = []
        while True:
            page = (await self._store.scan(start, end, limit=PAGE)).items
            for kv in page:
                e = self._entry(kv.key, kv.value)
                if e and (not action or e.action == action) and (not actor or e.actor == actor):
                    found.append(e)
                    if len(found) == limit:
                        return found
            if len(page) < PAGE:
                return found
            start = page[-1].key + "\0"

    @staticmethod
    def _entry(key: str, value: bytes) -> AuditEntry | None:
        try:
            return _decode(value)
        except (ValueError, TypeError) as exc:
            log.error("ignoring undecodable audit entry %s: %s", key, exc)
            return None

    async def trim(self) -> int:
        """Delete entries older than the retention, then the oldest beyond the
        count (entries of one microsecond stay or go together); return how many
        went. Raises StoreUnavailable.

        Idempotent: what it deletes depends only on the store's entries, never on
        a count taken before, so concurrent trims keep at least max_entries."""
        cutoff = _number(_time_key(self._clock() - self._retention))
        removed = await self._store.delete_range(_after(_key(cutoff)), _END)
        if await self._store.count(PREFIX, _END) <= self._max_entries:
            return removed
        # The newest time number n with at least max_entries entries at n or newer:
        # a binary search of counts, which etcd answers from its index without
        # reading values (about 43 of them over 90 days of microseconds).
        (newest,) = (await self._store.scan(PREFIX, _END, limit=1)).items
        low, high = _number(newest.key), cutoff
        while low < high:
            mid = (low + high) // 2
            if await self._store.count(PREFIX, _after(_key(mid))) >= self._max_entries:
                high = mid
            else:
                low = mid + 1
        return removed + await self._store.delete_range(_after(_key(low)), _END)

    async def run_trim(self) -> None:
        """Trim now and every trim_interval seconds, until cancelled (the leader runs it)."""
        defects = Defects(log, "audit trims")
        while True:
            try:
                removed = await self.trim()
            except StoreError as exc:
                log.warning("audit trim failed, next try in %g s: %s", self._trim_interval, exc)
            except Exception as exc:
                defects.failed(exc)
            else:
                defects.passed()
                if removed:
                    log.info("audit trail trimmed: %d old entries removed", removed)
            await asyncio.sleep(self._trim_interval)
