"""SemanticIndex: scoping (tenant, model, context), threshold, entities, eviction, purge.

Runs on the hashing fake embedder: similarities are predictable from shared character
n-grams, and the tests need no model. The real model's behaviour is measured by
bench/cache_eval.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

from dataplane.cache.embed import HashingEmbedder, Vectors
from dataplane.cache.entities import extract
from dataplane.cache.entry import CachedResponse, ResponseKind
from dataplane.cache.keys import last_user_text
from dataplane.cache.semantic import (
    Inserted,
    SemanticHit,
    SemanticIndex,
    entities_bytes,
    normalise_text,
)
from dataplane.cache.store import ExactStore
from dataplane.cache.vectors import ExactIndex

Q = "how do i reset my password for the mobile app"
Q_NEAR = "how do I reset my password for the mobile app please"
Q_FAR = "what is the weather like in lisbon tomorrow morning"
T = 0.8  # HashingEmbedder scores Q against Q_NEAR at ~0.9 and Q_FAR near 0


@pytest.fixture
async def index() -> AsyncIterator[SemanticIndex]:
    idx = SemanticIndex(HashingEmbedder())
    yield idx
    idx.close()


async def test_similar_text_hits_and_unrelated_misses(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "ctx", Q, "key-1")
    hit = await index.lookup("t1", "m", "ctx", Q_NEAR, T)
    assert isinstance(hit, SemanticHit)
    assert hit.key == "key-1"
    assert T <= hit.similarity <= 1.0
    assert await index.lookup("t1", "m", "ctx", Q_FAR, T) is None
    assert index.stats.hits == 1
    assert index.stats.lookups == 2


async def test_threshold_is_the_callers(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "ctx", Q, "key-1")
    hit = await index.lookup("t1", "m", "ctx", Q_NEAR, T)
    assert hit is not None
    assert await index.lookup("t1", "m", "ctx", Q_NEAR, hit.similarity + 0.01) is None
    assert await index.lookup("t1", "m", "ctx", Q_NEAR, hit.similarity - 0.01) is not None


async def test_tenants_and_models_are_isolated(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "ctx", Q, "key-1")
    assert await index.lookup("t2", "m", "ctx", Q, T) is None
    assert await index.lookup("t1", "other-model", "ctx", Q, T) is None
    assert await index.lookup("t1", "m", "ctx", Q, T) is not None


async def test_multi_turn_isolation_by_context_hash(index: SemanticIndex) -> None:
    # "what about the second one?" after two different earlier turns: the caller
    # hashes the earlier turns into context_hash, and nothing crosses between them.
    follow_up = "what about the second one"
    await index.insert("t1", "m", "hash(turns about laptops)", follow_up, "key-laptops")
    assert await index.lookup("t1", "m", "hash(turns about phones)", follow_up, T) is None
    hit = await index.lookup("t1", "m", "hash(turns about laptops)", follow_up, T)
    assert hit is not None
    assert hit.key == "key-laptops"


A = "please cancel my purchase with number 732201349959"
B = "please cancel my purchase with number 113542617735902"  # 0.69 to A with hashing


async def test_entities_block_a_near_twin(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "", A, "key-a")
    assert await index.lookup("t1", "m", "", B, 0.5) is None
    assert index.stats.entity_blocked == 1
    hit = await index.lookup("t1", "m", "", "please cancel my purchase number 732201349959", 0.5)
    assert hit is not None
    assert hit.key == "key-a"


@pytest.mark.parametrize(
    ("asked", "stored"),
    [
        ('What does len("a b") return?', 'What does len("a   b") return?'),
        ("What does len(\u201ea b\u201c) return?", "What does len(\u201ea   b\u201c) return?"),
        ("What does len(«a b») return?", "What does len(«a   b») return?"),
    ],
)
async def test_spaces_within_quotes_are_no_semantic_hit(
    index: SemanticIndex, asked: str, stored: str
) -> None:
    """As the exact key keeps them (review 31): the message as the semantic
    layer reads it (last_user_text), its normal form and its quote entities
    keep them too."""
    messages = [{"role": "user", "content": stored}]
    text = last_user_text(messages)
    assert text == stored
    await index.insert("t1", "m", "", text, "key-spaced")
    asked_text = last_user_text([{"role": "user", "content": asked}])
    assert asked_text is not None
    assert await index.lookup("t1", "m", "", asked_text, 0.5) is None
    assert await index.lookup("t1", "m", "", text, 0.5) is not None


async def test_a_farther_neighbour_with_matching_entities_still_hits(
    index: SemanticIndex,
) -> None:
    await index.insert("t1", "m", "", "cancel my purchase 111 now", "key-111")
    await index.insert("t1", "m", "", "cancel my purchase 222 today please", "key-222")
    hit = await index.lookup("t1", "m", "", "cancel my purchase 222 now", 0.5)
    assert hit is not None
    assert hit.key == "key-222"


async def test_entity_check_can_be_disabled() -> None:
    idx = SemanticIndex(HashingEmbedder(), entity_check=False)
    await idx.insert("t1", "m", "", A, "key-a")
    assert await idx.lookup("t1", "m", "", B, 0.5) is not None
    idx.close()


async def test_remove_and_replace_by_key(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "ctx", Q, "key-1")
    assert index.remove("key-1")
    assert not index.remove("key-1")
    assert await index.lookup("t1", "m", "ctx", Q, T) is None
    assert len(index) == 0
    assert index.namespaces() == 0
    # one entry per key: inserting a key again replaces its text
    await index.insert("t1", "m", "ctx", Q, "key-2")
    await index.insert("t1", "m", "ctx", Q_FAR, "key-2")
    assert len(index) == 1
    assert await index.lookup("t1", "m", "ctx", Q, T) is None
    hit = await index.lookup("t1", "m", "ctx", Q_FAR, T)
    assert hit is not None
    assert hit.key == "key-2"


async def test_purge_by_tenant_model_or_all(index: SemanticIndex) -> None:
    for tenant in ("t1", "t2"):
        for model in ("a", "b"):
            await index.insert(tenant, model, "", Q, f"{tenant}-{model}")
    assert index.purge(tenant="t1", model="a") == 1
    assert await index.lookup("t1", "a", "", Q, T) is None
    assert await index.lookup("t1", "b", "", Q, T) is not None
    assert index.purge(tenant="t2") == 2
    assert await index.lookup("t2", "b", "", Q, T) is None
    assert index.purge(model="b") == 1
    assert len(index) == 0
    await index.insert("t3", "a", "", Q, "t3-a")
    assert index.purge() == 1
    assert not index.remove("t3-a")


async def test_eviction_per_namespace_and_global_least_recent_first() -> None:
    idx = SemanticIndex(HashingEmbedder(), max_entries=4, max_entries_per_namespace=2)
    texts = [f"question number {w} about topic {w}" for w in ("alpha", "bravo", "charlie")]
    for i, text in enumerate(texts):
        await idx.insert("t", "m", "ns1", text, f"k{i}")
    assert len(idx) == 2  # k0 went first
    assert await idx.lookup("t", "m", "ns1", texts[0], 0.99) is None
    # a hit refreshes k1, so k2 is the least recently used of ns1 now
    assert await idx.lookup("t", "m", "ns1", texts[1], 0.99) is not None
    await idx.insert("t", "m", "ns1", "question number delta about topic delta", "k3")
    assert not idx.remove("k2")
    # the global bound spans namespaces
    for i in range(3):
        await idx.insert("t", "m", f"other{i}", texts[0], f"o{i}")
    assert len(idx) == 4
    assert idx.stats.evictions == 3
    assert not idx.remove("k1")  # the oldest overall
    idx.close()


async def test_empty_namespace_costs_no_embedding(index: SemanticIndex) -> None:
    assert await index.lookup("t1", "m", "nothing here", Q, T) is None
    assert index.stats.lookups == 1
    assert index.stats.busy == 0


async def test_too_long_texts_are_not_matched() -> None:
    class Windowed(HashingEmbedder):
        def fits(self, text: str) -> bool:
            return len(text) < 40

    idx = SemanticIndex(Windowed())
    await idx.insert("t", "m", "", "short question", "k")
    await idx.insert("t", "m", "", "x" * 50, "k-long")
    assert len(idx) == 1
    assert await idx.lookup("t", "m", "", "short question" + " padding" * 5, 0.1) is None
    assert idx.stats.too_long == 2
    idx.close()


class SlowEmbedder(HashingEmbedder):
    """Blocks in embed until released; records the thread it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.threads: set[int] = set()

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.threads.add(threading.get_ident())
        self.release.wait(5)
        return super().embed(texts)


