"""The semantic region feed: the proxies of a region share their semantic entries.

Each proxy keeps its own `SemanticIndex` (search stays local and sub-millisecond);
what it inserts is published on the region's Redis stream `ponto:sem:<region>`,
and every other proxy of the region tails that stream into its index with
`SemanticIndex.insert_vector` (no model call). A hit on a remote entry names an
exact-cache key that the caller fetches from the cache store, which with the
regional store falls through to Redis; a key no store holds is a miss.

One message per entry, fields (bytes):

    v   the normalised float32 embedding, raw little-endian, 4 x dim bytes
    k   exact-cache key          t   tenant        m   model
    c   context hash (the namespace, see dataplane.cache.semantic)
    e   entity signature, JSON {"s": [strict], "n": [names], "w": [words],
        "d": [side tags]} ("d" absent from a proxy that predates it: no tags)
    p   publisher: the proxy's name, "." and 8 random hex digits drawn once per
        feed (once per worker process)
    em  embedder model id
    r   the newest purge revision the publisher had applied (decimal)

Publishing (`publish`, the index's `on_insert`): the message is queued and one
sender task XADDs queued messages in pipelined batches through the region link
(op `sem_publish`, so its deadline, breaker and metrics apply), trimming the stream to
about `maxlen` (MAXLEN ~, the most entries an index can hold). The queue is
bounded: when it is full or the region link is down the message is dropped and
counted. A request never waits for Redis.

Tailing: one task per proxy worker, from `attach` on (the index is built when a
tenant first turns semantic caching on). It starts at the beginning of the stream,
so a new proxy replays up to `maxlen` entries and starts warm, then reads with
XREAD BLOCK from the last id seen, on a connection of its own: a blocking read
must neither hold one of the region link's connections nor run into its per-call
deadline. Messages this feed published (`p`) or from another embedder (`em`)
are skipped. Proxy names are stable across restarts, hence the random part of
`p`: a proxy restarted under its old name replays what it published before (its
new index is empty), and the workers of one --workers proxy, each with an index
of its own, take each other's entries. Each batch is added, then the feed waits
for the index's executor to run it (`flush`), so a replay never queues more than
one batch of vector inserts ahead of lookups.

Faults: a Redis error, a timeout or a reply that does not parse makes the tail
wait (backoff from `backoff_min` doubling to `backoff_max`) and resume from its
last id, with no restart: it catches up with what was published meanwhile. A
Redis that came back empty has a new stream, whose ids are later in time than
ours unless its clock is behind: after an error the tail checks the stream's
newest id and starts over from the beginning when it is older than the last id
seen, or when the stream is gone. A malformed message (a vector of the wrong
size or not of unit length, bad JSON, a missing field) is skipped and counted,
and logged at most once per `log_every_s`, never a crash. An exception from
applying a batch (the index, its memory bound, an eviction listener) or from
publishing one is a bug of ours: it is counted (`internal_errors`), logged at
ERROR with its traceback at most once per `log_every_s`, and the task goes on with
the next batch, the tail from after the message it failed on. `close` never
raises, so the proxy's shutdown runs to its end.

Purges: a message carries `r`, the newest purge revision its publisher had
applied. A message of tenant T and model M is skipped when this proxy's route
table has a purge of (T or every tenant, M or every model) with a revision above
`r`: the entry was published before that purge was run where it came from. This
covers a replay at start (a proxy that starts after a purge does not run it, as
its cache is empty, but replays older messages) and a publisher that had not yet
applied a purge other proxies had. Entries received before a purge arrives here
are dropped by the index's own purge. The route table keeps the newest 64 purges
(controlplane.catalog.MAX_PURGES); past that, and for an entry whose answer was
purged while it was being published, the exact store is the backstop: a semantic
hit is served only from an entry the store holds, and purges reach the store
(and the regional store's Redis).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from redis.asyncio import Redis

from dataplane import jsonio
from dataplane.cache.entities import Entities
from dataplane.cache.regionstore import covers
from ponto.logs import Throttled

if TYPE_CHECKING:
    # numpy and the index come with the semantic index, built once a tenant
    # turns semantic caching on: a proxy with a regional cache builds its feed
    # at start, and does not pay their memory before (dataplane.cache.semsizes).
    import numpy as np

    from dataplane.cache.semantic import Inserted, SemanticIndex

log = logging.getLogger(__name__)

__all__ = [
    "FeedStats",
    "Malformed",
    "Message",
    "RegionLinkLike",
    "SemanticFeed",
    "decode",
    "encode",
    "stream_name",
]

_T = TypeVar("_T")

Purges = Sequence[tuple[int, str, str]]  # (revision, tenant or "", model or "")

# Messages per XREAD: a batch of vector inserts is what a lookup may wait behind
# in the index's executor during a replay (about 50 ms of HNSW inserts).
BATCH = 256
# Messages per XADD pipeline (about 2 kB each), and its deadline: a background
# write, so longer than a lookup's, but a Redis that cannot take 64 kB in that
# time is failing (the link's breaker opens).
PUBLISH_BATCH = 32
PUBLISH_DEADLINE_S = 0.25
# Messages waiting to be published; past this they are dropped (the link is slow).
MAX_QUEUED = 1024
# How long one XREAD blocks; the tail's own connection times out a little later.
BLOCK_MS = 2000


class RegionLinkLike(Protocol):
    """What the feed needs of `dataplane.cache.regional.RegionLink`."""

    @property
    def available(self) -> bool: ...

    def hold_write(self, op: str, n: int = 1) -> bool: ...

    async def call(
        self,
        op: str,
        fn: Callable[[Redis], Awaitable[_T]],
        *,
        deadline_s: float | None = None,
        n: int = 1,
    ) -> _T | None: ...


def stream_name(region: str) -> str:
    return f"ponto:sem:{region}"


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded feed message (see the module doc for the fields)."""

    vector: np.ndarray[Any, np.dtype[np.float32]]
    key: str
    tenant: str
    model: str
    context: str
    entities: Entities
    proxy: str
    embedder: str
    purge_rev: int


