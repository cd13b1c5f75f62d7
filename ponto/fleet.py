"""A whole Ponto system as local processes: etcd, control planes, origins, proxies.

Used by `ponto-demo`, the end-to-end tests and the benchmarks, so all three run
the system exactly as an operator would: real processes, real ports, state in a
real etcd, topology written through the Admin API.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ponto.devenv import (
    DevEnvError,
    Etcd,
    Managed,
    Redis,
    free_port,
    python_entry,
    spawn,
    start_etcd,
    start_redis,
)
from ponto.grpcconn import ClientOptions, admin_channel, read_secret
from ponto.pki import Bundle, make_bundle
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb


@dataclass(frozen=True)
class RegionDef:
    name: str
    latitude: float
    longitude: float


# Real cloud region locations, so distances and failover order look familiar.
DEMO_REGIONS = (
    RegionDef("us-east", 38.9, -77.4),  # N. Virginia
    RegionDef("eu-west", 53.3, -6.3),  # Dublin
    RegionDef("ap-southeast", 1.35, 103.8),  # Singapore
)
DEMO_MODELS = ("sim-small", "sim-large")


@dataclass(frozen=True)
class DemoUser:
    """A client the demo's GeoIP database places in `place`, at a documentation
    address (RFC 5737, so never anybody's real one), nearest `region`."""

    place: str
    address: str
    network: str
    latitude: float
    longitude: float
    country: str
    city: str
    region: str


DEMO_USERS = (
    DemoUser("Tokyo", "203.0.113.7", "203.0.113.0/24", 35.68, 139.69, "JP", "Tokyo",
             "ap-southeast"),
    DemoUser("Frankfurt", "198.51.100.7", "198.51.100.0/24", 50.11, 8.68, "DE", "Frankfurt",
             "eu-west"),
    DemoUser("Virginia", "192.0.2.7", "192.0.2.0/24", 39.04, -77.49, "US", "Ashburn",
             "us-east"),
)  # fmt: skip
# The demo's proxies believe X-Forwarded-For from here: curl on this machine
# then speaks for the users above.
DEMO_TRUSTED_PROXIES = "127.0.0.0/8,::1/128"
# How long a proxy may take to listen. A worker group starts in a few seconds
# on a quiet machine; on a loaded 2-core CI machine running two test processes
# (load average 16) one took over 30 s. A bound, not a wait: a proxy
# that listens sooner is returned sooner.
PROXY_READY_S = 60.0


@dataclass
class Fleet:
    """Owns every process it starts; stop() ends them all (also on errors)."""

    workdir: Path
    etcd: Etcd | None = None
    controls: dict[str, Managed] = field(default_factory=dict)
    origins: dict[str, Managed] = field(default_factory=dict)
    proxies: dict[str, Managed] = field(default_factory=dict)
    # Each region's shared cache (proxies started with --redis on its URL), by region.
    caches: dict[str, Redis] = field(default_factory=dict)
    # Mutual TLS and tokens between the planes, as in production (the demo
    # and the security tests); None runs them in plaintext without tokens.
    security: Bundle | None = None
    status_url: str = ""  # the control plane's status page, when it serves one
    # Each proxy's metrics port (--metrics-listen), by name: its /metrics, and
    # its /healthz with the state the public port's does not give.
    metrics_addresses: dict[str, str] = field(default_factory=dict)
    _channel: grpc.Channel | None = None
    _channel_to: str = ""
    # The etag of each table version wait_table returned: another replica
    # numbers the same content by the revision it read it at, which may be lower.
    _etags: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    def secure(self) -> Bundle:
        """Generate a throwaway CA, certificates and tokens; later starts use them."""
        if self.security is None:
            self.security = make_bundle(self.workdir / "pki")
        return self.security

    def admin_options(self) -> ClientOptions:
        b = self.security
        if b is None:
            return ClientOptions()
        return ClientOptions(
            b.ca,
            b.path("admin.crt"),
            b.path("admin.key"),
            read_secret(b.admin_token_file, "admin token"),
        )

    def _ready(self, name: str) -> Path:
        path = self.workdir / f"{name}.addr"
        path.unlink(missing_ok=True)
        return path

    # ------------------------------------------------------------ processes

    def start_etcd(self) -> Etcd:
        if self.etcd is not None and self.etcd.managed.alive():
            return self.etcd
        if self.etcd is not None:  # restart the same member on the same ports
            old = self.etcd
            self.etcd = start_etcd(
                self.workdir,
                data_dir=old.data_dir,
                client_port=old.client_port,
                peer_port=old.peer_port,
            )
        else:
            # A new etcd is a new fleet (a new fleet id): the proxies' state
            # directories an earlier run left in a reused workdir hold the old
            # fleet's table, after which they would refuse every table of
            # this one (dataplane.sync.holder).
            for stale in self.workdir.glob("*-state"):
                shutil.rmtree(stale, ignore_errors=True)
            self.etcd = start_etcd(self.workdir)
        return self.etcd

    def start_control(
        self, name: str = "control-1", listen: str = "127.0.0.1:0", extra: list[str] | None = None
    ) -> Managed:
        """Start a replica; restarting a known name reuses its address, as in production."""
        assert self.etcd is not None, "start etcd first"
        if name in self.controls and listen.endswith(":0"):
            listen = self.controls[name].address
        listen = _own_port(listen)
        ready = self._ready(name)
        security = self.security.control_args() if self.security else []
        argv = [*python_entry("controlplane"), "--etcd", self.etcd.url, "--listen", listen,
                "--id", name, "--ready-file", str(ready), *security, *(extra or [])]  # fmt: skip
        self.controls[name] = m = spawn(name, argv, self.workdir, ready_file=ready)
        return m

    def start_origin(
        self,
        name: str,
        region: str,
        *,
        listen: str = "127.0.0.1:0",
        ttft_ms: int = 0,
        tokens_per_s: int = 0,
        models: tuple[str, ...] = DEMO_MODELS,
        extra: list[str] | None = None,
    ) -> Managed:
        listen = _own_port(listen)
        ready = self._ready(name)
        argv = [*python_entry("ponto.originsim"), "--listen", listen, "--region", region,
                "--name", name, "--models", ",".join(models), "--ttft-ms", str(ttft_ms),
                "--tokens-per-s", str(tokens_per_s), "--ready-file", str(ready),
                *(extra or [])]  # fmt: skip
        self.origins[name] = m = spawn(name, argv, self.workdir, ready_file=ready)
        return m

    def start_proxy(
        self,
        name: str,
        region: str,
        *,
        listen: str = "127.0.0.1:0",
        control_planes: list[str] | None = None,
        workers: int = 1,
        extra: list[str] | None = None,
        wait: bool = True,
        launcher: Sequence[str] = (),
        ready_timeout: float = PROXY_READY_S,
        metrics_port: bool = True,
    ) -> Managed:
        """Start a proxy; one process unless `workers` > 1 (dataplane/workers.py),
        whatever the machine's cores, so that runs do not depend on the machine.
        Returned once it listens (within `ready_timeout` seconds), or at once
        without `wait` (its address unknown). `launcher` goes before the
        interpreter (bench/instructions.py runs the proxy under valgrind).
        Without `metrics_port` (and no --metrics-listen in `extra`) it serves
        /metrics on its public port, as a single-port proxy does, and
        proxy_status, metrics_url and wait_proxies_at cannot read it."""
        addresses = control_planes or [m.address for m in self.controls.values()]
        listen = _own_port(listen)
        ready = self._ready(name)
        extra = list(extra or [])
        # A metrics port of its own, where proxy_status reads its state (the
        # public /healthz says only "ok"), unless `extra` gives one. Key
        # labels stay off, as they were when /metrics was on the public port;
        # `extra` may turn them on.
        metrics = _flag_value(extra, "--metrics-listen")
        own_metrics: list[str] = []
        if metrics is None and metrics_port:
            metrics = _own_port("127.0.0.1:0")
            own_metrics = ["--metrics-listen", metrics, "--metrics-key-labels", "off"]
        argv = [*launcher, *python_entry("dataplane"), "--control-plane", ",".join(addresses),
                "--listen", listen, "--region", region, "--name", name,
                "--workers", str(workers),
                "--state-dir", str(self.workdir / f"{name}-state"),
                "--ready-file", str(ready), *own_metrics,
                *(self.security.proxy_args() if self.security else []), *extra]  # fmt: skip
        if metrics is not None:
            self.metrics_addresses[name] = metrics
        else:
            self.metrics_addresses.pop(name, None)
        self.proxies[name] = m = spawn(
            name, argv, self.workdir, ready_file=ready if wait else None, timeout=ready_timeout
        )
        return m

    def start_cache(self, region: str) -> Redis:
        """Start the region's shared cache, a redis-server named "redis-REGION"; a
        region that had one gets it back on the same port, empty (nothing persists)."""
        old = self.caches.get(region)
        self.caches[region] = server = start_redis(
            self.workdir, name=f"redis-{region}", port=old.port if old else 0
        )
        return server

    def members(self) -> dict[str, Managed]:
        """Every process of the fleet by name: etcd, control planes, origins, proxies,
        the regions' caches."""
        etcd = {self.etcd.managed.name: self.etcd.managed} if self.etcd else {}
        caches = {c.managed.name: c.managed for c in self.caches.values()}
        return {**etcd, **self.controls, **self.origins, **self.proxies, **caches}

    def restart(self, name: str) -> Managed:
        """Start a member again as it was; stop it first if it still runs.

        Same arguments and address (the port it had bound, so proxies, probes
        and clients find it where it was), same data and state dirs and
        certificates. Returns once it serves; raises DevEnvError if it cannot.
        """
        if self.etcd is not None and name == self.etcd.managed.name:
            self.etcd.managed.stop()
            return self.start_etcd().managed
        for region, cache in self.caches.items():
            if name == cache.managed.name:
                cache.stop()
                return self.start_cache(region).managed
        groups = [g for g in (self.controls, self.origins, self.proxies) if name in g]
        if not groups:
            raise KeyError(name)
        group = groups[0]
        old = group[name]
        old.stop()
        argv = list(old.argv)
        argv[argv.index("--listen") + 1] = old.address
        group[name] = m = spawn(name, argv, self.workdir, ready_file=self._ready(name))
        return m

    # ------------------------------------------------------------ admin

    def admin(self) -> admin_pb2_grpc.AdminStub:
        """A stub on a live replica (the most recently started one if none is alive)."""
        alive = [m for m in self.controls.values() if m.alive()] or list(self.controls.values())
        address = alive[-1].address
        if self._channel is None or self._channel_to != address:
            if self._channel is not None:
                self._channel.close()
            self._channel = admin_channel(address, self.admin_options())
            self._channel_to = address
        return admin_pb2_grpc.AdminStub(self._channel)

    def add_region(self, region: RegionDef) -> None:
        spec = apb.RegionSpec(
            name=region.name, latitude=region.latitude, longitude=region.longitude
        )
        self.admin().PutRegion(apb.PutRegionRequest(region=spec, allow_update=True), timeout=10)

    def add_origin(
        self,
        name: str,
        region: str,
        url: str,
        models: tuple[str, ...] = DEMO_MODELS,
        *,
        weight: int = 0,
        capacity: int = 0,
    ) -> None:
        spec = apb.OriginSpec(
            name=name,
            base_url=url,
            region=region,
            models=list(models),
            weight=weight,
            capacity=capacity,
        )
        self.admin().PutOrigin(apb.PutOriginRequest(origin=spec, allow_update=True), timeout=10)

    def wait_table(self, ready: Callable[[pb.RouteTable], bool], timeout: float = 10.0) -> int:
        """Version of the control plane's table once `ready(table)` holds."""
        deadline = time.monotonic() + timeout
        while True:
            table = self.admin().GetRouteTable(apb.ListRequest(), timeout=10).table
            if table.version and ready(table):
                self._etags[table.version] = table.etag
                return int(table.version)
            if time.monotonic() > deadline:
                raise DevEnvError(f"route table never became ready; last:\n{table}")
            time.sleep(0.02)

    def table_version(self, *, origins: int = 0) -> int:
        """Version of the table once it lists at least `origins` origins."""
        return self.wait_table(lambda t: len(t.origins) >= origins)

    # ------------------------------------------------------------ waiting

    def proxy_status(self, name: str) -> dict[str, object]:
        """The proxy's state, as its metrics port's /healthz gives it."""
        url = f"http://{self.metrics_addresses[name]}/healthz"
        with urllib.request.urlopen(url, timeout=5) as resp:
            status: dict[str, object] = json.loads(resp.read())
            return status

    def wait_proxies_at(self, version: int, timeout: float = 15.0) -> None:
        """Wait until every proxy serves a table of at least this version, or
        the same content (etag) as the version wait_table returned: a proxy
        on another replica may be given that content under a lower number."""
        deadline = time.monotonic() + timeout
        etag = self._etags.get(version, "")
        pending = set(self.proxies)
        while pending:
            for name in list(pending):
                with contextlib.suppress(OSError):
                    status = self.proxy_status(name)
                    served = status.get("route_table_version", 0)
                    newer = isinstance(served, int) and served >= version
                    if newer or (etag and status.get("route_table_etag") == etag):
                        pending.discard(name)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise DevEnvError(
                    f"proxies {sorted(pending)} not at version {version} (etag {etag[:12]}…); "
                    f"they serve: {self._served(pending)}"
                )
            time.sleep(0.05)

    def _served(self, names: set[str]) -> str:
        """What each of `names` serves, for a failed wait's message."""
        said = []
        for name in sorted(names):
            try:
                status = self.proxy_status(name)
                said.append(
                    f"{name}: version {status.get('route_table_version')} etag "
                    f"{str(status.get('route_table_etag'))[:12]}… "
                    f"(connected: {status.get('control_plane_connected')})"
                )
            except OSError as exc:
                said.append(f"{name}: {exc}")
        return "; ".join(said)

    def proxy_url(self, name: str) -> str:
        return f"http://{self.proxies[name].address}/v1"

    def metrics_url(self, name: str) -> str:
        """The proxy's /metrics, on its metrics port."""
        return f"http://{self.metrics_addresses[name]}/metrics"

    def origin_url(self, name: str) -> str:
        return f"http://{self.origins[name].address}/v1"

    # ------------------------------------------------------------ teardown

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for group in (self.proxies, self.controls, self.origins):
            for managed in group.values():
                with contextlib.suppress(Exception):
                    managed.stop()
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.stop()
        for cache in self.caches.values():
            with contextlib.suppress(Exception):
                cache.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _own_port(listen: str) -> str:
    """`listen` with port 0 on an IPv4 address made a free_port of its own:
    the kernel picks port 0's from its ephemeral range, where, while a member
    restarted on its address is down, an outgoing connection can take the
    port as its own (one to that very address can even connect to itself)
    and the member cannot bind it again (review 276)."""
    host, _, port = listen.rpartition(":")
    if port != "0" or not host or host.startswith("["):
        return listen
    return f"{host}:{free_port(host)}"


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value `argv` gives `flag` (``--flag V`` or ``--flag=V``; the last
    one, as argparse takes it), None without it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.removeprefix(flag + "=")
    return value


def write_demo_geoip(path: Path) -> Path:
    """The demo's GeoIP City database: each of DEMO_USERS' networks at its city."""
    from ponto.geodb import write_city_db  # noqa: PLC0415 - dev dependency, demo only

    entries = {u.network: (u.latitude, u.longitude, u.country, u.city) for u in DEMO_USERS}
    return write_city_db(path, entries)


# The demo's proxies: (name, region). The second us-east proxy is started only
# with a regional cache, which it shares with the first.
DEMO_PROXIES = (("proxy-us-east", "us-east"), ("proxy-eu-west", "eu-west"))
DEMO_SECOND_PROXY = ("proxy-us-east-2", "us-east")


def start_demo_fleet(
    workdir: Path,
    *,
    proxy_ports: tuple[int, int, int] = (0, 0, 0),
    control_port: int = 0,
    status_port: int = 0,
    secure: bool = True,
    regional_cache: bool = False,
) -> Fleet:
    """The demo topology: etcd, one control plane (its status page on
    `status_port`, any free one if 0), an origin per region, two proxies that
    route clients by the demo's GeoIP database. With `regional_cache`, a
    redis-server for each region with proxies and a second us-east proxy that
    shares the first's cache through it (needs redis-server)."""
    fleet = Fleet(workdir)
    fleet.status_url = f"http://127.0.0.1:{status_port or free_port()}"
    try:
        geo = [
            "--geoip-db", str(write_demo_geoip(workdir / "demo-geoip.mmdb")),
            "--trusted-proxies", DEMO_TRUSTED_PROXIES,
        ]  # fmt: skip
        if secure:
            fleet.secure()
        fleet.start_etcd()
        fleet.start_control(
            listen=f"127.0.0.1:{control_port}",
            # Drains from the page on: it is on loopback, where the token
            # crossing plain HTTP is no exposure.
            extra=[
                "--http-listen",
                fleet.status_url.removeprefix("http://"),
                "--http-writes",
                "on",
            ],
        )
        for region in DEMO_REGIONS:
            fleet.add_region(region)
            origin = f"origin-{region.name}"
            # Answers end by themselves after 24 tokens, as a model's do, so a
            # request with a larger max_tokens gets a whole answer the cache keeps.
            # Responses are stored, as on a vLLM replica with its store on,
            # so a follow-up (previous_response_id) has its earlier turns.
            fleet.start_origin(
                origin,
                region.name,
                ttft_ms=40,
                tokens_per_s=200,
                extra=["--answer-tokens", "24", "--store-responses", "1000"],
            )
            fleet.add_origin(origin, region.name, fleet.origin_url(origin))
        version = fleet.table_version(origins=len(DEMO_REGIONS))
        proxies = list(DEMO_PROXIES)
        if regional_cache:
            proxies.append(DEMO_SECOND_PROXY)
            for region_name in dict.fromkeys(region for _, region in proxies):
                fleet.start_cache(region_name)
        for (name, region_name), port in zip(proxies, proxy_ports, strict=False):
            cache = fleet.caches.get(region_name)
            # The access log goes to the proxy's log file with its other output.
            fleet.start_proxy(
                name,
                region_name,
                listen=f"127.0.0.1:{port}",
                extra=[*geo, "--access-log", "on", *(["--redis", cache.url] if cache else [])],
            )
        fleet.wait_proxies_at(version)
    except BaseException:
        fleet.stop()
        raise
    return fleet
