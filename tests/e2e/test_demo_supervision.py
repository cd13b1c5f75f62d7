"""A demo that survives its parts, with real processes.

The first test runs `ponto-demo` as a user does (etcd, control plane, three
origins, two proxies, and with redis-server a third proxy and the regions' caches,
in a process of its own) and reads its console: run the curl lines it prints for
users in three places and see three regions answer, and its regional-cache lines
and see the second us-east proxy answer from the region's cache,
run the line it prints to add a proxy of one's own and see it answer,
kill an origin, watch failover, see it come back. The second runs the demo's supervisor
over a small fleet: kills the members that hold state, and keeps a member from
starting until its port is free.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ponto.demo import redis_available, supervise
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from tests.unit.test_demo_ports import free_block

pytestmark = pytest.mark.e2e

CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
NO_CACHE = {"cache-control": "no-cache"}  # every call must reach an origin


@dataclass
class Demo:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first console line from now on that matches `pattern`."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r}; the demo said:\n" + "\n".join(self.seen)
                ) from None
            self.seen.append(line)
            if found := re.search(pattern, line):
                return found


@dataclass(frozen=True)
class Started:
    demo: Demo
    port_base: int


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Started]:
    """`ponto-demo --port-base` a free block, with its temp dirs under
    tmp_path, in a process group of its own."""
    base = free_block()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ponto.demo", "--port-base", str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        start_new_session=True,  # so a failed test can end the whole tree
    )
    demo = Demo(proc)
    try:
        yield Started(demo, base)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        assert proc.stdout is not None and demo.reader is not None
        demo.reader.join(10)  # it ends at the pipe's end, before the pipe is closed
        proc.stdout.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group(pgid: int) -> set[int]:
    """The live processes of a process group (the demo's children stay in it)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(int(entry.name)) == pgid:
                    found.add(int(entry.name))
    return found


def chat(proxy: str) -> httpx.Response:
    r = httpx.post(f"http://{proxy}/v1/chat/completions", json=CHAT, headers=NO_CACHE, timeout=10)
    assert r.status_code == 200, (r.status_code, r.text)
    return r


def read_banner(demo: Demo) -> tuple[dict[str, tuple[str, int]], Path]:
    """{name: (host:port, pid)} of every process the banner lists, and the demo's dir."""
    members: dict[str, tuple[str, int]] = {}
    while True:
        line = demo.expect(r"^  (?:proxy|origin|control plane|etcd) |^Logs are in ").string
        if logs := re.match(r"^Logs are in (\S+) \(removed on exit", line):
            return members, Path(logs.group(1))
        name, address, pid = re.findall(r"(\S+)\s+(\S+)(?: \(gRPC\))?\s+pid (\d+)$", line)[0]
        members[name] = (address.removeprefix("http://").removesuffix("/v1"), int(pid))


def geo_lines(demo: Demo) -> dict[str, str]:
    """{place: curl line} of the banner's "as a user in" calls."""
    lines: dict[str, str] = {}
    for comment, line in itertools.pairwise(demo.seen):
        if (user := re.match(r"^  # a user in (\w+) ", comment)) and "curl " in line:
            lines[user[1]] = line.strip()
    return lines


def cache_lines(demo: Demo) -> list[tuple[str, str]]:
    """[(proxy, curl line)] of the banner's regional-cache calls, in order."""
    lines = []
    for comment, line in itertools.pairwise(demo.seen):
        if (ask := re.match(r"^  # (?:ask|then) (proxy-\S+):", comment)) and "curl " in line:
            lines.append((ask[1], line.strip()))
    return lines


def own_proxy_line(demo: Demo) -> str:
    """The banner's command that adds a proxy of one's own: the first command
    line after its introduction."""
    intro = next(
        i for i, line in enumerate(demo.seen) if line.startswith("Add a proxy of your own")
    )
    return next(line.strip() for line in demo.seen[intro:] if " --control-plane " in line)


def run_own_proxy(line: str) -> None:
    """Run the banner's add-a-proxy line as a user pastes it, see it answer as
    a proxy of its region, and stop it with Ctrl-C."""
    port = int(re.findall(r"--listen 127\.0\.0\.1:(\d+)", line)[0])
    # A process group of its own: Ctrl-C reaches the proxy, not only bash.
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {line}"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT,
                               headers=NO_CACHE, timeout=10)  # fmt: skip
                if r.status_code == 200:
                    break
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the added proxy never answered"
            time.sleep(0.2)
        assert r.headers["x-ponto-region"] == "us-east"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def run_line(line: str) -> str:
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {line}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()


