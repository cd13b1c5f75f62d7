"""Pure: Responses API ids that name the origin (and tenant) that stored them.

OpenAI's Responses API is stateful: an origin stores each response it makes
(`store` defaults to true), and a follow-up (`previous_response_id`), a
retrieval, a deletion, a cancellation or a listing of its input items works
only on that origin. A region's replicas each keep their own store, and no
placement key can know which one made a response: the proxy tells the client
an id that says it, as LiteLLM does.

The contract:

- **Encoding.** The client sees `original + SEPARATOR + origin tag + tenant
  tag`: the origin's id first (the id still starts with `resp_`), then
  ORIGIN_TAG_HEX hex digits of the SHA-256 of the origin's name (`origin_tag`:
  stable across proxies and restarts, and no name, so no topology is told),
  then TENANT_TAG_HEX of the tenant's (`tenant_tag`). Only characters safe in
  a URL path segment are added; an id that `safe_id` refuses is never sent
  on in a path.
- **Decoding** splits from the right, by fixed lengths, so an original id
  may hold anything, the separator included. An id without a valid suffix is
  "not ours" (`decode` gives None): passed on as it came, and unpinned.
- **The tags are a routing aid, not a secret.** They are unkeyed hashes:
  they keep one tenant from using another's id by mistake (the tenant tag of
  an id must be the caller's), but a caller who knows another tenant's
  original id and the origin's tag could write an id that passes. What an
  origin stores is as safe as its own ids are hard to guess.
- **Rewriting answers** (`Rewriter`) replaces the quoted original ids, as
  JSON strings (`"resp_..."`), by the encoded ones, in a whole body or in a
  stream split anywhere: the bytes out are the same whatever the split. A
  chunk that ends with a proper prefix of a quoted id keeps that tail back
  until the next chunk; one that ends with a blank line (an event's end) is
  never held.

Pure and synchronous; a Rewriter belongs to one answer (one task).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dataplane import jsonio

__all__ = [
    "MAX_ID_CHARS",
    "ORIGIN_TAG_HEX",
    "SEPARATOR",
    "TENANT_TAG_HEX",
    "Decoded",
    "Rewriter",
    "decode",
    "encode",
    "ids_of",
    "origin_tag",
    "response_id_in",
    "safe_id",
    "tenant_tag",
]

SEPARATOR: Final = "_ponto"
ORIGIN_TAG_HEX: Final = 16
TENANT_TAG_HEX: Final = 8
_SUFFIX: Final = len(SEPARATOR) + ORIGIN_TAG_HEX + TENANT_TAG_HEX
# The longest id a path may carry; OpenAI's and vLLM's are some 40 characters,
# encoded some 70.
MAX_ID_CHARS: Final = 256
# Unreserved characters of a URL (RFC 3986): a path segment as they are.
_SAFE: Final = re.compile(r"[A-Za-z0-9._~-]+")
_HEX: Final = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class Decoded:
    """An id of ours: the origin's own id, and the tags of its origin and tenant."""

    original: str
    origin: str
    tenant: str


def origin_tag(name: str) -> str:
    """The tag of the origin named `name`: equal in every proxy."""
    return hashlib.sha256(b"ponto-origin\0" + name.encode()).hexdigest()[:ORIGIN_TAG_HEX]


def tenant_tag(tenant: str) -> str:
    """The tag of tenant `tenant`: equal in every proxy."""
    return hashlib.sha256(b"ponto-tenant\0" + tenant.encode()).hexdigest()[:TENANT_TAG_HEX]


def encode(original: str, origin: str, tenant: str) -> str:
    """The id the client sees for `original`, stored on the origin tagged
    `origin` (origin_tag) for the tenant tagged `tenant` (tenant_tag)."""
    return f"{original}{SEPARATOR}{origin}{tenant}"


