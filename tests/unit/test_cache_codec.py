"""The regional cache's binary form of entries: round trips, and garbage is an error."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataplane.cache.codec import MAGIC, VERSION, EntryDecodeError, from_bytes, to_bytes
from dataplane.cache.entry import CachedResponse, ResponseKind, to_sse_chunks

kinds = st.sampled_from(list(ResponseKind))
times = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def entries(draw: st.DrawFn) -> CachedResponse:
    kind, created_at, model = draw(kinds), draw(times), draw(st.text(max_size=40))
    if draw(st.booleans()):
        return CachedResponse(kind=kind, created_at=created_at, model=model, body=draw(st.binary()))
    chunks = tuple(draw(st.lists(st.binary(max_size=64), max_size=12)))
    usage_only = tuple(sorted(draw(st.sets(st.integers(0, len(chunks) - 1))))) if chunks else ()
    return CachedResponse(
        kind=kind,
        created_at=created_at,
        model=model,
        chunks=chunks,
        usage_only=usage_only,
        usage_missing=draw(st.booleans()),
    )


@given(entries())
def test_every_entry_round_trips(entry: CachedResponse) -> None:
    assert from_bytes(to_bytes(entry)) == entry


@given(st.binary(max_size=300))
def test_garbage_is_an_error_never_a_crash(data: bytes) -> None:
    try:
        entry = from_bytes(data)
    except EntryDecodeError:
        return
    assert to_bytes(entry) == data  # what does decode is exactly an entry


@given(entries(), st.data())
def test_a_truncated_entry_is_an_error(entry: CachedResponse, data: st.DataObject) -> None:
    whole = to_bytes(entry)
    cut = data.draw(st.integers(0, len(whole) - 1))
    with pytest.raises(EntryDecodeError):
        from_bytes(whole[:cut])


@given(entries(), st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_an_error(entry: CachedResponse, extra: bytes) -> None:
    with pytest.raises(EntryDecodeError, match="trailing"):
        from_bytes(to_bytes(entry) + extra)


def test_another_version_is_an_error() -> None:
    entry = CachedResponse(kind=ResponseKind.CHAT, created_at=1.0, model="m", body=b"{}")
    data = bytearray(to_bytes(entry))
    assert data[:2] == MAGIC and data[2] == VERSION
    data[2] = VERSION + 1
    with pytest.raises(EntryDecodeError, match="version"):
        from_bytes(bytes(data))


def test_a_stream_recorded_without_usage_keeps_the_mark_across_the_region() -> None:
    entry = CachedResponse(
        kind=ResponseKind.CHAT, created_at=1.0, model="m", chunks=(b"{}",), usage_missing=True
    )
    assert from_bytes(to_bytes(entry)).usage_missing
    # The mark says nothing of a stored body: such bytes are not an entry.
    body = bytearray(
        to_bytes(CachedResponse(kind=ResponseKind.CHAT, created_at=1.0, model="m", body=b"{}"))
    )
    body[4] |= 0x02
    with pytest.raises(EntryDecodeError, match="flags"):
        from_bytes(bytes(body))


# A stream with usage-only chunks 1 and 3, as a proxy of e5b9841f wrote it to
# the region's Redis (its usage indexes a frozenset; the layout unchanged since).
OLDER_STREAM = bytes.fromhex(
    "50580100013ff8000000000000000000016d00000004000000077b2261223a317d"
    "000000077b2275223a327d000000077b2262223a337d000000077b2275223a347d"
    "000000020000000100000003"
)


def test_an_older_proxys_stream_loads_and_is_written_as_it_wrote_it() -> None:
    # Proxies of both versions share a region: each reads what the other wrote.
    entry = from_bytes(OLDER_STREAM)
    assert entry.chunks == (b'{"a":1}', b'{"u":2}', b'{"b":3}', b'{"u":4}')
    assert entry.usage_only == (1, 3)
    assert to_sse_chunks(entry, include_usage=False) == [
        b'data: {"a":1}\n\n',
        b'data: {"b":3}\n\n',
        b"data: [DONE]\n\n",
    ]
    assert to_bytes(entry) == OLDER_STREAM


def test_a_huge_count_fails_fast() -> None:
    head = struct.pack(">2sBBBdI", MAGIC, VERSION, 0, 1, 0.0, 0)
    with pytest.raises(EntryDecodeError, match="count"):
        from_bytes(head + struct.pack(">I", 0xFFFFFFFF))


def test_a_usage_index_past_the_chunks_is_an_error() -> None:
    entry = CachedResponse(
        kind=ResponseKind.CHAT, created_at=1.0, model="m", chunks=(b"a",), usage_only=(0,)
    )
    data = to_bytes(entry)
    bad = data[:-4] + struct.pack(">I", 1)
    with pytest.raises(EntryDecodeError, match="usage"):
        from_bytes(bad)


def test_usage_indexes_must_increase() -> None:
    entry = CachedResponse(
        kind=ResponseKind.CHAT,
        created_at=1.0,
        model="m",
        chunks=(b"a", b"b"),
        usage_only=(0, 1),
    )
    data = to_bytes(entry)
    repeated = data[:-4] + struct.pack(">I", 0)
    with pytest.raises(EntryDecodeError, match="order"):
        from_bytes(repeated)
