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
  see docs/semantic-cache.md for how the default was chosen). With an error bound
  (`max_error` > 0) the tenant's `Learner` (dataplane.cache.bounded) judges the
  nearest neighbour instead, from its checked answers: hit, verify or observe.
- Entities. A hit also needs the entity signatures of the two messages to agree
  (`dataplane.cache.entities`): numbers, ids, amounts, dates, names, quoted strings,
  and no opposite reading (`dataplane.cache.opposites`: two words exchanged around
  to/from/into/than, "miles to kilometers" / "kilometers to miles", or a listed
  antonym, buy / sell).
  The top `candidates` neighbours above the threshold are tried in order, so a
  stored question with the same order id can still hit when a closer one with a
  different id is refused.
- Long texts. A message longer than the embedder's window (`Embedder.fits`) is not
  matched semantically at all: the model would only see its beginning.

Concurrency contract: every method is called from the event loop thread that owns
the index (it is not thread-safe). Two owners, no locks:

- the loop owns the metadata (entries, keys, namespaces, LRU order, counters);
- one dedicated executor thread owns the embedder and every vector index: a lookup
  embeds and searches there in one `loop.run_in_executor` call, and index mutations
  (add, remove) are submitted there in order, fire-and-forget. The loop never waits
  for the model, a search, an HNSW insert or a one-off promotion of a growing
  namespace from exact search to HNSW (about a second at 4096 entries).

A search may return an id the loop has removed meanwhile; the loop skips ids it no
longer knows. When more than `max_pending` calls wait for the executor, lookups and
inserts are skipped (counted in `stats.busy`): under overload the semantic cache
steps aside instead of queueing every request behind the model.

Eviction contract (callback-free): at most `max_entries` entries in all,
`max_entries_per_namespace` in one namespace and `max_bytes` of memory (`nbytes`);
past any bound the least recently inserted or hit entry goes. The index never
calls back into the exact cache, and the exact cache does not own semantic
entries:

- when the exact cache drops an entry, the caller calls `remove(key)`;
- a hit may name a key the exact cache no longer has (expired, evicted, or a race
  with an insert in flight): the caller treats it as a miss and calls `remove(key)`;
- an entry evicted here stays in the exact cache, reachable by exact lookups.

`purge` drops namespaces at once (tenant, model or everything); an insert whose
embedding was in flight during a purge is dropped, so nothing purged comes back.

Memory (`nbytes`): every byte an entry keeps is counted, on the loop, at insert:
the entry's objects and map slots, its key, text and entity signature (measured
with sys.getsizeof), and its share of the namespace's vector index (and the
memo of recent embeddings, at most an eighth of `max_bytes`), whose
allocated size (capacity included) the executor thread reports after each
mutation (`VectorIndex.nbytes`). Between a mutation and its report the loop adds
a prediction (a slot's id entries per add, minus per removal: capacity is
allocated ahead and given back only when an index shrinks), corrected by the
report, so eviction never waits for the executor; when an index grew its
capacity beyond the prediction, the executor asks the loop to evict again
(`_rebalance`), so the bound holds again within one turn of the loop.

Region feed: `on_insert` (if set) is called with every entry `insert` adds, vector
included, so that `dataplane.cache.semfeed` can publish it to the other proxies of
the region, whose feeds add it with `insert_vector` (no model call there).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from dataplane.cache.bounded import (
    DEFAULT_TUNING,
    Action,
    Answer,
    Evidence,
    Learner,
    Tuning,
    by_meaning,
    same_answer,
)
from dataplane.cache.embed import Embedder
from dataplane.cache.entities import Entities, extract
from dataplane.cache.semsizes import DEFAULT_MAX_ENTRIES, ENTRY_BYTES
from dataplane.cache.textform import STRAIGHT_QUOTES, fold_line, nfkc
from dataplane.cache.vectors import ID_ENTRY_BYTES, TieredIndex, Vector, VectorIndex

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_THRESHOLD",
    "Inserted",
    "SemanticHit",
    "SemanticIndex",
    "SemanticStats",
    "entities_bytes",
    "normalise_text",
]

