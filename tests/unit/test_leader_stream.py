"""reply.LeaderStream under the relay, without HTTP: a flight leader's client
gone mid-stream ends the relay unless followers are there, who then get the
origin's stream to its end."""

from __future__ import annotations

from dataplane.cache.coalesce import Coalescer, Follower, Leader
from dataplane.http.reply import LeaderStream
from dataplane.streaming.relay import relay

CHUNKS = [b"data: %d\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


class Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class Client:
    """Takes `takes` writes, then is gone (aiohttp's ConnectionResetError)."""

    def __init__(self, takes: int) -> None:
        self.takes = takes
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if len(self.written) == self.takes:
            raise ConnectionResetError("Cannot write to closing transport")
        self.written.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(b"<eof>")


def flight(followers: int) -> tuple[Leader, list[Follower]]:
    co = Coalescer()
    leader = co.join("k")
    assert isinstance(leader, Leader)
    joined = [co.join("k") for _ in range(followers)]
    assert all(isinstance(f, Follower) for f in joined)
    return leader, [f for f in joined if isinstance(f, Follower)]


def stream_of(leader: Leader, client: Client, stops: list[str]) -> LeaderStream:
    lead = LeaderStream(leader, lambda: stops.append("stop"))
    lead.out = client  # type: ignore[assignment]  # a stand-in for aiohttp's
    return lead


async def test_a_client_gone_with_a_follower_there_leaves_the_relay_going() -> None:
    leader, [follower] = flight(1)
    client, stops = Client(takes=2), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    assert (end.complete, end.client_gone, lead.gone) == (True, False, True)
    assert client.written == CHUNKS[:2]  # nothing after it was found gone
    leader.finish(None)
    assert [c async for c in follower] == CHUNKS  # every chunk, the end included
    assert stops == []


async def test_a_client_gone_at_the_streams_end_had_the_whole_answer() -> None:
    # It closed once it had [DONE] (the openai SDK does), before the end could be written.
    for followers in (0, 1):
        leader, _ = flight(followers)
        client, stops = Client(takes=len(CHUNKS)), list[str]()
        lead = stream_of(leader, client, stops)
        end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
        assert (end.complete, end.client_gone, lead.gone) == (True, False, False)
        assert client.written == CHUNKS


async def test_a_client_gone_with_nobody_following_ends_the_relay() -> None:
    leader, _ = flight(0)
    client, stops = Client(takes=2), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    assert (end.complete, end.client_gone) == (False, True)
    assert stops == []


async def test_the_last_follower_leaving_after_the_client_stops_the_relay() -> None:
    leader, [follower] = flight(1)
    client, stops = Client(takes=0), list[str]()
    lead = stream_of(leader, client, stops)
    await lead.write(CHUNKS[0])  # found gone: dropped, for the follower
    assert (lead.gone, stops) == (True, [])
    follower.leave()
    assert stops == ["stop"]


async def test_the_last_follower_leaving_after_the_stream_ended_stops_nothing() -> None:
    # The whole answer is relayed; its storing (which may wait for the
    # region's Redis) must not be cancelled by the last follower leaving then.
    leader, [follower] = flight(1)
    client, stops = Client(takes=0), list[str]()
    lead = stream_of(leader, client, stops)
    end = await relay(CHUNKS[0], Content(CHUNKS[1:]), lead, chunks=leader)
    assert (end.complete, lead.gone, lead.ended) == (True, True, True)
    follower.leave()
    assert stops == []
