"""Error-bounded semantic hits through the proxy's app and the origin simulator
(tests/functional/test_pipeline.py's stack): a verification goes to the origin, the
client gets the origin's answer, and the comparison is recorded.

The semantic index runs on the hashing fake embedder, with a verification drawn
whenever the budget allows: the real model's behaviour is bench/cache_eval.py's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dataplane.cache.bounded import Tuning
from dataplane.cache.embed import HashingEmbedder
from dataplane.cache.semantic import SemanticIndex
from dataplane.http.state import HOLDER, PIPELINE
from ponto.originsim.app import SimConfig
from ponto.quota_types import tenant_scope
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import Stack, chat, start_stack, table

Q = "how do i reset my password for the mobile app"
Q_NEAR = "how do I reset my password for the mobile app please"
Q_OTHER = "how do i reset my password for the mobile app now"


@pytest.fixture
async def bounded(tmp_path: Path) -> AsyncIterator[tuple[Stack, SemanticIndex]]:
    stack = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=6, seed=1)])
    cache = stack.app[PIPELINE].cache
    # One verification per origin call at most, drawn whenever allowed.
    index = SemanticIndex(
        HashingEmbedder(), rng=lambda: 0.0, tuning=Tuning(verify_rate=1.0, verify_cap=1.0)
    )
    cache.semantic = index
    bound = table([("o1", str(stack.origins[0].make_url("/v1")))], version=3)
    bound.tenants[0].cache.CopyFrom(
        pb.CachePolicy(mode="semantic", semantic_threshold=0.8, semantic_max_error=0.05)
    )
    bound.etag = content_etag(bound)
    stack.app[HOLDER].apply(bound, "control-plane")
    yield stack, index
    index.close()
    await stack.close()


async def test_a_verification_answers_from_the_origin_and_records_the_check(
    bounded: tuple[Stack, SemanticIndex],
) -> None:
    stack, index = bounded
    cache = stack.app[PIPELINE].cache
    first = await stack.post(chat(Q))
    cached = await first.json()
    assert first.headers["x-ponto-cache"] == "miss"
    assert stack.origin_requests() == 1
    await cache.background_done()  # indexed after the answer

    verified = await stack.post(chat(Q_NEAR))
    assert verified.status == 200
    assert verified.headers["x-ponto-cache"] == "miss"
    assert verified.headers["x-ponto-cache-reason"] == "verify"
    body = await verified.json()
    assert stack.origin_requests() == 2  # the would-be hit went to the origin
    assert body["id"] != cached["id"]  # and the client got the origin's answer
    await cache.background_done()
    # The simulator's answers depend on the prompt: the cached one was wrong.
    assert (index.stats.verifies, index.stats.checks, index.stats.wrong_checks) == (1, 1, 1)

    # The neighbour that would have answered wrongly is not served again: a plain
    # miss (no verification), whose answer is compared with it once more.
    again = await stack.post(chat(Q_OTHER))
    assert again.headers["x-ponto-cache"] == "miss"
    assert "x-ponto-cache-reason" not in again.headers
    assert stack.origin_requests() == 3
    await cache.background_done()
    assert (index.stats.verifies, index.stats.checks) == (1, 2)


async def test_a_streamed_verification_is_compared_too(
    bounded: tuple[Stack, SemanticIndex],
) -> None:
    stack, index = bounded
    cache = stack.app[PIPELINE].cache
    await (await stack.post(chat(Q, stream=True))).read()
    await cache.background_done()  # indexed after the answer
    verified = await stack.post(chat(Q_NEAR, stream=True))
    assert verified.headers["x-ponto-cache-reason"] == "verify"
    assert b"data: [DONE]" in await verified.read()
    await cache.background_done()
    assert (index.stats.verifies, index.stats.checks) == (1, 1)
    assert stack.origin_requests() == 2


@contextlib.contextmanager
def embedding_held(index: SemanticIndex) -> Iterator[None]:
    """Every embedding of `index` waits (at most 10 s) until the block ends."""
    embedding = threading.Event()
    prepare = index._prepare_sync

    def held(text: str) -> Any:
        embedding.wait(10)
        return prepare(text)

    index._prepare_sync = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        embedding.set()
        index._prepare_sync = prepare  # type: ignore[method-assign]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_indexing_an_answer_holds_nothing_of_its_request(
    bounded: tuple[Stack, SemanticIndex], stream: bool
) -> None:
    """The embedding that indexes a new answer runs after the client has it: the
    request's concurrency slot is free and a next request admitted meanwhile,
    and the entry is indexed once the embedding ends."""
    stack, index = bounded
    cache = stack.app[PIPELINE].cache
    limiter = stack.app[PIPELINE].limiter
    one_slot = table([("o1", str(stack.origins[0].make_url("/v1")))], version=4)
    one_slot.tenants[0].limits.CopyFrom(pb.Limits(concurrency=1))
    one_slot.tenants[0].cache.CopyFrom(pb.CachePolicy(mode="semantic", semantic_threshold=0.8))
    one_slot.etag = content_etag(one_slot)
    stack.app[HOLDER].apply(one_slot, "control-plane")
    assert limiter.share(tenant_scope("acme")).concurrency == 1
    with embedding_held(index):
        first = await stack.post(chat(Q, stream=stream))
        assert first.status == 200
        await first.read()  # the whole answer, while its embedding waits
        assert index.stats.inserts == 0
        assert limiter.in_flight(tenant_scope("acme")) == 0
        nxt = await stack.post(chat("a next question, at once", stream=stream))
        assert nxt.status == 200
        await nxt.read()
    await cache.background_done()
    assert index.stats.inserts == 2
    # Asked as the entry was recorded (a stream recorded without usage is no
    # answer for a non-streaming request, which has its usage).
    near = await stack.post(chat(Q_NEAR, stream=stream))
    assert near.headers["x-ponto-cache"] == "hit" and "x-ponto-cache-similarity" in near.headers


async def test_an_answer_evicted_while_its_question_is_indexed_leaves_no_entry(
    bounded: tuple[Stack, SemanticIndex],
) -> None:
    stack, index = bounded
    cache = stack.app[PIPELINE].cache
    with embedding_held(index):
        await (await stack.post(chat(Q))).read()
        assert await cache.store.purge() == 1  # the answer leaves the store
    await cache.background_done()
    assert index.stats.inserts == 1
    assert len(index) == 0  # and its question left the index after it was added
