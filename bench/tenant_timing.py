"""Does another tenant's recent text answer faster? Paired timing of semantic lookups.

    .venv/bin/python -m bench.tenant_timing [--trials 150]

Each trial makes two fresh texts of the same shape, X and Y. Tenant A looks X up
and stores it (what a miss followed by the origin's answer does). Then tenant B
looks up X and Y, in a random order; the paired difference is B's time for Y minus
B's time for X, so a positive median means A's text answers B faster. The same is
measured for A itself (A's own X against a fresh Y) as a control: A's per-tenant
memo skips the model for its own recent text, so that row shows what a leak looks
like and that the method sees it.

Reported per row: the median paired difference (ms) and the share of trials in
which X was the faster one. With no cross-tenant signal, B's row is near 0 ms and
near 50 %; A's row is several ms and near 100 %.

Runs the real embedder (MiniLM int8, one onnxruntime thread) through
`SemanticIndex` on an event loop. Wall clock on a shared machine: compare the two
rows of one run, not runs.
"""

from __future__ import annotations

import os

# One BLAS thread, as the proxy runs (see bench/semantic_lookup.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import random
import statistics
import sys
import time

from dataplane.cache.embed import MiniLmOnnxEmbedder
from dataplane.cache.semantic import DEFAULT_THRESHOLD, SemanticIndex

_WORDS = [
    "invoice",
    "refund",
    "password",
    "router",
    "printer",
    "garden",
    "passport",
    "mortgage",
    "laptop",
    "recipe",
    "vaccine",
    "battery",
    "contract",
    "ticket",
    "warranty",
    "shipment",
    "thermostat",
    "license",
    "account",
    "balance",
    "schedule",
    "insurance",
    "visa",
    "charger",
    "bicycle",
    "kitchen",
    "roof",
    "tax",
    "salary",
    "pension",
    "tyre",
    "lamp",
    "carpet",
    "jacket",
    "meeting",
    "report",
    "budget",
    "server",
]
_SHAPES = (
    "how do I renew the {} for my {} before the {} deadline",
    "what happens to my {} if the {} breaks during the {} period",
    "can you compare the {} and the {} for a small {} team",
    "why is my {} slower after the {} update on the {}",
)


def fresh_text(rng: random.Random, seen: set[str]) -> str:
    """A question no tenant has sent in this run."""
    while True:
        text = rng.choice(_SHAPES).format(*rng.sample(_WORDS, 3)) + f" #{rng.randrange(10**6)}"
        if text not in seen:
            seen.add(text)
            return text


async def timed_lookup(index: SemanticIndex, tenant: str, text: str) -> float:
    t0 = time.perf_counter()
    await index.lookup(tenant, "m", "", text, DEFAULT_THRESHOLD)
    return time.perf_counter() - t0


async def paired(
    index: SemanticIndex, observer: str, trials: int, rng: random.Random, seen: set[str]
) -> list[float]:
    """Per trial, observer's time for a fresh text minus its time for A's recent text."""
    diffs = []
    for _ in range(trials):
        x, y = fresh_text(rng, seen), fresh_text(rng, seen)
        await index.lookup("tenant-a", "m", "", x, DEFAULT_THRESHOLD)
        await index.insert("tenant-a", "m", "", x, f"a:{x}")
        if rng.random() < 0.5:
            tx = await timed_lookup(index, observer, x)
            ty = await timed_lookup(index, observer, y)
        else:
            ty = await timed_lookup(index, observer, y)
            tx = await timed_lookup(index, observer, x)
        diffs.append(ty - tx)
    return diffs


def row(name: str, diffs: list[float]) -> str:
    faster = sum(d > 0 for d in diffs) / len(diffs)
    return f"{name:<34} {statistics.median(diffs) * 1e3:>8.2f} ms {faster:>8.1%}"


async def run(trials: int, seed: int) -> None:
    rng = random.Random(seed)
    seen: set[str] = set()
    index = SemanticIndex(MiniLmOnnxEmbedder())
    try:
        # Both tenants need a namespace: a lookup in an empty one returns
        # without embedding, which would time nothing.
        for tenant in ("tenant-a", "tenant-b"):
            text = fresh_text(rng, seen)
            await index.insert(tenant, "m", "", text, f"{tenant}:warm")
        for _ in range(10):  # warm the model and the executor thread
            await timed_lookup(index, "tenant-b", fresh_text(rng, seen))
        other = await paired(index, "tenant-b", trials, rng, seen)
        own = await paired(index, "tenant-a", trials, rng, seen)
    finally:
        index.close()
    print(f"{trials} paired trials, MiniLM int8, SemanticIndex.lookup")
    print(f"{'observer':<34} {'median Y-X':>11} {'X faster':>9}")
    print(row("tenant B, A's recent text (leak?)", other))
    print(row("tenant A, its own text (control)", own))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=150)
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args(argv)
    asyncio.run(run(args.trials, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