def decode(sent: str) -> Decoded | None:
    """The parts of an id of ours; None for any other (not ours)."""
    if len(sent) <= _SUFFIX:
        return None
    tags = sent[-(ORIGIN_TAG_HEX + TENANT_TAG_HEX) :]
    if sent[-_SUFFIX : -len(tags)] != SEPARATOR or not _HEX.fullmatch(tags):
        return None
    return Decoded(sent[:-_SUFFIX], tags[:ORIGIN_TAG_HEX], tags[ORIGIN_TAG_HEX:])


def safe_id(sent: str) -> bool:
    """Whether `sent` may go into a request path as it is: unreserved URL
    characters only, and at most MAX_ID_CHARS of them."""
    return len(sent) <= MAX_ID_CHARS and _SAFE.fullmatch(sent) is not None


def ids_of(obj: Any) -> list[str]:
    """The response ids a Responses object names: its own `id` and its
    `previous_response_id` (each when a string)."""
    if not isinstance(obj, dict):
        return []
    return [v for k in ("id", "previous_response_id") if isinstance(v := obj.get(k), str)]


def response_id_in(events: Iterable[bytes]) -> list[str]:
    """The ids of the first Responses object (`response`) in a stream's
    events' data (its response.created, which an origin sends first): parsed
    only for events that hold one."""
    for data in events:
        if b'"response"' not in data:
            continue
        obj = jsonio.loads_or_none(data)
        if isinstance(obj, dict) and isinstance(inner := obj.get("response"), dict):
            found = ids_of(inner)
            if found:
                return found
    return []


class Rewriter:
    """Replaces quoted ids (`"original"`) by quoted others in an answer's bytes.

    `whole` rewrites a whole body; `feed` each chunk of a stream, in order,
    then `flush` at its end gives what was kept back. Matches are taken left
    to right, none overlapping (an id holds no quote, so none can), as one
    pass over the whole stream would take them.
    """

    __slots__ = ("_find", "_kept", "_longest", "_patterns", "_to")

    def __init__(self, ids: Mapping[str, str]) -> None:
        """`ids`: each original id, and what the client is shown for it; ids
        holding a quote or a backslash (no JSON string as written) are left
        out."""
        usable = {k: v for k, v in ids.items() if k and k != v and not set(k) & {'"', "\\"}}
        self._to = {b'"' + k.encode() + b'"': b'"' + v.encode() + b'"' for k, v in usable.items()}
        self._patterns = tuple(self._to)
        self._longest = max((len(p) for p in self._patterns), default=0)
        self._find = (
            re.compile(b"|".join(re.escape(p) for p in self._patterns)) if self._patterns else None
        )
        self._kept = b""

    def __bool__(self) -> bool:
        return self._find is not None

    def whole(self, data: bytes) -> bytes:
        """`data` rewritten, as a whole."""
        if self._find is None:
            return data
        return self._find.sub(self._swap, data)

    def feed(self, chunk: bytes) -> bytes:
        """The next chunk of a stream rewritten, but a tail that may begin an
        id (kept for the next chunk, or `flush`)."""
        data = self._kept + chunk if self._kept else chunk
        find = self._find
        if find is None:
            return data
        out: list[bytes] = []
        at = 0
        for match in find.finditer(data):
            out.append(data[at : match.start()])
            out.append(self._to[match.group()])
            at = match.end()
        keep = self._held_from(data, at)
        out.append(data[at:keep])
        self._kept = data[keep:]
        return b"".join(out)

    def flush(self) -> bytes:
        """What the last chunks kept back: the stream's end."""
        kept, self._kept = self._kept, b""
        return kept

    def _swap(self, match: re.Match[bytes]) -> bytes:
        return self._to[match.group()]

    def _held_from(self, data: bytes, at: int) -> int:
        """Where the longest tail of `data` from `at` on that is a proper
        prefix of a quoted id begins; len(data) when none is."""
        end = len(data)
        start = max(at, end - self._longest + 1)
        quote = data.find(b'"', start)
        while quote >= 0:
            tail = data[quote:]
            if any(len(tail) < len(p) and p.startswith(tail) for p in self._patterns):
                return quote
            quote = data.find(b'"', quote + 1)
        return end
