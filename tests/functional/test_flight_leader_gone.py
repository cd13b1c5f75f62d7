"""A flight whose leading client leaves (dataplane.http.pipeline.Pipeline.lead):
the origin's stream goes on for the followers there are, is kept in the cache
and settled once, and stops as soon as nobody is left to read it, or when the
proxy stops (the stream's idle timeout applies as to any relay's).

The real proxy app on EdgeRunner (production's listener, handler cancellation
on) before a hand-written origin whose every event the test lets out.
"""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS, PIPELINE
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from ponto.quota_types import tenant_scope
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import COMPLETION, KEY, MODEL, table
from tests.functional.test_whole_answers import Edge, Start, edges, until

WORDS = ["one", "two", "three", "four", "five", "six"]
BODY = {
    "model": MODEL,
    "temperature": 0,  # deterministic: cacheable, so identical requests fly together
    "stream": True,
    "messages": [{"role": "user", "content": "count to six"}],
}


def event(word: str, finish: str | None = None) -> bytes:
    delta = {"content": word + " "} if word else {}
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# A natural answer (kept by the cache): its words, the stop, the end.
FRAMES = [*map(event, WORDS), event("", "stop"), b"data: [DONE]\n\n"]


class Origin:
    """Streams FRAMES, each once the test lets it out (`let`); says how many
    calls it had, and whether it streamed to the end or its caller left."""

    def __init__(self, *, late_head: bool = False, frames: list[bytes] = FRAMES) -> None:
        self.frames = frames
        self.calls = 0
        self.allowed = asyncio.Semaphore(0)
        self.finished = False
        self.gone = False
        # The head waits for a `let` too, as a model's whole answer (or a
        # stream behind a slow queue) does.
        self.late_head = late_head

    def let(self, events: int) -> None:
        for _ in range(events):
            self.allowed.release()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        try:
            if self.late_head:
                await self.allowed.acquire()
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            for frame in self.frames:
                await self.allowed.acquire()
                await out.write(frame)
        except (asyncio.CancelledError, ConnectionError):
            self.gone = True  # the proxy closed the connection: generation aborted
            raise
        self.finished = True
        return out


class Client:
    """A streaming client of the edge, on a connection of its own."""

    def __init__(self, edge: Edge) -> None:
        self.url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
        self.session = aiohttp.ClientSession()
        self.response: aiohttp.ClientResponse | None = None

    async def send(self) -> aiohttp.ClientResponse:
        self.response = await self.session.post(
            self.url, json=BODY, headers={"authorization": f"Bearer {KEY.key}"}
        )
        return self.response

    async def events(self, count: int) -> list[bytes]:
        """The next `count` events' data."""
        assert self.response is not None
        got: list[bytes] = []
        async with asyncio.timeout(10):
            while len(got) < count:
                line = await self.response.content.readline()
                assert line, f"the stream ended after {got}"
                if line.startswith(b"data: "):
                    got.append(line.removeprefix(b"data: ").strip())
        return got

    async def rest(self) -> bytes:
        assert self.response is not None
        async with asyncio.timeout(10):
            return await self.response.read()

    async def leave(self) -> None:
        """Close the connection mid-stream, as a client that gives up does."""
        if self.response is not None:
            self.response.close()
        await self.session.close()


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """The edge before an origin, tenant acme limited to 10 concurrent
    requests (so that its slots in use are counted)."""
    async with edges(tmp_path) as go:

        async def limited(origin: Origin, *flags: str) -> Edge:
            edge = await go(origin, *flags)
            [[target]] = edge.app[HOLDER].routes.groups[MODEL]  # type: ignore[union-attr]
            slots = table([(target.name, target.base_url)], version=2, limited=False)
            slots.tenants[0].limits.CopyFrom(pb.Limits(concurrency=10))
            slots.etag = content_etag(slots)
            edge.app[HOLDER].apply(slots, "control-plane")
            assert edge.app[PIPELINE].limiter.share(tenant_scope("acme")).concurrency == 10
            return edge

        yield limited


@pytest.fixture
async def clients() -> AsyncIterator[list[Client]]:
    made: list[Client] = []
    yield made
    for c in made:
        await c.leave()