async def test_embedding_runs_off_the_event_loop() -> None:
    slow = SlowEmbedder()
    idx = SemanticIndex(slow)
    insert = asyncio.create_task(idx.insert("t", "m", "", Q, "k"))
    # The loop keeps running while the embedder is blocked in its thread.
    ticks = 0
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks >= 5
    assert not insert.done()
    slow.release.set()
    await insert
    assert len(idx) == 1
    assert threading.get_ident() not in slow.threads
    idx.close()


async def test_busy_embedder_skips_instead_of_queueing() -> None:
    slow = SlowEmbedder()
    idx = SemanticIndex(slow, max_pending=1)
    first = asyncio.create_task(idx.insert("t", "m", "", Q, "k1"))
    await asyncio.sleep(0.05)
    await idx.insert("t", "m", "", Q_FAR, "k2")  # returns at once: skipped
    assert idx.stats.busy == 1
    slow.release.set()
    await first
    assert len(idx) == 1
    idx.close()


async def test_insert_in_flight_during_purge_is_dropped() -> None:
    slow = SlowEmbedder()
    idx = SemanticIndex(slow)
    insert = asyncio.create_task(idx.insert("t", "m", "", Q, "k"))
    await asyncio.sleep(0.05)
    idx.purge(tenant="t")
    slow.release.set()
    await insert
    assert len(idx) == 0
    idx.close()


