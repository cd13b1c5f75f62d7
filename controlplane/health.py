"""Active health checks and load scraping of origins (leader only).

Each origin is probed every interval at its probe path (its own, else the
fleet's --probe-path; resolved against the origin's scheme://host:port, so
vLLM's /health works) and its Prometheus metrics are read for its server's
kind and load (controlplane.load: vLLM, SGLang, llama.cpp, TGI). An origin
with probing off is never called: the table counts it healthy
(controlplane.compile) and the proxies' passive health judges it. Health
changes after `rise` consecutive successes or `fall` consecutive failures.
Results are written to the store only when they change what proxies would do
or operators read (health, its reason, the server's kind, whether its load
figures are read), so probing does not churn route tables. A move of load
alone is never written: each write rebuilds and pushes the table, and an
origin of capacity 4 moves by a tenth of it with every request. The load that
proxies place requests and spill regions by, and that operators read, is
scraped apart, more often, and pushed outside tables (controlplane.loadsync).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp

from controlplane.catalog import HEALTH, ORIGINS, Catalog
from controlplane.errors import Unavailable
from controlplane.load import Sample, parse_page
from controlplane.metrics import ControlMetrics
from controlplane.model import Origin, OriginHealth
from controlplane.rounds import Defects
from controlplane.store import Conflict, Fence

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    interval: float = 1.0
    timeout: float = 1.0
    path: str = "/health"
    metrics_path: str = "/metrics"
    rise: int = 2
    fall: int = 2
    # The load scraper's own cadence (controlplane.loadsync), apart from the
    # health probes: how often load is scraped, and how long the load key may
    # go unwritten while nothing changes (proxies tell stale figures by age).
    load_interval: float = 0.5
    load_refresh: float = 2.0
    # A CA bundle trusted for https origins besides the system's
    # (ponto.originca), and the context made of it when the flags were read:
    # read once, not at every leadership term (a file gone meanwhile would end
    # each term as it began).
    origin_ca: str = ""
    origin_ssl: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    def connector(self, **kwargs: Any) -> aiohttp.TCPConnector:
        """A connector to origins, trusting origin_ssl too. On the running loop."""
        context = self.origin_ssl
        return aiohttp.TCPConnector(ssl=context if context is not None else True, **kwargs)


@dataclass
class _Track:
    healthy: bool = True
    successes: int = 0
    failures: int = 0
    written: OriginHealth | None = None
    detail: str = ""
    # Metrics pages refused in a row (a non-200): one alone keeps the last
    # figures (review: each lost page flipped the load to unknown and back,
    # two tables and a spill each way).
    pages_refused: int = 0


def parse_load(text: str) -> float | None:
    """Running plus waiting requests over all label sets, of whichever server
    the page is of; None if it says neither (controlplane.load.parse_page)."""
    return _inflight(parse_page(text))


def _inflight(sample: Sample) -> float | None:
    if not sample.has_requests:
        return None
    return (sample.running or 0.0) + (sample.waiting or 0.0)


def _load_fields(page: str | None, written: OriginHealth | None) -> tuple[float, str, bool]:
    """(inflight, server_kind, inflight_unknown) of a metrics page as read
    (see Prober._probe): those last written while it is untold."""
    if page is None:
        if written is None:
            return 0.0, "", True
        return written.inflight, written.server_kind, written.inflight_unknown
    if not page:
        return 0.0, "", True
    sample = parse_page(page)
    load = _inflight(sample)
    return load or 0.0, sample.kind, load is None


def root_of(base_url: str) -> str:
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"


# Statuses that show an origin's server up but the probe unauthorised: the
# probe carries no key (the control plane never holds origin credentials),
# so from an origin the proxies send one to they say nothing of its health.
UNAUTHORISED = frozenset({401, 403})
# Statuses that say the path is wrong for the server, not that it is down.
NO_SUCH_PATH = frozenset({404, 405})


def verdict(status: int, path: str, has_credential: bool) -> tuple[bool, str]:
    """Pure: (passed, detail) of a probe of `path` answered `status`.

    A pass may carry a detail too: a 401/403 from an origin with a credential
    passes (its server answered; the proxies' requests carry the key, which
    the probe cannot), and the detail says it was not a health check. A
    failure's detail names the fix where the status points at one."""
    answered = f"probe answered {status} at {path}"
    if 300 <= status < 400:
        # Not followed (review: a redirect took the probe, and the metrics
        # page, to another host, which passed for the origin): the proxies
        # do not follow one either.
        return False, f"{answered}, a redirect: the origin's probe path or URL is wrong"
    if status < 400:
        return True, ""
    if status in UNAUTHORISED and has_credential:
        return True, f"{answered}: up; the probe carries no key, the proxies' requests do"
    if status in UNAUTHORISED:
        return False, (
            f"{answered}: the origin wants a key; give it a credential (pontoctl origin add "
            "--update --credential-env or --credential-file), a probe path it answers "
            "without one (--probe-path), or turn probing off (--probe off)"
        )
    if status in NO_SUCH_PATH:
        return False, (
            f"{answered}: set the origin's probe path (pontoctl origin add --update "
            "--probe-path, e.g. / or /api/version for Ollama, /health/liveliness for "
            "LiteLLM) or turn probing off (--probe off)"
        )
    return False, answered


