"""The cache step of the request pipeline: decides how a request is answered.

    decide (tenant policy, Cache-Control, determinism)
      bypass -> origin, `x-ponto-cache: bypass`
      lookup -> exact entry (local, then region)? -> replay, `hit`
             -> semantic neighbour?     -> replay, `hit` + similarity
                (not for a request that offers tools, whose miss says `tools`,
                nor from a neighbour whose answer calls one: policy.Reason.TOOLS)
                (error-bounded tenants: or `miss` with reason `verify`, a would-be
                hit checked against the origin's answer; or a near miss whose
                origin answer is compared with the neighbour's, to learn from)
             -> identical request in flight here? -> follow it (same chunks), `hit`
             -> identical request in flight on another proxy of the region
                (non-streaming only)?   -> wait for its entry, `hit`
             -> lead: origin call, recorded; stored only if it ended properly

An entry that cannot answer the request in full is no hit: a stream recorded
for a request that did not ask for usage, and without any, for a request that
asks (stream_options.include_usage; the key leaves stream_options out) or for
a non-streaming one (a whole answer always has its usage). The request is then
a miss with reason `no-usage`, and its answer, recorded with usage, replaces
the entry.

Every hit says its tier (`CachePlan.tier`): `local` when the entry was in this
proxy's memory (or came from this proxy's own flight), `region` when it came
from the region's Redis (dataplane.cache.regionstore), directly or by waiting
for another proxy's flight. A streaming request never waits for another
proxy's flight: that would hold its first token until the whole answer is
stored, which costs a streaming client more than an origin call of its own; it
still takes the region's lock when it is free and it asks for usage, so
non-streaming requests elsewhere can wait for it (an answer without usage
would be of no use to them).

`EdgeCache.plan` returns a `CachePlan`; the pipeline answers accordingly
(`dataplane.http.reply`) and hands the outcome back (`settle_body`,
`settle_stream`). The cache never calls an origin or writes to a client.

Replays keep the stored form's chunking: a stored stream answers a streaming
request with its own chunks and a non-streaming one with the assembled body;
a stored body answers a stream as several synthesised chunks.

One per app; all state lives on the app's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from dataplane.cache.bounded import Action, answer_of
from dataplane.cache.coalesce import Coalescer, Follower, Leader
from dataplane.cache.entry import (
    CONTINUED,
    INCOMPLETE,
    TOO_LARGE,
    TRUNCATED,
    CachedResponse,
    StreamRecorder,
    body_unkept_reason,
    holds_tool_calls,
    judge_completion,
    to_completion,
    unkept_reason,
)
from dataplane.cache.keys import (
    UncacheableRequest,
    cache_key,
    context_hash,
    last_user_text,
    without_text,
)
from dataplane.cache.policy import (
    TOO_LARGE_TO_KEY,
    UNKEYABLE,
    CacheMode,
    Reason,
    RequestCacheControl,
    decide,
)
from dataplane.cache.regionstore import RegionalStore, RegionLock
from dataplane.cache.store import UNANSWERED, ExactStore, Found
from dataplane.metrics import Metrics
from dataplane.offload import OFF_LOOP_ABOVE, OffLoop
from dataplane.policy import EdgePolicy, TenantRules
from dataplane.streaming.relay import RelayEnd
from dataplane.streaming.usage import asks_usage

if TYPE_CHECKING:  # numpy and the model load only when semantic caching is on
    from dataplane.cache.bounded import Answer
    from dataplane.cache.semantic import SemanticHit

log = logging.getLogger(__name__)

NO_DIRECTIVES = RequestCacheControl()

# The reasons of a miss (x-ponto-cache-reason, the `kind` of a miss in
# ponto_cache_requests_total): a would-be semantic hit checked against the
# origin; an entry without the usage the request asks for.
VERIFY = "verify"
NO_USAGE = "no-usage"
# A request with `Cache-Control: only-if-cached` that no entry answers: 504,
# no origin called (RFC 9111 5.2.1.7).
ONLY_IF_CACHED = "only-if-cached"
# An answer not kept, as x-ponto-cache-reason says it: the header's tokens are
# hyphenated (dataplane.cache.policy.Reason), ponto_cache_unkept_total's
# reasons are not, and too-large is taken (a request too large to key).
UNKEPT_SAID: Final = {TOO_LARGE: "answer-too-large"}
# Why a stream's answer was not kept that its repeat will meet again (the
# same request gives the same answer: a cacheable one is deterministic), as
# remembered by key for the repeat's headers (`CachePlan.foreseen`); a cut
# or a splice (incomplete, continued) is the call's accident, not the key's.
FORESEEN: Final = frozenset({TOO_LARGE, TRUNCATED})
# Keys of streams not kept for those reasons, per process: a dict of this
# many keys (some 100 bytes each), the oldest forgotten first.
MAX_FORESEEN_KEYS: Final = 4096
# Read on every request: an enum member read through its class costs some
# 1,000 instructions on Python 3.11 (see dataplane.cache.policy.decide).
_TOOLS: Final = Reason.TOOLS


class SemanticLayer(Protocol):
    """What the cache needs of the semantic index (dataplane.cache.semantic)."""

    async def lookup(
        self,
        tenant: str,
        model: str,
        context_hash: str,
        text: str,
        threshold: float,
        max_error: float = 0.0,
    ) -> SemanticHit | None: ...

    async def check(
        self, key: str, similarity: float, cached: Answer, fresh: Answer
    ) -> bool | None: ...

    async def insert(
        self, tenant: str, model: str, context_hash: str, text: str, key: str
    ) -> None: ...

    def may_fit(self, text: str) -> bool: ...

    def remove(self, key: str) -> bool: ...

    def close(self) -> None: ...

    def purge(self, tenant: str | None = None, model: str | None = None) -> int: ...


@dataclass(slots=True)
class CacheRequest:
    """One request as the cache sees it, after auth, assembly and admission."""

    endpoint: str
    body: dict[str, Any]
    tenant: TenantRules
    stream: bool
    # The request's Cache-Control header(s), joined; "" without one.
    cache_control: str = ""
    # The client headers forwarded to origins: they can change the answer.
    headers: Mapping[str, str] = field(default_factory=dict)
    # False for a body of too many JSON values to key at a bounded cost.
    keyable: bool = True
    # The body's bytes as sent: past OFF_LOOP_ABOVE its key is made off the
    # event loop (dataplane.offload).
    size: int = 0


Outcome = Literal["hit", "miss", "bypass"]
# A large request's key made off the loop (None: it has none), and its
# semantic namespace ("" when not made): EdgeCache._keyed.
Keyed = tuple[str | None, str]


class CachePlan:
    """What the cache step decided for one request; the pipeline carries it out.

    Exactly one way to answer: from `entry` (a hit), by following another
    request's origin call (`follower`), or by calling an origin; in the last
    case the answer is stored under `key` when it is set (a miss), through
    `settle_body` or `settle_stream`. `abandon` must run whatever happens, so a
    flight this request leads never leaves its followers waiting.

    Made with its outcome and the few fields every plan names; the rest
    start at their defaults (below) and are set by the maker. A plain
    slotted class, not a dataclass: one is made every request, and a
    dataclass's __init__ took each of its 21 fields as a keyword argument
    (some 8,800 instructions a miss's plan against 3,700, callgrind on a
    loop). A field added is added to __slots__ too.
    """

    __slots__ = (
        "age_s",
        "context",
        "entry",
        "follower",
        "foreseen",
        "include_usage",
        "key",
        "kind",
        "leader",
        "neighbour",
        "not_cached",
        "outcome",
        "purge_mark",
        "reason",
        "recorder",
        "region_lock",
        "similarity",
        "text",
        "tier",
        "unkept",
        "waited_s",
    )

    def __init__(
        self, outcome: Outcome, reason: str = "", kind: str = "", include_usage: bool = False
    ) -> None:
        self.outcome = outcome  # the x-ponto-cache header
        # Why a bypass: the policy's reason (dataplane.cache.policy.Reason), a
        # short stable token sent as x-ponto-cache-reason; for a miss, VERIFY
        # (a would-be semantic hit checked against the origin) or NO_USAGE (an
        # entry without the usage the request asks for).
        self.reason = reason
        # How a hit was found: exact, semantic or coalesced (a follower).
        self.kind = kind
        self.include_usage = include_usage
        self.entry: CachedResponse | None = None
        self.similarity: float | None = None
        self.follower: Follower | None = None
        self.key = ""
        self.leader: Leader | None = None
        self.recorder: StreamRecorder | None = None
        # The semantic layer's namespace and text, when the answer is to be
        # indexed.
        self.context = ""
        self.text = ""
        # Where a hit's entry came from: local or region ("" for no hit).
        self.tier = ""
        # A hit's entry's age in whole seconds, by this proxy's clock (its Age
        # header, RFC 9111 5.1).
        self.age_s = 0
        # The region-wide flight lock this request holds, released once its
        # answer is stored (or it failed).
        self.region_lock: RegionLock | None = None
        # Error-bounded tenants: the neighbour, and its entry, whose answer the
        # origin's is compared with once it arrives (a verification, or a near
        # miss to learn from).
        self.neighbour: tuple[SemanticHit, CachedResponse] | None = None
        # Seconds spent waiting for another proxy's flight that left no
        # answer: the origin call gets what remains of the request's deadline.
        self.waited_s = 0.0
        # The newest purge this proxy had run when the origin call was
        # decided: an answer that comes back after a newer one may predate it
        # and is not kept.
        self.purge_mark: int | None = None
        # Why the origin's 200 answer of a keyed request is not kept
        # (dataplane.cache.entry: truncated, too_large, continued, incomplete),
        # "" while it is or is not known: a whole answer's is known before its
        # headers go out (x-ponto-cache-reason), a stream's at its end (the
        # access log).
        self.unkept = ""
        # The request said `Cache-Control: only-if-cached` and nothing in the
        # cache answers it: the pipeline answers 504 and calls no origin.
        self.not_cached = False
        # A stream's miss: why the last answer of its key was not kept on this
        # proxy process (FORESEEN), for the headers that go out before this
        # answer's end; "" when none was refused, or not for those reasons.
        self.foreseen = ""

    @property
    def said_reason(self) -> str:
        """The access log's cache_reason: why a bypass, or a miss, or why the
        miss's answer is not kept ("")."""
        if self.unkept and self.reason == _TOOLS:
            # An answer not kept misses every repeat, exact ones too: that
            # says more than "matched exactly only".
            return UNKEPT_SAID.get(self.unkept, self.unkept)
        return self.reason or UNKEPT_SAID.get(self.unkept, self.unkept)

    @property
    def header_reason(self) -> str:
        """x-ponto-cache-reason: `said_reason`, else (a stream's headers go
        out before its answer is known) why its key's last answer was not
        kept (trial: a repeat of a stream too large to keep was a plain miss)."""
        if not (self.reason or self.unkept or self.foreseen):
            return ""  # the usual miss: said_reason's call (and its lookup) spared
        said = self.said_reason
        if self.foreseen and (not said or (self.reason == _TOOLS and not self.unkept)):
            # As for an answer not kept: the repeats of this key miss too.
            return UNKEPT_SAID.get(self.foreseen, self.foreseen)
        return said

    def abandon(self, error: BaseException | None = None) -> None:
        """Report a failure to the flight this request leads, unless it finished;
        leave the flight it follows."""
        if self.follower is not None:
            self.follower.leave()
        if self.leader is not None and not self.leader.finished:
            self.leader.finish(None, error or RuntimeError("the leading request ended early"))
        if self.region_lock is not None:
            self.region_lock.release()


