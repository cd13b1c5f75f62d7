"""Driving the cache step (dataplane.cache.step) as the pipeline does, without HTTP."""

from __future__ import annotations

import json

from dataplane.cache.step import CachePlan, CacheRequest, EdgeCache


async def settle_whole(
    step: EdgeCache, req: CacheRequest, plan: CachePlan, body: bytes, status: int = 200
) -> None:
    """The origin answered `body` whole: its entry made (before the answer's
    headers, in the pipeline) and kept, and the flight told."""
    entry = step.whole_entry(req, plan, status, body, json.loads(body))
    await step.settle_body(req, plan, entry)