def judge(track: _Track, ok: bool, detail: str, settings: ProbeSettings) -> None:
    """Pure rise/fall hysteresis on one probe result. A passing probe's
    detail (see `verdict`) is kept while healthy; a failing one's always."""
    if ok:
        track.successes += 1
        track.failures = 0
        if not track.healthy and track.successes >= settings.rise:
            track.healthy = True
        if track.healthy:
            # A passing probe also clears a reason that never flipped health.
            track.detail = detail
    else:
        track.failures += 1
        track.successes = 0
        track.detail = detail
        if track.healthy and track.failures >= settings.fall:
            track.healthy = False


def health_line(health: OriginHealth, fall: int, *, passed: bool = False) -> str:
    """The log line of an origin's health as first written or flipped (by a
    probe that `passed` or not). A new origin starts healthy: a first probe
    that failed has not made it unhealthy."""
    name = health.origin
    if not health.healthy:
        why = f" ({health.detail})" if health.detail else ""
        return f"origin {name} is unhealthy{why}"
    if health.detail and passed:  # what the pass proved (see `verdict`)
        return f"origin {name} is healthy ({health.detail})"
    if health.detail:
        return (
            f"origin {name} is healthy until {fall} probes in a row fail"
            f" (the last: {health.detail})"
        )
    return f"origin {name} is healthy"


# Origins unhealthy as a term starts each logged on a line of their own, up
# to this many; one line says how many more (a fleet of 300 dead origins
# would flood the log with each new leader).
INHERITED_LINES = 10


def say_inherited(healths: list[OriginHealth], fall: int) -> None:
    """Log the origins a term starts with unhealthy (`healths`, as stored):
    flips alone are logged (_probe), so an origin that was failing when this
    leader took over would otherwise never be, for as long as it fails."""
    for h in healths[:INHERITED_LINES]:
        log.info("%s, as stored when this leader's term started", health_line(h, fall))
    if len(healths) > INHERITED_LINES:
        log.info(
            "and %d more origins unhealthy when this leader's term started "
            "(pontoctl get origins lists them)",
            len(healths) - INHERITED_LINES,
        )


# Probes started in one turn of the event loop; the next ones a turn later.
# Started all at once, 300 origins' probes (a connection made, refused and
# closed, a metric and a verdict each, most of it before the first await
# that waits) held the leader's loop 0.1 to 0.7 s every round on a busy
# machine (a fleet with 296 closed ports): its election, proxies and Admin
# API meanwhile unanswered. Each still starts within the round's first
# turns, so a slow origin's timeout does not delay the others.
PROBES_A_TURN = 16

