"""Proxies take the tables that follow an etcd gone back, without a restart.

A real etcd (its own, so that wiping it leaves the session's alone), one
control plane replica over it and a proxy's own link and table holder. etcd
loses its data (a restore from an old backup is alike: the revision goes
back); the operator applies the configuration again. Before RebasedStore,
the proxy refused every table that followed as older than its own (NACK
"stale table"), until restarted (trial 34, docs/architecture.md Versions).

An etcd that came back empty has lost the fleet id too: the replica makes a
new one, and the proxy refuses its tables (trial 73: it had applied the empty
table and served nothing, then, after `apply -f`, anyone without a key) until
the operator adopts the proxies' fleet id. A restore from a snapshot keeps
the fleet id, and the proxy takes its tables as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.app import ControlPlane
from controlplane.errors import Unavailable
from controlplane.model import Origin, Region, Tenant
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from dataplane.sync.holder import ANOTHER_FLEET, WOULD_OPEN, TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.devenv import Etcd, Managed, find_etcd, free_port, spawn, start_etcd, wait_for_port
from ponto.v1 import routing_pb2 as pb

pytestmark = pytest.mark.integration

WAIT = 20.0  # generous: a shared 2-core machine


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not check():
        if loop.time() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        await asyncio.sleep(0.05)


@dataclass
class Fleet:
    tmp_path: Path
    etcd: Etcd
    port: int
    plane: ControlPlane | None = None
    store: EtcdStore | None = None

    async def start_plane(self) -> ControlPlane:
        argv = ["--etcd", self.etcd.endpoint, "--listen", f"127.0.0.1:{self.port}"]
        settings = parse([*argv, "--id", "cp-1", "--probe-interval-ms", "60000"])
        self.store = EtcdStore(settings.etcd, timeout=2.0)
        await self.store.connect()
        self.plane = ControlPlane(settings, self.store)
        await self.plane.start()
        return self.plane

    async def stop_plane(self) -> None:
        if self.plane is not None:
            await self.plane.stop(grace=0)
            self.plane = None

    def lose_etcd_data(self, backup: Path | None = None) -> None:
        """etcd stopped, its data dir wiped, started again: empty, or restored
        from `backup` (etcdutl, as an SRE does and docs/architecture.md says)."""
        self.etcd.stop()
        shutil.rmtree(self.etcd.data_dir)
        if backup is not None:
            peer = f"http://127.0.0.1:{self.etcd.peer_port}"
            argv = [
                tool("etcdutl"), "snapshot", "restore", str(backup),
                "--data-dir", str(self.etcd.data_dir),
                "--name", "restore", "--initial-cluster", f"restore={peer}",
                "--initial-advertise-peer-urls", peer,
            ]  # fmt: skip
            subprocess.run(argv, check=True, capture_output=True)
        self.etcd = start_etcd(
            self.tmp_path,
            name="restore",
            data_dir=self.etcd.data_dir,
            client_port=self.etcd.client_port,
            peer_port=self.etcd.peer_port,
        )


def tool(name: str) -> str:
    """etcdctl or etcdutl: beside the venv's python (make setup links them)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else shutil.which(name) or name


async def configure(plane: ControlPlane, models: tuple[str, ...]) -> None:
    """What an operator applies: one region, one origin serving `models`."""
    await plane.catalog.put_region(Region("east", 40.7, -74.0), allow_update=True)
    await plane.catalog.put_origin(
        Origin("gpu-1", "http://127.0.0.1:9/v1", "east", models), allow_update=True
    )


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path, start_etcd(tmp_path, name="restore"), free_port())
    try:
        yield fleet
    finally:
        await fleet.stop_plane()
        fleet.etcd.stop()
        shutil.rmtree(fleet.etcd.data_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def proxy(
    port: int, holder: TableHolder | None = None, loads_generation: int = 0, name: str = "p1"
) -> AsyncIterator[tuple[TableHolder, ControlPlaneClient]]:
    """A proxy's link running; `holder` (the table it holds) and the load
    generation it took, a proxy's that connects again."""
    holder = holder or TableHolder("east", None)
    link = ControlPlaneClient(
        holder,
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name=name, region="east", address="127.0.0.1:9", version="test"),
        backoff_min=0.05,
        backoff_max=0.2,
    )
    link.loads_generation = loads_generation
    task = asyncio.create_task(link.run())
    try:
        yield holder, link
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def models_of(holder: TableHolder) -> set[str]:
    return set() if holder.routes is None else set(holder.routes.models)