# The threshold a tenant gets unless it sets its own: the highest hit rate at which
# CLINC150's wrong hits stay under 1 % while the rate doubles that of a plain 0.95
# (docs/semantic-cache.md has the table, bench/cache_eval.py reproduces it).
DEFAULT_THRESHOLD = 0.90

# DEFAULT_MAX_ENTRIES and ENTRY_BYTES (dataplane.cache.semsizes); and of a
# namespace beyond its context string: the _Space, its map, the namespace tuple
# and its slot in the namespace map. Measured with tracemalloc (CPython 3.11).
NAMESPACE_BYTES = 700
# An entry's Evidence once checked (at most, see dataplane.cache.bounded), and an
# error-bounded tenant's Learner (its curve's bins and counters).
EVIDENCE_BYTES = 112
LEARNER_BYTES = 5_500
# Characters of an answer given to the model when comparing two answers: more
# than its window of 256 word pieces holds.
ANSWER_CHARS = 2048
# A comparison by meaning (two answer embeddings, several times a lookup's) is
# skipped when this many tasks are queued on or running in the embedding thread,
# so it waits behind at most one: under load, learning gives way to lookups.
CHECK_QUEUE = 2


def normalise_text(text: str) -> str:
    """The form of a message that is embedded and compared.

    NFKC (textform.nfkc), casefold, curly quotes made straight, whitespace
    collapsed but within quotes (textform.fold_line), trailing
    `?`, `.` and `!` stripped. Nothing else: dropping inner punctuation would make
    "C++", "C" and "C#" one language.
    """
    folded = nfkc(text).translate(STRAIGHT_QUOTES).casefold()
    return fold_line(folded).rstrip("?.! ")


@dataclass(frozen=True, slots=True)
class SemanticHit:
    """A stored question close enough to the asked one: fetch `key` from the exact cache.

    `action` is HIT with a fixed threshold. Under an error bound, VERIFY (a
    would-be hit: ask the origin and `check` the answers) or OBSERVE (a miss close
    enough to learn from: `check` the origin's answer against `key`'s) as well.
    """

    key: str
    similarity: float
    action: Action = Action.HIT


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
    # entries added from other proxies (insert_vector), and those refused: a key
    # held already, a vector of another size, or the index closed
    remote_inserts: int = 0
    remote_refused: int = 0
    verifies: int = 0  # would-be hits sent to the origin to check them (error bound)
    checks: int = 0  # answers compared with a neighbour's (verifications and near misses)
    wrong_checks: int = 0  # of which the neighbour's answer differed
    checks_skipped: int = 0  # comparisons by meaning dropped: lookups were queued


def entities_bytes(entities: Entities) -> int:
    """Memory of an entity signature: the object, its four sets and their strings."""
    total = sys.getsizeof(entities)
    for values in (entities.strict, entities.names, entities.words, entities.sides):
        total += sys.getsizeof(values) + sum(sys.getsizeof(v) for v in values)
    return total


@dataclass(frozen=True, slots=True)
class Inserted:
    """An entry `insert` added: what another proxy needs to add it without the model."""

    tenant: str
    model: str
    context: str
    key: str
    vector: Vector  # normalised float32, the index's dim; read-only
    entities: Entities


InsertListener = Callable[[Inserted], None]


Namespace = tuple[str, str, str]  # (tenant, model, context_hash)


@dataclass(slots=True)
class _Entry:
    id: int
    key: str
    namespace: Namespace
    # Normalised; None for an entry from another proxy (only its vector travels).
    text: str | None
    entities: Entities
    cost: int  # bytes, beyond the vector index
    # What checks of its answer said (error-bounded tenants); None until checked.
    evidence: Evidence | None = None