# What a probe's result changes of the record last written (`change`).
UNCHANGED: Final = ""
AT_ONCE: Final = "at once"  # what proxies or operators must see now


def change(old: OriginHealth | None, new: OriginHealth, *, passed: bool = False) -> str:
    """What `new` changes of `old`, the last written: AT_ONCE for a first
    result, a flip of health, a new reason while unhealthy, a new detail of
    a probe that `passed` while healthy (a 401 with a credential, or an old
    first failure it clears), and while healthy a new server kind or load
    figures that come or go; else UNCHANGED. Not a move of load alone (the
    module's docstring), nor a failure that does not flip health: one lost
    probe would push two tables."""
    if old is None or old.healthy != new.healthy:
        return AT_ONCE
    if old.detail != new.detail and (passed or not new.healthy):
        return AT_ONCE
    if not new.healthy:
        return UNCHANGED
    if old.server_kind != new.server_kind or old.inflight_unknown != new.inflight_unknown:
        return AT_ONCE  # whether the origin counts for its region's load changed
    return UNCHANGED


class Prober:
    def __init__(
        self,
        catalog: Catalog,
        settings: ProbeSettings,
        *,
        may_write: Callable[[], bool] = lambda: True,
        fence: Callable[[], Fence | None] = lambda: None,
        metrics: ControlMetrics | None = None,
    ) -> None:
        self._catalog = catalog
        self._settings = settings
        self._metrics = metrics if metrics is not None else ControlMetrics()
        self._may_write = may_write
        self._fence = fence
        self._defects = Defects(log, "health rounds")
        self._tracks: dict[str, _Track] = {}
        self.rounds = 0

    async def run(self) -> None:
        """Probe every interval, for one leadership term (until cancelled).
        A term starts from what the store holds, not from what this process
        wrote in a term of its own before: another leader may have written
        since (review: an origin it wrote unhealthy stayed so in the table
        once it came back, this process finding it as it had last written it)."""
        self._tracks.clear()
        timeout = aiohttp.ClientTimeout(total=self._settings.timeout)
        connector = self._settings.connector()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                started = asyncio.get_running_loop().time()
                try:
                    await self.probe_all(session)
                except Unavailable as exc:
                    log.warning("health round skipped: %s", exc)
                except Exception as exc:
                    self._defects.failed(exc)
                else:
                    self._defects.passed()
                elapsed = asyncio.get_running_loop().time() - started
                await asyncio.sleep(max(0.0, self._settings.interval - elapsed))

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        # Not the whole state: at 20,000 keys that was 0.6 s of decoding a round.
        state = await self._catalog.read(ORIGINS, HEALTH)
        names = {o.name for o in state.origins}
        for gone in set(self._tracks) - names:
            del self._tracks[gone]
        # Health of origins no longer stored: written by a round that read
        # the origin before its deletion (delete_origin drops the record
        # first), it would stay for good, and a new origin of that name
        # would start from its verdict. Only this round's writes make such
        # records, so one read without the origin is enough.
        orphans = sorted(set(state.health) - names)
        if orphans and self._may_write():
            await self._delete_all(orphans)
        # Origins with probing off are not called, nor tracked, and a verdict
        # stored before is forgotten (the table ignores it meanwhile): turned
        # back on, one starts healthy, as a new origin does, not from a
        # failure of before.
        probed = [o for o in state.origins if o.probe]
        for off in (o for o in state.origins if not o.probe):
            self._tracks.pop(off.name, None)
            stored = state.health.get(off.name)
            # Its load and server too: no probe reads them now (review).
            said = stored is not None and (
                not stored.healthy
                or bool(stored.detail)
                or bool(stored.inflight)
                or bool(stored.server_kind)
            )
            if said and self._may_write():
                await self._write(
                    OriginHealth(
                        off.name, healthy=True, inflight_unknown=True, checked_at=time.time()
                    )
                )
        inherited = []
        for origin in probed:
            if origin.name not in self._tracks:
                stored = state.health.get(origin.name)
                self._tracks[origin.name] = _Track(
                    healthy=stored.healthy if stored else True, written=stored
                )
                if stored is not None and not stored.healthy:
                    inherited.append(stored)
        say_inherited(inherited, self._settings.fall)
        await asyncio.gather(*await self._started(session, probed))
        self.rounds += 1

    async def _started(
        self, session: aiohttp.ClientSession, origins: list[Origin]
    ) -> list[asyncio.Task[None]]:
        """A task probing each of `origins`, PROBES_A_TURN started a turn of
        the loop. If this is cancelled meanwhile, those started are too, and
        it ends once they have, as the gather of them does when cancelled:
        the session they use (the caller's, closed once the round ends) is
        not closed under requests still unwinding."""
        tasks: list[asyncio.Task[None]] = []
        try:
            for i, origin in enumerate(origins):
                if i and not i % PROBES_A_TURN:
                    await asyncio.sleep(0)
                tasks.append(asyncio.create_task(self._probe(session, origin)))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return tasks

    async def _probe(self, session: aiohttp.ClientSession, origin: Origin) -> None:
        """Probe `origin` and write what changed (`change`)."""
        track = self._tracks[origin.name]
        root = root_of(origin.base_url)
        path = origin.probe_path or self._settings.path
        ok, detail = False, ""
        # The metrics page as read: None while untold (not asked, or no
        # answer in time: the last figures stand); a refusal (404, or
        # llama.cpp's 501 without --metrics) reads as an empty page.
        page: str | None = "" if not self._settings.metrics_path else None
        try:
            async with session.get(root + path, allow_redirects=False) as resp:
                has_key = bool(origin.credential_env or origin.credential_file)
                ok, detail = verdict(resp.status, path, has_key)
                await resp.read()
            if ok and self._settings.metrics_path:
                try:
                    async with session.get(
                        root + self._settings.metrics_path, allow_redirects=False
                    ) as resp:
                        if resp.status == 200:
                            page, track.pages_refused = await resp.text(), 0
                        else:
                            track.pages_refused += 1
                            # Refused twice in a row: no load metrics there.
                            page = "" if track.pages_refused > 1 else None
                except (aiohttp.ClientError, TimeoutError):
                    pass  # no metrics is not a health failure
        except TimeoutError:
            detail = f"probe timed out after {self._settings.timeout}s"
        except aiohttp.ClientError as exc:
            detail = f"probe failed: {type(exc).__name__}"
        self._metrics.probed(origin.name, origin.region, ok=ok)
        judge(track, ok, detail, self._settings)
        inflight, kind, unknown = _load_fields(page, track.written)
        new = OriginHealth(
            origin=origin.name,
            healthy=track.healthy,
            inflight=inflight,
            detail=track.detail,
            checked_at=time.time(),
            server_kind=kind,
            inflight_unknown=unknown,
        )
        if change(track.written, new, passed=ok) == AT_ONCE and self._may_write():
            flipped = track.written is None or track.written.healthy != new.healthy
            if await self._write(new):
                track.written = new
                if flipped:
                    log.info("%s", health_line(new, self._settings.fall, passed=ok))

    async def _delete_all(self, origins: list[str]) -> None:
        """Delete the health records of `origins` (Catalog.delete_healths);
        logged when they could not be (tried again next round)."""
        what = f"the health of {len(origins)} deleted origins"
        try:
            await self._catalog.delete_healths(origins, fence=self._fence())
        except Unavailable as exc:
            log.warning("cannot delete %s: %s", what, exc)
        except Conflict:
            log.warning("not deleting %s: no longer the leader", what)

    async def _write(self, health: OriginHealth) -> bool:
        """Store `health` (Catalog.put_healths); False (and logged) when it
        could not be."""
        what = f"health of {health.origin}"
        try:
            await self._catalog.put_healths([health], fence=self._fence())
        except Unavailable as exc:
            log.warning("cannot record %s: %s", what, exc)
            return False
        except Conflict:
            log.warning("not recording %s: no longer the leader", what)
            return False
        return True
