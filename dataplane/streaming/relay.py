"""Relaying an origin's stream to the client, and who reads it on the way.

The relay writes the origin's bytes unchanged. When anyone reads the stream
(usage counting, the cache's recorder), one `SseParser` turns the bytes into
events once and each reader gets them; a flight's leader gets the raw chunks
for its followers. A relay whose stream nobody reads parses nothing.

Contract: once the client has a byte the response is committed; a failure of
the origin ends the client's stream with a well-formed SSE error event and
`data: [DONE]`, never a hang; a client that goes away ends the relay, and the
caller releases the origin's response, which closes its connection (vLLM then
aborts the generation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

from dataplane.streaming.sse import Event, SseParser

__all__ = ["ChunkSink", "EventSink", "RelayEnd", "relay"]


class EventSink(Protocol):
    def event(self, ev: Event) -> None: ...


class ChunkSink(Protocol):
    def chunk(self, data: bytes) -> None: ...


@dataclass(slots=True)
class RelayEnd:
    """How a relay ended."""

    # The origin ended its stream and the client got all of it.
    complete: bool = False
    # Why the origin's stream stopped early, if it did ("" otherwise).
    cut: str = ""
    # The client went away before the end.
    client_gone: bool = False
    # What the parser held when the stream ended (see SseParser.close).
    open_event: Event | None = None


async def relay(
    first: bytes,
    content: aiohttp.StreamReader,
    out: web.StreamResponse,
    *,
    readers: Sequence[EventSink] = (),
    chunks: ChunkSink | None = None,
    error_event: bytes = b"",
) -> RelayEnd:
    """Write `first`, then the rest of `content`, to the prepared `out`.

    A cut (read error, timeout) writes `error_event` and returns with `cut`
    set. A cancellation (the client vanished with the server's handler
    cancellation on) propagates; the caller learns of it in its `finally`.
    """
    end = RelayEnd()
    parser = SseParser() if readers else None
    chunk = first
    try:
        while True:
            if parser is not None:
                for ev in parser.feed(chunk):
                    for reader in readers:
                        reader.event(ev)
            if chunks is not None:
                chunks.chunk(chunk)
            # write() waits for the client's socket to drain: backpressure
            # reaches the origin through the unread upstream socket.
            await out.write(chunk)
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                end.cut = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                await out.write(error_event)
                break
            if not chunk:
                end.complete = True
                break
        await out.write_eof()
    except ConnectionResetError:
        end.complete = False
        end.client_gone = True
    if parser is not None:
        end.open_event = parser.close()
    return end
