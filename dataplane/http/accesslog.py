"""The access log (`--access-log on`): one JSON line per answer, on standard output.

Every answer passes the error boundary (dataplane.http.boundary) once; there
an `AccessRecord` is built from the request's `Exchange` (when the request
reached the pipeline) and handed to the app's `AccessLog`, refusals and errors
included. Lines are for machines (one JSON object each, the same keys on every
line, null where a field does not apply), next to the human log on standard
error, which keeps its refusal lines (dataplane.http.refusals): the access log
is a record of traffic, not a second error log.

Probes (`--access-log-probes`, off by default): a successful answer of the
proxy's own /healthz (/health), /readyz or /metrics gets no line; a kubelet's probes
and a scraper's pulls, every few seconds at every proxy, are not traffic and
would outnumber it on a quiet fleet (trial 33). Their failures are written.

Sampling (`--access-log-sample RATE`, 0 < RATE <= 1): each answer is written
with probability RATE, except that every answer with an error (a refusal, a
5xx, a cut stream, a client that left) is written: those are the lines an
operator looks for.

A stalled reader does not block the event loop: `start` makes standard
output non-blocking when it is a pipe or a socket (the only kinds whose reader
can stall the writer), unless standard error is the same pipe (its human log
lines would block on that reader anyway, and must not start failing). What the
reader does not take now waits, up to MAX_BACKLOG bytes, and is written on the
next flush; lines past that are dropped and counted (`dropped`,
ponto_access_log_dropped_total), with at most one WARNING line per
DROP_WARNING_EVERY_S.

Lines are buffered and written with one `os.write` per batch, at the latest
FLUSH_AFTER_S after the first line of a batch, when the batch passes MAX_BATCH
bytes, and at stop. A batch write holds whole lines and at most PIPE_BUF bytes
when it can, so the lines of the workers of one group (--workers, all writing
to one inherited pipe) never interleave inside a line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import select
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from dataplane import jsonio
from dataplane.http.refusals import redact_credentials

if TYPE_CHECKING:
    from dataplane.auth.authenticator import Principal
    from dataplane.geo.clientip import TrustedProxies
    from dataplane.http.pipeline import Exchange

__all__ = ["AccessLog", "AccessRecord", "OriginCall", "Sampler", "record", "rfc3339"]

log = logging.getLogger(__name__)

FLUSH_AFTER_S: Final = 0.1
MAX_BATCH: Final = 64 * 1024
# Writes of at most this many bytes to a pipe are atomic (POSIX, 4096 on Linux).
ATOMIC_WRITE: Final = getattr(select, "PIPE_BUF", 512)
MAX_PATH: Final = 200
# Bytes kept while standard output takes nothing: about 4,000 lines.
MAX_BACKLOG: Final = 1024 * 1024
DROP_WARNING_EVERY_S: Final = 60.0


@dataclass(slots=True)
class AccessRecord:
    """One answer, as the access log writes it. Durations in milliseconds.

    Not frozen: a frozen dataclass's 24 field assignments cost a few µs a request."""

    ts: str  # when the answer ended, RFC 3339 in UTC with milliseconds
    request_id: str
    method: str
    path: str  # cut to MAX_PATH characters, credentials redacted; never the query string
    endpoint: str  # the route's name ("chat.completions", "models", ...) or "other"
    client: str | None  # the client's address, trusted proxies' forwarding believed
    tenant: str | None
    key_id: str | None
    model: str | None
    region: str  # of the origin that answered; the proxy's own otherwise
    origin: str | None
    # The answering origin's own x-request-id, when not the proxy's (a hosted API's).
    origin_request_id: str | None
    attempts: int  # origin calls made (failover, hedge and continuations included)
    route: str | None  # why that origin (x-ponto-route)
    # What affinity placed it by: the key's source and a MAC of its hash
    # ("conversation:1f0c93a2", "prefix:1f0c93a2/9a0b1c2d" with the
    # conversation, see _placement), so that requests sharing a
    # key can be told (trial 60: conversations that start alike share one)
    placement: str | None
    hedged: bool
    cache: str | None  # hit, miss, bypass; None when no cache step ran
    cache_reason: str | None  # why a bypass, or a miss: verify, no-usage, tools, truncated...
    cache_kind: str | None  # how a hit was found: exact, semantic, coalesced
    cache_tier: str | None  # where a hit came from: local, region
    status: int
    error: str | None  # the error code of an error answer, or how a stream ended badly
    stream: bool
    ttft_ms: float | None  # to a stream's first chunk
    duration_ms: float
    input_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None  # of input_tokens, those the origin's prefix cache held
    # With tracing on, the request span's ids (hex, as in `traceparent`), to find
    # its trace; for a request no span was made for (the sampler drops every
    # root), the trace id its origin calls carried. None with tracing off.
    trace_id: str | None = None
    span_id: str | None = None
    # The tokens are in whole or in part the proxy's estimate, not an origin's
    # count (billing trial 76: a stream without usage read as exact); None
    # where there are no tokens.
    tokens_estimated: bool | None = None

    def line(self) -> bytes:
        return jsonio.dumps(self) + b"\n"


