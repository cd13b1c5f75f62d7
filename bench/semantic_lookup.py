"""Semantic lookup latency at 10k and 1M entries, insert cost and memory.

    .venv/bin/python -m bench.semantic_lookup [--large 1000000] [--queries 1000]

Prints, in one run:

1. the embedding of one query (MiniLM int8, one onnxruntime thread), p50/p99;
2. vector search at 10k entries of real query embeddings (CLINC150, cached on
   disk like bench/cache_eval.py's), with the shipped
   defaults: `TieredIndex` (HNSW M=16, ef_construction=100, ef_search=64) beside
   exact numpy search; top-1 agreement of HNSW with exact;
3. `SemanticIndex.lookup` end to end at 10k entries (executor hop, embedding,
   search, entity check) of unseen queries, p50/p99, on a running event loop;
4. vector search at `--large` entries (1M by default), with a smaller graph so
   that the build fits the time budget (M=8, ef_construction=24, built on 2
   threads). The fill is synthetic but shaped like a cache: the 10k real
   embeddings, each repeated with random noise (cosine about 0.9 to the original).
   (Plain random unit vectors are the worst case for HNSW, no cluster structure at
   all: at 1M with these parameters top-1 recall of a planted neighbour was ~10 %.)
   Probes are unseen real queries and rephrased stored entries (noise at cosine
   ~0.96); reported: how often HNSW's top-1 comes from the same real query as the
   exact (brute-force) top-1, and how many would-be hits (an exact neighbour at or
   above the default threshold) HNSW keeps.

Memory is the growth of the process's resident set while an index is built
(includes allocator slack). Latencies are wall clock on a shared 2-core machine:
compare rows of one run, not runs.
"""

from __future__ import annotations

import os

from bench.data import SEMCACHE

# One BLAS thread, as the proxy should run (see docs/semantic-cache.md): on a busy
# 2-core machine OpenBLAS's second thread made a 10k x 384 product 5-9x slower.
# Set before numpy is imported, which reads it once.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from bench.cache_eval import embeddings
from dataplane.cache.embed import MiniLmOnnxEmbedder
from dataplane.cache.semantic import DEFAULT_THRESHOLD, SemanticIndex, normalise_text
from dataplane.cache.vectors import ExactIndex, HnswIndex, TieredIndex, Vector, VectorIndex

DATA = SEMCACHE  # ../shared/data/semcache, or $PONTO_SEMCACHE_DATA
DIM = 384