async def led_and_followed(
    start: Start, clients: list[Client], *flags: str, origin: Origin | None = None
) -> Any:
    """An origin (`origin`, else one of FRAMES); client A leading its flight
    with 3 events read; client B following it (the 3 events in hand); then A
    gone, and its request counted as the 499 it is."""
    origin = origin or Origin()
    edge = await start(origin, *flags)
    leader, follower = Client(edge), Client(edge)
    clients.extend((leader, follower))
    origin.let(3)  # its answer's head waits for the first
    await leader.send()
    assert len(await leader.events(3)) == 3
    answer = await follower.send()
    assert answer.headers["x-ponto-cache"] == "hit"
    assert answer.headers["x-ponto-coalesced"] == "1"
    assert len(await follower.events(3)) == 3
    await leader.leave()
    gone = {"endpoint": "chat.completions", "code": "499"}
    await until(lambda: edge.sample("ponto_requests_total", gone) == 1)
    return origin, edge, follower


def in_flight(edge: Edge) -> int:
    return edge.app[PIPELINE].limiter.in_flight(tenant_scope("acme"))


def coalesced_hits(edge: Edge) -> tuple[float | None, float | None]:
    return (
        edge.sample("ponto_cache_requests_total", {"result": "hit", "kind": "coalesced"}),
        edge.sample("ponto_cache_hits_total", {"tier": "local"}),
    )


async def test_a_leader_whose_client_leaves_goes_on_for_its_follower(
    start: Start, clients: list[Client]
) -> None:
    origin, edge, follower = await led_and_followed(start, clients)
    # The leader holds its concurrency slot while the origin generates.
    assert in_flight(edge) == 2
    origin.let(len(FRAMES) - 3)  # the rest
    rest = (await follower.rest()).decode()
    # The whole answer: no error event, every word, the end.
    assert "error" not in rest
    assert [w for w in WORDS[3:] if w in rest] == WORDS[3:]
    assert rest.rstrip().endswith("data: [DONE]")
    assert (origin.calls, origin.finished, origin.gone) == (1, True, False)
    # Recorded to its end and kept: the same question is an exact hit.
    again = Client(edge)
    clients.append(again)
    answer = await again.send()
    assert answer.headers["x-ponto-cache"] == "hit"
    assert "x-ponto-coalesced" not in answer.headers
    assert b"data: [DONE]" in await again.rest()
    assert origin.calls == 1
    # The leader is the 499 it is, its client's leaving counted once; it was
    # settled once, with every token the origin generated (six text events),
    # and gave its concurrency slot back.
    ok = {"endpoint": "chat.completions", "code": "200"}
    assert edge.sample("ponto_requests_total", ok) == 2
    assert edge.sample("ponto_client_disconnects_total", {}) == 1
    completion = {"tenant": "acme", "key": KEY.key_id, "kind": "completion"}
    await until(lambda: in_flight(edge) == 0)
    assert edge.sample("ponto_tenant_tokens_total", completion) == len(WORDS)
    assert coalesced_hits(edge) == (1, 2)  # the follower; the follower and the replay


# The origin's count, at its stream's end (as asked: stream_options).
USAGE = {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
COUNTED = [
    *FRAMES[:-1],
    b"data: "
    + json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": USAGE,
        }
    ).encode()
    + b"\n\n",
    FRAMES[-1],
]


