"""Live load of origins as this proxy sees it: the leader's last scrape plus
this proxy's own requests since.

The control plane pushes every origin's vLLM gauges (running and waiting
requests) about twice a second. Between pushes, and for origins that export no
gauges, the proxy knows what it added itself: every request it has in flight
to an origin. The estimate is the scraped figure plus the change in this
proxy's own outstanding count since that scrape arrived, never less than the
own count: a request this proxy just sent shows at once, without double
counting the ones the scrape already saw.

Single event loop; no locks. Reads are O(1) dict lookups on the hot path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from dataplane.placement.speed import SpeedBoard
from ponto.v1 import routing_pb2 as pb

# The leader pushes at least every 2 s (--load-refresh-ms) while it scrapes.
STALE_AFTER_S = 10.0


class LoadBoard:
    """Per-origin load estimates for the scorer; one per proxy process."""

    def __init__(
        self, clock: Callable[[], float] = time.time, speeds: SpeedBoard | None = None
    ) -> None:
        self._clock = clock
        # How slow each origin serves now: fed by the forwarder beside the
        # counts, read by the picker with them.
        self.speeds = speeds if speeds is not None else SpeedBoard()
        # The pushed figures as they came (kv_cache_usage and
        # prefix_hit_rate are -1 when unknown).
        self._scraped: dict[str, pb.OriginLoad] = {}
        self._base: dict[str, float] = {}  # scraped running + waiting
        self._own: dict[str, int] = {}  # this proxy's requests in flight
        self._own_at_scrape: dict[str, int] = {}
        self.generation = 0
        self.scraped_at = 0.0
        self._expiry: asyncio.TimerHandle | None = None
        # Called once the scraped figures changed (a push taken, or their
        # expiry): the table holder's spilling (TableHolder.loads_changed).
        self.on_change: list[Callable[[], None]] = []

    # ------------------------------------------------------------ updates

    def apply(self, loads: pb.OriginLoads) -> bool:
        """Take a pushed scrape; False (and nothing changes) if it is not newer
        than the one held (a replica resends its current one on every new
        stream: taking it again would forget the requests sent since).

        Scraped figures are dropped STALE_AFTER_S after they arrive unless a
        newer scrape replaces them: without a leader scraping, the proxy goes
        by its own requests alone rather than by a replica's old queue.
        """
        if loads.generation and loads.generation <= self.generation:
            return False
        self.generation = loads.generation
        self.scraped_at = loads.scraped_at
        self._scraped = {o.origin: o for o in loads.loads}
        self._base = {name: s.running + s.waiting for name, s in self._scraped.items()}
        self._own_at_scrape = dict(self._own)
        self._expire_later()
        self._changed()
        return True

    def expire(self) -> None:
        """Forget the scraped figures (they are too old to go by)."""
        self._scraped = {}
        self._base = {}
        self._own_at_scrape = {}
        self._changed()

    def _changed(self) -> None:
        for hook in self.on_change:
            hook()

    def _expire_later(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # applied outside a loop (a test): nothing to schedule
            return
        self._expiry = loop.call_later(STALE_AFTER_S, self.expire)

    def started(self, origin: str) -> None:
        """This proxy sent a request to origin."""
        self._own[origin] = self._own.get(origin, 0) + 1

    def finished(self, origin: str) -> None:
        """A request started with `started` ended (answered, failed or cut)."""
        left = self._own.get(origin, 0) - 1
        if left > 0:
            self._own[origin] = left
        else:
            self._own.pop(origin, None)

    # ------------------------------------------------------------ reads

    def load(self, origin: str) -> float:
        """Requests the origin is running or queueing, as best known now."""
        own = self._own.get(origin, 0)
        base = self._base.get(origin)
        if base is None:
            return float(own)
        return max(float(own), base + own - self._own_at_scrape.get(origin, 0))

    def scraped_load(self, origin: str) -> float | None:
        """The origin's running and waiting requests as the latest push gave
        them, without this proxy's own since; None when it lacks them (not
        scraped, or the figures expired). What spilling reads (routes.Scraped):
        every proxy holds the same, so every proxy spills alike."""
        return self._base.get(origin)

    def outstanding(self, origin: str) -> int:
        """This proxy's own requests in flight to origin."""
        return self._own.get(origin, 0)

    def scraped(self, origin: str) -> pb.OriginLoad | None:
        return self._scraped.get(origin)

    def age(self) -> float:
        """Seconds since the scrape held was taken; inf before the first."""
        return self._clock() - self.scraped_at if self.scraped_at else float("inf")

    def origins(self) -> Iterable[str]:
        return self._scraped.keys()
