"""Per-origin probes: servers other than vLLM behind the real probe loop.

One control plane replica (the leader) over the session etcd probes in-process
HTTP servers on loopback that answer as Ollama (no /health; 200 at /), a
LiteLLM-like server behind a key (401 at /health) and a hosted API (401 at
every path) do (trial 66). What it decides is read from the route table it
publishes: what the proxies would route by.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.app import ControlPlane
from controlplane.model import Origin, Region
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from ponto.v1 import routing_pb2 as pb
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration

WAIT = 10.0  # generous: a shared 2-core machine, etcd on loopback
MODEL = "llama3"


@dataclass
class FakeServer:
    """An origin that answers `answers[path]` (else `otherwise`) and records
    the paths it was asked for."""

    answers: dict[str, int]
    otherwise: int
    hits: list[str] = field(default_factory=list)
    server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        return web.Response(status=self.answers.get(request.path, self.otherwise), text="…")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("/v1"))


def ollama() -> FakeServer:
    # "Ollama is running" at /, its version at /api/version, no /health.
    return FakeServer({"/": 200, "/api/version": 200}, 404)


def keyed() -> FakeServer:
    # LiteLLM with a master key, or any server behind an API gateway: every
    # path but its liveness path wants a key.
    return FakeServer({"/health/liveliness": 200}, 401)


def hosted() -> FakeServer:
    return FakeServer({}, 401)


@dataclass
class Setup:
    plane: ControlPlane
    servers: dict[str, FakeServer]

    def table(self) -> dict[str, pb.Origin]:
        latest = self.plane.publisher.latest
        return {o.name: o for o in latest.table.origins} if latest else {}

    async def until(self, check: Callable[[dict[str, pb.Origin]], bool], what: str) -> None:
        """Wait, polling, until the published table passes `check`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while not check(self.table()):
            if loop.time() > deadline:
                pytest.fail(f"not within {WAIT}s: {what}; table: {self.table()}")
            await asyncio.sleep(0.05)


ORIGINS: dict[str, tuple[Callable[[], FakeServer], dict[str, object]]] = {
    # Ollama at the fleet's default path, then at its own.
    "ollama-default": (ollama, {}),
    "ollama-root": (ollama, {"probe_path": "/"}),
    "ollama-version": (ollama, {"probe_path": "/api/version"}),
    # A server behind a key: at /health with and without a credential, at
    # its unauthenticated liveness path.
    "keyed-with-key": (keyed, {"credential_env": "KEYED_KEY"}),
    "keyed-without-key": (keyed, {}),
    "litellm": (keyed, {"probe_path": "/health/liveliness"}),
    # A hosted API, not probed.
    "hosted": (hosted, {"probe": False, "credential_env": "HOSTED_KEY"}),
}


@pytest.fixture
async def setup(etcd_endpoint: EtcdEndpoint) -> AsyncIterator[Setup]:
    servers = {name: make() for name, (make, _) in ORIGINS.items()}
    urls = {name: await s.start() for name, s in servers.items()}
    settings = parse(
        [
            "--etcd",
            etcd_endpoint.url,
            "--listen",
            "127.0.0.1:0",
            "--id",
            "cp-1",
            "--probe-interval-ms",
            "100",
            "--load-interval-ms",
            "100",
        ]
    )
    store = EtcdStore(settings.etcd)
    await store.connect()
    plane = ControlPlane(settings, store)
    await plane.start()
    try:
        await plane.catalog.put_region(Region("east", 40.7, -74.0), allow_update=False)
        for name, (_, fields) in ORIGINS.items():
            origin = Origin(name, urls[name], "east", (MODEL,), **fields)  # type: ignore[arg-type]
            await plane.catalog.put_origin(origin.validated(), allow_update=False)
        yield Setup(plane, servers)
    finally:
        await plane.stop(grace=0)
        for s in servers.values():
            assert s.server is not None
            await s.server.close()


def probed(table: dict[str, pb.Origin]) -> bool:
    """The probes' verdicts are in the table: the origins they fail are down,
    and the 401 with a key has its detail (every origin starts healthy)."""
    down = ("ollama-default", "keyed-without-key")
    return all(n in table and not table[n].healthy for n in down) and bool(
        "keyed-with-key" in table and table["keyed-with-key"].health_detail
    )


async def test_each_origin_is_probed_at_its_own_path_or_not_at_all(setup: Setup) -> None:
    await setup.until(probed, "the probes' verdicts")
    table = setup.table()

    # Ollama has no /health: at the default path it is down, and the detail
    # says what to do; at / or /api/version it is healthy.
    default = table["ollama-default"]
    assert default.health_detail.startswith(
        "probe answered 404 at /health: set the origin's probe path (pontoctl origin add "
        "--update --probe-path"
    )
    assert "or turn probing off (--probe off)" in default.health_detail
    for name, path in (("ollama-root", "/"), ("ollama-version", "/api/version")):
        assert table[name].healthy and table[name].health_detail == "", name
        assert table[name].probe_path == path
        assert path in setup.servers[name].hits and "/health" not in setup.servers[name].hits

    # A 401 from an origin the proxies send a key to: its server is up.
    with_key = table["keyed-with-key"]
    assert with_key.healthy
    assert with_key.health_detail == (
        "probe answered 401 at /health: up; the probe carries no key, the proxies' requests do"
    )
    # Without a credential the proxies' requests would be refused too.
    without = table["keyed-without-key"]
    assert not without.healthy
    assert without.health_detail.startswith("probe answered 401 at /health: the origin wants a key")
    assert table["litellm"].healthy and table["litellm"].health_detail == ""

    # Not probed: healthy in the table, and never called (neither probes nor
    # load scrapes) while every probed origin was.
    hosted = table["hosted"]
    assert hosted.healthy and hosted.not_probed and hosted.health_detail == ""
    assert setup.servers["hosted"].hits == []
    assert not table["ollama-root"].not_probed


async def test_turning_probing_off_heals_an_origin_the_probes_held_down(setup: Setup) -> None:
    await setup.until(probed, "the probes' verdicts")
    catalog = setup.plane.catalog
    down = next(o for o in await catalog.list_origins() if o.name == "ollama-default")
    await catalog.put_origin(
        Origin(down.name, down.base_url, down.region, down.models, probe=False).validated(),
        allow_update=True,
    )
    await setup.until(
        lambda t: t["ollama-default"].healthy and t["ollama-default"].not_probed,
        "ollama-default healthy and not probed",
    )
    assert setup.table()["ollama-default"].health_detail == ""
    # The leader forgets the failure it stored: turned back on, the origin
    # starts healthy, as a new one does.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not (await catalog.snapshot()).health["ollama-default"].healthy:
        assert loop.time() < deadline, "the stored failure forgotten"
        await asyncio.sleep(0.05)
    # And back on at its own path: probed there.
    hits = len(setup.servers["ollama-default"].hits)
    await catalog.put_origin(
        Origin(down.name, down.base_url, down.region, down.models, probe_path="/").validated(),
        allow_update=True,
    )
    await setup.until(
        lambda t: not t["ollama-default"].not_probed and t["ollama-default"].healthy,
        "ollama-default probed again",
    )
    assert "/" in setup.servers["ollama-default"].hits[hits:]
