"""Nearest-neighbour indexes over unit vectors, keyed by integer ids.

`VectorIndex` is the protocol the semantic index depends on. Contract, shared by every
implementation and checked by one suite (tests/unit/test_vectors.py):

- vectors are float32 of the index's `dim` with unit L2 norm; similarity is the inner
  product, i.e. cosine, in [-1, 1];
- `add(id, vec)` stores a vector under a fresh non-negative id. An id that is present
  is refused with ValueError; an id that was removed must not be added again either
  (HnswIndex hands removed ids' slots to new ids, so a comeback could alias them);
  the semantic index draws ids from a counter;
- `remove(id)` forgets an id and is idempotent (absent ids are ignored);
- `search(vec, k)` returns up to k `(id, similarity)` pairs of present ids, most
  similar first; fewer than k only when fewer are present (an approximate index may
  rank imperfectly but never returns removed ids);
- `len(index)` is the number of present ids;
- `nbytes` is the memory the index holds, allocated capacity included (vectors,
  graph links, id maps): what the semantic index counts against the cache's bound.
  It is computed from the index's shape, not measured, and follows removals:
  ExactIndex halves its arrays once its live ids fall to a quarter of its
  capacity; HnswIndex rebuilds its graph from the live vectors (a capacity of a
  quarter more than them) once its deleted slots outnumber both the live ones and 16;
- not thread-safe: one owner calls it (the semantic index calls it from its single
  executor thread only; a search costs 0.1-0.5 ms, see bench/semantic_lookup.py).

Implementations:

- `ExactIndex`: numpy brute force. Exact, a few microseconds per insert and no
  memory beyond the vectors (its arrays start at one row and grow by a quarter:
  most namespaces hold one or two vectors); a search grows with size (0.12 ms at 10k idle, 6 ms at
  100k; 0.75 ms at 10k on a busy machine, where HNSW took 0.08 ms). The test fake.
- `HnswIndex`: hnswlib's HNSW graph. Grows its capacity by a quarter and reuses the
  slots of removed ids (hnswlib only marks deletions). Chosen over usearch, which
  was 2-3x slower per query and per insert here and used more memory at 200k
  vectors, and over faiss, whose HNSW cannot delete. Once removed nodes outnumber
  live ones the graph is rebuilt from the live vectors (amortised O(1) per removal).
- `TieredIndex`: starts exact and moves to HNSW once it holds `promote_at` vectors,
  so the many small namespaces (one per conversation prefix) cost a small array each
  and microsecond inserts rather than a preallocated graph and ~0.2 ms per insert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]


class VectorIndex(Protocol):
    """Unit-vector similarity search by integer id (see the module doc for the contract)."""

    @property
    def dim(self) -> int: ...

    def add(self, id: int, vec: Vector) -> None: ...

    def remove(self, id: int) -> None: ...

    def search(self, vec: Vector, k: int = 1) -> list[tuple[int, float]]: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


# Memory of one id in a Python dict or set (the hash slot, the boxed int) and of an
# array's or index object's fixed part; measured with tracemalloc on CPython 3.12.
ID_ENTRY_BYTES = 64
OBJECT_BYTES = 400


def _grown(capacity: int) -> int:
    """An index's next capacity: a quarter more, not twice. Every slot costs a
    vector (and a graph's links) counted against the cache's bound, so a doubling
    would make one insert claim as much memory as the whole index, and the
    semantic index would evict half its entries to pay for it; a resize copies,
    so growth stays geometric (amortised O(1) per insert)."""
    return capacity + max(4, capacity // 4)


def _check_vec(vec: Vector, dim: int) -> Vector:
    arr = np.asarray(vec, dtype=np.float32).reshape(-1)
    if arr.shape[0] != dim:
        raise ValueError(f"vector has {arr.shape[0]} dimensions, the index {dim}")
    return arr


def _check_id(id_: int) -> None:
    if id_ < 0:
        raise ValueError("ids are non-negative")


class ExactIndex:
    """Brute-force inner product over a dense matrix; rows are compacted on removal."""

    def __init__(self, dim: int, initial_capacity: int = 1) -> None:
        self._dim = dim
        self._matrix = np.zeros((max(1, initial_capacity), dim), dtype=np.float32)
        self._ids = np.zeros(max(1, initial_capacity), dtype=np.int64)
        self._row_of: dict[int, int] = {}

    @property
    def dim(self) -> int:
        return self._dim

    def __len__(self) -> int:
        return len(self._row_of)

    @property
    def nbytes(self) -> int:
        return (
            OBJECT_BYTES
            + self._matrix.nbytes
            + self._ids.nbytes
            + ID_ENTRY_BYTES * len(self._row_of)
        )

    def _resize(self, capacity: int) -> None:
        n = len(self._row_of)
        matrix = np.zeros((capacity, self._dim), dtype=np.float32)
        matrix[:n] = self._matrix[:n]
        ids = np.zeros(capacity, dtype=np.int64)
        ids[:n] = self._ids[:n]
        self._matrix, self._ids = matrix, ids

    def add(self, id: int, vec: Vector) -> None:
        _check_id(id)
        arr = _check_vec(vec, self._dim)
        if id in self._row_of:
            raise ValueError(f"id {id} is already present")
        n = len(self._row_of)
        if n == self._matrix.shape[0]:
            self._resize(_grown(n))
        self._matrix[n] = arr
        self._ids[n] = id
        self._row_of[id] = n

    def remove(self, id: int) -> None:
        row = self._row_of.pop(id, None)
        if row is None:
            return
        last = len(self._row_of)  # index of the last live row before removal
        if row != last:  # move the last row into the hole
            moved = int(self._ids[last])
            self._matrix[row] = self._matrix[last]
            self._ids[row] = moved
            self._row_of[moved] = row
        # Halving at a quarter (not at a half) leaves room to grow again without
        # copying back and forth at one size.
        capacity = self._matrix.shape[0]
        if capacity > 1 and last <= capacity // 4:
            self._resize(capacity // 2)

    def search(self, vec: Vector, k: int = 1) -> list[tuple[int, float]]:
        n = len(self._row_of)
        if n == 0 or k <= 0:
            return []
        scores = self._matrix[:n] @ _check_vec(vec, self._dim)
        k = min(k, n)
        top = np.argpartition(-scores, k - 1)[:k] if k < n else np.arange(n)
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(self._ids[i]), float(scores[i])) for i in top]

    def items(self) -> tuple[npt.NDArray[np.int64], Vector]:
        """(ids, vectors) of every present entry, copies; used to promote to HNSW."""
        n = len(self._row_of)
        return self._ids[:n].copy(), self._matrix[:n].copy()


# hnswlib's memory (hnswalg.h, 0.8): 65,536 label-operation mutexes per graph; per
# slot of capacity the level-0 links and the vector, the label, a mutex, a level
# and a visited-list mark; per element a label-map node and, for the 1 in M that
# reach an upper level, that level's links; per deleted label a set node.
_HNSW_GRAPH_BYTES = 65_536 * 40
_HNSW_SLOT_EXTRA = 8 + 40 + 4 + 8 + 2
_HNSW_ELEMENT_BYTES = 48
_HNSW_DELETED_BYTES = 32


class HnswIndex:
    """hnswlib HNSW with inner-product space, growing capacity and slot reuse.

    Parameters (see bench/semantic_lookup.py for what they cost): `m` graph degree,
    `ef_construction` build beam, `ef_search` query beam (raised to k when k is
    larger). Searches run on one thread: the caller owns parallelism;
    `build_threads` only applies to bulk adds (benchmarks, promotion).
    """

    def __init__(
        self,
        dim: int,
        *,
        initial_capacity: int = 1024,
        m: int = 16,
        ef_construction: int = 100,
        ef_search: int = 64,
        seed: int = 100,
        build_threads: int = 1,
    ) -> None:
        self._dim = dim
        self._ef_search = ef_search
        self._build_threads = build_threads
        self._params = (m, ef_construction, seed)
        self._index = self._new_graph(max(16, initial_capacity))
        self._present: set[int] = set()
        self._deleted = 0  # marked-deleted slots that an add may reuse
        level0 = (2 * m) * 4 + 4  # hnswlib's maxM0 = 2M links of 4 bytes, and a count
        upper = (m * 4 + 4) // m  # one upper level's links, for 1 element in M
        self._slot_bytes = level0 + 4 * dim + _HNSW_SLOT_EXTRA
        self._element_bytes = _HNSW_ELEMENT_BYTES + upper + ID_ENTRY_BYTES

    def _new_graph(self, capacity: int) -> Any:
        import hnswlib  # noqa: PLC0415  (native; only loaded where a graph is used)

        m, ef_construction, seed = self._params
        graph = hnswlib.Index(space="ip", dim=self._dim)
        graph.init_index(
            max_elements=capacity,
            M=m,
            ef_construction=ef_construction,
            random_seed=seed,
            allow_replace_deleted=True,
        )
        graph.set_ef(self._ef_search)
        graph.set_num_threads(1)
        return graph

    def _rebuild(self) -> None:
        """A fresh graph of the live vectors: deleted nodes still cost traversal and,
        once they outnumber the live ones, can cut live nodes off from the entry point."""
        ids = np.fromiter(self._present, dtype=np.int64, count=len(self._present))
        vecs = (
            np.asarray(self._index.get_items(ids), dtype=np.float32)
            if len(ids)
            else np.zeros((0, self._dim), dtype=np.float32)
        )
        self._index = self._new_graph(max(16, _grown(len(ids))))
        self._present = set()
        self._deleted = 0
        self.add_many(ids, vecs)

    @property
    def dim(self) -> int:
        return self._dim

    def __len__(self) -> int:
        return len(self._present)

    @property
    def nbytes(self) -> int:
        return (
            OBJECT_BYTES
            + _HNSW_GRAPH_BYTES
            + self._slot_bytes * int(self._index.get_max_elements())
            + self._element_bytes * len(self._present)
            + _HNSW_DELETED_BYTES * self._deleted
        )

    def add(self, id: int, vec: Vector) -> None:
        self.add_many(np.asarray([id], dtype=np.int64), _check_vec(vec, self._dim)[None, :])

    def add_many(self, ids: npt.NDArray[np.int64], vecs: Vector) -> None:
        """Bulk add (same rules as add, for every id); much faster than a loop of adds."""
        if len(ids) == 0:
            return
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        if vecs.shape != (len(ids), self._dim):
            raise ValueError(f"expected vectors of shape ({len(ids)}, {self._dim})")
        new = [int(i) for i in ids]
        for i in new:
            _check_id(i)
        if len(set(new)) != len(new) or not self._present.isdisjoint(new):
            raise ValueError("ids must be new and distinct")
        reuse = min(self._deleted, len(new))
        if reuse:
            # replace_deleted takes the slot (and graph position) of a deleted label.
            self._index.add_items(vecs[:reuse], ids[:reuse], replace_deleted=True)
            self._deleted -= reuse
        rest = len(new) - reuse
        if rest:
            needed = self._index.get_current_count() + rest
            capacity = self._index.get_max_elements()
            if needed > capacity:
                while capacity < needed:
                    capacity = _grown(capacity)
                self._index.resize_index(capacity)
            self._index.add_items(vecs[reuse:], ids[reuse:], num_threads=self._build_threads)
        self._present.update(new)

    def remove(self, id: int) -> None:
        if id not in self._present:
            return
        self._index.mark_deleted(id)
        self._present.discard(id)
        self._deleted += 1
        if self._deleted > max(16, len(self._present)):
            self._rebuild()

    def search(self, vec: Vector, k: int = 1) -> list[tuple[int, float]]:
        n = len(self._present)
        if n == 0 or k <= 0:
            return []
        k = min(k, n)
        query = _check_vec(vec, self._dim)
        self._index.set_ef(max(self._ef_search, k))
        rebuilt = False
        while True:
            try:
                labels, distances = self._index.knn_query(query, k=k)
                break
            except RuntimeError:
                # hnswlib could not collect k live neighbours (many deletions
                # around the query): ask for fewer, and rebuild once if even one
                # live vector is out of reach.
                if k > 1:
                    k = max(1, k // 2)
                elif not rebuilt and self._deleted:
                    self._rebuild()
                    rebuilt = True
                else:
                    return []
        # The "ip" space reports 1 - <a, b> as its distance.
        return [(int(i), 1.0 - float(d)) for i, d in zip(labels[0], distances[0], strict=True)]


class TieredIndex:
    """Exact while small, HNSW from `promote_at` vectors on (never demoted).

    The promotion copies every vector into the graph in one bulk add, a one-off cost
    of about 0.1 s per thousand vectors at the default parameters; it happens inside
    the `add` that reaches the threshold.
    """

    def __init__(
        self,
        dim: int,
        *,
        promote_at: int = 4096,
        hnsw_factory: Callable[[int, int], HnswIndex] | None = None,
    ) -> None:
        self._dim = dim
        self._promote_at = promote_at
        self._hnsw_factory = hnsw_factory or (lambda d, cap: HnswIndex(d, initial_capacity=cap))
        self._exact: ExactIndex | None = ExactIndex(dim)
        self._hnsw: HnswIndex | None = None

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def promoted(self) -> bool:
        return self._hnsw is not None

    def __len__(self) -> int:
        if self._hnsw is not None:
            return len(self._hnsw)
        assert self._exact is not None
        return len(self._exact)

    @property
    def nbytes(self) -> int:
        if self._hnsw is not None:
            return OBJECT_BYTES + self._hnsw.nbytes
        assert self._exact is not None
        return OBJECT_BYTES + self._exact.nbytes

    def add(self, id: int, vec: Vector) -> None:
        if self._hnsw is not None:
            self._hnsw.add(id, vec)
            return
        assert self._exact is not None
        self._exact.add(id, vec)
        if len(self._exact) >= self._promote_at:
            ids, vecs = self._exact.items()
            hnsw = self._hnsw_factory(self._dim, _grown(len(ids)))
            hnsw.add_many(ids, vecs)
            self._hnsw, self._exact = hnsw, None

    def remove(self, id: int) -> None:
        if self._hnsw is not None:
            self._hnsw.remove(id)
        elif self._exact is not None:
            self._exact.remove(id)

    def search(self, vec: Vector, k: int = 1) -> list[tuple[int, float]]:
        if self._hnsw is not None:
            return self._hnsw.search(vec, k)
        assert self._exact is not None
        return self._exact.search(vec, k)
