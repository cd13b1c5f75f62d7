"""The semantic cache index: "has a question like this one been answered here?".

`SemanticIndex` maps the last user message of a request to the exact-cache key of
an earlier request whose answer may be reused. It stores no answers: a hit names an
exact-cache key and the caller fetches that entry.

Scoping, which is what makes a semantic hit safe:

- Namespaces. Entries live in a namespace `(tenant, model, context_hash)` and a
  lookup only sees its own namespace. `context_hash` is computed by the caller: a
  hash of everything in the request before the last user message (system prompt,
  earlier turns, tool calls and results) together with every parameter that is in
  the exact key except the last user message. So only the last user message is
  matched semantically, and two conversations whose earlier turns differ by a byte
  never share an answer ("what about the second one?" means something else in each).
- Threshold. A hit needs cosine similarity >= the caller's threshold (per tenant;
  see docs/semantic-cache.md for how the default was chosen).
- Entities. A hit also needs the entity signatures of the two messages to agree
  (`dataplane.cache.entities`): numbers, ids, amounts, dates, names, quoted strings.
  The top `candidates` neighbours above the threshold are tried in order, so a
  stored question with the same order id can still hit when a closer one with a
  different id is refused.
- Long texts. A message longer than the embedder's window (`Embedder.fits`) is not
  matched semantically at all: the model would only see its beginning.

Concurrency contract: every method is called from the event loop thread that owns
the index (it is not thread-safe). The embedding model runs in a dedicated
single-thread executor through `loop.run_in_executor`, so the loop never waits for
it; vector search (0.1-0.5 ms) and bookkeeping run on the loop. When more than
`max_pending` embeddings are queued, lookups and inserts are skipped (counted in
`stats.busy`): under overload the semantic cache steps aside instead of queueing
every request behind the model.

Eviction contract (callback-free): at most `max_entries` entries in all and
`max_entries_per_namespace` in one namespace; past either bound the least recently
inserted or hit entry goes. The index never calls back into the exact cache, and the
exact cache does not own semantic entries:

- when the exact cache drops an entry, the caller calls `remove(key)`;
- a hit may name a key the exact cache no longer has (expired, evicted, or a race
  with an insert in flight): the caller treats it as a miss and calls `remove(key)`;
- an entry evicted here stays in the exact cache, reachable by exact lookups.

`purge` drops namespaces at once (tenant, model or everything); an insert whose
embedding was in flight during a purge is dropped, so nothing purged comes back.
"""

from __future__ import annotations

import asyncio
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dataplane.cache.embed import Embedder
from dataplane.cache.entities import Entities, extract
from dataplane.cache.vectors import TieredIndex, Vector, VectorIndex

__all__ = ["DEFAULT_THRESHOLD", "SemanticHit", "SemanticIndex", "SemanticStats", "normalise_text"]

# The threshold a tenant gets unless it sets its own: the highest hit rate at which
# CLINC150's wrong hits stay under 1 % while the rate doubles that of a plain 0.95
# (docs/semantic-cache.md has the table, bench/cache_eval.py reproduces it).
DEFAULT_THRESHOLD = 0.90

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def normalise_text(text: str) -> str:
    """The form of a message that is embedded and compared.

    NFKC, casefold, whitespace collapsed, curly quotes made straight, trailing
    `?`, `.` and `!` stripped. Nothing else: dropping inner punctuation would make
    "C++", "C" and "C#" one language.
    """
    folded = unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold()
    return " ".join(folded.split()).rstrip("?.! ")


@dataclass(frozen=True, slots=True)
class SemanticHit:
    """A stored question close enough to the asked one: fetch `key` from the exact cache."""

    key: str
    similarity: float


@dataclass(slots=True)
class SemanticStats:
    """Counters since construction (monotonic; read them for metrics)."""

    lookups: int = 0
    hits: int = 0
    # a neighbour was above the threshold but every such one had other entities
    entity_blocked: int = 0
    too_long: int = 0  # message past the embedder's window, not matched
    busy: int = 0  # lookups or inserts skipped because the embedder queue was full
    inserts: int = 0
    evictions: int = 0


Namespace = tuple[str, str, str]  # (tenant, model, context_hash)


@dataclass(slots=True)
class _Entry:
    id: int
    key: str
    namespace: Namespace
    text: str  # normalised
    entities: Entities


@dataclass(slots=True)
class _Space:
    index: VectorIndex
    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # LRU order


@dataclass(frozen=True, slots=True)
class _Prepared:
    text: str  # normalised
    entities: Entities
    vector: Vector