class EdgeCache:
    """The cache step. `store` is this proxy's ExactStore, or a RegionalStore
    that puts the region's Redis behind it (and then coalesces across proxies:
    a non-streaming request waits up to `region_wait_s` for another proxy's
    flight on the same key)."""

    def __init__(
        self,
        store: ExactStore | RegionalStore,
        metrics: Metrics,
        *,
        coalescer: Coalescer | None = None,
        semantic: SemanticLayer | None = None,
        semantic_factory: Callable[[], SemanticLayer] | None = None,
        forward_headers: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
        region_wait_s: float = 60.0,
        off_loop: OffLoop | None = None,
    ) -> None:
        self.store = store
        # Where a large request's key is made (dataplane.offload).
        self._off_loop = off_loop if off_loop is not None else OffLoop()
        self.region = store if isinstance(store, RegionalStore) else None
        # This proxy's own store when it is the only tier: asked by plain
        # calls (its `*_now`), not the protocol's coroutines, which never wait.
        self._local = store if isinstance(store, ExactStore) else None
        self._region_wait = region_wait_s
        # The embedding model costs memory and start-up time: it is loaded (off
        # the event loop) only once a tenant turns semantic caching on.
        self._semantic_factory = semantic_factory
        self._semantic_loading = False
        store.on_evict = self._evicted
        # Client headers passed to origins can change the answer: they are
        # part of the key.
        self._forward_headers = tuple(h.lower() for h in forward_headers)
        self.coalescer = coalescer or Coalescer()
        self.semantic = semantic
        self._metrics = metrics
        self._clock = clock
        self._purged_to: int | None = None
        # Work that runs after the client has its answer (answer comparisons,
        # semantic indexing); kept here so it is not collected before it ends.
        self._background: set[asyncio.Task[None]] = set()
        # Keys being indexed: False once evicted meanwhile (see _index).
        self._indexing: dict[str, bool] = {}
        # Key -> why its stream was last not kept (FORESEEN), in the order
        # remembered; at most MAX_FORESEEN_KEYS (see settle_stream).
        self._foreseen: dict[str, str] = {}

    # ------------------------------------------------------------ control

    def _evicted(self, key: str, reason: object) -> None:
        if key in self._indexing:
            self._indexing[key] = False
        if self.semantic is not None:
            self.semantic.remove(key)

    def _load_semantic(self) -> None:
        factory = self._semantic_factory
        if self.semantic is not None or self._semantic_loading or factory is None:
            return
        self._semantic_loading = True
        loop = asyncio.get_running_loop()

        def done(future: asyncio.Future[SemanticLayer]) -> None:
            self._semantic_loading = False
            try:
                self.semantic = future.result()
                log.info("semantic cache ready")
            except Exception as exc:  # a missing model must not stop the proxy
                log.error("semantic cache unavailable, exact only: %s", exc)

        loop.run_in_executor(None, factory).add_done_callback(done)

    def on_policy(self, policy: EdgePolicy) -> None:
        """Run the purges of a new table that this proxy has not run yet, and load
        the embedding model the first time a tenant asks for semantic caching.

        The first table after start only sets the purge mark: the cache is empty.
        """
        wants_semantic = any(
            t.cache.mode is CacheMode.SEMANTIC for t in (*policy.tenants.values(), policy.default)
        )
        if wants_semantic:
            with contextlib.suppress(RuntimeError):  # no loop yet: the next table
                self._load_semantic()
        if self.region is not None:
            # Before the purges below run: new entries go to the new epoch.
            self.region.set_purges(policy.purges)
        newest = max((rev for rev, _, _ in policy.purges), default=0)
        if self._purged_to is None:
            self._purged_to = newest
            return
        for rev, tenant, model in policy.purges:
            if rev > self._purged_to:
                asyncio.get_running_loop().create_task(self.purge(tenant or None, model or None))
        self._purged_to = max(self._purged_to, newest)

    def close(self) -> None:
        """Stop the semantic index's embedding thread, if it was loaded."""
        if self.semantic is not None:
            self.semantic.close()

    async def purge(self, tenant: str | None, model: str | None) -> int:
        dropped = await self.store.purge(tenant=tenant, model=model)
        if self.semantic is not None:
            self.semantic.purge(tenant, model)
        log.info("cache purge tenant=%s model=%s: %d entries", tenant or "*", model or "*", dropped)
        return dropped

    # ------------------------------------------------------------ requests

    async def plan(self, req: CacheRequest) -> CachePlan:
        """Decide how `req` is answered: see the module docstring."""
        planned = self.plan_now(req)
        return planned if isinstance(planned, CachePlan) else await planned

    def plan_now(
        self, req: CacheRequest, keyed: Keyed | None = None
    ) -> CachePlan | Coroutine[Any, Any, CachePlan]:
        """`plan`'s answer when it needs no wait, else a coroutine that
        finishes it (a lookup in an async store or the semantic index, or a
        region's flight to claim, or a large request's key: `_plan_off_loop`).
        Most requests wait for none: a plain call, where a coroutine that
        never waits costs some 1,000 instructions more (the pipeline's, every
        request). The same plan either way; the caller owns the coroutine (it
        must be awaited). `keyed` is `_keyed`'s, when it made the key."""
        policy = req.tenant.cache
        cc = RequestCacheControl.parse(req.cache_control) if req.cache_control else NO_DIRECTIVES
        decision = decide(policy, req.endpoint, req.body, cc)
        key = ""
        if (decision.lookup or decision.store) and not req.keyable:
            decision = TOO_LARGE_TO_KEY
        if decision.lookup or decision.store:
            if keyed is not None:
                if keyed[0] is None:
                    decision = UNKEYABLE
                else:
                    key = keyed[0]
            elif req.size > OFF_LOOP_ABOVE:
                # Its namespace only when it is matched by meaning: a last
                # user message without text, or past the embedder's window,
                # is not, and the namespace is a walk of the whole body more.
                semantic = (
                    decision.semantic
                    and self.semantic is not None
                    and bool(last_user_text(req.body["messages"], self.semantic.may_fit))
                )
                return self._plan_off_loop(req, semantic)
            else:
                try:
                    key = self._key(req)
                except UncacheableRequest:
                    decision = UNKEYABLE
        if not (decision.lookup or decision.store):
            self._count("bypass", decision.reason.value)
            bypass = CachePlan("bypass", decision.reason.value)
            bypass.not_cached = cc.only_if_cached
            return bypass
        include_usage = asks_usage(req.body)
        context = text = ""
        if decision.semantic and self.semantic is None:
            self._load_semantic()  # e.g. a saved table applied before the loop ran
        if decision.semantic and self.semantic is not None:
            # A text past the embedder's window (a pasted document) is never
            # matched by meaning: told from its words before it is normalised,
            # which took 0.4 s of the loop for an 8 MB prompt (trial 89).
            text = last_user_text(req.body["messages"], self.semantic.may_fit) or ""
            if text:
                context = self._context(req) if keyed is None or not keyed[1] else keyed[1]
        # Why this request misses, when an entry was there but could not
        # answer, or when a semantic tenant's request was matched exactly only.
        miss = decision.reason.value if decision.reason is _TOOLS else ""
        if not decision.lookup:
            if cc.only_if_cached:  # no-cache (or max-age=0) with only-if-cached
                return self._not_cached()
            return self._fill(req, key, None, context, text, include_usage, None, miss)
        local = self._local
        if local is None or text:
            return self._looked_up(req, cc, key, include_usage, context, text, miss)
        hit = local.lookup_now(key)
        if isinstance(hit, Found) and self._accepts(cc, hit, policy.ttl_s):
            if hit.entry.answers(include_usage=_wants_usage(include_usage, req.stream)):
                return self._hit(hit, "exact", include_usage)
            miss = NO_USAGE  # the request's own entry, refreshed by this miss
        return self._flight(req, cc, key, include_usage, context, text, None, miss)

    async def _plan_off_loop(self, req: CacheRequest, semantic: bool) -> CachePlan:
        """`plan_now` of a large request: its key (and its semantic namespace
        when its tenant matches by meaning) made off the event loop, each a
        walk over the whole body; then the plan as any other's. Cancelled
        (its client left) while they are made, it has joined no flight, and
        the thread's result is dropped."""
        keyed = await self._off_loop.run(self._keyed, req, semantic)
        planned = self.plan_now(req, keyed)
        return planned if isinstance(planned, CachePlan) else await planned

    def _keyed(self, req: CacheRequest, semantic: bool) -> Keyed:
        """`req`'s key, None when it has none (UncacheableRequest), and with
        `semantic` its namespace (`_context`; "" without). Pure: run on the
        off-loop thread."""
        try:
            key = self._key(req)
        except UncacheableRequest:
            return None, ""
        return key, self._context(req) if semantic else ""

    async def _looked_up(
        self,
        req: CacheRequest,
        cc: RequestCacheControl,
        key: str,
        include_usage: bool,
        context: str,
        text: str,
        miss: str,
    ) -> CachePlan:
        """`plan_now`'s lookup that waits: in an async store (no local one),
        or for a semantic neighbour of `text` too."""
        policy = req.tenant.cache
        tenant, model = req.tenant.name, req.body["model"]
        wants_usage = _wants_usage(include_usage, req.stream)
        neighbour: tuple[SemanticHit, CachedResponse] | None = None
        local = self._local
        hit = (
            local.lookup_now(key)
            if local is not None
            else await self.store.lookup(key, tenant=tenant, model=model)
        )
        if isinstance(hit, Found) and self._accepts(cc, hit, policy.ttl_s):
            if hit.entry.answers(include_usage=wants_usage):
                return self._hit(hit, "exact", include_usage)
            # The request's own entry, refreshed by this miss: no neighbour
            # is sought in its place.
            miss = NO_USAGE
        if text and self.semantic is not None and not miss:
            found = await self.semantic.lookup(
                tenant,
                model,
                context,
                text,
                policy.semantic_threshold,
                policy.semantic_max_error,
            )
            if found is not None:
                near = await self.store.lookup(found.key, tenant=tenant, model=model)
                if near is UNANSWERED:
                    pass  # the region could not say: a miss, the pointer stays
                elif near is None or not cc.accepts_age(self._clock() - near.entry.created_at):
                    self.semantic.remove(found.key)  # its answer is gone
                elif not self._accepts(cc, near, policy.ttl_s):
                    pass  # not fresh enough for this request: sound for others
                elif holds_tool_calls(near.entry):
                    # An action is no answer to a near question. Such
                    # answers are not indexed (`_keep`), but an older
                    # proxy of the region may have (the feed replays
                    # its entries), or the key's answer was replaced.
                    self.semantic.remove(found.key)
                elif found.action is Action.HIT:
                    if near.entry.answers(include_usage=wants_usage):
                        plan = self._hit(near, "semantic", include_usage)
                        plan.similarity = found.similarity
                        return plan
                    miss = NO_USAGE  # the pointer stays: its entry is sound
                elif found.action in (Action.VERIFY, Action.OBSERVE):
                    neighbour = (found, near.entry)
        planned = self._flight(req, cc, key, include_usage, context, text, neighbour, miss)
        return planned if isinstance(planned, CachePlan) else await planned

    def _flight(
        self,
        req: CacheRequest,
        cc: RequestCacheControl,
        key: str,
        include_usage: bool,
        context: str,
        text: str,
        neighbour: tuple[SemanticHit, CachedResponse] | None,
        miss: str,
    ) -> CachePlan | Coroutine[Any, Any, CachePlan]:
        """The plan of a lookup that missed: the key's flight followed or
        led (a coroutine with a region, whose flight is claimed first)."""
        if cc.only_if_cached:
            return self._not_cached()
        # Joining is synchronous: of identical requests that reach it while
        # a flight is open, one leads and the rest follow (see Coalescer).
        # One whose lookup suspended (Redis, the semantic index) and missed
        # just before a flight ended may call again: a duplicate origin
        # call, never a wrong answer.
        flight = self._join(key, include_usage, req.stream)
        if isinstance(flight, Follower):
            return _following(flight, key, include_usage, context, text, neighbour)
        if self.region is None:  # _lead's plan, without its coroutine
            return self._fill(req, key, flight, context, text, include_usage, neighbour, miss)
        return self._lead(req, key, flight, include_usage, context, text, neighbour, miss)

    def _accepts(self, cc: RequestCacheControl, found: Found, ttl_s: float) -> bool:
        """Whether the request's max-age and min-fresh let `found` answer it.
        Its time left is its store's reckoning, else (a region entry the
        local tier did not take) the tenant's TTL less its age."""
        age = self._clock() - found.entry.created_at
        fresh = found.fresh_s if found.fresh_s is not None else ttl_s - age
        return cc.accepts(age, fresh)

    def _not_cached(self) -> CachePlan:
        self._count("miss", ONLY_IF_CACHED)
        plan = CachePlan("miss", ONLY_IF_CACHED)
        plan.not_cached = True
        return plan

    async def _lead(
        self,
        req: CacheRequest,
        key: str,
        leader: Leader,
        include_usage: bool,
        context: str,
        text: str,
        neighbour: tuple[SemanticHit, CachedResponse] | None,
        miss: str,
    ) -> CachePlan:
        """The plan of the request that leads the key's flight on this proxy.
        With a region, it first claims the region's flight: a non-streaming
        request whose key another proxy is calling for waits for that answer
        (a coalesced hit, which its local followers take too). A stream that
        does not ask for usage claims nothing: its answer has none, so it
        would serve no request that waits (only whole answers wait, and those
        always carry their usage); a whole answer waited it out and then
        called the origin after all (trial 21)."""
        region_lock: RegionLock | None = None
        waited = 0.0
        if self.region is not None and _wants_usage(include_usage, req.stream):
            tenant, model = req.tenant.name, req.body["model"]
            try:
                claim = await self.region.claim(key, tenant, model)
                if claim is False and not req.stream:
                    loop = asyncio.get_running_loop()
                    began = loop.time()
                    entry = await self.region.follow(
                        key, tenant, model, max_wait_s=self._region_wait
                    )
                    # A whole answer is asked for, which always has its usage.
                    if entry is not None and entry.answers(include_usage=True):
                        leader.finish(entry)  # local followers take it too
                        return self._hit(Found(entry, "region"), "coalesced", include_usage)
                    if entry is not None:
                        miss = NO_USAGE
                    waited = loop.time() - began
                elif isinstance(claim, RegionLock):
                    region_lock = claim
            except BaseException as exc:  # the client went away while waiting
                leader.finish(None, exc)
                raise
        plan = self._fill(req, key, leader, context, text, include_usage, neighbour, miss)
        plan.region_lock = region_lock
        plan.waited_s = waited
        return plan

    def _hit(self, found: Found, kind: str, include_usage: bool) -> CachePlan:
        self._count("hit", kind)
        self._metrics.cache_hits.labels(found.tier).inc()
        plan = CachePlan("hit", "", kind, include_usage)
        plan.entry = found.entry
        plan.tier = found.tier
        plan.age_s = max(0, int(self._clock() - found.entry.created_at))
        return plan

    async def own_call(self, req: CacheRequest, plan: CachePlan) -> CachePlan:
        """A follower whose flight failed before it got a byte calls an origin
        itself; its answer is stored and indexed as the leader's would have been.

        When the flight's leader was cancelled (`Follower.leader_left`), the
        follower joins the key's flight again, before any await: the first to
        do so leads a new one (as `plan`'s leader: the region's flight claimed
        first, then a miss with a leader), the others follow it (a coalesced
        hit to follow again). After an origin failure each calls on its own,
        without a flight."""
        key, include_usage = plan.key, plan.include_usage
        context, text, neighbour = plan.context, plan.text, plan.neighbour
        follower = plan.follower
        if follower is not None and follower.leader_left:
            flight = self._join(key, include_usage, req.stream)
            if isinstance(flight, Follower):
                return _following(flight, key, include_usage, context, text, neighbour)
            return await self._lead(req, key, flight, include_usage, context, text, neighbour, "")
        return self._fill(req, key, None, context, text, include_usage, neighbour)

    def _join(self, key: str, include_usage: bool, stream: bool) -> Leader | Follower:
        """The key's flight; requests that want usage (see `plan`) fly apart
        from those that do not."""
        return self.coalescer.join(key + ("+usage" if _wants_usage(include_usage, stream) else ""))

    def _fill(
        self,
        req: CacheRequest,
        key: str,
        leader: Leader | None,
        context: str,
        text: str,
        include_usage: bool,
        neighbour: tuple[SemanticHit, CachedResponse] | None,
        reason: str = "",
    ) -> CachePlan:
        if neighbour is not None and neighbour[0].action is Action.VERIFY:
            reason = VERIFY
        self._count("miss", reason or "exact")
        policy = req.tenant.cache
        recorder = None
        foreseen = ""
        if req.stream:
            recorder = StreamRecorder(
                store_truncated=policy.store_truncated,
                max_bytes=policy.max_entry_bytes,
                usage_asked=include_usage,
            )
            foreseen = self._foreseen.get(key, "")
        plan = CachePlan("miss", reason, "", include_usage)
        plan.key = key
        plan.leader = leader
        plan.recorder = recorder
        plan.context = context
        plan.text = text
        plan.neighbour = neighbour
        plan.purge_mark = self._purged_to
        plan.foreseen = foreseen
        return plan

    def whole_entry(
        self, req: CacheRequest, plan: CachePlan, status: int, body: bytes, obj: Any
    ) -> CachedResponse | None:
        """The entry a non-streamed answer makes (`obj` is `body` parsed, or
        None if it is not JSON): one for a complete 200 of a keyed request,
        None otherwise, with `plan.unkept` saying why a 200 is not kept (the
        pipeline asks before the answer's headers are made, so that a client
        whose repeats all miss is told why: trial 24)."""
        if status != 200 or not plan.key:
            return None
        policy = req.tenant.cache
        entry, unkept = judge_completion(
            body,
            now=self._clock(),
            store_truncated=policy.store_truncated,
            max_bytes=policy.max_entry_bytes,
            parsed=obj,
        )
        if entry is None:
            # The finish reasons' refusal, when it was that, is the reason
            # without a second look at the body (judge_completion).
            plan.unkept = (
                unkept
                if unkept is not None
                else body_unkept_reason(
                    body,
                    obj,
                    max_bytes=policy.max_entry_bytes,
                    store_truncated=policy.store_truncated,
                )
            )
            self._metrics.cache_unkept.add(plan.unkept)
        return entry

    async def settle_body(
        self, req: CacheRequest, plan: CachePlan, entry: CachedResponse | None
    ) -> None:
        """Keep a non-streamed answer's entry (`whole_entry`'s) and tell the
        flight (`finish_flight`). Without an entry there is nothing to keep:
        the caller may call `finish_flight` alone, without this coroutine."""
        if entry is not None:  # else _keep keeps nothing: no coroutine for it
            if self._local is not None:
                self._keep_now(self._local, req, plan, entry)
            else:
                await self._keep(req, plan, entry)
        self.finish_flight(plan, entry)

    @staticmethod
    def finish_flight(plan: CachePlan, entry: CachedResponse | None) -> None:
        """Tell the flight `plan` leads, here and in the region, that its
        non-streamed answer is in (`entry`; None: none to share)."""
        if plan.leader is not None:
            plan.leader.finish(entry)
        if plan.region_lock is not None:
            plan.region_lock.release()

    async def settle_stream(
        self, req: CacheRequest, plan: CachePlan, status: int, end: RelayEnd
    ) -> None:
        """Keep a relayed 200 stream that ended properly as a complete, natural answer."""
        entry = None
        # A continued stream is complete but carries the splice's metadata,
        # and one the proxy ended carries its own finish or usage: served,
        # not stored.
        stored = end.complete and not end.continued and not end.ended
        recorder = plan.recorder
        if status == 200 and recorder is not None and plan.key:
            if stored:
                entry = recorder.finish(now=self._clock(), open_event=end.open_event)
            # A client that left is no answer the cache failed to keep; a
            # flight's leader whose client left had its stream finished for
            # its followers (complete), which is one.
            if entry is None and (end.complete or not end.client_gone):
                if end.continued:
                    plan.unkept = CONTINUED
                elif end.truncated and not req.tenant.cache.store_truncated:
                    # The proxy ended it at the budget (dataplane.http.resume):
                    # an answer cut by its max_tokens, as the origin's would be.
                    plan.unkept = TRUNCATED
                elif end.ended:
                    plan.unkept = INCOMPLETE
                else:
                    plan.unkept = unkept_reason(recorder.reason, too_large=recorder.too_large)
                self._metrics.cache_unkept.add(plan.unkept)
            self._foresee(plan.key, plan.unkept, kept=entry is not None)
        if self._local is not None:
            self._keep_now(self._local, req, plan, entry)
        else:
            await self._keep(req, plan, entry)
        if plan.leader is not None:
            if end.complete:
                plan.leader.finish(entry)
            else:
                plan.leader.finish(None, RuntimeError("the origin's stream did not end properly"))
        if plan.region_lock is not None:
            plan.region_lock.release()

    def _foresee(self, key: str, unkept: str, *, kept: bool) -> None:
        """Remember why `key`'s stream was not kept, for its repeat's headers
        (FORESEEN reasons only); forget it once one is kept. A cut stream
        (neither) changes nothing: what its whole answer would be is unknown."""
        foreseen = self._foreseen
        if unkept in FORESEEN:
            foreseen.pop(key, None)  # now the newest
            if len(foreseen) >= MAX_FORESEEN_KEYS:
                del foreseen[next(iter(foreseen))]
            foreseen[key] = unkept
        elif kept:
            foreseen.pop(key, None)

    async def _keep(self, req: CacheRequest, plan: CachePlan, entry: CachedResponse | None) -> None:
        if entry is None:
            return
        if plan.purge_mark != self._purged_to:
            # A purge arrived while the origin answered: the answer may be what
            # the purge was for, and the region would serve it for its whole TTL.
            return
        stored = await self.store.put(
            plan.key,
            entry,
            tenant=req.tenant.name,
            model=req.body["model"],
            ttl_s=req.tenant.cache.ttl_s,
        )
        if self.semantic is not None:
            self._semantic_kept(self.semantic, req, plan, entry, stored)

    def _keep_now(
        self, local: ExactStore, req: CacheRequest, plan: CachePlan, entry: CachedResponse | None
    ) -> None:
        """`_keep`'s steps for this proxy's own store, the only tier: by plain
        calls, as it never waits. Twins kept for speed: change both."""
        if entry is None or plan.purge_mark != self._purged_to:  # see _keep
            return
        stored = local.put_now(
            plan.key,
            entry,
            tenant=req.tenant.name,
            model=req.body["model"],
            ttl_s=req.tenant.cache.ttl_s,
        )
        if self.semantic is not None:
            self._semantic_kept(self.semantic, req, plan, entry, stored)

    def _semantic_kept(
        self,
        semantic: SemanticLayer,
        req: CacheRequest,
        plan: CachePlan,
        entry: CachedResponse,
        stored: bool,
    ) -> None:
        """After `entry` was put (`stored`: the store took it): its check
        against the neighbour the plan found, and its indexing, off the request."""
        model = req.body["model"]
        if plan.neighbour is not None:
            near, cached_entry = plan.neighbour
            self._after(self._check(semantic, near, cached_entry, entry))
        if stored and plan.text and not holds_tool_calls(entry):
            # Not an answer that calls a tool (a request without tools may
            # get one, from tools the origin adds): an action answers its own
            # question only, exactly (policy.Reason.TOOLS).
            # Indexing embeds the text (milliseconds on the embedder's thread,
            # more behind a queue): not in the request, which would hold its
            # concurrency slot and its coalesced followers after its client
            # had the whole answer, and lose the entry if cancelled then.
            self._after(self._index(semantic, req.tenant.name, model, plan))

    async def _index(
        self, semantic: SemanticLayer, tenant: str, model: str, plan: CachePlan
    ) -> None:
        """Index the question of an answer just stored. Not after a purge that
        came since, and taken out again when the store evicted the answer
        while it was being embedded (an entry pointing at nothing would hold
        index memory until a lookup found it). One insert per key at a time."""
        if plan.purge_mark != self._purged_to:
            return
        key = plan.key
        if key in self._indexing:
            # Another answer of the key is being indexed (followers calling on
            # their own, flights apart by usage): that insert serves this one
            # too, and is told the key is stored again. Two at once would each
            # pop the mark and the second would take the entry out.
            self._indexing[key] = True
            return
        self._indexing[key] = True
        try:
            await semantic.insert(tenant, model, plan.context, plan.text, key)
        finally:
            kept = self._indexing.pop(key, False)
        if not kept or plan.purge_mark != self._purged_to:
            semantic.remove(key)

    def _after(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on its own, kept until it ends (`background_done` waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._after_done)

    def _after_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("cache work after an answer failed", exc_info=exc)

    async def _check(
        self,
        semantic: SemanticLayer,
        near: SemanticHit,
        cached_entry: CachedResponse,
        entry: CachedResponse,
    ) -> None:
        """Compare an origin's answer (`entry`) with the neighbour's cached one,
        as the lookup found it, and let the semantic layer learn from it
        (error-bounded tenants)."""
        cached = answer_of(to_completion(cached_entry))
        fresh = answer_of(to_completion(entry))
        if cached is not None and fresh is not None:
            await semantic.check(near.key, near.similarity, cached, fresh)

    async def background_done(self) -> None:
        """Wait for the answer comparisons and semantic indexing started so far
        (tests; shutdown does not wait for them: a comparison lost at exit only
        loses one label, an insert one semantic entry)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _context(self, req: CacheRequest) -> str:
        """Everything but the text of the last user message, exactly: the
        semantic namespace.

        The exact key of the request with that text blanked covers the
        tenant, the model, every parameter, forwarded headers, every other
        message and the rest of that one (its images, its audio), so only the
        last user message's text is ever matched by meaning; `context_hash`
        adds the indentation of its lines (code).
        """
        original = req.body["messages"]
        messages = list(original)
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if isinstance(m, dict) and m.get("role") == "user":
                messages[i] = {**m, "content": without_text(m.get("content"))}
                break
        blanked = CacheRequest(
            req.endpoint,
            {**req.body, "messages": messages},
            req.tenant,
            False,
            headers=req.headers,
        )
        return context_hash(original) + ":" + self._key(blanked)

    def _key(self, req: CacheRequest) -> str:
        headers = None
        if self._forward_headers:
            headers = {h: v for h in self._forward_headers if (v := req.headers.get(h)) is not None}
        return cache_key(
            req.endpoint, req.body, tenant=req.tenant.name, model=req.body["model"], headers=headers
        )

    def count_coalesced(self) -> None:
        """A follower of this proxy's own flight was answered from it: whole,
        cut with it, or left by its client (all `hit` in the access log)."""
        self._count("hit", "coalesced")
        self._metrics.cache_hits.labels("local").inc()

    def _count(self, result: str, kind: str) -> None:
        self._metrics.cache_requests.add(result, kind)


def _following(
    follower: Follower,
    key: str,
    include_usage: bool,
    context: str,
    text: str,
    neighbour: tuple[SemanticHit, CachedResponse] | None,
) -> CachePlan:
    """The plan of a request that follows another's flight (a coalesced hit).
    It keeps what its own call would need (`EdgeCache.own_call`)."""
    plan = CachePlan("hit", "", "coalesced", include_usage)
    plan.follower = follower
    plan.key = key
    plan.tier = "local"
    plan.context = context
    plan.text = text
    plan.neighbour = neighbour
    return plan


__all__ = ["CachePlan", "CacheRequest", "EdgeCache", "SemanticLayer"]


def _wants_usage(include_usage: bool, stream: bool) -> bool:
    """Whether a request's answer must carry its usage: a whole answer always
    has it, as an origin's does, so a request for one asks for usage as a
    stream's include_usage does."""
    return include_usage or not stream