async def test_a_leader_whose_client_left_shows_what_it_got_and_is_charged_every_token(
    start: Start, clients: list[Client], capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial 98: its 499 line, written when its client left, has what was
    relayed until then, the prompt estimated (the count comes at the end);
    billing charges the origin's count of the whole stream, once it ends
    (README, "Identical requests in flight"; the access log's
    `tokens_estimated`)."""
    origin = Origin(frames=COUNTED)
    _, edge, follower = await led_and_followed(start, clients, "--access-log=on", origin=origin)
    origin.let(len(COUNTED) - 3)
    await follower.rest()
    await until(lambda: in_flight(edge) == 0)
    edge.app[ACCESS_LOG].flush()
    lines = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    [left] = [x for x in lines if x["status"] == 499]
    estimate = estimate_prompt_tokens("chat.completions", BODY)
    assert estimate != USAGE["prompt_tokens"]
    assert (left["input_tokens"], left["output_tokens"]) == (estimate, 3)
    assert left["tokens_estimated"] is True
    who = {"tenant": "acme", "key": KEY.key_id}
    charged = [
        edge.sample(name, {**who, "kind": kind})
        for name in ("ponto_tenant_tokens_total", "ponto_tenant_estimated_tokens_total")
        for kind in ("prompt", "completion")
    ]
    assert charged == [USAGE["prompt_tokens"], USAGE["completion_tokens"], None, None]


async def left_while_followed(
    start: Start, clients: list[Client], origin: Origin
) -> tuple[Edge, Client, weakref.ref[web.Request]]:
    """The leader's client gone (its writer started: followed, its writes
    were queued) while a follower reads on, 4 events in hand; its request,
    watched, still held by its flight's task."""
    edge = await start(origin)
    leader, follower = Client(edge), Client(edge)
    clients.extend((leader, follower))
    origin.let(3)
    await leader.send()
    assert len(await leader.events(3)) == 3
    [request] = edge.app[METRICS].in_flight.requests.values()
    freed = weakref.ref(request)
    del request
    await follower.send()
    assert len(await follower.events(3)) == 3
    origin.let(1)  # followed, the leader's writes are queued: its writer starts
    assert len(await follower.events(1)) == len(await leader.events(1)) == 1
    await leader.leave()
    await until(lambda: edge.sample("ponto_client_disconnects_total", {}) == 1)
    assert freed() is not None  # its flight's task goes on with it
    return edge, follower, freed


async def test_a_leader_whose_client_left_is_freed_once_its_flight_ends_for_its_follower(
    start: Start, clients: list[Client]
) -> None:
    """With the garbage collector off, the request of a leader whose client
    left while a follower read on is freed once the flight's task has
    relayed the rest for the follower: the client's stream, never ended,
    holds its request, which holds its exchange, whose answer is that
    stream (a real proxy: RSS 10 MB higher for each 5 MB such request, 30 in
    a row, until a full collection)."""
    gc.collect()
    gc.disable()
    try:
        origin = Origin()
        edge, follower, freed = await left_while_followed(start, clients, origin)
        origin.let(len(FRAMES) - 4)
        assert (await follower.rest()).rstrip().endswith(b"data: [DONE]")
        detached = edge.app[PIPELINE]._detached
        await until(lambda: not detached)
        assert freed() is None
    finally:
        gc.enable()


