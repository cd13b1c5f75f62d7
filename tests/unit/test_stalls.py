"""dataplane.upstream.stalls: the streams of an origin the table marks
unhealthy have their waits capped, and only those, while it is so; the relay
tells the watch of each origin a stream goes on from."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from aiohttp import web

from dataplane.metrics import Metrics
from dataplane.routes import Routes, build_routes
from dataplane.streaming.relay import Next, relay
from dataplane.timer import IdleTimeout
from dataplane.upstream.forwarder import Forwarder, UpstreamSettings
from dataplane.upstream.stalls import NO_WATCH, CallWatch, Stalled, Stalls, StreamWatch
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_stream_relay import Content, Out


class Idle:
    """An IdleTimeout's cap, as the watch sets it."""

    def __init__(self) -> None:
        self.caps: list[float | None] = []

    def cap(self, delay: float | None) -> None:
        self.caps.append(delay)


def routes(*unhealthy: str) -> Routes:
    return cast(Routes, type("R", (), {"unhealthy": frozenset(unhealthy)})())


def attached(stalls: Stalls, origin: str) -> tuple[StreamWatch, Idle]:
    watch = stalls.watch(origin)
    assert watch is not None
    idle = Idle()
    watch.attach(cast(IdleTimeout, idle))
    return watch, idle


def test_the_streams_of_an_origin_marked_unhealthy_are_capped_until_it_heals() -> None:
    stalls = Stalls(5.0)
    (w0, on_o0), (w1, on_o1) = attached(stalls, "o0"), attached(stalls, "o1")
    assert on_o0.caps == on_o1.caps == [None]  # healthy when attached
    stalls.on_apply(routes("o0"), None)
    assert on_o0.caps == [None, 5.0] and on_o1.caps == [None]
    stalls.on_apply(routes("o0"), None)  # still so: nothing again
    assert on_o0.caps == [None, 5.0]
    stalls.on_apply(routes(), None)
    assert on_o0.caps == [None, 5.0, None]
    # One attached while its origin is unhealthy is capped at once.
    stalls.on_apply(routes("o1"), None)
    _, late = attached(stalls, "o1")
    assert late.caps == [5.0]
    assert stalls.streams("o1") == 2
    w0.close()
    w1.close()
    assert stalls.streams("o0") == 0 and stalls.streams("o1") == 1


def test_a_stream_continued_elsewhere_follows_its_new_origins_health() -> None:
    stalls = Stalls(5.0)
    stalls.on_apply(routes("o0"), None)
    watch, idle = attached(stalls, "o0")
    watch.move("o1")  # continued on a healthy origin: the cap goes
    assert idle.caps == [5.0, None]
    assert (stalls.streams("o0"), stalls.streams("o1")) == (0, 1)
    stalls.on_apply(routes("o0", "o1"), None)
    assert idle.caps == [5.0, None, 5.0]
    watch.move("")  # the proxy's own ending: no origin
    assert idle.caps[-1] is None and stalls.streams("o1") == 0


def test_off_there_is_nothing_to_watch() -> None:
    assert Stalls(None).watch("o0") is None


def origin(name: str, model: str, *, healthy: bool) -> pb.Origin:
    return pb.Origin(
        name=name, base_url="http://x", region="r", models=[model], weight=1, healthy=healthy
    )


def test_the_table_names_unhealthy_origins_but_those_panic_routing_uses() -> None:
    table = pb.RouteTable(
        version=1,
        regions=[pb.Region(name="r")],
        origins=[
            origin("a1", "a", healthy=True),
            origin("a2", "a", healthy=False),  # a has a healthy origin: a2 is capped
            origin("b1", "b", healthy=False),  # b has none: panic, not capped
        ],
    )
    table.etag = content_etag(table)
    built = build_routes(table, "r")
    assert built.panic == {"b"}
    assert built.unhealthy == {"a2"}


class Moves:
    def __init__(self) -> None:
        self.origins: list[str] = []
        self.idle: IdleTimeout | None = None

    def attach(self, idle: IdleTimeout) -> None:
        self.idle = idle

    def move(self, origin: str) -> None:
        self.origins.append(origin)