@dataclass(slots=True)
class _Space:
    index: VectorIndex
    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # LRU order
    cost: int = 0  # bytes of the namespace itself, beyond entries and index
    # Bytes of the vector index: `report` = (its nbytes, `cum` when the executor
    # measured it), written by the executor thread only; `cum` = the sum of the
    # loop's predictions so far, so nbytes now ~ report[0] + cum - report[1].
    cum: int = 0
    report: tuple[int, int] = (0, 0)


_T = TypeVar("_T")


class _Skipped(enum.Enum):
    """Work not done: the index is closed or the executor queue is full."""

    SKIPPED = enum.auto()


SKIPPED = _Skipped.SKIPPED


@dataclass(frozen=True, slots=True)
class _Prepared:
    text: str  # normalised
    entities: Entities
    vector: Vector


class SemanticIndex:
    """Per-namespace vector indexes plus entry metadata. See the module doc.

    `embedder` and every vector index are used only from one executor thread: the
    owned single-thread executor, or `executor` if given, which must then run one
    task at a time (a single-thread pool) because the indexes are not thread-safe.
    `index_factory(dim)` makes the vector index of a new namespace, on the loop, so
    it must be cheap (default: exact while small, HNSW past 4096 entries).
    `candidates` is how many neighbours above the threshold are checked for matching
    entities. `rng` draws the error-bounded tenants' verifications; `tuning` is
    their learners' (dataplane.cache.bounded.Tuning).
    """

    def __init__(
        self,
        embedder: Embedder,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_entries_per_namespace: int = 20_000,
        candidates: int = 4,
        max_pending: int = 64,
        entity_check: bool = True,
        index_factory: Callable[[int], VectorIndex] | None = None,
        executor: Executor | None = None,
        embedding_cache_size: int = 1024,
        max_bytes: int | None = None,
        rng: Callable[[], float] = random.random,
        tuning: Tuning = DEFAULT_TUNING,
    ) -> None:
        if max_entries < 1 or max_entries_per_namespace < 1 or candidates < 1:
            raise ValueError("max_entries, max_entries_per_namespace and candidates must be >= 1")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be 0 or more")
        self._embedder = embedder
        self._max_bytes = max_bytes
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
        self._closed = False
        self._pending = 0
        self._spaces: dict[Namespace, _Space] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # global LRU order
        self._by_key: dict[str, _Entry] = {}
        self._next_id = 0
        self._purges = 0  # bumped by purge; inserts in flight across one are dropped
        # A miss is usually followed by an insert of the same message once the
        # origin answers; keeping recent preparations saves embedding it twice.
        # Keyed by tenant as well as text: a memo shared across tenants would let
        # one tenant time whether another just sent a text (a hit skips the model).
        self._recent: OrderedDict[tuple[str, str], tuple[_Prepared, int]] = OrderedDict()
        self._recent_size = embedding_cache_size
        # Its bytes count too, and it may take at most an eighth of max_bytes.
        self._recent_bytes = 0
        self._recent_max_bytes = max_bytes // 8 if max_bytes is not None else None
        self._rng = rng
        self._tuning = tuning
        # One per error-bounded tenant: its calibration and verification budget.
        self._learners: dict[str, Learner] = {}
        self.stats = SemanticStats()
        # Memory (see the module doc): entries' and namespaces' own bytes, kept on
        # the loop; the vector indexes' total as the executor last measured it,
        # with the loop's predictions since (`_cum`, as for a _Space).
        self._meta_bytes = 0
        self._cum = 0
        self._vec_total = 0  # executor thread only
        self._vec_report: tuple[int, int] = (0, 0)
        # Predicted change of an index's bytes per add and per removal: a slot's
        # id entries, as capacity is allocated ahead (a growth is measured and
        # rebalanced) and a removal frees its slot only when capacity shrinks.
        self._add_bytes = 2 * ID_ENTRY_BYTES
        self._remove_bytes = ID_ENTRY_BYTES
        self._loop: asyncio.AbstractEventLoop | None = None  # for _rebalance
        # See the module doc. Called on the loop; must be quick and must not raise.
        self.on_insert: InsertListener | None = None
        # Called after an insert has grown the index (the exact store's fit(), so
        # the two keep to one bound); may call remove().
        self.on_grow: Callable[[], object] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def dim(self) -> int:
        return self._embedder.dim

    @property
    def nbytes(self) -> int:
        """Memory held: entries, namespaces and vector indexes (see the module doc)."""
        total, cum = self._vec_report
        return self._meta_bytes + self._recent_bytes + total + self._cum - cum

    def namespaces(self) -> int:
        return len(self._spaces)

    async def flush(self) -> None:
        """Wait until every index operation submitted so far has run (the executor is
        first in, first out). For tests, benchmarks and orderly shutdown."""
        if not self._closed:
            await asyncio.get_running_loop().run_in_executor(self._executor, _nothing)

    def close(self) -> None:
        """Stop the owned executor (queued work is cancelled); later lookups miss and
        inserts are ignored. Idempotent."""
        self._closed = True
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the executor thread: embedding and every vector index operation --------

    def _prepare_sync(self, text: str) -> _Prepared | None:
        """Everything that is O(text) or costs a model call; None when too long."""
        if not self._embedder.fits(text):
            return None
        normalised = normalise_text(text)
        vector = np.asarray(self._embedder.embed([normalised])[0], dtype=np.float32)
        return _Prepared(normalised, extract(text), vector)

    def _lookup_sync(
        self, index: VectorIndex, text: str, prepared: _Prepared | None
    ) -> tuple[_Prepared, list[tuple[int, float]]] | None:
        prepared = prepared or self._prepare_sync(text)
        if prepared is None:
            return None
        return prepared, index.search(prepared.vector, self._candidates)

    def _submit(self, fn: Callable[..., object], *args: object) -> None:
        """Fire-and-forget an index mutation; the single thread keeps the order."""
        if self._closed:
            return
        self._executor.submit(fn, *args).add_done_callback(_log_failure)

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T | _Skipped:
        """fn(*args) in the executor, unless closed or too much work is queued."""
        if self._closed:
            return SKIPPED
        if self._pending >= self._max_pending:
            self.stats.busy += 1
            return SKIPPED
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._pending -= 1

    def _remember(self, memo: tuple[str, str], prepared: _Prepared) -> None:
        cost = (
            ENTRY_BYTES
            + sys.getsizeof(memo[1])
            + sys.getsizeof(prepared.text)
            + prepared.vector.nbytes
            + entities_bytes(prepared.entities)
        )
        old = self._recent.pop(memo, None)
        if old is not None:
            self._recent_bytes -= old[1]
        self._recent[memo] = (prepared, cost)
        self._recent_bytes += cost
        limit = self._recent_max_bytes
        while len(self._recent) > self._recent_size or (
            limit is not None and self._recent_bytes > limit and self._recent
        ):
            self._recent_bytes -= self._recent.popitem(last=False)[1][1]

    def _recalled(self, memo: tuple[str, str]) -> _Prepared | None:
        found = self._recent.get(memo)
        return found[0] if found is not None else None

    # -- the API (event loop thread) ---------------------------------------------

    def may_fit(self, text: str) -> bool:
        """Whether `text`, a last user message's text as sent, may fit the
        embedder's window once normalised (`Embedder.may_fit`): False only
        for one `lookup` and `insert` would find too long, counted as such.
        Cheap (no normalisation, no tokenizer): the caller asks it on the
        event loop before it normalises the text, which for a document of
        megabytes costs far more than the lookup it would feed."""
        if self._embedder.may_fit(text):
            return True
        self.stats.too_long += 1
        return False

    async def lookup(
        self,
        tenant: str,
        model: str,
        context_hash: str,
        text: str,
        threshold: float,
        max_error: float = 0.0,
    ) -> SemanticHit | None:
        """The best stored message of this namespace that may share `text`'s answer.

        `text` is the last user message as sent (entities are read from it before
        normalisation, since capitals mark names). Returns None on a miss, when the
        namespace is empty, when the message is too long or the embedder is busy.
        A hit counts as a use of the entry for eviction.

        `max_error` > 0: the tenant's bound on wrong hits. The nearest neighbour with
        matching entities at or above the learner's band is judged by the tenant's
        `Learner`, with `threshold` as its cold-start prior, and returned with its
        action; the caller reports VERIFY and OBSERVE outcomes through `check`.
        """
        learner = self._learner(tenant, threshold, max_error) if max_error > 0 else None
        found = await self._nearest(tenant, model, context_hash, text, threshold, learner)
        if found is None:
            if learner is not None:
                learner.count_miss()
            return None
        entry, similarity = found
        action = Action.HIT
        if learner is not None:
            action = learner.decide(similarity, entry.evidence)
            if action is Action.VERIFY:
                self.stats.verifies += 1
        if action is Action.HIT:
            space = self._spaces[entry.namespace]
            space.entries.move_to_end(entry.id)
            self._entries.move_to_end(entry.id)
            self.stats.hits += 1
        return SemanticHit(entry.key, min(1.0, similarity), action)

    async def _nearest(
        self,
        tenant: str,
        model: str,
        context_hash: str,
        text: str,
        threshold: float,
        learner: Learner | None,
    ) -> tuple[_Entry, float] | None:
        """The closest entry at or above the threshold (or the learner's band)
        whose entities match, among the top `candidates`."""
        self.stats.lookups += 1
        namespace = (tenant, model, context_hash)
        space = self._spaces.get(namespace)
        if space is None:
            return None  # nothing to compare with: do not spend an embedding
        memo = (tenant, text)
        result = await self._run(self._lookup_sync, space.index, text, self._recalled(memo))
        if isinstance(result, _Skipped):
            return None
        if result is None:
            self.stats.too_long += 1
            return None
        prepared, found = result
        self._remember(memo, prepared)
        space = self._spaces.get(namespace)  # may have gone during the search
        if space is None:
            return None
        floor = learner.floor if learner is not None else threshold
        blocked = False
        for entry_id, similarity in found:
            if similarity < floor:
                break
            entry = space.entries.get(entry_id)
            if entry is None:
                continue  # removed while the search ran
            if (
                not self._entity_check
                or entry.text == prepared.text
                or entry.entities.matches(prepared.entities)
            ):
                return entry, similarity
            blocked = True
        if blocked:
            self.stats.entity_blocked += 1
        return None

    def _learner(self, tenant: str, prior: float, max_error: float) -> Learner:
        learner = self._learners.get(tenant)
        if learner is None or (learner.max_error, learner.prior) != (max_error, prior):
            # A new bound or prior starts over: what was learned answered another question.
            if learner is None:
                self._meta_bytes += LEARNER_BYTES
            learner = self._learners[tenant] = Learner(max_error, prior, self._rng, self._tuning)
            for entry in self._entries.values():
                if entry.namespace[0] == tenant and entry.evidence is not None:
                    entry.evidence = None
                    entry.cost -= EVIDENCE_BYTES
                    self._meta_bytes -= EVIDENCE_BYTES
        return learner

    async def check(
        self, key: str, similarity: float, cached: Answer, fresh: Answer
    ) -> bool | None:
        """Compare the origin's answer (`fresh`) with the answer stored for `key`
        (`cached`), found at `similarity` by a VERIFY or OBSERVE lookup, and record
        the outcome on the entry and the tenant's learner.

        Returns whether they were the same; None when nothing was recorded (the
        entry or the tenant's bound went meanwhile, or the embedder was busy:
        a comparison by meaning waits behind at most CHECK_QUEUE - 1 tasks).
        """
        result: bool | _Skipped = same_answer(cached, fresh, None)
        if by_meaning(cached, fresh):  # two longer texts: the model, off the loop
            if self._pending >= CHECK_QUEUE:
                self.stats.checks_skipped += 1
                return None
            result = await self._run(same_answer, cached, fresh, self._similarity_sync)
        if isinstance(result, _Skipped):
            return None
        entry = self._by_key.get(key)
        learner = self._learners.get(entry.namespace[0]) if entry is not None else None
        if entry is None or learner is None:
            return None
        if entry.evidence is None:  # its bytes count against the bound too
            entry.cost += EVIDENCE_BYTES
            self._meta_bytes += EVIDENCE_BYTES
        entry.evidence = learner.observe(entry.evidence, similarity, result)
        self.stats.checks += 1
        self.stats.wrong_checks += not result
        return result

    def _similarity_sync(self, texts: Sequence[str]) -> float:
        # Answers past the model's window are compared on their beginnings (the
        # tokenizer truncates), where an answer usually says what it is about;
        # the cut bounds the tokenizer's work on a very long one.
        a, b = self._embedder.embed([t[:ANSWER_CHARS] for t in texts])
        return float(np.dot(a, b))

    async def insert(self, tenant: str, model: str, context_hash: str, text: str, key: str) -> None:
        """Store `text` (a last user message) as answered by exact-cache entry `key`.

        Call it after the exact cache has stored `key`. A key stored before is
        replaced (one entry per key). May evict other entries (see the module doc);
        silently skipped when the message is too long or the embedder is busy.
        """
        purges = self._purges
        memo = (tenant, text)
        prepared = self._recalled(memo)
        if prepared is None:
            result = await self._run(self._prepare_sync, text)
            if isinstance(result, _Skipped):
                return
            if result is None:
                self.stats.too_long += 1
                return
            prepared = result
            self._remember(memo, prepared)
        if purges != self._purges or self._closed:
            return
        self.remove(key)
        namespace = (tenant, model, context_hash)
        self._add(namespace, key, prepared.text, prepared.entities, prepared.vector)
        self.stats.inserts += 1
        listener = self.on_insert
        if listener is not None:
            listener(Inserted(tenant, model, context_hash, key, prepared.vector, prepared.entities))
        self._grown()

    def insert_vector(
        self,
        tenant: str,
        model: str,
        context_hash: str,
        key: str,
        vector: Vector,
        entities: Entities,
    ) -> bool:
        """Add an entry whose embedding another proxy computed (no model call).

        `vector` must be normalised float32 of this index's `dim` (from the same
        embedder; anything else, NaN included, is refused); `entities` the
        signature of its message. Same namespaces,
        bounds and eviction as `insert`, and `on_insert` is not called (the entry
        is not this proxy's to publish). A key held already keeps its entry: it is
        this proxy's own or an earlier copy. False when not added. A hit on it
        names `key`, which the caller fetches from the cache store like any other
        (a key this proxy's store does not hold is a miss there, and removed).
        """
        if self._closed or key in self._by_key or not self._unit(vector):
            self.stats.remote_refused += 1
            return False
        self._add((tenant, model, context_hash), key, None, entities, vector)
        self.stats.remote_inserts += 1
        self._grown()
        return True

    def _unit(self, vector: Vector) -> bool:
        # A NaN would compare as "not below the threshold" in lookup, i.e. a hit.
        if vector.dtype != np.float32 or vector.shape != (self.dim,):
            return False
        norm = float(np.dot(vector, vector))
        return abs(norm - 1.0) < 1e-3

    def _add(
        self, namespace: Namespace, key: str, text: str | None, entities: Entities, vec: Vector
    ) -> None:
        space = self._spaces.get(namespace)
        if space is None:
            index = self._index_factory(vec.shape[0])
            space = _Space(index, cost=NAMESPACE_BYTES + sys.getsizeof(namespace[2]))
            self._spaces[namespace] = space
            self._meta_bytes += space.cost
            self._predict(space, index.nbytes)  # read before the executor has it
        cost = ENTRY_BYTES + sys.getsizeof(key) + entities_bytes(entities)
        if text is not None:
            cost += sys.getsizeof(text)
        entry = _Entry(self._next_id, key, namespace, text, entities, cost)
        self._next_id += 1
        space.entries[entry.id] = entry
        self._entries[entry.id] = entry
        self._by_key[key] = entry
        self._meta_bytes += cost
        self._mutate(space, space.index.add, self._add_bytes, entry.id, vec)
        while len(space.entries) > self._max_per_space:
            self._evict(next(iter(space.entries.values())))
        while len(self._entries) > self._max_entries:
            self._evict(next(iter(self._entries.values())))
        if self._max_bytes is not None:
            while self._entries and self.nbytes > self._max_bytes:
                self._evict(next(iter(self._entries.values())))

    def _grown(self) -> None:
        hook = self.on_grow
        if hook is not None:
            hook()

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
        self._recent_bytes = 0
        doomed = [
            ns
            for ns in self._spaces
            if (tenant is None or ns[0] == tenant) and (model is None or ns[1] == model)
        ]
        dropped = 0
        for ns in doomed:
            space = self._spaces.pop(ns)  # its index goes with it, unreferenced
            for entry in space.entries.values():
                del self._entries[entry.id]
                del self._by_key[entry.key]
                self._meta_bytes -= entry.cost
            dropped += len(space.entries)
            self._forget(space)
        return dropped

    def _evict(self, entry: _Entry) -> None:
        self.stats.evictions += 1
        self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.id]
        del self._by_key[entry.key]
        self._meta_bytes -= entry.cost
        space = self._spaces[entry.namespace]
        del space.entries[entry.id]
        if space.entries:
            self._mutate(space, space.index.remove, -self._remove_bytes, entry.id)
        else:
            del self._spaces[entry.namespace]  # an empty namespace costs nothing
            self._forget(space)

    # -- memory of the vector indexes (see the module doc) -------------------------

    def _predict(self, space: _Space, delta: int) -> None:
        space.cum += delta
        self._cum += delta

    def _mutate(self, space: _Space, op: Callable[..., None], delta: int, *args: object) -> None:
        """Submit op(*args) on space's index, predicting that it changes its bytes by delta."""
        if self._loop is None:
            with contextlib.suppress(RuntimeError):  # no loop: nothing to rebalance on
                self._loop = asyncio.get_running_loop()
        self._predict(space, delta)
        self._submit(self._measured, space, op, args, delta, space.cum, self._cum)

    def _forget(self, space: _Space) -> None:
        """Stop counting a namespace's index (dropped, its entries gone)."""
        self._meta_bytes -= space.cost
        nbytes, cum = space.report
        self._predict(space, -(nbytes + space.cum - cum))
        self._submit(self._unmeasured, space, self._cum)

    def _measured(
        self,
        space: _Space,
        op: Callable[..., None],
        args: tuple[object, ...],
        delta: int,
        scum: int,
        cum: int,
    ) -> None:
        # Executor thread: the only writer of _vec_total and of the reports, which
        # the loop reads as whole tuples.
        before = space.index.nbytes
        try:
            op(*args)
        finally:
            nbytes = space.index.nbytes
            self._vec_total += nbytes - space.report[0]
            space.report = (nbytes, scum)
            self._vec_report = (self._vec_total, cum)
            loop = self._loop
            if nbytes - before > delta and loop is not None and not self._closed:
                # The index grew its capacity: more than the loop had counted on.
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(self._rebalance)

    def _rebalance(self) -> None:
        """Back under max_bytes after an index grew past the loop's prediction, and
        let the exact store make room (on_grow)."""
        if self._max_bytes is not None:
            while self._entries and self.nbytes > self._max_bytes:
                self._evict(next(iter(self._entries.values())))
        self._grown()

    def _unmeasured(self, space: _Space, cum: int) -> None:
        self._vec_total -= space.report[0]
        space.report = (0, space.cum)
        self._vec_report = (self._vec_total, cum)


def _nothing() -> None:
    pass


def _log_failure(future: Future[object]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("semantic index operation failed: %r", exc)
