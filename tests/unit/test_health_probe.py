"""controlplane.health: metrics parsing, hysteresis, write filtering, and real probes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.catalog import Catalog
from controlplane.errors import Unavailable
from controlplane.health import (
    AT_ONCE,
    INHERITED_LINES,
    PROBES_A_TURN,
    UNCHANGED,
    Prober,
    ProbeSettings,
    _Track,
    change,
    health_line,
    judge,
    parse_load,
    root_of,
    verdict,
)
from controlplane.model import Origin, OriginHealth, Region
from controlplane.store import Fence
from controlplane.store.memory import MemoryStore

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

VLLM_METRICS = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 4.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} 123456.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2345678e+09
"""


# ---------------------------------------------------------------- parse_load


def test_parse_load_sums_running_and_waiting_over_label_sets() -> None:
    assert parse_load(VLLM_METRICS) == 9.0


def test_parse_load_without_labels() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2.5\n"
    assert parse_load(text) == 3.5


def test_parse_load_label_values_with_spaces() -> None:
    text = 'vllm:num_requests_running{model_name="my model v2"} 6\n'
    assert parse_load(text) == 6.0


def test_parse_load_zero_is_not_none() -> None:
    text = 'vllm:num_requests_running{model_name="m"} 0.0\n'
    assert parse_load(text) == 0.0


def test_parse_load_only_one_gauge() -> None:
    text = '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 7\n'
    assert parse_load(text) == 7.0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP vllm:num_requests_running Number of requests.\n"
        "# TYPE vllm:num_requests_running gauge\n",
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\nprocess_open_fds 12\n',
        "<html><body>Not Found</body></html>",
    ],
    ids=["empty", "help-and-type-only", "other-metrics", "html"],
)
def test_parse_load_none_without_the_gauges(text: str) -> None:
    assert parse_load(text) is None


def test_parse_load_ignores_malformed_lines() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 2\n'
        'vllm:num_requests_running{model_name="m"} not-a-number\n'
        "vllm:num_requests_waiting\n"
        'vllm:num_requests_waiting{model_name="m"} 1\n'
    )
    assert parse_load(text) == 3.0


def test_parse_load_only_malformed_lines_is_none() -> None:
    text = "vllm:num_requests_running{} garbage\nvllm:num_requests_waiting\n"
    assert parse_load(text) is None


# ---------------------------------------------------------------- root_of


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000"),
        ("https://gpu.example/openai/v1/", "https://gpu.example"),
        ("http://gpu.example", "http://gpu.example"),
        ("http://[::1]:9000/v1", "http://[::1]:9000"),
    ],
)
def test_root_of_strips_the_path(url: str, root: str) -> None:
    assert root_of(url) == root


# ---------------------------------------------------------------- judge

RISE_FALL_2 = ProbeSettings(rise=2, fall=2)
DOWN = "probe answered 503"


def step(
    track: _Track, ok: bool, settings: ProbeSettings = RISE_FALL_2, detail: str = DOWN
) -> bool:
    """Judge one probe result; return whether the track is healthy afterwards."""
    judge(track, ok, "" if ok else detail, settings)
    return track.healthy


def test_one_failure_keeps_healthy_two_flip() -> None:
    track = _Track()
    assert step(track, False) is True
    assert step(track, False) is False
    assert track.detail == DOWN


def test_interrupted_failures_do_not_flip() -> None:
    track = _Track()
    for _ in range(5):
        assert step(track, False) is True
        assert step(track, True) is True


def test_one_success_keeps_unhealthy_two_flip_back() -> None:
    track = _Track(healthy=False, detail=DOWN)
    assert step(track, True) is False
    assert track.detail == DOWN  # still unhealthy: reason kept
    assert step(track, True) is True
    assert track.detail == ""


