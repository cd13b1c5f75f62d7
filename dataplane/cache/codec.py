"""A compact, versioned binary form of a `CachedResponse`, for the regional cache.

Layout (integers big-endian):

    b"PX" | version u8 (1) | kind u8 | flags u8 (bit 0: streamed,
                                                  bit 1: usage missing)
    created_at f64 | model: u32 length + UTF-8
    body:    u32 length + bytes                              (flags bit 0 clear)
    chunks:  u32 count, then per chunk u32 length + bytes     (flags bit 0 set)
             usage_only: u32 count, then u32 indexes, increasing

Another proxy, possibly of another version, reads what this one wrote: a value
that is not exactly this (another version, truncated, trailing bytes, an index
out of range, garbage) raises `EntryDecodeError`, which callers treat as a
miss. A new layout takes a new version number; readers of the old one then miss
on it until the entry ages out. Bit 1 (`CachedResponse.usage_missing`, only
with bit 0) came after version 1's first readers, which refuse it as an unknown
flag: they miss on such entries, which they would have replayed without the
usage a request may ask for. A stream written without the bit by such a reader
is taken as complete, usage or not, until it ages out.

Pure; safe from any thread.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

from dataplane.cache.entry import CachedResponse, ResponseKind

MAGIC = b"PX"
VERSION = 1
# Appended to, never reordered: a kind's code is its index, in entries other
# proxies' versions wrote to the region's Redis.
_KINDS = (ResponseKind.CHAT, ResponseKind.TEXT, ResponseKind.EMBEDDINGS, ResponseKind.RERANK)
_KIND_CODES = {kind: code for code, kind in enumerate(_KINDS)}
_STREAMED = 0x01
_USAGE_MISSING = 0x02

_HEAD = struct.Struct(">2sBBBdI")  # magic, version, kind, flags, created_at, model length
_U32 = struct.Struct(">I")


class EntryDecodeError(ValueError):
    """Bytes that are not an entry in this module's layout."""


def to_bytes(entry: CachedResponse) -> bytes:
    model = entry.model.encode()
    flags = _STREAMED if entry.chunks is not None else 0
    if entry.usage_missing:
        flags |= _USAGE_MISSING
    parts = [
        _HEAD.pack(MAGIC, VERSION, _KIND_CODES[entry.kind], flags, entry.created_at, len(model))
    ]
    parts.append(model)
    if entry.chunks is not None:
        parts.append(_U32.pack(len(entry.chunks)))
        for chunk in entry.chunks:
            parts.append(_U32.pack(len(chunk)))
            parts.append(chunk)
        parts.append(_U32.pack(len(entry.usage_only)))
        parts.extend(_U32.pack(i) for i in sorted(entry.usage_only))
    else:
        assert entry.body is not None
        parts.append(_U32.pack(len(entry.body)))
        parts.append(entry.body)
    return b"".join(parts)


def from_bytes(data: bytes) -> CachedResponse:
    """The entry `data` holds; EntryDecodeError when it is not exactly one."""
    reader = _Reader(data)
    magic, version, kind_code, flags, created_at, model_len = reader.unpack(_HEAD)
    if magic != MAGIC:
        raise EntryDecodeError("not a Ponto cache entry")
    if version != VERSION:
        raise EntryDecodeError(f"entry version {version}, this proxy reads {VERSION}")
    if (
        kind_code >= len(_KINDS)
        or flags & ~(_STREAMED | _USAGE_MISSING)
        or (flags & _USAGE_MISSING and not flags & _STREAMED)
    ):
        raise EntryDecodeError(f"unknown kind {kind_code} or flags {flags:#x}")
    if not math.isfinite(created_at):
        raise EntryDecodeError("created_at is not a finite number")
    try:
        model = reader.take(model_len).decode()
    except UnicodeDecodeError:
        raise EntryDecodeError("the model name is not UTF-8") from None
    kind = _KINDS[kind_code]
    if flags & _STREAMED:
        count = reader.u32()
        chunks = tuple(reader.take(reader.u32()) for _ in range(reader.bounded(count, 4)))
        indexes = [reader.u32() for _ in range(reader.bounded(reader.u32(), 4))]
        if any(a >= b for a, b in itertools.pairwise(indexes)):
            raise EntryDecodeError("usage indexes out of order")
        if indexes and indexes[-1] >= len(chunks):
            raise EntryDecodeError("a usage index past the last chunk")
        usage_only = tuple(indexes)
        reader.end()
        return CachedResponse(
            kind=kind,
            created_at=created_at,
            model=model,
            chunks=chunks,
            usage_only=usage_only,
            usage_missing=bool(flags & _USAGE_MISSING),
        )
    body = reader.take(reader.u32())
    reader.end()
    return CachedResponse(kind=kind, created_at=created_at, model=model, body=body)


class _Reader:
    __slots__ = ("_at", "_data")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        self._need(layout.size)
        values = layout.unpack_from(self._data, self._at)
        self._at += layout.size
        return values

    def u32(self) -> int:
        (value,) = self.unpack(_U32)
        assert isinstance(value, int)
        return value

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self._data[self._at : self._at + n]
        self._at += n
        return out

    def bounded(self, count: int, each: int) -> int:
        """A count of items of at least `each` bytes that the rest can hold: a
        garbage count must not make the decoder loop for long."""
        if count * each > len(self._data) - self._at:
            raise EntryDecodeError("a count larger than the value")
        return count

    def end(self) -> None:
        if self._at != len(self._data):
            raise EntryDecodeError("trailing bytes")

    def _need(self, n: int) -> None:
        if self._at + n > len(self._data):
            raise EntryDecodeError("truncated")