async def held_high(plane: ControlPlane, holder: TableHolder) -> int:
    """Push etcd's revision well up, then wait for the proxy to hold the table."""
    for i in range(40):
        await plane.store.put(f"/ponto/probe-filler/{i}", b"x")
    await configure(plane, ("m-old", "m-filler"))
    await until(lambda: models_of(holder) == {"m-old", "m-filler"}, "the proxy holds the table")
    assert holder.routes is not None
    return holder.routes.version


async def refused_until_adopted(
    plane: ControlPlane, holder: TableHolder, link: ControlPlaneClient, before: int
) -> None:
    """The configuration applied again to an etcd that came back empty: the
    proxy refuses it as another fleet's, and keeps its table, until the
    operator adopts the fleet id it serves."""
    served, held = holder.fleet_id, models_of(holder)
    assert served
    await configure(plane, ("m-new",))
    await until(lambda: holder.refused.get(ANOTHER_FLEET, 0) > 0, "the new fleet's table refused")
    await until(lambda: plane.fleet.refusing == {"p1": served}, "the replica hears of it")
    assert plane.publisher.latest is not None
    assert plane.publisher.latest.table.fleet_id not in ("", served)
    assert models_of(holder) == held
    assert served in plane.fleet.problem()
    nacks = link.nacks
    assert await plane.catalog.adopt_fleet(served) == plane.publisher.latest.table.fleet_id
    await until(lambda: models_of(holder) == {"m-new"}, "the configuration, adopted")
    assert holder.routes is not None and holder.routes.version > before
    assert holder.fleet_id == served and link.nacks == nacks
    await until(lambda: not plane.fleet.refusing, "the replica hears the proxy took it")
    assert plane.fleet.problem() == ""


async def test_a_replica_running_through_the_loss_numbers_on_from_where_it_was(
    fleet: Fleet,
) -> None:
    plane = await fleet.start_plane()
    async with proxy(fleet.port) as (holder, link):
        before = await held_high(plane, holder)
        served = holder.fleet_id
        fleet.lose_etcd_data()
        # The replica's watches notice etcd went back and raise the base.
        await until(lambda: plane.store.base > 0, "the base raised")
        await until(lambda: plane.fleet.replaced == served, "the replica says the fleet is lost")
        await refused_until_adopted(plane, holder, link, before)


async def test_trial_73_a_closed_fleet_whose_etcd_came_back_empty_stays_served_and_closed(
    fleet: Fleet,
) -> None:
    """kill -9 etcd, its data dir deleted, an empty etcd on the same address
    (a StatefulSet that lost its volume claims). The replica publishes the
    empty state, numbered above the proxy: refused (another fleet), and the
    proxy serves its table and its keys. The runbook: apply the configuration
    (no keys in it), adopt the proxies' fleet id: the table would open the
    proxy, refused; keys made again close it, and the proxy takes it. A proxy
    started meanwhile without a state directory (a new pod) is sent no table
    until then: neither the new fleet's nor the open one."""
    plane = await fleet.start_plane()
    async with proxy(fleet.port) as (holder, link):
        await plane.catalog.put_tenant(Tenant("acme"), allow_update=False)
        await plane.catalog.create_key("acme")
        before = await held_high(plane, holder)
        served = holder.fleet_id
        assert holder.closed
        assert holder.policy is not None and not holder.policy.authenticator.open
        fleet.lose_etcd_data()
        await until(lambda: holder.refused.get(ANOTHER_FLEET, 0) > 0, "the empty table refused")
        assert models_of(holder) == {"m-old", "m-filler"}
        assert holder.policy is not None and not holder.policy.authenticator.open
        assert plane.fleet.replaced == served
        await configure(plane, ("m-new",))
        async with proxy(fleet.port, name="p2") as (new, _):
            await until(lambda: "p2" in plane.fleet.waiting, "the new proxy waits")
            assert new.routes is None
            await plane.catalog.adopt_fleet(served)
            await until(lambda: holder.refused.get(WOULD_OPEN, 0) > 0, "the open table refused")
            assert models_of(holder) == {"m-old", "m-filler"} and holder.closed
            assert new.routes is None and "p2" in plane.fleet.waiting
            await plane.catalog.put_tenant(Tenant("acme"), allow_update=False)
            await plane.catalog.create_key("acme")
            await until(lambda: models_of(new) == {"m-new"}, "the new proxy takes the table")
            assert new.closed and new.fleet_id == served
        await until(lambda: models_of(holder) == {"m-new"}, "the closed table taken")
        assert holder.closed and holder.fleet_id == served
        assert holder.routes is not None and holder.routes.version > before
        await until(lambda: not plane.fleet.refusing, "the replica hears the proxy took it")
        assert not plane.fleet.replaced
        assert link.nacks == sum(holder.refused.values())