def test_interrupted_successes_do_not_flip_back() -> None:
    track = _Track(healthy=False, detail="probe failed: ClientConnectorError")
    for _ in range(5):
        assert step(track, True) is False
        assert step(track, False, detail="probe answered 502") is False
    assert track.detail == "probe answered 502"


def test_detail_follows_latest_failure_while_unhealthy() -> None:
    track = _Track()
    step(track, False)
    assert step(track, False) is False
    assert step(track, False, detail="probe timed out after 1.0s") is False
    assert track.detail == "probe timed out after 1.0s"
    assert step(track, True) is False
    assert track.detail == "probe timed out after 1.0s"


def test_rise_and_fall_of_one_flip_at_once() -> None:
    settings = ProbeSettings(rise=1, fall=1)
    track = _Track()
    assert step(track, False, settings) is False
    assert track.detail == DOWN
    assert step(track, True, settings) is True
    assert track.detail == ""


def test_asymmetric_rise_and_fall() -> None:
    settings = ProbeSettings(rise=3, fall=1)
    track = _Track()
    assert step(track, False, settings) is False
    assert step(track, True, settings) is False
    assert step(track, True, settings) is False
    assert step(track, True, settings) is True


# ---------------------------------------------------------------- change


def health(healthy: bool = True, inflight: float = 0.0, detail: str = "") -> OriginHealth:
    return OriginHealth(origin="o1", healthy=healthy, inflight=inflight, detail=detail)


def test_first_result_is_always_written() -> None:
    assert change(None, health()) == AT_ONCE
    assert change(None, health(healthy=False, detail="x")) == AT_ONCE


def test_health_flips_are_written() -> None:
    assert change(health(True), health(False, detail="probe answered 503")) == AT_ONCE
    assert change(health(False, detail="probe answered 503"), health(True)) == AT_ONCE


def test_same_health_same_load_not_written() -> None:
    assert change(health(True, 3), health(True, 3)) == UNCHANGED
    unhealthy = health(False, 3, "probe answered 503")
    assert change(unhealthy, unhealthy) == UNCHANGED


def test_detail_change_while_unhealthy_is_written() -> None:
    old = health(False, detail="probe answered 503")
    new = health(False, detail="probe failed: ClientConnectorError")
    assert change(old, new) == AT_ONCE


def test_load_change_while_unhealthy_is_not_written() -> None:
    old = health(False, 0, "probe answered 503")
    new = health(False, 9, "probe answered 503")
    assert change(old, new) == UNCHANGED


def test_a_move_of_load_alone_is_never_written_a_flip_is() -> None:
    """Trial 19: origins of capacity 4 rewrote their health, and so rebuilt
    the route table, on nearly every probe under three clients; later, moves
    of a tenth of capacity still made a table every five seconds under any
    traffic. Load reaches proxies and operators apart from tables
    (controlplane.loadsync); a flip of health goes at once."""
    last = health(True, 0)
    assert change(last, health(True, 3)) == UNCHANGED
    assert change(last, health(True, 500)) == UNCHANGED
    assert change(health(True, 90), health(True, 0)) == UNCHANGED
    assert change(last, health(False, 3, "probe answered 503")) == AT_ONCE
    down = health(False, 0, "probe answered 503")
    assert change(down, health(True, 3)) == AT_ONCE


def test_a_new_server_kind_or_load_figures_coming_or_going_are_written() -> None:
    # Even within the interval, and without capacity: they change what
    # `get origins` and the status page say of the origin's load.
    vllm = OriginHealth("o1", healthy=True, inflight=3, server_kind="vllm")
    unread = OriginHealth("o1", healthy=True, server_kind="unknown", inflight_unknown=True)
    assert change(vllm, unread) == AT_ONCE
    assert change(unread, vllm) == AT_ONCE
    assert change(vllm, OriginHealth("o1", healthy=True, inflight=3, server_kind="tgi")) == AT_ONCE
    assert change(vllm, vllm) == UNCHANGED


