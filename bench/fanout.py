"""Route-table fan-out: one control plane replica, many proxies, time to converge.

    .venv/bin/python -m bench.fanout [--proxies 1000] [--cycles 5] [--quick]

Starts etcd, one control plane replica and one origin simulator as real
processes (ponto.fleet), writes a realistic topology through the Admin API
(10 regions with an RTT matrix, 30 origins, a few models), then connects the
simulated proxies from a separate worker process. Each simulated proxy speaks
the protocol of dataplane/sync/link.py: Register, open RouteStream, ACK every
pushed table by version and nonce (quota-only pushes are not answered). Each
has its own channel and HTTP/2 connection, as real proxies do; all share one
event loop in one worker process by default (a second process on the same
core measured worse: more switching, no more CPU).

Each cycle records t0, calls DrainRegion (drain and undrain alternate) and
every simulated proxy stamps time.time() on the first table whose content has
the new drain state (the content is checked, not just "a new version"). The
propagation of a cycle is that stamp minus t0, over all proxies.

Placement: on a machine with two or more CPUs the control plane and etcd (the
server side) run on core 0; the simulated proxies, this orchestrator and the
origin simulator on core 1. Proxy stamps therefore include the simulated
proxies' own queueing on core 1; their CPU per push is reported so that it can
be told apart.

Control-plane CPU per push is the utime+stime delta over a fixed window after
t0, minus the idle rate measured with every stream connected (keepalives,
health probes); it covers the push and the write of every ACK to etcd.

The whole run is done once per debounce setting (default: the control plane's
defaults, 50/500 ms, and a small 5/50 ms), each on a fresh fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc

from ponto.fleet import Fleet
from ponto.grpcconn import KEEPALIVE_OPTIONS
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from ponto.v1 import routing_pb2_grpc

SERVER_CORE = 0  # control plane and etcd
CLIENT_CORE = 1  # simulated proxies, orchestrator, origin simulator
CONTROL = "control-1"
DEFAULT_OUT = Path("docs/benchmarks/fanout.json")

REGIONS = (
    ("us-east", 38.9, -77.4), ("us-west", 45.8, -119.7), ("ca-central", 45.5, -73.6),
    ("sa-east", -23.5, -46.6), ("eu-west", 53.3, -6.3), ("eu-central", 50.1, 8.7),
    ("me-central", 25.2, 55.3), ("ap-south", 19.1, 72.9), ("ap-southeast", 1.35, 103.8),
    ("ap-northeast", 35.7, 139.7),
)  # fmt: skip
MODELS = ("llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "qwen2.5-32b-instruct",
          "mistral-small-24b", "bge-m3")  # fmt: skip
WATCHED = "eu-west"  # the region the cycles drain and undrain

# Bootstrap token header, for when the control plane checks one (see _metadata).
TOKEN_HEADER = "authorization"


# ---------------------------------------------------------------- connection


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS (mTLS when cert and key are given) channel."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


def _channel(target: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """One proxy's channel. A local subchannel pool gives it its own HTTP/2
    connection, as a real proxy process has; otherwise gRPC would share one
    connection among all channels with equal arguments."""
    options = [
        *KEEPALIVE_OPTIONS,  # as dataplane/sync/link.py
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )
    return grpc.aio.secure_channel(target, creds, options=options)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata for Register and RouteStream (none while insecure)."""
    return ((TOKEN_HEADER, f"Bearer {token}"),) if token else ()


# ---------------------------------------------------------------- worker side


@dataclass(frozen=True)
class WorkerSpec:
    target: str
    names: tuple[tuple[str, str], ...]  # (proxy name, region)
    channels: int  # 0: one per proxy
    watched: str
    cpu: int | None
    tls: TlsFiles | None = None
    token: str | None = None
    connect_concurrency: int = 64
    ack_delay: float = 0.0  # diagnostic: hold each ACK back this long
    ready_timeout: float = 60.0