async def test_a_replica_started_after_the_loss_learns_from_the_proxies(
    fleet: Fleet,
) -> None:
    """It handed out nothing before: the proxy's first message says what it
    holds (RouteRequest.highest_held), and the replica numbers above it:
    above its table, and above the load pushes it took (the leader writes
    loads every scrape, so their generations run far ahead of tables). The
    table it compiled before, from the empty etcd, is numbered below what the
    proxy holds: it is not pushed (the proxy would refuse it)."""
    plane = await fleet.start_plane()
    async with proxy(fleet.port) as (holder, _):
        before = await held_high(plane, holder)
    await fleet.stop_plane()
    fleet.lose_etcd_data()
    plane = await fleet.start_plane()
    await until(lambda: plane.publisher.latest is not None, "a table of the empty etcd")
    # It never served the fleet the proxy serves: only the proxy's refusal says it.
    assert not plane.fleet.replaced
    async with proxy(fleet.port, holder, loads_generation=before + 5000) as (_, link):
        await refused_until_adopted(plane, holder, link, before)
        assert (await plane.store.list("/ponto/")).revision > before + 5000


async def test_after_a_restore_from_a_snapshot_objects_kept_from_it_can_be_edited(
    fleet: Fleet, tmp_path: Path
) -> None:
    """An SRE's drill: `etcdctl snapshot save`, changes, etcd restored from
    the snapshot under a running replica. The region kept from the snapshot
    is edited (a compare-and-swap on a key read after the raise: before the
    review of 009c829 its new number was one the old base had handed out, and
    every edit of it conflicted for good), and the proxy takes the table."""
    plane = await fleet.start_plane()
    await configure(plane, ("m-kept",))
    # A snapshot of a fleet that served: its first table made the fleet's
    # Responses id key and its fleet id (one taken before holds neither, and
    # its restore is another fleet's).
    await until(lambda: plane.publisher.latest is not None, "the first table")
    backup = tmp_path / "backup.db"
    subprocess.run(
        [tool("etcdctl"), "--endpoints", fleet.etcd.url, "snapshot", "save", str(backup)],
        check=True,
        capture_output=True,
    )
    async with proxy(fleet.port) as (holder, link):
        before = await held_high(plane, holder)
        served = holder.fleet_id
        fleet.lose_etcd_data(backup)
        await until(lambda: plane.store.base > 0, "the base raised")
        await until(lambda: models_of(holder) == {"m-kept"}, "the table of the snapshot")
        [kept] = [r for r in await plane.catalog.list_regions() if r.name == "east"]
        await plane.catalog.put_region(Region("east", 51.5, -0.1), allow_update=True)
        await plane.catalog.put_origin(
            Origin("gpu-1", "http://127.0.0.1:9/v1", "east", ("m-edited",)), allow_update=True
        )
        await until(lambda: models_of(holder) == {"m-edited"}, "the edit reaches the proxy")
        assert holder.routes is not None and holder.routes.version > before
        assert link.nacks == 0
        # The snapshot holds the fleet id: the same fleet, nothing to adopt.
        assert holder.fleet_id == served and not plane.fleet.replaced
        [edited] = [r for r in await plane.catalog.list_regions() if r.name == "east"]
        assert (kept.latitude, edited.latitude) == (40.7, 51.5)