class Malformed(ValueError):
    """A feed message that cannot be used; the reason is safe to log."""


def encode(ins: Inserted, *, proxy: str, embedder: str, purge_rev: int) -> dict[bytes, bytes]:
    """The stream fields of one inserted entry."""
    import numpy as np  # noqa: PLC0415 - loaded with the index that inserted it

    e = ins.entities
    signature = {
        "s": sorted(e.strict),
        "n": sorted(e.names),
        "w": sorted(e.words),
        "d": sorted(e.sides),
    }
    return {
        b"v": np.ascontiguousarray(ins.vector, dtype="<f4").tobytes(),
        b"k": ins.key.encode(),
        b"t": ins.tenant.encode(),
        b"m": ins.model.encode(),
        b"c": ins.context.encode(),
        b"e": jsonio.dumps(signature),
        b"p": proxy.encode(),
        b"em": embedder.encode(),
        b"r": str(purge_rev).encode(),
    }


def _text(fields: dict[bytes, bytes], name: bytes) -> str:
    value = fields.get(name)
    if not isinstance(value, bytes):
        raise Malformed(f"field {name.decode()} missing")
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise Malformed(f"field {name.decode()} is not UTF-8") from exc


def _strings(signature: dict[str, Any], name: str) -> frozenset[str]:
    values = signature.get(name)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise Malformed(f"entity signature's {name!r} is not a list of strings")
    return frozenset(values)


def decode(fields: dict[bytes, bytes], dim: int) -> Message:
    """A message's fields checked and decoded; Malformed if unusable. The vector's
    unit length is checked by `SemanticIndex.insert_vector`."""
    import numpy as np  # noqa: PLC0415 - loaded with the index it goes to

    raw = fields.get(b"v")
    if not isinstance(raw, bytes) or len(raw) != 4 * dim:
        raise Malformed(f"vector is not {dim} float32 values")
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    try:
        signature = jsonio.loads(fields.get(b"e") or b"")
    except jsonio.JSONDecodeError as exc:
        raise Malformed("entity signature is not JSON") from exc
    if not isinstance(signature, dict):
        raise Malformed("entity signature is not a JSON object")
    entities = Entities(
        _strings(signature, "s"),
        _strings(signature, "n"),
        _strings(signature, "w"),
        # A publisher of an older version sends no side tags: its entries are
        # guarded by the other checks only until it is upgraded.
        _strings(signature, "d") if "d" in signature else frozenset(),
    )
    rev = _text(fields, b"r")
    if not rev.isdigit():
        raise Malformed("purge revision is not a number")
    return Message(
        vector,
        key=_text(fields, b"k"),
        tenant=_text(fields, b"t"),
        model=_text(fields, b"m"),
        context=_text(fields, b"c"),
        entities=entities,
        proxy=_text(fields, b"p"),
        embedder=_text(fields, b"em"),
        purge_rev=int(rev),
    )


def purged_since(purges: Purges, tenant: str, model: str, rev: int) -> bool:
    """Whether a purge newer than `rev` covers tenant and model ("" = every)."""
    return any(r > rev and covers(t, m, tenant, model) for r, t, m in purges)