@dataclass(frozen=True)
class Ready:
    connected: int
    failed: int
    errors: tuple[str, ...]
    quota_pushes: int


@dataclass(frozen=True)
class Wait:
    """Report once every proxy has a table with `drained` received at or after t0."""

    drained: bool
    t0: float
    timeout: float


@dataclass(frozen=True)
class Done:
    latencies: tuple[float | None, ...]  # seconds from t0, None: never arrived
    versions: tuple[int, ...]  # versions of the first matching tables
    tables: int  # tables received since t0, all proxies (coalescing shows here)
    quota_pushes: int  # quota-only pushes received since t0, all proxies
    failed: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Bye:
    errors: tuple[str, ...]


class SimProxy:
    """One simulated proxy: the protocol of dataplane/sync/link.py, no routing work."""

    def __init__(self, index: int, name: str, region: str, watched: str) -> None:
        self.index = index
        self.info = pb.ProxyInfo(
            name=name, region=region, address=f"10.0.{index // 250}.{index % 250}:8080",
            version="bench",
        )  # fmt: skip
        self.watched = watched
        self.receipts: list[tuple[float, int, bool]] = []  # (time.time(), version, drained)
        self.quota_pushes: list[float] = []  # time.time() of pushes without a table
        self.error = ""

    async def run(
        self,
        stub: routing_pb2_grpc.RoutingAsyncStub,
        metadata: tuple[tuple[str, str], ...],
        gate: asyncio.Semaphore,
        on_receipt: Callable[[SimProxy], None],
        ack_delay: float = 0.0,
    ) -> None:
        try:
            async with gate:
                reg = await stub.Register(
                    pb.RegisterRequest(proxy=self.info), metadata=metadata, timeout=30
                )
                call = stub.RouteStream(metadata=metadata)
                # As dataplane/sync/link.py subscribes: it takes `unchanged` shares.
                await call.write(pb.RouteRequest(session_id=reg.session_id, takes_unchanged=True))
            while True:
                update = await call.read()
                now = time.time()
                if not isinstance(update, pb.RouteUpdate):  # grpc.aio.EOF
                    self.error = "stream ended"
                    break
                if not update.HasField("table"):
                    self.quota_pushes.append(now)  # quota shares only: not answered
                    continue
                table = update.table
                drained = any(r.drained for r in table.regions if r.name == self.watched)
                self.receipts.append((now, table.version, drained))
                on_receipt(self)
                if ack_delay:
                    await asyncio.sleep(ack_delay)
                await call.write(
                    pb.RouteRequest(
                        session_id=reg.session_id,
                        version_info=table.version,
                        response_nonce=update.nonce,
                    )
                )
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        finally:
            on_receipt(self)

    def first_match(self, drained: bool, t0: float) -> tuple[float, int] | None:
        for at, version, state in self.receipts:
            if at >= t0 and state == drained:
                return at, version
        return None


def _has_match(drained: bool, t0: float) -> Callable[[SimProxy], bool]:
    return lambda s: s.first_match(drained, t0) is not None


class Tracker:
    """Counts down proxies that have not yet met a predicate; O(1) per receipt."""

    def __init__(self, sims: Sequence[SimProxy]) -> None:
        self._sims = sims
        self._pred: Callable[[SimProxy], bool] = lambda s: True
        self._pending: set[int] = set()
        self.done = asyncio.Event()

    def expect(self, pred: Callable[[SimProxy], bool]) -> None:
        self._pred = pred
        self._pending = {s.index for s in self._sims if not (s.error or pred(s))}
        self.done = asyncio.Event()
        if not self._pending:
            self.done.set()

    def notify(self, sim: SimProxy) -> None:
        if sim.index in self._pending and (sim.error or self._pred(sim)):
            self._pending.discard(sim.index)
            if not self._pending:
                self.done.set()