def test_parse_load_reads_every_servers_requests() -> None:
    llamacpp = "llamacpp:requests_processing 3\nllamacpp:requests_deferred 5\n"
    assert parse_load(llamacpp) == 8.0
    assert parse_load('sglang:num_running_reqs{model_name="m"} 2.0\n') == 2.0
    assert parse_load("tgi_queue_size 1\ntgi_batch_current_size 4\n") == 5.0


# ---------------------------------------------------------------- Prober, real servers


@dataclass
class FakeOrigin:
    """What the tiny vLLM stand-in answers; tests change it between rounds."""

    status: int = 200
    metrics: str = VLLM_METRICS
    metrics_status: int = 200
    health_hits: list[str] = field(default_factory=list)
    # Awaited as a probe arrives, before it is answered.
    on_probe: Callable[[], Awaitable[None]] | None = None

    def app(self) -> web.Application:
        async def health_handler(request: web.Request) -> web.Response:
            self.health_hits.append(request.path)
            if self.on_probe is not None:
                await self.on_probe()
            if 300 <= self.status < 400:  # to a page that answers 200
                return web.Response(status=self.status, headers={"location": "/metrics"})
            return web.Response(status=self.status, text="ok" if self.status < 400 else "down")

        async def metrics_handler(request: web.Request) -> web.Response:
            if self.metrics_status != 200:
                return web.Response(status=self.metrics_status, text="busy")
            return web.Response(text=self.metrics, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/health", health_handler)
        app.router.add_get("/metrics", metrics_handler)
        return app


@pytest.fixture
async def fake_origin() -> AsyncIterator[tuple[FakeOrigin, TestServer]]:
    origin = FakeOrigin()
    server = TestServer(origin.app(), host="127.0.0.1")
    await asyncio.wait_for(server.start_server(), 10)
    try:
        yield origin, server
    finally:
        await asyncio.wait_for(server.close(), 10)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        yield s


async def make_catalog(*origins: Origin) -> Catalog:
    catalog = Catalog(MemoryStore())
    await catalog.put_region(Region("eu-west", 53.0, -6.0), allow_update=False)
    for o in origins:
        await catalog.put_origin(o, allow_update=False)
    return catalog


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def stored(catalog: Catalog, name: str) -> OriginHealth | None:
    return (await catalog.snapshot()).health.get(name)


async def probe(prober: Prober, session: aiohttp.ClientSession) -> None:
    await asyncio.wait_for(prober.probe_all(session), 10)


async def one_origin(fake_origin: tuple[FakeOrigin, TestServer]) -> tuple[Catalog, Prober]:
    """A catalog of the fake origin alone (o1, capacity 10) and a prober of it
    that flips health on one probe."""
    _, server = fake_origin
    base_url = str(server.make_url("/v1"))
    catalog = await make_catalog(Origin("o1", base_url, "eu-west", ("llama-3",), capacity=10))
    return catalog, Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))


