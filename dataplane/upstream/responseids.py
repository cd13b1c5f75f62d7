"""Pure: Responses API ids that name the origin that stored them, and are
bound to the tenant they were made for.

OpenAI's Responses API is stateful: an origin stores each response it makes
(`store` defaults to true), and a follow-up (`previous_response_id`), a
retrieval, a deletion, a cancellation or a listing of its input items works
only on that origin. A region's replicas each keep their own store, and no
placement key can know which one made a response: the proxy tells the client
an id that says it, as LiteLLM does.

The contract:

- **Encoding.** The client sees `original + SEPARATOR + origin tag + MAC`:
  the origin's id first (the id still starts with `resp_`), then
  ORIGIN_TAG_HEX hex digits of the SHA-256 of the origin's name (`origin_tag`:
  stable across proxies and restarts, a routing aid that tells no name), then
  MAC_HEX hex digits of an HMAC-SHA-256, under the fleet's key (`IdKeys`),
  of the original, the origin tag and the tenant (`owner`: its name and its
  record's create revision; an id made for the name alone, before, is still
  verified for it). The original is
  visible: what keeps it from being used by anyone else is that the proxy
  takes no id it did not make (`IdKeys.verified`, and the pipeline refuses a
  `previous_response_id` that is not one), and no one without the key can
  make one for another tenant, or for an original of their choosing.
- **Ids.** Only ids of `[A-Za-z0-9_-]` (OpenAI's and vLLM's are `resp_` and
  hex) are encoded, and only such are decoded (`decode`, `safe_id`): an
  original is a plain path segment, never `.` or `..`. An origin's id of
  other characters, or longer than MAX_ORIGINAL_CHARS, is shown as it came,
  and cannot be continued through the proxy.
- **Decoding** splits from the right, by fixed lengths, so an original may
  hold the separator. An id without a valid suffix, or whose MAC no key of
  the table gives for the caller's tenant, is "not ours".
- **Keys** come with the route table (RouteTable.response_id_keys): the
  first makes ids, each one verifies them, so a key is rotated by listing a
  new one first and the old one after it until the ids it made may go.
- **Rewriting answers** (`Rewriter`) replaces the quoted original ids, as
  JSON strings (`"resp_..."`), by the encoded ones, in a whole body or in a
  stream split anywhere: the bytes out are the same whatever the split. A
  chunk that ends with a proper prefix of a quoted id keeps that tail back
  until the next chunk; one that ends with a blank line (an event's end) is
  never held. A stream's own id is learned from its first events
  (`StreamIds`), however long they are, up to a bound.

Pure and synchronous; a Rewriter or StreamIds belongs to one answer (one task).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dataplane import jsonio
from dataplane.streaming.sse import SseParser

__all__ = [
    "MAC_HEX",
    "MAX_ID_CHARS",
    "MAX_ORIGINAL_CHARS",
    "MIN_KEY_BYTES",
    "ORIGIN_TAG_HEX",
    "SEPARATOR",
    "Decoded",
    "IdKeys",
    "Rewriter",
    "StreamIds",
    "decode",
    "ids_of",
    "origin_tag",
    "response_id_in",
    "rewrite_words",
    "safe_id",
]

SEPARATOR: Final = "_ponto"
ORIGIN_TAG_HEX: Final = 16
# 96 bits: a guess is checked by a proxy, one request each, under the
# caller's limits.
MAC_HEX: Final = 24
_SUFFIX: Final = len(SEPARATOR) + ORIGIN_TAG_HEX + MAC_HEX
# The longest id a path may carry; OpenAI's and vLLM's are some 40 characters,
# encoded some 85.
MAX_ID_CHARS: Final = 256
MAX_ORIGINAL_CHARS: Final = MAX_ID_CHARS - _SUFFIX
# A key shorter than this is refused with its table (dataplane.routes.validate).
MIN_KEY_BYTES: Final = 16
# What an id may hold: a path segment as it is (unreserved URL characters,
# RFC 3986, but '.' and '~': no id may be a dot segment).
_ID: Final = re.compile(r"[A-Za-z0-9_-]+")
_ID_BYTE: Final = rb"[A-Za-z0-9_-]"
_HEX: Final = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class Decoded:
    """An id in our shape: the origin's own id, its origin's tag and its MAC
    (not checked: `IdKeys.verified`)."""

    original: str
    origin: str
    mac: str


def origin_tag(name: str) -> str:
    """The tag of the origin named `name`: equal in every proxy."""
    return hashlib.sha256(b"ponto-origin\0" + name.encode()).hexdigest()[:ORIGIN_TAG_HEX]


def decode(sent: str) -> Decoded | None:
    """The parts of an id in our shape; None for any other."""
    if len(sent) <= _SUFFIX or len(sent) > MAX_ID_CHARS:
        return None
    tags = sent[-(ORIGIN_TAG_HEX + MAC_HEX) :]
    if sent[-_SUFFIX : -len(tags)] != SEPARATOR or not _HEX.fullmatch(tags):
        return None
    original = sent[:-_SUFFIX]
    if not _ID.fullmatch(original):
        return None
    return Decoded(original, tags[:ORIGIN_TAG_HEX], tags[ORIGIN_TAG_HEX:])


def safe_id(sent: str) -> bool:
    """Whether `sent` may go into a request path as it is: letters, digits,
    '_' and '-' only, and at most MAX_ID_CHARS of them."""
    return len(sent) <= MAX_ID_CHARS and _ID.fullmatch(sent) is not None


class IdKeys:
    """The fleet's keys of the ids' MAC, as a route table carries them: the
    first signs, any verifies. Immutable; shared by every request of a table."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[bytes]) -> None:
        self._keys = tuple(keys)
        if not self._keys:
            raise ValueError("no key")

    def _mac(self, key: bytes, original: str, origin: str, tenant: str) -> str:
        # The original and the origin tag hold no NUL: the message is unambiguous.
        message = b"ponto-response-id\0%s\0%s\0%s" % (
            original.encode(),
            origin.encode(),
            tenant.encode(),
        )
        return hmac.new(key, message, hashlib.sha256).hexdigest()[:MAC_HEX]

    def tag(self, purpose: bytes, value: int) -> str:
        """8 hex digits of the fleet's MAC of `value` for `purpose`: the same
        on every proxy, and not reversible without the key (the access log's
        placement: a CRC-32 of a `user` field or session id in a log line
        gave the id back to a search of candidates)."""
        message = b"ponto-%s\0%d" % (purpose, value)
        return hmac.new(self._keys[0], message, hashlib.sha256).hexdigest()[:8]

    def encodable(self, original: str) -> bool:
        """Whether an origin's id may be encoded (see the module's "Ids")."""
        return len(original) <= MAX_ORIGINAL_CHARS and _ID.fullmatch(original) is not None

    def encode(self, original: str, origin: str, tenant: str) -> str:
        """The id the client of tenant `tenant` sees for `original`, stored on
        the origin tagged `origin` (origin_tag). `original` must be encodable."""
        mac = self._mac(self._keys[0], original, origin, tenant)
        return f"{original}{SEPARATOR}{origin}{mac}"

    def verified(self, sent: str, tenant: str, legacy: str | None = None) -> Decoded | None:
        """`sent`'s parts when it is an id made (under any key) for `tenant`
        (an owner: see `owner`), or for `legacy` when given (the tenant's name
        alone, which ids made before owners were signed for); None for any
        other id."""
        decoded = decode(sent)
        if decoded is None:
            return None
        for owner in (tenant,) if legacy is None else (tenant, legacy):
            for key in self._keys:
                mac = self._mac(key, decoded.original, decoded.origin, owner)
                if hmac.compare_digest(mac, decoded.mac):
                    return decoded
        return None