async def _worker(conn: Connection, spec: WorkerSpec) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[object] = asyncio.Queue()

    def readable() -> None:
        try:
            while conn.poll():
                inbox.put_nowait(conn.recv())
        except (EOFError, OSError):  # the orchestrator is gone
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(Stop())

    loop.add_reader(conn.fileno(), readable)
    n_channels = spec.channels or len(spec.names)
    channels = [_channel(spec.target, spec.tls) for _ in range(n_channels)]
    stubs = [routing_pb2_grpc.RoutingStub(c) for c in channels]
    sims = [SimProxy(i, name, region, spec.watched) for i, (name, region) in enumerate(spec.names)]
    tracker = Tracker(sims)
    tracker.expect(lambda s: bool(s.receipts))
    gate = asyncio.Semaphore(spec.connect_concurrency)
    metadata = _metadata(spec.token)
    tasks = [
        asyncio.create_task(
            s.run(stubs[i % n_channels], metadata, gate, tracker.notify, spec.ack_delay)
        )
        for i, s in enumerate(sims)
    ]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tracker.done.wait(), spec.ready_timeout)
        failed = [s for s in sims if s.error or not s.receipts]
        conn.send(
            Ready(
                connected=len(sims) - len(failed),
                failed=len(failed),
                errors=tuple({s.error for s in failed})[:5],
                quota_pushes=sum(len(s.quota_pushes) for s in sims),
            )
        )
        while True:
            msg = await inbox.get()
            if isinstance(msg, Stop):
                break
            if not isinstance(msg, Wait):
                continue
            drained, t0 = msg.drained, msg.t0
            tracker.expect(_has_match(drained, t0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tracker.done.wait(), msg.timeout)
            matches = [s.first_match(drained, t0) for s in sims]
            conn.send(
                Done(
                    latencies=tuple(m[0] - t0 if m else None for m in matches),
                    versions=tuple(sorted({m[1] for m in matches if m})),
                    tables=sum(1 for s in sims for at, _, _ in s.receipts if at >= t0),
                    quota_pushes=sum(1 for s in sims for at in s.quota_pushes if at >= t0),
                    failed=sum(1 for s in sims if s.error),
                )
            )
    finally:
        loop.remove_reader(conn.fileno())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
        with contextlib.suppress(OSError):
            conn.send(Bye(tuple({s.error for s in sims if s.error})[:5]))


def _worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process (spawned, so nothing is inherited)."""
    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})  # before gRPC starts any thread
    import uvloop  # noqa: PLC0415 - the real proxy runs on uvloop too

    try:
        uvloop.run(_worker(conn, spec))
    finally:
        conn.close()


# ---------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM in MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Set the affinity of every thread of pid (sched_setaffinity is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


# ---------------------------------------------------------------- orchestrator


@dataclass(frozen=True)
class Params:
    proxies: int = 1000
    cycles: int = 5
    workers: int = 1
    channels: int = 0  # per worker; 0: one channel (and connection) per proxy
    debounce: tuple[tuple[int, int], ...] = ((50, 500), (5, 50))  # (quiet ms, max ms)
    origins_per_region: int = 3
    pin: bool = True
    etcd_core: int = SERVER_CORE
    ack_delay: float = 0.0
    window: float = 1.0  # CPU measurement window after t0, seconds
    cycle_timeout: float = 15.0
    tls: TlsFiles | None = None
    token: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "min": round(min(values) * 1e3, 2),
        "p50": round(percentile(values, 0.50) * 1e3, 2),
        "p99": round(percentile(values, 0.99) * 1e3, 2),
        "max": round(max(values) * 1e3, 2),
    }


def _km(a: tuple[str, float, float], b: tuple[str, float, float]) -> float:
    lat1, lon1, lat2, lon2 = map(math.radians, (a[1], a[2], b[1], b[2]))
    h = math.sin((lat2 - lat1) / 2) ** 2 + (
        math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    )
    return 2 * 6371 * math.asin(math.sqrt(h))


def _topology(fleet: Fleet, origins_per_region: int, origin_url: str) -> int:
    """Regions with an RTT matrix, origins with models; returns the origin count."""
    admin = fleet.admin()
    for region in REGIONS:
        # Light in fibre: about 100 km per ms of round trip, plus 5 ms of hops.
        rtt = {o[0]: round(_km(region, o) / 100 + 5, 1) for o in REGIONS if o is not region}
        spec = apb.RegionSpec(name=region[0], latitude=region[1], longitude=region[2], rtt_ms=rtt)
        admin.PutRegion(apb.PutRegionRequest(region=spec, allow_update=True), timeout=10)
    count = 0
    for r, region in enumerate(REGIONS):
        for k in range(origins_per_region):
            models = [MODELS[(r + k + j) % len(MODELS)] for j in range(3)]
            # One simulator answers every origin's health probe: the table is
            # realistic and the leader's probes run as they would.
            origin = apb.OriginSpec(
                name=f"{region[0]}-{k}", base_url=origin_url, region=region[0], models=models,
                weight=100, capacity=64,
            )  # fmt: skip
            admin.PutOrigin(apb.PutOriginRequest(origin=origin, allow_update=True), timeout=10)
            count += 1
    return count


@dataclass
class Workers:
    """Worker processes and their pipes; close() ends them even on errors."""

    procs: list[BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def recv_all(self, timeout: float) -> list[object]:
        deadline = time.monotonic() + timeout
        out: list[object] = []
        for proc, conn in zip(self.procs, self.conns, strict=True):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise RuntimeError(f"worker {proc.pid} exited with {proc.exitcode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {proc.pid} silent for {timeout}s")
            out.append(conn.recv())
        return out

    def send_all(self, msg: object) -> None:
        for conn in self.conns:
            conn.send(msg)

    def close(self) -> list[str]:
        errors: list[str] = []
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(Stop())
        deadline = time.monotonic() + 10
        for proc, conn in zip(self.procs, self.conns, strict=True):
            with contextlib.suppress(OSError, EOFError):
                while conn.poll(max(0.0, deadline - time.monotonic())):
                    msg = conn.recv()
                    if isinstance(msg, Bye):
                        errors.extend(msg.errors)
                        break
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        return errors


def _specs(params: Params, target: str, cpu: int | None) -> list[WorkerSpec]:
    names = [(f"sim-{i:04d}", REGIONS[i % len(REGIONS)][0]) for i in range(params.proxies)]
    n = max(1, min(params.workers, params.proxies))
    return [
        WorkerSpec(
            target=target,
            names=tuple(names[w::n]),
            channels=params.channels,
            watched=WATCHED,
            cpu=cpu,
            tls=params.tls,
            token=params.token,
            ack_delay=params.ack_delay,
        )
        for w in range(n)
    ]


def _list_proxies(fleet: Fleet) -> tuple[int, int, int]:
    """(proxies listed, how many ACKed the current version, current version)."""
    resp = fleet.admin().ListProxies(apb.ListRequest(), timeout=10)
    sims = [p for p in resp.proxies if p.info.name.startswith("sim-")]
    at = sum(1 for p in sims if p.acked_version == resp.current_version)
    return len(sims), at, int(resp.current_version)


def _wait_listed(fleet: Fleet, n: int, version: int, timeout: float) -> tuple[bool, float, int]:
    """Poll ListProxies until all n are at `version` or a later one, the
    control plane's current (a health write may number a newer table meanwhile:
    a CI run under load waited for the older one for ever): (converged, when,
    how many at it)."""
    deadline = time.monotonic() + timeout
    while True:
        listed, at, current = _list_proxies(fleet)
        ok = listed == n and at == n and current >= version
        if ok or time.monotonic() > deadline:
            return ok, time.time(), at
        time.sleep(0.05)


@contextlib.contextmanager
def _affinity(cpus: set[int] | None) -> Iterator[None]:
    """Run the block with this process on cpus (children started inside inherit)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    pin(os.getpid(), cpus)
    try:
        yield
    finally:
        pin(os.getpid(), before)