async def test_a_miss_then_insert_embeds_once() -> None:
    calls: list[int] = []

    class Counting(HashingEmbedder):
        def embed(self, texts: Sequence[str]) -> Vectors:
            calls.append(len(texts))
            return super().embed(texts)

    idx = SemanticIndex(Counting())
    await idx.insert("t", "m", "", Q_FAR, "k0")
    assert await idx.lookup("t", "m", "", Q, T) is None
    await idx.insert("t", "m", "", Q, "k1")
    assert calls == [1, 1]
    idx.close()


async def test_another_tenants_recent_text_is_embedded_again() -> None:
    """The embedding memo is per tenant: a hit in it skips the model and answers
    faster, so a shared memo would tell tenant B that tenant A just sent a text.
    The fake's calls are that signal: B's lookup and insert of A's text each embed."""
    calls: list[str] = []

    class Counting(HashingEmbedder):
        def embed(self, texts: Sequence[str]) -> Vectors:
            calls.extend(texts)
            return super().embed(texts)

    idx = SemanticIndex(Counting())
    await idx.insert("tenant-a", "m", "", Q_FAR, "a0")
    await idx.insert("tenant-b", "m", "", Q_FAR, "b0")
    calls.clear()
    assert await idx.lookup("tenant-a", "m", "", Q, T) is None
    assert len(calls) == 1
    assert await idx.lookup("tenant-b", "m", "", Q, T) is None
    assert len(calls) == 2
    await idx.insert("tenant-b", "m", "", Q, "b1")
    assert len(calls) == 2  # B's own lookup is remembered for B's insert
    await idx.insert("tenant-a", "m", "", Q, "a1")
    assert len(calls) == 2  # and A's for A's
    await idx.insert("tenant-c", "m", "", Q, "c1")
    assert len(calls) == 3
    idx.close()


