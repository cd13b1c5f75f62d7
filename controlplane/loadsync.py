"""Moving origins' live load from their vLLM metrics to every proxy.

    leader (LoadScraper) every --load-interval-ms (default 0.5 s): GET the
      metrics page of every healthy, undrained origin of the current table,
      concurrently, and write /ponto/load, fenced by its leadership
    every replica watches /ponto/load (LoadHub.watch) and pushes each
      connected proxy RouteUpdate(loads=OriginLoads(...)): the same bytes,
      serialised once per change, to every stream

The load key lives outside /ponto/state/, so load never rebuilds a route
table: proxies place requests inside regions by these figures and spill
between regions by them (dataplane.routes, Routes.spilled), and operators
read them (the status page, ListOrigins).

Freshness. The leader writes when the rounded figures change, or when the
last write is `load_refresh` (default 2 s) old although nothing changed. So:

- while the leader scrapes, what a proxy holds matches the origins as of at
  most one scrape interval plus the scrape and push time ago;
- ``scraped_at`` is when the round that wrote the figures began, so a proxy's
  age (now - scraped_at) may reach `load_refresh` on a quiet fleet and stays
  below about refresh + interval + timeout while the leader works: an age
  beyond that means no leader is scraping (or the figures cannot reach this
  proxy), and the figures should be trusted less.

The generation of a push is the key's store revision: it increases across
leaders, so a proxy ignores a lagging replica's older view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp

from controlplane.distribute import Publisher
from controlplane.health import ProbeSettings, root_of
from controlplane.load import Figures, Sample, decode_loads, encode_loads, figures, parse_page
from controlplane.rounds import Defects
from controlplane.store import Conflict, Fence, StateStore, StoreUnavailable
from controlplane.store.base import follow
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)

LOAD_KEY = "/ponto/load"

# A failing scrape's first round is logged per origin at most this often: a
# flapping origin cannot flood the log (nor can a fleet of them: one line a round).
UNREAD_LOG_QUIET = 60.0
# The most origins one such line names.
UNREAD_LOG_NAMES = 10


@dataclass(frozen=True, slots=True)
class Unread:
    """A metrics page not had: why (`HTTP 500`, `timed out`, ...)."""

    reason: str


# url -> the page's text, or why it cannot be had in time.
Fetch = Callable[[str], Awaitable[str | Unread]]


# Replicas' clocks differ by milliseconds under NTP; a second covers a
# worse-kept one and an etcd write under load without showing live figures
# as gone.
CLOCK_SLACK: Final = 1.0


def stale_after(settings: ProbeSettings) -> float:
    """The age of the load key's figures (now - scraped_at) beyond which no
    leader is scraping: a working leader writes at least every refresh,
    each round starting an interval after the last and lasting at most the
    timeout (see Freshness above), and CLOCK_SLACK more: `scraped_at` is the
    leader's wall clock, the age is read on the replica serving the request,
    and the write reaches it through etcd."""
    return settings.load_refresh + settings.load_interval + settings.timeout + CLOCK_SLACK


def targets(table: pb.RouteTable) -> list[tuple[str, str]]:
    """(origin, scheme://host:port) of the origins worth scraping: healthy,
    not drained, not in a drained region (proxies send them nothing), and
    probed (probing off is for origins the control plane cannot call without
    a key, such as hosted APIs, which publish no vLLM gauges either)."""
    drained_regions = {r.name for r in table.regions if r.drained}
    return [
        (o.name, root_of(o.base_url))
        for o in table.origins
        if o.healthy and not o.not_probed and not o.drained and o.region not in drained_regions
    ]


class LoadScraper:
    """Leader only: scrapes origins' load every interval and writes the load key.

    Runs as one task (`run`) while this replica leads; it returns when a write
    finds leadership lost. Origins come from the latest compiled table (in
    memory), not from a store read per round. An origin whose scrape fails or
    whose page has no request gauges is left out of that round; health is the
    prober's business, not this loop's.
    """

    def __init__(
        self,
        store: StateStore,
        publisher: Publisher,
        settings: ProbeSettings,
        *,
        fence: Callable[[], Fence | None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._settings = settings
        self._fence = fence
        self._defects = Defects(log, "origin load rounds")
        self._clock = clock
        self._previous: dict[str, Sample] = {}
        self._written: dict[str, Figures] | None = None
        self._written_at = 0.0
        # When each origin's figures were last read, this term: an origin
        # whose page stops answering (or stops saying its load) goes on being
        # routed by the proxies' own counts alone, unseen but for `ages`.
        self._read_at: dict[str, float] = {}
        # The origins scraped in the latest round (healthy, undrained).
        self._wanted: frozenset[str] = frozenset()
        # Origins read this term whose scrape fails now (origin -> why), those
        # of them whose failure was logged, and when each failure was last
        # logged (UNREAD_LOG_QUIET). Kept while the origin is in the table,
        # scraped or not: one that turns unhealthy or is drained after its
        # warning still gets its line when read again.
        self._unread: dict[str, str] = {}
        self._logged: set[str] = set()
        self._logged_at: dict[str, float] = {}
        self.rounds = 0
        self.writes = 0

    def ages(self) -> Mapping[str, float]:
        """Seconds since each origin the scraper reads now (healthy,
        undrained) last gave its figures in this leader's term; origins it
        has not read since the term began are left out (ponto_control_origin_
        load_age_seconds, the PontoOriginLoadsStale alert)."""
        now = self._clock()
        return {o: now - at for o, at in self._read_at.items() if o in self._wanted}

    async def run(self) -> None:
        if not self._settings.metrics_path:
            log.info("origin loads are not scraped: no metrics path")
            return
        # A new term starts afresh: another leader may have written since.
        self._previous, self._written, self._read_at = {}, None, {}
        self._unread, self._logged = {}, set()
        # A scrape slower than the interval is too late to be of use, and
        # must not hold up the next round.
        timeout = aiohttp.ClientTimeout(
            total=min(self._settings.timeout, self._settings.load_interval)
        )
        # No connection limit: a round opens one request per origin at once,
        # and aiohttp's default of 100 would queue the rest into timeouts.
        connector = self._settings.connector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            loop = asyncio.get_running_loop()
            while True:
                started = loop.time()
                try:
                    await self.round(lambda url: _fetch(session, url))
                except StoreUnavailable as exc:
                    log.warning("origin loads not written: %s", exc)
                except Conflict:
                    log.warning("origin loads not written: no longer the leader")
                    return
                except Exception as exc:
                    self._defects.failed(exc)
                else:
                    self._defects.passed()
                elapsed = loop.time() - started
                await asyncio.sleep(max(0.0, self._settings.load_interval - elapsed))

    async def round(self, fetch: Fetch) -> None:
        """Scrape every target once with `fetch` and write the key if due.

        Raises StoreUnavailable, or Conflict once leadership is lost.
        """
        latest = self._publisher.latest
        if latest is None:
            return
        wanted = targets(latest.table)
        path = self._settings.metrics_path
        scraped_at = self._clock()
        pages = await asyncio.gather(*(fetch(root + path) for _, root in wanted))
        names = frozenset(name for name, _ in wanted)
        for gone in set(self._previous) - names:
            del self._previous[gone]
        known = {o.name for o in latest.table.origins}
        for gone in set(self._unread) - known:
            del self._unread[gone]
            self._logged.discard(gone)
        for gone in (set(self._logged_at) | set(self._read_at)) - known:
            self._logged_at.pop(gone, None)
            self._read_at.pop(gone, None)
        loads: dict[str, Figures] = {}
        stopped: list[str] = []
        recovered: list[str] = []
        for (name, _), page in zip(wanted, pages, strict=True):
            sample = parse_page(page) if isinstance(page, str) else None
            if sample is None or not sample.has_requests:
                why = "no request gauges on the page" if sample is not None else _reason(page)
                if name in self._read_at:
                    self._unread[name] = why
                    # A failure held back by the quiet period is logged once
                    # it is over if the page still fails: the last line about
                    # an origin must not be "read again" while it is not.
                    if (
                        name not in self._logged
                        and scraped_at - self._logged_at.get(name, -UNREAD_LOG_QUIET)
                        >= UNREAD_LOG_QUIET
                    ):
                        self._logged_at[name] = scraped_at
                        self._logged.add(name)
                        stopped.append(f"{name} ({why})")
                continue
            if self._unread.pop(name, None) is not None and name in self._logged:
                self._logged.discard(name)
                recovered.append(name)
            loads[name] = figures(sample, self._previous.get(name))
            self._previous[name] = sample
            self._read_at[name] = scraped_at
        if stopped:
            log.warning(
                "origin load metrics no longer read, routing by the proxies' own counts: %s",
                _some(stopped),
            )
        if recovered:
            log.info("origin load metrics read again: %s", _some(recovered))
        self._wanted = names
        self.rounds += 1
        if loads == self._written and scraped_at - self._written_at < self._settings.load_refresh:
            return
        await self._store.put(LOAD_KEY, encode_loads(loads, scraped_at), fence=self._fence())
        self._written = loads
        self._written_at = scraped_at
        self.writes += 1


def _reason(page: str | Unread) -> str:
    return page.reason if isinstance(page, Unread) else "unparsable"


def _some(items: list[str]) -> str:
    """The first UNREAD_LOG_NAMES items, and how many more."""
    shown = ", ".join(items[:UNREAD_LOG_NAMES])
    more = len(items) - UNREAD_LOG_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


async def _fetch(session: aiohttp.ClientSession, url: str) -> str | Unread:
    """The page at url, or why it cannot be had (in time)."""
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return Unread(f"HTTP {resp.status}")
            return (await resp.read()).decode("utf-8", "replace")
    except TimeoutError:
        return Unread("timed out")
    except aiohttp.ClientError as exc:
        return Unread(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class LoadHub:
    """One per replica: the leader's latest loads, ready to send.

    Single event loop. `watch` runs as the replica's task; `next_after` is
    awaited by every stream writer. The payload is serialised once per change
    and shared; a stream that was busy sends only the newest.
    """

    def __init__(
        self,
        store: StateStore,
        *,
        max_age: float = float("inf"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`max_age` (stale_after) bounds the age of the figures `fresh` gives,
        by `clock` (wall time, as the leader's scraped_at)."""
        self._store = store
        self._max_age = max_age
        self._clock = clock
        self.generation = 0
        self.payload = b""
        self.loads: pb.OriginLoads | None = None
        self._changed = asyncio.Event()

    def fresh(self) -> pb.OriginLoads | None:
        """The latest loads if a leader is still scraping, else None (as
        before any scrape): what pontoctl and the status page show. Figures
        frozen since the leader went away would pass for live. (Streams get
        `loads` whatever their age: proxies judge it themselves.)"""
        loads = self.loads
        if loads is None or self._clock() - loads.scraped_at > self._max_age:
            return None
        return loads

    async def watch(self) -> None:
        """Follow the load key; wake the streams on every change."""
        await follow(self._store, LOAD_KEY, self._load)

    async def _load(self) -> int:
        """Read the key; return the store revision read at (0 if unread)."""
        try:
            listing = await self._store.list(LOAD_KEY)
        except StoreUnavailable as exc:
            log.debug("origin loads not read: %s", exc)
            return 0
        kv = next((i for i in listing.items if i.key == LOAD_KEY), None)
        if kv is None or kv.mod_revision <= self.generation:
            return listing.revision
        try:
            loads = decode_loads(kv.value, kv.mod_revision)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            log.error("ignoring undecodable origin loads: %s", exc)
            return listing.revision
        self.loads = loads
        self.payload = pb.RouteUpdate(loads=loads).SerializeToString()
        self.generation = kv.mod_revision
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return listing.revision

    async def next_after(self, sent_generation: int) -> tuple[int, bytes]:
        """Wait for loads newer than sent_generation; return (generation, payload)."""
        while self.generation in (0, sent_generation):
            await self._changed.wait()
        return self.generation, self.payload