async def test_prober_follows_health_and_load(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    origin, _ = fake_origin
    catalog, prober = await one_origin(fake_origin)

    await probe(prober, session)
    first = await stored(catalog, "o1")
    assert first is not None
    assert first.healthy
    assert first.inflight == 9.0  # 3 + 2 running, 4 + 0 waiting
    assert first.detail == ""
    assert first.checked_at > 0
    assert origin.health_hits == ["/health"]  # resolved against the root, not /v1

    origin.status = 503
    await probe(prober, session)
    down = await stored(catalog, "o1")
    assert down is not None
    assert not down.healthy
    assert "503" in down.detail
    assert down.inflight == 9.0  # no metrics read while down: last load kept

    origin.status = 200
    origin.metrics = VLLM_METRICS.replace("} 3.0", "} 7.0")  # engine 0 running 3 -> 7
    await probe(prober, session)
    up = await stored(catalog, "o1")
    assert up is not None
    assert up.healthy
    assert up.detail == ""
    assert up.inflight == 13.0
    assert prober.rounds == 3


async def test_prober_never_writes_a_move_of_load_alone(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    """Trial 84, and the churn after it: moves of load were written together
    at most every five seconds, and each write made a new route table for
    every proxy to build, ack and save, under any traffic, for nothing an
    operator or a probe changed. The store's revision stays put however the
    load moves; a flip of health is still written at once."""
    origin, server = fake_origin
    root = str(server.make_url(""))
    catalog = await make_catalog(
        *(
            Origin(f"o{i}", f"{root}/o{i}/v1", "eu-west", ("llama-3",), capacity=10)
            for i in range(3)
        )
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    await probe(prober, session)
    revision = (await catalog.snapshot()).revision
    for metrics in (VLLM_METRICS.replace("} 3.0", "} 7.0"), VLLM_METRICS):  # 9 -> 13 -> 9
        origin.metrics = metrics
        await probe(prober, session)
        assert (await catalog.snapshot()).revision == revision
    origin.status = 503
    await probe(prober, session)
    down = await stored(catalog, "o1")
    assert down is not None and not down.healthy


async def test_a_flip_not_written_is_tried_next_round_and_a_deposed_leader_writes_none(
    fake_origin: tuple[FakeOrigin, TestServer],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write etcd did not take is tried at the next round (what was
    written stays the prober's reference until one is taken); one a
    deposed leader's fence refuses writes nothing, and says why."""
    origin, _ = fake_origin
    catalog, _ = await one_origin(fake_origin)
    leader = await catalog.store.put("/ponto/leader", b"me")
    fence = [Fence("/ponto/leader", leader)]
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2), fence=lambda: fence[0])
    await probe(prober, session)  # first result: at once
    put_healths, calls = catalog.put_healths, [0]

    async def unavailable_once(healths: Any, *, fence: Fence | None = None) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise Unavailable("etcd is away")
        await put_healths(healths, fence=fence)

    catalog.put_healths = unavailable_once  # type: ignore[method-assign]
    origin.status = 503
    await probe(prober, session)
    first = await stored(catalog, "o1")
    assert first is not None and first.healthy
    await probe(prober, session)
    second = await stored(catalog, "o1")
    assert second is not None and not second.healthy  # the next round
    # Deposed: its fence names a leader key no longer there as it was.
    fence[0] = Fence("/ponto/leader", leader + 99)
    origin.status = 200
    before = (await catalog.snapshot()).revision
    caplog.clear()
    await probe(prober, session)
    assert (await catalog.snapshot()).revision == before
    refused = [r for r in caplog.records if "no longer the leader" in r.getMessage()]
    assert [r.getMessage() for r in refused] == ["not recording health of o1: no longer the leader"]
    assert refused[0].exc_info is None


async def test_a_new_term_starts_from_what_the_store_holds_not_from_a_past_term(
    fake_origin: tuple[FakeOrigin, TestServer],
) -> None:
    """Review: the prober outlives a term, and kept what it had written in
    its last one. Another leader meanwhile wrote o1 unhealthy, and o1 came
    back: the first leader, leading again, found o1 as it had last written
    it (healthy, 9 requests) and wrote nothing, so the table held o1
    unhealthy (and its old load) for as long as it stayed as it was."""
    catalog, prober = await one_origin(fake_origin)

    async def one_term() -> None:
        started = prober.rounds
        term = asyncio.create_task(prober.run())
        try:
            async with asyncio.timeout(10):
                while prober.rounds == started:
                    await asyncio.sleep(0.01)
        finally:
            term.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await term

    await one_term()
    first = await stored(catalog, "o1")
    assert first is not None and first.healthy and first.inflight == 9.0
    # Another leader's term: o1 was down, and busy.
    await catalog.put_health(
        OriginHealth("o1", healthy=False, inflight=30.0, detail="probe answered 503")
    )
    await one_term()
    back = await stored(catalog, "o1")
    assert back is not None and back.healthy and back.inflight == 9.0


async def test_prober_hysteresis_with_default_rise_fall(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    origin, server = fake_origin
    catalog = await make_catalog(
        Origin("o1", str(server.make_url("/v1")), "eu-west", ("llama-3",), capacity=10)
    )
    prober = Prober(catalog, ProbeSettings(rise=2, fall=2, timeout=2))
    await probe(prober, session)
    origin.status = 500
    await probe(prober, session)
    one = await stored(catalog, "o1")
    assert one is not None
    assert one.healthy  # one failure is not enough
    await probe(prober, session)
    two = await stored(catalog, "o1")
    assert two is not None
    assert not two.healthy
    assert "500" in two.detail


async def test_prober_without_metrics_has_an_unknown_load(session: aiohttp.ClientSession) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)  # no /metrics: 404
    server = TestServer(app, host="127.0.0.1")
    await asyncio.wait_for(server.start_server(), 10)
    try:
        catalog = await make_catalog(
            Origin("o1", str(server.make_url("/v1")), "eu-west", ("llama-3",), capacity=10)
        )
        prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
        await probe(prober, session)
    finally:
        await asyncio.wait_for(server.close(), 10)
    h = await stored(catalog, "o1")
    assert h is not None
    assert h.healthy  # missing metrics is not a health failure
    assert h.inflight == 0.0
    assert h.inflight_unknown  # ... but that 0 is not measured
    assert h.server_kind == ""


LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


async def test_prober_reads_a_llamacpp_origins_load_and_kind(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    """Trial 66: a llama.cpp origin with 8 in flight (3 processing, 5
    deferred) read 0: only vllm: names were read."""
    origin, _ = fake_origin
    origin.metrics = LLAMACPP_METRICS
    catalog, prober = await one_origin(fake_origin)
    await probe(prober, session)
    h = await stored(catalog, "o1")
    assert h is not None
    assert (h.inflight, h.server_kind, h.inflight_unknown) == (8.0, "llamacpp", False)


async def test_prober_says_when_a_page_has_no_load_figures(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    origin, _ = fake_origin
    catalog, prober = await one_origin(fake_origin)
    await probe(prober, session)
    origin.metrics = "# TYPE process_open_fds gauge\nprocess_open_fds 12\n"
    await probe(prober, session)  # within the load interval: written at once
    h = await stored(catalog, "o1")
    assert h is not None
    assert (h.inflight, h.server_kind, h.inflight_unknown) == (0.0, "unknown", True)


async def test_one_refused_metrics_page_keeps_the_last_figures_two_in_a_row_do_not(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    """Review: each lost page flipped the load to unknown and back, two
    tables and a spill each way; a page refused twice in a row is no page."""
    origin, _ = fake_origin
    origin.metrics = LLAMACPP_METRICS
    catalog, prober = await one_origin(fake_origin)
    await probe(prober, session)
    written = await stored(catalog, "o1")
    origin.metrics_status = 503
    await probe(prober, session)
    assert await stored(catalog, "o1") == written  # nothing written
    await probe(prober, session)
    h = await stored(catalog, "o1")
    assert h is not None and (h.inflight, h.inflight_unknown) == (0.0, True)


async def test_a_redirect_is_no_passing_probe(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    """Review: the probe followed a redirect (to another host, there), and
    what answered there passed for the origin. The proxies follow none."""
    origin, _ = fake_origin
    origin.status = 302
    catalog, prober = await one_origin(fake_origin)
    await probe(prober, session)
    h = await stored(catalog, "o1")
    assert h is not None and not h.healthy and "redirect" in h.detail
    assert verdict(204, "/health", False) == (True, "")


async def test_health_of_an_origin_deleted_during_its_probe_goes_next_round(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    origin, _ = fake_origin
    catalog, prober = await one_origin(fake_origin)
    origin.status = 503  # a verdict a new o1 must not start from

    async def delete() -> None:
        origin.on_probe = None
        await catalog.delete_origin("o1")

    origin.on_probe = delete
    await probe(prober, session)
    # The round read o1 before its deletion and wrote its verdict after.
    orphan = await stored(catalog, "o1")
    assert orphan is not None and not orphan.healthy
    await probe(prober, session)
    assert (await catalog.snapshot()).health == {}
    assert len(origin.health_hits) == 1  # a gone origin is not probed again


async def test_a_replica_not_the_leader_deletes_no_health(
    session: aiohttp.ClientSession,
) -> None:
    catalog = await make_catalog()
    await catalog.put_health(OriginHealth("gone", healthy=False, detail="probe failed"))
    await probe(Prober(catalog, ProbeSettings(), may_write=lambda: False), session)
    assert set((await catalog.snapshot()).health) == {"gone"}
    await probe(Prober(catalog, ProbeSettings()), session)
    assert (await catalog.snapshot()).health == {}


async def test_prober_writes_nothing_when_not_allowed(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    origin, server = fake_origin
    catalog = await make_catalog(
        Origin("o1", str(server.make_url("/v1")), "eu-west", ("llama-3",), capacity=10)
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2), may_write=lambda: False)
    await probe(prober, session)
    origin.status = 503
    await probe(prober, session)
    assert len(origin.health_hits) == 2  # it did probe
    assert (await catalog.snapshot()).health == {}
    assert prober.rounds == 2


async def test_prober_marks_closed_port_unhealthy(session: aiohttp.ClientSession) -> None:
    port = closed_port()
    catalog = await make_catalog(
        Origin("dead", f"http://127.0.0.1:{port}/v1", "eu-west", ("llama-3",), capacity=10)
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    await probe(prober, session)
    h = await stored(catalog, "dead")
    assert h is not None
    assert not h.healthy
    assert h.detail.startswith("probe failed")


async def test_prober_probes_every_origin_independently(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    _, server = fake_origin
    port = closed_port()
    catalog = await make_catalog(
        Origin("live", str(server.make_url("/v1")), "eu-west", ("llama-3",), capacity=10),
        Origin("dead", f"http://127.0.0.1:{port}/v1", "eu-west", ("llama-3",), capacity=10),
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    await probe(prober, session)
    health_by_name = (await catalog.snapshot()).health
    assert health_by_name["live"].healthy
    assert health_by_name["live"].inflight == 9.0
    assert not health_by_name["dead"].healthy


async def test_prober_starts_from_stored_health(
    fake_origin: tuple[FakeOrigin, TestServer], session: aiohttp.ClientSession
) -> None:
    """A new leader resumes from what the previous one stored (rise applies)."""
    _, server = fake_origin
    catalog = await make_catalog(
        Origin("o1", str(server.make_url("/v1")), "eu-west", ("llama-3",), capacity=10)
    )
    await catalog.put_health(OriginHealth("o1", healthy=False, detail="probe answered 503"))
    prober = Prober(catalog, ProbeSettings(rise=2, fall=2, timeout=2))
    await probe(prober, session)
    h = await stored(catalog, "o1")
    assert h is not None
    assert not h.healthy  # one success of two
    await probe(prober, session)
    h = await stored(catalog, "o1")
    assert h is not None
    assert h.healthy


async def test_a_term_logs_the_origins_it_starts_with_unhealthy_once(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Flips alone are logged: a leader that took over while an origin
    failed logged nothing of it for as long as it failed. It says each one
    it starts with unhealthy once, up to INHERITED_LINES, then how many more."""
    port = closed_port()
    names = [f"dead{i:02}" for i in range(INHERITED_LINES + 2)]
    catalog = await make_catalog(
        *(Origin(n, f"http://127.0.0.1:{port}/v1", "eu-west", ("m",)) for n in names)
    )
    for n in names:
        await catalog.put_health(OriginHealth(n, healthy=False, detail="probe answered 503"))
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    caplog.set_level(logging.INFO, logger="controlplane.health")
    await probe(prober, session)
    await probe(prober, session)  # the term's next round: said already
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        *(
            f"origin {n} is unhealthy (probe answered 503), as stored when this "
            "leader's term started"
            for n in names[:INHERITED_LINES]
        ),
        "and 2 more origins unhealthy when this leader's term started "
        "(pontoctl get origins lists them)",
    ]


def test_the_health_line_never_reads_healthy_because_a_probe_failed() -> None:
    def line(healthy: bool, detail: str) -> str:
        return health_line(OriginHealth("o1", healthy, 0, detail, 0.0), fall=2)

    assert line(True, "") == "origin o1 is healthy"
    assert line(False, "probe answered 503") == "origin o1 is unhealthy (probe answered 503)"
    assert line(False, "") == "origin o1 is unhealthy"
    # A new origin's first probe failed: healthy still, but not "healthy (probe failed)".
    assert line(True, "probe failed: ClientConnectorCertificateError") == (
        "origin o1 is healthy until 2 probes in a row fail"
        " (the last: probe failed: ClientConnectorCertificateError)"
    )


class Turns:
    """Counts the event loop's turns: a callback that schedules itself again."""

    def __init__(self) -> None:
        self.now = 0
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.now += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


async def test_a_rounds_probes_start_a_few_a_turn_of_the_loop_and_all_run_at_once(
    session: aiohttp.ClientSession,
) -> None:
    """Started all in one turn, 300 origins' probes held the leader's loop
    0.1 to 0.7 s a round on a busy machine: its election unanswered. Each
    still starts before any ends, so one slow origin delays none."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    count = 3 * PROBES_A_TURN + 5
    catalog = await make_catalog(
        *(Origin(f"o{i}", url, "eu-west", ("llama-3",)) for i in range(count))
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    turns = Turns()
    started: dict[str, int] = {}
    all_started = asyncio.Event()

    async def probed(session: aiohttp.ClientSession, origin: Origin) -> None:
        started[origin.name] = turns.now
        if len(started) == count:
            all_started.set()
        await all_started.wait()  # none ends before the last starts

    prober._probe = probed  # type: ignore[method-assign]
    try:
        await probe(prober, session)
    finally:
        turns.stop()
    assert len(started) == count
    per_turn = collections.Counter(started.values())
    assert max(per_turn.values()) == PROBES_A_TURN
    assert len(per_turn) == 4


async def test_a_round_cancelled_while_its_probes_start_ends_after_those_started(
    session: aiohttp.ClientSession,
) -> None:
    """A term ending (its round cancelled) while the round still starts its
    probes: the round ends once those started have unwound, as it does when
    cancelled once all have started (gather), not before them with the
    session they use then closed by the caller; a probe's own error does not
    stand in for the cancellation."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    count = 2 * PROBES_A_TURN
    catalog = await make_catalog(
        *(Origin(f"o{i}", url, "eu-west", ("llama-3",)) for i in range(count))
    )
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    started: list[str] = []
    unwound: list[str] = []
    round_: asyncio.Task[None] | None = None

    async def probed(session: aiohttp.ClientSession, origin: Origin) -> None:
        started.append(origin.name)
        if len(started) == 1:
            raise RuntimeError("a probe's own defect")
        if len(started) == 2:
            assert round_ is not None
            round_.cancel()  # the term ends before the next turn's probes start
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # unwinding takes turns, as a request's does
            unwound.append(origin.name)

    prober._probe = probed  # type: ignore[method-assign]
    round_ = asyncio.create_task(prober.probe_all(session))
    with pytest.raises(asyncio.CancelledError):
        await round_
    assert len(started) == PROBES_A_TURN  # the next turn's never started
    assert sorted(unwound) == sorted(started[1:])