class Dropping(Origin):
    """Resets its connection once the test lets out the event after its
    fifth."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for frame in FRAMES[:5]:
            await self.allowed.acquire()
            await out.write(frame)
        await self.allowed.acquire()
        assert request.transport is not None
        request.transport.abort()
        return out


async def test_a_leader_whose_client_left_is_freed_once_its_origin_cut_the_flight(
    start: Start, clients: list[Client]
) -> None:
    """As above, the origin's connection reset mid-stream: the follower's
    stream ends with the error event, and the body's reader keeps the read's
    error, whose traceback held the relay's frames (the client's stream)."""
    gc.collect()
    gc.disable()
    try:
        origin = Dropping()
        edge, follower, freed = await left_while_followed(start, clients, origin)
        origin.let(2)
        rest = (await follower.rest()).decode()
        assert "upstream_stream_broken" in rest and WORDS[4] in rest
        assert rest.rstrip().endswith("data: [DONE]")
        detached = edge.app[PIPELINE]._detached
        await until(lambda: not detached)
        assert freed() is None
    finally:
        gc.enable()


async def test_once_its_last_follower_leaves_too_the_origin_stops(
    start: Start, clients: list[Client]
) -> None:
    origin, edge, follower = await led_and_followed(start, clients)
    await follower.leave()
    await until(lambda: origin.gone)
    assert not origin.finished
    await until(lambda: in_flight(edge) == 0)
    # A follower that left is the hit it was logged as.
    assert coalesced_hits(edge) == (1, 1)
    # Nothing was kept: the next one asks the origin.
    again = Client(edge)
    clients.append(again)
    origin.let(1)
    assert (await again.send()).headers["x-ponto-cache"] == "miss"
    assert origin.calls == 2


async def test_a_leader_nobody_follows_stops_the_origin_when_its_client_leaves(
    start: Start, clients: list[Client]
) -> None:
    origin = Origin()
    edge = await start(origin)
    leader = Client(edge)
    clients.append(leader)
    origin.let(3)
    await leader.send()
    await leader.events(3)
    await leader.leave()
    await until(lambda: origin.gone)
    assert not origin.finished
    await until(lambda: in_flight(edge) == 0)
    # Its origin's call, cut mid-stream, is counted as cancelled, not ok.
    cancelled = {"origin": "o1", "outcome": "cancelled"}
    await until(lambda: edge.sample("ponto_upstream_attempts_total", cancelled) == 1)
    assert not edge.sample("ponto_upstream_attempts_total", {"origin": "o1", "outcome": "ok"})


async def test_a_flight_relayed_for_followers_alone_ends_at_the_idle_timeout(
    start: Start, clients: list[Client]
) -> None:
    # The origin sends nothing more: the stream's idle timeout ends the call,
    # and the follower's stream with an error event, as any relay's.
    origin, edge, follower = await led_and_followed(start, clients, "--stream-idle-timeout=0.5")
    rest = (await follower.rest()).decode()
    assert "upstream_stream_broken" in rest
    assert rest.rstrip().endswith("data: [DONE]")
    await until(lambda: origin.gone)
    await until(lambda: in_flight(edge) == 0)


async def test_a_flight_past_the_request_deadline_goes_on_for_its_followers(
    start: Start, clients: list[Client]
) -> None:
    # --deadline bounds the wait for an answer to start, not a stream under
    # way: a leader leaving after it does not cut its followers (review 14).
    origin, edge, follower = await led_and_followed(start, clients, "--deadline=0.1")
    await asyncio.sleep(0.3)  # past the deadline, the stream healthy
    origin.let(len(FRAMES) - 3)
    rest = (await follower.rest()).decode()
    assert "error" not in rest and WORDS[-1] in rest
    assert rest.rstrip().endswith("data: [DONE]")
    await until(lambda: in_flight(edge) == 0)


async def test_the_proxy_stopping_stops_a_flight_relayed_for_followers_alone(
    start: Start, clients: list[Client]
) -> None:
    origin, edge, follower = await led_and_followed(start, clients)
    await edge.app[PIPELINE].close()  # the app's clean-up step
    assert origin.calls == 1
    await until(lambda: origin.gone)
    rest = (await follower.rest()).decode()
    assert "upstream_stream_broken" in rest
    assert in_flight(edge) == 0


def followers(edge: Edge) -> int:
    return edge.app[PIPELINE].cache.coalescer.stats.followers


async def test_followers_of_a_leader_gone_before_the_answer_started_make_one_call(
    start: Start, clients: list[Client]
) -> None:
    """A leader whose client leaves while the origin has not answered yet
    fails its flight; its followers hand off: the first leads a new flight,
    the others follow it (not a call each)."""
    origin = Origin(late_head=True)
    edge = await start(origin)
    leader, first, second = Client(edge), Client(edge), Client(edge)
    clients.extend((leader, first, second))
    sent = asyncio.create_task(leader.send())
    await until(lambda: origin.calls == 1)
    following = [asyncio.create_task(c.send()) for c in (first, second)]
    await until(lambda: followers(edge) == 2)
    sent.cancel()
    await leader.leave()
    await until(lambda: origin.gone)
    # One of the two leads the new flight; the other follows it.
    await until(lambda: origin.calls == 2)
    await until(lambda: followers(edge) == 3)
    origin.let(1 + len(FRAMES))  # the new call's head, then every event
    answers = await asyncio.gather(*following)
    assert sorted(a.headers["x-ponto-cache"] for a in answers) == ["hit", "miss"]
    for c in (first, second):
        rest = (await c.rest()).decode()
        assert "error" not in rest and WORDS[-1] in rest
        assert rest.rstrip().endswith("data: [DONE]")
    assert origin.calls == 2
    assert origin.finished
    await until(lambda: in_flight(edge) == 0)


WHOLE = {**BODY, "stream": False}


class WholeOrigin:
    """Answers a whole completion once the test lets it out; counts its calls
    and the ones whose caller left."""

    def __init__(self) -> None:
        self.calls = 0
        self.gone = 0
        self.allowed = asyncio.Semaphore(0)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        try:
            await self.allowed.acquire()
        except asyncio.CancelledError:
            self.gone += 1
            raise
        return web.json_response(COMPLETION)


async def test_followers_of_a_whole_answer_leader_gone_make_one_call(
    start: Start, clients: list[Client]
) -> None:
    origin = WholeOrigin()
    edge = await start(origin)
    sessions = [aiohttp.ClientSession() for _ in range(4)]
    url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
    auth = {"authorization": f"Bearer {KEY.key}"}
    try:
        leader = asyncio.create_task(sessions[0].post(url, json=WHOLE, headers=auth))
        await until(lambda: origin.calls == 1)
        posts = [asyncio.create_task(s.post(url, json=WHOLE, headers=auth)) for s in sessions[1:]]
        await until(lambda: followers(edge) == 3)
        leader.cancel()
        await sessions[0].close()
        await until(lambda: origin.gone == 1)
        await until(lambda: origin.calls == 2 and followers(edge) == 5)
        origin.allowed.release()
        answers = await asyncio.gather(*posts)
        assert sorted(a.headers["x-ponto-cache"] for a in answers) == ["hit", "hit", "miss"]
        for a in answers:
            assert a.status == 200
            assert (await a.json())["choices"][0]["message"]["content"] == "hi"
        assert origin.calls == 2
    finally:
        for s in sessions:
            await s.close()
    await until(lambda: in_flight(edge) == 0)


class FailingFirst(WholeOrigin):
    """Its first call fails once the test lets it out; the others are answered."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        if self.calls == 1:
            await self.allowed.acquire()
            raise ConnectionResetError  # aiohttp drops the connection: no answer
        return web.json_response(COMPLETION)