@dataclass(slots=True)
class OriginCall:
    """The origin call of a request without an Exchange (a stored response's
    route, dataplane.http.stored), as its access line reports it: what an
    Exchange's `origin`, `region`, `origin_request_id`, `attempts` and
    `origin_error` say of a proxied request. Its handler notes it in
    request[ORIGIN_CALL] (state) as the call ends; the error boundary reads
    it once the handler returns."""

    origin: str = ""  # the origin that answered ("" for none), and its region
    region: str = ""
    origin_request_id: str | None = None
    attempts: int = 0  # calls made, failed ones included
    origin_error: str = ""


def rfc3339(t: float) -> str:
    """`t` (seconds since the epoch) as ``2026-12-01T01:02:03.456Z``."""
    whole = int(t)
    return f"{_second(whole)}.{int((t - whole) * 1000):03d}Z"


@functools.lru_cache(maxsize=4)
def _second(whole: int) -> str:
    # strftime costs more than the rest of a record: once a second, not per line.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))


def record(
    *,
    ended: float,
    request_id: str,
    method: str,
    path: str,
    endpoint: str,
    client: str | None,
    principal: Principal | None,
    ex: Exchange | None,
    region: str,
    status: int,
    error: str,
    started: float,
    finished: float,
    call: OriginCall | None = None,
) -> AccessRecord:
    """The record of one answer. `ended` is wall-clock time (the `ts`);
    `started`, `finished` and the Exchange's first-chunk time are
    time.perf_counter() readings. `region` is the proxy's own (the Exchange,
    or without one `call`, says which origin's region answered, when one
    did). Pure."""
    ms = 1000.0
    tenant = key_id = None
    if principal is not None:
        tenant, key_id = principal.tenant, principal.key_id or None
    if ex is None:
        call = call or _NO_CALL
        return AccessRecord(
            rfc3339(ended), request_id, method, _quoted(path), endpoint, client, tenant,
            key_id, None, call.region or region, call.origin or None, call.origin_request_id,
            call.attempts, None, None, False, None, None, None, None, status, error or None, False,
            None, round((finished - started) * ms, 3), None, None, None,
        )  # fmt: skip
    plan = ex.cache
    usage = ex.usage
    first = ex.first_chunk_at
    trace_id = span_id = None
    if ex.trace is not None:
        trace_id, span_id = ex.trace.ids()
    elif ex.traceparent is not None:  # version-traceid-spanid-flags
        trace_id = ex.traceparent[3:35]
    return AccessRecord(
        ts=rfc3339(ended),
        request_id=request_id,
        method=method,
        path=_quoted(path),
        endpoint=endpoint,
        client=client,
        tenant=tenant,
        key_id=key_id,
        model=ex.model or _asked_model(ex.body),
        region=ex.region or region,
        origin=ex.origin or None,
        origin_request_id=ex.origin_request_id,
        attempts=ex.attempts,
        route=ex.route or None,
        placement=_placement(ex),
        hedged=ex.hedged,
        cache=plan.outcome if plan is not None else None,
        cache_reason=(plan.said_reason or None) if plan is not None else None,
        cache_kind=(plan.kind or None) if plan is not None and plan.outcome == "hit" else None,
        cache_tier=(plan.tier or None) if plan is not None and plan.outcome == "hit" else None,
        status=status,
        error=error or None,
        stream=ex.stream,
        ttft_ms=round((first - started) * ms, 3) if ex.stream and first is not None else None,
        duration_ms=round((finished - started) * ms, 3),
        input_tokens=usage.prompt_tokens if usage is not None else None,
        output_tokens=usage.completion_tokens if usage is not None else None,
        cached_tokens=usage.cached_tokens if usage is not None else None,
        trace_id=trace_id,
        span_id=span_id,
        # A given-back 0 is no estimate (a hit, an error answer).
        tokens_estimated=not usage.exact and usage.total > 0 if usage is not None else None,
    )