async def test_custom_index_factory_is_used() -> None:
    made: list[int] = []

    def factory(dim: int) -> ExactIndex:
        made.append(dim)
        return ExactIndex(dim)

    idx = SemanticIndex(HashingEmbedder(dim=64), index_factory=factory)
    await idx.insert("t", "m", "", Q, "k")
    assert made == [64]
    idx.close()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  How   do I\treset\nmy PASSWORD?? ", "how do i reset my password"),
        ("It\u2019s \u201cfine\u201d!", 'it\'s "fine"'),
        ("ﬁle №5.", "file no5"),
        ("C++ vs C#?", "c++ vs c#"),
        ("...", ""),
        ("what is 3.5", "what is 3.5"),
        # A superscript is no digit: x² is not x2.
        ("What is x² at 3?", "what is x² at 3"),
    ],
)
def test_normalise_text(raw: str, expected: str) -> None:
    assert normalise_text(raw) == expected


def test_constructor_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        SemanticIndex(HashingEmbedder(), max_entries=0)


def test_hashing_vectors_behave_as_the_tests_assume() -> None:
    v = HashingEmbedder().embed([Q, Q_NEAR, Q_FAR])
    assert float(v[0] @ v[1]) > 0.85
    assert abs(float(v[0] @ v[2])) < 0.3
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0)


class RecordingIndex(ExactIndex):
    """Records the threads that touch it."""

    threads: set[int]

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.threads = set()

    def add(self, id: int, vec: Vectors) -> None:
        self.threads.add(threading.get_ident())
        super().add(id, vec)

    def remove(self, id: int) -> None:
        self.threads.add(threading.get_ident())
        super().remove(id)

    def search(self, vec: Vectors, k: int = 1) -> list[tuple[int, float]]:
        self.threads.add(threading.get_ident())
        return super().search(vec, k)


async def test_vector_indexes_are_only_touched_off_the_loop() -> None:
    made: list[RecordingIndex] = []

    def factory(dim: int) -> RecordingIndex:
        made.append(RecordingIndex(dim))
        return made[-1]

    idx = SemanticIndex(HashingEmbedder(), index_factory=factory)
    await idx.insert("t", "m", "", Q, "k1")
    await idx.insert("t", "m", "", Q_FAR, "k2")
    assert await idx.lookup("t", "m", "", Q_NEAR, T) is not None
    idx.remove("k1")
    assert await idx.lookup("t", "m", "", Q_NEAR, T) is None
    await idx.flush()
    (index,) = made
    assert index.threads  # it was used ...
    assert threading.get_ident() not in index.threads  # ... never on the loop thread
    assert len(index) == 1
    idx.close()


async def test_an_entry_removed_during_a_search_is_not_a_hit() -> None:
    slow = SlowEmbedder()
    idx = SemanticIndex(slow)
    slow.release.set()
    await idx.insert("t", "m", "", Q, "k1")
    await idx.insert("t", "m", "", Q_FAR, "k2")
    slow.release.clear()
    lookup = asyncio.create_task(idx.lookup("t", "m", "", Q_NEAR, T))
    await asyncio.sleep(0.05)  # the lookup is embedding in the executor
    idx.remove("k1")  # its index removal queues behind the lookup
    slow.release.set()
    assert await lookup is None
    idx.close()


async def test_closed_index_misses_and_ignores_inserts() -> None:
    idx = SemanticIndex(HashingEmbedder())
    await idx.insert("t", "m", "", Q, "k1")
    idx.close()
    idx.close()
    assert await idx.lookup("t", "m", "", Q, T) is None
    await idx.insert("t", "m", "", Q_FAR, "k2")
    assert len(idx) == 1
    assert idx.remove("k1")


# -- entries from other proxies (the region feed) -----------------------------------