def run_one(params: Params, workdir: Path, quiet_ms: int, max_ms: int) -> dict[str, Any]:
    """One fresh fleet with one debounce setting; every process ends before returning."""
    pinned = params.pin and len(os.sched_getaffinity(0)) >= 2
    server = {SERVER_CORE} if pinned else None
    client = {CLIENT_CORE} if pinned else None
    workers = Workers()
    with Fleet(workdir) as fleet, _affinity(client):
        started = time.monotonic()
        with _affinity(server):  # etcd and the control plane inherit core 0
            fleet.start_etcd()
            fleet.start_control(
                CONTROL,
                extra=["--debounce-quiet-ms", str(quiet_ms), "--debounce-max-ms", str(max_ms)],
            )
        cp_pid = fleet.controls[CONTROL].proc.pid
        assert fleet.etcd is not None
        etcd_pid = fleet.etcd.managed.proc.pid
        if pinned:
            pin(etcd_pid, {params.etcd_core})
        fleet.start_origin("origin-sim", "us-east")
        n_origins = _topology(fleet, params.origins_per_region, fleet.origin_url("origin-sim"))
        fleet.table_version(origins=n_origins)
        table = fleet.admin().GetRouteTable(apb.ListRequest(), timeout=10).table
        mem_before = memory_mib(cp_pid)
        try:
            workers.start(
                _specs(params, fleet.controls[CONTROL].address, CLIENT_CORE if pinned else None)
            )
            readies = [m for m in workers.recv_all(120) if isinstance(m, Ready)]
            connected = sum(r.connected for r in readies)
            if connected != params.proxies:
                errors = sorted({e for r in readies for e in r.errors})
                raise RuntimeError(f"only {connected}/{params.proxies} proxies connected: {errors}")
            version = int(fleet.admin().GetRouteTable(apb.ListRequest(), timeout=10).table.version)
            ok, _, _ = _wait_listed(fleet, params.proxies, version, 60)
            if not ok:
                raise RuntimeError("ListProxies never showed every proxy at the current version")
            startup = time.monotonic() - started
            startup_quota = sum(r.quota_pushes for r in readies)

            # Idle cost with every stream open: keepalives, lease, health probes.
            pids = {"cp": cp_pid, "etcd": etcd_pid}
            pids.update({f"w{i}": p.pid or 0 for i, p in enumerate(workers.procs)})
            time.sleep(0.5)
            c0, w0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
            time.sleep(2.0)
            idle_window = time.monotonic() - w0
            idle = {k: (cpu_seconds(p) - c0[k]) / idle_window for k, p in pids.items()}
            mem_connected = memory_mib(cp_pid)

            cycles = [
                _cycle(fleet, workers, params, pids, idle, drained=(k % 2 == 0))
                for k in range(params.cycles)
            ]
            mem_after = memory_mib(cp_pid)
        finally:
            worker_errors = workers.close()
    lat = [c["_latencies"] for c in cycles]
    pooled = [x for cycle in lat for x in cycle]
    for c in cycles:
        del c["_latencies"]
    per_stream_kib = (mem_connected["VmRSS"] - mem_before["VmRSS"]) * 1024 / params.proxies
    return {
        "debounce_quiet_ms": quiet_ms,
        "debounce_max_ms": max_ms,
        "proxies": params.proxies,
        "worker_processes": len(workers.procs),
        "connections": params.proxies
        if not params.channels
        else params.channels * len(workers.procs),
        "pinned": pinned,
        "regions": len(table.regions),
        "origins": len(table.origins),
        "update_bytes": pb.RouteUpdate(table=table, nonce="control-1-000").ByteSize(),
        "startup_s": round(startup, 2),
        "startup_quota_pushes": startup_quota,
        "propagation_ms": _spread(pooled),
        "cycle_p99_ms_median": statistics.median(c["propagation_ms"]["p99"] for c in cycles),
        "all_received": all(c["received"] == params.proxies for c in cycles),
        "list_proxies_converged": all(c["list_proxies"]["converged"] for c in cycles),
        "idle_cpu_pct": {k: round(v * 100, 1) for k, v in idle.items()},
        "cpu_ms_per_push_median": {
            k: statistics.median(c["cpu_ms"][k] for c in cycles) for k in cycles[0]["cpu_ms"]
        },
        "cp_memory_mib": {
            "rss_before_proxies": mem_before["VmRSS"],
            "rss_connected": mem_connected["VmRSS"],
            "rss_after_cycles": mem_after["VmRSS"],
            "hwm": mem_after["VmHWM"],
            "kib_per_stream": round(per_stream_kib, 1),
        },
        "worker_errors": worker_errors,
        "cycles": cycles,
    }