_NO_CALL: Final = OriginCall()  # read only


def _placement(ex: Exchange) -> str | None:
    """What affinity placed the request by: the key's source, and the fleet's
    MAC of its hash (IdKeys.tag) when the table has the fleet's key. Not the
    hash itself: a CRC-32 of a `user` field or a session id gave the id back
    to a search of candidates (review of 8a4c023). A prefix key's
    conversation (Key.within) follows the prefix's tag after a "/": the
    prefix's tag alone made one preamble's conversations look like one."""
    key = ex.placement
    if key is None:
        return None
    keys = ex.routes.id_keys
    if keys is None:
        return key.source
    tag = f"{key.source}:{keys.tag(b'placement', key.value)}"
    return tag if key.within is None else f"{tag}/{keys.tag(b'placement', key.within)}"


def _asked_model(body: dict[str, Any]) -> str | None:
    """The model a request named, before or without being found served (a 404
    names it), cut and redacted like the path: the log keeps what was asked
    for."""
    model = body.get("model")
    return _quoted(model) if isinstance(model, str) else None


def _quoted(text: str) -> str:
    """A client's text as a line holds it: cut to MAX_PATH characters, and a
    key or token in it redacted (refusals.redact_credentials): a credential
    pasted as the model, or into a path, is the client's mistake, which must
    not put it in every log pipeline the access log feeds."""
    return redact_credentials(text[:MAX_PATH])


# The proxy's own endpoints (route names) whose successful answers are
# probes and scrapes, left out unless --access-log-probes on.
PROBES: Final = frozenset({"healthz", "health", "readyz", "metrics"})


class Sampler:
    """Which answers get a line: see the module docstring. `rng` returns a
    float in [0, 1) (random.random by default); `probes`: whether successful
    answers of PROBES get one."""

    __slots__ = ("_rng", "probes", "rate")

    def __init__(
        self, rate: float = 1.0, rng: Callable[[], float] = random.random, *, probes: bool = False
    ) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"the access log's sample rate must be in (0, 1], not {rate}")
        self.rate = rate
        self.probes = probes
        self._rng = rng

    def __call__(self, error: str, endpoint: str = "") -> bool:
        """Whether the answer with `error` (its error code, "" for none) of
        `endpoint` (its route's name) gets a line."""
        if error:
            return True
        if not self.probes and endpoint in PROBES:
            return False
        return self.rate >= 1.0 or self._rng() < self.rate


