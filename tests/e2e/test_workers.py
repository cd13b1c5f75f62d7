"""`ponto-proxy --workers 2` as real processes against a real control plane.

One fleet per module: etcd, a control plane, an origin, and a proxy group `p` of
two workers. Tests that stop or kill a group start their own. Every wait polls
a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ponto.devenv import Managed, free_port
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb

pytestmark = pytest.mark.e2e

T = TypeVar("T")
CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def until(what: str, check: Callable[[], T | None], timeout: float = 20.0) -> T:
    """check()'s first truthy value, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o-us", "us-east")
        f.add_origin("o-us", "us-east", f.origin_url("o-us"))
        version = f.table_version(origins=1)
        f.start_proxy("p", "us-east", workers=2)
        f.wait_proxies_at(version)
        yield f


def workers_of(group: Managed) -> dict[int, int]:
    """Worker index -> pid of the group's live workers (children of its supervisor)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == group.proc.pid and b"--worker-index" in argv:
            found[int(argv[argv.index(b"--worker-index") + 1])] = int(entry.name)
    return found


def both_workers(group: Managed, not_pid: int = 0) -> dict[int, int] | None:
    """Both workers' pids, once both run (and worker 1 is not `not_pid`)."""
    found = workers_of(group)
    return found if len(found) == 2 and found[1] != not_pid else None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def workers_gone(fleet: Fleet, name: str) -> bool:
    return not {f"{name}-w0", f"{name}-w1"} & registered(fleet)


def holds_stop_signals(pid: int) -> bool:
    """Whether the process blocks SIGTERM (its SigBlk mask in /proc): a
    proxy's first line does (dataplane.stopsignals), so from then on a stop
    signal waits for its handlers. Before it, the interpreter itself is still
    starting, which a loaded machine makes last longer than any fixed sleep."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    blocked = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(blocked.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def registered(fleet: Fleet) -> set[str]:
    return {p.info.name for p in fleet.admin().ListProxies(apb.ListRequest(), timeout=5).proxies}


def scrape(address: str) -> tuple[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]:
    """The answering worker and the samples of one scrape over a fresh connection
    to `address`, the group's metrics port (--metrics-listen)."""
    r = httpx.get(f"http://{address}/metrics", timeout=10)
    assert r.status_code == 200
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return r.headers["x-ponto-worker"], samples


