"""Keeps the published route table in step with the store.

Watches the state prefix; after a change waits for a quiet period (more changes
restart it) but never longer than max_delay since the first unhandled change,
then re-reads the whole state at one revision, compiles and publishes. When the
store is unreachable the last published table stays (static stability) and the
builder retries with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from controlplane.catalog import STATE_PREFIX, Catalog
from controlplane.compile import compile_table
from controlplane.distribute import Publisher
from controlplane.errors import Unavailable
from controlplane.fleetid import FleetWatch
from controlplane.store import StoreUnavailable
from controlplane.suspensions import Suspensions, of_state

log = logging.getLogger(__name__)


class TableBuilder:
    def __init__(
        self,
        catalog: Catalog,
        publisher: Publisher,
        *,
        quiet: float = 0.05,
        max_delay: float = 0.5,
        retry_max: float = 2.0,
        behind: Callable[[int], Awaitable[bool]] | None = None,
        fleet: FleetWatch | None = None,
    ) -> None:
        """`behind(version)` is told when the state read is numbered below
        `version`, the table this replica published last: the store's
        revision went back (etcd restored, or its data lost) and was not
        renumbered yet. It renumbers above `version` (RebasedStore's
        ensure_above), which wakes this builder again."""
        self._catalog = catalog
        self._publisher = publisher
        self._quiet = quiet
        self._max_delay = max_delay
        self._retry_max = retry_max
        self._behind = behind
        self.fleet = fleet if fleet is not None else FleetWatch()
        self._dirty = asyncio.Event()
        # The revision the last build read the state at: the watch starts
        # there (see _watch), set once a build has read.
        self._read_at = 0
        self._read = asyncio.Event()
        self.store_ok = False
        self.builds = 0
        # What is suspended in the state of the table last compiled (None
        # before the first), for the status page; replaced whole by each
        # build, reasons changed alone included (the table has no reasons,
        # so such a change publishes nothing).
        self.suspensions: Suspensions | None = None

    def wake(self) -> None:
        """Build again soon (debounced), as a change of the state does."""
        self._dirty.set()

    async def build_once(self) -> bool:
        """Read, compile, publish; return whether a new snapshot was published."""
        state = await self._catalog.snapshot()
        if not state.response_id_keys or not state.response_id_owners_from or not state.fleet_id:
            # The first table of a fleet (or of one older than the keys, or
            # than ids signed for tenants' records, or than fleet ids; or of
            # an etcd that lost its data): each is made once, and read back
            # as every replica reads it.
            if not state.response_id_keys:
                await self._catalog.ensure_response_id_key()
            if not state.response_id_owners_from:
                await self._catalog.ensure_response_id_owners()
            state = await self._catalog.snapshot()
            # After the keys: the id is derived from them (Catalog.ensure_fleet_id).
            if not state.fleet_id and not state.fleet_id_invalid:
                if made := await self._catalog.ensure_fleet_id(state.response_id_keys):
                    latest = self._publisher.latest
                    self.fleet.made(made, latest.table.fleet_id if latest is not None else "")
                state = await self._catalog.snapshot()
        self._read_at = state.revision
        self._read.set()
        self.builds += 1
        self.fleet.stored(state.fleet_id_invalid)
        latest = self._publisher.latest
        if latest is not None and state.revision < latest.version and self._behind is not None:
            # Every proxy would refuse it as older, and the publisher drops
            # it; nothing else numbers the state above it again when the
            # replica's watches did not see etcd go back (a restore a few
            # writes old) or their raise failed (review of 21fde0b: the
            # operator's changes after a restore never reached a proxy).
            below = (
                f"the state read is numbered {state.revision}, below the table "
                f"published last ({latest.version}): etcd went back"
            )
            try:
                raised = await self._behind(latest.version)
            except StoreUnavailable as exc:
                raise Unavailable(f"{below}; not numbered above it yet: {exc}") from exc
            if not raised:
                # etcd passed the old numbers meanwhile, or the raise was
                # refused: built again after the back-off, which reads anew
                # (review: nothing woke the builder, and the change waited
                # for the next write of the state).
                raise Unavailable(f"{below}; not numbered above it yet")
            # The raise wakes this builder (ControlPlane._renumbered).
            log.warning("%s; numbered above it now", below)
            return False
        # In a worker thread: at 20,000 keys compiling took 0.8 s, which on
        # the event loop held the election's keep-alives, the proxies'
        # streams and every probe meanwhile (trial 83). The state is not
        # shared with anything that changes it.
        table = await asyncio.to_thread(compile_table, state)
        if table.auth_required and not state.auth_ever:
            # Its write wakes the builders; the table they compile is the same.
            await self._catalog.mark_auth_required()
        self.suspensions = of_state(state)
        snap = self._publisher.publish(table)
        if snap is not None:
            self.fleet.published(table.fleet_id)
            log.info("route table version %d (etag %s…) published", snap.version, snap.etag[:12])
        return snap is not None

    async def run(self) -> None:
        """Run until cancelled."""
        watcher = asyncio.create_task(self._watch())
        try:
            await self._loop()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _loop(self) -> None:
        backoff = 0.1
        failing = False  # the last build failed on the store
        self._dirty.set()
        while True:
            await self._dirty.wait()
            await self._debounce()  # returns with _dirty cleared
            try:
                await self.build_once()
                if failing:
                    failing = False
                    log.info("route table built again: the state store answers")
                self.store_ok = True
                backoff = 0.1
            except Unavailable as exc:
                # Said once at WARNING, then at DEBUG until a build works
                # (trial 18: 64 warnings in 3.5 minutes of an etcd away).
                say = log.debug if failing else log.warning
                failing = True
                self.store_ok = False
                if self._publisher.latest is None:
                    say(
                        "cannot build the route table yet (proxies get none from this "
                        "replica until it can): %s",
                        exc,
                    )
                else:
                    say("cannot rebuild route table, serving the last one: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._retry_max)
                self._dirty.set()
            except Exception:  # a state that cannot compile must not stop publishing
                log.exception("cannot compile the route table, serving the last one")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._retry_max)
                if not self._read.is_set():
                    # No watch is made before a build has read the state
                    # (_watch), so no change would wake this builder (review:
                    # a hand-edited key that failed the first read stopped
                    # it for good): built again after the back-off.
                    self._dirty.set()

    async def _debounce(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._max_delay
        while True:
            self._dirty.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                # Not wait_for, which in 3.11 may let a cancellation go.
                async with asyncio.timeout(min(self._quiet, remaining)):
                    await self._dirty.wait()
            except TimeoutError:
                return

    async def _watch(self) -> None:
        # From the revision the first build read, not "from now": a watch
        # made after that read (etcd not yet serving, as a replica started
        # with its members waits for their first election) would miss what
        # was written between, and nothing else rebuilds the table (a clean
        # -clone run: a proxy kept a table without the origin configured
        # meanwhile). etcd replays what came after; what was compacted
        # away is a re-read (the store's watch says so).
        await self._read.wait()
        revision = self._read_at
        while True:
            try:
                stream: AsyncIterator[int] = self._catalog.store.watch(STATE_PREFIX, revision)
                async for rev in stream:
                    revision = rev
                    self._dirty.set()
            except Exception:  # the watch must never die silently
                log.exception("state watch failed; restarting")
                await asyncio.sleep(0.5)