class SemanticIndex:
    """Per-namespace vector indexes plus entry metadata. See the module doc.

    `embedder` is called only from the owned executor (or `executor`, if given; it
    must run one task at a time for `max_pending` to mean anything).
    `index_factory(dim)` makes the vector index of a new namespace (default: exact
    while small, HNSW past 4096 entries). `candidates` is how many neighbours above
    the threshold are checked for matching entities.
    """

    def __init__(
        self,
        embedder: Embedder,
        *,
        max_entries: int = 100_000,
        max_entries_per_namespace: int = 20_000,
        candidates: int = 4,
        max_pending: int = 64,
        entity_check: bool = True,
        index_factory: Callable[[int], VectorIndex] | None = None,
        executor: Executor | None = None,
        embedding_cache_size: int = 1024,
    ) -> None:
        if max_entries < 1 or max_entries_per_namespace < 1 or candidates < 1:
            raise ValueError("max_entries, max_entries_per_namespace and candidates must be >= 1")
        self._embedder = embedder
        self._max_entries = max_entries
        self._max_per_space = max_entries_per_namespace
        self._candidates = candidates
        self._max_pending = max_pending
        self._entity_check = entity_check
        self._index_factory = index_factory or TieredIndex
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ponto-embed"
        )
        self._pending = 0
        self._spaces: dict[Namespace, _Space] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # global LRU order
        self._by_key: dict[str, _Entry] = {}
        self._next_id = 0
        self._purges = 0  # bumped by purge; inserts in flight across one are dropped
        # A miss is usually followed by an insert of the same message once the
        # origin answers; keeping recent preparations saves embedding it twice.
        self._recent: OrderedDict[str, _Prepared] = OrderedDict()
        self._recent_size = embedding_cache_size
        self.stats = SemanticStats()

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Stop the owned executor (queued embeddings are cancelled). Idempotent."""
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- embedding, off the loop ------------------------------------------------

    def _prepare_sync(self, text: str) -> _Prepared | None:
        """Runs in the executor: everything that is O(text) or costs a model call."""
        if not self._embedder.fits(text):
            return None
        normalised = normalise_text(text)
        vector = self._embedder.embed([normalised])[0]
        return _Prepared(normalised, extract(text), vector)

    async def _prepare(self, text: str) -> _Prepared | bool | None:
        """The prepared message; None when too long; False when the embedder is busy."""
        cached = self._recent.get(text)
        if cached is not None:
            self._recent.move_to_end(text)
            return cached
        if self._pending >= self._max_pending:
            self.stats.busy += 1
            return False
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._executor, self._prepare_sync, text)
        finally:
            self._pending -= 1
        if prepared is None:
            self.stats.too_long += 1
            return None
        self._recent[text] = prepared
        if len(self._recent) > self._recent_size:
            self._recent.popitem(last=False)
        return prepared

    # -- the API ----------------------------------------------------------------

    async def lookup(
        self, tenant: str, model: str, context_hash: str, text: str, threshold: float
    ) -> SemanticHit | None:
        """The best stored message of this namespace that may share `text`'s answer.

        `text` is the last user message as sent (entities are read from it before
        normalisation, since capitals mark names). Returns None on a miss, when the
        namespace is empty, when the message is too long or the embedder is busy.
        A hit counts as a use of the entry for eviction.
        """
        self.stats.lookups += 1
        if (tenant, model, context_hash) not in self._spaces:
            return None  # nothing to compare with: do not spend an embedding
        prepared = await self._prepare(text)
        if not isinstance(prepared, _Prepared):
            return None
        space = self._spaces.get((tenant, model, context_hash))  # may be gone after await
        if space is None:
            return None
        blocked = False
        for entry_id, similarity in space.index.search(prepared.vector, self._candidates):
            if similarity < threshold:
                break
            entry = space.entries[entry_id]
            if (
                not self._entity_check
                or entry.text == prepared.text
                or entry.entities.matches(prepared.entities)
            ):
                space.entries.move_to_end(entry_id)
                self._entries.move_to_end(entry_id)
                self.stats.hits += 1
                return SemanticHit(entry.key, min(1.0, similarity))
            blocked = True
        if blocked:
            self.stats.entity_blocked += 1
        return None

    async def insert(self, tenant: str, model: str, context_hash: str, text: str, key: str) -> None:
        """Store `text` (a last user message) as answered by exact-cache entry `key`.

        Call it after the exact cache has stored `key`. A key stored before is
        replaced (one entry per key). May evict other entries (see the module doc);
        silently skipped when the message is too long or the embedder is busy.
        """
        purges = self._purges
        prepared = await self._prepare(text)
        if not isinstance(prepared, _Prepared) or purges != self._purges:
            return
        self.remove(key)
        namespace = (tenant, model, context_hash)
        space = self._spaces.get(namespace)
        if space is None:
            space = _Space(self._index_factory(prepared.vector.shape[0]))
            self._spaces[namespace] = space
        entry = _Entry(self._next_id, key, namespace, prepared.text, prepared.entities)
        self._next_id += 1
        space.index.add(entry.id, np.asarray(prepared.vector, dtype=np.float32))
        space.entries[entry.id] = entry
        self._entries[entry.id] = entry
        self._by_key[key] = entry
        self.stats.inserts += 1
        while len(space.entries) > self._max_per_space:
            self._evict(next(iter(space.entries.values())))
        while len(self._entries) > self._max_entries:
            self._evict(next(iter(self._entries.values())))

    def remove(self, key: str) -> bool:
        """Forget the entry stored for `key`; False when there was none."""
        entry = self._by_key.get(key)
        if entry is None:
            return False
        self._drop(entry)
        return True

    def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        """Drop every entry of `tenant` (all tenants if None) and `model` (all if None).

        Returns the number of entries dropped. Inserts in flight are dropped too.
        """
        self._purges += 1
        self._recent.clear()
        doomed = [
            ns
            for ns in self._spaces
            if (tenant is None or ns[0] == tenant) and (model is None or ns[1] == model)
        ]
        dropped = 0
        for ns in doomed:
            space = self._spaces.pop(ns)
            for entry in space.entries.values():
                del self._entries[entry.id]
                del self._by_key[entry.key]
            dropped += len(space.entries)
        return dropped

    def namespaces(self) -> int:
        return len(self._spaces)

    def _evict(self, entry: _Entry) -> None:
        self.stats.evictions += 1
        self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.id]
        del self._by_key[entry.key]
        space = self._spaces[entry.namespace]
        del space.entries[entry.id]
        if space.entries:
            space.index.remove(entry.id)
        else:
            del self._spaces[entry.namespace]  # an empty namespace costs nothing
