"""The link of one proxy worker to its region's Redis (or Valkey).

`RegionLink` owns the `redis.asyncio` client and is the only way the data plane
talks to Redis: every call goes through `call(op, fn)`, which bounds it by a
deadline, feeds a circuit breaker (dataplane.cache.breaker) and never raises.
Redis is an optimisation shared by the proxies of a region: when it is down,
slow or answers nonsense, the proxy serves from its local cache and the origins
and says so in `ponto_cache_region_up`; when it answers again, the next probe
closes the breaker and region-wide hits resume without a restart.

Why a 50 ms deadline: a Redis GET on the same network answers in well under a
millisecond, and an origin round trip costs hundreds of milliseconds; a call
that has not answered in 50 ms is not going to make the request faster, so the
request goes on without it (a lookup becomes a miss) and the breaker stops
later requests from paying the same wait. Writes run in the background after
the client has its answer (dataplane.cache.regionstore), so their deadline
only bounds how long a write's task lives.

Not every failure is an outage (dataplane.cache.regionfaults): a Redis that
answers a command with an error (full under `noeviction`, a read-only replica,
an ACL that refuses that command) is up, and reads go on; that call is a miss
or a dropped write, counted as `refused` and logged in one WARNING per
REFUSED_WARNING_EVERY_S. After a full or read-only refusal, writes are held
back for WRITE_BACKOFF_S, then one tries again. A setup mistake (a wrong
password or an ACL refusal of the PING, an unknown DB, a Redis Cluster node)
makes Redis as unusable as an outage, but is logged as an ERROR naming the
fix, once per MISTAKE_ERROR_EVERY_S per mistake while it lasts or comes back
(the throttle outlives the breaker closing: a Redis that serves the PING and
refuses the next call must not be one ERROR per flap); the link goes on
probing, so a Redis fixed live is used again without a restart. The probe is
always a PING (`call`), so the breaker closes only on an answer that says
Redis serves this proxy.

Lifecycle (as the app's other resources): construction has no side effects;
`start()` checks the connection once (an unreachable Redis is not an error: the
proxy starts degraded, logs one WARNING, and catches up when Redis answers) and
reads Redis's maxmemory-policy (again whenever Redis answers after an outage),
warning once when it is `noeviction`; `close()` releases the connections.
One per proxy worker, used from its event loop; not thread-safe. With
`--workers N`, each worker has its own link, so the workers of one process
also share their entries through Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from dataplane.cache.breaker import Admit, Breaker
from dataplane.cache.regionfaults import (
    MISTAKE_CLUSTER,
    PROBE_OP,
    WRITE_REFUSALS,
    BadSetup,
    ClusterNode,
    Mistake,
    Refusal,
    fault_of,
    policy_warning,
)
from dataplane.cache.regionurl import check_url, redact
from dataplane.metrics import Metrics
from ponto.logs import Throttled

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_DEADLINE_S = 0.05
CONNECT_TIMEOUT_S = 0.25
# Connections per worker. Redis answers in a fraction of a millisecond, so a
# few dozen connections carry tens of thousands of calls a second; background
# writes take at most half (dataplane.cache.regionstore.MAX_WRITES).
MAX_CONNECTIONS = 128
WARM_CONNECTIONS = 16
# The deadline of the check at start (`start`): one second, as for the pings
# that open the warm connections.
START_PING_S = 1.0
# Without traffic nothing would notice Redis going or coming back, and
# ponto_cache_region_up would say what the last request saw: the link pings
# when it has been idle this long, and probes as soon as the breaker allows.
IDLE_PING_S = 5.0
WATCH_TICK_S = 0.25
# A refusal (Redis full, say) can come with every write, a setup mistake with
# every probe (up to one in 5 s): one line per kind this often says it
# without flooding the log, and the lines not written are counted in the next.
REFUSED_WARNING_EVERY_S = 60.0
MISTAKE_ERROR_EVERY_S = 60.0
# After Redis refused a write as full or read-only, writes (the ops in
# WRITE_OPS) are held back this long, then one goes through to see whether
# Redis takes writes again. A refused SET still costs Redis reading the whole
# entry (up to --cache-max-entry-kb) and the proxy a connection; reads go on.
WRITE_BACKOFF_S = 5.0
# Only writes that take memory: a flight lock's refresh ("lock_refresh", a
# PEXPIRE) and a purge's claim ("purge_claim", whose UNLINKs free memory) are
# not held back.
WRITE_OPS = frozenset({"set", "lock", "sem_publish"})
# How long reading Redis's memory settings may take (at start, and when Redis
# answers again): nothing waits on it but the warning.
CONFIG_READ_S = 1.0


class RegionLink:
    """One proxy worker's Redis client with per-call deadlines and a circuit breaker.

    `call(op, fn)` runs `fn(client)` within the op's deadline and returns its
    result, or None when Redis failed, timed out, the reply did not parse (`fn`
    raised) or the breaker is open; failures count in
    `ponto_cache_region_errors_total{op}` and open the breaker. Every call counts
    in `ponto_cache_region_requests_total{op,result}`. It never raises, except
    the caller's own cancellation.
    """

    def __init__(
        self,
        url: str,
        metrics: Metrics,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        deadlines: Mapping[str, float] | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        breaker: Breaker | None = None,
        watch_tick_s: float | None = WATCH_TICK_S,
        idle_ping_s: float = IDLE_PING_S,
        password: str | None = None,
    ) -> None:
        self.url = check_url(url)
        # From --redis-password-file: never in the URL, so never in a log line.
        self._password = password
        self._metrics = metrics
        self._deadline = deadline_s
        self._deadlines = dict(deadlines or {})
        self._connect_timeout = connect_timeout_s
        self._breaker = breaker or Breaker(clock=clock)
        self._client: Redis | None = None
        self._closed = False
        # One WARNING per reason while degraded, not one per failed call.
        self._warned = False
        self._last_error = ""
        self._clock = clock
        self._last_ok = clock()
        self._watch: asyncio.Task[None] | None = None
        self._watch_tick = watch_tick_s  # None: no watcher (tests that count calls)
        self._idle_ping = idle_ping_s
        # Refusals by kind (regionfaults.Refusal.kind), setup mistakes by kind.
        self._refused_logs: dict[str, Throttled] = {}
        self._mistake_logs: dict[str, Throttled] = {}
        # The setup mistake of the last failure, None when it was none.
        self._mistake: Mistake | None = None
        # Redis's maxmemory-policy as last read (None: not read, or refused),
        # and the one last warned about.
        self.policy: str | None = None
        self._policy_warned = ""
        self._config_task: asyncio.Task[None] | None = None
        # The first full refusal's policy read and line (_policy_then_say).
        self._refusal_task: asyncio.Task[None] | None = None
        # The write back-off (WRITE_BACKOFF_S): the refusal kind that started
        # it ("" while writes go), when the next write may try, and whether
        # that one is in flight.
        self._writes_refused = ""
        self._writes_retry_at = 0.0
        self._write_probe = False
        # Exported from 0: PontoRegionCacheRefusingWrites reads increase(),
        # which misses a series' first count (trial 67).
        for op in sorted(WRITE_OPS):
            for reason in sorted(WRITE_REFUSALS):
                self._metrics.region_writes_skipped.labels(op, reason)
        # Whether the last failure was an error reply (not a lost connection).
        self._last_reply = False
        # A cluster's reply (MOVED, ...) was seen: the probe checks for one.
        self._cluster_seen = False

    @property
    def client(self) -> Redis:
        """The redis.asyncio client (created on first use; no I/O until a command)."""
        if self._client is None:
            pool = self._pool()
            self._client = Redis.from_pool(pool)
        return self._client

    def _pool(self) -> BlockingConnectionPool:
        """The connection pool for the URL, one connection object made (not
        connected) to see that redis-py can make them: BadSetup if not. redis-py
        raises a misspelled URL option (`?socket_timout=1`) as a TypeError at
        every connect, which was taken for an outage and retried without an
        ERROR naming it (review finding 4); check_url refuses such a URL at
        start, and this catches what it cannot see."""
        # One immediate retry inside redis-py: a pooled connection that
        # died with a restarted Redis fails once, and must not open the
        # breaker for a server that answers. The breaker decides the rest,
        # and the call's deadline bounds both tries.
        # A blocking pool: a call that finds every connection busy waits
        # for one (within its deadline) instead of failing at once, as
        # redis-py's default pool does past 100 connections.
        try:
            pool = BlockingConnectionPool.from_url(
                self.url,
                max_connections=MAX_CONNECTIONS,
                timeout=None,
                socket_connect_timeout=self._connect_timeout,
                socket_timeout=max(self._deadline, *self._deadlines.values(), 1.0),
                retry=Retry(NoBackoff(), 1),
                health_check_interval=0,
                **({"password": self._password} if self._password else {}),
                # No CLIENT SETINFO on connect: two round trips fewer, which
                # matters when a burst opens many connections at once.
                driver_info=None,
            )
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError) as exc:
            raise BadSetup(f"{type(exc).__name__}: {exc}") from None
        return pool

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis is being skipped)."""
        return self._breaker.closed and not self._closed

    @property
    def writable(self) -> bool:
        """`available`, and writes are not held back (WRITE_BACKOFF_S), or the
        one write that tries again may go now."""
        return self.available and not self._writes_held()

    def _writes_held(self) -> bool:
        return bool(self._writes_refused) and (
            self._write_probe or self._clock() < self._writes_retry_at
        )

    def hold_write(self, op: str, n: int = 1) -> bool:
        """Whether a write `op` is to be held back now (Redis refused writes
        lately: WRITE_BACKOFF_S); counted when it is, in
        ponto_cache_region_writes_skipped_total{op, reason} and as `skipped`.
        For writers that would queue work for `call` (the semantic feed); `n`
        is how many items the write holds, as for `call`."""
        if not self._writes_held():
            return False
        self._metrics.region_writes_skipped.labels(op, self._writes_refused).inc(n)
        self.count(op, "skipped", n)
        return True

    def deadline(self, op: str) -> float:
        return self._deadlines.get(op, self._deadline)

    def count(self, op: str, result: str, n: int = 1) -> None:
        """Count an outcome decided outside call(), e.g. a write dropped."""
        self._metrics.region_requests.labels(op, result).inc(n)

    def error(self, op: str, n: int = 1) -> None:
        """Count a failure found by the caller, e.g. a value that does not decode
        (op "decode"); it does not open the breaker: Redis itself answered."""
        self._metrics.region_errors.labels(op).inc(n)

    async def start(self) -> None:
        """Check the connection once (an unreachable Redis leaves the link
        degraded) and keep watching it: see IDLE_PING_S."""
        self._metrics.bind_region(lambda: self.available)
        if self._watch_tick is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watching(self._watch_tick))
        self._warned = True  # one line below says it all
        # The first call opens the first connection (a TLS handshake, say),
        # and nothing waits on it: a request's 50 ms deadline would call a
        # Redis that is merely slow to accept, or a busy start, unreachable.
        if await self.call(PROBE_OP, self._ping, deadline_s=START_PING_S) is None:
            if self._mistake is None:  # a mistake was logged as one, by _failed
                log.warning(
                    "regional cache %s %s at start (%s): local cache only until it answers",
                    redact(self.url),
                    "not serving" if self._last_reply else "unreachable",
                    self._last_error,
                )
            return
        self._warned = False
        await self.read_policy()
        # Opening a connection costs a few milliseconds of this loop's time: a
        # burst that found the pool cold would open dozens at once and overrun
        # its deadlines. Open some now, with time to spare.
        await asyncio.gather(
            *(self.call(PROBE_OP, self._ping, deadline_s=1.0) for _ in range(WARM_CONNECTIONS))
        )

    async def _watching(self, tick: float) -> None:
        while not self._closed:
            await asyncio.sleep(tick)
            idle = self._clock() - self._last_ok >= self._idle_ping
            if (self._breaker.closed and idle) or self._breaker.probe_due:
                await self.call(PROBE_OP, self._ping)

    async def read_policy(self) -> None:
        """Read Redis's maxmemory-policy (`CONFIG GET`), and warn once when it
        is `noeviction`: a full Redis then refuses every write. Not through
        `call`: a managed Redis may refuse CONFIG (renamed, or denied by its
        ACL), which is neither an outage nor a mistake, and is only a DEBUG
        line here. Never raises but the caller's cancellation."""
        try:
            async with asyncio.timeout(CONFIG_READ_S):
                got = await self.client.config_get("maxmemory*")
            policy = str(got["maxmemory-policy"])
            maxmemory = int(str(got.get("maxmemory") or 0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("regional cache %s: no maxmemory-policy read (%r)", redact(self.url), exc)
            return
        self.policy = policy
        warning = policy_warning(policy, maxmemory)
        if warning is None:
            self._policy_warned = ""
        elif self._policy_warned != warning:
            self._policy_warned = warning
            log.warning("regional cache %s: %s", redact(self.url), warning)

    def _read_policy_later(self) -> None:
        if self._closed or (self._config_task is not None and not self._config_task.done()):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to read for
            self._config_task = asyncio.get_running_loop().create_task(self.read_policy())

    async def close(self) -> None:
        self._closed = True
        for task in (self._watch, self._config_task, self._refusal_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._client is not None:
            await self._client.aclose()

    async def call(
        self,
        op: str,
        fn: Callable[[Redis], Awaitable[T]],
        *,
        deadline_s: float | None = None,
        n: int = 1,
    ) -> T | None:
        """fn(client) within the deadline (the op's, or `deadline_s`); see the class.

        While the breaker is open, the one call it lets through as its probe
        runs a PING first (PROBE_OP), and `fn` only once that answered: the
        probe says whether Redis serves this proxy, which a command that Redis
        refuses alone (an ACL without scripting, a full Redis) does not. A
        write (WRITE_OPS) is skipped while writes are held back.

        `n` is how many items the call carries (the semantic feed's XADD batch
        carries one per entry): each outcome counts `n` in the metrics, so that
        one op counts one unit whether a call is made or held back (review
        finding 5: a held entry counted one, a batch sent one)."""
        if self._closed:
            self.count(op, "skipped", n)
            return None
        tries_writes = False
        if op in WRITE_OPS and self._writes_refused:
            if self.hold_write(op, n):
                return None
            tries_writes = self._write_probe = True
        try:
            got = await self._call(op, fn, deadline_s, n)
        finally:
            if tries_writes:
                self._write_probe = False
        return None if got is _FAILED else got

    async def _call(
        self, op: str, fn: Callable[[Redis], Awaitable[Any]], deadline_s: float | None, n: int
    ) -> Any:
        admit = self._breaker.allow()
        if admit is None:
            self.count(op, "skipped", n)
            return _FAILED
        when = asyncio.get_running_loop().time() + (
            deadline_s if deadline_s is not None else self.deadline(op)
        )
        if admit is Admit.PROBE and op != PROBE_OP:
            if await self._attempt(PROBE_OP, self._ping, admit, when) is _FAILED:
                self.count(op, "skipped", n)
                return _FAILED
            admit = Admit.CLOSED  # the PING closed the breaker
        return await self._attempt(op, fn, admit, when, n)

    async def _attempt(
        self,
        op: str,
        fn: Callable[[Redis], Awaitable[Any]],
        admit: Admit,
        when: float,
        n: int = 1,
    ) -> Any:
        """One call to Redis, its outcome reported; _FAILED when it gave nothing."""
        try:
            async with asyncio.timeout_at(when):
                result = await fn(self.client)
        except asyncio.CancelledError:
            # The caller's cancellation (a timeout's is turned into TimeoutError).
            self._breaker.abandon(admit)
            raise
        except TimeoutError:
            self._failed(op, admit, "timeout", "no answer within the deadline", n=n)
            return _FAILED
        except Exception as exc:  # any failure of an optional tier is a miss
            fault = fault_of(exc, op, self.policy)
            # An error reply to the probe is never a healthy answer.
            if not isinstance(fault, Refusal) or op == PROBE_OP:
                self._last_reply = isinstance(exc, (ResponseError, ClusterNode))
                if fault is MISTAKE_CLUSTER:
                    self._cluster_seen = True
                why = f"{type(exc).__name__}: {exc}"
                mistake = fault if isinstance(fault, Mistake) else None
                self._failed(op, admit, "error", why, mistake, n=n)
                return _FAILED
            self._refused(op, admit, exc, fault, n)
            return _FAILED
        self.count(op, "ok", n)
        self._answered(admit)
        if op in WRITE_OPS and self._writes_refused:
            self._writes_refused = ""  # Redis takes writes again
        return result

    async def _ping(self, r: Redis) -> bool:
        """The probe: PING, and once a cluster's reply was seen, whether the
        server is still a Redis Cluster node (a PING alone would say it serves,
        and the next key's MOVED would open the breaker again)."""
        answered = bool(await r.ping())
        if self._cluster_seen:
            info = await r.info("cluster")
            if int(info.get("cluster_enabled", 0)):
                raise ClusterNode("INFO cluster says cluster_enabled:1")
            self._cluster_seen = False
        return answered

    def _refused(self, op: str, admit: Admit, exc: Exception, refusal: Refusal, n: int) -> None:
        """Redis is up and said no to this one command: a miss (or a write
        dropped). Reads go on; after a full or read-only refusal writes are
        held back (WRITE_BACKOFF_S)."""
        self.count(op, "refused", n)
        self.error(op, n)
        if refusal.serving:
            self._answered(admit)
        first_full = refusal.kind == "full" and self._writes_refused != "full"
        if refusal.kind in WRITE_REFUSALS:
            # Set before anything is awaited: the writes in flight that Redis
            # refuses at the same time find the run started (review finding 3:
            # each read the policy, and a lock claim waited for it).
            self._writes_refused = refusal.kind
            self._writes_retry_at = self._clock() + WRITE_BACKOFF_S
        if first_full:
            # The first of a run: the policy may have changed since it was read
            # (CONFIG SET at runtime), and the advice depends on it. Read once,
            # in the background; the line is written once it is read.
            self._refusal_task = asyncio.get_running_loop().create_task(
                self._policy_then_say(op, exc)
            )
            return
        if (
            refusal.kind == "full"
            and self._refusal_task is not None
            and not self._refusal_task.done()
        ):
            # Refused while that read runs: counted in its line.
            self._refusal_log(refusal, op).unlogged += 1
            return
        self._say_refused(op, exc, refusal)

    async def _policy_then_say(self, op: str, exc: Exception) -> None:
        """Read the policy, then log the refusal `exc` of `op` with the advice
        that policy calls for. The first full refusal's, in the background."""
        await self.read_policy()
        refusal = fault_of(exc, op, self.policy)
        if isinstance(refusal, Refusal):
            self._say_refused(op, exc, refusal)

    def _refusal_log(self, refusal: Refusal, op: str) -> Throttled:
        """The throttle of one kind of refusal line; an ACL's per command, as
        each needs its own grant."""
        key = f"acl {op}" if refusal.kind == "acl" else refusal.kind
        return self._refused_logs.setdefault(
            key, Throttled(log, every_s=REFUSED_WARNING_EVERY_S, clock=self._clock)
        )

    def _say_refused(self, op: str, exc: Exception, refusal: Refusal) -> None:
        """The throttled WARNING of a refusal: why, and what to change."""
        if refusal.kind in WRITE_REFUSALS:
            then = (
                f"writes (lock, set, semantic feed) held back {WRITE_BACKOFF_S:g}s at a time, "
                "then one tries again; reads go on"
            )
        elif refusal.kind == "auth":
            then = "such calls are misses or dropped writes; pooled connections go on"
        else:
            then = "such calls are misses or dropped writes, reads go on"
        self._refusal_log(refusal, op).log(
            logging.WARNING,
            "regional cache %s refused %s (%s: %s)%s; %s",
            redact(self.url),
            op,
            type(exc).__name__,
            exc,
            f": {refusal.advice}" if refusal.advice else "",
            then,
        )

    def _answered(self, admit: Admit) -> None:
        """Redis answered a call (with a result or an error reply)."""
        self._last_ok = self._clock()
        self._mistake = None
        if self._breaker.success(admit):
            self._warned = False
            # The mistakes' throttles stay: a mistake that comes back (a Redis
            # that serves the PING and refuses the next call) is said once per
            # MISTAKE_ERROR_EVERY_S, not once per flap.
            log.info("regional cache %s answers again: region-wide hits resume", redact(self.url))
            self._read_policy_later()

    def _failed(
        self,
        op: str,
        admit: Admit,
        result: str,
        why: str,
        mistake: Mistake | None = None,
        *,
        n: int = 1,
    ) -> None:
        self.count(op, result, n)
        self.error(op, n)
        self._last_error = f"{op} {why}"
        self._mistake = mistake
        opened = self._breaker.failure(admit)
        if mistake is not None:
            # Not an outage: waiting does not end it. Said as what to fix, at
            # start and then once a while as long as it lasts (the breaker
            # goes on probing, so a Redis fixed live is used again).
            self._warned = True
            said = self._mistake_logs.setdefault(
                mistake.kind, Throttled(log, every_s=MISTAKE_ERROR_EVERY_S, clock=self._clock)
            )
            said.log(
                logging.ERROR,
                "regional cache %s misconfigured: %s (%s); %s. Local cache only until it "
                "answers; retrying",
                redact(self.url),
                mistake.what,
                self._last_error,
                mistake.fix,
            )
            return
        if opened and not self._warned:
            self._warned = True
            log.warning(
                "regional cache %s degraded (%s): local cache only, retrying in %.2gs",
                redact(self.url),
                self._last_error,
                self._breaker.delay_s,
            )


_FAILED: Any = object()  # what _attempt returns for a call that gave nothing
