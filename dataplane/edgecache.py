"""The cache step of the request pipeline: exact, then semantic, then one origin call.

    decide (tenant policy, Cache-Control, determinism)
      bypass -> origin, `x-ponto-cache: bypass`
      lookup -> exact entry?            -> replay, `hit`
             -> semantic neighbour?     -> replay, `hit` + similarity
             -> identical request in flight? -> follow it (same chunks), `hit`
             -> lead: origin call, recorded; stored only if it ended properly

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from dataplane.cache.coalesce import CacheTap, Coalescer, FlightFailed, Follower, Leader
from dataplane.cache.entry import (
    CachedResponse,
    StreamRecorder,
    from_completion,
    to_completion,
    to_sse_chunks,
)
from dataplane.cache.keys import (
    UncacheableRequest,
    cache_key,
    context_hash,
    last_user_text,
)
from dataplane.cache.policy import CacheMode, Decision, Reason, RequestCacheControl, decide
from dataplane.cache.store import ExactStore
from dataplane.metrics import Metrics
from dataplane.policy import EdgePolicy, TenantRules
from dataplane.upstream import StreamTap, sse_error_event
from dataplane.usage import Taps

if TYPE_CHECKING:  # numpy and the model load only when semantic caching is on
    from dataplane.cache.semantic import SemanticHit

log = logging.getLogger(__name__)

HEADER = "x-ponto-cache"
NO_DIRECTIVES = RequestCacheControl()
SIMILARITY = "x-ponto-cache-similarity"

# Calls the origins with a tap and extra response headers; raises ApiError.
OriginCall = Callable[[StreamTap | None, Sequence[tuple[str, str]]], Awaitable[web.StreamResponse]]


class SemanticLayer(Protocol):
    """What the cache needs of the semantic index (dataplane.cache.semantic)."""

    async def lookup(
        self, tenant: str, model: str, context_hash: str, text: str, threshold: float
    ) -> SemanticHit | None: ...

    async def insert(
        self, tenant: str, model: str, context_hash: str, text: str, key: str
    ) -> None: ...

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


class EdgeCache:
    def __init__(
        self,
        store: ExactStore,
        metrics: Metrics,
        *,
        coalescer: Coalescer | None = None,
        semantic: SemanticLayer | None = None,
        semantic_factory: Callable[[], SemanticLayer] | None = None,
        forward_headers: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
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

    # ------------------------------------------------------------ control

    def _evicted(self, key: str, reason: object) -> None:
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

    async def respond(self, request: web.Request, req: CacheRequest, origin: OriginCall,
                      usage_tap: StreamTap | None) -> web.StreamResponse:  # fmt: skip
        policy = req.tenant.cache
        header = request.headers.getall("cache-control", None)
        cc = RequestCacheControl.parse(", ".join(header)) if header else NO_DIRECTIVES
        decision = decide(policy, req.endpoint, req.body, cc)
        model = req.body["model"]
        key = ""
        if decision.lookup or decision.store:
            try:
                key = self._key(request, req)
            except UncacheableRequest:
                decision = Decision(False, False, Reason.NONDETERMINISTIC)
        if not (decision.lookup or decision.store):
            self._count("bypass", decision.reason)
            return await origin(usage_tap, ((HEADER, "bypass"),))
        include_usage = _include_usage(req.body)
        context = text = ""
        if decision.semantic and self.semantic is None:
            self._load_semantic()  # e.g. a saved table applied before the loop ran
        if decision.semantic and self.semantic is not None:
            text = last_user_text(req.body["messages"]) or ""
            if text:
                context = self._context(request, req)
        if decision.lookup:
            entry = await self.store.get(key)
            if entry is not None and cc.accepts_age(self._clock() - entry.created_at):
                self._count("hit", "exact")
                return await self._replay(request, entry, req.stream, include_usage, ())
            if text and self.semantic is not None:
                found = await self.semantic.lookup(
                    req.tenant.name, model, context, text, policy.semantic_threshold
                )
                if found is not None:
                    near = await self.store.get(found.key)
                    if near is not None and cc.accepts_age(self._clock() - near.created_at):
                        self._count("hit", "semantic")
                        similarity = ((SIMILARITY, f"{found.similarity:.4f}"),)
                        return await self._replay(
                            request, near, req.stream, include_usage, similarity
                        )
                    self.semantic.remove(found.key)  # its answer is gone
            flight = self.coalescer.join(key + ("+usage" if include_usage else ""))
            if isinstance(flight, Follower):
                return await self._follow(request, req, flight, include_usage, origin, usage_tap)
            with flight:
                return await self._lead(req, key, flight, origin, usage_tap, context, text)
        return await self._lead(req, key, None, origin, usage_tap, context, text)

    async def _lead(
        self,
        req: CacheRequest,
        key: str,
        leader: Leader | None,
        origin: OriginCall,
        usage_tap: StreamTap | None,
        context: str,
        text: str,
    ) -> web.StreamResponse:
        policy = req.tenant.cache
        self._count("miss", "exact")
        recorder: CacheTap | None = None
        tap = usage_tap
        if req.stream:
            recorder = CacheTap(
                StreamRecorder(
                    store_truncated=policy.store_truncated, max_bytes=policy.max_entry_bytes
                ),
                leader,
            )
            tap = Taps(usage_tap, recorder) if usage_tap is not None else recorder
        response = await origin(tap, ((HEADER, "miss"),))
        entry: CachedResponse | None = None
        now = self._clock()
        if response.status == 200:
            if recorder is not None:
                entry = recorder.recorder.finish(now=now) if recorder.complete else None
            elif isinstance(response, web.Response) and isinstance(response.body, bytes):
                entry = from_completion(
                    response.body,
                    now=now,
                    store_truncated=policy.store_truncated,
                    max_bytes=policy.max_entry_bytes,
                )
        if entry is not None:
            model = req.body["model"]
            stored = await self.store.put(
                key, entry, tenant=req.tenant.name, model=model, ttl_s=policy.ttl_s
            )
            if stored and text and self.semantic is not None:
                await self.semantic.insert(req.tenant.name, model, context, text, key)
        if leader is not None:
            if recorder is not None and not recorder.complete:
                leader.finish(None, RuntimeError("the origin's stream did not end properly"))
            else:
                leader.finish(entry)
        return response

    async def _follow(
        self,
        request: web.Request,
        req: CacheRequest,
        follower: Follower,
        include_usage: bool,
        origin: OriginCall,
        usage_tap: StreamTap | None,
    ) -> web.StreamResponse:
        headers = ((HEADER, "hit"), ("x-ponto-coalesced", "1"))
        out: web.StreamResponse | None = None
        try:
            with follower:
                if not req.stream:
                    entry = await follower.result()
                    self._count("hit", "coalesced")
                    return self._json(to_completion(entry), headers)
                async for chunk in follower:
                    if out is None:
                        out = await self._start_stream(request, headers)
                    await out.write(chunk)
                if out is None:  # the leader answered without streaming
                    entry = await follower.result()
                    out = await self._start_stream(request, headers)
                    for frame in to_sse_chunks(entry, include_usage=include_usage):
                        await out.write(frame)
                self._count("hit", "coalesced")
                await out.write_eof()
                return out
        except FlightFailed as exc:
            if out is None and exc.delivered == 0:
                # Nothing reached this client: make its own call (and keep it).
                return await self._lead(
                    req, self._key(request, req), None, origin, usage_tap, "", ""
                )
            if out is None:  # pragma: no cover - delivered implies started
                raise
            await out.write(sse_error_event(f"the shared origin call failed: {exc}"))
            await out.write_eof()
            return out

    def _context(self, request: web.Request, req: CacheRequest) -> str:
        """Everything but the last user message, exactly: the semantic namespace.

        The exact key of the request with that message blanked covers the
        tenant, the model, every parameter, forwarded headers and every other
        message, so only the last user message is ever matched by meaning.
        """
        messages = list(req.body["messages"])
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if isinstance(m, dict) and m.get("role") == "user":
                messages[i] = {**m, "content": ""}
                break
        blanked = CacheRequest(req.endpoint, {**req.body, "messages": messages}, req.tenant, False)
        return context_hash(messages) + ":" + self._key(request, blanked)

    def _key(self, request: web.Request, req: CacheRequest) -> str:
        headers = None
        if self._forward_headers:
            headers = {
                h: v for h in self._forward_headers if (v := request.headers.get(h)) is not None
            }
        return cache_key(
            req.endpoint, req.body, tenant=req.tenant.name, model=req.body["model"], headers=headers
        )

    # ------------------------------------------------------------ replies

    async def _replay(
        self,
        request: web.Request,
        entry: CachedResponse,
        stream: bool,
        include_usage: bool,
        extra: Sequence[tuple[str, str]],
    ) -> web.StreamResponse:
        headers = ((HEADER, "hit"), *extra)
        if not stream:
            return self._json(to_completion(entry), headers)
        out = await self._start_stream(request, headers)
        # One write per frame: the client sees the stored chunking.
        for frame in to_sse_chunks(entry, include_usage=include_usage):
            await out.write(frame)
        await out.write_eof()
        return out

    def _json(self, body: bytes, headers: Sequence[tuple[str, str]]) -> web.Response:
        response = web.Response(body=body, content_type="application/json")
        response.headers.extend(headers)
        return response

    async def _start_stream(
        self, request: web.Request, headers: Sequence[tuple[str, str]]
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=200)
        out.content_type = "text/event-stream"
        out.headers["cache-control"] = "no-cache"
        out.headers.extend(headers)
        for name, value in request.get("limit_headers") or ():
            out.headers[name] = value
        await out.prepare(request)
        return out

    def _count(self, result: str, kind: str) -> None:
        m = self._metrics
        m.child(m.cache_requests, result, str(kind)).inc()


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


__all__ = ["CacheRequest", "EdgeCache", "SemanticLayer"]