def _bytes(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError(f"stream id {value!r} is not bytes")
    return value


def _stream_id(value: bytes) -> tuple[int, int]:
    ms, _, seq = value.partition(b"-")
    return int(ms), int(seq or b"0")


@dataclass(slots=True)
class FeedStats:
    """Counters since start (monotonic; read them for metrics)."""

    published: int = 0
    dropped: int = 0  # not published: queue full, link down, writes held back or the XADD failed
    held: int = 0  # of those dropped, held back: Redis refused writes lately
    applied: int = 0  # added to the index
    own: int = 0  # messages this feed published, skipped
    foreign: int = 0  # another embedder's, skipped
    purged: int = 0  # published before a purge that covers them, skipped
    refused: int = 0  # the index refused them (key held, not a unit vector)
    malformed: int = 0
    errors: int = 0  # failed reads of the stream
    internal_errors: int = 0  # batches whose handling raised: a bug here, logged with a traceback
    resets: int = 0  # the stream was gone or restarted: read again from its start


class SemanticFeed:
    """Publisher and tailer of one region's semantic stream (see the module doc).

    Owned by one proxy worker; `publish`, `start` and `close` run on its event
    loop, `attach` may run on any thread (the index is built in an executor).
    `link` publishes (its breaker and deadlines apply); `tail_client` is a Redis
    client used for XREAD BLOCK only, whose socket timeout must exceed
    `BLOCK_MS` (`build_tail_client`). `purges()` gives the route table's purges.
    `publisher` is this feed's `p`, `proxy` with a random part of its own.
    """

    def __init__(
        self,
        link: RegionLinkLike,
        tail_client: Redis,
        *,
        region: str,
        proxy: str,
        embedder: str,
        maxlen: int,
        purges: Callable[[], Purges] = tuple,
        backoff_min: float = 0.1,
        backoff_max: float = 5.0,
        log_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.stream = stream_name(region)
        self._link = link
        self._tail_client = tail_client
        self.publisher = f"{proxy}.{secrets.token_hex(4)}"
        self._embedder = embedder
        self._maxlen = maxlen
        self._purges = purges
        self._backoff = (backoff_min, backoff_max)
        self._malformed_log = Throttled(log, every_s=log_every_s, clock=clock)
        self._bug_log = Throttled(log, every_s=log_every_s, clock=clock)
        self._queue: deque[dict[bytes, bytes]] = deque()
        self._index: SemanticIndex | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._attached: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._lock = threading.Lock()
        self.stats = FeedStats()
        self.last_id = b"0-0"  # of the last message read

    # -- lifetime -----------------------------------------------------------------

    def attach(self, index: SemanticIndex) -> None:
        """Publish what `index` inserts and tail the stream into it. Call once,
        before the index is shared (it sets `index.on_insert`); any thread."""
        index.on_insert = self.publish
        with self._lock:
            self._index = index
            loop, attached = self._loop, self._attached
        if loop is not None and attached is not None:
            loop.call_soon_threadsafe(attached.set)

    def start(self) -> None:
        """Start the sender and the tail (on the running loop)."""
        self._wake = asyncio.Event()
        self._attached = asyncio.Event()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            if self._index is not None:
                self._attached.set()
        self._tasks = [
            asyncio.create_task(self._send(), name="semantic-feed-send"),
            asyncio.create_task(self._tail(), name="semantic-feed-tail"),
        ]

    async def close(self) -> None:
        """Stop both tasks and close the tail's connection; queued messages are dropped."""
        # The flag as well as the cancellation: Python 3.11's wait_for (in a link's
        # call) can swallow a cancellation that races its result.
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        for task in self._tasks:
            task.cancel()
        # Both tasks contain their failures; should one still end on an exception,
        # it is logged here and the proxy's shutdown goes on.
        ended = await asyncio.gather(*self._tasks, return_exceptions=True)
        for task, result in zip(self._tasks, ended, strict=True):
            if isinstance(result, Exception):
                log.error("semantic feed: task %s failed", task.get_name(), exc_info=result)
        self._tasks = []
        self.stats.dropped += len(self._queue)
        self._queue.clear()
        if self._index is not None and self._index.on_insert == self.publish:
            self._index.on_insert = None
        await self._tail_client.aclose()

    # -- publishing -----------------------------------------------------------------

    def publish(self, ins: Inserted) -> None:
        """Queue one entry for the stream; never waits (the index's on_insert)."""
        if self._wake is None or not self._link.available or len(self._queue) >= MAX_QUEUED:
            self.stats.dropped += 1
            return
        if self._link.hold_write("sem_publish"):
            # Redis refused writes lately (full, read-only): nothing is queued
            # until the link lets one write try again.
            self.stats.dropped += 1
            self.stats.held += 1
            return
        rev = max((r for r, _, _ in self._purges()), default=0)
        self._queue.append(
            encode(ins, proxy=self.publisher, embedder=self._embedder, purge_rev=rev)
        )
        self._wake.set()

    async def _send(self) -> None:
        assert self._wake is not None
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                n = min(PUBLISH_BATCH, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                try:
                    # n: the op counts entries, as publish's held ones do.
                    sent = await self._link.call(
                        "sem_publish", self._xadd(batch), deadline_s=PUBLISH_DEADLINE_S, n=n
                    )
                except Exception:  # the link never raises: a bug, which must not end the task
                    self._bug("publishing a batch")
                    sent = None
                if sent is None:
                    self.stats.dropped += len(batch)
                else:
                    self.stats.published += len(batch)

    def _xadd(self, batch: list[dict[bytes, bytes]]) -> Callable[[Redis], Awaitable[list[Any]]]:
        async def xadd(client: Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for fields in batch:
                pipe.xadd(self.stream, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]
            return await pipe.execute()

        return xadd

    # -- tailing --------------------------------------------------------------------

    async def _tail(self) -> None:
        assert self._attached is not None
        await self._attached.wait()
        index = self._index
        assert index is not None
        delay, failing = self._backoff[0], False
        while not self._closing:
            try:
                if failing:
                    await self._check_reset()
                reply = await self._tail_client.xread(
                    {self.stream: self.last_id}, count=BATCH, block=BLOCK_MS
                )
                batch = _messages(reply)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, a timeout, a reply that does not parse
                self.stats.errors += 1
                if not failing:
                    log.warning("semantic feed: reading %s failed, retrying: %r", self.stream, exc)
                failing = True
                await asyncio.sleep(delay)
                delay = min(2 * delay, self._backoff[1])
                continue
            if failing:
                log.info(
                    "semantic feed: reading %s again from id %s", self.stream, self.last_id.decode()
                )
                delay, failing = self._backoff[0], False
            if batch:
                try:
                    purges = self._purges()
                    for msg_id, fields in batch:
                        self.last_id = msg_id
                        self._apply(index, fields, purges)
                    await index.flush()
                except Exception:
                    # A bug in the chain behind the index (insert_vector, its memory
                    # bound, an eviction listener), not the message's fault: the
                    # message it failed on is lost, the next read starts after it. A
                    # pause as after a read error, so a bug that repeats cannot spin.
                    self._bug(f"applying the messages up to {self.last_id.decode()}")
                    await asyncio.sleep(self._backoff[0])

    async def _check_reset(self) -> None:
        """Start over when the stream is gone or restarted behind our last id."""
        if self.last_id == b"0-0":
            return
        newest = await self._tail_client.xrevrange(self.stream, count=1)
        if not newest or _stream_id(_bytes(newest[0][0])) < _stream_id(self.last_id):
            self.stats.resets += 1
            self.last_id = b"0-0"

    def _apply(self, index: SemanticIndex, fields: Any, purges: Purges) -> None:
        try:
            if not isinstance(fields, dict):
                raise Malformed("not a map of fields")
            msg = decode(fields, index.dim)
        except Malformed as exc:
            self.stats.malformed += 1
            self._warn(f"skipped a malformed message: {exc}")
            return
        if msg.proxy == self.publisher:
            self.stats.own += 1
        elif msg.embedder != self._embedder:
            self.stats.foreign += 1
        elif purged_since(purges, msg.tenant, msg.model, msg.purge_rev):
            self.stats.purged += 1
        elif index.insert_vector(
            msg.tenant, msg.model, msg.context, msg.key, msg.vector, msg.entities
        ):
            self.stats.applied += 1
        else:
            self.stats.refused += 1

    def _bug(self, what: str) -> None:
        """Count and log (with the traceback being handled) an unexpected exception."""
        self.stats.internal_errors += 1
        self._bug_log.log(
            logging.ERROR, "semantic feed %s: %s failed", self.stream, what, exc_info=True
        )

    def _warn(self, line: str) -> None:
        """At most one line per log_every_s; the next line says how many were not."""
        self._malformed_log.log(logging.WARNING, "semantic feed %s: %s", self.stream, line)


def _messages(reply: Any) -> list[tuple[bytes, Any]]:
    """The (id, fields) pairs of an XREAD reply of one stream (RESP2 list or RESP3
    map); ValueError for a shape that is neither."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [entry[1] for entry in reply]
    out: list[tuple[bytes, Any]] = []
    for messages in streams:
        for msg_id, fields in messages:
            if not isinstance(msg_id, bytes):
                raise ValueError(f"stream id {msg_id!r} is not bytes")
            _stream_id(msg_id)  # raises ValueError if it is not one
            out.append((msg_id, fields))
    return out


def build_tail_client(url: str, password: str | None = None) -> Redis:
    """A client for the tail's blocking reads: one connection, a socket timeout
    past BLOCK_MS, binary replies; `password` from --redis-password-file."""
    return Redis.from_url(
        url,
        password=password or None,
        socket_timeout=BLOCK_MS / 1000 + 3.0,
        socket_connect_timeout=2.0,
        max_connections=1,
        decode_responses=False,
    )
