"""dataplane.streaming.relay driven without HTTP: what the client is written,
and what the readers see, for the relay that passes bytes through and the one
that re-frames events (continuation on)."""

from __future__ import annotations

from typing import cast

from aiohttp import web

from dataplane.streaming.relay import Next, RelayEnd, Resume, relay
from dataplane.streaming.sse import Event


class Content:
    """An origin's body, chunk by chunk, then its end."""

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class Out:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.ended = False

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def write_eof(self) -> None:
        self.ended = True


class Reader:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def event(self, ev: Event) -> None:
        self.events.append(ev)


async def no_resume(cut: str) -> Next | None:
    return None


STREAM = (
    b'data: {"a":1}\r\n\r\n',
    b"event: note\ndata: two\ndata: lines\n\n: keep-alive\n\n",
    b"data: [DO",
    b"NE]\n\n",
)


async def run(resume: Resume | None) -> tuple[Out, Reader, RelayEnd]:
    out, reader = Out(), Reader()
    end = await relay(
        STREAM[0],
        Content(*STREAM[1:]),
        cast(web.StreamResponse, out),
        readers=[reader],
        idle_timeout=60.0,
        resume=resume,
    )
    return out, reader, end


async def test_the_byte_relay_passes_the_origins_bytes_and_parses_them_for_readers() -> None:
    out, reader, end = await run(None)
    assert end.complete and not end.cut
    assert b"".join(out.written) == b"".join(STREAM)
    assert out.ended
    assert reader.events == [
        Event(b'{"a":1}'),
        Event(b"two\nlines", b"note"),
        Event(b"[DONE]"),
    ]
    assert reader.events[-1].done


async def test_the_event_relay_reframes_each_event_as_data_lines() -> None:
    out, reader, end = await run(no_resume)
    assert end.complete and not end.cut
    assert out.written == [
        b'data: {"a":1}\n\n',
        b"event: note\ndata: two\ndata: lines\n\n",
        b"data: [DONE]\n\n",
    ]
    assert [e.done for e in reader.events] == [False, False, True]