def rss_mb() -> float:
    """Current resident set size (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, seconds: Sequence[float], extra: str = "") -> None:
    print(
        f"  {name:<44} p50 {1e3 * statistics.median(seconds):7.3f} ms"
        f"  p99 {1e3 * pct(seconds, 0.99):7.3f} ms  {extra}",
        flush=True,
    )


def clinc_texts() -> list[str]:
    data = json.loads((DATA / "clinc150_train_val.json").read_text(encoding="utf-8"))
    texts = sorted({normalise_text(t) for split in data.values() for t, _ in split})
    rng = np.random.default_rng(1)
    rng.shuffle(texts)
    return texts


def unit_rows(rng: np.random.Generator, n: int) -> npt.NDArray[np.float32]:
    v = rng.standard_normal((n, DIM), dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def bench_embedding(embedder: MiniLmOnnxEmbedder, texts: list[str], n: int) -> None:
    print("\n1. embedding one query (MiniLM int8, 1 thread)")
    embedder.embed(texts[:8])
    samples = [texts[i % len(texts)] for i in range(n)]
    it = iter(samples)
    cpu = time.process_time()
    wall = timed(lambda: embedder.embed([next(it)]), n)
    cpu_ms = 1e3 * (time.process_time() - cpu) / n
    row("embed([query])", wall, f"CPU {cpu_ms:.2f} ms/query")


class Precomputed:
    """The real embedder, short-cut for texts embedded beforehand (to fill fast)."""

    def __init__(self, real: MiniLmOnnxEmbedder, table: dict[str, npt.NDArray[np.float32]]):
        self._real = real
        self._table = table
        self.dim = real.dim

    def fits(self, text: str) -> bool:
        return self._real.fits(text)

    def may_fit(self, text: str) -> bool:
        return self._real.may_fit(text)

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if all(t in self._table for t in texts):
            return np.stack([self._table[t] for t in texts])
        return self._real.embed(texts)


def bench_10k(vectors: npt.NDArray[np.float32], queries: int) -> None:
    stored, unseen = vectors[:-queries], vectors[-queries:]
    print(f"\n2. vector search at {len(stored)} entries (real CLINC150 embeddings)")
    # Probes: half unseen queries, half stored ones.
    probes = np.concatenate([unseen[: queries // 2], stored[: queries - queries // 2]])
    results: dict[str, list[int]] = {}
    for name, make in (
        ("exact (numpy)", lambda: ExactIndex(DIM)),
        ("tiered -> HNSW M=16 efc=100 ef=64", lambda: TieredIndex(DIM)),
    ):
        gc.collect()
        before = rss_mb()
        index: VectorIndex = make()
        t0 = time.perf_counter()
        for i, v in enumerate(stored):
            index.add(i, v)
        insert = (time.perf_counter() - t0) / len(stored)
        grown = rss_mb() - before
        found: list[int] = []
        it = iter(probes)

        def search(
            index: VectorIndex = index, found: list[int] = found, it: Iterator[Vector] = it
        ) -> None:
            found.append(index.search(next(it), 1)[0][0])

        row(
            f"{name} search",
            timed(search, len(probes)),
            f"insert {1e6 * insert:6.1f} us/entry (incl. promotion)  RSS +{grown:.0f} MB",
        )
        results[name] = found
    exact, approx = results.values()
    agree = sum(a == b for a, b in zip(exact, approx, strict=True)) / len(exact)
    print(f"  HNSW top-1 equals exact top-1 for {100 * agree:.1f} % of queries")


async def bench_lookup(embedder: Precomputed, texts: list[str], queries: int) -> None:
    stored, probes = texts[:-queries], texts[-queries:]
    print(f"\n3. SemanticIndex.lookup end to end at {len(stored)} entries")
    index = SemanticIndex(embedder, max_entries=len(texts))
    t0 = time.perf_counter()
    for i, text in enumerate(stored):
        await index.insert("tenant", "model", "ctx", text, f"key-{i}")
    await index.flush()
    per = (time.perf_counter() - t0) / len(stored)
    print(
        f"  insert with a precomputed vector (executor hop + index add): {1e3 * per:.3f} ms/entry"
    )
    samples = []
    cpu = time.process_time()
    for text in probes:
        t0 = time.perf_counter()
        await index.lookup("tenant", "model", "ctx", text, DEFAULT_THRESHOLD)
        samples.append(time.perf_counter() - t0)
    cpu_ms = 1e3 * (time.process_time() - cpu) / len(probes)
    row(
        "lookup of an unseen query (embeds it)",
        samples,
        f"CPU {cpu_ms:.2f} ms/lookup, hits {index.stats.hits}/{len(probes)} at {DEFAULT_THRESHOLD}",
    )
    index.close()


def fill_chunk(centres: npt.NDArray[np.float32], start: int, size: int) -> Vector:
    """Entries start..start+size of the large fill: a real query embedding plus noise
    (cosine about 0.9 to it), so the fill has the cluster structure of a cache full
    of paraphrases. Deterministic per chunk, so it can be regenerated for exact search.
    """
    rng = np.random.default_rng(1000 + start)
    base = centres[np.arange(start, start + size) % len(centres)]
    noisy = base + 0.5 * unit_rows(rng, size)
    noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
    return noisy


def bench_large(
    n: int, centres: npt.NDArray[np.float32], unseen: Vector, m: int, ef_construction: int
) -> None:
    params = {"m": m, "ef_construction": ef_construction, "ef_search": 64}
    print(
        f"\n4. vector search at {n:,} entries: {len(centres)} real embeddings, each"
        f" repeated with noise (HNSW {params}, built on 2 threads)"
    )
    gc.collect()
    before = rss_mb()
    index = HnswIndex(DIM, initial_capacity=n, build_threads=2, **params)
    chunk = 50_000
    chunks = -(-n // chunk)
    per_chunk = -(-len(unseen) // chunks)
    paraphrased: list[Vector] = []
    rng = np.random.default_rng(3)
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        vecs = fill_chunk(centres, start, size)
        index.add_many(np.arange(start, start + size, dtype=np.int64), vecs)
        # a few stored entries, rephrased: noise at cosine ~0.96, so they should hit
        picked = vecs[rng.choice(size, min(size, per_chunk), replace=False)]
        paraphrased.append(picked + 0.28 * unit_rows(rng, len(picked)))
    build = time.perf_counter() - t0
    near = np.concatenate(paraphrased)[: len(unseen)]
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    probes = np.concatenate([unseen, near])
    grown = rss_mb() - before
    print(
        f"  build {build:.0f} s ({1e6 * build / n:.0f} us/entry on 2 threads), "
        f"RSS +{grown:.0f} MB ({grown * 2**20 / n:.0f} B/entry)"
    )
    # Exact top-1 of every probe, chunk by chunk.
    best = np.full(len(probes), -np.inf, dtype=np.float32)
    best_id = np.zeros(len(probes), dtype=np.int64)
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        scores = probes @ fill_chunk(centres, start, size).T
        top = scores.argmax(axis=1)
        better = scores[np.arange(len(probes)), top] > best
        best = np.where(better, scores[np.arange(len(probes)), top], best)
        best_id = np.where(better, start + top, best_id)
    for ef in (64, 128):
        index._ef_search = ef
        got: list[tuple[int, float]] = []
        it = iter(probes)

        def search(got: list[tuple[int, float]] = got, it: Iterator[Vector] = it) -> None:
            got.append(index.search(next(it), 1)[0])

        samples = timed(search, len(probes))
        ids = np.array([i for i, _ in got])
        sims = np.array([s for _, s in got])
        same = float(np.mean(ids % len(centres) == best_id % len(centres)))
        would_hit = best >= DEFAULT_THRESHOLD
        found = float(np.mean(sims[would_hit] >= DEFAULT_THRESHOLD)) if would_hit.any() else 1.0
        row(
            f"HNSW search ef_search={ef}",
            samples,
            f"same source as exact top-1 {100 * same:.1f} %; hits kept {100 * found:.1f} %",
        )
    print(
        f"  (probes: {len(unseen)} unseen real queries and {len(near)} rephrased stored"
        f" entries; 'hits kept': of the {int(would_hit.sum())} probes with an exact"
        f" neighbour >= {DEFAULT_THRESHOLD}, the share for which HNSW returns one too)"
    )
    extra = fill_chunk(centres, n, 1000)
    t0 = time.perf_counter()
    for i, v in enumerate(extra):
        index.add(n + i, v)
    per = (time.perf_counter() - t0) / len(extra)
    print(f"  insert, one at a time into the full graph: {1e3 * per:.3f} ms/entry")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--m", type=int, default=8, help="HNSW degree for the large index")
    parser.add_argument(
        "--ef-construction", type=int, default=24, help="HNSW build beam for the large index"
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    embedder = MiniLmOnnxEmbedder()
    every = clinc_texts()
    texts = every[: args.small + args.queries]
    bench_embedding(embedder, texts, 300)
    # All of CLINC150, so that the on-disk cache of bench.cache_eval is reused.
    vectors = embeddings(every, threads=2)[: len(texts)]
    bench_10k(vectors, args.queries)
    table = dict(zip(texts[: args.small], vectors[: args.small], strict=True))
    filled = texts[: args.small + args.queries // 2]  # 10k stored, then unseen probes
    asyncio.run(bench_lookup(Precomputed(embedder, table), filled, args.queries // 2))
    if args.large:
        bench_large(
            args.large, vectors[: args.small], vectors[args.small :], args.m, args.ef_construction
        )
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
