"""SemanticIndex under an error bound: the learner's actions, per-entry evidence, checks.

Runs on the hashing fake embedder (tests/unit/test_semantic_index.py's texts: Q and
Q_NEAR score about 0.9).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import pytest

from dataplane.cache.bounded import Action, Answer, Tuning
from dataplane.cache.embed import HashingEmbedder, Vectors
from dataplane.cache.semantic import CHECK_QUEUE, EVIDENCE_BYTES, LEARNER_BYTES, SemanticIndex

Q = "how do i reset my password for the mobile app"
Q_NEAR = "how do I reset my password for the mobile app please"
Q_FAR = "what is the weather like in lisbon tomorrow morning"
LONG = "Open Settings, then Account, then Reset password; a link comes by email within minutes."


def never() -> float:
    return 0.999999


@pytest.fixture
async def index() -> AsyncIterator[SemanticIndex]:
    idx = SemanticIndex(HashingEmbedder(), rng=never)
    yield idx
    idx.close()


async def test_a_fixed_threshold_is_unchanged_without_a_bound(index: SemanticIndex) -> None:
    await index.insert("t", "m", "", Q, "k1")
    hit = await index.lookup("t", "m", "", Q_NEAR, 0.8)
    assert hit is not None and hit.action is Action.HIT
    assert await index.lookup("t", "m", "", Q_NEAR, 0.99) is None


async def test_a_near_miss_in_the_band_is_returned_to_learn_from(index: SemanticIndex) -> None:
    await index.insert("t", "m", "", Q, "k1")
    near = await index.lookup("t", "m", "", Q_NEAR, 0.97, max_error=0.01)
    assert near is not None and near.key == "k1"
    assert 0.8 <= near.similarity < 0.97
    assert near.action is Action.OBSERVE
    assert index.stats.hits == 0
    assert await index.lookup("t", "m", "", Q_FAR, 0.97, max_error=0.01) is None  # below the band


async def test_checks_are_recorded_on_the_entry_and_move_its_threshold(
    index: SemanticIndex,
) -> None:
    await index.insert("t", "m", "", Q, "k1")
    found = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert found is not None and found.action is Action.OBSERVE
    for _ in range(8):  # the origin's answers keep matching the cached one
        assert await index.check("k1", found.similarity, Answer("Yes."), Answer("yes")) is True
    assert (index.stats.checks, index.stats.wrong_checks) == (8, 0)
    again = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert again is not None and again.action is Action.HIT  # confirmed: served now
    assert await index.check("k1", found.similarity, Answer("Yes."), Answer("No.")) is False
    assert index.stats.wrong_checks == 1


async def test_longer_answers_are_compared_with_the_embedder(index: SemanticIndex) -> None:
    await index.insert("t", "m", "", Q, "k1")
    await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert await index.check("k1", 0.9, Answer(LONG), Answer(LONG + " Thanks!")) is True
    assert await index.check("k1", 0.9, Answer(LONG), Answer(Q_FAR + " " + Q_FAR)) is False


async def test_a_check_of_a_gone_entry_or_a_tenant_without_a_bound_records_nothing(
    index: SemanticIndex,
) -> None:
    await index.insert("t", "m", "", Q, "k1")
    assert await index.check("k1", 0.9, Answer("a"), Answer("a")) is None  # no bound yet
    await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    index.remove("k1")
    assert await index.check("k1", 0.9, Answer("a"), Answer("a")) is None
    assert index.stats.checks == 0


async def test_a_new_bound_starts_learning_over(index: SemanticIndex) -> None:
    await index.insert("t", "m", "", Q, "k1")
    found = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert found is not None
    for _ in range(8):
        await index.check("k1", found.similarity, Answer("Yes."), Answer("yes"))
    served = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert served is not None and served.action is Action.HIT
    relearn = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.02)
    assert relearn is not None and relearn.action is Action.OBSERVE


async def test_would_be_hits_are_verified_within_the_budget() -> None:
    index = SemanticIndex(
        HashingEmbedder(), rng=lambda: 0.0, tuning=Tuning(verify_rate=1.0, verify_cap=0.5)
    )
    try:
        for _ in range(4):  # origin calls of the tenant: the budget's base
            assert await index.lookup("t", "m", "", Q, 0.8, max_error=0.05) is None
        await index.insert("t", "m", "", Q, "k1")
        actions = [
            found.action
            for _ in range(4)
            if (found := await index.lookup("t", "m", "", Q_NEAR, 0.8, max_error=0.05))
        ]
        # 4 misses, half of it: two verifications, then hits.
        assert actions == [Action.VERIFY, Action.VERIFY, Action.HIT, Action.HIT]
        assert (index.stats.verifies, index.stats.hits) == (2, 2)
    finally:
        index.close()


class GatedEmbedder(HashingEmbedder):
    """Embeds only while `open` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.open.wait(5)
        return super().embed(texts)


async def test_comparisons_by_meaning_give_way_to_queued_lookups() -> None:
    gated = GatedEmbedder()
    index = SemanticIndex(gated, rng=never)
    try:
        gated.open.set()
        await index.insert("t", "m", "", Q, "k1")
        await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
        gated.open.clear()
        queued = [
            asyncio.create_task(index.lookup("t", "m", "", f"{Q_NEAR} {n}", 0.95, max_error=0.01))
            for n in range(CHECK_QUEUE)
        ]
        await asyncio.sleep(0)  # they are submitted to the embedding thread
        assert await index.check("k1", 0.9, Answer(LONG), Answer(LONG + " Thanks!")) is None
        assert index.stats.checks_skipped == 1
        # Short answers need no model: compared at once, whatever the queue.
        assert await index.check("k1", 0.9, Answer("Yes."), Answer("yes")) is True
        gated.open.set()
        await asyncio.gather(*queued)
        assert await index.check("k1", 0.9, Answer(LONG), Answer(LONG + " Thanks!")) is True
        assert index.stats.checks == 2
    finally:
        gated.open.set()
        index.close()


async def test_learning_state_counts_against_the_index_bytes(index: SemanticIndex) -> None:
    await index.insert("t", "m", "", Q, "k1")
    await index.lookup("t", "m", "", Q_NEAR, 0.95)  # its embedding is kept (memo)
    await index.flush()
    plain = index.nbytes
    found = await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.01)
    assert found is not None
    with_learner = index.nbytes
    assert with_learner == plain + LEARNER_BYTES
    await index.check("k1", found.similarity, Answer("Yes."), Answer("yes"))
    await index.check("k1", found.similarity, Answer("Yes."), Answer("yes"))
    assert index.nbytes == with_learner + EVIDENCE_BYTES  # once per entry
    # A new bound forgets the evidence, and its bytes.
    await index.lookup("t", "m", "", Q_NEAR, 0.95, max_error=0.02)
    assert index.nbytes == with_learner
