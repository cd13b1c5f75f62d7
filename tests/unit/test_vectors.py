"""One contract suite for every VectorIndex: exact (the fake), HNSW and tiered."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from dataplane.cache.vectors import ExactIndex, HnswIndex, TieredIndex, VectorIndex

DIM = 32

Factory = Callable[[], VectorIndex]

FACTORIES: dict[str, Factory] = {
    "exact": lambda: ExactIndex(DIM, initial_capacity=2),
    "hnsw": lambda: HnswIndex(DIM, initial_capacity=16, m=8, ef_construction=64),
    # promote after a few vectors so that the suite runs across the switch
    "tiered": lambda: TieredIndex(
        DIM, promote_at=20, hnsw_factory=lambda d, cap: HnswIndex(d, initial_capacity=cap)
    ),
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Factory:
    return FACTORIES[request.param]


def unit(rng: np.random.Generator, n: int = 1) -> npt.NDArray[np.float32]:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True), dtype=np.float32)


def test_empty_index_finds_nothing(make: Factory) -> None:
    index = make()
    assert len(index) == 0
    assert index.dim == DIM
    assert index.search(unit(np.random.default_rng(0))[0], 3) == []


def test_finds_itself_with_similarity_one(make: Factory) -> None:
    rng = np.random.default_rng(1)
    vecs = unit(rng, 50)
    index = make()
    for i, v in enumerate(vecs):
        index.add(i, v)
    assert len(index) == 50
    for i in (0, 17, 49):
        (best, sim), *_ = index.search(vecs[i], 1)
        assert best == i
        assert sim == pytest.approx(1.0, abs=1e-5)


def test_results_are_ordered_and_bounded_by_k(make: Factory) -> None:
    rng = np.random.default_rng(2)
    vecs = unit(rng, 40)
    index = make()
    for i, v in enumerate(vecs):
        index.add(100 + i, v)
    query = unit(rng)[0]
    found = index.search(query, 5)
    assert len(found) == 5
    sims = [s for _, s in found]
    assert sims == sorted(sims, reverse=True)
    # similarities are cosines of the stored vectors
    for id_, sim in found:
        assert sim == pytest.approx(float(vecs[id_ - 100] @ query), abs=1e-4)
    assert len(index.search(query, 500)) == 40
    assert index.search(query, 0) == []


def test_agrees_with_brute_force_top1(make: Factory) -> None:
    rng = np.random.default_rng(3)
    vecs = unit(rng, 200)
    index = make()
    for i, v in enumerate(vecs):
        index.add(i, v)
    queries = vecs[:50] + 0.1 * unit(rng, 50)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    agree = sum(index.search(q, 1)[0][0] == int(np.argmax(vecs @ q)) for q in queries)
    assert agree >= 48  # HNSW is approximate; at this size it is all but exact


def test_remove_is_idempotent_and_hides_the_id(make: Factory) -> None:
    rng = np.random.default_rng(4)
    vecs = unit(rng, 30)
    index = make()
    for i, v in enumerate(vecs):
        index.add(i, v)
    index.remove(7)
    index.remove(7)
    index.remove(12345)
    assert len(index) == 29
    assert all(id_ != 7 for id_, _ in index.search(vecs[7], 29))
    assert len(index.search(vecs[7], 100)) == 29


def test_removed_slots_are_reused_and_capacity_grows(make: Factory) -> None:
    rng = np.random.default_rng(5)
    index = make()
    next_id = 0
    live: dict[int, npt.NDArray[np.float32]] = {}
    for round_ in range(6):
        for v in unit(rng, 25):
            index.add(next_id, v)
            live[next_id] = v
            next_id += 1
        for id_ in list(live)[:: 2 + round_ % 2]:  # remove about half or a third
            index.remove(id_)
            del live[id_]
        assert len(index) == len(live)
    for id_, v in list(live.items())[:10]:
        assert index.search(v, 1)[0][0] == id_
    found = {i for i, _ in index.search(unit(rng)[0], len(live))}
    assert found <= set(live)


def test_remove_everything_then_add_again(make: Factory) -> None:
    rng = np.random.default_rng(6)
    index = make()
    vecs = unit(rng, 25)
    for i, v in enumerate(vecs):
        index.add(i, v)
    for i in range(25):
        index.remove(i)
    assert len(index) == 0
    assert index.search(vecs[0], 3) == []
    index.add(1000, vecs[0])
    ((only, sim),) = index.search(vecs[0], 3)
    assert only == 1000
    assert sim == pytest.approx(1.0, abs=1e-5)


def test_refuses_present_ids_bad_ids_and_wrong_dimensions(make: Factory) -> None:
    rng = np.random.default_rng(7)
    index = make()
    index.add(1, unit(rng)[0])
    with pytest.raises(ValueError, match=r"present|new"):
        index.add(1, unit(rng)[0])
    with pytest.raises(ValueError, match="non-negative"):
        index.add(-1, unit(rng)[0])
    with pytest.raises(ValueError, match=r"dimensions|shape"):
        index.add(2, np.ones(DIM + 1, dtype=np.float32))
    assert len(index) == 1


def test_tiered_index_promotes_without_losing_entries() -> None:
    rng = np.random.default_rng(8)
    index = TieredIndex(DIM, promote_at=10)
    vecs = unit(rng, 12)
    for i, v in enumerate(vecs[:9]):
        index.add(i, v)
    index.remove(3)
    before = index.promoted
    for i, v in enumerate(vecs[9:], start=9):
        index.add(i, v)
    assert not before
    assert index.promoted
    assert len(index) == 11
    assert index.search(vecs[11], 1)[0][0] == 11
    assert all(i != 3 for i, _ in index.search(vecs[3], 11))


def test_hnsw_bulk_add_grows_capacity() -> None:
    rng = np.random.default_rng(9)
    index = HnswIndex(DIM, initial_capacity=16)
    vecs = unit(rng, 100)
    index.add_many(np.arange(100, dtype=np.int64), vecs)
    assert len(index) == 100
    assert index.search(vecs[99], 1)[0][0] == 99
    with pytest.raises(ValueError, match="new and distinct"):
        index.add_many(np.array([5, 200], dtype=np.int64), vecs[:2])


def test_nbytes_counts_the_vectors_and_gives_memory_back(make: Factory) -> None:
    """`nbytes` is what the semantic index counts against the cache's bound: at
    least the vectors held, and it falls again once most are removed."""
    rng = np.random.default_rng(9)
    index = make()
    empty = index.nbytes
    vecs = unit(rng, 200)
    for i, v in enumerate(vecs):
        index.add(i, v)
    full = index.nbytes
    assert full >= empty + 200 * DIM * 4
    for i in range(195):
        index.remove(i)
    assert index.nbytes < full - 100 * DIM * 4
    assert [i for i, _ in index.search(vecs[199], 1)] == [199]