async def test_a_proxy_gone_since_the_snapshot_is_not_listed_again(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 73: a proxy registered when the snapshot was taken, and gone for
    good since. The restore brings its key back under the lease of the
    replica that held it, alive all along, so the key never expired: listed
    by `get proxies` and counted in the fleet's size for as long as the
    replica lived. The replica removes it once it reads its keys back."""
    plane = await fleet.start_plane()
    await configure(plane, ("m-kept",))
    async with proxy(fleet.port) as (holder, _):
        await until(lambda: models_of(holder) == {"m-kept"}, "the proxy holds the table")
        await until_read(lambda: names_are(plane, ["p1"]), "the proxy registered")
        backup = tmp_path / "backup.db"
        subprocess.run(
            [tool("etcdctl"), "--endpoints", fleet.etcd.url, "snapshot", "save", str(backup)],
            check=True,
            capture_output=True,
        )
    await until_read(lambda: names_are(plane, []), "the stopped proxy's registration gone")
    fleet.lose_etcd_data(backup)

    async def checked_and_gone() -> bool:
        # The replica reads its keys back at once if it saw etcd's revision go
        # back, else at its self-check every 30 s: made here meanwhile (a
        # restore only a few writes old may go unseen: docs/operations.md).
        with contextlib.suppress(Unavailable):
            await plane.registry.self_check()
        return await names_are(plane, [])

    await until_read(checked_and_gone, "the restored registration removed")
    said = [r.getMessage() for r in caplog.records if "with no session here" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("proxy p1 was registered under")


async def names_are(plane: ControlPlane, names: list[str]) -> bool:
    """Whether the registered proxies are `names` (False while etcd is away)."""
    try:
        return sorted(await plane.catalog.proxy_names()) == names
    except Unavailable:
        return False


async def until_read(check: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        await asyncio.sleep(0.1)


# ------------------------------------------------------- docs/operations.md, run


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    managed: Managed | None = None

    @property
    def peer(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"


def start_member(member: Member, members: list[Member], workdir: Path) -> None:
    """Start a member with the flags it always starts with (those of a
    bootstrapped cluster: a restored data dir ignores --initial-cluster*)."""
    cluster = ",".join(f"{m.name}={m.peer}" for m in members)
    argv = [
        str(find_etcd()),
        "--name", member.name,
        "--data-dir", str(member.data_dir),
        "--listen-client-urls", member.url,
        "--advertise-client-urls", member.url,
        "--listen-peer-urls", member.peer,
        "--initial-advertise-peer-urls", member.peer,
        "--initial-cluster", cluster,
        "--initial-cluster-token", "ponto-etcd",
        "--heartbeat-interval", "10",
        "--election-timeout", "100",
        "--log-level", "warn",
    ]  # fmt: skip
    member.managed = spawn(member.name, argv, workdir)


async def healthy(endpoints: str, within: float = 30.0) -> None:
    """Until every member of `endpoints` answers `etcdctl endpoint health`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        done = subprocess.run(
            [tool("etcdctl"), "--endpoints", endpoints, "endpoint", "health"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0:
            return
        if loop.time() > deadline:
            pytest.fail(f"etcd not healthy within {within:g} s: {done.stderr.strip()}")
        await asyncio.sleep(0.2)


def etcd_tool(*argv: str) -> str:
    done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)
    return done.stdout


async def test_a_three_member_cluster_restored_by_the_runbook_serves_the_snapshot(
    tmp_path: Path,
) -> None:
    """docs/operations.md's restore, its commands as written, on three
    members on loopback, under a running replica and a proxy: every member
    stopped and gone before its data dir moves, each restored from one
    snapshot with its own name and peer URL, one --initial-cluster and a new
    token. The cluster serves the snapshot (what came after is gone), and
    the replica, whose lease came after the snapshot, registers itself and
    its proxy again (docs/architecture.md)."""
    members = [
        Member(f"m{i}", free_port(), free_port(), tmp_path / f"m{i}.etcd") for i in (1, 2, 3)
    ]
    for member in members:
        start_member(member, members, tmp_path)
    plane: ControlPlane | None = None
    try:
        for member in members:
            assert member.managed is not None
            wait_for_port("127.0.0.1", member.client_port, 20.0, member.managed.proc)
        endpoints = ",".join(m.url for m in members)
        # A listening member is not yet one of a cluster with a leader: the
        # replica started before the first election (a clean-clone run) found
        # each member timing out at once. Healthy first, as an SRE checks.
        await healthy(endpoints)
        port = free_port()
        argv = ["--etcd", endpoints, "--listen", f"127.0.0.1:{port}", "--id", "cp-1"]
        settings = parse([*argv, "--probe-interval-ms", "60000", "--lease-ttl", "3"])
        store = EtcdStore(settings.etcd, timeout=2.0)
        await store.connect()
        plane = ControlPlane(settings, store)
        await plane.start()
        await configure(plane, ("m-kept",))
        # A fleet that served (see test_after_a_restore_from_a_snapshot_...).
        await until(lambda: plane is not None and plane.publisher.latest is not None, "a table")
        backup = tmp_path / "backup.db"
        # Back up, and verify.
        etcd_tool(tool("etcdctl"), "--endpoints", members[0].url, "snapshot", "save", str(backup))
        status = etcd_tool(tool("etcdutl"), "snapshot", "status", str(backup), "-w", "json")
        assert json.loads(status)["totalKey"] > 0
        async with proxy(port) as (holder, _):
            await until(lambda: models_of(holder) == {"m-kept"}, "the proxy holds the table")
            # Written after the snapshot, lost by the restore: a backup is
            # older than the last writes (an hourly one, thousands of writes).
            # One only a few writes old may go unnoticed: the replica's own
            # writes as etcd comes back can carry its revision past the one
            # its watches last saw before they resume (docs/operations.md).
            for i in range(200):
                await plane.store.put(f"/ponto/probe-filler/{i}", b"x")
            await configure(plane, ("m-after",))
            await until(lambda: models_of(holder) == {"m-after"}, "the later table")
            assert holder.routes is not None
            held = holder.routes.version
            # 1. Stop every member and wait until each has exited.
            for member in members:
                assert member.managed is not None
                member.managed.stop()
                assert member.managed.proc.poll() is not None
            # 2. Move each old data dir aside.
            for member in members:
                member.data_dir.rename(member.data_dir.with_suffix(".before-restore"))
            # 3. Restore each from the same snapshot.
            cluster = ",".join(f"{m.name}={m.peer}" for m in members)
            for member in members:
                etcd_tool(
                    tool("etcdutl"), "snapshot", "restore", str(backup),
                    "--name", member.name,
                    "--data-dir", str(member.data_dir),
                    "--initial-cluster", cluster,
                    "--initial-cluster-token", "ponto-etcd-restored",
                    "--initial-advertise-peer-urls", member.peer,
                )  # fmt: skip
            # 4. Start all members.
            for member in members:
                start_member(member, members, tmp_path)
            for member in members:
                assert member.managed is not None
                wait_for_port("127.0.0.1", member.client_port, 20.0, member.managed.proc)
            # Listening is not serving: a member still joining answers
            # unhealthy for a moment (a clean-clone run found 2 of 3). The
            # runbook's SRE waits for all three, as this does.
            await healthy(endpoints)
            # The snapshot's state, served to the proxy; the replica and its
            # proxy registered again under a lease that lives.
            # A table compiled before the replica saw etcd go back may be
            # refused (a NACK: that is how it learns); the one after is not.
            await until(lambda: models_of(holder) == {"m-kept"}, "the table of the snapshot")
            assert holder.routes is not None and holder.routes.version > held

            async def listed() -> bool:
                replicas, _ = await plane.catalog.list_replicas()
                names = await plane.catalog.proxy_names()
                return [r["id"] for r in replicas] == ["cp-1"] and names == ["p1"]

            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while not await listed():
                assert loop.time() < deadline, "the replica and its proxy registered again"
                await asyncio.sleep(0.1)
    finally:
        if plane is not None:
            await plane.stop(grace=0)
        for member in members:
            if member.managed is not None:
                member.managed.stop()
        for member in members:
            shutil.rmtree(member.data_dir, ignore_errors=True)
            shutil.rmtree(member.data_dir.with_suffix(".before-restore"), ignore_errors=True)