async def test_on_insert_hands_over_the_vector_and_insert_vector_adds_it_elsewhere() -> None:
    """What one proxy inserts, another adds from the vector alone and then hits."""
    here, there = SemanticIndex(HashingEmbedder()), SemanticIndex(HashingEmbedder())
    published: list[Inserted] = []
    here.on_insert = published.append
    await here.insert("t1", "m", "ctx", Q, "key-1")
    (ins,) = published
    assert (ins.tenant, ins.model, ins.context, ins.key) == ("t1", "m", "ctx", "key-1")
    assert ins.vector.dtype == np.float32
    assert ins.vector.shape == (here.dim,)
    there.on_insert = published.append
    assert there.insert_vector(
        ins.tenant, ins.model, ins.context, ins.key, ins.vector, ins.entities
    )
    assert len(published) == 1  # a remote entry is not published again
    hit = await there.lookup("t1", "m", "ctx", Q_NEAR, T)
    assert hit is not None
    assert hit.key == "key-1"
    assert await there.lookup("t2", "m", "ctx", Q_NEAR, T) is None  # same namespaces
    assert there.stats.remote_inserts == 1
    here.close()
    there.close()


async def test_remote_entries_keep_the_entity_check(index: SemanticIndex) -> None:
    vec = HashingEmbedder().embed([normalise_text(A)])[0]
    assert index.insert_vector("t1", "m", "", "key-a", vec, extract(A))
    assert await index.lookup("t1", "m", "", B, 0.5) is None
    assert index.stats.entity_blocked == 1


MILES = "Convert 5 miles to kilometers"
KM = "Convert 5 kilometers to miles"  # the same words: 1.0 with hashing, 0.99 with MiniLM


async def test_the_opposite_question_is_never_a_hit(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "", MILES, "key-miles")
    assert await index.lookup("t1", "m", "", KM, 0.99) is None
    assert index.stats.entity_blocked == 1
    hit = await index.lookup("t1", "m", "", "convert 5 miles into kilometers", 0.5)
    assert hit is not None
    assert hit.key == "key-miles"


async def test_remote_entries_keep_the_opposite_check(index: SemanticIndex) -> None:
    vec = HashingEmbedder().embed([normalise_text(MILES)])[0]
    assert index.insert_vector("t1", "m", "", "key-miles", vec, extract(MILES))
    assert await index.lookup("t1", "m", "", KM, 0.99) is None
    assert index.stats.entity_blocked == 1


async def test_insert_vector_refuses_held_keys_and_bad_vectors(index: SemanticIndex) -> None:
    await index.insert("t1", "m", "", Q, "key-1")
    good = HashingEmbedder().embed([Q_FAR])[0]
    ents = extract(Q_FAR)
    assert not index.insert_vector("t1", "m", "", "key-1", good, ents)  # held: kept
    assert not index.insert_vector("t1", "m", "", "k2", good[:-1], ents)  # other size
    assert not index.insert_vector("t1", "m", "", "k3", good * 2, ents)  # not unit
    nan = good.copy()
    nan[0] = np.nan  # would compare as "not below the threshold": a hit on anything
    assert not index.insert_vector("t1", "m", "", "k4", nan, ents)
    assert not index.insert_vector("t1", "m", "", "k5", good.astype(np.float64), ents)
    assert index.stats.remote_refused == 5
    assert len(index) == 1
    hit = await index.lookup("t1", "m", "", Q, T)
    assert hit is not None
    assert hit.key == "key-1"


# -- memory --------------------------------------------------------------------------


async def test_bytes_stay_under_the_bound_and_come_back_when_entries_go() -> None:
    bound = 400_000
    idx = SemanticIndex(HashingEmbedder(dim=384), max_bytes=bound, max_entries=10**6)
    vectors = HashingEmbedder(dim=384).embed([f"message {i} of the soak" for i in range(400)])
    for i, vec in enumerate(vectors):
        # many small namespaces and one large one, as conversations and a FAQ give
        context = f"conversation-{i}" if i % 2 else "faq"
        idx.insert_vector("t", "m", context, f"key-{i}", vec, extract(f"message {i}"))
        await idx.flush()  # the executor's measurements in, so nbytes is exact
        assert idx.nbytes <= bound
    assert idx.stats.evictions > 0
    assert 20 < len(idx) < 400
    # each entry counts at least its vector and its key
    assert idx.nbytes >= len(idx) * (384 * 4 + 20)
    idx.purge()
    await idx.flush()
    assert idx.nbytes == 0
    idx.close()