def _cycle(
    fleet: Fleet,
    workers: Workers,
    params: Params,
    pids: dict[str, int],
    idle: dict[str, float],
    *,
    drained: bool,
) -> dict[str, Any]:
    admin = fleet.admin()
    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
    w0 = time.monotonic()
    t0 = time.time()
    admin.DrainRegion(apb.DrainRequest(name=WATCHED, drained=drained), timeout=10)
    call_s = time.time() - t0
    workers.send_all(Wait(drained, t0, params.cycle_timeout))
    dones = [m for m in workers.recv_all(params.cycle_timeout + 10) if isinstance(m, Done)]
    latencies = [x for d in dones for x in d.latencies if x is not None]
    versions = sorted({v for d in dones for v in d.versions})
    # Let the ACK writes finish inside the window; then the operator's view.
    time.sleep(max(0.0, w0 + max(params.window, time.monotonic() - w0 + 0.3) - time.monotonic()))
    window = time.monotonic() - w0
    cpu_ms = {
        k: round((cpu_seconds(p) - c0[k] - idle[k] * window) * 1e3, 1) for k, p in pids.items()
    }
    version = versions[-1] if versions else 0
    converged, when, at = _wait_listed(fleet, params.proxies, version, params.cycle_timeout)
    return {
        "drained": drained,
        "version": version,
        "versions_seen": versions,
        "drain_call_ms": round(call_s * 1e3, 2),
        "received": len(latencies),
        "failed": sum(d.failed for d in dones),
        "tables_received": sum(d.tables for d in dones),
        "quota_pushes_received": sum(d.quota_pushes for d in dones),
        "propagation_ms": _spread(latencies),
        "cpu_window_s": round(window, 3),
        "cpu_ms": cpu_ms,
        "list_proxies": {"converged": converged, "at_current": at, "seconds": round(when - t0, 3)},
        "_latencies": latencies,
    }