def test_a_killed_origin_fails_over_comes_back_on_its_address_and_the_demo_stays_up(
    started: Started, tmp_path: Path
) -> None:
    demo = started.demo
    members, workdir = read_banner(demo)
    assert workdir.parent == tmp_path
    # Where --port-base put them (trial 33: the demo's ports could not be moved).
    base = started.port_base
    assert members["proxy-us-east"][0] == f"127.0.0.1:{base}"
    assert members["proxy-eu-west"][0] == f"127.0.0.1:{base + 1}"
    assert members["control-1"][0] == f"127.0.0.1:{base + 3}"
    # Each proxy's state and /metrics are on its metrics port, which the
    # banner names under it (the public port's /healthz says only "ok").
    row = demo.seen.index(next(line for line in demo.seen if "proxy  proxy-us-east " in line))
    metrics = re.findall(r"its /healthz and /metrics\s+(\S+)\s+pid ", demo.seen[row + 1])[0]
    assert httpx.get(f"{metrics}/healthz", timeout=10).json()["route_table_version"] > 0
    assert "ponto_route_table_version" in httpx.get(f"{metrics}/metrics", timeout=10).text
    # The lines printed for users in three places, run as a user pastes them.
    lines = geo_lines(demo)
    assert list(lines) == ["Tokyo", "Frankfurt", "Virginia"], demo.seen
    regions = {
        place: subprocess.run(
            ["bash", "-c", f"set -o pipefail; {line}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        for place, line in lines.items()
    }
    assert regions == {
        "Tokyo": "x-ponto-region: ap-southeast",
        "Frankfurt": "x-ponto-region: eu-west",
        "Virginia": "x-ponto-region: us-east",
    }
    # The regional cache's lines: a question asked of one us-east proxy, then of
    # the other, comes back from the region's Redis (the second line is pasted a
    # moment after the first, as a user would).
    if redis_available():
        calls = cache_lines(demo)
        assert [proxy for proxy, _ in calls] == ["proxy-us-east", "proxy-us-east-2"], demo.seen
        assert run_line(calls[0][1]).lower() == "x-ponto-cache: miss"
        time.sleep(0.5)
        assert set(run_line(calls[1][1]).lower().splitlines()) == {
            "x-ponto-cache: hit",
            "x-ponto-cache-tier: region",
        }
    else:
        assert [line for line in demo.seen if line.startswith("redis-server not found")]
    assert {"proxy-us-east", "origin-us-east", "control-1", "etcd"} <= members.keys()
    own = own_proxy_line(demo)
    assert f"--listen 127.0.0.1:{base + 5} " in own, own  # trial 35: it was 8099
    run_own_proxy(own)
    origin, origin_pid = members["origin-us-east"]
    proxy = members["proxy-us-east"][0]
    assert chat(proxy).headers["x-ponto-origin"] == "origin-us-east"

    os.kill(origin_pid, signal.SIGKILL)
    # The origin is gone and not yet back (that takes its 0.5 s delay at least):
    # the proxy answers from the next region.
    r = chat(proxy)
    assert (r.headers["x-ponto-origin"], r.headers["x-ponto-region"]) == (
        "origin-eu-west",
        "eu-west",
    )

    demo.expect(rf"^\S+ origin-us-east \(pid {origin_pid}\) killed by SIGKILL; restarting it in")
    back = int(demo.expect(r"^\S+ origin-us-east is back \(pid (\d+)\)").group(1))
    assert back != origin_pid and alive(back)
    # The same address, served by the new process.
    assert httpx.get(f"http://{origin}/v1/models", timeout=5).status_code == 200
    # The proxy goes back to its own region's origin once health says so.
    deadline = time.monotonic() + 30
    while chat(proxy).headers["x-ponto-origin"] != "origin-us-east":
        assert time.monotonic() < deadline, "proxy-us-east never went back to origin-us-east"
        time.sleep(0.1)
    assert demo.proc.poll() is None, "the demo stopped"

    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(30) == 0
    demo.expect(r"^stopping")
    assert group(demo.proc.pid) == set()
    assert not [pid for _, pid in members.values() if alive(pid)]
    assert not alive(back)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_start_up_leaves_no_process_and_no_temp_dir(
    started: Started, tmp_path: Path
) -> None:
    demo = started.demo
    demo.expect(r"^Starting")
    deadline = time.monotonic() + 30
    while len(group(demo.proc.pid)) < 3:  # the demo, etcd and the control plane so far
        assert time.monotonic() < deadline, "nothing started"
        time.sleep(0.05)
    demo.proc.send_signal(signal.SIGTERM)
    # 130 when the signal lands during start-up, as it does unless the machine
    # is so slow that the start-up finished first; then the demo stops with 0.
    assert demo.proc.wait(30) in (0, 130)
    demo.expect(r"stopping")
    assert group(demo.proc.pid) == set()
    assert list(tmp_path.iterdir()) == []


def test_etcd_control_plane_and_proxy_come_back_with_their_addresses_and_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's supervisor over a small secured fleet: its stateful members,
    killed together, restart where they were, with the data they had."""
    with Fleet(tmp_path) as fleet:
        fleet.secure()
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("us-east", 38.9, -77.4))
        fleet.start_origin("o-us", "us-east")
        fleet.add_origin("o-us", "us-east", fleet.origin_url("o-us"))
        version = fleet.table_version(origins=1)
        fleet.start_proxy("p-us", "us-east")
        fleet.wait_proxies_at(version)
        supervisor = supervise(fleet)
        before = {name: (m.address, m.pid) for name, m in fleet.members().items()}
        for name in ("etcd", "control-1", "p-us"):  # as a user's kill -9 does
            os.kill(fleet.members()[name].pid, signal.SIGKILL)
        for name in ("etcd", "control-1", "p-us"):
            fleet.members()[name].proc.wait(timeout=10)

        deadline = time.monotonic() + 60
        while any(not fleet.members()[n].alive() for n in ("etcd", "control-1", "p-us")):
            assert time.monotonic() < deadline, capsys.readouterr().out
            supervisor.poll()
            time.sleep(0.1)

        after = {name: (m.address, m.pid) for name, m in fleet.members().items()}
        for name in ("control-1", "p-us"):
            assert after[name][0] == before[name][0] and after[name][1] != before[name][1]
        assert after["o-us"] == before["o-us"], "a live member was restarted"
        out = capsys.readouterr().out
        assert f"etcd (pid {before['etcd'][1]}) killed by SIGKILL" in out
        assert f"p-us is back (pid {after['p-us'][1]})" in out
        # etcd kept its data: the region and origin written before are still there.
        regions = fleet.admin().ListRegions(apb.ListRequest(), timeout=10).regions
        assert [r.name for r in regions] == ["us-east"]
        # The proxy serves and reconnects to the restarted control plane.
        r = httpx.post(fleet.proxy_url("p-us") + "/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200 and r.headers["x-ponto-origin"] == "o-us"
        while not fleet.proxy_status("p-us")["control_plane_connected"]:
            assert time.monotonic() < deadline, "the proxy never reconnected"
            time.sleep(0.1)


def test_a_member_that_cannot_start_is_retried_until_it_can(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its port taken by someone else, the origin fails to start; the supervisor
    says so, tries again later, and brings it back once the port is free."""
    with Fleet(tmp_path) as fleet:
        fleet.start_origin("o-us", "us-east")
        supervisor = supervise(fleet)
        host, port = fleet.origins["o-us"].address.rsplit(":", 1)
        fleet.origins["o-us"].kill()
        with socket.create_server((host, int(port))):
            deadline = time.monotonic() + 30
            while "o-us did not start again" not in (out := capsys.readouterr().out):
                assert time.monotonic() < deadline, out
                supervisor.poll()
                time.sleep(0.1)
        assert "next try in 1 s" in out
        while not fleet.origins["o-us"].alive():
            assert time.monotonic() < deadline, capsys.readouterr().out
            supervisor.poll()
            time.sleep(0.1)
        assert fleet.origins["o-us"].address == f"{host}:{port}"
        r = httpx.get(fleet.origin_url("o-us") + "/models", timeout=5)
        assert r.status_code == 200
