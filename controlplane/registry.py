"""Proxies connected to this replica, kept in the store under the replica's lease.

One lease per replica, not per proxy: a proxy's key is deleted when its stream
ends, and if the replica itself dies its lease expires and every key it wrote
goes with it. The proxies then reconnect to another replica and re-register.
If the lease is lost (etcd was away longer than the TTL) a new one is granted
and every live registration is written again.

A name registered again, on this replica or another (a group's worker and its
successor during a reload, or a proxy back from a partition), belongs to the
later registration: the earlier session is dropped here as soon as the
replica holding it sees the write (`watch`), and its route stream ends at once
(`ended`), rather than when its process leaves.

A registration whose proxy opens no route stream within STREAM_GRACE seconds
is removed: a proxy that died between Register and RouteStream would otherwise
stay listed, and counted in every proxy's fleet size (so in its share of each
global limit), until the replica itself goes.

A proxy that stops says so (Routing.Deregister, `deregister`), and its
registration goes at once, whichever replica it asks: that replica deletes
the key if it is still the process's, having first noted the departure
(catalog.DEPARTED, for DEPARTED_TTL seconds). The note is what the replica
holding the session reads when its key is found missing (`watch`, the
self-check, a rewrite): it drops the session rather than write the key back,
as it does for a key lost with a lease or an etcd restored from a snapshot.
A Register of that process still under way (the proxy stopped before its
answer) reads the note after its write, removes its key and fails; a route
stream that arrives for a session deregistered is refused, or ended once its
replica reads the note: a process that deregistered is never listed again.

A key under this replica's lease that holds no session of it, registered
or being registered, is removed when the replica reads its registrations
(the self-check, the watch's read; `_drop_ghosts`): a restore from an etcd
snapshot brings back the key of a proxy gone since, under a lease that
lives on with the replica, so it would never expire (trial 73: listed for
good, counted in every proxy's fleet size). A Register writes its key
after naming its session (`_unstreamed`), a removal names its session
until it is done (`_removing`), and the delete is conditional on the key
as read: a registration written since stays. Keys under another lease are
never touched, even one naming this replica: that lease is another
process's, or one this replica lost, which nobody renews.

The keys this replica writes under its lease (its own, /ponto/replicas/ID,
and its proxies') are written again whenever a lease is granted after the
first, whoever asked for it, and retried with a bounded backoff until they
are all written under the live lease (REWRITE_CONCURRENCY at once, in a
task of its own: the lease is renewed meanwhile); every SELF_CHECK_EVERY
seconds the replica also reads them back and writes again those missing
(only those, while the lease is the same). A lease
granted by another caller (the ACK flush) while a rewrite had failed had
kept the new lease with no rewrite at all: the replica and its proxies were
gone from the fleet view, and from the leader's rate-limit shares, until the
replica restarted (trial: an etcd stall). Its own key is written again at
every keepalive beat (`renewed_at`, `renew_every`, `lease_ttl`): a reader,
by when it saw the key change on its own clock (controlplane.beats), tells
a replica that stopped renewing (hung, killed) from a live one before its
lease runs out (replica_silence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import orjson

from controlplane.catalog import (
    PROXIES,
    REPLICAS,
    Catalog,
    Departure,
    Ejections,
    Limited,
    Served,
    Traffic,
)
from controlplane.errors import Departed, Superseded, Unavailable
from controlplane.model import ProxyRecord, decode_proxy
from controlplane.quotasync import QUOTA_FORMAT
from controlplane.store import KeyValue, LeaseExpired, Listing, StoreError, StoreUnavailable
from ponto.features import FEATURES
from ponto.v1 import routing_pb2 as pb
from ponto.version import software_version

log = logging.getLogger(__name__)

# How often a replica writes its proxies' traffic reports (/ponto/traffic/ID),
# if any changed: the status page's rates have this granularity.
TRAFFIC_EVERY = 5.0
# How long a registration may wait for its route stream. A proxy opens it
# right after Register returns; this leaves room for a slow network or a
# paused process, far less than the minutes a replica lives.
STREAM_GRACE = 15.0
# How long a deregistration's note (catalog.DEPARTED) lasts: past a Register
# under way (5 s at most, the proxy's deadline) and past the holding
# replica's read of its registrations (0.5 s after a change, a rescan and a
# self-check every 30 s). A note gone before that read leaves the session to
# the stream grace, or to its stream's end.
DEPARTED_TTL = 60
# At most one read of the registrations (to find this replica's sessions
# superseded elsewhere) per this many seconds: a superseded stream ends this
# much later at worst.
SUPERSEDED_READ_EVERY = 0.5
# And one read at least this often with no change seen: a change the watch
# missed (one made while its stream was being re-created after etcd restarted)
# would otherwise leave a superseded stream open until the next change.
SUPERSEDED_RESCAN_EVERY = 30.0
# How often a replica reads back its own key and its proxies' keys, to write
# again any that is not in the store under its lease (a read of every
# registration: as rare as the rescan above).
SELF_CHECK_EVERY = 30.0
# A failed re-registration is tried again after this, doubled per failure up
# to REWRITE_RETRY_MAX (and never later than the keepalive's beat).
REWRITE_RETRY_MIN = 0.2
REWRITE_RETRY_MAX = 5.0
# Keys a rewrite writes at once: 400 proxies, each a read and a conditional
# write, one after the other at 5 ms a call took 4 s, past a 3 s lease.
REWRITE_CONCURRENCY = 16


def silent_after(replica: Mapping[str, object]) -> float | None:
    """After how long without a renewal seen a replica (its /ponto/replicas/
    key, decoded) is judged hung; None for a replica from before
    `renew_every`, which is never judged.

    The rule: two of its beats and half a beat more, and never less than
    half its lease's TTL (with beats of TTL/3, as this registry's: 5/6 of
    the TTL). Two beats let one renewal fail (or time out short of a beat)
    and the next work; the half beat is for the writes' latency. Always
    below the TTL, so a replica that stops renewing is flagged for the last
    sixth of its lease before its keys go with it. (Two beats and a second
    flagged a healthy replica after one failed renewal and a slow write, and
    with a TTL of 3 s or less never flagged one before its lease ended.)"""
    every = replica.get("renew_every")
    if not isinstance(every, int | float) or isinstance(every, bool) or every <= 0:
        return None
    ttl = replica.get("lease_ttl")
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or ttl <= 0:
        ttl = 3 * float(every)  # a replica from before lease_ttl: beats of TTL/3
    return max(2 * float(every), float(ttl) / 2) + float(every) / 2


def replica_silence(replica: Mapping[str, object], silent: float) -> float | None:
    """`silent` (seconds without a renewal of `replica`'s key seen by the
    reader, on its own monotonic clock: controlplane.beats) when it is
    longer than silent_after allows; None while it renews, or for a replica
    from before `renew_every`."""
    after = silent_after(replica)
    return silent if after is not None and silent > after else None


def conflict_of(refused: ProxyRecord, holder_address: str, holder_host: str) -> str:
    """Where `refused` runs, if it is not where the holder of its name does
    (its address, or its host when the address is the holder's too and names
    no one host: two hosts advertising 0.0.0.0:8080, say); "" when it is the
    same place, as a group's worker and its successor are, or the holder is
    unknown. A host's own address is not second-guessed by the peer's: behind
    a NAT with several addresses, one group's workers arrive from several."""
    if not holder_address:
        return ""
    if refused.address != holder_address:
        return refused.address
    if (
        _names_no_host(refused.address)
        and refused.host
        and holder_host
        and refused.host != holder_host
    ):
        return f"{refused.address} on host {refused.host}"
    return ""