def owner(tenant: str, birth: int) -> str:
    """Who a response id is signed for: tenant `tenant` of the record created
    at revision `birth` (0: no record, the built-in tenant's). A tenant made
    again under a deleted one's name is another owner, as it is another
    tenant to the caches (trial 62: the new one read and continued the old
    one's stored responses). No NUL is in a tenant's name."""
    return f"{tenant}\0{birth}" if birth else tenant


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


def rewrite_words(data: bytes, ids: Mapping[str, str]) -> bytes:
    """`data` with each id of `ids` replaced where it stands alone (no id
    character either side): in an error's message, where an origin quotes
    an id as it likes (`'resp_x'`). Ids of other characters are left out."""
    usable = {k.encode(): v.encode() for k, v in ids.items() if k != v and _ID.fullmatch(k)}
    if not usable:
        return data
    alternatives = b"|".join(re.escape(k) for k in sorted(usable, key=len, reverse=True))
    pattern = re.compile(b"(?<!" + _ID_BYTE + b")(?:" + alternatives + b")(?!" + _ID_BYTE + b")")
    return pattern.sub(lambda m: usable[m.group()], data)


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


class StreamIds:
    """A Responses stream's Rewriter, made (`make`) from the ids of its first
    event that names a response (its response.created), as `feed`/`flush`
    of a Rewriter.

    Until that event has come whole, the stream's bytes are held: they are
    its preamble, not answer text. `make([])` is used instead once an event
    with data that names no response comes first (an origin that sends no
    response.created), once `limit` bytes are held, or at the stream's end,
    and the bytes held go on through it. Belongs to one stream (one task).
    """

    __slots__ = ("_held", "_limit", "_make", "_parser", "_size", "rewriter")

    def __init__(self, make: Callable[[list[str]], Rewriter], limit: int) -> None:
        self._make = make
        self._limit = limit
        self._parser = SseParser(limit)
        self._held: list[bytes] = []
        self._size = 0
        self.rewriter: Rewriter | None = None

    def feed(self, chunk: bytes) -> bytes:
        """As Rewriter.feed; nothing while the id is still to come."""
        if self.rewriter is not None:
            return self.rewriter.feed(chunk)
        self._held.append(chunk)
        self._size += len(chunk)
        ids: list[str] | None = None
        for event in self._parser.feed(chunk):
            if not event.data:
                continue
            found = response_id_in((event.data,))
            if found or b'"response"' not in event.data:
                ids = found
                break
        if ids is None and (self._parser.over or self._size > self._limit):
            ids = []
        if ids is None:
            return b""
        return self._release(ids)

    def flush(self) -> bytes:
        """As Rewriter.flush: the stream's end."""
        out = self._release([]) if self.rewriter is None else b""
        assert self.rewriter is not None
        return out + self.rewriter.flush()

    def _release(self, ids: list[str]) -> bytes:
        rewriter = self.rewriter = self._make(ids)
        held, self._held = b"".join(self._held), []
        self._parser = SseParser()  # no longer read
        return rewriter.feed(held)