def served_by(samples: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
    """Chat completions answered, by worker."""
    out: dict[str, float] = {}
    for labels, value in samples.get("ponto_requests_total", {}).items():
        d = dict(labels)
        if d["endpoint"] == "chat.completions" and d["code"] == "200":
            out[d["worker"]] = value
    return out


def test_each_worker_is_its_own_proxy(fleet: Fleet) -> None:
    until("both workers registered", lambda: registered(fleet) == {"p-w0", "p-w1"})
    version = fleet.table_version(origins=1)

    def converged() -> bool:
        # The same table on both, that one or a later one (a probe's result
        # may publish another before they ack: CI once waited 20 s for it).
        listed = fleet.admin().ListProxies(apb.ListRequest(), timeout=5).proxies
        acked = {p.acked_version for p in listed}
        return len(listed) == 2 and len(acked) == 1 and min(acked) >= version

    until("both workers acked the table", converged)
    # Each keeps its own last good table.
    state = fleet.workdir / "p-state"
    until("per-worker saved tables", lambda: all((state / w).is_dir() for w in ("w0", "w1")))


def test_requests_are_served_by_both_workers(fleet: Fleet) -> None:
    group = fleet.proxies["p"]
    for _ in range(100):
        # A new client per request: a new connection, which the kernel may give
        # to either worker.
        r = httpx.post(f"http://{group.address}/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200, r.text
        by_worker = served_by(scrape(fleet.metrics_addresses[group.name])[1])
        if len(by_worker) == 2:
            break
    assert set(by_worker) == {"0", "1"}, by_worker


def test_metrics_from_any_worker_show_both_workers(fleet: Fleet) -> None:
    group = fleet.proxies["p"]
    answered: set[str] = set()
    for _ in range(60):
        worker, samples = scrape(fleet.metrics_addresses[group.name])
        answered.add(worker)
        versions = samples["ponto_route_table_version"]
        assert {dict(labels)["worker"] for labels in versions} == {"0", "1"}
        assert set(samples["ponto_worker_up"].values()) == {1.0}
        if answered == {"0", "1"}:
            break
    assert answered == {"0", "1"}
    # Readiness and liveness answer on the shared port too.
    assert httpx.get(f"http://{group.address}/readyz", timeout=10).status_code == 200
    assert httpx.get(f"http://{group.address}/healthz", timeout=10).json()["status"] == "ok"


def test_metrics_on_their_own_port_show_both_workers_and_no_key_ids(fleet: Fleet) -> None:
    metrics_address = f"127.0.0.1:{free_port()}"
    flags = ["--metrics-listen", metrics_address, "--metrics-key-labels", "off"]
    group = fleet.start_proxy("m", "us-east", workers=2, extra=flags)
    until("m's workers registered", lambda: {"m-w0", "m-w1"} <= registered(fleet))
    # The public port does not serve /metrics: an OpenAI-style 404.
    public = httpx.get(f"http://{group.address}/metrics", timeout=10)
    assert public.status_code == 404
    assert public.json()["error"]["code"] == "not_found"
    for _ in range(4):
        reply = httpx.post(f"http://{group.address}/v1/chat/completions", json=CHAT, timeout=10)
        assert reply.status_code == 200
    answered: set[str] = set()
    for _ in range(60):
        worker, samples = scrape(metrics_address)
        answered.add(worker)
        assert set(samples["ponto_worker_up"].values()) == {1.0}
        versions = samples["ponto_route_table_version"]
        assert {dict(labels)["worker"] for labels in versions} == {"0", "1"}
        tenants = samples["ponto_tenant_requests_total"]
        assert sum(tenants.values()) == 4
        assert all("key" not in dict(labels) for labels in tenants)
        if answered == {"0", "1"}:
            break
    assert answered == {"0", "1"}
    assert group.stop(signal.SIGTERM, timeout=20) == 0


def test_a_killed_worker_is_restarted(fleet: Fleet) -> None:
    group = fleet.proxies["p"]
    before = until("two workers", lambda: both_workers(group))
    os.kill(before[1], signal.SIGKILL)
    after = until("worker 1 restarted", lambda: both_workers(group, not_pid=before[1]))
    assert after[0] == before[0], "the other worker was left alone"

    def back() -> bool:
        _, samples = scrape(fleet.metrics_addresses[group.name])
        return samples["ponto_worker_up"].get((("worker", "1"),)) == 1.0

    until("worker 1 serving its metrics again", back)
    until("worker 1 registered again", lambda: registered(fleet) == {"p-w0", "p-w1"})
    assert "worker 1 (pid" in group.log_tail(200) and "restarting it in" in group.log_tail(200)
    assert group.alive()


def test_a_stuck_worker_is_killed_and_started_again(fleet: Fleet) -> None:
    """Trial 53: a worker whose event loop is stuck (here: stopped) kept its
    part of the port, and the kubelet's /healthz, answered by any worker,
    seldom saw it. Its supervisor asks it directly."""
    group = fleet.start_proxy("h", "us-east", workers=2, extra=["--worker-hang-timeout", "5"])
    before = until("two workers", lambda: both_workers(group))
    os.kill(before[1], signal.SIGSTOP)
    try:
        after = until("worker 1 replaced", lambda: both_workers(group, not_pid=before[1]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before[1], signal.SIGCONT)
    assert after[0] == before[0], "the worker that answered was left alone"
    log = group.log_tail(200)
    assert f"worker 1 (pid {before[1]}) has answered nothing on its private socket" in log
    assert f"worker 1 (pid {before[1]}) was killed by SIGKILL; restarting it" in log
    assert group.stop(signal.SIGTERM, timeout=20) == 0


def test_sigterm_stops_the_group_cleanly(fleet: Fleet) -> None:
    group = fleet.start_proxy("q", "us-east", workers=2, extra=["--drain-seconds", "0.5"])
    until("q's workers registered", lambda: {"q-w0", "q-w1"} <= registered(fleet))
    pids = until("two workers", lambda: both_workers(group))
    # Within its --drain-seconds: the stop's timeout is far below the default drain's.
    assert group.stop(signal.SIGTERM, timeout=20) == 0
    assert not any(alive(pid) for pid in pids.values())
    until(
        "q's workers gone from the control plane", lambda: not {"q-w0", "q-w1"} & registered(fleet)
    )
    assert "all 2 workers have exited" in group.log_tail()


@pytest.mark.parametrize("at_once", [True, False], ids=["before-exec", "workers-starting"])
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_group_stopped_while_it_starts_exits_cleanly(
    fleet: Fleet, how: signal.Signals, at_once: bool
) -> None:
    """A rollout's SIGTERM, or a Ctrl-C (SIGINT to the supervisor and every
    worker, as a terminal sends it), while `ponto-proxy` still imports and
    checks its flags (before its exec of the supervisor), or while the
    workers do: the group stops with 0, with no traceback, and leaves no
    proxy behind."""
    # Whether the signal came early enough is judged after it is sent (a
    # process not yet the supervisor, a group not yet listening), never by a
    # fixed wait: a loaded machine may not run this test in the window, and
    # a try that missed it is tried again (each must stop cleanly all the same).
    for attempt in range(3):
        name = f"early-{how.name[3:].lower()}-{'a' if at_once else 'w'}{attempt}"
        group = fleet.start_proxy(name, "us-east", workers=2, wait=False)
        pids: dict[int, int] = {}
        if not at_once:
            pids = until("two workers started", partial(both_workers, group), timeout=30)
        else:
            until("it holds its stop signals", partial(holds_stop_signals, group.proc.pid))
        targets = [group.proc.pid, *pids.values()] if how == signal.SIGINT else [group.proc.pid]
        for pid in targets:
            os.kill(pid, how)
        if at_once:
            # Not the supervisor yet: the proxy's own imports take ~0.5 s.
            argv = Path(f"/proc/{group.proc.pid}/cmdline").read_bytes().split(b"\0")
            early = b"dataplane.supervisor" not in argv
        else:
            # Still starting: the group has not said it listens (its imports take ~1 s).
            early = not (fleet.workdir / f"{name}.addr").exists()
        assert group.proc.wait(60) == 0, group.log_tail(50)
        assert not any(alive(pid) for pid in pids.values())
        log = group.log_tail(400)
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert "while stopping" not in log, log
        until(
            f"{name}'s workers gone from the control plane",
            partial(workers_gone, fleet, name),
        )
        if early:
            return
    pytest.fail("the signal never came while the group started, in 3 tries")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_single_proxy_stopped_while_it_imports_exits_cleanly(
    fleet: Fleet, how: signal.Signals
) -> None:
    """`--workers 1` holds the signals from its first line too: stopped in
    its imports, it starts, stops at once, and exits 0 with no traceback."""
    name = f"early-one-{how.name[3:].lower()}"
    proxy = fleet.start_proxy(name, "us-east", wait=False)
    until("the proxy holds its stop signals", lambda: holds_stop_signals(proxy.proc.pid) or None)
    os.kill(proxy.proc.pid, how)
    assert proxy.proc.wait(60) == 0, proxy.log_tail(50)
    log = proxy.log_tail(400)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    until(f"{name} gone from the control plane", lambda: name not in registered(fleet))


def test_workers_stop_when_the_supervisor_is_killed(fleet: Fleet) -> None:
    group = fleet.start_proxy("r", "us-east", workers=2)
    pids = until("two workers", lambda: both_workers(group))
    argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
    run_dir = Path(argv[argv.index(b"--run-dir") + 1].decode())
    group.kill()
    until("orphaned workers stopped", lambda: not any(alive(pid) for pid in pids.values()))
    assert "the supervisor is gone; stopping" in group.log_tail()
    # A killed supervisor cannot remove the group's run directory.
    assert run_dir.is_dir()
    shutil.rmtree(run_dir)


def test_the_supervisor_holds_none_of_the_proxys_libraries(fleet: Fleet) -> None:
    """It checked the flags as a proxy (aiohttp, gRPC...), then replaced itself
    (same pid) with a supervisor of the standard library alone: their memory
    is not held once per pod for a process that serves nothing."""
    group = fleet.proxies["p"]
    until("two workers", lambda: both_workers(group))
    pid = group.proc.pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[1:3] == [b"-m", b"dataplane.supervisor"]
    mapped = Path(f"/proc/{pid}/maps").read_text()
    for library in ("cygrpc", "_http_parser", "uvloop", "_multidict"):
        assert library not in mapped, library
    # Its workers do hold them: the check above is not vacuous.
    worker = both_workers(group)
    assert worker is not None
    assert "cygrpc" in Path(f"/proc/{worker[0]}/maps").read_text()


# Two worker groups start and two workers start again, each a fresh
# interpreter: beside a loaded run (load average near 20) that took a minute
# in all, and with the module's fleet to start first, more than pytest's 120 s.
@pytest.mark.timeout(240)
def test_sighup_restarts_the_workers_and_refuses_no_request(fleet: Fleet) -> None:
    """A reload (certificates, the GeoIP database or the code changed on disk):
    each worker is started anew beside the old one, which leaves once its
    successor listens. A client sending all along gets every answer; a
    request in flight on a worker that leaves is answered; the control plane
    sees the same two proxies."""
    group = fleet.start_proxy(
        "h", "us-east", workers=2, extra=["--forward-headers", "x-sim-hold,x-sim-mark"]
    )
    until("h's workers registered", lambda: {"h-w0", "h-w1"} <= registered(fleet))
    before = until("two workers", lambda: both_workers(group))
    url = f"http://{group.address}/v1/chat/completions"
    results: list[object] = []
    in_flight: list[object] = []
    done = threading.Event()

    # The slow request is held by the origin until the test has seen what it
    # waits for (a delay would be outlasted by workers slow to start on a
    # loaded machine, and the old worker gone before any scrape saw it).
    origin = f"http://{fleet.origins['o-us'].address}/sim"
    held = {"x-sim-hold": "sighup-slow", "x-sim-mark": "sighup-slow"}

    def release() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{origin}/release", params={"name": "sighup-slow"}, timeout=10)

    def slow() -> None:
        r = httpx.post(url, json=CHAT, headers=held, timeout=120)
        in_flight.append(r.status_code)

    def steady() -> None:
        # One pooled client, as the openai SDK keeps one: its kept-alive
        # connection to a leaving worker closes after an answer, and its next
        # request opens one to a worker that listens.
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                try:
                    results.append(client.post(url, json=CHAT).status_code)
                except httpx.HTTPError as exc:
                    results.append(repr(exc))

    # The processes whose series scrapes show under a `pid` label (trial 50:
    # what an old worker counted after its successor took over was in none).
    pids_seen: set[str] = set()

    def scrapes() -> None:
        while not done.is_set():
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                requests = scrape(fleet.metrics_addresses[group.name])[1].get(
                    "ponto_requests_total", {}
                )
                pids_seen.update(dict(labels).get("pid", "") for labels in requests)
            time.sleep(0.1)

    old = {str(pid) for pid in before.values()}
    threads = [threading.Thread(target=f) for f in (slow, steady, scrapes)]
    for t in threads:
        t.start()
    try:
        until("requests flowing", lambda: len(results) >= 5)
        # At the origin, so an old worker holds it.
        marks = partial(httpx.get, f"{origin}/marks", timeout=10)
        until("the slow request at the origin", lambda: "sighup-slow" in marks().json()["marks"])
        os.kill(group.proc.pid, signal.SIGHUP)

        def replaced() -> dict[int, int] | None:
            now = workers_of(group)
            fresh = len(now) == 2 and not set(now.values()) & set(before.values())
            return now if fresh else None

        until("both workers replaced", replaced, timeout=60)
        until("an old worker scraped", lambda: any(p in pids_seen for p in old), timeout=30)
        release()
        until("the old workers gone", lambda: not any(alive(p) for p in before.values()), 60)
        count = len(results)
        until("requests flowing after the reload", lambda: len(results) >= count + 5)
    finally:
        release()
        done.set()
        for t in threads:
            t.join(60)
    assert in_flight == [200]
    # An old worker finishing its requests was scraped, as series of its own.
    assert old & pids_seen, pids_seen
    refused = [r for r in results if r != 200]
    assert not refused, refused[:5]
    assert registered(fleet) >= {"h-w0", "h-w1"}
    log = group.log_tail(400)
    assert "reload done: 2 workers" in log, log
    assert "Traceback" not in log, log
    assert group.stop(signal.SIGTERM, timeout=30) == 0


def test_sighup_to_a_single_proxy_is_said_and_changes_nothing(fleet: Fleet) -> None:
    proxy = fleet.start_proxy("hup-one", "us-east")
    proxy.proc.send_signal(signal.SIGHUP)
    until("the SIGHUP logged", lambda: "SIGHUP ignored" in proxy.log_tail())
    r = httpx.post(f"http://{proxy.address}/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200
    assert proxy.alive()
    assert proxy.stop(signal.SIGTERM, timeout=30) == 0