async def test_the_relay_attaches_its_idle_bound_and_tells_each_origin_it_goes_on_from() -> None:
    async def resume(cut: str, too_long: int) -> Next:
        return Next(b"data: [DONE]\n\n", Content(), lambda data: data, origin="o1")

    moves = Moves()
    end = await relay(
        b'data: {"a":1}\n\n',
        Content(b'data: {"error": {"message": "x"}}\n\n'),
        cast(web.StreamResponse, Out()),
        idle_timeout=60.0,
        resume=resume,
        watch=moves,
    )
    assert end.complete and end.continued == ["the origin sent an error event"]
    assert moves.idle is not None and moves.idle.delay == 60.0
    assert moves.origins == ["o1"]


async def test_a_call_is_cut_once_its_origin_is_marked_unhealthy_and_only_then() -> None:
    """CallWatch (trial 49): a call not yet answered is cut after_s after the
    table marks its origin unhealthy; one that answers first is left alone,
    a cancellation from elsewhere stays a cancellation, and each is forgotten."""
    stalls = Stalls(0.01)
    hung = asyncio.Event()

    async def call(origin: str, answer: asyncio.Event, stream: bool = False) -> str:
        task = asyncio.current_task()
        assert task is not None
        with CallWatch(stalls, origin, task, stream):
            hung.set()
            await answer.wait()
            return "answered"

    never = asyncio.Event()
    cut = asyncio.ensure_future(call("o0", never))
    await hung.wait()
    stalls.on_apply(routes("o0"), None)
    with pytest.raises(Stalled, match=r"no answer within 0\.01 s"):
        await cut
    # Answered before the cut: as it came, and nothing cancels it later.
    answered = asyncio.Event()
    quick = asyncio.ensure_future(call("o0", answered))
    await asyncio.sleep(0)
    answered.set()
    assert await quick == "answered"
    # A cancel from elsewhere (the client left) is not a stall.
    hung.clear()
    stalls.on_apply(routes(), None)
    left = asyncio.ensure_future(call("o0", never))
    await hung.wait()
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    assert stalls.streams("o0") == 0
    # Not before twice the origin's usual time to answer (helper-191: probes
    # slow on a loaded origin cut the long answers it was giving).
    stalls.on_apply(routes("o0"), None)
    stalls.usual = lambda origin, stream: 15.0 if stream else None  # its streams' first chunks
    slow = asyncio.Event()
    long = asyncio.ensure_future(call("o0", slow, stream=True))
    await asyncio.sleep(0.05)  # five times after_s
    slow.set()
    assert await long == "answered"


async def test_the_forwarder_watches_each_call_while_the_watch_is_on() -> None:
    """Forwarder._watch, the one maker of CallWatches: a watch of the call's
    own task, registered under its origin while the call runs; NO_WATCH when
    Stalls is off (after_s None), and before the forwarder knows its loop."""
    stalls = Stalls(0.01)
    on = Forwarder(Metrics(), UpstreamSettings(), stalls=stalls)
    assert on._watch("o0", False) is NO_WATCH  # no call made yet: no loop
    on._loop = asyncio.get_running_loop()
    watch = on._watch("o0", True)
    assert isinstance(watch, CallWatch)
    with watch:
        assert stalls.streams("o0") == 1
    assert stalls.streams("o0") == 0
    off = Forwarder(Metrics(), UpstreamSettings(), stalls=Stalls(None))
    off._loop = asyncio.get_running_loop()
    assert off._watch("o0", False) is NO_WATCH


async def test_a_call_to_an_origin_already_marked_unhealthy_is_cut() -> None:
    """CallWatch: a call that begins while the table marks its origin
    unhealthy is bounded from its start; no later table has to say so."""
    stalls = Stalls(0.01)
    stalls.on_apply(routes("o0"), None)

    async def call() -> None:
        task = asyncio.current_task()
        assert task is not None
        with CallWatch(stalls, "o0", task):
            await asyncio.Event().wait()

    # The outer bound only keeps a failure of this test from hanging.
    with pytest.raises(Stalled, match=r"no answer within 0\.01 s"):
        await asyncio.wait_for(call(), 10)
    assert stalls.streams("o0") == 0