def _names_no_host(address: str) -> bool:
    """Whether an advertised HOST:PORT is one every host may advertise: a
    wildcard or loopback address (the defaults of --listen and --advertise)."""
    host = address.rpartition(":")[0].strip("[]").lower()
    return host in ("", "0.0.0.0", "::", "::1", "localhost") or host.startswith("127.")


def record_of(kv: KeyValue) -> ProxyRecord | None:
    """The registration a key holds; None if it does not decode."""
    try:
        return decode_proxy(kv.value)
    except (ValueError, TypeError, KeyError):
        return None


class ProxyRegistry:
    def __init__(
        self,
        catalog: Catalog,
        replica_id: str,
        *,
        lease_ttl: int = 10,
        current_version: Callable[[], int] = lambda: 0,
        current_etag: Callable[[], str] = lambda: "",
        traffic_every: float = TRAFFIC_EVERY,
        stream_grace: float = STREAM_GRACE,
        clock: Callable[[], float] = time.time,
        self_check_every: float = SELF_CHECK_EVERY,
        store_epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self._catalog = catalog
        # The version this replica serves now, written with its ACK summary.
        self._current_version = current_version
        self._current_etag = current_etag
        # (version, etag) of the last ACK summary written: one is written when
        # they change too, so readers see soon which table this replica
        # serves (a proxy of a replica behind is not shown current).
        self._summary_of: tuple[int, str] = (0, "")
        self.replica_id = replica_id
        self._ttl = lease_ttl
        self._lease = 0
        self._lease_lock = asyncio.Lock()
        # Set when a write found the lease gone: the keepalive looks at once
        # rather than at its next beat.
        self._lease_suspect = asyncio.Event()
        self.sessions: dict[str, ProxyRecord] = {}
        self._by_name: dict[str, str] = {}  # proxy name -> its current session id
        # Session id -> the store revision its registration was last written
        # at: a registration of its name read at a later revision, of
        # another session, superseded it.
        self._written: dict[str, int] = {}
        # Session id -> set when the session is dropped here (see ended).
        self._ended: dict[str, asyncio.Event] = {}
        self._announcement: bytes | None = None
        # ACKs are kept here and written as one key per replica (ACKS + id) at
        # most every ack_flush seconds: a push to N proxies costs one etcd
        # write, not N.
        self._acks_dirty = False
        # Traffic reports come about once a second from every proxy; they are
        # written under their own key (TRAFFIC + id), at most every
        # traffic_every seconds and only when a proxy's counters changed, so
        # the ACK summary is rewritten only when an ACK changes.
        self._traffic: dict[str, Traffic] = {}
        self._traffic_dirty = False
        self._traffic_every = traffic_every
        self._traffic_written = float("-inf")
        self._clock = clock
        self._fleet: tuple[float, int] = (0.0, 0)
        # Sessions registered, or being registered, whose proxy has not opened
        # its route stream yet -> their proxy's name and the `now` of the first
        # flush that saw them (None before one did): flush's clock is the only
        # one the deadline is read on.
        self._unstreamed: dict[str, tuple[str, float | None]] = {}
        # Sessions whose key this replica is removing (_remove_key): no
        # longer its sessions, but their keys are not ghosts (_drop_ghosts).
        self._removing: set[str] = set()
        # The lease's keepalive or rewrite failed, and has not worked since.
        self._store_failing = False
        self._stream_grace = stream_grace
        # Set when a lease is granted after the first (its keys went with the
        # lost one) or a self-check missed a key; cleared only once every
        # key is written under the live lease.
        self._rewrite_due = False
        # The sessions whose keys a due rewrite writes, when only they were
        # found missing under the live lease; None: every session's (a lease
        # granted after the first holds none of them). A rewrite takes them
        # as it starts: those found missing while it runs are written by the
        # next (_ask_rewrite).
        self._rewrite_only: set[str] | None = None
        # Counts the asks for a rewrite (_ask_rewrite); a rewrite clears
        # _rewrite_due only if none came since it took what to write, and
        # set by each: a failed rewrite's back-off ends at a new ask.
        self._rewrite_asked = 0
        self._rewrite_took = 0
        self._asked = asyncio.Event()
        # The sessions whose keys the rewrite under way has still to write.
        self._rewrite_taken: set[str] = set()
        self._granted = False
        self._announced = False  # its key written once (announce, or a rewrite)
        self._retry_in = REWRITE_RETRY_MIN
        self._self_check_every = self_check_every
        # Changes when etcd's revision went back (RebasedStore.base): restored
        # from a snapshot, which may hold this replica's lease but not every
        # key written under it since; nothing else tells (a watch whose last
        # event is older than the snapshot sees no regression).
        self._store_epoch = store_epoch

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if not self._lease:
                try:
                    self._lease = await self._catalog.store.grant_lease(self._ttl)
                except StoreUnavailable as exc:
                    raise Unavailable(f"state store unavailable: {exc}") from exc
                log.info("replica lease %x granted (ttl %ds)", self._lease, self._ttl)
                if self._granted:
                    # Whoever asked (a flush, a Register), the keys of the
                    # lost lease are to be written under this one.
                    self._ask_rewrite(None)
                    self._lease_suspect.set()
                self._granted = True
            return self._lease

    async def announce(self, address: str) -> None:
        """List this replica under /ponto/replicas/ for as long as it lives."""
        self._announcement = orjson.dumps(
            {
                "id": self.replica_id,
                "address": address,
                "started_at": time.time(),
                "version": software_version(),
                # What this replica compiles of the settings only some builds know.
                "features": list(FEATURES),
                # What this replica reads of the leader's quota shares.
                "quota_format": QUOTA_FORMAT,
            }
        )
        try:
            await self._put_announcement(await self._ensure_lease())
            self._announced = True
        except (Unavailable, LeaseExpired, StoreUnavailable) as exc:
            log.warning("replica not announced yet (retried with the lease): %s", exc)

    async def _put_announcement(self, lease: int) -> None:
        """Write this replica's key (if announced) with the time it renewed its lease."""
        if self._announcement is not None:
            value = orjson.loads(self._announcement)
            # For people (its clock's); readers judge by when they saw the
            # key change (controlplane.beats), by renew_every and lease_ttl.
            value["renewed_at"] = self._clock()
            value["renew_every"] = self._beat()
            value["lease_ttl"] = self._ttl
            await self._catalog.store.put(
                REPLICAS + self.replica_id, orjson.dumps(value), lease=lease
            )

    def _beat(self) -> float:
        """Seconds between two renewals of the lease."""
        return max(self._ttl / 3, 0.2)

    async def lease(self) -> int:
        """The replica's lease, granted on first use; keys under it die with the replica."""
        return await self._ensure_lease()

    async def fleet_size(self) -> int:
        """Registered proxies across all replicas (at least 1), read at most once a second."""
        at, size = self._fleet
        now = time.monotonic()
        if now - at > 1.0:
            try:
                size = len(await self._catalog.proxy_names())
            except Unavailable:
                size = len(self.sessions)
            self._fleet = (now, size)
        return max(1, size)

    async def register(
        self,
        name: str,
        region: str,
        address: str,
        version: str,
        *,
        started_at: float = 0.0,
        host: str = "",
        age_s: float | None = None,
        features: Sequence[str] = (),
    ) -> ProxyRecord:
        """Register proxy `name`, replacing the registration of its name unless
        that one's process started later (Superseded): a group's worker that a
        reload replaced, or a proxy back from a partition after its restart
        elsewhere, must not take the name from its successor. `age_s`: how
        long its process had run when it asked (its counters' age), from
        when it asked, before any wait here (a lease granted after an etcd
        outage takes seconds, which would shorten the counters' time)."""
        connected_at = time.time()
        lease = await self._ensure_lease()
        record = ProxyRecord(
            name=name,
            region=region,
            address=address,
            version=version,
            session_id=uuid.uuid4().hex,
            control_plane_id=self.replica_id,
            connected_at=connected_at,
            started_at=started_at,
            counting_from=connected_at - age_s if age_s is not None else 0.0,
            host=host,
            features=tuple(features),
        )
        # Timed before the write: a call cancelled (the proxy gone) or failed
        # during it may still have written the key, under the replica's lease,
        # which would keep it for as long as the replica lives; the sweep
        # removes the key if it is still this session's. The session becomes
        # this replica's (superseding an older one of the name, rewritten on
        # a new lease) only once the write is done.
        self._unstreamed[record.session_id] = (name, None)
        try:
            written = await self._catalog.register_proxy(record, lease)
        except Superseded as exc:
            self._unstreamed.pop(record.session_id, None)  # nothing was written
            await self._note_conflict(record, exc.holder_address, exc.holder_host, "refused")
            raise
        except LeaseExpired:
            # The replica stalled past its lease (a stopped process, a paused
            # VM): its keepalive re-grants it and rewrites its proxies; this
            # one tries again meanwhile. It was an INTERNAL with a traceback,
            # and a warning 15 s later of a stream never opened (trial 22).
            self._unstreamed.pop(record.session_id, None)  # nothing was written
            self._lease_suspect.set()
            raise Unavailable(
                "this control plane's lease in etcd expired (the replica stalled, or etcd did "
                "not answer its keepalives); it is renewing it, try again"
            ) from None
        if await self._departed(record):
            # Its process deregistered while this call was under way (it
            # stopped before the answer): the key just written is removed.
            self._unstreamed.pop(record.session_id, None)
            await self._remove_key(name, record.session_id)
            raise Departed(f"proxy {name}'s process deregistered; it is stopping")
        old = self._by_name.get(name)
        if old is not None:
            if self.streaming_now(old):
                await self._note_conflict(
                    self.sessions[old], address, host, "superseded while it streams"
                )
            self._forget(old)
        # The old session's counters are not this one's (rates are per session).
        if self._traffic.pop(name, None) is not None:
            self._traffic_dirty = True
        self._by_name[name] = record.session_id
        self.sessions[record.session_id] = record
        self._written[record.session_id] = written
        self._ended[record.session_id] = asyncio.Event()
        self._acks_dirty = True
        return record

    async def _departed(self, record: ProxyRecord) -> bool:
        """Whether a departure noted of `record`'s name is its process's; False
        when none is, when it says no start (nothing could name it before its
        answer), or when the store does not answer (the grace then applies)."""
        if record.started_at <= 0:
            return False
        try:
            departure = await self._catalog.departure(record.name)
        except Unavailable:
            return False
        return departure is not None and departure.of(record)

    async def deregister(self, name: str, session_id: str, started_at: float) -> bool:
        """Remove proxy `name`'s registration by the process that asks
        (Routing.Deregister): its session `session_id`, or, when empty (its
        Register was not answered), the one of its process started at
        `started_at`; whether one was removed. Idempotent, and any replica may
        be asked: another's session is deleted from the store after a note of
        the departure, which that replica reads before it would write the key
        back (see the module's docstring). Unavailable if the store does not
        answer (the proxy gives up; the grace applies)."""
        departure = Departure(session_id, started_at)
        removed = False
        for held, record in list(self.sessions.items()):
            if record.name == name and departure.of(record):
                await self.unregister(held)
                removed = True
        if removed and session_id:
            return True  # a session is one replica's: none holds it elsewhere
        noted = False
        if not session_id:
            # Before the read: a Register of the process under way here or
            # elsewhere reads it after its write, or wrote before the read.
            await self._catalog.note_departure(name, departure, DEPARTED_TTL)
            noted = True
        kv = await self._catalog.departed_key(name, departure)
        if kv is None:
            return removed
        if not noted:
            # Before the delete: the replica holding the session must drop it
            # when it finds the key gone, not write it back.
            await self._catalog.note_departure(name, departure, DEPARTED_TTL)
        return await self._catalog.remove_key(kv) or removed

    async def _drop_departed(self, listing: Listing) -> None:
        """Drop this replica's sessions whose key `listing` (of PROXIES)
        lacks, when a departure noted is their process's: deregistered through
        another replica (or through this one while its Register was under
        way). Read only when a key is missing; a failed read keeps them."""
        names = {kv.key[len(PROXIES) :] for kv in listing.items}
        gone = [(sid, r) for sid, r in self.sessions.items() if r.name not in names]
        if not gone:
            return
        try:
            departures = await self._catalog.departures()
        except Unavailable as exc:
            log.debug("departures not read: %s", exc)
            return
        for session_id, record in gone:
            departure = departures.get(record.name)
            if departure is None or not departure.of(record) or session_id not in self.sessions:
                continue
            log.info("proxy %s deregistered (session %s)", record.name, session_id)
            self._forget(session_id)

    def ended(self, session_id: str) -> asyncio.Event:
        """Set once the session is no longer this replica's: its name
        registered again (here or elsewhere), its registration was removed,
        or it never was one. A route stream waits on it to end at once."""
        event = self._ended.get(session_id)
        if event is None:
            event = asyncio.Event()
            event.set()
        return event

    async def watch(
        self, every: float = SUPERSEDED_READ_EVERY, rescan: float = SUPERSEDED_RESCAN_EVERY
    ) -> None:
        """Drop the sessions whose name registered again on another replica
        after changes of the registrations, until cancelled: one read for
        the changes of `every` seconds (a fleet's rolling reload is thousands
        of changes, each replica's read of all registrations per change would
        be millions of decodes). The store's watch survives its restarts and
        compactions, but may miss a change made while it re-creates its
        stream: with no change seen, the registrations are read every
        `rescan` seconds anyway. A read that fails is made again `every`
        seconds later."""
        changed = asyncio.Event()

        async def follow() -> None:
            async for _ in self._catalog.store.watch(PROXIES, 0):
                changed.set()

        follower = asyncio.create_task(follow(), name="proxy-registrations-watch")
        try:
            while True:
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait(
                    {waiter, follower}, timeout=rescan, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                if follower.done():
                    follower.result()  # the watch's error, if any, is the task's
                    return
                changed.clear()
                if not await self.drop_superseded():
                    changed.set()  # the change is still unread
                await asyncio.sleep(every)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def drop_superseded(self) -> bool:
        """Read the registrations and drop this replica's sessions whose name
        holds another session written after theirs; a session whose key is
        not there under the live lease (etcd restored from a snapshot taken
        before it registered, say) is written again (self_check). False,
        keeping everything, if the store is unavailable."""
        if not self.sessions:
            return True
        lease, before = self._lease, dict(self._written)
        try:
            listing = await self._catalog.store.list(PROXIES)
        except (StoreUnavailable, LeaseExpired) as exc:
            log.debug("registrations not read: %s", exc)
            return False
        # First: a ghost of this replica's own under the name of one of its
        # sessions (the same process, registered again since the snapshot)
        # would be taken for a registration made elsewhere.
        listing = await self._drop_ghosts(listing, lease)
        keys = {kv.key[len(PROXIES) :]: kv for kv in listing.items}
        for session_id, record in list(self.sessions.items()):
            kv = keys.get(record.name)
            # A key absent was removed or went with a lost lease (keepalive
            # writes it again); one at this session's revision or earlier is
            # its own write or a read from before it. Only a later one is
            # decoded: this replica's own rewrite of the session (a lost
            # lease's) may be read before its revision is noted.
            if kv is None or kv.mod_revision <= self._written.get(session_id, 0):
                continue
            holder = record_of(kv)
            if holder is None or holder.session_id == session_id:
                continue
            if 0 < holder.started_at < record.started_at:
                # An earlier process's, written back after an outage of etcd
                # before this replica wrote its own (review 37): this one
                # takes the name back now (review 38: with its lease alive,
                # as after etcd restored from a snapshot, no rewrite of its
                # own would come).
                with contextlib.suppress(Unavailable, LeaseExpired, StoreUnavailable):
                    written = await self._catalog.restore_proxy(record, await self._ensure_lease())
                    if written and session_id in self.sessions:
                        self._written[session_id] = written
                continue
            log.info(
                "proxy %s registered again elsewhere (session %s); its session %s here ends",
                record.name,
                holder.session_id,
                session_id,
            )
            if self.streaming_now(session_id):
                await self._note_conflict(
                    record, holder.address, holder.host, "superseded while it streams"
                )
            self._forget(session_id)
        await self._drop_departed(listing)
        if lease:
            self._write_missing(self._missing(listing, lease, before), lease)
        return True

    def streaming_now(self, session_id: str) -> bool:
        """Whether the session is this replica's and its route stream open."""
        return session_id in self.sessions and session_id not in self._unstreamed

    async def _note_conflict(
        self, older: ProxyRecord, holder_address: str, holder_host: str, what: str
    ) -> None:
        """`older`'s process lost its name (`what`: refused it, or superseded
        while its stream was open) to a later one at `holder_address`, from
        `holder_host`: unless both run in one place, as a group's worker and
        its successor do, two proxies were given one --name. Logged, and
        noted beside the holder (Catalog.note_conflict), or the older one
        would serve its last table unseen. Best effort: the registration's
        answer stands (review 37: a lease lost meanwhile made a refusal an
        INTERNAL error with a traceback)."""
        where = conflict_of(older, holder_address, holder_host)
        if not where:
            return
        log.warning(
            "proxy %s at %s %s: a process started later holds the name, at %s "
            "(two proxies given one --name?)",
            older.name,
            where,
            what,
            holder_address,
        )
        with contextlib.suppress(Unavailable, LeaseExpired, StoreUnavailable):
            await self._catalog.note_conflict(older, where, await self._ensure_lease())

    def streaming(self, session_id: str) -> bool:
        """Mark the session's route stream open, so its registration stays
        for as long as the stream does; False if the session is unknown (never
        registered here, superseded, or removed for opening its stream late)."""
        if session_id not in self.sessions:
            return False
        self._unstreamed.pop(session_id, None)
        return True

    async def acked(
        self, session_id: str, version: int, error: str, warnings: tuple[str, ...] = ()
    ) -> None:
        """Record an ACK (error empty; `warnings`: what the proxy cannot use of
        the table it applied) or a NACK (the warnings of the table it still
        serves stand); written with the next flush."""
        record = self.sessions.get(session_id)
        if record is None:
            return
        if error:
            record = replace(record, last_error=error)
        else:
            record = replace(record, acked_version=version, last_error="", warnings=warnings)
        self.sessions[session_id] = record
        self._acks_dirty = True

    def warned(self, session_id: str, warnings: tuple[str, ...]) -> None:
        """Record what a proxy reported it cannot use of the table it serves,
        between two ACKs (RouteRequest.warnings_current); written with the
        next flush, as an ACK's are."""
        record = self.sessions.get(session_id)
        if record is None or record.warnings == warnings:
            return
        self.sessions[session_id] = replace(record, warnings=warnings)
        self._acks_dirty = True

    def reported(
        self,
        session_id: str,
        requests: int,
        server_errors: int,
        client_errors: int,
        served: Served | None = None,
        limited: Limited | None = None,
        ejected: Sequence[pb.OriginEjected] = (),
    ) -> None:
        """Record a proxy's cumulative traffic counters (`served`: region ->
        requests, errors it served; `limited`: tenant -> requests refused by a
        rate limit, requests that waited for a slot) and the origins it
        ejected; written with a later flush if they changed (the time heard
        goes along, never alone, and so do an ejection's times: its count
        and last failure are what change it)."""
        record = self.sessions.get(session_id)
        if record is None:
            return
        served = served or {}
        limited = limited or {}
        now = self._clock()
        ejections = {
            e.origin: (
                now - e.for_s,
                e.ejections,
                e.last_failure,
                now - e.failed_s,
                now + e.ejected_s if e.ejected_s > 0 else now - e.failed_s,
            )
            for e in ejected
        }
        last = self._traffic.get(record.name)
        if last is None or (*last[:3], *last[4:6], _changes(last[6])) != (
            requests,
            server_errors,
            client_errors,
            served,
            limited,
            _changes(ejections),
        ):
            self._traffic_dirty = True
        self._traffic[record.name] = (
            requests,
            server_errors,
            client_errors,
            now,
            served,
            limited,
            ejections,
        )

    def traffic(self) -> dict[str, Traffic]:
        """This replica's proxies: name -> (requests, 5xx, 4xx, heard at,
        served, limited, ejected)."""
        return {
            r.name: self._traffic[r.name] for r in self.sessions.values() if r.name in self._traffic
        }

    def acks(self) -> dict[str, tuple[int, str]]:
        """This replica's proxies: name -> (acked version, last error)."""
        return {r.name: (r.acked_version, r.last_error) for r in self.sessions.values()}

    def ack_warnings(self) -> dict[str, list[str]]:
        """This replica's proxies that last reported warnings: name -> warnings."""
        return {r.name: list(r.warnings) for r in self.sessions.values() if r.warnings}

    async def flush_acks(self, interval: float = 0.2) -> None:
        """Write what changed (see flush) every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.flush(time.monotonic())

    async def flush(self, now: float) -> None:
        """Write the ACK summary if an ACK changed, and the traffic reports if
        a counter changed and the last write is traffic_every old at `now`
        (monotonic seconds); what is not written stays due for the next call.
        Registrations still without a route stream stream_grace s after the
        first flush that saw them are removed first."""
        await self._drop_unstreamed(now)
        serving = (self._current_version(), self._current_etag())
        try:
            if self._acks_dirty or (self.sessions and serving != self._summary_of):
                self._acks_dirty = False
                await self._catalog.put_acks(
                    self.replica_id,
                    self.acks(),
                    await self._ensure_lease(),
                    version=serving[0],
                    etag=serving[1],
                    warnings=self.ack_warnings(),
                )
                self._summary_of = serving
            if self._traffic_dirty and now - self._traffic_written >= self._traffic_every:
                self._traffic_dirty = False
                self._traffic_written = now
                await self._catalog.put_traffic(
                    self.replica_id, self.traffic(), await self._ensure_lease()
                )
        except (Unavailable, LeaseExpired, StoreUnavailable) as exc:
            self._acks_dirty = True
            self._traffic_dirty = True
            log.debug("ACK summary or traffic not written: %s", exc)

    async def _drop_unstreamed(self, now: float) -> None:
        late = []
        for session_id, (name, seen) in self._unstreamed.items():
            if seen is None:
                self._unstreamed[session_id] = (name, now)
            elif now - seen >= self._stream_grace:
                late.append(session_id)
        for session_id in late:
            # Each removal awaits the store: a stream opened meanwhile keeps its own.
            pending = self._unstreamed.pop(session_id, None)
            if pending is None:
                continue
            name = pending[0]
            said = (
                "proxy %s registered (session %s) but opened no route stream in %gs; "
                "its registration is removed"
            )
            if session_id in self.sessions:
                log.warning(said, name, session_id, self._stream_grace)
                await self.unregister(session_id)
            elif await self._remove_key(name, session_id):  # its Register never finished
                log.warning(said, name, session_id, self._stream_grace)
            else:
                # Never written, or removed since: its proxy deregistered
                # (it stopped during the call), or registered again; or the
                # store did not answer (_remove_key said so).
                log.debug("proxy %s: its Register (session %s) left no key", name, session_id)

    async def unregister(self, session_id: str) -> None:
        record = self._forget(session_id)
        if record is not None:
            await self._remove_key(record.name, session_id)

    def _forget(self, session_id: str) -> ProxyRecord | None:
        """Drop the session here (not its key) and end its stream; its
        record, if it had one."""
        self._unstreamed.pop(session_id, None)
        self._written.pop(session_id, None)
        ended = self._ended.pop(session_id, None)
        if ended is not None:
            ended.set()
        record = self.sessions.pop(session_id, None)
        if record is None:
            return None
        if self._by_name.get(record.name) == session_id:
            del self._by_name[record.name]
            if self._traffic.pop(record.name, None) is not None:
                self._traffic_dirty = True
        self._acks_dirty = True
        return record

    async def _remove_key(self, name: str, session_id: str) -> bool:
        """Remove proxy `name`'s key if it is still `session_id`'s; whether
        it was (a store that does not answer: False, said, the key kept)."""
        self._removing.add(session_id)
        try:
            return await self._catalog.remove_proxy(name, session_id)
        except Unavailable as exc:
            # The next read of the registrations removes it (_drop_ghosts).
            log.warning("could not remove %s (removed at the next self-check): %s", name, exc)
            return False
        finally:
            self._removing.discard(session_id)

    async def keepalive(self) -> None:
        """Refresh the lease and rewrite this replica's key (its heartbeat)
        every beat until cancelled; re-grant the lease if it was lost, and
        write its keys again until they are all under the live lease
        (retried after REWRITE_RETRY_MIN to REWRITE_RETRY_MAX seconds); read
        them back every self_check_every seconds, once the store answers
        again after failing, and once its revision went back (self_check).

        A rewrite runs as a task of its own: the lease is renewed, and the
        replica's key with it, every beat however long the rewrite takes (400
        keys written one after the other in line with the renewals had the
        lease expire, granted again, and expire again, over and over)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        epoch = self._store_epoch()
        rewriting: asyncio.Task[None] | None = None
        try:
            while True:
                busy = rewriting is not None and not rewriting.done()
                due = self._rewrite_due and not busy
                wait = min(self._retry_in, self._beat()) if due else self._beat()
                # Not wait_for: 3.11's lets a cancellation go with the event
                # set at once (stop() then waited for this loop for good).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._lease_suspect.wait()
                self._lease_suspect.clear()
                if lease := self._lease:
                    try:
                        await self._catalog.store.refresh_lease(lease)
                        if self._store_failing and not self._rewrite_due:
                            self._store_failing = False
                            log.info("lease keepalive works again")
                            # etcd may come back restored from a snapshot that
                            # has the lease but not every key: read them now.
                            checked = float("-inf")
                    except LeaseExpired:
                        self._lease_expired(lease)
                    except StoreUnavailable as exc:
                        self._say_store_failing("lease keepalive failed: %s", exc)
                        continue
                if not self._lease or self._rewrite_due:
                    if rewriting is not None and not rewriting.done():
                        if self._lease:  # a long rewrite: its heartbeat goes on
                            with contextlib.suppress(LeaseExpired, StoreUnavailable):
                                await self._put_announcement(self._lease)  # renewed_at
                    elif self.sessions or self._announcement is not None:
                        # It writes the replica's key first.
                        rewriting = asyncio.create_task(
                            self._rewrite_then_back_off(), name="registry-rewrite"
                        )
                    continue
                try:
                    await self._put_announcement(self._lease)  # renewed_at
                except (LeaseExpired, StoreUnavailable) as exc:
                    log.debug("replica key not renewed: %s", exc)
                    continue
                if epoch != self._store_epoch():
                    epoch = self._store_epoch()
                    checked = float("-inf")  # etcd went back: read the keys now
                if loop.time() - checked >= self._self_check_every:
                    checked = loop.time()
                    await self.self_check()
        finally:
            if rewriting is not None:
                rewriting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rewriting

    def _lease_expired(self, lease: int) -> None:
        """The keepalive's refresh of `lease` found it gone: drop it and have
        every key written again under the next, unless the replica holds
        another already. The rewrite task may have dropped `lease` during the
        refresh and a flush or a Register been granted the next one since,
        which holds the keys' rewrite due (a review: zeroed here too, that
        live lease was said to have expired, left to run out, and a third
        granted, every key written again, a Register's under the dropped one
        lost when it ran out)."""
        if lease != self._lease:
            log.debug("replica lease %x expired, dropped already", lease)
            return
        log.warning(
            "replica lease %x expired; re-registering %d proxies", lease, len(self.sessions)
        )
        self._lease = 0
        self._ask_rewrite(None)

    async def self_check(self) -> bool:
        """Read this replica's key and its proxies' keys back; if one is not
        in the store under the live lease, say which once and have the
        keepalive write them again at once. False if they were not read (the
        store unavailable) or a rewrite is due anyway."""
        lease, before = self._lease, dict(self._written)
        if not lease or self._rewrite_due:
            return False
        try:
            own = await self._catalog.store.get(REPLICAS + self.replica_id)
            listing = await self._catalog.store.list(PROXIES)
        except (StoreUnavailable, LeaseExpired) as exc:
            log.debug("self-check not made: %s", exc)
            return False
        listing = await self._drop_ghosts(listing, lease)
        await self._drop_departed(listing)
        missing = self._missing(listing, lease, before)
        if lease != self._lease or self._rewrite_due:
            return False  # the lease changed during the read
        own_missing = self._announcement is not None and (own is None or own.lease != lease)
        self._write_missing(missing, lease, own_missing=own_missing)
        return True

    async def _drop_ghosts(self, listing: Listing, lease: int) -> Listing:
        """Remove the keys `listing` (of PROXIES) holds under `lease`, still
        this replica's live one, that hold no session of this replica's
        (`_holds`): ghosts, such as a restore from an etcd snapshot brings
        back of a proxy gone since (see the module's docstring). Each delete
        is conditional on the key as read; a store that fails stops the
        removals until the next read. `listing` without the ghosts, whether
        removed or written again meanwhile: what their names hold now is
        not what was read (a session of this replica's under one of them is
        then missing, and written again)."""
        if not lease or lease != self._lease:
            return listing
        # Judged at once after the read, with no wait between: a session
        # named since holds a key written after the read, which the
        # conditional delete leaves.
        ghosts = [kv for kv in listing.items if kv.lease == lease and not self._holds(kv)]
        if not ghosts:
            return listing
        for kv in ghosts:
            try:
                removed = await self._catalog.remove_key(kv)
            except Unavailable as exc:
                log.debug("stale registrations not removed yet: %s", exc)
                break
            if removed:
                record = record_of(kv)
                log.warning(
                    "proxy %s was registered under this replica's lease %x, with no "
                    "session here (session %s: gone before etcd was restored from a "
                    "snapshot?); its registration is removed",
                    kv.key[len(PROXIES) :],
                    lease,
                    "undecodable" if record is None else record.session_id,
                )
        return Listing(listing.revision, tuple(kv for kv in listing.items if kv not in ghosts))

    def _holds(self, kv: KeyValue) -> bool:
        """Whether a proxy's key holds a session of this replica's: registered,
        being registered (its key is written before the session is this
        replica's), or being removed. Decoded only when it is not a session's
        own write (a fleet's reload reads the registrations several times a
        second; revisions do not go back: RebasedStore numbers a restored
        key above every revision handed out before)."""
        held = self._by_name.get(kv.key[len(PROXIES) :])
        if held is not None and 0 < kv.mod_revision <= self._written.get(held, 0):
            return True  # its write, or a read from before it
        record = record_of(kv)
        if record is None:
            return False
        sid = record.session_id
        return sid in self.sessions or sid in self._unstreamed or sid in self._removing

    def _missing(self, listing: Listing, lease: int, before: dict[str, int]) -> dict[str, str]:
        """This replica's proxies whose key `listing` (of PROXIES) does not
        hold under `lease`, but for those written since `before` (what
        _written was as the read began: not by revision, which goes back
        with a restored etcd) and those whose name another session holds
        (drop_superseded's to judge): session id -> proxy name."""
        keys = {kv.key[len(PROXIES) :]: kv for kv in listing.items}
        missing = {}
        for session_id, record in list(self.sessions.items()):
            if session_id not in before or before[session_id] != self._written.get(session_id):
                continue  # written during the read
            kv = keys.get(record.name)
            if kv is not None and kv.lease == lease:
                continue
            holder = None if kv is None else record_of(kv)
            if holder is not None and holder.session_id != session_id:
                continue
            missing[session_id] = record.name
        return missing

    def _write_missing(
        self, missing: Mapping[str, str], lease: int, *, own_missing: bool = False
    ) -> None:
        """Say what is missing from under `lease`, still the live one
        (`missing`: session id -> proxy name; `own_missing`: this replica's
        key), and have the keepalive write those keys again at once: only
        those, the others being there under the same lease. Those a rewrite
        due or under way is to write anyway are left to it; the others are
        added to what is due (a key found missing while a rewrite of others
        ran had been forgotten until the next self-check)."""
        missing = {sid: name for sid, name in missing.items() if not self._to_rewrite(sid)}
        own_missing = own_missing and not self._rewrite_due  # a rewrite writes it first
        if not (missing or own_missing) or lease != self._lease:
            return
        said = [f"replica {self.replica_id}"] if own_missing else []
        said += [f"proxy {name}" for name in missing.values()]
        log.warning(
            "%s not in the state store under this replica's lease %x; writing them again",
            ", ".join(said),
            lease,
        )
        self._ask_rewrite(set(missing))
        self._lease_suspect.set()

    def _to_rewrite(self, session_id: str) -> bool:
        """Whether a rewrite due, or the one under way, is to write
        `session_id`'s key (not yet written by the one under way)."""
        if session_id in self._rewrite_taken:
            return True
        return self._rewrite_due and (
            self._rewrite_only is None or session_id in self._rewrite_only
        )

    def _ask_rewrite(self, only: set[str] | None) -> None:
        """Have a rewrite write this replica's key and those of sessions
        `only` (None: every session's) again, with whatever is due already;
        a rewrite under way leaves them due when it ends (they may come
        after its writes)."""
        if only is None or (self._rewrite_due and self._rewrite_only is None):
            self._rewrite_only = None
        elif self._rewrite_due and self._rewrite_only is not None:
            self._rewrite_only |= only
        else:
            self._rewrite_only = set(only)
        self._rewrite_due = True
        self._rewrite_asked += 1
        self._asked.set()

    async def _rewrite_then_back_off(self) -> None:
        """The keepalive's rewrite task: _rewrite, and after a failure its
        back-off (REWRITE_RETRY_MIN, doubled per failure up to
        REWRITE_RETRY_MAX, never past a beat; cut short by a new ask); then
        wake the keepalive if a rewrite is still due, which starts it. (A
        failed rewrite had been tried again at the keepalive's next beat
        only, whatever the back-off said.)"""
        delay = min(self._retry_in, self._beat())
        if not await self._rewrite() and self._rewrite_asked == self._rewrite_took:
            self._asked.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._asked.wait()
        if self._rewrite_due:
            self._lease_suspect.set()

    async def _rewrite(self) -> bool:
        """Write this replica's key and every session's under the lease
        (granted if there is none), or only the sessions found missing
        under the live lease (_rewrite_only), REWRITE_CONCURRENCY keys at
        once; on failure, have it tried again later (False). Run by the
        keepalive as a task of its own, one at a time. A rewrite asked for
        while it ran is left due (_ask_rewrite)."""
        lease = 0
        only: set[str] | None = set()  # nothing taken yet: nothing to give back
        self._rewrite_took = self._rewrite_asked  # a failed grant backs off too
        try:
            lease = await self._ensure_lease()
            # Taken after a grant, which asks for every key.
            only, self._rewrite_only = self._rewrite_only, set()
            self._rewrite_took = self._rewrite_asked
            await self._put_announcement(lease)
            records = [r for sid, r in list(self.sessions.items()) if only is None or sid in only]
            records = await self._not_departed(records)
            await self._restore_all(records, lease)
        except LeaseExpired as exc:
            self._rewrite_failed(exc, only)
            if self._lease == lease:  # not one granted since (by a flush)
                self._lease = 0
            return False
        except (Unavailable, StoreUnavailable) as exc:
            # The lease stays: the keepalive's refresh says if it went too.
            self._rewrite_failed(exc, only)
            return False
        except Exception as exc:
            # Not a store failure (a bug, a key that does not decode): the
            # keys must still be written, so it is tried again as well.
            self._rewrite_failed(exc, only)
            return False
        if lease != self._lease:
            return True  # lost during the writes: the next lease's rewrite is due
        if self._rewrite_asked == self._rewrite_took:
            self._rewrite_due = False
            self._rewrite_only = None
        self._retry_in = REWRITE_RETRY_MIN
        self._acks_dirty = True
        self._traffic_dirty = True
        self._store_failing = False
        self._say_rewritten(lease, only, len(records))
        return True

    def _say_rewritten(self, lease: int, only: set[str] | None, written: int) -> None:
        """Log a rewrite done under `lease`: of `written` sessions' keys,
        `only` those when not None."""
        if self._announcement is not None and not self._announced:
            self._announced = True  # its first announcement, after a failed one
            log.info("replica %s announced under lease %x", self.replica_id, lease)
        elif only is not None and not written:
            # Its own key only: "0 missing proxy keys" had been said.
            log.info("replica %s wrote its key again under lease %x", self.replica_id, lease)
        elif only is not None:
            log.info(
                "replica %s wrote %d missing proxy keys again under lease %x",
                self.replica_id,
                written,
                lease,
            )
        else:
            log.info(
                "replica %s and its %d proxies registered again under lease %x",
                self.replica_id,
                len(self.sessions),
                lease,
            )

    async def _not_departed(self, records: list[ProxyRecord]) -> list[ProxyRecord]:
        """`records` but those of processes that deregistered (through any
        replica) while their keys were away with the lease, whose sessions
        are dropped: not written back."""
        if not records:
            return records
        departures = await self._catalog.departures()
        kept = []
        for record in records:
            departure = departures.get(record.name)
            if departure is not None and departure.of(record):
                log.info("proxy %s deregistered (session %s)", record.name, record.session_id)
                self._forget(record.session_id)
            elif record.session_id in self.sessions:
                kept.append(record)
        return kept

    async def _restore_all(self, records: list[ProxyRecord], lease: int) -> None:
        """Write `records`' keys again under `lease`, REWRITE_CONCURRENCY at
        once; the first failure is raised once the writes under way are done,
        and none is started after it (with the lease lost, every key still
        queued had been written under it, each a LeaseExpired)."""
        gate = asyncio.Semaphore(REWRITE_CONCURRENCY)
        failed: list[Exception] = []
        self._rewrite_taken = {r.session_id for r in records}

        async def one(record: ProxyRecord) -> None:
            async with gate:
                if failed or lease != self._lease:  # else the next lease's rewrite is due
                    return
                try:
                    await self._restore(record, lease)
                except Exception as exc:
                    failed.append(exc)
                finally:
                    self._rewrite_taken.discard(record.session_id)

        try:
            await asyncio.gather(*(one(r) for r in records))
        finally:
            self._rewrite_taken = set()
        if failed:
            raise failed[0]

    async def _restore(self, record: ProxyRecord, lease: int) -> None:
        """Write `record`'s key again under `lease` (a rewrite's, one key)."""
        written = await self._catalog.restore_proxy(record, lease)
        if record.session_id not in self.sessions:
            # Its stream ended (or a registration superseded it) during the
            # write, whose key its removal did not find.
            if written:
                await self._remove_key(record.name, record.session_id)
            return
        if written:
            self._written[record.session_id] = written
        else:
            # Its name registered anew (elsewhere) while the lease was lost:
            # that session is the proxy's now, and this one's stream ends
            # ABORTED.
            log.info("proxy %s registered again elsewhere meanwhile", record.name)
            self._forget(record.session_id)

    def _rewrite_failed(self, exc: Exception, only: set[str] | None) -> None:
        """A rewrite of sessions `only` (None: every one's) failed: due again,
        with whatever was asked for meanwhile."""
        self._rewrite_due = True
        if only is None or self._rewrite_only is None:
            self._rewrite_only = None
        else:
            self._rewrite_only |= only
        self._say_store_failing(
            f"re-registration failed, retried every {REWRITE_RETRY_MAX:g} s at most "
            "until it works: %s",
            exc if isinstance(exc, StoreError | Unavailable) else repr(exc),
        )
        self._retry_in = min(self._retry_in * 2, REWRITE_RETRY_MAX)

    def _say_store_failing(self, message: str, exc: object) -> None:
        """The lease's failures, at WARNING the first time, then at DEBUG
        until it works again (trial 18: one every 3.3 s for as long as etcd
        was away)."""
        (log.debug if self._store_failing else log.warning)(message, exc)
        self._store_failing = True

    async def close(self) -> None:
        if self._lease:
            with contextlib.suppress(StoreUnavailable):
                await self._catalog.store.revoke_lease(self._lease)
            self._lease = 0


def _changes(ejections: Ejections) -> dict[str, tuple[int, str]]:
    """What makes a change of reported ejections worth a write: an origin's
    count and last failure (their times move with every report)."""
    return {origin: (e[1], e[2]) for origin, e in ejections.items()}