async def test_followers_of_a_leader_that_failed_still_call_on_their_own(
    start: Start, clients: list[Client]
) -> None:
    """Only a leader's leaving hands off: after an origin's failure each
    follower calls on its own, as before."""
    origin = FailingFirst()
    edge = await start(origin, "--max-attempts=1")
    url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
    auth = {"authorization": f"Bearer {KEY.key}"}
    async with aiohttp.ClientSession() as session:
        leader = asyncio.create_task(session.post(url, json=WHOLE, headers=auth))
        await until(lambda: origin.calls == 1)
        posts = [asyncio.create_task(session.post(url, json=WHOLE, headers=auth)) for _ in range(2)]
        await until(lambda: followers(edge) == 2)
        origin.allowed.release()
        failed = await leader
        assert failed.status >= 500
        answers = await asyncio.gather(*posts)
        assert [a.status for a in answers] == [200, 200]
    assert origin.calls == 3


@pytest.mark.parametrize("followed", [True, False], ids=["a-flights-leader", "uncached"])
async def test_a_whole_answer_whose_origin_failed_is_freed_once_answered(
    start: Start, followed: bool
) -> None:
    """With the garbage collector off, a whole answer's request whose origin
    failed is freed once it (and the follower of its flight) is answered:
    the error the forwarder raised held its frame (the body), and a flight
    kept the failure for its followers, whose traceback held the leader's
    frames (its request, its body) and through its cache plan the flight."""
    gc.collect()
    gc.disable()
    try:
        origin = FailingFirst()
        edge = await start(origin, "--max-attempts=1")
        url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
        auth = {"authorization": f"Bearer {KEY.key}"}
        body = WHOLE if followed else {**WHOLE, "temperature": 1}
        async with aiohttp.ClientSession() as session:
            leader = asyncio.create_task(session.post(url, json=body, headers=auth))
            await until(lambda: origin.calls == 1)
            [request] = edge.app[METRICS].in_flight.requests.values()
            freed = weakref.ref(request)
            del request
            posts = []
            if followed:
                posts.append(asyncio.create_task(session.post(url, json=body, headers=auth)))
                await until(lambda: followers(edge) == 1)
            origin.allowed.release()
            answers = [await leader, *await asyncio.gather(*posts)]
            assert [a.status for a in answers] == [502, 200][: len(answers)]
        await until(lambda: in_flight(edge) == 0 and not edge.app[METRICS].in_flight.requests)
        assert freed() is None
    finally:
        gc.enable()