async def test_bytes_follow_inserts_before_the_executor_measures() -> None:
    slow = SlowEmbedder()
    idx = SemanticIndex(HashingEmbedder(dim=64))
    before = idx.nbytes
    # the first insert's vector add waits behind a blocked executor
    blocker = asyncio.get_running_loop().run_in_executor(idx._executor, slow.release.wait, 5)
    idx.insert_vector("t", "m", "", "k", HashingEmbedder(dim=64).embed([Q])[0], extract(Q))
    predicted = idx.nbytes
    assert predicted > before + 64 * 4
    slow.release.set()
    await blocker
    await idx.flush()
    assert idx.nbytes > before + 64 * 4
    assert idx.remove("k")
    await idx.flush()
    assert idx.nbytes == 0
    idx.close()


async def test_on_grow_runs_after_an_insert(index: SemanticIndex) -> None:
    seen: list[int] = []
    index.on_grow = lambda: seen.append(len(index))
    await index.insert("t1", "m", "", Q, "k1")
    index.insert_vector("t1", "m", "", "k2", HashingEmbedder().embed([Q_FAR])[0], extract(Q_FAR))
    assert seen == [1, 2]


def test_entities_bytes_counts_the_strings() -> None:
    small, large = extract("hi"), extract("Order 123456 for Anna to Lisbon on the 3rd of May")
    assert entities_bytes(large) > entities_bytes(small) > 0


async def test_store_and_index_keep_to_one_bound_together() -> None:
    """Wired as the proxy wires them: the store yields to the index's bytes, the
    index keeps to its share, and together they never pass the bound."""
    bound = 1_000_000
    store = ExactStore(max_bytes=bound, clock=lambda: 0.0)
    idx = SemanticIndex(HashingEmbedder(dim=384), max_bytes=bound // 2)
    store.reserved = lambda: idx.nbytes

    def evicted(key: str, reason: object) -> None:
        idx.remove(key)

    store.on_evict = evicted
    idx.on_grow = store.fit
    body = CachedResponse(ResponseKind.CHAT, 0.0, "m", body=b"x" * 600)
    for i in range(600):
        key = f"key-{i}"
        assert await store.put(key, body, tenant="t", model="m", ttl_s=60)
        await idx.insert("t", "m", "", f"question {i} about topic {i % 7}", key)
        await idx.flush()
        await asyncio.sleep(0)  # the loop's turn for the executor's call back
        assert store.stats.bytes + idx.nbytes <= bound
    assert store.stats.evictions > 0
    assert idx.nbytes <= bound // 2
    # every semantic entry still points at an answer the store holds
    keys = [e.key for e in idx._entries.values()]
    assert keys
    assert all([await store.get(key) is not None for key in keys])
    idx.close()


async def test_an_index_that_grows_its_capacity_is_brought_back_under_the_bound() -> None:
    """One namespace whose array doubles (128 -> 256 rows) past what the loop had
    predicted for one vector: once the executor has measured it, the index evicts
    until it is under its bound again, and tells the store (on_grow)."""
    bound = 500_000
    idx = SemanticIndex(HashingEmbedder(dim=384), max_bytes=bound)
    grown: list[int] = []
    idx.on_grow = lambda: grown.append(idx.nbytes)
    for i in range(300):
        await idx.insert("t", "m", "", f"question {i} about topic {i % 7}", f"key-{i}")
        await idx.flush()
        await asyncio.sleep(0)  # the loop's turn for the executor's call back
        assert idx.nbytes <= bound
    assert idx.stats.evictions > 0
    assert len(grown) > 300  # one per insert, and more after a growth
    idx.close()