def run(params: Params, workdir: Path) -> list[dict[str, Any]]:
    results = []
    for i, (quiet_ms, max_ms) in enumerate(params.debounce):
        results.append(run_one(params, workdir / f"run-{i}", quiet_ms, max_ms))
    return results


# ---------------------------------------------------------------- report


def _ms(d: dict[str, float], key: str) -> str:
    return f"{d[key]:8.1f}" if key in d else "       -"


def print_report(results: Sequence[dict[str, Any]]) -> None:
    for r in results:
        print(
            f"## debounce quiet {r['debounce_quiet_ms']} ms / max {r['debounce_max_ms']} ms: "
            f"{r['proxies']} proxies over {r['connections']} connections in "
            f"{r['worker_processes']} processes; {r['regions']} regions, {r['origins']} origins, "
            f"{r['update_bytes']} B per push; pinned={r['pinned']}; startup {r['startup_s']} s "
            f"({r['startup_quota_pushes']} quota-only pushes meanwhile)"
        )
        print(
            "  cycle  drain    recv      min      p50      p99      max   tables  "
            "quota  cp ms  etcd ms  proxies ms  ListProxies"
        )
        for k, c in enumerate(r["cycles"]):
            p = c["propagation_ms"]
            cpu = c["cpu_ms"]
            proxies_ms = sum(v for key, v in cpu.items() if key.startswith("w"))
            lp = c["list_proxies"]
            print(
                f"  {k + 1:5d}  {'on ' if c['drained'] else 'off'}  {c['received']:6d} "
                f"{_ms(p, 'min')} {_ms(p, 'p50')} {_ms(p, 'p99')} {_ms(p, 'max')} "
                f"{c['tables_received']:8d} {c['quota_pushes_received']:6d} "
                f"{max(0, cpu['cp']):6.0f} {max(0, cpu['etcd']):8.0f} "
                f"{max(0, proxies_ms):11.0f}  {'ok' if lp['converged'] else 'NO'} "
                f"{lp['at_current']}/{r['proxies']} at +{lp['seconds']:.2f} s"
            )
        p = r["propagation_ms"]
        mem = r["cp_memory_mib"]
        print(
            f"  all    propagation p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms, "
            f"max {p['max']:.1f} ms (median of cycle p99s {r['cycle_p99_ms_median']:.1f} ms); "
            f"first proxy at {p['min']:.1f} ms (drain call, watch, "
            f"debounce, build), fan-out p99 - first = {p['p99'] - p['min']:.1f} ms"
        )
        print(
            f"  control plane: idle {r['idle_cpu_pct']['cp']}% CPU with all streams open, "
            f"{r['cpu_ms_per_push_median']['cp']:.0f} ms CPU per push incl. ACK writes; "
            f"RSS {mem['rss_before_proxies']:.0f} -> {mem['rss_connected']:.0f} MiB "
            f"({mem['kib_per_stream']} KiB/stream), {mem['rss_after_cycles']:.0f} MiB after "
            f"cycles, peak {mem['hwm']:.0f} MiB"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--proxies", type=int, default=1000)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--workers", type=int, default=1, help="simulated-proxy processes")
    p.add_argument("--channels", type=int, default=0, help="channels per worker (0: one per proxy)")
    p.add_argument(
        "--debounce",
        default="50:500,5:50",
        help="QUIET_MS:MAX_MS settings of the control plane, one fleet each",
    )
    p.add_argument("--quick", action="store_true", help="200 proxies, 2 cycles, one setting")
    p.add_argument("--etcd-core", type=int, default=SERVER_CORE, help="core for etcd when pinning")
    p.add_argument(
        "--ack-delay-ms",
        type=int,
        default=0,
        help="diagnostic: proxies hold each ACK back (separates push cost from ACK cost)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--out", type=Path, help=f"JSON report (default {DEFAULT_OUT}; none if --quick)")
    a = p.parse_args(argv)
    debounce = tuple(
        (int(q), int(m)) for q, m in (item.split(":") for item in a.debounce.split(","))
    )
    params = Params(
        proxies=200 if a.quick else a.proxies,
        cycles=2 if a.quick else a.cycles,
        workers=a.workers,
        channels=a.channels,
        debounce=debounce[:1] if a.quick else debounce,
        pin=not a.no_pin,
        etcd_core=a.etcd_core,
        ack_delay=a.ack_delay_ms / 1000,
    )
    out = a.out or (None if a.quick else DEFAULT_OUT)
    loadavg = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ponto-fanout-") as tmp:
        results = run(params, Path(tmp))
    print_report(results)
    print(f"total {time.monotonic() - started:.1f} s; load average before {loadavg[0]:.2f}")
    if out is not None:
        report = {
            "name": "fanout",
            "results": results,
            "params": {**asdict(params), "watched_region": WATCHED},
            "machine": {
                "cpus": os.cpu_count(),
                "loadavg_before": loadavg,
                "python": platform.python_version(),
                "grpcio": grpc.__version__,
            },
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