class AccessLog:
    """Buffers access lines and writes them to `fd` (standard output).

    One per app, used from its event loop only. `start` (at start) makes a
    pipe or socket non-blocking; `close` (at stop) writes what it can. While
    `fd` takes nothing (BlockingIOError, or a partial write), the rest waits in
    a backlog of at most MAX_BACKLOG bytes and is retried on the next flush;
    lines that do not fit are dropped and counted in `dropped`. Any other
    write error (standard output closed) turns the log off with one ERROR
    line: the proxy keeps serving.
    """

    def __init__(
        self,
        region: str,
        trusted: TrustedProxies,
        sampler: Sampler | None = None,
        *,
        fd: int = 1,
        write: Callable[[int, bytes], int] = os.write,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        call_later: Callable[[float, Callable[[], None]], asyncio.Handle] | None = None,
    ) -> None:
        self.region = region  # the proxy's
        self.trusted = trusted  # whose forwarding headers name the client
        self.sampled = sampler or Sampler()
        self.clock = clock  # wall time, for the records' `ts`
        self.dropped = 0  # lines dropped because the backlog was full
        self._monotonic = monotonic
        self._fd = fd
        self._write = write
        self._lines: list[bytes] = []
        self._size = 0
        # Written batches `fd` has not taken yet (the first maybe in part).
        self._backlog: list[bytes] = []
        self._warned_at: float | None = None
        self._dropped_warned = 0
        # The running loop's call_later unless a test gives its own.
        self._call_later = call_later
        self._timer: asyncio.Handle | None = None
        self._broken = False

    def start(self, stderr: int = 2) -> None:
        """Make `fd` non-blocking when it is a pipe or a socket, unless it is
        the same one as `stderr`: the flag belongs to the open pipe, and the
        human log's writes (which block on a stalled reader anyway) must not
        start failing. The process's siblings share the pipe and its flag;
        they write the same way."""
        mode = os.fstat(self._fd)
        if not (stat.S_ISFIFO(mode.st_mode) or stat.S_ISSOCK(mode.st_mode)):
            return
        try:
            other = os.fstat(stderr)
        except OSError:  # no standard error at all
            other = None
        if other is not None and (other.st_dev, other.st_ino) == (mode.st_dev, mode.st_ino):
            return
        os.set_blocking(self._fd, False)

    def write(self, rec: AccessRecord) -> None:
        """Queue one line; written within FLUSH_AFTER_S (needs a running loop)."""
        if self._broken:
            return
        line = rec.line()
        self._lines.append(line)
        self._size += len(line)
        if self._size >= MAX_BATCH:
            self.flush()
        else:
            self._schedule()

    def flush(self) -> None:
        """Write the backlog, then every queued line, in whole-line writes, as
        far as `fd` takes them now; never waits for it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._lines, self._size = self._lines, [], 0
        pending = self._backlog
        self._backlog = []
        pending.extend(batches(lines, ATOMIC_WRITE))
        done = 0  # batches written whole
        rest = b""
        try:
            for batch in pending:
                rest = batch
                while rest:
                    written = self._write(self._fd, rest)
                    rest = rest[written:]
                    if rest and not written:
                        raise BlockingIOError
                done += 1
        except BlockingIOError:
            self._keep(rest, pending[done + 1 :])
        except OSError as exc:
            self._broken = True
            log.error("access log off: cannot write to fd %d: %s", self._fd, exc)
            return
        if self._backlog:
            self._schedule()
        self._warn_dropped()

    def close(self) -> None:
        self.flush()

    def _schedule(self) -> None:
        if self._timer is None:
            call_later = self._call_later or asyncio.get_running_loop().call_later
            self._timer = call_later(FLUSH_AFTER_S, self.flush)

    def _keep(self, partial: bytes, batches_left: list[bytes]) -> None:
        """Hold what `fd` did not take: the rest of a batch begun (always, so
        no line is cut in two), then whole batches while they fit."""
        size = len(partial)
        kept = [partial]
        for batch in batches_left:
            if size + len(batch) > MAX_BACKLOG:
                self.dropped += batch.count(b"\n")
                continue
            kept.append(batch)
            size += len(batch)
        self._backlog = kept

    def _warn_dropped(self) -> None:
        new = self.dropped - self._dropped_warned
        if not new:
            return
        now = self._monotonic()
        if self._warned_at is not None and now - self._warned_at < DROP_WARNING_EVERY_S:
            return
        self._warned_at = now
        self._dropped_warned = self.dropped
        log.warning(
            "access log: %d line(s) dropped: standard output does not keep up (%d since start)",
            new,
            self.dropped,
        )


def batches(lines: list[bytes], limit: int) -> list[bytes]:
    """`lines` joined into as few writes as possible of at most `limit` bytes
    each, every write whole lines; a longer line is a write of its own."""
    out: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        if current and size + len(line) > limit:
            out.append(b"".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        out.append(b"".join(current))
    return out
