"""The audit trail of admin actions: who did what to what, when, from where,
and how it ended.

Every mutating Admin call (controlplane/api/auditing.py) and the status page's
drain buttons record an entry; `pontoctl get audit` (the ListAudit call) reads
them, newest first. Layout in the store:

  /ponto/audit/<microseconds since the epoch, 16 digits>-<8 hex>   one JSON entry

so a range read returns entries in time order. Whichever replica served the
call writes its entry (no leader needed); the random suffix keeps entries of
two replicas in the same microsecond apart, and replicas' clocks only need to
agree as well as the order of entries matters to a reader. The prefix lies
outside /ponto/state/, so an entry never rebuilds a route table. The leader
bounds the trail (`run_trim`): entries older than the retention go, then the
oldest beyond the count.

When an entry cannot be written, the call's answer stands and the entry is
logged whole, once, at WARNING. The entry is written after the change, which
cannot be taken back by then: failing the call would tell the operator that a
change that was made was not, and the retry would make it twice. The trail
shares etcd with the state it audits, so while etcd is down the change itself
fails; an entry is missing from the trail only when etcd fails between a change
and its entry, and the control plane's log holds it then.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Final

import orjson
from etcd3aio import prefix_range_end

from controlplane.errors import Unavailable
from controlplane.store import StateStore, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

PREFIX: Final = "/ponto/audit/"
_END: Final = prefix_range_end(PREFIX).decode()
RETENTION_DAYS: Final = 90
MAX_ENTRIES: Final = 100_000
TRIM_INTERVAL: Final = 60.0
# Entries read per store call when filtering, and deleted per call when trimming
# to the count: a page is at most about MAX_ENTRY_BYTES times this.
PAGE: Final = 1000
MAX_LIMIT: Final = 1000
# What one entry may hold, so a page stays well inside a gRPC message.
MAX_FIELD: Final = 256
MAX_MESSAGE: Final = 512
MAX_DETAIL_KEYS: Final = 16


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One admin action.

    time: Unix seconds. actor: the client certificate's identity, "admin-token"
    or "anonymous". source: the caller's address ("ipv4:10.0.0.5:51234",
    "http:10.0.0.5"). result: "ok", or the gRPC status code the call was
    refused with, its message in message. replica: the control-plane replica
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
    return f"{PREFIX}{max(0, int(t * 1_000_000)):016d}"


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

        Long values are cut, and detail keeps its first MAX_DETAIL_KEYS keys.
        """
        entry = AuditEntry(
            time=self._clock(),
            actor=_clip(actor, MAX_FIELD),
            action=_clip(action, MAX_FIELD),
            target=_clip(target, MAX_FIELD),
            source=_clip(source, MAX_FIELD),
            result=_clip(result, MAX_FIELD),
            message=_clip(message, MAX_MESSAGE),
            detail={
                _clip(k, MAX_FIELD): _clip(v, MAX_FIELD)
                for k, v in list((detail or {}).items())[:MAX_DETAIL_KEYS]
            },
            replica=self._replica,
        )
        value = orjson.dumps(asdict(entry))
        key = f"{_time_key(entry.time)}-{uuid.uuid4().hex[:8]}"
        try:
            await self._store.put(key, value)
        except StoreError as exc:
            log.warning("audit entry not stored (%s): %s", exc, value.decode())

    async def read(
        self, *, limit: int = 100, action: str = "", actor: str = "", since: float = 0.0
    ) -> list[AuditEntry]:
        """Up to limit (1..MAX_LIMIT) entries, newest first, of this action and
        actor (when given) at or after since (Unix seconds; 0: all).

        Raises Unavailable. Unfiltered, this is one store read; with an action
        or actor it reads every entry since `since` in pages.
        """
        try:
            return await self._read(limit, action, actor, since)
        except StoreUnavailable as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc

    async def _read(self, limit: int, action: str, actor: str, since: float) -> list[AuditEntry]:
        limit = max(1, min(limit, MAX_LIMIT))
        start = _time_key(since) if since > 0 else PREFIX
        if not action and not actor:
            listing = await self._store.scan(start, _END, limit=limit, newest_first=True)
            return [e for kv in listing.items if (e := self._entry(kv.key, kv.value))]
        found: collections.deque[AuditEntry] = collections.deque(maxlen=limit)
        while True:
            page = (await self._store.scan(start, _END, limit=PAGE)).items
            for kv in page:
                e = self._entry(kv.key, kv.value)
                if e and (not action or e.action == action) and (not actor or e.actor == actor):
                    found.append(e)
            if len(page) < PAGE:
                return list(reversed(found))
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
        count; return how many went. Raises StoreUnavailable."""
        removed = await self._store.delete_range(PREFIX, _time_key(self._clock() - self._retention))
        excess = await self._store.count(PREFIX) - self._max_entries
        while excess > 0:
            page = (await self._store.scan(PREFIX, _END, limit=min(excess, PAGE))).items
            if not page:
                break
            removed += await self._store.delete_range(PREFIX, page[-1].key + "\0")
            excess -= len(page)
        return removed

    async def run_trim(self) -> None:
        """Trim now and every trim_interval seconds, until cancelled (the leader runs it)."""
        while True:
            try:
                removed = await self.trim()
            except StoreError as exc:
                log.warning("audit trim failed, next try in %g s: %s", self._trim_interval, exc)
            else:
                if removed:
                    log.info("audit trail trimmed: %d old entries removed", removed)
            await asyncio.sleep(self._trim_interval)
